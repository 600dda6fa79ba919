// Package session keeps long-lived processes on a pseudo-terminal inside a sandbox: a
// bash shell or a python interpreter whose state (cwd, variables, functions, aliases,
// history; python globals) persists across calls, or any long-lived command.
//
// Protocol. A call's code is sent in lines short enough for the terminal's
// canonical-mode line buffer (4095 bytes) and free of the characters its line
// discipline acts on (bash: $'...' words, bash.go; python: base64), and the process
// answers with a sentinel "\x1eDBX:<id>:<status>\x1e" after the code ran: bash prints
// it from PROMPT_COMMAND, python from a small driver loop. Everything the terminal shows
// between the last line sent and the sentinel is the call's output (stdout and stderr
// merged, as on any terminal; output.go keeps its head and tail). A timeout types ^C,
// which the line discipline turns into SIGINT for the foreground process group: the
// command is interrupted and the session lives on. In a bash session `exit` and `set
// -e` end the call, not the shell (bash.go). If the process ends during a call all the
// same, the call answers with its exit status and a note (endedError).
//
// Call ids are nonces (newID: 128 random bits), the readiness check at Start included.
// A counter was wrong twice over: bash prints a sentinel after every line it reads,
// the lines that carry a call's code included, with the id it last held, so a call
// whose id equalled that one ended at once with status 0 and no output, as soon as a
// restore gave a restarted session (a new counter) a shell from before the restart;
// and any process of the sandbox could end the next call early, with the output and
// status of its choice, by writing the next count's sentinel on the terminal. A nonce
// never equals an earlier call's id, and is unknown to the sandbox until the call's
// last line is typed. The code a call runs can read its own call's id (the process
// that prints the sentinel must know it) and so end that call early: that is the
// call's own doing. Bash forgets the id once it printed it (PROMPT_COMMAND clears it),
// so the lines of the next call, and a shell restored from a template, print an
// empty id, which no call awaits.
//
// Concurrency: one call at a time per session (ErrBusy otherwise). One goroutine
// (readLoop) owns reading the master; mu guards the buffers and the state they feed.
//
// Bounds. Whatever the sandbox prints, a session holds at most logCap bytes of output no
// call consumes (log, a ring with an exact count of what it dropped) and, during a call,
// pendingCap bytes the call has not yet taken: past that readLoop stops reading and the
// terminal's own buffer pushes back on the writer. A call keeps its output within its
// limit (output.go), and a stray 0x1e holds back at most maxSentinel bytes. The master
// is nonblocking, on Go's netpoller: an idle session's reader is a parked goroutine,
// not an OS thread blocked in read(2) (200 idle sessions took 198 threads; Go aborts
// at 10,000). Every write to the terminal has a deadline (writeTimeout).
package session

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/pydriver"
	"deltabox/internal/sandbox"
)

// Kind is what runs in a session. Kind and Info are the API's session types: their wire
// form is defined once, in apitypes.
type Kind = apitypes.SessionKind

const (
	Bash    = apitypes.SessionBash
	Python  = apitypes.SessionPython
	Command = apitypes.SessionCommand // any long-lived command; output is kept, calls are refused
)

// ErrBusy: a call is already running in the session.
var ErrBusy = errors.New("session busy")

// ErrNotCallable: the session runs a plain command, which has no call protocol.
var ErrNotCallable = errors.New("not a shell or interpreter session")

// logCap bounds what a session keeps of the output no call consumed (a command
// session's log): the tail, in a ring (logbuf.go).
const logCap = 1 << 20

// pendingCap bounds the output a running call has not consumed yet (it consumes as
// output arrives; this is only reached when its answer's reader is slow).
const pendingCap = 256 << 10

// writeTimeout bounds each write to the terminal (a call's code, ^C): a process that
// no longer reads its terminal makes the call fail rather than hang.
const writeTimeout = 30 * time.Second

// chunk is how much encoded code goes on one line (under the terminal's 4095).
const chunk = 3000

// Info is what the API shows of a session.
type Info = apitypes.SessionInfo

