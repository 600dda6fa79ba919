// Package e2e holds DeltaBox's end-to-end tests: each starts a real daemon on a private
// test store (internal/testutil) and drives it through its API, as an agent would.
// They need root and a machine prepared by scripts/setup.sh; elsewhere they skip
// (and fail under CI=true).
//
// Helpers shared by the files of this package are prefixed dbx.
package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/sandbox"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// ---- shared helpers ----

// dbxCtx is a context bounded well under the suite's budget, so a hang fails one test
// with a message instead of the whole run at go test's timeout.
func dbxCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// dbxCreate creates a sandbox (id "" lets the daemon choose) and returns its info.
func dbxCreate(t *testing.T, d *testutil.Daemon, id string) *state.SandboxInfo {
	t.Helper()
	in, err := d.C.Create(dbxCtx(t), state.CreateOptions{ID: id})
	if err != nil {
		t.Fatalf("create sandbox %q: %v", id, err)
	}
	return in
}

// dbxExec runs r and fails the test if the daemon refuses it.
func dbxExec(t *testing.T, d *testutil.Daemon, id string, r api.ExecRequest) *sandbox.ExecResult {
	t.Helper()
	if r.TimeoutMS == 0 {
		r.TimeoutMS = 30_000
	}
	res, err := d.C.Exec(dbxCtx(t), id, r)
	if err != nil {
		t.Fatalf("exec %q in %s: %v", r.Argv, id, err)
	}
	return res
}

// dbxSh runs a bash script and requires exit code 0; it returns stdout.
func dbxSh(t *testing.T, d *testutil.Daemon, id, script string) string {
	t.Helper()
	res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", script}})
	if res.ExitCode != 0 || res.TimedOut {
		t.Fatalf("bash -c %q in %s: exit %d (timed out %v)\nstdout: %s\nstderr: %s",
			script, id, res.ExitCode, res.TimedOut, res.Stdout, res.Stderr)
	}
	return res.Stdout
}

// dbxCheckpoint checkpoints and fails the test on error. A checkpoint that answered
// early (its node pending) is waited for, by a read of its node: tests look at the
// host (stopped templates, layers on disk) right after, which no call of theirs orders
// after the checkpoint's end.
func dbxCheckpoint(t *testing.T, d *testutil.Daemon, id, label string) *state.OpResult {
	t.Helper()
	r, err := d.C.Checkpoint(dbxCtx(t), id, label)
	if err != nil {
		t.Fatalf("checkpoint %s (%s): %v", id, label, err)
	}
	if r.Node == nil || r.Node.ID == "" {
		t.Fatalf("checkpoint %s (%s) returned no node: %+v", id, label, r)
	}
	if r.Node.Pending {
		if n, err := d.C.Node(dbxCtx(t), r.Node.ID); err != nil || n.Pending {
			t.Fatalf("checkpoint %s (%s): node %s after its early answer: %+v, %v", id, label, r.Node.ID, n, err)
		}
	}
	return r
}

// dbxRestore restores and fails the test on error.
func dbxRestore(t *testing.T, d *testutil.Daemon, id, node string) *state.OpResult {
	t.Helper()
	r, err := d.C.Restore(dbxCtx(t), id, node)
	if err != nil {
		t.Fatalf("restore %s to %s: %v", id, node, err)
	}
	return r
}

