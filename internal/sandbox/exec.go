package sandbox

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/cgroup"
	"deltabox/internal/sbinit"
)

// DefaultEnv is the environment every command starts with; ExecRequest.Env adds to it.
// OPENBLAS/OMP threads are pinned to 1 so that common Python stays single-threaded,
// which the process fast path needs (fork copies only the calling thread).
var DefaultEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"HOME=/root",
	"LANG=C.UTF-8",
	"OPENBLAS_NUM_THREADS=1",
	"OMP_NUM_THREADS=1",
}

// env is the environment of a command: HOSTNAME and DefaultEnv, then extra (later wins).
// A command run as a user (user != "") gets no HOME here: init sets HOME from the
// sandbox's /etc/passwd, unless extra sets it (sbinit.SpawnOptions.User).
func (s *Sandbox) env(extra []string, user string) []string {
	env := append(make([]string, 0, 1+len(DefaultEnv)+len(extra)), "HOSTNAME="+s.Hostname)
	for _, e := range DefaultEnv {
		if user != "" && strings.HasPrefix(e, "HOME=") {
			continue
		}
		env = append(env, e)
	}
	return append(env, extra...)
}

// DefaultOutputLimit caps each of stdout and stderr unless the request says otherwise.
const DefaultOutputLimit = 1 << 20

// ExecRequest is one command to run.
type ExecRequest struct {
	Argv []string
	Env  []string // KEY=VALUE, appended to DefaultEnv (later wins)
	Dir  string
	// User runs the command as that user (sbinit.SpawnOptions.User); "": the
	// sandbox's (Sandbox.User).
	User  string
	Stdin []byte
	// StdinReader, if set, feeds stdin after Stdin, until it ends (EOF closes the
	// command's stdin): a client that sends input while the command runs (E2B's
	// SendInput). Its Read must return once the command has exited (the caller closes
	// it), or its goroutine stays blocked.
	StdinReader io.Reader
	Timeout     time.Duration // 0: none
	OutputLimit int           // per stream; 0: DefaultOutputLimit
	// Session, if set, runs Argv as shell code in that session (see package session);
	// the state manager handles it, Exec ignores it.
	Session string
	// OnOutput, if set, receives the kept output ("stdout" or "stderr"): the head as
	// it is produced, the tail once the command has ended (whether it will be kept is
	// known only then). It may be called from two goroutines at once.
	OnOutput func(stream string, data []byte)
	// OnMarker, if set with OnOutput, receives DeltaBox's markers in their place in
	// the output: kind "dropped" (dropped bytes of stream were dropped there) or
	// "timeout"; text is the marker as a whole answer holds it.
	OnMarker func(stream, kind, text string, dropped int64)
}

// ExecResult is what a command did. The wire form is defined once, in apitypes.
type ExecResult = apitypes.ExecResult

// drainGrace is how long output is still read after the command exits: a background
// child that inherited stdout would otherwise hold the call open forever.
const drainGrace = 200 * time.Millisecond

