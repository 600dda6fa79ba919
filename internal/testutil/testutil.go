// Package testutil starts real daemons for tests. Tests run as root and really mount,
// fork and ptrace; a test that cannot run skips with the reason, and with CI=true such
// a skip fails instead (Require).
package testutil

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/cgroup"
	"deltabox/internal/client"
	"deltabox/internal/deadline"
	"deltabox/internal/store"
	"deltabox/internal/testutil/skip"
)

// Require skips t with reason unless ok; under CI=true it fails instead, so that CI
// cannot pass with privileged tests silently skipped.
func Require(t testing.TB, ok bool, reason string, args ...any) {
	t.Helper()
	skip.Require(t, ok, reason, args...)
}

// Command is a child process of a test with a deadline: it leads its own process
// group, which is killed when timeout passes or the test ends, and its error then
// names it (internal/deadline). A hung child fails its test instead of the whole run.
func Command(t testing.TB, timeout time.Duration, name string, args ...string) *deadline.Cmd {
	t.Helper()
	return deadline.Command(t.Context(), timeout, name, args...)
}

// MainRoot is the store that scripts/setup.sh prepares.
func MainRoot() string {
	if r := os.Getenv("DELTABOX_ROOT"); r != "" {
		return r
	}
	return store.DefaultRoot
}

// RequireStore checks that this is root on a machine set up by scripts/setup.sh.
func RequireStore(t testing.TB) {
	t.Helper()
	Require(t, os.Geteuid() == 0, "needs root (mounts, namespaces, cgroups)")
	err := store.CheckFS(MainRoot())
	Require(t, err == nil, "no reflink store at %s (run scripts/setup.sh): %v", MainRoot(), err)
	_, err = os.Stat(filepath.Join(MainRoot(), "images", "default", "image.json"))
	Require(t, err == nil, "no default image in %s (run scripts/setup.sh)", MainRoot())
}

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// raceDaemon (DELTABOX_TEST_RACE=1) builds the daemon with the race detector; a test
// whose daemon reported a data race (in its log) then fails at Stop.
var raceDaemon = os.Getenv("DELTABOX_TEST_RACE") == "1"

// Binary builds cmd/deltabox once per test process and returns its path.
func Binary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		_, file, _, _ := runtime.Caller(0)
		repo := filepath.Join(filepath.Dir(file), "..", "..")
		dir, err := os.MkdirTemp("", "deltabox-bin-")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "deltabox")
		// scripts/build.sh, as every script builds it: the small init inside, built
		// in a temporary directory of its own (test packages build at once).
		// Generous: a build from cold module and build caches, not a hang.
		// -tags testhooks: the crash points (DELTABOX_CRASH_AT) of the state package.
		args := []string{filepath.Join("scripts", "build.sh"), "-o", binPath, "-tags", "testhooks"}
		if raceDaemon {
			args = append(args, "-race")
		}
		cmd := deadline.Command(context.Background(), 10*time.Minute, "bash", args...)
		cmd.Dir = repo
		out, err := cmd.CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("scripts/build.sh: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

// Main runs a test package's tests and then removes the daemon binary Binary built for
// them (34 MB in a temporary directory per package run: left behind, they filled this
// machine's root filesystem). A package whose tests call Binary or start a daemon has
// `func TestMain(m *testing.M) { os.Exit(testutil.Main(m)) }`.
func Main(m *testing.M) int {
	code := m.Run()
	if binPath != "" {
		if err := os.RemoveAll(filepath.Dir(binPath)); err != nil {
			fmt.Fprintf(os.Stderr, "testutil: remove the test binary: %v\n", err)
		}
	}
	return code
}

// Daemon is a daemon started for a test, on its own store (a directory of the main
// reflink store, sharing its images) and its own socket.
type Daemon struct {
	Root   string
	Socket string
	C      *client.Client
	cmd    *exec.Cmd
	t      testing.TB
	log    *os.File
}

// NewStore makes an empty test store under the main store and returns its root.
func NewStore(t testing.TB) string {
	t.Helper()
	RequireStore(t)
	b := make([]byte, 4)
	rand.Read(b)
	root := filepath.Join(MainRoot(), "tests", t.Name()+"-"+hex.EncodeToString(b))
	root = filepath.Clean(root)
	// The main store hardened as a daemon on it would (scripts/setup.sh mounts it so):
	// a test's store, a directory of it, is then nosuid without a bind of its own, and
	// its overlays name their layers by the store's path (tests look for them so).
	if err := store.Harden(MainRoot()); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(root, "images"), 0o700); err != nil {
		t.Fatal(err)
	}
	// Share the main store's images: same filesystem, so copy-up still reflinks.
	ims, _ := os.ReadDir(filepath.Join(MainRoot(), "images"))
	for _, im := range ims {
		if im.Name()[0] == '.' {
			continue
		}
		os.Symlink(filepath.Join(MainRoot(), "images", im.Name()), filepath.Join(root, "images", im.Name()))
	}
	t.Cleanup(func() {
		// Sandboxes outlive their daemon (a test's daemon is stopped or killed before
		// this runs): end what is left of this store's, by its cgroups.
		EndSandboxes(root)
		// A daemon binds the store onto itself if it is not nosuid (store.Harden):
		// not here (see above) unless the main store was made suid again meanwhile.
		unix.Unmount(root, unix.MNT_DETACH)
		if !t.Failed() {
			os.RemoveAll(root)
		}
	})
	return root
}