// dbxCgroupDir finds the sandbox's cgroup2 directory the way an operator would: the
// sandbox cgroup under /sys/fs/cgroup/unified/deltabox* whose cgroup.procs holds the
// init's pid.
func dbxCgroupDir(t *testing.T, initPid int) string {
	t.Helper()
	if initPid <= 0 {
		t.Fatalf("sandbox has no init pid (%d)", initPid)
	}
	// init's own v2 group, from /proc (not a walk of every store's groups: thousands
	// on a machine that ran the suites for long, seconds to read, and a 1.5 s exec was
	// over before the walk was: "still 1 processes after 10s").
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", initPid))
	if err != nil {
		t.Fatalf("init pid %d: %v", initPid, err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if rel, ok := strings.CutPrefix(l, "0::"); ok && strings.HasPrefix(rel, "/deltabox") {
			return filepath.Join("/sys/fs/cgroup/unified", rel)
		}
	}
	t.Fatalf("init pid %d is in no cgroup under /sys/fs/cgroup/unified/deltabox*: %s", initPid, b)
	return ""
}

func dbxReadPids(procsFile string) []int {
	b, err := os.ReadFile(procsFile)
	if err != nil {
		return nil
	}
	var out []int
	for _, f := range strings.Fields(string(b)) {
		if p, err := strconv.Atoi(f); err == nil {
			out = append(out, p)
		}
	}
	return out
}

// dbxSandboxPids returns the host pids in the sandbox's cgroup (init included).
func dbxSandboxPids(t *testing.T, d *testutil.Daemon, id string) (initPid int, pids []int) {
	t.Helper()
	in, err := d.C.Get(dbxCtx(t), id)
	if err != nil {
		t.Fatalf("get %s: %v", id, err)
	}
	dir := dbxCgroupDir(t, in.InitPid)
	return in.InitPid, dbxReadPids(filepath.Join(dir, "cgroup.procs"))
}

// dbxWaitOnlyInit waits up to wait for the sandbox's cgroup to hold init alone, and
// fails naming what is left.
func dbxWaitOnlyInit(t *testing.T, d *testutil.Daemon, id string, wait time.Duration) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for {
		initPid, pids := dbxSandboxPids(t, d, id)
		if len(pids) == 1 && pids[0] == initPid {
			return
		}
		if time.Now().After(deadline) {
			var desc []string
			for _, p := range pids {
				cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p))
				desc = append(desc, fmt.Sprintf("%d:%q", p, strings.ReplaceAll(string(cmd), "\x00", " ")))
			}
			t.Fatalf("sandbox %s: %v after the command ended, want only init (pid %d); processes: %s",
				id, wait, initPid, strings.Join(desc, ", "))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// dbxWaitProcs waits until the sandbox's cgroup holds at least n processes (an exec
// started from another goroutine is really running).
func dbxWaitProcs(t *testing.T, d *testutil.Daemon, id string, n int) {
	t.Helper()
	// The cgroup is read directly, not through GET /v1/sandboxes/ID each time: on a
	// loaded machine that call came back after a 1.5 s exec had ended (CI saw 1 process).
	in, err := d.C.Get(dbxCtx(t), id)
	if err != nil {
		t.Fatalf("get %s: %v", id, err)
	}
	procs := filepath.Join(dbxCgroupDir(t, in.InitPid), "cgroup.procs")
	deadline := time.Now().Add(10 * time.Second)
	for {
		pids := dbxReadPids(procs)
		if len(pids) >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox %s: still %d processes after 10s, want >= %d", id, len(pids), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// dbxRaw sends one raw HTTP request to the daemon's unix socket (path after /v1)
// and returns the status and the body.
func dbxRaw(t *testing.T, d *testutil.Daemon, method, path, body string) (int, []byte) {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var nd net.Dialer
			return nd.DialContext(ctx, "unix", d.Socket)
		},
		DisableKeepAlives: true,
	}}
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(dbxCtx(t), method, "http://deltabox/"+api.Version+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b
}

// dbxErrorBody checks that body is exactly {"error":{"code":C,"message":M}} with
// non-empty strings and returns code and message.
func dbxErrorBody(t *testing.T, body []byte) (code, message string) {
	t.Helper()
	var top map[string]json.RawMessage
	if err := json.Unmarshal(body, &top); err != nil {
		t.Fatalf("error body is not a JSON object: %v: %s", err, body)
	}
	if len(top) != 1 || top["error"] == nil {
		t.Fatalf(`error body has keys %v, want exactly "error": %s`, dbxKeys(top), body)
	}
	var inner map[string]any
	if err := json.Unmarshal(top["error"], &inner); err != nil {
		t.Fatalf(`"error" is not an object: %v: %s`, err, body)
	}
	c, ok1 := inner["code"].(string)
	m, ok2 := inner["message"].(string)
	if len(inner) != 2 || !ok1 || !ok2 || c == "" || m == "" {
		t.Fatalf(`"error" must be {"code": string, "message": string}, non-empty: %s`, body)
	}
	return c, m
}

func dbxKeys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// ---- exec ----

// TestExecBasics covers what one command sees and returns, in one sandbox.
func TestExecBasics(t *testing.T) {
	d := testutil.StartDaemon(t)
	sb := dbxCreate(t, d, "exec-basics")
	id := sb.ID

	t.Run("StdoutStderrApart", func(t *testing.T) {
		res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c",
			"echo out1; echo err1 >&2; echo out2; echo err2 >&2"}})
		if res.Stdout != "out1\nout2\n" || res.Stderr != "err1\nerr2\n" {
			t.Fatalf("stdout %q stderr %q, want %q and %q", res.Stdout, res.Stderr, "out1\nout2\n", "err1\nerr2\n")
		}
		if res.StdoutTruncated || res.StderrTruncated || res.TimedOut {
			t.Fatalf("unexpected flags: %+v", res)
		}
	})

	// Arguments as long as the kernel's exec takes (each under 128 KiB, 600 KB in all)
	// reach the command; more than the daemon carries is refused saying what to do.
	// The init socket's default send buffer (208 KiB) refused 300 KB with "message too
	// long" before the daemon raised it.
	t.Run("LongArgv", func(t *testing.T) {
		arg := strings.Repeat("a", 100_000)
		argv := []string{"bash", "-c", `n=0; for a; do n=$((n+${#a})); done; echo $# $n`, "x"}
		for range 6 {
			argv = append(argv, arg)
		}
		res, err := d.C.Exec(dbxCtx(t), id, api.ExecRequest{Argv: argv})
		if err != nil {
			t.Fatalf("6 arguments of 100 KB: %.300s", err)
		}
		if res.ExitCode != 0 || res.Stdout != "6 600000\n" {
			t.Fatalf("6 arguments of 100 KB: exit %d, stdout %q, stderr %q; want 6 600000", res.ExitCode, res.Stdout, res.Stderr)
		}
		for range 6 {
			argv = append(argv, arg)
		}
		_, err = d.C.Exec(dbxCtx(t), id, api.ExecRequest{Argv: argv})
		if err == nil || !strings.Contains(err.Error(), "stdin or in a file") {
			t.Errorf("1.2 MB of arguments: err %.300v, want a refusal saying to pass it on stdin or in a file", err)
		}
	})

	t.Run("ExitCode", func(t *testing.T) {
		for _, c := range []struct {
			script string
			code   int
			sig    int
		}{{"exit 0", 0, 0}, {"exit 7", 7, 0}, {"exit 255", 255, 0}, {"false", 1, 0}, {"kill -KILL $$", -1, 9}} {
			res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", c.script}})
			if res.ExitCode != c.code || res.Signal != c.sig {
				t.Errorf("%q: exit %d signal %d, want %d and %d", c.script, res.ExitCode, res.Signal, c.code, c.sig)
			}
		}
		// A command that does not exist is refused with a message, not run.
		_, err := d.C.Exec(dbxCtx(t), id, api.ExecRequest{Argv: []string{"no-such-command-xyz"}})
		if err == nil || !strings.Contains(err.Error(), "not found") {
			t.Errorf("exec of a missing command: err %v, want one saying it was not found", err)
		}
	})

	t.Run("Duration", func(t *testing.T) {
		start := time.Now()
		res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"sleep", "0.3"}})
		wall := time.Since(start)
		if res.Duration < 300*time.Millisecond || res.Duration > wall {
			t.Fatalf("duration %v (duration_ms %v) for sleep 0.3, want >= 300ms and <= the call's %v",
				res.Duration, res.DurationMS, wall)
		}
		fast := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"true"}})
		if fast.DurationMS <= 0 || fast.Duration >= 300*time.Millisecond {
			t.Fatalf("duration of true: %v (duration_ms %v), want > 0 and well under 300ms", fast.Duration, fast.DurationMS)
		}
	})

	t.Run("Workdir", func(t *testing.T) {
		if got := dbxSh(t, d, id, "pwd"); got != "/workspace\n" {
			t.Fatalf("default workdir %q, want /workspace", got)
		}
		res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"pwd"}, Dir: "/etc"})
		if res.Stdout != "/etc\n" {
			t.Fatalf("dir /etc: pwd says %q", res.Stdout)
		}
		dbxSh(t, d, id, "mkdir -p /workspace/sub/dir")
		res = dbxExec(t, d, id, api.ExecRequest{Argv: []string{"pwd"}, Dir: "sub/dir"})
		if res.Stdout != "/workspace/sub/dir\n" {
			t.Fatalf("relative dir sub/dir: pwd says %q, want /workspace/sub/dir", res.Stdout)
		}
		_, err := d.C.Exec(dbxCtx(t), id, api.ExecRequest{Argv: []string{"pwd"}, Dir: "/no/such/dir"})
		if err == nil || !strings.Contains(err.Error(), "/no/such/dir") {
			t.Fatalf("missing dir: err %v, want an error naming the directory", err)
		}
	})

	t.Run("Env", func(t *testing.T) {
		res := dbxExec(t, d, id, api.ExecRequest{
			Argv: []string{"bash", "-c", `printf '%s|%s|%s|%s' "$FOO" "$EMPTY" "$HOME" "$PATH"`},
			Env:  []string{"FOO=bar baz=qux", "EMPTY=", "HOME=/tmp/home"},
		})
		want := "bar baz=qux||/tmp/home|/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
		if res.Stdout != want {
			t.Fatalf("env: got %q, want %q (request env passed, later entries override defaults)", res.Stdout, want)
		}
		// Nothing of the daemon's environment leaks in.
		res = dbxExec(t, d, id, api.ExecRequest{Argv: []string{"env"}})
		for _, l := range strings.Split(strings.TrimSpace(res.Stdout), "\n") {
			k, _, _ := strings.Cut(l, "=")
			switch k {
			case "PATH", "HOME", "LANG", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "HOSTNAME", "PWD", "SHLVL", "_":
			default:
				t.Errorf("unexpected variable in a command's environment: %q", l)
			}
		}
	})

	t.Run("Stdin", func(t *testing.T) {
		res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"cat"}, Stdin: "hello\nworld\n"})
		if res.Stdout != "hello\nworld\n" {
			t.Fatalf("cat of stdin: %q", res.Stdout)
		}
		// More than a pipe buffer (64 KiB): the stdin writer must not deadlock with the readers.
		big := strings.Repeat("0123456789abcdef", 32<<10) // 512 KiB
		res = dbxExec(t, d, id, api.ExecRequest{Argv: []string{"sha256sum"}, Stdin: big})
		want := dbxSh(t, d, id, fmt.Sprintf("printf '0123456789abcdef%%.0s' $(seq %d) | sha256sum", 32<<10))
		if res.Stdout != want {
			t.Fatalf("512 KiB of stdin: sha256 %q, want %q", res.Stdout, want)
		}
		// No stdin: the command reads EOF at once instead of hanging.
		res = dbxExec(t, d, id, api.ExecRequest{Argv: []string{"wc", "-c"}, TimeoutMS: 5000})
		if strings.TrimSpace(res.Stdout) != "0" || res.TimedOut {
			t.Fatalf("wc -c with no stdin: %q (timed out %v)", res.Stdout, res.TimedOut)
		}
	})

	t.Run("Hostname", func(t *testing.T) {
		host, _ := os.Hostname()
		got := strings.TrimSpace(dbxSh(t, d, id, "cat /proc/sys/kernel/hostname; uname -n"))
		if got != id+"\n"+id {
			t.Fatalf("hostname in the sandbox %q, want the sandbox id %q twice (host is %q)", got, id, host)
		}
	})

	t.Run("LoopbackOnly", func(t *testing.T) {
		const script = `
import errno, socket, time
print("ifaces", ",".join(sorted(n for _, n in socket.if_nameindex())))
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(10)
t0 = time.monotonic()
try:
    s.connect(("1.1.1.1", 80))
    print("connect connected")
except OSError as e:
    print("connect", errno.errorcode.get(e.errno, str(e.errno)))
print("elapsed %.3f" % (time.monotonic() - t0))
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(1)
c = socket.create_connection(l.getsockname(), timeout=5)
a, _ = l.accept(); c.sendall(b"ping"); print("loopback", a.recv(4).decode())
`
		res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"python3", "-c", script}})
		if res.ExitCode != 0 {
			t.Fatalf("python: exit %d: %s", res.ExitCode, res.Stderr)
		}
		lines := map[string]string{}
		for _, l := range strings.Split(strings.TrimSpace(res.Stdout), "\n") {
			k, v, _ := strings.Cut(l, " ")
			lines[k] = v
		}
		if lines["ifaces"] != "lo" {
			t.Errorf("network interfaces %q, want only lo", lines["ifaces"])
		}
		if lines["connect"] != "ENETUNREACH" {
			t.Errorf("connect to 1.1.1.1:80: %q, want ENETUNREACH", lines["connect"])
		}
		if el, err := strconv.ParseFloat(lines["elapsed"], 64); err != nil || el > 1 {
			t.Errorf("connect took %q s, want it to fail at once (< 1s)", lines["elapsed"])
		}
		if lines["loopback"] != "ping" {
			t.Errorf("loopback round trip: %q, want ping", lines["loopback"])
		}
	})

	t.Run("PIDNamespace", func(t *testing.T) {
		out := dbxSh(t, d, id, `echo $$; tr '\0' ' ' </proc/1/cmdline; echo; ls -d /proc/[0-9]* | wc -l`)
		f := strings.Split(strings.TrimSpace(out), "\n")
		if len(f) != 3 {
			t.Fatalf("unexpected output %q", out)
		}
		pid, err := strconv.Atoi(f[0])
		if err != nil || pid <= 1 || pid > 1000 {
			t.Errorf("the command sees itself as pid %q, want a small pid of the sandbox's namespace", f[0])
		}
		if hostPid := sb.InitPid; pid == hostPid {
			t.Errorf("the command's pid %d equals the init's host pid", pid)
		}
		if !strings.Contains(f[1], "deltabox-init") {
			t.Errorf("/proc/1/cmdline is %q, want the sandbox init (deltabox-init)", f[1])
		}
		// init, bash, ls (and wc): nothing of the host is visible.
		if n, _ := strconv.Atoi(strings.TrimSpace(f[2])); n < 2 || n > 5 {
			t.Errorf("%s processes visible in /proc, want the sandbox's few (init, bash, ls, wc)", f[2])
		}
	})

	t.Run("TmpDirsRollBack", func(t *testing.T) {
		const files = "/tmp/f /var/tmp/f /dev/shm/f"
		n0 := dbxCheckpoint(t, d, id, "before-tmp").Node.ID
		dbxSh(t, d, id, "for f in "+files+"; do echo one > $f; done")
		n1 := dbxCheckpoint(t, d, id, "tmp-one").Node.ID
		dbxSh(t, d, id, "for f in "+files+"; do echo two > $f; echo x > $f.2; done")
		if got := dbxSh(t, d, id, "cat "+files+" /dev/shm/f.2"); got != "two\ntwo\ntwo\nx\n" {
			t.Fatalf("after the writes: %q", got)
		}
		dbxRestore(t, d, id, n1)
		if got := dbxSh(t, d, id, "cat "+files+"; ls /tmp/f.2 /var/tmp/f.2 /dev/shm/f.2 2>/dev/null | wc -l"); got != "one\none\none\n0\n" {
			t.Fatalf("after restore to %s: %q, want the checkpoint's contents and no later files", n1, got)
		}
		dbxRestore(t, d, id, n0)
		if got := dbxSh(t, d, id, "ls -A /tmp /var/tmp /dev/shm | grep -c '^f' || true"); got != "0\n" {
			t.Fatalf("after restore to %s (before any write): %q files named f* remain in /tmp, /var/tmp, /dev/shm", n0, got)
		}
		// /dev/shm is a directory of the state (not a tmpfs shared across states).
		if got := dbxSh(t, d, id, "ls -A /dev/shm | wc -l"); got != "0\n" {
			t.Fatalf("/dev/shm not empty after restore: %q", got)
		}
	})
}

