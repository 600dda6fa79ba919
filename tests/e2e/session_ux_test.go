package e2e

import (
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/apitypes"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// sessRunRC runs code in a session and returns its output and exit code.
func sessRunRC(t *testing.T, d *testutil.Daemon, id, sess, code string) (string, int) {
	t.Helper()
	r, err := d.C.Run(dbxCtx(t), id, sess, code, 30*time.Second)
	if err != nil {
		t.Fatalf("%s: %q: %v", sess, code, err)
	}
	if r.SessionRestarted {
		t.Fatalf("%s: %q: the session was restarted (an earlier call ended it)", sess, code)
	}
	return r.Stdout, r.ExitCode
}

// TestBashSessionExitEndsTheCallNotTheShell: `exit N`, `set -e` and a failing command,
// and errexit inside a function end the call with that status; the shell, its PID and
// its variables live on. Subshells and command substitutions still exit as in any shell.
// A shell that ends all the same (builtin exit, exec CMD) answers with its status. On
// main the shell exited and the call failed ("session main ended during the call
// (terminal closed)").
func TestBashSessionExitEndsTheCallNotTheShell(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "bx")
	pid := sessRun(t, d, "bx", "main", "V=kept; echo $$")
	for _, c := range []struct {
		code, out string
		rc        int
	}{
		{"echo hi; exit 3; echo after", "hi\n", 3},
		{"echo -n no-newline; exit 4", "no-newline", 4},
		{"false; exit", "", 1},
		{"exit", "", 0},
		{"exit 300", "", 44},
		{"exit nope", "bash: exit: nope: numeric argument required\n", 2},
		{"for i in 1 2; do f() { exit 7; }; f; done; echo after", "", 7},
		{"x=$(exit 4); echo sub $?; (exit 5); echo sub $?", "sub 4\nsub 5\n", 0},
		{"set -e; echo one; false; echo after", "one\n", 1},
		{"case $- in *e*) echo errexit stays on;; esac; false; echo after", "errexit stays on\n", 1},
		{"g() { false; echo after; }; g", "", 1},
		{"if false; then :; fi; false || true; echo errexit spares conditions", "errexit spares conditions\n", 0},
		{"set +e; false; echo errexit off", "errexit off\n", 0},
		// A SIGINT trap of the user's own is put back after an exit ended the call.
		{"trap 'echo trapped' INT; exit 6", "", 6},
		{"trap -p INT", "trap -- 'echo trapped' SIGINT\n", 0},
		{"trap - INT; echo $V $$", "kept " + strings.TrimSpace(pid) + "\n", 0},
	} {
		out, rc := sessRunRC(t, d, "bx", "main", c.code)
		if out != c.out || rc != c.rc {
			t.Fatalf("%q: got %q exit %d, want %q exit %d", c.code, out, rc, c.out, c.rc)
		}
	}
	// exec with redirections only changes the shell's descriptors, for good, as in any
	// shell; the end of each call still reaches the session (it printed its end marker on
	// stdout: into the file, and the call hung until its timeout).
	sessRunWant(t, d, "bx", "main", "exec 3>&1 >/tmp/out.log", "", 0)
	sessRunWant(t, d, "bx", "main", "echo into the log", "", 0)
	sessRunWant(t, d, "bx", "main", "exec >&3 3>&-; cat /tmp/out.log", "into the log\n", 0)
	// A command that ends the shell itself is still answered with its status; the next
	// call starts a new shell and says so.
	r, err := d.C.Run(dbxCtx(t), "bx", "main", "echo bye; builtin exit 9", 30*time.Second)
	if err != nil || r.ExitCode != 9 || !strings.HasPrefix(r.Stdout, "bye\n") || !strings.Contains(r.Stdout, "exited with status 9") {
		t.Fatalf("builtin exit: %+v %v", r, err)
	}
	r, err = d.C.Run(dbxCtx(t), "bx", "main", "echo ${V:-fresh}", 30*time.Second)
	if err != nil || !r.SessionRestarted || r.Stdout != "fresh\n" || r.ExitCode != 0 {
		t.Fatalf("after the shell exited: %+v %v", r, err)
	}
	if out, rc := sessRunRC(t, d, "bx", "main", "exec true"); rc != 0 || !strings.Contains(out, "exited with status 0") {
		t.Fatalf("exec true: %q exit %d", out, rc)
	}
}

