// Package criu runs the CRIU binary that scripts/setup.sh builds (CRIU 4.1.1 in
// /opt/deltabox/criu, because Debian bookworm's criu fails `criu check` on this kernel).
//
// Every invocation has a deadline. CRIU stops the code it injects into a dumped
// process (the parasite), and the processes it restores, on a hardware breakpoint
// (PTRACE_POKEUSER of the debug registers) and then waits for that trap without a
// timeout. Some VMs of the kind DeltaBox runs on never deliver the trap: there a plain
// `criu dump --leave-running` of a sleep never returns (measured: still waiting after
// 20 s, the log ending at "Can't setup RLIMIT_NOFILE for self"), while the same dump
// with CRIU's fault-injection switch CRIU_FAULT=130 (FI_NO_BREAKPOINTS: stop with
// PTRACE_SYSCALL instead) takes 0.11 s. Probe finds out, once per process, which way
// works here; Runner then runs every command that way, and a command that still hangs
// is killed, with everything it forked, and reported with the end of its log.
package criu

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"deltabox/internal/deadline"
)

// DefaultPath is where scripts/setup.sh installs CRIU.
const DefaultPath = "/opt/deltabox/criu/sbin/criu"

// Find returns the CRIU binary: DefaultPath if it is there, else criu on PATH.
func Find() (string, error) {
	if st, err := os.Stat(DefaultPath); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
		return DefaultPath, nil
	}
	p, err := exec.LookPath("criu")
	if err != nil {
		return "", fmt.Errorf("no CRIU at %s nor on PATH (scripts/setup.sh builds it): %w", DefaultPath, err)
	}
	return p, nil
}

// Log files CRIU writes into the images directory (-o is relative to -D).
const (
	DumpLog    = "dump.log"
	RestoreLog = "restore.log"
)

// NoBreakpointsEnv is CRIU's fault-injection code FI_NO_BREAKPOINTS
// (criu/include/fault-injection.h): dump and restore stop their tracees with
// PTRACE_SYSCALL instead of a debug-register breakpoint. It is not a fault despite the
// name: CRIU falls back to the same path where the breakpoint cannot be set at all.
const NoBreakpointsEnv = "CRIU_FAULT=130"

// Deadlines. A dump of a 53 MB python3 to tmpfs takes 98 ms here and its restore
// 51 ms, so 30 s is a hang, not a slow run. The self-test dumps a sleep, 0.1 s.
const (
	DumpTimeout    = 30 * time.Second
	RestoreTimeout = 30 * time.Second
	ProbeTimeout   = 5 * time.Second
)

// Mode is how CRIU runs on this machine.
type Mode string

const (
	// Plain: CRIU as it comes; the hardware breakpoints it sets fire.
	Plain Mode = "plain"
	// NoBreakpoints: with NoBreakpointsEnv in its environment, because a plain dump
	// hung or failed and this one worked.
	NoBreakpoints Mode = "no-breakpoints"
	// Unusable: neither way dumped a sleep.
	Unusable Mode = "unusable"
)

// Runner is a CRIU binary and the way it works on this machine, as Probe found out.
// It is what the benches record about CRIU.
type Runner struct {
	Bin  string `json:"bin"`
	Mode Mode   `json:"mode"`
	// Reason says why the mode is not Plain (what the plain self-test did), and for
	// Unusable what both self-tests did.
	Reason string `json:"reason,omitempty"`
	// ProbeS is how long the self-test took, in seconds: on a machine without
	// breakpoints it includes the plain attempt's ProbeTimeout.
	ProbeS float64 `json:"probe_s"`
	// Cached: the answer is an earlier process's, of this boot and this binary
	// (loadProbe); ProbeS is that self-test's.
	Cached bool `json:"cached,omitempty"`
	// Runs, when set, is the directory where each `criu swrk` that package durable
	// starts is recorded while it runs, for the next daemon to end one its dead daemon
	// left working (durable/runs.go).
	Runs string `json:"-"`
}

// Usable says whether CRIU can dump here.
func (r *Runner) Usable() bool { return r.Mode == Plain || r.Mode == NoBreakpoints }

// Env is what CRIU needs in its environment here (besides the caller's).
func (r *Runner) Env() []string {
	if r.Mode == NoBreakpoints {
		return []string{NoBreakpointsEnv}
	}
	return nil
}