// TestExecTimeout: a timed-out command and everything it started are killed, the
// call returns promptly, and the sandbox goes on working.
func TestExecTimeout(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "").ID
	start := time.Now()
	res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", "sleep 1000 & sleep 1000"}, TimeoutMS: 500})
	wall := time.Since(start)
	if wall > 2*time.Second {
		t.Errorf("a 500ms timeout returned after %v, want within ~2s", wall)
	}
	if wall < 500*time.Millisecond {
		t.Errorf("returned after %v, before the 500ms timeout", wall)
	}
	if !res.TimedOut {
		t.Errorf("timed_out is false: %+v", res)
	}
	if !strings.Contains(res.Stderr, "timed out") {
		t.Errorf("stderr %q has no timeout marker", res.Stderr)
	}
	if res.ExitCode != -1 || res.Signal != 9 {
		t.Errorf("exit %d signal %d, want -1 and SIGKILL (9)", res.ExitCode, res.Signal)
	}
	// The background sleep was in the command's process group: it must be gone too.
	dbxWaitOnlyInit(t, d, id, 500*time.Millisecond)
	if got := dbxSh(t, d, id, "echo still-works"); got != "still-works\n" {
		t.Fatalf("after a timeout: %q", got)
	}
	// And a command within its timeout is not marked.
	res = dbxExec(t, d, id, api.ExecRequest{Argv: []string{"sleep", "0.1"}, TimeoutMS: 5000})
	if res.TimedOut || res.ExitCode != 0 || strings.Contains(res.Stderr, "timed out") {
		t.Fatalf("sleep 0.1 with a 5s timeout: %+v", res)
	}
}