// Exec runs a command in the sandbox's current state, in its own process group and
// exec cgroup (cgroup.ExecGroup), and returns its output and status. On timeout or ctx
// cancellation everything the command started is killed, whatever its session or
// process group.
func (s *Sandbox) Exec(ctx context.Context, r ExecRequest) (*ExecResult, error) {
	limit := r.OutputLimit
	if limit <= 0 {
		limit = DefaultOutputLimit
	}
	ns, err := s.StateNS()
	if err != nil {
		return nil, err
	}
	defer unix.Close(ns)

	var closers []*os.File
	defer func() {
		for _, f := range closers {
			_ = f.Close()
		}
	}()
	// Pipes belong to the fsuid that makes them: made as the sandbox's root, so that a
	// command may reopen its stdio by path (echo x > /dev/stdout opens /proc/self/fd/1),
	// which a pipe of the host's root (unmapped inside) would refuse.
	pipe := func() (r, w *os.File, err error) {
		err = s.AsRoot(func() (err error) {
			r, w, err = os.Pipe()
			return err
		})
		if r != nil {
			closers = append(closers, r, w)
		}
		return r, w, err
	}
	inR, inW, err := pipe()
	if err != nil {
		return nil, err
	}
	outR, outW, err := pipe()
	if err != nil {
		return nil, err
	}
	errR, errW, err := pipe()
	if err != nil {
		return nil, err
	}
	user := r.User
	if user == "" {
		user = s.User
	}
	env := s.env(r.Env, user)
	group, tasks, err := s.execGroup()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	p, err := s.init.Spawn(sbinit.SpawnOptions{Argv: r.Argv, Env: env, Dir: r.Dir, User: user, Tasks: int(tasks.Fd())},
		[3]int{int(inR.Fd()), int(outW.Fd()), int(errW.Fd())}, ns)
	_ = tasks.Close() // the child's copy is what counts
	if err != nil {
		s.dropExecGroup(group)
		return nil, fmt.Errorf("start %q: %w", r.Argv[0], err)
	}
	// Whatever the command left running after a normal exit (nohup server &) goes on
	// in its group; the group goes once empty.
	defer s.dropExecGroup(group)
	// Our copies of the child's ends must go, or EOF never comes.
	_ = inR.Close()
	_ = outW.Close()
	_ = errW.Close()
	go func() {
		_, _ = inW.Write(r.Stdin) // EPIPE: the command does not read its stdin
		if r.StdinReader != nil {
			_, _ = io.Copy(inW, r.StdinReader) // EPIPE: the command does not read its stdin
		}
		_ = inW.Close()
	}()
	stdout, stderr := newCapture(limit), newCapture(limit)
	if r.OnOutput != nil {
		stdout.live = func(b []byte) { r.OnOutput("stdout", b) }
		stderr.live = func(b []byte) { r.OnOutput("stderr", b) }
	}
	outDone := make(chan struct{}, 2)
	go func() { stdout.readFrom(outR); outDone <- struct{}{} }()
	go func() { stderr.readFrom(errR); outDone <- struct{}{} }()

	var timeout <-chan time.Time
	if r.Timeout > 0 {
		t := time.NewTimer(r.Timeout)
		defer t.Stop()
		timeout = t.C
	}
	res := &ExecResult{}
	var ws unix.WaitStatus
	var ok bool
	var kerr error
	select {
	case ws, ok = <-p.Exit:
	case <-timeout:
		res.TimedOut = true
		ws, ok, kerr = killExec(p, group, r.Argv[0])
	case <-ctx.Done():
		ws, ok, kerr = killExec(p, group, r.Argv[0])
	}
	if kerr != nil {
		return nil, kerr
	}
	if !ok {
		return nil, fmt.Errorf("while %q ran: %w", r.Argv[0], sbinit.ErrInitGone)
	}
	res.Duration = time.Since(start)
	grace := time.After(drainGrace)
	for i := 0; i < 2; i++ {
		select {
		case <-outDone:
		case <-grace:
			_ = outR.SetReadDeadline(time.Now()) // pipes are pollable: only a closed one refuses
			_ = errR.SetReadDeadline(time.Now())
			<-outDone
		}
	}
	res.Stdout, res.StdoutDropped = stdout.result("stdout")
	res.Stderr, res.StderrDropped = stderr.result("stderr")
	res.StdoutTruncated, res.StderrTruncated = res.StdoutDropped > 0, res.StderrDropped > 0
	if r.OnOutput != nil {
		stdout.finish("stdout", r.OnOutput, r.OnMarker)
		stderr.finish("stderr", r.OnOutput, r.OnMarker)
	}
	if ws.Signaled() {
		res.ExitCode = -1
		res.Signal = int(ws.Signal())
	} else {
		res.ExitCode = ws.ExitStatus()
	}
	if res.TimedOut {
		m := fmt.Sprintf("\n[deltabox: command timed out after %v; it and every process it started were killed]\n", r.Timeout)
		res.Stderr += m
		if r.OnMarker != nil {
			r.OnMarker("stderr", apitypes.MarkerTimeout, m, 0)
		}
	}
	res.DurationMS = float64(res.Duration.Microseconds()) / 1000
	return res, nil
}

// capture keeps what an answer holds of one output stream: its first head bytes and
// its last tail bytes (head + tail = the limit). What falls between is read, counted
// and dropped, so that the writer never blocks on a full pipe.
//
// Why the tail gets three quarters: what ends a command's output (the failing test,
// the compiler's last error, the summary) is what an agent needs most, and the head
// still shows how it started. Streaming (live) sends the head as it is read; the rest
// waits in the ring until the command ends, since only then is it known which of it
// is kept (finish).
type capture struct {
	head    []byte
	headMax int
	ring    []byte // the output after the head: its last tailMax bytes at most
	next    int    // once the ring is full: where its oldest byte is (the next to go)
	tailMax int
	total   int64
	live    func([]byte) // streaming: the head as it arrives
}

func newCapture(limit int) *capture {
	h := limit / 4
	return &capture{headMax: h, tailMax: limit - h}
}

