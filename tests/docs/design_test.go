// Package docs_test keeps docs/DESIGN.md and the subsystem pages under docs/design/
// honest about the code: every `path.go:Name` or `path.go:Type.method` they name must
// exist and declare that function, method or top-level name, and DESIGN.md's numbered
// lists of checkpoint and restore steps must name the methods of checkpointSteps and
// restoreSteps (internal/state), in their order, with their FailStep numbers. DESIGN.md
// stays a 20-minute read (maxDesignBytes), and the relative links of the docs (README.md,
// docs/*.md, docs/design/*.md) lead to a file that exists and, with #anchor, to one of
// its headings. It parses Go source only (go/parser): no root, no daemon.
package docs_test

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

const designDoc = "docs/DESIGN.md"

// designPages are the subsystem pages, each checked as DESIGN.md is for its references.
const designPages = "docs/design/*.md"

// maxDesignBytes bounds DESIGN.md: the map, the step lists, the invariants, the lock
// order and the limits fit in it; a subsystem's detail goes to its page (issue 25).
const maxDesignBytes = 25_000

// The step lists: the section of DESIGN.md that holds each, and the table in the code.
var stepLists = []struct {
	heading  string // the section's heading line
	file     string // the Go file declaring the table (relative to the repository)
	variable string // the table: a slice literal of steps whose run is a method expression
}{
	{"## The path of a checkpoint", "internal/state/checkpoint.go", "checkpointSteps"},
	{"## The path of a restore", "internal/state/restore.go", "restoreSteps"},
}

// refRE finds a Go file of the repository, optionally followed by :Name or :Type.method.
var refRE = regexp.MustCompile(`\b((?:cmd|internal|tests)/[A-Za-z0-9_./-]+\.go)(?::([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?))?`)

// itemRE is the start of a numbered list item.
var itemRE = regexp.MustCompile(`^(\d+)\. `)

func TestDesignNamesExist(t *testing.T) {
	root, doc := readDesign(t)
	refs, problems := checkRefs(root, designDoc, doc)
	for _, p := range problems {
		t.Error(p)
	}
	if refs < 20 {
		t.Errorf("%s names only %d Go files or declarations: is refRE still finding them?", designDoc, refs)
	}
}

// Every subsystem page is checked the same way.
func TestDesignPagesNamesExist(t *testing.T) {
	root, _ := readDesign(t)
	pages := readPages(t, root)
	if len(pages) < 5 {
		t.Fatalf("%s matches %d pages: have they moved?", designPages, len(pages))
	}
	total := 0
	for _, name := range sortedKeys(pages) {
		refs, problems := checkRefs(root, name, pages[name])
		for _, p := range problems {
			t.Error(p)
		}
		total += refs
	}
	if total < 50 {
		t.Errorf("%s name only %d Go files or declarations together: is refRE still finding them?", designPages, total)
	}
}

func TestDesignIsA20MinuteRead(t *testing.T) {
	_, doc := readDesign(t)
	if p := checkSize(doc); p != "" {
		t.Error(p)
	}
}

// Links between the docs, README.md's to DESIGN.md's sections and the subsystem pages
// included, still lead somewhere after a section moves.
func TestDocLinksResolve(t *testing.T) {
	root, _ := readDesign(t)
	docs := readLinkedDocs(t, root)
	n, problems := checkLinks(root, docs)
	for _, p := range problems {
		t.Error(p)
	}
	if n < 20 {
		t.Errorf("found only %d relative links in the docs: is linkRE still finding them?", n)
	}
}

func TestDesignStepsFollowTheCode(t *testing.T) {
	root, doc := readDesign(t)
	for _, p := range checkSteps(root, doc) {
		t.Error(p)
	}
}