func (r *Runner) String() string {
	s := string(r.Mode)
	if r.Mode == NoBreakpoints {
		s += " (" + NoBreakpointsEnv + ")"
	}
	if r.Reason != "" {
		s += ": " + r.Reason
	}
	return fmt.Sprintf("%s; self-test %.2f s", s, r.ProbeS)
}

// Cmd is one CRIU invocation: the exact command line, for callers that record what
// they ran, and what it is allowed to take.
type Cmd struct {
	Argv []string
	Env  []string // added to CRIU's environment (NoBreakpointsEnv where needed)
	// Dir is the images directory and Log the log file in it (-o is relative to -D),
	// quoted on failure.
	Dir, Log string
	What     string // names the command in errors: "criu dump of pid 42"
	Timeout  time.Duration
}

// Line is the command line with its environment, as one would type it.
func (c *Cmd) Line() []string { return append(append([]string(nil), c.Env...), c.Argv...) }

// Dump is `criu dump` of the process tree rooted at pid into dir. With leaveRunning the
// tree goes on running after the dump (else CRIU kills it). -v1 logs errors only, so
// that logging costs the dump nothing measurable.
func (r *Runner) Dump(pid int, dir string, leaveRunning bool) *Cmd {
	a := []string{r.Bin, "dump", "-t", strconv.Itoa(pid), "-D", dir, "-v1", "-o", DumpLog}
	if leaveRunning {
		a = append(a, "--leave-running")
	}
	return &Cmd{Argv: a, Env: r.Env(), Dir: dir, Log: DumpLog, What: fmt.Sprintf("criu dump of pid %d", pid), Timeout: DumpTimeout}
}

// Restore is `criu restore` of the images in dir, detached (-d): the command returns
// once the restored tree runs, which is then reparented to the caller's nearest child
// subreaper (or to init).
func (r *Runner) Restore(dir string) *Cmd {
	return &Cmd{Argv: []string{r.Bin, "restore", "-D", dir, "-d", "-v1", "-o", RestoreLog}, Env: r.Env(),
		Dir: dir, Log: RestoreLog, What: "criu restore from " + dir, Timeout: RestoreTimeout}
}

// Run runs the command. CRIU leads its own process group; past the deadline (or when
// ctx ends) the group is killed and the error quotes the end of CRIU's log. A dumped
// process survives a killed dump (CRIU's tracer exit detaches it).
func (c *Cmd) Run(ctx context.Context) error {
	out, log, err := c.run(ctx)
	if err == nil {
		return nil
	}
	var te *deadline.TimeoutError
	if errors.As(err, &te) {
		hint := fmt.Sprintf("if the log ends after \"Can't setup RLIMIT_NOFILE\", this machine does not deliver hardware "+
			"breakpoints (CRIU waits for ever for the trap): run CRIU with %s, which criu.Probe finds out", NoBreakpointsEnv)
		if slices.Contains(c.Env, NoBreakpointsEnv) {
			hint = "it already ran with " + NoBreakpointsEnv
		}
		return fmt.Errorf("%w; the end of its log %s: %s; %s", err, filepath.Join(c.Dir, c.Log), log, hint)
	}
	return fmt.Errorf("%s failed: %s: %v: %s; the end of its log: %s", c.What, strings.Join(c.Line(), " "), err,
		strings.TrimSpace(string(out)), log)
}

// run runs the command and returns its output and the end of its log, quoted.
func (c *Cmd) run(ctx context.Context) (out []byte, log string, err error) {
	cmd := deadline.Command(ctx, c.Timeout, c.Argv[0], c.Argv[1:]...)
	cmd.What = c.What
	cmd.Env = append(Environ(), c.Env...)
	if out, err = cmd.CombinedOutput(); err == nil {
		return out, "", nil
	}
	log = "(no log)"
	if b, e := os.ReadFile(filepath.Join(c.Dir, c.Log)); e == nil {
		log = strconv.Quote(Tail(strings.TrimSpace(string(b)), 1000))
	}
	return out, log, err
}

// Environ is the caller's environment without CRIU_FAULT, so that a Runner's mode
// alone decides how CRIU runs (what every CRIU command line and `criu swrk` gets).
func Environ() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CRIU_FAULT=") {
			env = append(env, kv)
		}
	}
	return env
}

