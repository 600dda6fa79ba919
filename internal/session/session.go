// Package session keeps long-lived processes on a pseudo-terminal inside a sandbox: a
// bash shell or a python interpreter whose state (cwd, variables, functions, aliases,
// history; python globals) persists across calls, or any long-lived command.
//
// Protocol. A call's code is sent base64-encoded, in lines short enough for the
// terminal's canonical-mode line buffer (4095 bytes), and the process answers with a
// sentinel "\x1eDBX:<id>:<status>\x1e" after the code ran: bash prints it from
// PROMPT_COMMAND, python from a small driver loop. Everything the terminal shows
// between the last line sent and the sentinel is the call's output (stdout and stderr
// merged, as on any terminal). A timeout types ^C, which the line discipline turns into
// SIGINT for the foreground process group: the command is interrupted and the session
// lives on.
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
// (readLoop) owns reading the master; mu guards the buffer and the state it feeds.
package session

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
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

// logCap bounds what a command session keeps of its output (the tail).
const logCap = 1 << 20

// chunk is how much base64 goes on one line.
const chunk = 3000

// Info is what the API shows of a session.
type Info = apitypes.SessionInfo

// Session is one session.
type Session struct {
	name    string
	kind    Kind
	argv    []string
	pid     int
	started time.Time
	rt      *sandbox.Sandbox
	master  *os.File

	mu     sync.Mutex // guards everything below
	cond   *sync.Cond
	buf    []byte // output not yet consumed by a call (command sessions: the tail)
	dead   bool
	exit   string
	busy   bool
	closed bool
	gen    int      // process generation: Rebind after a restore starts a new one
	slave  *os.File // held by NewDetached until Rebind

	// settling is closed when the interruption of an abandoned call's command is over
	// (nil when none runs): the next call waits for it rather than meet a busy session.
	settling chan struct{}
}

var pythonDriver = `
import sys, base64, ast, traceback, termios, signal
try:
    a = termios.tcgetattr(0); a[3] &= ~termios.ECHO; termios.tcsetattr(0, termios.TCSANOW, a)
except Exception:
    pass
g = {"__name__": "__main__", "__builtins__": __builtins__}
buf = []
def run(src):
    tree = ast.parse(src, "<session>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<session>", "exec"), g)
    if last is not None:
        v = eval(compile(last, "<session>", "eval"), g)
        if v is not None:
            print(repr(v))
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
        run(src)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        report(); rc = 130
    except BaseException:
        report(); rc = 1
    sys.stdout.flush(); sys.stderr.flush()
    sys.stdout.write("\x1eDBX:%s:%d\x1e" % (cid, rc)); sys.stdout.flush()
`

// bashSetup turns the interactive shell into a call server and prints the sentinel of
// id (the readiness check). The leading space keeps protocol lines out of history
// (HISTCONTROL=ignorespace). PROMPT_COMMAND prints a call's sentinel, then forgets its
// id (see the package doc).
func bashSetup(id string) string {
	return ` stty -echo; HISTCONTROL=ignorespace; PS1=''; PS2=''; PROMPT_COMMAND='__db_rc=$?; printf "\036DBX:%s:%s\036" "$__db_id" "$__db_rc"; __db_id='; __db_id=` + id + "\n"
}

// newID returns a call id: a nonce of 128 random bits (base32: no ':' and no 0x1e,
// which the sentinel uses).
func newID() string { return rand.Text() }