// The checks catch what they are for: a name that does not exist, steps out of order, a
// step missing, a file that does not exist.
func TestDesignChecksCatchMistakes(t *testing.T) {
	root, doc := readDesign(t)
	section := func(heading string) (int, int) {
		i := strings.Index(doc, heading)
		j := strings.Index(doc[i+len(heading):], "\n## ")
		return i, i + len(heading) + j
	}
	mutate := func(heading string, f func(string) string) string {
		i, j := section(heading)
		return doc[:i] + f(doc[i:j]) + doc[j:]
	}
	ckpt, rest := stepLists[0].heading, stepLists[1].heading
	for _, c := range []struct {
		name, doc, want string
	}{
		{"a method that does not exist", strings.Replace(doc, "internal/state/checkpoint.go:checkpoint.seize",
			"internal/state/checkpoint.go:checkpoint.seizeAll", 1), "declares no checkpoint.seizeAll"},
		{"a function that does not exist", strings.Replace(doc, "internal/fastpath/atomic.go:EndLive",
			"internal/fastpath/atomic.go:EndAll", 1), "declares no EndAll"},
		{"a file that does not exist", strings.Replace(doc, "internal/store/freeze.go:Store.Freeze",
			"internal/store/frozen.go:Store.Freeze", 1), "internal/store/frozen.go"},
		{"two checkpoint steps swapped", mutate(ckpt, func(s string) string {
			s = strings.Replace(s, "checkpoint.go:checkpoint.fork", "checkpoint.go:checkpoint.SWAP", 1)
			s = strings.Replace(s, "checkpoint.go:checkpoint.kill", "checkpoint.go:checkpoint.fork", 1)
			return strings.Replace(s, "checkpoint.go:checkpoint.SWAP", "checkpoint.go:checkpoint.kill", 1)
		}), "step 2 names checkpoint.kill, the code's step 2 is checkpoint.fork"},
		{"a restore step left out", mutate(rest, func(s string) string {
			i := strings.Index(s, "\n7. ")
			j := strings.Index(s[i+1:], "\n\n") + i + 1
			return s[:i] + s[j:]
		}), "lists 6 steps, the code has 7"},
		{"a restore step misnumbered", mutate(rest, func(s string) string {
			return strings.Replace(s, "\n5. **install**", "\n6. **install**", 1)
		}), "item 5 is numbered 6"},
	} {
		_, problems := checkRefs(root, designDoc, c.doc)
		problems = append(problems, checkSteps(root, c.doc)...)
		if c.doc == doc {
			t.Errorf("%s: the mutation changed nothing (DESIGN.md changed?)", c.name)
			continue
		}
		if !strings.Contains(strings.Join(problems, "\n"), c.want) {
			t.Errorf("%s: no problem says %q; got:\n%s", c.name, c.want, strings.Join(problems, "\n"))
		}
	}
}

// The page, size and link checks catch what they are for too.
func TestDocChecksCatchMistakes(t *testing.T) {
	root, doc := readDesign(t)
	pages := readPages(t, root)
	page, text := "", ""
	for _, name := range sortedKeys(pages) {
		if m := refRE.FindStringSubmatch(pages[name]); m != nil && m[2] != "" {
			page, text = name, pages[name]
			break
		}
	}
	if page == "" {
		t.Fatalf("no page under %s names a file.go:Name", designPages)
	}
	m := refRE.FindString(text)
	_, problems := checkRefs(root, page, strings.Replace(text, m, m+"Gone", 1))
	if want := "declares no"; !strings.Contains(strings.Join(problems, "\n"), want) {
		t.Errorf("a name that does not exist in %s (%s): no problem says %q; got %q", page, m+"Gone", want, problems)
	}

	if p := checkSize(doc + strings.Repeat("x", maxDesignBytes)); !strings.Contains(p, "KB") {
		t.Errorf("a DESIGN.md past %d bytes: no problem reported (got %q)", maxDesignBytes, p)
	}

	for _, c := range []struct{ name, link, want string }{
		{"a page that does not exist", "[x](design/gone.md)", "docs/design/gone.md"},
		{"a section that does not exist", "[x](design/restarts.md#no-such-heading)", "no heading"},
		{"a section of this page that does not exist", "[x](#no-such-heading)", "no heading"},
	} {
		docs := map[string]string{designDoc: doc + "\n" + c.link + "\n"}
		for k, v := range pages {
			docs[k] = v
		}
		_, problems := checkLinks(root, docs)
		if !strings.Contains(strings.Join(problems, "\n"), c.want) {
			t.Errorf("%s: no problem says %q; got %q", c.name, c.want, problems)
		}
	}
}

