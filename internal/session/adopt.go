package session

import (
	"encoding/json"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/sandbox"
)

// A session outlives its daemon: the sandbox's init keeps a duplicate of its terminal's
// master (Keep), so that the terminal does not hang up when the daemon's master closes
// (the session's leader would get SIGHUP: bash and python end), and the next daemon
// takes it back (Adopt). A call that was running when the daemon went is lost: its
// output went to a terminal nobody read, and its sentinel names an id no call awaits.

// Keep hands the sandbox's init a duplicate of the session's master, with data, under
// key (sandbox.Sandbox.Keep), replacing what init kept there.
func (s *Session) Keep(key, data string) error {
	var err error
	if cerr := s.control(func(fd int) { err = s.rt.Keep(key, data, fd) }); cerr != nil {
		return cerr
	}
	return err
}

// Forget makes the sandbox's init close what it kept under key (Keep).
func (s *Session) Forget(key string) error { return s.rt.Forget(key) }

// Started is when the session's process started.
func (s *Session) Started() time.Time { return s.started }

// Adopt makes a session of a process a previous daemon started, on master (the
// terminal's master that the sandbox's init kept; Adopt owns it): pid is the process in
// the sandbox and exit its Watch.
func Adopt(rt *sandbox.Sandbox, name string, kind Kind, argv []string, pid int, started time.Time, master *os.File, exit <-chan unix.WaitStatus) (*Session, error) {
	m, err := pollable(master)
	if err != nil {
		return nil, err
	}
	s := &Session{name: name, kind: kind, argv: argv, pid: pid, started: started, rt: rt, master: m, log: newLogBuf(logCap)}
	s.cond = sync.NewCond(&s.mu) // +checklocksignore: construction
	go s.readLoop()
	s.watch(exit, 0)
	return s, nil
}

// termWire is TermState's JSON form (a node's process record in the index).
type termWire struct {
	Termios *unix.Termios `json:"termios,omitempty"`
	Winsize *unix.Winsize `json:"winsize,omitempty"`
	Log     []byte        `json:"log,omitempty"`
	Dropped int64         `json:"dropped,omitempty"`
}

// MarshalJSON encodes t for the index.
func (t TermState) MarshalJSON() ([]byte, error) {
	return json.Marshal(termWire{t.termios, t.winsize, t.log, t.dropped})
}

// UnmarshalJSON decodes MarshalJSON's form.
func (t *TermState) UnmarshalJSON(b []byte) error {
	var w termWire
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*t = TermState{termios: w.Termios, winsize: w.Winsize, log: w.Log, dropped: w.Dropped}
	return nil
}