// NewSmallStore loop-mounts a fresh reflink XFS of mib MiB as a store, with the main
// store's images linked in (NewStore does the same on the main store): a store of its
// own filesystem, where it can be filled, and where a disk pass (one BULKSTAT of the
// whole filesystem, by XFS project: state/diskquota.go) counts no other store's layers.
func NewSmallStore(t testing.TB, mib int) string {
	t.Helper()
	RequireStore(t)
	_, err := exec.LookPath("mkfs.xfs")
	Require(t, err == nil, "no mkfs.xfs: %v", err)
	dir := t.TempDir()
	img, root := filepath.Join(dir, "store.img"), filepath.Join(dir, "root")
	run := func(name string, args ...string) {
		t.Helper()
		if out, err := Command(t, time.Minute, name, args...).CombinedOutput(); err != nil {
			t.Fatalf("%s %v: %v\n%s", name, args, err, out)
		}
	}
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(int64(mib) << 20)
	f.Close()
	run("mkfs.xfs", "-q", "-m", "reflink=1", img)
	os.Mkdir(root, 0o700)
	run("mount", "-o", "loop", img, root)
	t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
	// Run before the unmount (cleanups run last first): the sandboxes outlive their daemon.
	t.Cleanup(func() { EndSandboxes(root) })
	os.Mkdir(filepath.Join(root, "images"), 0o700)
	ims, _ := os.ReadDir(filepath.Join(MainRoot(), "images"))
	for _, im := range ims {
		if im.Name()[0] != '.' {
			os.Symlink(filepath.Join(MainRoot(), "images", im.Name()), filepath.Join(root, "images", im.Name()))
		}
	}
	return root
}

// EndSandboxes kills every process of the sandboxes of the store at root, through the
// cgroup2 directory its daemons use (cgroup.SetRootFor), and waits until they are gone.
func EndSandboxes(root string) {
	dir := cgroup.RootFor(root)
	os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0)
	for i := 0; i < 500; i++ {
		b, err := os.ReadFile(filepath.Join(dir, "cgroup.events"))
		if err != nil || strings.Contains(string(b), "populated 0") {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Then the store's cgroup directories, v2 and v1 (a daemon removes only its empty
	// roots at shutdown, and the sandboxes of a test's daemon outlive it): 8,800 left by
	// earlier runs made every walk of /sys/fs/cgroup take seconds on this machine.
	removeCgroupTree(dir)
	v1, _ := filepath.Glob(filepath.Join(cgroup.V1Mount, "*", filepath.Base(dir)+"*"))
	for _, d := range v1 {
		removeCgroupTree(d)
	}
}

// removeCgroupTree removes the cgroup directory dir and its descendants, deepest
// first; a group that still holds a process stays (rmdir: EBUSY).
func removeCgroupTree(dir string) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if e.IsDir() {
			removeCgroupTree(filepath.Join(dir, e.Name()))
		}
	}
	unix.Rmdir(dir)
}

// The parent-death signal (PR_SET_PDEATHSIG) is sent when the *thread* that forked the
// child exits, not the process: a daemon started from a Go thread that a locked
// goroutine later ends (a remote.Tracer closed, a CRIU call whose thread cannot be put
// back) was killed with SIGKILL mid-test (TestCheckCopyImage run twice: the second
// daemon died 0.3 s after it started). Daemons are started from one thread that is
// locked for the life of the test process and never exits.
var spawner struct {
	once sync.Once
	reqs chan spawnReq
}

type spawnReq struct {
	cmd  *exec.Cmd
	done chan error
}

func startFromLastingThread(cmd *exec.Cmd) error {
	spawner.once.Do(func() {
		spawner.reqs = make(chan spawnReq)
		go func() {
			runtime.LockOSThread() // never unlocked: this thread outlives every daemon
			for r := range spawner.reqs {
				r.done <- r.cmd.Start()
			}
		}()
	})
	done := make(chan error, 1)
	spawner.reqs <- spawnReq{cmd, done}
	return <-done
}