// readDesign returns the repository's root and DESIGN.md.
func readDesign(t *testing.T) (string, string) {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			break
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no go.mod above the test's directory")
		}
		dir = parent
	}
	b, err := os.ReadFile(filepath.Join(dir, designDoc))
	if err != nil {
		t.Fatal(err)
	}
	return dir, string(b)
}

// readPages returns the subsystem pages by path (relative to the repository).
func readPages(t *testing.T, root string) map[string]string {
	t.Helper()
	paths, err := filepath.Glob(filepath.Join(root, designPages))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(root, p)
		out[filepath.ToSlash(rel)] = string(b)
	}
	return out
}

// readLinkedDocs returns README.md, docs/*.md and docs/design/*.md by path.
func readLinkedDocs(t *testing.T, root string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, pat := range []string{"README.md", "docs/*.md", designPages} {
		paths, err := filepath.Glob(filepath.Join(root, pat))
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range paths {
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			rel, _ := filepath.Rel(root, p)
			out[filepath.ToSlash(rel)] = string(b)
		}
	}
	if len(out) < 5 {
		t.Fatalf("found %d docs: has the layout changed?", len(out))
	}
	return out
}

func sortedKeys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// checkSize says what is wrong with DESIGN.md's size, or "".
func checkSize(doc string) string {
	if len(doc) <= maxDesignBytes {
		return ""
	}
	return fmt.Sprintf("%s is %.1f KB, past %.0f KB: move a subsystem's detail to its page under docs/design/ and leave a line and a link",
		designDoc, float64(len(doc))/1000, float64(maxDesignBytes)/1000)
}

// linkRE finds a markdown link's target: [text](target). Targets with a scheme are not
// checked (no network here).
var linkRE = regexp.MustCompile(`\]\(([^()\s]+)\)`)

// checkLinks checks every relative link of docs (path -> text): its file exists
// (relative to the linking file), and its #anchor, if any, is a heading of the target
// (GitHub's anchors). It returns how many links it checked and what is wrong.
func checkLinks(root string, docs map[string]string) (int, []string) {
	var problems []string
	n := 0
	for _, from := range sortedKeys(docs) {
		for _, m := range linkRE.FindAllStringSubmatch(stripCode(docs[from]), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			n++
			file, anchor, _ := strings.Cut(target, "#")
			path := from
			if file != "" {
				path = filepath.ToSlash(filepath.Join(filepath.Dir(from), file))
			}
			text, ok := docs[path]
			if !ok {
				if _, err := os.Stat(filepath.Join(root, path)); err != nil {
					problems = append(problems, fmt.Sprintf("%s links to %s: %s does not exist", from, target, path))
					continue
				}
			}
			if anchor == "" || !strings.HasSuffix(path, ".md") {
				continue
			}
			if !ok {
				b, err := os.ReadFile(filepath.Join(root, path))
				if err != nil {
					problems = append(problems, fmt.Sprintf("%s links to %s: %v", from, target, err))
					continue
				}
				text = string(b)
			}
			if !anchors(text)[anchor] {
				problems = append(problems, fmt.Sprintf("%s links to %s: %s has no heading whose anchor is #%s", from, target, path, anchor))
			}
		}
	}
	return n, problems
}

// stripCode blanks fenced code blocks and inline code spans, where a `](` is not a link.
func stripCode(s string) string {
	var b strings.Builder
	fenced := false
	for _, line := range strings.SplitAfter(s, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			b.WriteString("\n")
			continue
		}
		if fenced {
			b.WriteString("\n")
			continue
		}
		b.WriteString(codeSpanRE.ReplaceAllString(line, "``"))
	}
	return b.String()
}