// NewDetached makes a session with a fresh terminal and no process yet, for a process
// restored from a template after the original session was killed (Rebind attaches it).
func NewDetached(rt *sandbox.Sandbox, name string, kind Kind, argv []string) (*Session, error) {
	master, slave, err := rt.OpenPTY()
	if err != nil {
		return nil, err
	}
	// The slave stays open here until the restored process has opened it by path
	// (PtsPath): with no slave open, reads on the master fail with EIO.
	s := &Session{name: name, kind: kind, argv: argv, started: time.Now().UTC(), rt: rt, master: master, slave: slave, dead: true, exit: "not started"}
	s.cond = sync.NewCond(&s.mu)
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
	master, slave, err := rt.OpenPTY()
	if err != nil {
		return nil, err
	}
	// HISTCONTROL from the start, so that even the setup line stays out of history.
	env = append([]string{"TERM=xterm", "HISTCONTROL=ignorespace"}, env...)
	p, err := rt.SpawnSession(argv, env, dir, slave)
	slave.Close()
	if err != nil {
		master.Close()
		return nil, err
	}
	shown := argv
	if kind == Python {
		shown = []string{"python3"} // not the driver's source
	}
	s := &Session{name: name, kind: kind, argv: shown, pid: p.Pid, started: time.Now().UTC(), rt: rt, master: master}
	s.cond = sync.NewCond(&s.mu)
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
	if _, err := master.WriteString(setup); err != nil {
		s.Close()
		return nil, err
	}
	if _, _, err := s.await(context.Background(), id, 10*time.Second, 0, nil); err != nil {
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
		s.cond.Broadcast()
	}()
}