// Session is one session.
type Session struct {
	name string
	kind Kind
	argv []string
	// +checklocks:mu
	pid     int
	started time.Time
	rt      *sandbox.Sandbox
	master  *os.File

	mu sync.Mutex // guards everything below
	// cond is set at construction (unlocked: no one else has s yet).
	// +checklocks:mu
	cond *sync.Cond
	// +checklocks:mu
	buf []byte // while busy: output the call has not consumed yet (at most pendingCap)
	// +checklocks:mu
	log *logBuf // while not busy: output no call consumes
	// +checklocks:mu
	dead bool
	exit string
	// +checklocks:mu
	reaped bool // watch reported the end of this generation's process
	// +checklocks:mu
	eof bool // readLoop read the terminal to its end (EIO: no process holds it)
	// +checklocks:mu
	status *unix.WaitStatus // how it ended (nil: init could not say)
	// +checklocks:mu
	busy bool
	// +checklocks:mu
	closed bool
	// +checklocks:mu
	gen int // process generation: Rebind after a restore starts a new one
	// +checklocks:mu
	slave *os.File // held by NewDetached until Rebind

	// settling is closed when the interruption of an abandoned call's command is over
	// (nil when none runs): the next call waits for it rather than meet a busy session.
	// +checklocks:mu
	settling chan struct{}
}

// pythonDriver runs a python session: code arrives base64 in "C" lines, runs at an "R"
// line (pydriver.Exec's run), and its end is marked by the sentinel with its status.
var pythonDriver = `
import sys, base64, ast, traceback, termios, signal
try:
    a = termios.tcgetattr(0); a[3] &= ~termios.ECHO; termios.tcsetattr(0, termios.TCSANOW, a)
except Exception:
    pass
` + pydriver.Exec + `
buf = []
def report():
    # The traceback of the user's code only, without this driver's frames.
    t, v, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename != "<session>":
        tb = tb.tb_next
    traceback.print_exception(t, v, tb)
while True:
    try:
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        continue
    if not line:
        break
    line = line.strip()
    if line.startswith("C"):
        buf.append(line[1:]); continue
    if not line.startswith("R"):
        continue
    cid, rc = line[1:], 0
    src = base64.b64decode("".join(buf)).decode(); buf = []
    try:
        v = run(src)
        if v is not None:
            print(v)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        report(); rc = 130
    except BaseException:
        report(); rc = 1
    sys.stdout.flush(); sys.stderr.flush()
    sys.stdout.write("\x1eDBX:%s:%d\x1e" % (cid, rc)); sys.stdout.flush()
`

// newID returns a call id: a nonce of 128 random bits (base32: no ':' and no 0x1e,
// which the sentinel uses).
func newID() string { return rand.Text() }

// NewDetached makes a session with a fresh terminal and no process yet, for a process
// restored from a template after the original session was killed (Rebind attaches it).
func NewDetached(rt *sandbox.Sandbox, name string, kind Kind, argv []string) (*Session, error) {
	master, slave, err := openPTY(rt)
	if err != nil {
		return nil, err
	}
	// The slave stays open here until the restored process has opened it by path
	// (PtsPath): with no slave open, reads on the master fail with EIO.
	s := &Session{name: name, kind: kind, argv: argv, started: time.Now().UTC(), rt: rt, master: master, slave: slave, dead: true, exit: "not started", log: newLogBuf(logCap)}
	s.cond = sync.NewCond(&s.mu) // +checklocksignore: construction
	go s.readLoop()
	return s, nil
}