var codeSpanRE = regexp.MustCompile("`[^`]*`")

// anchors returns the anchors GitHub makes for text's headings: lower case, spaces to
// hyphens, every other character but letters, digits, '-' and '_' dropped; a repeated
// anchor gets -1, -2...
func anchors(text string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for _, line := range strings.Split(stripFences(text), "\n") {
		m := headingRE.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		var b strings.Builder
		for _, r := range strings.ToLower(strings.TrimSpace(m[1])) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				b.WriteRune(r)
			}
		}
		a := b.String()
		if k := seen[a]; k > 0 {
			out[fmt.Sprintf("%s-%d", a, k)] = true
		} else {
			out[a] = true
		}
		seen[a]++
	}
	return out
}

// headingRE is an ATX heading: 1 to 6 '#', a space, its text.
var headingRE = regexp.MustCompile(`^#{1,6} (.+)$`)

// stripFences blanks fenced code blocks (a `#` there is no heading).
func stripFences(s string) string {
	var b strings.Builder
	fenced := false
	for _, line := range strings.SplitAfter(s, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
		}
		if fenced || strings.HasPrefix(strings.TrimSpace(line), "```") {
			b.WriteString("\n")
			continue
		}
		b.WriteString(line)
	}
	return b.String()
}

// parsed caches parsed files by path.
var parsed = map[string]*ast.File{}

func parseFile(root, path string) (*ast.File, error) {
	if f, ok := parsed[path]; ok {
		return f, nil
	}
	f, err := parser.ParseFile(token.NewFileSet(), filepath.Join(root, path), nil, parser.SkipObjectResolution)
	if err != nil {
		return nil, err
	}
	parsed[path] = f
	return f, nil
}

// checkRefs checks every Go file doc (the file named name) names, and the name after it
// if any; it returns how many references it found and what is wrong.
func checkRefs(root, name, doc string) (int, []string) {
	docName := name
	var problems []string
	ms := refRE.FindAllStringSubmatch(doc, -1)
	for _, m := range ms {
		path, name := m[1], m[2]
		f, err := parseFile(root, path)
		if err != nil {
			problems = append(problems, fmt.Sprintf("%s names %s: %v", docName, m[0], err))
			continue
		}
		if name != "" && !declares(f, name) {
			problems = append(problems, fmt.Sprintf("%s names %s, but %s declares no %s", docName, m[0], path, name))
		}
	}
	return len(ms), problems
}

// declares reports whether f declares name: Type.method (a method of Type or *Type), or a
// function, type, variable or constant at the top level.
func declares(f *ast.File, name string) bool {
	typ, method, isMethod := strings.Cut(name, ".")
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if isMethod {
				if d.Recv != nil && recvType(d.Recv.List[0].Type) == typ && d.Name.Name == method {
					return true
				}
			} else if d.Recv == nil && d.Name.Name == name {
				return true
			}
		case *ast.GenDecl:
			if isMethod {
				continue
			}
			for _, s := range d.Specs {
				switch s := s.(type) {
				case *ast.TypeSpec:
					if s.Name.Name == name {
						return true
					}
				case *ast.ValueSpec:
					for _, n := range s.Names {
						if n.Name == name {
							return true
						}
					}
				}
			}
		}
	}
	return false
}

// recvType is the type name of a receiver: T, *T, T[P], *T[P].
func recvType(e ast.Expr) string {
	switch x := e.(type) {
	case *ast.StarExpr:
		return recvType(x.X)
	case *ast.IndexExpr:
		return recvType(x.X)
	case *ast.IndexListExpr:
		return recvType(x.X)
	case *ast.Ident:
		return x.Name
	}
	return ""
}