// write adds output read from the stream.
func (c *capture) write(b []byte) {
	c.total += int64(len(b))
	if n := min(c.headMax-len(c.head), len(b)); n > 0 {
		c.head = append(c.head, b[:n]...)
		if c.live != nil {
			c.live(b[:n])
		}
		b = b[n:]
	}
	if len(b) == 0 || c.tailMax == 0 {
		return
	}
	if len(b) >= c.tailMax { // the ring is all of b's end
		c.ring = append(c.ring[:0], b[len(b)-c.tailMax:]...)
		c.next = 0
		return
	}
	if room := c.tailMax - len(c.ring); room > 0 { // growing (next stays 0)
		n := min(room, len(b))
		c.ring = append(c.ring, b[:n]...)
		b = b[n:]
	}
	for len(b) > 0 { // full: overwrite the oldest
		n := copy(c.ring[c.next:], b)
		b = b[n:]
		c.next = (c.next + n) % c.tailMax
	}
}

func (c *capture) readFrom(r io.Reader) {
	b := make([]byte, 64<<10)
	for {
		n, err := r.Read(b)
		if n > 0 {
			c.write(b[:n])
		}
		if err != nil {
			return
		}
	}
}

// tail is the ring in order, oldest first.
func (c *capture) tail() []byte {
	t := make([]byte, 0, len(c.ring))
	return append(append(t, c.ring[c.next:]...), c.ring[:c.next]...)
}

func (c *capture) dropped() int64 { return c.total - int64(len(c.head)) - int64(len(c.ring)) }

// DroppedMarker is the line that stands for dropped output in an answer, between
// what was kept of its head and of its tail; stream is "stdout", "stderr" or (a
// session's terminal) "output". docs/API.md documents the form.
func DroppedMarker(dropped int64, stream string) string {
	return fmt.Sprintf("\n[deltabox: %d bytes of %s dropped]\n", dropped, stream)
}

// result is the kept output, with the marker between head and tail when bytes were
// dropped, and how many were.
func (c *capture) result(name string) (string, int64) {
	d := c.dropped()
	var b bytes.Buffer
	b.Grow(len(c.head) + len(c.ring) + 64)
	b.Write(c.head)
	if d > 0 {
		b.WriteString(DroppedMarker(d, name))
	}
	b.Write(c.ring[c.next:])
	b.Write(c.ring[:c.next])
	return b.String(), d
}

// finish streams what live did not send: the marker, if bytes were dropped, then the
// tail. Precondition: the reader is done.
func (c *capture) finish(name string, out func(string, []byte), marker func(stream, kind, text string, dropped int64)) {
	if d := c.dropped(); d > 0 && marker != nil {
		marker(name, apitypes.MarkerDropped, DroppedMarker(d, name), d)
	}
	t := c.tail()
	for len(t) > 0 {
		n := min(len(t), 64<<10)
		out(name, t[:n])
		t = t[n:]
	}
}

// killWait bounds the wait for a killed command's exit: SIGKILL takes effect when the
// process leaves the kernel, and one in uninterruptible sleep (a hung device or network
// filesystem) may not for a long time.
var killWait = 10 * time.Second // a var for tests

// killExec kills everything in the exec's group, p first among them, and waits for p's
// exit, for killWait at most in all.
func killExec(p *sbinit.Process, group *cgroup.ExecGroup, what string) (unix.WaitStatus, bool, error) {
	if err := group.Kill(killWait); err != nil {
		return 0, false, fmt.Errorf("kill %q (pid %d in the sandbox) and what it started: %w", what, p.Pid, err)
	}
	return exitAfterKill(p, what)
}

// exitAfterKill waits for the exit of p, which was just sent SIGKILL, for killWait at
// most.
func exitAfterKill(p *sbinit.Process, what string) (unix.WaitStatus, bool, error) {
	t := time.NewTimer(killWait)
	defer t.Stop()
	select {
	case ws, ok := <-p.Exit:
		return ws, ok, nil
	case <-t.C:
		return 0, false, fmt.Errorf("%q (pid %d in the sandbox) did not exit within %v of SIGKILL (uninterruptible sleep?); it may still run", what, p.Pid, killWait)
	}
}

// execGroup makes the exec's cgroup and opens its tasks file; the groups earlier execs
// left (their survivors have exited since) are removed first.
func (s *Sandbox) execGroup() (*cgroup.ExecGroup, *os.File, error) {
	if s.execLeft.Load() > 0 {
		s.execLeft.Store(int64(s.lim.RemoveIdleExecGroups()))
	}
	g, err := s.lim.NewExecGroup()
	if err != nil {
		return nil, nil, err
	}
	f, err := g.OpenTasks()
	if err != nil {
		g.Remove()
		return nil, nil, fmt.Errorf("open the exec's cgroup: %w", err)
	}
	return g, f, nil
}

// dropExecGroup removes the exec's group, or leaves it to a later exec while processes
// the command started run on in it.
func (s *Sandbox) dropExecGroup(g *cgroup.ExecGroup) {
	if !g.Remove() {
		s.execLeft.Add(1)
	}
}
