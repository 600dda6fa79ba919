package sandbox

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
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
func (s *Sandbox) env(extra []string) []string {
	return append(append([]string{"HOSTNAME=" + s.Hostname}, DefaultEnv...), extra...)
}

// DefaultOutputLimit caps each of stdout and stderr unless the request says otherwise.
const DefaultOutputLimit = 1 << 20

// ExecRequest is one command to run.
type ExecRequest struct {
	Argv        []string
	Env         []string // KEY=VALUE, appended to DefaultEnv (later wins)
	Dir         string
	Stdin       []byte
	Timeout     time.Duration // 0: none
	OutputLimit int           // per stream; 0: DefaultOutputLimit
	// Session, if set, runs Argv as shell code in that session (see package session);
	// the state manager handles it, Exec ignores it.
	Session string
	// OnOutput, if set, receives output as it is produced ("stdout" or "stderr").
	// It may be called from two goroutines at once.
	OnOutput func(stream string, data []byte)
}

// ExecResult is what a command did. The wire form is defined once, in apitypes.
type ExecResult = apitypes.ExecResult

// drainGrace is how long output is still read after the command exits: a background
// child that inherited stdout would otherwise hold the call open forever.
const drainGrace = 200 * time.Millisecond

// Exec runs a command in the sandbox's current state, in its own process group, and
// returns its output and status. On timeout or ctx cancellation the whole process
// group is killed.
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
			f.Close()
		}
	}()
	pipe := func() (*os.File, *os.File, error) {
		r, w, err := os.Pipe()
		if err == nil {
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
	env := s.env(r.Env)
	start := time.Now()
	p, err := s.init.Spawn(sbinit.SpawnOptions{Argv: r.Argv, Env: env, Dir: r.Dir},
		[3]int{int(inR.Fd()), int(outW.Fd()), int(errW.Fd())}, ns)
	if err != nil {
		return nil, fmt.Errorf("start %q: %w", r.Argv[0], err)
	}
	// Our copies of the child's ends must go, or EOF never comes.
	inR.Close()
	outW.Close()
	errW.Close()
	go func() {
		inW.Write(r.Stdin)
		inW.Close()
	}()
	stdout, stderr := newCapture(limit), newCapture(limit)
	if r.OnOutput != nil {
		stdout.emit = func(b []byte) { r.OnOutput("stdout", b) }
		stderr.emit = func(b []byte) { r.OnOutput("stderr", b) }
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
		s.init.Signal(p.Pid, unix.SIGKILL, true)
		ws, ok, kerr = exitAfterKill(p, r.Argv[0])
	case <-ctx.Done():
		s.init.Signal(p.Pid, unix.SIGKILL, true)
		ws, ok, kerr = exitAfterKill(p, r.Argv[0])
	}
	if kerr != nil {
		return nil, kerr
	}
	if !ok {
		return nil, fmt.Errorf("while %q ran: %w", r.Argv[0], sbinit.ErrInitGone)
	}
	res.Duration = time.Since(start)
	if res.TimedOut {
		// Whatever the group left behind holding the pipes is gone too.
		s.init.Signal(p.Pid, unix.SIGKILL, true)
	}
	grace := time.After(drainGrace)
	for i := 0; i < 2; i++ {
		select {
		case <-outDone:
		case <-grace:
			outR.SetReadDeadline(time.Now())
			errR.SetReadDeadline(time.Now())
			<-outDone
		}
	}
	res.Stdout, res.StdoutTruncated = stdout.result("stdout")
	res.Stderr, res.StderrTruncated = stderr.result("stderr")
	if ws.Signaled() {
		res.ExitCode = -1
		res.Signal = int(ws.Signal())
	} else {
		res.ExitCode = ws.ExitStatus()
	}
	if res.TimedOut {
		res.Stderr += fmt.Sprintf("\n[deltabox: command timed out after %v; its process group was killed]\n", r.Timeout)
	}
	res.DurationMS = float64(res.Duration.Microseconds()) / 1000
	return res, nil
}

// capture keeps the first limit bytes of a stream and counts the rest, which it
// reads and drops so that the writer never blocks on a full pipe.
type capture struct {
	buf     bytes.Buffer
	limit   int
	dropped int64
	emit    func([]byte) // streaming: what is kept, as it arrives
}

func newCapture(limit int) *capture { return &capture{limit: limit} }

func (c *capture) readFrom(r io.Reader) {
	b := make([]byte, 64<<10)
	for {
		n, err := r.Read(b)
		if n > 0 {
			room := c.limit - c.buf.Len()
			if room > n {
				room = n
			}
			if room > 0 {
				c.buf.Write(b[:room])
				if c.emit != nil {
					c.emit(b[:room])
				}
			}
			c.dropped += int64(n - room)
		}
		if err != nil {
			return
		}
	}
}

func (c *capture) result(name string) (string, bool) {
	if c.dropped == 0 {
		return c.buf.String(), false
	}
	return c.buf.String() + fmt.Sprintf("\n[deltabox: %s truncated at %d bytes; %d more bytes dropped]\n", name, c.limit, c.dropped), true
}

// killWait bounds the wait for a killed command's exit: SIGKILL takes effect when the
// process leaves the kernel, and one in uninterruptible sleep (a hung device or network
// filesystem) may not for a long time.
var killWait = 10 * time.Second // a var for tests

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