// Start starts a session in the sandbox's current state.
func Start(rt *sandbox.Sandbox, name string, kind Kind, argv []string, dir string, env []string) (*Session, error) {
	switch kind {
	case Bash:
		argv = []string{"bash", "--norc", "--noprofile", "--noediting", "-i"}
	case Python:
		argv = []string{"python3", "-u", "-q", "-c", pythonDriver}
	case Command:
		if len(argv) == 0 {
			return nil, fmt.Errorf("a command session needs a command")
		}
	default:
		return nil, fmt.Errorf("unknown session kind %q (bash, python or command)", kind)
	}
	master, slave, err := openPTY(rt)
	if err != nil {
		return nil, err
	}
	// HISTCONTROL from the start, so that even the setup line stays out of history.
	env = append([]string{"TERM=xterm", "HISTCONTROL=ignorespace"}, env...)
	p, err := rt.SpawnSession(argv, env, dir, slave)
	_ = slave.Close()
	if err != nil {
		_ = master.Close()
		return nil, err
	}
	shown := argv
	if kind == Python {
		shown = []string{"python3"} // not the driver's source
	}
	s := &Session{name: name, kind: kind, argv: shown, pid: p.Pid, started: time.Now().UTC(), rt: rt, master: master, log: newLogBuf(logCap)}
	s.cond = sync.NewCond(&s.mu) // +checklocksignore: construction
	go s.readLoop()
	s.watch(p.Exit, 0)
	if kind == Command {
		return s, nil
	}
	// Wait for the sentinel of a first, empty call, then drop what came before it.
	id := newID()
	setup := bashSetup(id)
	if kind == Python {
		setup = "R" + id + "\n"
	}
	s.mu.Lock()
	s.busy = true
	s.mu.Unlock()
	err = s.write([]byte(setup))
	if err == nil {
		_, err = s.await(context.Background(), id, 10*time.Second, nil)
	}
	s.endCall()
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("session %s did not come up: %w", name, err)
	}
	return s, nil
}

// watch marks the session ended when its process (generation gen) exits; a later
// generation (Rebind) is not affected by an earlier process's exit.
func (s *Session) watch(exit <-chan unix.WaitStatus, gen int) {
	go func() {
		ws, ok := <-exit
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.gen != gen {
			return
		}
		s.dead = true
		switch {
		case !ok:
			s.exit = "the sandbox's init is gone"
		case ws.Signaled():
			s.exit = "killed by " + unix.SignalName(ws.Signal())
		default:
			s.exit = "exited with status " + strconv.Itoa(ws.ExitStatus())
		}
		s.reaped = true
		if ok {
			s.status = &ws
		}
		s.cond.Broadcast()
	}()
}

// Rebind attaches the session to a process restored from a template (same PID, same
// terminal): the session runs again, with no call in flight, and the output it holds is
// what RestoreTerm put back (the log as it was at the checkpoint).
func (s *Session) Rebind(pid int, exit <-chan unix.WaitStatus) {
	s.mu.Lock()
	s.gen++
	s.pid, s.dead, s.exit, s.busy, s.reaped, s.status, s.eof = pid, false, "", false, false, nil, false
	gen := s.gen
	slave := s.slave
	s.slave = nil
	s.mu.Unlock()
	if slave != nil {
		_ = slave.Close()
	}
	s.watch(exit, gen)
}

// Pid is the session process's PID in the sandbox.
func (s *Session) Pid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pid
}

// Kind is what runs in the session.
func (s *Session) Kind() Kind { return s.kind }

// TermState is what a checkpoint keeps of a session's terminal beside its process (a
// template's terminal is gone by the time it is restored): the line discipline settings,
// the window size, and the output no call consumed (a command session's log: a restore
// brings back the log as it was, as it brings back the process).
type TermState struct {
	termios *unix.Termios
	winsize *unix.Winsize
	log     []byte
	dropped int64 // what the log had dropped before it
}

// SaveTerm reads the session's terminal settings (what it cannot read stays unset, and
// RestoreTerm then leaves it as it is) and copies its log.
func (s *Session) SaveTerm() TermState {
	var t TermState
	_ = s.control(func(fd int) { // a closed terminal: t stays unset, as said
		if tio, err := unix.IoctlGetTermios(fd, unix.TCGETS); err == nil {
			t.termios = tio
		}
		if ws, err := unix.IoctlGetWinsize(fd, unix.TIOCGWINSZ); err == nil {
			t.winsize = ws
		}
	})
	s.mu.Lock()
	t.log, t.dropped = s.log.bytes(), s.log.dropped
	s.mu.Unlock()
	return t
}

// RestoreTerm sets the session's terminal and log to t (a restore, before its process
// resumes; what the session held before is dropped).
func (s *Session) RestoreTerm(t TermState) {
	_ = s.control(func(fd int) { // a closed terminal: nothing to restore
		if t.termios != nil {
			_ = unix.IoctlSetTermios(fd, unix.TCSETS, t.termios)
		}
		if t.winsize != nil {
			_ = unix.IoctlSetWinsize(fd, unix.TIOCSWINSZ, t.winsize)
		}
	})
	s.mu.Lock()
	s.log.set(t.log, t.dropped)
	s.mu.Unlock()
}