// TestExecTimeoutEndsWhatItStarted: a timeout or a cancelled call ends every process
// the command started, also those that left its session and process group (setsid)
// and a fork loop racing the kill; a normal exit leaves what it started in the
// background running, and a later exec's timeout does not touch it.
func TestExecTimeoutEndsWhatItStarted(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "").ID

	res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", "setsid sleep 1000 & sleep 100"}, TimeoutMS: 2000})
	if !res.TimedOut {
		t.Fatalf("not timed out: %+v", res)
	}
	dbxWaitOnlyInit(t, d, id, 2*time.Second)

	// A loop that keeps starting new sessions while the kill runs.
	res = dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", "while :; do setsid sleep 1000 & done"}, TimeoutMS: 1000})
	if !res.TimedOut {
		t.Fatalf("fork loop not timed out: %+v", res)
	}
	dbxWaitOnlyInit(t, d, id, 2*time.Second)

	// The client gives up (Ctrl-C, API cancel): the same.
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	_, err := d.C.Exec(ctx, id, api.ExecRequest{Argv: []string{"bash", "-c", "setsid sleep 1000 & sleep 100"}, TimeoutMS: 60_000})
	cancel()
	if err == nil {
		t.Fatalf("a cancelled exec returned no error")
	}
	dbxWaitOnlyInit(t, d, id, 5*time.Second)

	// A normal exit: the background server lives on, and outlives another exec's timeout.
	dbxSh(t, d, id, "nohup setsid sleep 1001 >/dev/null 2>&1 </dev/null &")
	res = dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", "setsid sleep 1000 & sleep 100"}, TimeoutMS: 500})
	if !res.TimedOut {
		t.Fatalf("not timed out: %+v", res)
	}
	time.Sleep(200 * time.Millisecond)
	if got := dbxSh(t, d, id, "pgrep -x sleep -a || true"); got == "" || strings.Contains(got, "sleep 1000") || !strings.Contains(got, "sleep 1001") {
		t.Fatalf("after a normal exit that left `sleep 1001` and a timed-out exec that left `sleep 1000`: sleeps running %q, want sleep 1001 alone", got)
	}
}