// StartDaemon starts a daemon on a fresh test store.
func StartDaemon(t testing.TB) *Daemon {
	t.Helper()
	return StartDaemonOn(t, NewStore(t))
}

// StartDaemonNoImages starts a daemon on a fresh test store without durable images
// (DELTABOX_DURABLE=0): for tests of the templates' memory and the template budget, which
// the images' short-lived copies of templates (they share the templates' pages, and are
// evictions' precondition) would blur.
func StartDaemonNoImages(t testing.TB) *Daemon {
	t.Helper()
	return StartDaemonEnv(t, NewStore(t), "DELTABOX_DURABLE=0")
}

// StartDaemonOn starts a daemon on root (reused across a restart).
func StartDaemonOn(t testing.TB, root string) *Daemon {
	t.Helper()
	return StartDaemonEnv(t, root)
}

// StartDaemonEnv starts a daemon on root with env (NAME=VALUE) added to its environment.
func StartDaemonEnv(t testing.TB, root string, env ...string) *Daemon {
	t.Helper()
	return StartDaemonArgs(t, root, nil, env...)
}

// StartDaemonArgs starts a daemon on root with more arguments (--listen ADDR) and env.
func StartDaemonArgs(t testing.TB, root string, args []string, env ...string) *Daemon {
	t.Helper()
	d := &Daemon{Root: root, Socket: filepath.Join(root, "deltabox.sock"), t: t}
	var err error
	d.log, err = os.OpenFile(filepath.Join(root, "daemon.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	// Not waited for until Stop, which gives it 20 s; it must answer within 20 s.
	d.cmd = exec.Command(Binary(t), append([]string{"daemon", "--root", root, "--socket", d.Socket}, args...)...)
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	if len(env) > 0 {
		d.cmd.Env = append(os.Environ(), env...)
	}
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := startFromLastingThread(d.cmd); err != nil {
		t.Fatal(err)
	}
	d.C = client.New(d.Socket)
	deadline := time.Now().Add(20 * time.Second)
	for {
		if err := d.C.Health(context.Background()); err == nil {
			break
		}
		if time.Now().After(deadline) {
			d.Stop()
			log, _ := os.ReadFile(filepath.Join(root, "daemon.log"))
			t.Fatalf("daemon did not answer within 20s; log:\n%s", log)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Cleanup(d.Stop)
	return d
}

// Stop stops the daemon gracefully (SIGTERM); its sandboxes keep running (unless it runs
// with DELTABOX_STOP_SANDBOXES=1), for the next daemon on the store or NewStore's
// cleanup (EndSandboxes).
func (d *Daemon) Stop() {
	if d.cmd == nil || d.cmd.Process == nil {
		return
	}
	d.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { d.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		d.cmd.Process.Kill()
		<-done
	}
	d.cmd = nil
	d.log.Close()
	if raceDaemon {
		if log := d.Log(); strings.Contains(log, "WARNING: DATA RACE") {
			d.t.Errorf("the daemon reported a data race; its log:\n%s", log)
		}
	}
}

// Kill kills the daemon with SIGKILL, as a crash would.
func (d *Daemon) Kill() {
	if d.cmd == nil {
		return
	}
	d.cmd.Process.Kill()
	d.cmd.Wait()
	d.cmd = nil
	d.log.Close()
}

// Pid returns the daemon's process id (0 when it is not running).
func (d *Daemon) Pid() int {
	if d.cmd == nil || d.cmd.Process == nil {
		return 0
	}
	return d.cmd.Process.Pid
}

// Log returns the daemon's log so far.
func (d *Daemon) Log() string {
	b, _ := os.ReadFile(filepath.Join(d.Root, "daemon.log"))
	return string(b)
}

// StartRemoteDaemon starts a daemon on a fresh store that also listens on a free
// loopback TCP port (`--listen`; args add TLS), and returns it with that address once
// the listener accepts.
func StartRemoteDaemon(t testing.TB, args ...string) (*Daemon, string) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	d := StartDaemonArgs(t, NewStore(t), append([]string{"--listen", addr}, args...))
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
			return d, addr
		}
		if time.Now().After(deadline) {
			t.Fatalf("the daemon does not listen on %s within 10 s; log:\n%s", addr, d.Log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// NewKey makes an API key named name in d's root with `deltabox key create`; the key is
// its output's last line.
func NewKey(t testing.TB, d *Daemon, name string) string {
	t.Helper()
	out, err := Command(t, time.Minute, Binary(t), "key", "create", name, "--root", d.Root).Output()
	if err != nil {
		t.Fatalf("deltabox key create %s: %v", name, err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	k := lines[len(lines)-1]
	if !strings.HasPrefix(k, "e2b_") || len(k) != 44 {
		t.Fatalf("key create printed %q: want e2b_ and 40 hex digits on the last line", out)
	}
	return k
}