// OpenPeer opens the terminal's slave through the master (TIOCGPTPEER: no path lookup,
// so nothing in the sandbox can substitute another file), close-on-exec and not as a
// controlling terminal. The caller closes the fd.
func (s *Session) OpenPeer() (int, error) {
	var r uintptr
	var errno unix.Errno
	if err := s.control(func(fd int) {
		r, _, errno = unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TIOCGPTPEER, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC)
	}); err != nil {
		return -1, fmt.Errorf("open the terminal's slave: %w", err)
	}
	if errno != 0 {
		return -1, fmt.Errorf("open the terminal's slave: %w", errno)
	}
	return int(r), nil
}

// PtsPath is the terminal's slave as the sandbox names it (/dev/pts/N).
func (s *Session) PtsPath() (string, error) {
	var n uint32
	var err error
	if cerr := s.control(func(fd int) { n, err = ptsNumber(fd) }); cerr != nil {
		err = cerr
	}
	if err != nil {
		return "", err
	}
	return "/dev/pts/" + strconv.Itoa(int(n)), nil
}

// openPTY opens a terminal in the sandbox with its master on Go's netpoller: the fd is
// duplicated (the *os.File OpenPTY made is blocking, and closed here) and made
// nonblocking before os.NewFile, which then registers it with the poller. From here on
// the master's fd is reached only through control: File.Fd would make it blocking
// again, and each reader an OS thread again.
func openPTY(rt *sandbox.Sandbox) (master, slave *os.File, err error) {
	m, slave, err := rt.OpenPTY()
	if err != nil {
		return nil, nil, err
	}
	if master, err = pollable(m); err != nil {
		_ = slave.Close()
		return nil, nil, err
	}
	return master, slave, nil
}

// pollable returns f's file as a nonblocking *os.File on the netpoller, and closes f.
func pollable(f *os.File) (*os.File, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	_ = f.Close() // the dup, or its error, is what matters
	if err == nil {
		if err = unix.SetNonblock(fd, true); err != nil {
			unix.Close(fd)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("make the terminal's master nonblocking: %w", err)
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}

// control runs f with the master's fd (an ioctl), without making it blocking.
func (s *Session) control(f func(fd int)) error {
	rc, err := s.master.SyscallConn()
	if err != nil {
		return err
	}
	return rc.Control(func(fd uintptr) { f(int(fd)) })
}

// write writes b to the terminal within writeTimeout.
func (s *Session) write(b []byte) error {
	_ = s.master.SetWriteDeadline(time.Now().Add(writeTimeout)) // fails only on a closed file, as the Write below does
	_, err := s.master.Write(b)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return fmt.Errorf("the session's process took no input for %v (it no longer reads its terminal: kill the session)", writeTimeout)
	}
	return err
}

// endCall ends a call (or Start's readiness check): what the call left unconsumed
// joins the log, and readLoop, which may wait for the call to consume, goes on.
func (s *Session) endCall() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.busy = false
	s.log.write(s.buf)
	s.buf = nil
	if s.settling != nil {
		close(s.settling)
		s.settling = nil
	}
	s.cond.Broadcast()
}

func (s *Session) readLoop() {
	b := make([]byte, 32<<10)
	for {
		n, err := s.master.Read(b)
		s.mu.Lock()
		if n > 0 {
			if s.busy {
				s.buf = append(s.buf, b[:n]...) // await consumes it as it grows
			} else {
				s.log.write(b[:n])
			}
		}
		if err != nil {
			// EIO once every holder of the slave is gone, after what they wrote.
			s.dead, s.eof = true, true
			if s.exit == "" {
				s.exit = "terminal closed"
			}
		}
		s.cond.Broadcast()
		// A call consumes what it is given; when it falls behind (a slow reader of a
		// streamed answer) the terminal's buffer holds the rest, and its writer waits.
		for err == nil && s.busy && len(s.buf) >= pendingCap && !s.closed {
			s.cond.Wait()
		}
		s.mu.Unlock()
		if err != nil {
			return
		}
	}
}