// TestPythonSessionProcessExitReturnsStatus: os._exit ends the interpreter; the call
// answers with its status, and the next call starts it afresh. On main the call failed
// ("session py ended during the call (terminal closed)").
func TestPythonSessionProcessExitReturnsStatus(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "px")
	if _, err := d.C.StartSession(dbxCtx(t), "px", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	if out, rc := sessRunRC(t, d, "px", "py", "import sys\nx = 1\nsys.exit(2)"); out != "" || rc != 2 {
		t.Fatalf("sys.exit(2): %q exit %d", out, rc)
	}
	r, err := d.C.Run(dbxCtx(t), "px", "py", "import os\nprint('bye', flush=True)\nos._exit(3)", 30*time.Second)
	if err != nil || r.ExitCode != 3 || !strings.HasPrefix(r.Stdout, "bye\n") {
		t.Fatalf("os._exit(3): %+v %v", r, err)
	}
	r, err = d.C.Run(dbxCtx(t), "px", "py", "'x' in globals()", 30*time.Second)
	if err != nil || !r.SessionRestarted || r.Stdout != "False\n" {
		t.Fatalf("after os._exit: %+v %v", r, err)
	}
}

// sessionCallP50 times n calls of code in a session as the client sees them.
func sessionCallP50(t *testing.T, d *testutil.Daemon, id, sess, code string, n int) time.Duration {
	t.Helper()
	var ds []time.Duration
	for i := 0; i < n; i++ {
		start := time.Now()
		sessRunWant(t, d, id, sess, code, "", 0)
		ds = append(ds, time.Since(start))
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	return ds[len(ds)/2]
}

// TestBashSessionCallIsAsFastAsPython: a trivial bash session call costs about what a
// python one does (it decodes its code without a subshell or a base64 process). On main
// a bash call of `true` took 30-50 ms, a python one under 1 ms.
func TestBashSessionCallIsAsFastAsPython(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "fast")
	if _, err := d.C.StartSession(dbxCtx(t), "fast", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessionCallP50(t, d, "fast", "main", "true", 5) // starts it
	bash := sessionCallP50(t, d, "fast", "main", "true", 41)
	py := sessionCallP50(t, d, "fast", "py", "pass", 41)
	t.Logf("call p50: bash %v, python %v", bash, py)
	// Generous for a loaded 2-core machine: the target (2 ms) is checked by the bench.
	if bash > py+5*time.Millisecond {
		t.Fatalf("bash session call p50 %v, python %v: want bash within 5 ms of python", bash, py)
	}
	// The encoding carries every character a call can hold (NUL aside: JSON carries
	// valid UTF-8, and no bash string holds a NUL) through the terminal.
	var all strings.Builder
	for c := 1; c < 128; c++ {
		all.WriteByte(byte(c))
	}
	all.WriteString("é€😀")
	code := "printf %s " + shellQuote(all.String()) + " | od -An -v -tx1 | tr -d ' \\n'"
	var want strings.Builder
	for _, c := range []byte(all.String()) {
		fmt.Fprintf(&want, "%02x", c)
	}
	if out := sessRun(t, d, "fast", "main", code); out != want.String() {
		t.Fatalf("characters through a call:\n got %s\nwant %s", out, want.String())
	}
	// History expansion cannot touch a call's code; a long one spans several lines.
	if out := sessRun(t, d, "fast", "main", "set -H; echo '!!' \"a!b\" \\!x; printf %s "+shellQuote(strings.Repeat("é'!\\", 3000))+" | wc -c"); out != "!! a!b !x\n15000\n" {
		t.Fatalf("history expansion or a long call: %q", out)
	}
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

var droppedRE = regexp.MustCompile(`\[deltabox: output truncated: ([0-9]+) bytes dropped here; kept the first ([0-9]+) and the last ([0-9]+) of ([0-9]+) bytes\]`)

// TestSessionOutputKeepsTheTail: a call's output over the limit keeps its head and its
// tail (where a test summary is), and the marker says exactly how much was dropped. On
// main the head was kept, the tail lost, and the count was of a buffer already capped.
func TestSessionOutputKeepsTheTail(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "tail")
	if _, err := d.C.StartSession(dbxCtx(t), "tail", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	// 3 MiB of numbered lines, then a summary line.
	const lines = 3 << 20 / 16
	for _, c := range []struct{ sess, code string }{
		{"main", fmt.Sprintf(`for ((i=0; i<%d; i++)); do printf '%%015d\n' $i; done; echo SUMMARY: 3 passed`, lines)},
		{"py", fmt.Sprintf("import sys\nfor i in range(%d): sys.stdout.write('%%015d\\n' %% i)\nprint('SUMMARY: 3 passed')", lines)},
	} {
		r, err := d.C.Run(dbxCtx(t), "tail", c.sess, c.code, 2*time.Minute)
		if err != nil || r.ExitCode != 0 {
			t.Fatalf("%s: %+v %v", c.sess, r, err)
		}
		total := lines*16 + len("SUMMARY: 3 passed\n")
		if !r.StdoutTruncated || !strings.HasSuffix(r.Stdout, "SUMMARY: 3 passed\n") || !strings.HasPrefix(r.Stdout, "000000000000000\n") {
			t.Fatalf("%s: truncated %v, %d bytes, head %q, tail %q", c.sess, r.StdoutTruncated, len(r.Stdout), r.Stdout[:min(40, len(r.Stdout))], r.Stdout[max(0, len(r.Stdout)-40):])
		}
		m := droppedRE.FindStringSubmatch(r.Stdout)
		if m == nil {
			t.Fatalf("%s: no truncation marker in %d bytes", c.sess, len(r.Stdout))
		}
		n := func(i int) int { v, _ := strconv.Atoi(m[i]); return v }
		dropped, head, tail, all := n(1), n(2), n(3), n(4)
		if all != total || dropped+head+tail != total || head+tail > 1<<20 || tail < 1<<19 {
			t.Fatalf("%s: marker %q: want %d bytes in all, dropped+head+tail = all, at most 1 MiB kept, most of it the tail", c.sess, m[0], total)
		}
		if len(r.Stdout) != head+tail+len(m[0])+2 {
			t.Fatalf("%s: %d bytes of output, marker says %d kept", c.sess, len(r.Stdout), head+tail)
		}
		// What is kept is the output's own bytes: the line before the summary is the last one.
		if !strings.HasSuffix(r.Stdout, fmt.Sprintf("%015d\nSUMMARY: 3 passed\n", lines-1)) {
			t.Fatalf("%s: the tail is not the output's end: %q", c.sess, r.Stdout[len(r.Stdout)-60:])
		}
	}
	// A limit set by the call applies the same way.
	r, err := d.C.Exec(dbxCtx(t), "tail", api.ExecRequest{Argv: []string{"seq 1 100000"}, Session: "main", OutputLimit: 1000})
	if err != nil || !r.StdoutTruncated || !strings.HasSuffix(r.Stdout, "\n99999\n100000\n") || !strings.HasPrefix(r.Stdout, "1\n2\n") {
		t.Fatalf("output_limit 1000: %+v %v", r, err)
	}
}

// TestCommandSessionLogsSurviveCheckpoint: what a command session printed before a
// checkpoint is still in its logs after it, and after a restore to it.
func TestCommandSessionLogsSurviveCheckpoint(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "lg")
	if _, err := d.C.StartSession(dbxCtx(t), "lg", state.SessionOptions{Name: "job", Argv: []string{"python3", "-u", "-c",
		"import time, os\nprint('started', flush=True)\nwhile not os.path.exists('/tmp/go'): time.sleep(0.02)\nprint('went on', flush=True)\ntime.sleep(1000)"}}); err != nil {
		t.Fatal(err)
	}
	waitLogs := func(want string) string {
		t.Helper()
		var logs string
		for i := 0; i < 250; i++ {
			var err error
			if logs, err = d.C.SessionLogs(dbxCtx(t), "lg", "job"); err != nil {
				t.Fatal(err)
			}
			if strings.Contains(logs, want) {
				return logs
			}
			time.Sleep(20 * time.Millisecond)
		}
		l, _ := d.C.Sessions(dbxCtx(t), "lg")
		t.Fatalf("session logs %q, want %q (sessions %+v)", logs, want, l)
		return ""
	}
	waitLogs("started")
	n := dbxCheckpoint(t, d, "lg", "started")
	if n.Processes != 1 {
		t.Fatalf("checkpoint took %d processes, want the job (%v)", n.Processes, n.ProcessErrors)
	}
	if logs := waitLogs("started"); strings.Contains(logs, "went on") {
		t.Fatalf("logs after the checkpoint: %q", logs)
	}
	sessRun(t, d, "lg", "main", "touch /tmp/go")
	if logs := waitLogs("went on"); !strings.Contains(logs, "started") {
		t.Fatalf("logs lost what came before the checkpoint: %q", logs)
	}
	dbxRestore(t, d, "lg", n.Node.ID)
	if logs := waitLogs("started"); strings.Contains(logs, "went on") {
		t.Fatalf("logs after a restore to the node: %q, want what the job had printed by then", logs)
	}
}

// TestSessionStartRelativeDir: a session's relative dir is resolved against the
// sandbox's workdir, as exec's is. On main it was refused.
func TestSessionStartRelativeDir(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "rel")
	sessRun(t, d, "rel", "main", "mkdir -p sub/dir")
	for _, k := range []string{"bash", "python"} {
		if _, err := d.C.StartSession(dbxCtx(t), "rel", state.SessionOptions{Name: "s" + k, Kind: apitypes.SessionKind(k), Dir: "sub/dir"}); err != nil {
			t.Fatalf("%s session in a relative dir: %v", k, err)
		}
	}
	if out := sessRun(t, d, "rel", "sbash", "pwd"); out != "/workspace/sub/dir\n" {
		t.Fatalf("bash session cwd %q", out)
	}
	if out := sessRun(t, d, "rel", "spython", "import os\nos.getcwd()"); out != "'/workspace/sub/dir'\n" {
		t.Fatalf("python session cwd %q", out)
	}
	r := dbxExec(t, d, "rel", api.ExecRequest{Argv: []string{"pwd"}, Dir: "sub/dir"})
	if r.Stdout != "/workspace/sub/dir\n" {
		t.Fatalf("exec cwd %q", r.Stdout)
	}
}