// Rebind attaches the session to a process restored from a template (same PID, same
// terminal): the session runs again, with nothing buffered and no call in flight.
func (s *Session) Rebind(pid int, exit <-chan unix.WaitStatus) {
	s.mu.Lock()
	s.gen++
	s.pid, s.dead, s.exit, s.busy = pid, false, "", false
	s.buf = s.buf[:0]
	gen := s.gen
	slave := s.slave
	s.slave = nil
	s.mu.Unlock()
	if slave != nil {
		slave.Close()
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

// Master is the terminal's master side (termios and window size are read and set
// there).
func (s *Session) Master() *os.File { return s.master }

// TermState is a terminal's line discipline settings and window size, as a checkpoint
// keeps them for its session (a template's terminal is gone by the time it is restored).
type TermState struct {
	termios *unix.Termios
	winsize *unix.Winsize
}

// SaveTerm reads the session's terminal settings (what it cannot read stays unset, and
// RestoreTerm then leaves it as it is).
func (s *Session) SaveTerm() TermState {
	var t TermState
	fd := int(s.master.Fd())
	if tio, err := unix.IoctlGetTermios(fd, unix.TCGETS); err == nil {
		t.termios = tio
	}
	if ws, err := unix.IoctlGetWinsize(fd, unix.TIOCGWINSZ); err == nil {
		t.winsize = ws
	}
	return t
}

// RestoreTerm sets the session's terminal to t (a restore, before its process resumes).
func (s *Session) RestoreTerm(t TermState) {
	fd := int(s.master.Fd())
	if t.termios != nil {
		unix.IoctlSetTermios(fd, unix.TCSETS, t.termios)
	}
	if t.winsize != nil {
		unix.IoctlSetWinsize(fd, unix.TIOCSWINSZ, t.winsize)
	}
}

// OpenPeer opens the terminal's slave through the master (TIOCGPTPEER: no path lookup,
// so nothing in the sandbox can substitute another file), close-on-exec and not as a
// controlling terminal. The caller closes the fd.
func (s *Session) OpenPeer() (int, error) {
	r, _, errno := unix.Syscall(unix.SYS_IOCTL, s.master.Fd(), unix.TIOCGPTPEER, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC)
	if errno != 0 {
		return -1, fmt.Errorf("open the terminal's slave: %w", errno)
	}
	return int(r), nil
}

// PtsPath is the terminal's slave as the sandbox names it (/dev/pts/N).
func (s *Session) PtsPath() (string, error) {
	n, err := unix.IoctlGetUint32(int(s.master.Fd()), unix.TIOCGPTN)
	if err != nil {
		return "", err
	}
	return "/dev/pts/" + strconv.Itoa(int(n)), nil
}

func (s *Session) readLoop() {
	b := make([]byte, 32<<10)
	for {
		n, err := s.master.Read(b)
		s.mu.Lock()
		if n > 0 {
			s.buf = append(s.buf, b[:n]...)
			if s.kind == Command && len(s.buf) > logCap {
				s.buf = append([]byte(nil), s.buf[len(s.buf)-logCap:]...)
			}
		}
		if err != nil {
			// EIO once every holder of the slave is gone.
			s.dead = true
			if s.exit == "" {
				s.exit = "terminal closed"
			}
		}
		s.cond.Broadcast()
		s.mu.Unlock()
		if err != nil {
			return
		}
	}
}

var sentinelRE = regexp.MustCompile("\x1eDBX:([^:\x1e]*):(-?[0-9]+)\x1e")

// Result is one call's outcome.
type Result struct {
	ExitCode  int
	Output    string
	Truncated bool
	TimedOut  bool
	Duration  time.Duration
}

// Run runs code in the session and waits for it. onOutput, if set, receives output as
// it arrives. limit caps the kept output (0: 1 MiB).
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
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.busy = false
		if s.settling != nil {
			close(s.settling)
			s.settling = nil
		}
		s.mu.Unlock()
	}()

	enc := base64.StdEncoding.EncodeToString([]byte(code))
	var w bytes.Buffer
	switch s.kind {
	case Bash:
		w.WriteString(" __db_b=\n")
		for i := 0; i < len(enc); i += chunk {
			fmt.Fprintf(&w, " __db_b+=%s\n", enc[i:min(i+chunk, len(enc))])
		}
		fmt.Fprintf(&w, ` __db_id=%s; __db_c=$(printf %%s "$__db_b" | base64 -d); history -s -- "$__db_c"; eval "$__db_c"`+"\n", id)
	case Python:
		for i := 0; i < len(enc); i += chunk {
			fmt.Fprintf(&w, "C%s\n", enc[i:min(i+chunk, len(enc))])
		}
		fmt.Fprintf(&w, "R%s\n", id)
	}
	start := time.Now()
	if _, err := s.master.Write(w.Bytes()); err != nil {
		return nil, fmt.Errorf("write to session %s: %w", s.name, err)
	}
	out, rc, err := s.await(ctx, id, timeout, limit, onOutput)
	res := &Result{ExitCode: rc, Duration: time.Since(start)}
	// A caller gone (ctx: its client disconnected) interrupts the command as a timeout
	// does, so that the session is idle again, its marker read, before the next call.
	abandoned := err != nil && ctx.Err() != nil && !errors.Is(err, errTimeout)
	if abandoned {
		s.mu.Lock()
		s.settling = make(chan struct{})
		s.mu.Unlock()
	}
	if errors.Is(err, errTimeout) || abandoned {
		res.TimedOut = true
		// Interrupt the command, not the session: ^C reaches the foreground group.
		s.interrupt()
		out2, rc2, err2 := s.await(context.Background(), id, 5*time.Second, limit, onOutput)
		out = append(out, out2...)
		res.ExitCode = rc2
		if err2 != nil {
			// It ignored SIGINT: kill the terminal's foreground group if it is not the
			// session itself.
			if pg, e := unix.IoctlGetInt(int(s.master.Fd()), unix.TIOCGPGRP); e == nil && pg > 1 {
				unix.Kill(-pg, unix.SIGKILL)
			}
			out3, rc3, err3 := s.await(context.Background(), id, 5*time.Second, limit, onOutput)
			out, res.ExitCode = append(out, out3...), rc3
			if err3 != nil {
				return nil, fmt.Errorf("session %s did not come back after its command timed out: %w", s.name, err3)
			}
		}
		if abandoned {
			return nil, fmt.Errorf("session %s: the call was abandoned and its command interrupted: %w", s.name, ctx.Err())
		}
		marker := fmt.Sprintf("\n[deltabox: command timed out after %v and was interrupted; the session lives on]\n", timeout)
		out = append(out, marker...)
		if onOutput != nil {
			onOutput([]byte(marker))
		}
	} else if err != nil {
		return nil, err
	}
	res.Output = string(out)
	if len(res.Output) > limit {
		res.Output = res.Output[:limit] + fmt.Sprintf("\n[deltabox: output truncated at %d bytes; %d more bytes dropped]\n", limit, len(res.Output)-limit)
		res.Truncated = true
	}
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
		fd := int(s.master.Fd())
		sid, err := unix.IoctlGetInt(fd, unix.TIOCGSID)
		shell, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", sid))
		for end := time.Now().Add(200 * time.Millisecond); err == nil && shell != "" && time.Now().Before(end); time.Sleep(time.Millisecond) {
			pg, err := unix.IoctlGetInt(fd, unix.TIOCGPGRP)
			if err != nil {
				break
			}
			if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pg)); pg != sid && exe != shell {
				break
			}
		}
	}
	s.master.Write([]byte{0x03})
}