// Result is one call's outcome.
type Result struct {
	ExitCode  int // the code's status; when the process ended during the call, its exit status (-1: a signal)
	Signal    int // the signal that ended the process during the call
	Output    string
	Truncated bool
	TimedOut  bool
	Duration  time.Duration
}

// Run runs code in the session and waits for it. onOutput, if set, receives output as
// it arrives. limit caps the kept output (0: 1 MiB): its head and tail (output.go).
func (s *Session) Run(ctx context.Context, code string, timeout time.Duration, limit int, onOutput func([]byte)) (*Result, error) {
	if s.kind == Command {
		return nil, fmt.Errorf("session %s runs %q: %w", s.name, s.argv, ErrNotCallable)
	}
	if limit <= 0 {
		limit = sandbox.DefaultOutputLimit
	}
	s.mu.Lock()
	// A call whose client has just gone is known as such a moment later (the server
	// reads the closed connection, then the call's context ends): a busy session gets
	// that moment before the call is refused.
	for end := time.Now().Add(busyGrace); s.busy && s.settling == nil && time.Now().Before(end); {
		s.mu.Unlock()
		time.Sleep(5 * time.Millisecond)
		s.mu.Lock()
	}
	for s.busy && s.settling != nil {
		ch := s.settling
		s.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		s.mu.Lock()
	}
	if s.busy {
		s.mu.Unlock()
		return nil, fmt.Errorf("session %s is running another call: %w", s.name, ErrBusy)
	}
	if s.dead {
		s.mu.Unlock()
		return nil, fmt.Errorf("session %s has ended (%s)", s.name, s.exit)
	}
	s.busy = true
	id := newID()
	s.buf = s.buf[:0]
	s.log.reset() // what came before the call is not its output
	s.mu.Unlock()
	defer s.endCall()

	var w bytes.Buffer
	switch s.kind {
	case Bash:
		w.WriteString(bashCall(code, id))
	case Python:
		enc := base64.StdEncoding.EncodeToString([]byte(code))
		for i := 0; i < len(enc); i += chunk {
			fmt.Fprintf(&w, "C%s\n", enc[i:min(i+chunk, len(enc))])
		}
		fmt.Fprintf(&w, "R%s\n", id)
	}
	out := newOutput(limit, onOutput)
	res := &Result{}
	start := time.Now()
	if err := s.write(w.Bytes()); err != nil {
		return nil, fmt.Errorf("write to session %s: %w", s.name, err)
	}
	end, err := s.await(ctx, id, timeout, out)
	// A caller gone (ctx: its client disconnected) interrupts the command as a timeout
	// does, so that the session is idle again, its marker read, before the next call.
	var ended *endedError
	abandoned := err != nil && ctx.Err() != nil && !errors.Is(err, errTimeout) && !errors.As(err, &ended)
	if abandoned {
		s.mu.Lock()
		s.settling = make(chan struct{})
		s.mu.Unlock()
	}
	if errors.Is(err, errTimeout) || abandoned {
		res.TimedOut = true
		// Interrupt the command, not the session: ^C reaches the foreground group.
		s.interrupt()
		end, err = s.await(context.Background(), id, 5*time.Second, out)
		if errors.Is(err, errTimeout) {
			// It ignored SIGINT: kill the terminal's foreground group if it is not the
			// session itself.
			_ = s.control(func(fd int) { // a closed terminal: no group to kill
				if pg, e := unix.IoctlGetInt(fd, unix.TIOCGPGRP); e == nil && pg > 1 {
					_ = unix.Kill(-pg, unix.SIGKILL) // gone already, or the await below says it stayed
				}
			})
			end, err = s.await(context.Background(), id, 5*time.Second, out)
			if errors.Is(err, errTimeout) {
				return nil, fmt.Errorf("session %s did not come back after its command timed out: %w", s.name, err)
			}
		}
		if abandoned {
			return nil, fmt.Errorf("session %s: the call was abandoned and its command interrupted: %w", s.name, ctx.Err())
		}
	}
	res.Duration = time.Since(start)
	switch {
	case errors.As(err, &ended):
		res.ExitCode, res.Signal = ended.status, ended.signal
		out.addNote(fmt.Sprintf("\n[deltabox: the session ended during the call (%s)]\n", ended.why))
	case err != nil:
		return nil, err
	default:
		res.ExitCode = end.status
		out.finish(end.unwound)
	}
	if res.TimedOut {
		out.addNote(fmt.Sprintf("\n[deltabox: command timed out after %v and was interrupted; the session lives on]\n", timeout))
	}
	res.Output, res.Truncated = out.result()
	return res, nil
}

