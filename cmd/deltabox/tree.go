package main

import (
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"deltabox/internal/apitypes"
)

func treeCmd() *cobra.Command {
	var htmlFile, root, sandbox string
	c := &cobra.Command{
		Use:   "tree [--html FILE [--root NODE] [--sandbox ID]]",
		Short: "Print the snapshot tree and where each sandbox stands",
		Long: `Print the snapshot tree and where each sandbox stands.

With --html FILE, write the daemon's page of the tree instead (GET /v1/tree/page: the
tree drawn with each node's figures, one self-contained HTML file without scripts), for a
browser: --root NODE for that node's subtree, --sandbox ID to draw its path thick.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if htmlFile != "" {
				page, err := cli().TreePage(ctx(), root, sandbox)
				if err != nil {
					return err
				}
				return os.WriteFile(htmlFile, page, 0o644)
			}
			if root != "" || sandbox != "" {
				return fmt.Errorf("--root and --sandbox choose what --html FILE shows: add --html FILE")
			}
			t, err := cli().Tree(ctx())
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(t)
				return nil
			}
			printTree(t)
			sbs, err := cli().List(ctx())
			if err != nil {
				return err
			}
			printSandboxPaths(t, sbs)
			return nil
		},
	}
	c.Flags().StringVar(&htmlFile, "html", "", "write the tree as an HTML page to this file")
	c.Flags().StringVar(&root, "root", "", "with --html: only this node's subtree")
	c.Flags().StringVar(&sandbox, "sandbox", "", "with --html: draw the path to this sandbox's node thick")
	var unpin bool
	pin := &cobra.Command{
		Use:   "pin NODE [--unpin]",
		Short: "Pin a node you will restore again: its templates are never evicted over the template budget",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			n, err := cli().PinNode(ctx(), args[0], !unpin)
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(n)
			} else if n.Pinned {
				fmt.Printf("pinned %s\n", n.ID)
			} else {
				fmt.Printf("unpinned %s\n", n.ID)
			}
			return nil
		},
	}
	pin.Flags().BoolVar(&unpin, "unpin", false, "unpin it instead")
	c.AddCommand(pin)
	c.AddCommand(&cobra.Command{
		Use:   "rm NODE",
		Short: "Remove a node and its subtree (refused while a sandbox stands in it)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			removed, err := cli().RemoveNode(ctx(), args[0])
			if err != nil {
				return err
			}
			fmt.Printf("removed %d node(s): %s\n", len(removed), strings.Join(removed, " "))
			return nil
		},
	})
	return c
}

func printTree(t *apitypes.Tree) {
	byID := map[string]*apitypes.NodeInfo{}
	images := map[string][]string{}
	for _, n := range t.Nodes {
		byID[n.ID] = n
		if n.Parent == "" {
			images[n.Image] = append(images[n.Image], n.ID)
		}
	}
	for im := range t.OnImage {
		if _, ok := images[im]; !ok {
			images[im] = nil
		}
	}
	var names []string
	for im := range images {
		names = append(names, im)
	}
	sort.Strings(names)
	var walk func(id, prefix string, last bool)
	walk = func(id, prefix string, last bool) {
		n := byID[id]
		branch, next := "├── ", "│   "
		if last {
			branch, next = "└── ", "    "
		}
		size := "no change"
		if n.Own {
			size = humanBytes(n.Bytes)
		}
		line := fmt.Sprintf("%s%s%s  %s  %s", prefix, branch, n.ID, n.Created.Local().Format(time.TimeOnly), size)
		if n.Label != "" {
			line += fmt.Sprintf("  %q", n.Label)
		}
		if !n.Durable {
			line += "  (not yet durable)"
		}
		if n.Pinned {
			line += "  (pinned)"
		}
		if tp := n.Templates; tp != nil && tp.Processes > 0 {
			who := append([]string(nil), tp.Sessions...)
			if n := tp.Processes - len(tp.Sessions); n > 0 {
				who = append(who, fmt.Sprintf("%d background", n)) // processes outside sessions
			}
			line += fmt.Sprintf("  [%s: %s private]", strings.Join(who, ","), humanBytes(tp.PrivateDirty))
		}
		if len(n.Sandboxes) > 0 {
			line += "  <- " + strings.Join(n.Sandboxes, ", ")
		}
		fmt.Println(line)
		for i, c := range n.Children {
			walk(c, prefix+next, i == len(n.Children)-1)
		}
	}
	if len(names) == 0 {
		fmt.Println("(no nodes and no sandboxes)")
	}
	for _, im := range names {
		line := "image " + im
		if sbs := t.OnImage[im]; len(sbs) > 0 {
			line += "  <- " + strings.Join(sbs, ", ")
		}
		fmt.Println(line)
		roots := images[im]
		for i, r := range roots {
			walk(r, "", i == len(roots)-1)
		}
	}
}

// printSandboxPaths prints, per sandbox, its checkpoints and restores per path and what
// its process templates cost, then the daemon's total.
func printSandboxPaths(t *apitypes.Tree, sbs []*apitypes.SandboxInfo) {
	if len(sbs) == 0 {
		return
	}
	fmt.Println()
	for _, sb := range sbs {
		st := sb.Stats
		fmt.Printf("%s  checkpoints %s  restores %s\n", sb.ID, pathCounts(st.CheckpointPaths), pathCounts(st.RestorePaths))
		if tp := sb.Templates; tp != nil && tp.Processes > 0 && sb.TemplateBudgetMB > 0 {
			// Templates have a budget of their own (docs/API.md, Template memory).
			fmt.Printf("%s  templates %d: private dirty %s, anonymous PSS %s of its %s template budget\n", strings.Repeat(" ", len(sb.ID)), tp.Processes, humanBytes(tp.PrivateDirty), humanBytes(tp.PssAnon), humanBytes(sb.TemplateBudgetMB<<20))
		} else if tp != nil && tp.Processes > 0 {
			// Without one they count against the sandbox's memory limit.
			fmt.Printf("%s  templates %d: private dirty %s, PSS %s of its %s memory limit\n", strings.Repeat(" ", len(sb.ID)), tp.Processes, humanBytes(tp.PrivateDirty), humanBytes(tp.Pss), humanBytes(sb.Limits.MemoryBytes))
		}
	}
	if tp := t.Templates; tp != nil && tp.Processes > 0 {
		fmt.Printf("templates (all sandboxes): %d, private dirty %s, PSS %s\n", tp.Processes, humanBytes(tp.PrivateDirty), humanBytes(tp.Pss))
	}
}

// pathCounts is "N (process P, files only F: why...)[, failed X]".
func pathCounts(c apitypes.PathCounts) string {
	s := fmt.Sprintf("%d (process %d, files only %d", c.Process+c.FilesOnly, c.Process, c.FilesOnly)
	var why []string
	for _, r := range []struct {
		n    int
		what string
	}{{c.FastPathOff, "fast path off"}, {c.NoSessions, "no process state"}, {c.OtherSandbox, "other sandbox"}} {
		if r.n > 0 {
			why = append(why, fmt.Sprintf("%s %d", r.what, r.n))
		}
	}
	if len(why) > 0 {
		s += ": " + strings.Join(why, ", ")
	}
	s += ")"
	if c.Failed > 0 {
		s += fmt.Sprintf(", failed %d", c.Failed)
		if c.Ineligible > 0 {
			s += fmt.Sprintf(" (ineligible %d)", c.Ineligible)
		}
		if c.TemplateGone > 0 {
			s += fmt.Sprintf(" (template gone %d)", c.TemplateGone)
		}
	}
	return s
}