// busyGrace is how long a call waits for a busy session before it is refused.
const busyGrace = 250 * time.Millisecond

var errTimeout = errors.New("timed out")

// await collects output until the sentinel of call id and returns it (without
// sentinels, with "\r\n" turned into "\n") and the status.
func (s *Session) await(ctx context.Context, id string, timeout time.Duration, limit int, onOutput func([]byte)) ([]byte, int, error) {
	var deadline <-chan time.Time
	if timeout > 0 {
		t := time.NewTimer(timeout)
		defer t.Stop()
		deadline = t.C
	}
	stop := make(chan struct{})
	defer close(stop)
	expired := false
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
	var out []byte
	sent := 0
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		// Consume whole sentinels; keep a trailing partial one for the next read.
		for {
			loc := sentinelRE.FindSubmatchIndex(s.buf)
			if loc == nil {
				break
			}
			out = append(out, s.buf[:loc[0]]...)
			sid := string(s.buf[loc[2]:loc[3]])
			rc, _ := strconv.Atoi(string(s.buf[loc[4]:loc[5]]))
			s.buf = s.buf[loc[1]:]
			if sid == id {
				s.flush(out, &sent, onOutput)
				return clean(out), rc, nil
			}
		}
		hold := bytes.IndexByte(s.buf, 0x1e)
		if hold < 0 {
			hold = len(s.buf)
		}
		out = append(out, s.buf[:hold]...)
		s.buf = s.buf[hold:]
		s.flush(out, &sent, onOutput)
		if limit > 0 && len(out) > 2*limit {
			// Bounded memory: Run keeps limit bytes and reports the truncation.
			out = out[:2*limit]
			sent = min(sent, len(out))
		}
		if s.dead {
			return clean(out), -1, fmt.Errorf("session %s ended during the call (%s)", s.name, s.exit)
		}
		if expired {
			if ctx.Err() != nil {
				return clean(out), -1, ctx.Err()
			}
			return clean(out), -1, errTimeout
		}
		s.cond.Wait()
	}
}

// flush hands output not yet streamed to onOutput. Precondition: mu held.
func (s *Session) flush(out []byte, sent *int, onOutput func([]byte)) {
	if onOutput == nil || len(out) <= *sent {
		return
	}
	onOutput(clean(out[*sent:]))
	*sent = len(out)
}

func clean(b []byte) []byte { return bytes.ReplaceAll(b, []byte("\r\n"), []byte("\n")) }

// Logs returns what a session printed that no call consumed (for a command session:
// the tail of its output, up to 1 MiB).
func (s *Session) Logs() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]byte(nil), s.buf...)
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
	s.mu.Unlock()
	if kill {
		s.rt.Signal(s.Pid(), unix.SIGKILL, true)
	}
	s.master.Close()
}