// interrupt types ^C into the terminal: the kernel sends SIGINT to its foreground
// process group. A bash session runs a command in a process group it forks; until the
// child has exec'd the command it has the interactive shell's SIGINT handler, and a
// ^C then is lost: the command runs on (measured: one ^C in three, right after a
// command started). So a bash session's ^C waits first, 200 ms at most, while the
// foreground group is the shell's own or led by the shell's executable (a fork not yet
// exec'd; a subshell or a bash script also look so, and get the ^C at 200 ms).
func (s *Session) interrupt() {
	if s.kind == Bash {
		var sid, pg int
		var err error
		_ = s.control(func(fd int) { sid, err = unix.IoctlGetInt(fd, unix.TIOCGSID) }) // a closed terminal leaves sid 0: no shell, no wait
		shell, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", sid))
		for end := time.Now().Add(200 * time.Millisecond); err == nil && shell != "" && time.Now().Before(end); time.Sleep(time.Millisecond) {
			_ = s.control(func(fd int) { pg, err = unix.IoctlGetInt(fd, unix.TIOCGPGRP) }) // a closed terminal leaves pg 0: the loop ends
			if err != nil {
				break
			}
			if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pg)); pg != sid && exe != shell {
				break
			}
		}
	}
	_ = s.write([]byte{0x03}) // not written: the caller's await times out and kills
}

// busyGrace is how long a call waits for a busy session before it is refused.
const busyGrace = 250 * time.Millisecond

var errTimeout = errors.New("timed out")

// endedError: the session's process ended during a call. The call answers with its
// status (the session's next call, through the state package, starts it again).
type endedError struct {
	why    string // Session.exit: "exited with status 3", "killed by SIGKILL", "terminal closed"
	status int    // the exit status; -1 if a signal ended it, or if that is not known
	signal int
}

func (e *endedError) Error() string { return "the session ended during the call (" + e.why + ")" }

// endedWait is how long a call whose terminal closed waits for its process's exit
// status (reaped by the sandbox's init, reported through watch).
const endedWait = 2 * time.Second

// await passes output to out (nil: dropped) until the sentinel of call id, and returns
// that sentinel; errTimeout after timeout, ctx.Err(), or an *endedError.
func (s *Session) await(ctx context.Context, id string, timeout time.Duration, out *output) (sentinel, error) {
	if out == nil {
		out = newOutput(0, nil)
	}
	var deadline <-chan time.Time
	if timeout > 0 {
		t := time.NewTimer(timeout)
		deadline = t.C
		defer t.Stop()
	}
	stop := make(chan struct{})
	defer close(stop)
	expired, gaveUp, drainGaveUp := false, false, false
	go func() {
		select {
		case <-deadline:
		case <-ctx.Done():
		case <-stop:
			return
		}
		s.mu.Lock()
		expired = true
		s.cond.Broadcast()
		s.mu.Unlock()
	}()
	// A trailing newline out holds back (output.add: maybe the newline bash prints as
	// exit or errexit unwinds a call, which comes right before the sentinel) is passed on
	// once heldFlush has gone by with nothing more: a line streamed as it is printed must
	// not wait for the next one. (Its timer is stopped after the unlock below.)
	var flushTimer *time.Timer
	flush := false
	defer func() {
		if flushTimer != nil {
			flushTimer.Stop()
		}
	}()
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		if len(s.buf) > 0 {
			s.cond.Broadcast() // readLoop may wait for room (pendingCap)
		}
		if flush && len(s.buf) == 0 {
			out.flushHeld()
			flush = false
		}
		// Consume the buffer up to a whole sentinel of this call, or up to a 0x1e that
		// might begin one once more comes; other sentinels (empty ids: the lines of the
		// call itself) are dropped, stray bytes are output.
		for len(s.buf) > 0 {
			i := bytes.IndexByte(s.buf, 0x1e)
			if i < 0 {
				out.add(s.buf)
				s.buf = s.buf[:0]
				break
			}
			out.add(s.buf[:i])
			sen, n, partial := parseSentinel(s.buf[i:])
			if n == 0 && partial {
				s.buf = s.buf[:copy(s.buf, s.buf[i:])]
				break
			}
			if n == 0 {
				n = 1
				out.add(s.buf[i : i+1])
			}
			s.buf = s.buf[i+n:]
			if n > 1 && sen.id == id {
				return sen, nil
			}
		}
		if s.dead {
			if !s.eof && !drainGaveUp {
				// The exit was reported (watch) before readLoop read what the process
				// wrote last ("echo bye; exit 9" lost "bye" on a loaded machine):
				// read the terminal to its end first, at most drainWait (a background
				// job of the shell may hold it open).
				s.waitEOF(&drainGaveUp)
				continue
			}
			if !s.reaped && !gaveUp {
				s.waitReaped(&gaveUp)
			}
			e := &endedError{why: s.exit, status: -1}
			if ws := s.status; ws != nil {
				if ws.Signaled() {
					e.signal = int(ws.Signal())
				} else {
					e.status = ws.ExitStatus()
				}
			}
			return sentinel{}, e
		}
		if expired {
			if ctx.Err() != nil {
				return sentinel{}, ctx.Err()
			}
			return sentinel{}, errTimeout
		}
		if out.holding() {
			if flushTimer != nil {
				flushTimer.Stop()
			}
			flush = false
			flushTimer = time.AfterFunc(heldFlush, func() {
				s.mu.Lock()
				flush = true
				s.cond.Broadcast()
				s.mu.Unlock()
			})
		}
		s.cond.Wait()
	}
}