// codeSteps returns the methods of the step table variable in file, in order, as
// "Type.method" (each element's method expression, (*Type).method).
func codeSteps(root, file, variable string) ([]string, error) {
	f, err := parseFile(root, file)
	if err != nil {
		return nil, err
	}
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.VAR {
			continue
		}
		for _, s := range g.Specs {
			vs := s.(*ast.ValueSpec)
			for i, n := range vs.Names {
				if n.Name != variable || i >= len(vs.Values) {
					continue
				}
				lit, ok := vs.Values[i].(*ast.CompositeLit)
				if !ok {
					return nil, fmt.Errorf("%s: %s is not a composite literal", file, variable)
				}
				var out []string
				for k, el := range lit.Elts {
					m := methodExpr(el)
					if m == "" {
						return nil, fmt.Errorf("%s: element %d of %s has no method expression", file, k+1, variable)
					}
					out = append(out, m)
				}
				return out, nil
			}
		}
	}
	return nil, fmt.Errorf("%s declares no variable %s", file, variable)
}

// methodExpr finds the method expression ((*T).m or T.m) among a step literal's fields.
func methodExpr(el ast.Expr) string {
	lit, ok := el.(*ast.CompositeLit)
	if !ok {
		return ""
	}
	for _, f := range lit.Elts {
		if kv, ok := f.(*ast.KeyValueExpr); ok {
			f = kv.Value
		}
		sel, ok := f.(*ast.SelectorExpr)
		if !ok {
			continue
		}
		x := sel.X
		if p, ok := x.(*ast.ParenExpr); ok {
			x = p.X
		}
		if typ := recvType(x); typ != "" {
			return typ + "." + sel.Sel.Name
		}
	}
	return ""
}

// docSteps returns, for each numbered item of the section under heading, its number and
// the first `file:Type.method` it names ("" if none).
func docSteps(doc, heading, file string) (nums []int, names []string, err error) {
	i := strings.Index(doc, "\n"+heading+"\n")
	if i < 0 {
		return nil, nil, fmt.Errorf("%s has no section %q", designDoc, heading)
	}
	sec := doc[i+len(heading)+2:]
	if j := strings.Index(sec, "\n## "); j >= 0 {
		sec = sec[:j]
	}
	var items []string
	for _, line := range strings.Split(sec, "\n") {
		if m := itemRE.FindStringSubmatch(line); m != nil {
			n, _ := strconv.Atoi(m[1])
			nums = append(nums, n)
			items = append(items, line)
		} else if len(items) > 0 && strings.HasPrefix(line, "   ") {
			items[len(items)-1] += " " + strings.TrimSpace(line)
		}
	}
	for _, it := range items {
		name := ""
		for _, m := range refRE.FindAllStringSubmatch(it, -1) {
			if m[1] == file && strings.Contains(m[2], ".") {
				name = m[2]
				break
			}
		}
		names = append(names, name)
	}
	return nums, names, nil
}

// checkSteps compares each step list of doc with its table in the code.
func checkSteps(root, doc string) []string {
	var problems []string
	for _, l := range stepLists {
		want, err := codeSteps(root, l.file, l.variable)
		if err != nil {
			problems = append(problems, err.Error())
			continue
		}
		nums, got, err := docSteps(doc, l.heading, l.file)
		if err != nil {
			problems = append(problems, err.Error())
			continue
		}
		where := fmt.Sprintf("%s, %q", designDoc, l.heading)
		if len(got) != len(want) {
			problems = append(problems, fmt.Sprintf("%s lists %d steps, the code has %d (%s in %s: %s)",
				where, len(got), len(want), l.variable, l.file, strings.Join(want, ", ")))
		}
		for k := range got {
			if nums[k] != k+1 {
				problems = append(problems, fmt.Sprintf("%s: item %d is numbered %d (FailStep numbers run 1, 2, ...)", where, k+1, nums[k]))
			}
			switch {
			case got[k] == "":
				problems = append(problems, fmt.Sprintf("%s: step %d names no %s:Type.method", where, k+1, l.file))
			case k < len(want) && got[k] != want[k]:
				problems = append(problems, fmt.Sprintf("%s: step %d names %s, the code's step %d is %s (%s in %s)",
					where, k+1, got[k], k+1, want[k], l.variable, l.file))
			}
		}
	}
	return problems
}