// TestExecOutputLimit: output over the cap is cut with a visible marker and the writer
// is never blocked; a background child holding stdout does not hold the call open.
func TestExecOutputLimit(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "").ID

	t.Run("Truncated", func(t *testing.T) {
		const mib = 1 << 20
		script := `
import sys
sys.stdout.write("x" * (5 << 20)); sys.stdout.flush()
sys.stderr.write("e" * (2 << 20)); sys.stderr.flush()
open("/tmp/wrote-all", "w").write("yes")
`
		start := time.Now()
		res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"python3", "-c", script}, OutputLimit: mib, TimeoutMS: 20_000})
		if res.TimedOut || res.ExitCode != 0 {
			t.Fatalf("the writer did not complete (blocked on a full pipe?): exit %d timed out %v after %v; stderr tail %q",
				res.ExitCode, res.TimedOut, time.Since(start), dbxTail(res.Stderr, 300))
		}
		// The first quarter and the last three quarters of the limit, the count of the
		// dropped bytes between them.
		check := func(name, out string, trunc bool, ch byte, total int) {
			if !trunc {
				t.Errorf("%s_truncated is false", name)
			}
			marker := fmt.Sprintf("\n[deltabox: %d bytes of %s dropped]\n", total-mib, name)
			head, tail, ok := strings.Cut(out, marker)
			if !ok || len(head) != mib/4 || len(tail) != mib-mib/4 || strings.Count(head+tail, string(ch)) != mib {
				t.Errorf("%s: %d bytes (%q...%q), want 256 KiB, the marker %q, 768 KiB", name, len(out), out[:min(20, len(out))], dbxTail(out, 100), marker)
			}
		}
		check("stdout", res.Stdout, res.StdoutTruncated, 'x', 5<<20)
		check("stderr", res.Stderr, res.StderrTruncated, 'e', 2<<20)
		if got := dbxSh(t, d, id, "cat /tmp/wrote-all"); got != "yes" {
			t.Errorf("the writer did not reach its end: %q", got)
		}
		// Under the cap nothing is marked.
		res = dbxExec(t, d, id, api.ExecRequest{Argv: []string{"head", "-c", "1000", "/dev/zero"}, OutputLimit: 1000})
		if res.StdoutTruncated || len(res.Stdout) != 1000 {
			t.Errorf("exactly the limit: truncated %v, %d bytes", res.StdoutTruncated, len(res.Stdout))
		}
	})

	t.Run("BackgroundChildHoldsStdout", func(t *testing.T) {
		start := time.Now()
		res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", "sleep 30 & echo main-done"}})
		wall := time.Since(start)
		if wall > 1500*time.Millisecond {
			t.Errorf("exec returned %v after its main process (which exits at once), want within ~1s", wall)
		}
		if res.Stdout != "main-done\n" || res.ExitCode != 0 || res.TimedOut {
			t.Errorf("got %+v", res)
		}
		// And output the child writes within the grace is still captured.
		res = dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", "(sleep 0.05; echo child) & echo parent"}})
		if res.Stdout != "parent\nchild\n" {
			t.Errorf("output of a child that ends right after its parent: %q", res.Stdout)
		}
	})
}

func dbxTail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}