// Tail is s's last n bytes, with "..." before them when it was cut (CRIU's logs in
// errors).
func Tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}

var (
	probeMu sync.Mutex // held during a self-test: callers of Probe wait for it
	// +checklocks:probeMu
	probed = map[string]*Runner{} // by binary; protected by probeMu
)

// Probe returns how CRIU (bin, or Find's when bin is "") works on this machine. The
// first call per binary runs the self-test: `criu dump --leave-running` of a fresh
// sleep, within ProbeTimeout, plainly, and if that hangs or fails, again with
// NoBreakpointsEnv. The answer is kept for the life of the process (unless ctx ended
// during the self-test) and shared by its callers, who must not change it; a usable one
// is also kept for the rest of the boot, for the next processes (probeRecord). It never
// returns nil.
func Probe(ctx context.Context, bin string) *Runner {
	if bin == "" {
		var err error
		if bin, err = Find(); err != nil {
			return &Runner{Mode: Unusable, Reason: err.Error()}
		}
	}
	probeMu.Lock()
	defer probeMu.Unlock()
	if r := probed[bin]; r != nil {
		return r
	}
	ensureKdatDir()
	if r := loadProbe(bin); r != nil {
		probed[bin] = r
		return r
	}
	start := time.Now()
	r := &Runner{Bin: bin}
	if err := selfTest(ctx, r); err == nil {
		r.Mode = Plain
	} else {
		r.Mode = NoBreakpoints
		if err2 := selfTest(ctx, r); err2 == nil {
			r.Reason = fmt.Sprintf("a plain dump did not work (%v) and one with %s did: this machine does not deliver "+
				"the hardware breakpoints CRIU stops its tracees with", err, NoBreakpointsEnv)
		} else {
			r.Mode, r.Reason = Unusable, fmt.Sprintf("a plain dump did not work (%v), nor one with %s (%v)", err, NoBreakpointsEnv, err2)
		}
	}
	r.ProbeS = float64(time.Since(start).Milliseconds()) / 1000
	if ctx.Err() == nil {
		probed[bin] = r
		saveProbe(bin, r)
	}
	return r
}

// Probe keeps a usable answer in KdatDir for the rest of the boot (a root-only tmpfs
// directory, gone at the next boot, when the machine may differ), keyed by the binary's
// path, inode, size and mtime: the next daemon then starts without a self-test. On a
// machine without breakpoints the plain attempt waits out ProbeTimeout, 5 s that every
// daemon start (and every test daemon) paid before its first dump. An unusable answer
// is not kept: it may be a passing failure.
type probeRecord struct {
	Boot, Bin string
	Ino, Size uint64
	MtimeNS   int64
	Mode      Mode
	Reason    string
	ProbeS    float64
}

func probeKey(bin string) (probeRecord, string, bool) {
	var st syscall.Stat_t
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil || syscall.Stat(bin, &st) != nil {
		return probeRecord{}, "", false
	}
	sum := sha256.Sum256([]byte(bin))
	return probeRecord{Boot: strings.TrimSpace(string(boot)), Bin: bin, Ino: st.Ino, Size: uint64(st.Size), MtimeNS: st.Mtim.Nano()},
		filepath.Join(KdatDir, "probe-"+hex.EncodeToString(sum[:6])+".json"), true
}

func loadProbe(bin string) *Runner {
	key, path, ok := probeKey(bin)
	if !ok || !kdatDirOwned() {
		return nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	var rec probeRecord
	if json.Unmarshal(b, &rec) != nil || rec.Boot != key.Boot || rec.Bin != key.Bin || rec.Ino != key.Ino ||
		rec.Size != key.Size || rec.MtimeNS != key.MtimeNS || (rec.Mode != Plain && rec.Mode != NoBreakpoints) {
		return nil
	}
	return &Runner{Bin: bin, Mode: rec.Mode, Reason: rec.Reason, ProbeS: rec.ProbeS, Cached: true}
}

func saveProbe(bin string, r *Runner) {
	rec, path, ok := probeKey(bin)
	if !ok || !r.Usable() || !kdatDirOwned() {
		return
	}
	rec.Mode, rec.Reason, rec.ProbeS = r.Mode, r.Reason, r.ProbeS
	b, _ := json.Marshal(rec)
	tmp := fmt.Sprintf("%s.%d.tmp", path, os.Getpid())
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return
	}
	_, err = f.Write(b)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil || os.Rename(tmp, path) != nil {
		os.Remove(tmp)
	}
}