// waitReaped waits until watch reported the end of the session's process or endedWait
// went by (then *gaveUp).
// +checklocks:s.mu
func (s *Session) waitReaped(gaveUp *bool) {
	t := time.AfterFunc(endedWait, func() {
		s.mu.Lock()
		*gaveUp = true
		s.cond.Broadcast()
		s.mu.Unlock()
	})
	defer t.Stop()
	for !s.reaped && !*gaveUp {
		s.cond.Wait()
	}
}

// waitEOF waits until readLoop has read the terminal to its end or drainWait went by
// (then *gaveUp).
// +checklocks:s.mu
func (s *Session) waitEOF(gaveUp *bool) {
	t := time.AfterFunc(drainWait, func() {
		s.mu.Lock()
		*gaveUp = true
		s.cond.Broadcast()
		s.mu.Unlock()
	})
	defer t.Stop()
	for !s.eof && !*gaveUp {
		s.cond.Wait()
	}
}

// drainWait bounds how long a call whose session's process ended waits for the rest of
// its output: the terminal closes right after the process when nothing else holds it.
const drainWait = 500 * time.Millisecond

// heldFlush is how long a held-back trailing newline waits for more output (bash writes
// the unwind newline and the sentinel back to back).
const heldFlush = 50 * time.Millisecond

// Logs returns what a session printed that no call consumed (for a command session:
// the tail of its output, up to 1 MiB), after a marker counting what went before it if
// anything did.
func (s *Session) Logs() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.log.withMarker()
}

// Info describes the session.
func (s *Session) Info() Info {
	s.mu.Lock()
	defer s.mu.Unlock()
	return Info{Name: s.name, Kind: s.kind, Argv: s.argv, Pid: s.pid, Started: s.started, Running: !s.dead, Busy: s.busy, Exit: s.exit}
}

// Alive reports whether the session's process still runs.
func (s *Session) Alive() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.dead
}

// Close kills the session's process group and releases the terminal.
func (s *Session) Close() { s.close(true) }

// Release releases the terminal of a session whose processes are already gone (a
// checkpoint ended them), without a round trip to the sandbox's init.
func (s *Session) Release() { s.close(false) }

func (s *Session) close(kill bool) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	s.cond.Broadcast() // readLoop may wait for a call to consume
	s.mu.Unlock()
	if kill {
		_ = s.rt.Signal(s.Pid(), unix.SIGKILL, true) // the master's close below hangs the terminal up too
	}
	_ = s.master.Close()
}