// kdatDirOwned reports whether KdatDir is a directory root's alone (ensureKdatDir makes it
// so, unless someone else made it first in the world-writable /dev/shm): only then is
// what it holds trusted.
func kdatDirOwned() bool {
	var st syscall.Stat_t
	return syscall.Lstat(KdatDir, &st) == nil && st.Mode&syscall.S_IFMT == syscall.S_IFDIR && st.Uid == 0 && st.Mode&0o077 == 0
}

// KdatDir is where CRIU (as scripts/setup.sh builds it: RUNDIR) keeps what it found
// out about the kernel, criu.kdat, which it writes into KdatTemp first (O_EXCL) and
// renames. CRIU keeps it only on a tmpfs, and /run is not one on this machine kind:
// every run probed the kernel again, 50-100 ms of each dump and restore (a restore's
// log: "File /run/criu.kdat does not exist", 83 ms to "PAGEMAP_SCAN is supported",
// a veth made...). /dev/shm is a tmpfs but anyone may write there, and CRIU trusts the
// file: the directory must be root's alone (ensureKdatDir).
const (
	KdatDir  = "/dev/shm/deltabox-criu"
	KdatTemp = KdatDir + "/criu.kdat.tmp"
)

// ensureKdatDir makes KdatDir root's alone: made if missing (after a boot), replaced
// if anyone else could have written in it.
func ensureKdatDir() {
	var st syscall.Stat_t
	if err := syscall.Lstat(KdatDir, &st); err == nil {
		if st.Mode&syscall.S_IFMT == syscall.S_IFDIR && st.Uid == 0 && st.Mode&0o077 == 0 {
			clearStaleKdat()
			return
		}
		os.RemoveAll(KdatDir)
	}
	os.Mkdir(KdatDir, 0o700)
}

// clearStaleKdat removes a KdatTemp that a CRIU killed while saving left behind: CRIU
// skips its save while that file exists, so every later run would probe again. One a
// minute old is no running CRIU's: a save takes microseconds.
func clearStaleKdat() {
	if st, err := os.Stat(KdatTemp); err == nil && time.Since(st.ModTime()) > time.Minute {
		os.Remove(KdatTemp)
	}
}

// selfTest dumps a fresh sleep the way r runs CRIU and checks that it goes on running.
func selfTest(ctx context.Context, r *Runner) error {
	dir, err := os.MkdirTemp("", "deltabox-criu-probe-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	// Its own session, stdio on /dev/null: what CRIU dumps without --shell-job. Killed
	// when the self-test returns (deferred below), or with ctx.
	sleep := exec.CommandContext(ctx, "sleep", "1000")
	sleep.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL}
	if err := sleep.Start(); err != nil {
		return fmt.Errorf("start a sleep to dump: %w", err)
	}
	defer func() { sleep.Process.Kill(); sleep.Wait() }()
	c := r.Dump(sleep.Process.Pid, dir, true)
	c.Timeout = ProbeTimeout
	c.What = fmt.Sprintf("criu dump of a sleep (pid %d)", sleep.Process.Pid)
	if out, log, err := c.run(ctx); err != nil {
		if len(out) > 0 {
			log = strings.TrimSpace(string(out)) + " " + log
		}
		return fmt.Errorf("%w; its log: %s", err, log)
	}
	if _, err := os.Stat(filepath.Join(dir, "inventory.img")); err != nil {
		return fmt.Errorf("criu dump exited 0 but wrote no images: %w", err)
	}
	if st := procState(sleep.Process.Pid); st != "S" && st != "R" {
		return fmt.Errorf("the dumped sleep is in state %q after --leave-running, want S or R", st)
	}
	return nil
}

// procState is the state letter of /proc/PID/stat ("" if it cannot be read).
func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	// pid (comm) S ...: comm may hold spaces and parentheses.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	if len(f) == 0 {
		return ""
	}
	return f[0]
}
