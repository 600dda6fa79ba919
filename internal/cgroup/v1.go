package cgroup

// Limits through the cgroup v1 controllers.
//
// On this machine kind the cgroup2 hierarchy (Root) has no controllers: the memory, pids,
// cpu and cpuacct controllers are mounted as v1 hierarchies under V1Mount. Each sandbox
// gets one directory per controller, named like its cgroup2 directory:
// V1Mount/CONTROLLER/deltabox[-hash]/ID.
//
// Who is in them: not the sandbox's init. Init is a Go program, and the Go runtime dies
// ("runtime: failed to create new OS thread") when a thread cannot be created, which is
// exactly what a pids limit does to everything in its cgroup while a fork bomb fills it;
// a memory or CPU limit would likewise let a runaway command slow down or OOM-kill the
// process that has to kill it. Instead the daemon opens each directory's "tasks" file
// and hands the fds to init (sbinit.StartOptions.CgroupTasks), and init's spawn thread
// writes "0" (itself) into them just before it forks: v1 places single threads, a child
// inherits the cgroups of the thread that forked it, and the spawn thread dies right
// after the fork. So every process the sandbox runs, and all of its descendants, are
// inside the limits from their first instruction; init stays outside them (it still is
// in the cgroup2 directory, which tracks and kills everything).

import (
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
)

// V1Mount is where the v1 controller hierarchies are mounted.
var V1Mount = "/sys/fs/cgroup"

// v1Controllers are the hierarchies a sandbox gets a directory in. cpuacct only reads
// usage, and is optional; freezer holds no limit, only each exec's group (exec.go).
var v1Controllers = []string{"memory", "pids", "cpu", "cpuacct", "freezer"}

func v1Optional(ctrl string) bool { return ctrl == "cpuacct" }

// cfsPeriodUS is the CFS bandwidth period: CPUs=1.5 allows 150 ms of CPU time per 100 ms.
const cfsPeriodUS = 100_000

// Limits are one sandbox's resource limits (the fields say what each caps). Zero fields
// mean "the default" (WithDefaults); the state manager stores the resolved values with
// the sandbox. The wire form is defined once, in apitypes.
type Limits = apitypes.Limits

// Default limits. Limits are containment, not reservation: they are not summed
// against the host, so the defaults are generous for one agent's work (package
// installs, compilers, test suites) and only stop a runaway before it hurts the host.
//
//   - Memory: 4 GiB, or half the host's RAM if that is less. A sandbox that exceeds it is
//     OOM-killed inside its own cgroup; without a cap it would push the whole machine into
//     global OOM, where the kernel may pick the daemon or another sandbox.
//   - Pids: 1024 processes and threads. Enough for make -j, thread pools and test runners
//     (threads count too); a fork bomb stops at 1024 instead of exhausting the host's
//     pid space (pid_max is 32768 on this machine kind) and kernel memory.
//   - CPUs: the host's CPU count, i.e. no throttling. Each sandbox has its own cpu cgroup,
//     so CFS already shares contended CPUs fairly between sandboxes (equal weights,
//     however many processes each runs); a default quota would only leave idle cores idle.
const (
	DefaultMemoryBytes int64 = 4 << 30
	DefaultPids        int64 = 1024
)

// Bounds accepted at create time.
const (
	MinMemoryBytes int64   = 16 << 20 // below this, a shell and a tool or two do not start
	MinPids        int64   = 8        // a shell, a pipeline of a few commands
	MaxPids        int64   = 1 << 22  // the kernel's PID_MAX_LIMIT
	MinCPUs        float64 = 0.01     // the kernel refuses a CFS quota under 1 ms
)

// HostMemoryBytes is the host's RAM.
func HostMemoryBytes() int64 {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		return 0
	}
	return int64(si.Totalram) * int64(si.Unit)
}

// HostCPUs is the number of CPUs the daemon may run on.
func HostCPUs() int { return runtime.NumCPU() }

// DefaultLimits are the limits of a sandbox created without any (see the constants).
func DefaultLimits() Limits {
	mem := DefaultMemoryBytes
	if h := HostMemoryBytes(); h > 0 && h/2 < mem {
		mem = h / 2
	}
	return Limits{MemoryBytes: mem, Pids: DefaultPids, CPUs: float64(HostCPUs())}
}

// WithDefaults returns l with its zero fields replaced by the defaults.
func WithDefaults(l Limits) Limits {
	d := DefaultLimits()
	if l.MemoryBytes == 0 {
		l.MemoryBytes = d.MemoryBytes
	}
	if l.Pids == 0 {
		l.Pids = d.Pids
	}
	if l.CPUs == 0 {
		l.CPUs = d.CPUs
	}
	return l
}

// CheckLimits validates limits asked for at create time (zero fields: default). The
// error says what is accepted.
func CheckLimits(l Limits) error {
	var errs []error
	host := HostMemoryBytes()
	switch {
	case l.MemoryBytes < 0:
		errs = append(errs, fmt.Errorf("memory must be positive (0: the default)"))
	case l.MemoryBytes > 0 && l.MemoryBytes < MinMemoryBytes:
		errs = append(errs, fmt.Errorf("memory %d MiB is under the minimum of %d MiB", l.MemoryBytes>>20, MinMemoryBytes>>20))
	case host > 0 && l.MemoryBytes > host:
		errs = append(errs, fmt.Errorf("memory %d MiB is more than the host's %d MiB of RAM", l.MemoryBytes>>20, host>>20))
	}
	switch {
	case l.Pids < 0:
		errs = append(errs, fmt.Errorf("pids must be positive (0: the default)"))
	case l.Pids > 0 && l.Pids < MinPids:
		errs = append(errs, fmt.Errorf("pids %d is under the minimum of %d", l.Pids, MinPids))
	case l.Pids > MaxPids:
		errs = append(errs, fmt.Errorf("pids %d is over the kernel's maximum of %d", l.Pids, MaxPids))
	}
	switch {
	case math.IsNaN(l.CPUs) || l.CPUs < 0:
		errs = append(errs, fmt.Errorf("cpus must be positive (0: the default)"))
	case l.CPUs > 0 && l.CPUs < MinCPUs:
		errs = append(errs, fmt.Errorf("cpus %g is under the minimum of %g", l.CPUs, MinCPUs))
	case l.CPUs > float64(HostCPUs()):
		errs = append(errs, fmt.Errorf("cpus %g is more than the host's %d CPUs", l.CPUs, HostCPUs()))
	}
	return errors.Join(errs...)
}

// Usage is what a sandbox's processes use, read from its v1 cgroups (V1.Usage). The
// wire form is defined once, in apitypes.
type Usage = apitypes.Usage

// V1 is one sandbox's directories in the v1 hierarchies.
type V1 struct {
	ID   string
	dirs map[string]string // controller -> directory

	// memory.oom_control and memory.usage_in_bytes, kept open once read: a pread takes
	// ~4 µs, an open and read ~35 µs (measured here), and they are read after every
	// exec (OOMKills) and in every checkpoint's and restore's answer (MemoryUsage).
	oomFile, usageFile keptFile
}

// keptFile is a cgroup file opened on its first read and kept open for the next ones.
type keptFile struct {
	once sync.Once
	f    *os.File
}

// read reads p from offset 0 through the kept fd; false if that fails (the caller
// reads it the usual way).
func (k *keptFile) read(p string, b []byte) ([]byte, bool) {
	k.once.Do(func() { k.f, _ = os.Open(p) })
	if k.f == nil {
		return nil, false
	}
	n, err := k.f.ReadAt(b, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, false
	}
	return b[:n], true
}

// close closes the fd; no read opens it again.
func (k *keptFile) close() {
	k.once.Do(func() {})
	if k.f != nil {
		k.f.Close()
	}
}

// v1Parent is this daemon's directory in one hierarchy (the per-store name of Root).
func v1Parent(ctrl string) string { return filepath.Join(V1Mount, ctrl, filepath.Base(Root)) }

func v1Mounted(ctrl string) bool {
	_, err := os.Stat(filepath.Join(V1Mount, ctrl, "cgroup.procs"))
	return err == nil
}

// CreateV1 makes (or reuses) the sandbox's v1 directories and sets l (WithDefaults).
// A required controller that is not mounted is an error: limits are never silently
// dropped.
func CreateV1(id string, l Limits) (_ *V1, err error) {
	v := &V1{ID: id, dirs: map[string]string{}}
	defer func() {
		if err != nil {
			v.Destroy(time.Second)
		}
	}()
	for _, c := range v1Controllers {
		if !v1Mounted(c) {
			if v1Optional(c) {
				continue
			}
			what := "sandbox limits"
			if c == execController {
				what = "the end of what a timed-out exec started"
			}
			return nil, fmt.Errorf("the cgroup v1 %s controller is not mounted at %s, so %s cannot be enforced (run scripts/setup.sh)", c, filepath.Join(V1Mount, c), what)
		}
		d := filepath.Join(v1Parent(c), id)
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("create cgroup %s: %w", d, err)
		}
		v.dirs[c] = d
	}
	if err := v.SetLimits(WithDefaults(l)); err != nil {
		return nil, err
	}
	return v, nil
}

func writeFile(p, s string) error {
	if err := os.WriteFile(p, []byte(s), 0); err != nil {
		return fmt.Errorf("write %q to %s: %w", s, p, err)
	}
	return nil
}

func readInt(p string) int64 {
	b, err := os.ReadFile(p)
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return n
}

// readKey reads "key value" lines (memory.oom_control, pids.events, cpu.stat).
func readKey(p, key string) int64 {
	b, err := os.ReadFile(p)
	if err != nil {
		return 0
	}
	return parseKey(b, key)
}

// parseKey is readKey on the file's content.
func parseKey(b []byte, key string) int64 {
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && f[0] == key {
			n, _ := strconv.ParseInt(f[1], 10, 64)
			return n
		}
	}
	return 0
}

// SetMemoryLimit sets the memory limit alone (memory and memory+swap). Lowering it under
// the usage makes the kernel reclaim; it fails with EBUSY when it cannot, the limit
// unchanged.
func (v *V1) SetMemoryLimit(b int64) error {
	d := v.dirs["memory"]
	if d == "" {
		return nil
	}
	// memory.memsw (memory+swap) must stay >= memory.limit: raise it first when
	// growing, lower the limit first when shrinking. Capping memsw at the same value
	// means a sandbox cannot escape its limit into swap.
	lim := filepath.Join(d, "memory.limit_in_bytes")
	sw := filepath.Join(d, "memory.memsw.limit_in_bytes")
	val := strconv.FormatInt(b, 10)
	_, swErr := os.Stat(sw)
	order := []string{lim, sw}
	if b > readInt(lim) {
		order = []string{sw, lim}
	}
	for _, p := range order {
		if p == sw && swErr != nil {
			continue // no swap accounting in this kernel
		}
		if err := writeFile(p, val); err != nil {
			return err
		}
	}
	return nil
}

// SetLimits writes l (which must have no zero field) into the controllers.
func (v *V1) SetLimits(l Limits) error {
	if l.MemoryBytes <= 0 || l.Pids <= 0 || l.CPUs <= 0 {
		return fmt.Errorf("SetLimits(%+v): every limit must be set (WithDefaults)", l)
	}
	if err := v.SetMemoryLimit(l.MemoryBytes); err != nil {
		return err
	}
	if d := v.dirs["memory"]; d != "" {
		// Keep the OOM killer on (the default): a runaway is killed inside the sandbox
		// rather than left hanging in the allocator.
		if err := writeFile(filepath.Join(d, "memory.oom_control"), "0"); err != nil {
			return err
		}
	}
	if d := v.dirs["pids"]; d != "" {
		if err := writeFile(filepath.Join(d, "pids.max"), strconv.FormatInt(l.Pids, 10)); err != nil {
			return err
		}
	}
	if d := v.dirs["cpu"]; d != "" {
		quota := int64(-1) // no throttling
		if l.CPUs < float64(HostCPUs()) {
			quota = int64(math.Round(l.CPUs * cfsPeriodUS))
		}
		// Only a value that differs is written: each write of either file walks every
		// CPU cgroup of the host (the kernel's tg_set_bandwidth checks the whole tree's
		// quotas under one mutex), and a new group already has the period and no quota,
		// what a sandbox without a CPU limit below the host's asks (every fork branch).
		period, quotaFile := filepath.Join(d, "cpu.cfs_period_us"), filepath.Join(d, "cpu.cfs_quota_us")
		if readInt(period) != cfsPeriodUS {
			if err := writeFile(period, strconv.Itoa(cfsPeriodUS)); err != nil {
				return err
			}
		}
		if b, err := os.ReadFile(quotaFile); err != nil || strings.TrimSpace(string(b)) != strconv.FormatInt(quota, 10) {
			if err := writeFile(quotaFile, strconv.FormatInt(quota, 10)); err != nil {
				return err
			}
		}
	}
	return nil
}

// OpenTasks opens the "tasks" file of each directory for writing; a thread that writes
// "0" into them joins the sandbox's limits (see the package comment of this file).
// The caller closes the files.
func (v *V1) OpenTasks() ([]*os.File, error) {
	var out []*os.File
	for _, c := range v1Controllers {
		d := v.dirs[c]
		if d == "" {
			continue
		}
		f, err := os.OpenFile(filepath.Join(d, "tasks"), os.O_WRONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			for _, o := range out {
				o.Close()
			}
			return nil, err
		}
		out = append(out, f)
	}
	return out, nil
}

// Usage reads the current usage.
func (v *V1) Usage() Usage {
	var u Usage
	if d := v.dirs["memory"]; d != "" {
		u.MemoryBytes = readInt(filepath.Join(d, "memory.usage_in_bytes"))
		u.MemoryPeakBytes = readInt(filepath.Join(d, "memory.max_usage_in_bytes"))
		u.OOMKills = readKey(filepath.Join(d, "memory.oom_control"), "oom_kill")
	}
	if d := v.dirs["pids"]; d != "" {
		u.Pids = readInt(filepath.Join(d, "pids.current"))
		u.PidsPeak = readInt(filepath.Join(d, "pids.peak"))
		u.PidsLimitHits = readKey(filepath.Join(d, "pids.events"), "max")
	}
	if d := v.dirs["cpuacct"]; d != "" {
		u.CPUNanos = readInt(filepath.Join(d, "cpuacct.usage"))
	}
	if d := v.dirs["cpu"]; d != "" {
		if b, err := os.ReadFile(filepath.Join(d, "cpu.stat")); err == nil { // one read for both
			u.CPUThrottled, u.CPUThrottledNS = parseKey(b, "nr_throttled"), parseKey(b, "throttled_time")
		}
	}
	return u
}

// MemoryAnon is the part of the memory usage that reclaim cannot free: anonymous and
// shared memory (memory.stat's total_rss + total_shmem), without the page cache, which
// a sandbox that wrote a large workspace holds a lot of (a longer read than
// MemoryUsage's: memory.stat has some forty lines).
func (v *V1) MemoryAnon() int64 {
	d := v.dirs["memory"]
	if d == "" {
		return 0
	}
	b, err := os.ReadFile(filepath.Join(d, "memory.stat"))
	if err != nil {
		return 0
	}
	return parseKey(b, "total_rss") + parseKey(b, "total_shmem")
}

// MemoryUsage is Usage's MemoryBytes alone (one read, for answers that report it).
func (v *V1) MemoryUsage() int64 {
	d := v.dirs["memory"]
	if d == "" {
		return 0
	}
	p := filepath.Join(d, "memory.usage_in_bytes")
	var b [64]byte
	if c, ok := v.usageFile.read(p, b[:]); ok {
		n, _ := strconv.ParseInt(strings.TrimSpace(string(c)), 10, 64)
		return n
	}
	return readInt(p)
}

// V1MemoryUsageAll is the memory usage of every sandbox of this daemon together: their
// v1 memory parent's usage (hierarchical accounting, always on in this kernel), one
// pread of the file OpenV1MemoryUsageAll keeps open (each checkpoint's admission reads
// it), else one read. 0 if it cannot be read.
func V1MemoryUsageAll() int64 {
	p := filepath.Join(v1Parent("memory"), "memory.usage_in_bytes")
	parentUsage.mu.Lock()
	f := parentUsage.f
	parentUsage.mu.Unlock()
	if f != nil {
		var b [64]byte
		if n, err := f.ReadAt(b[:], 0); err == nil || errors.Is(err, io.EOF) {
			v, _ := strconv.ParseInt(strings.TrimSpace(string(b[:n])), 10, 64)
			return v
		}
	}
	return readInt(p)
}

// parentUsage is the daemon's memory parent's usage file, open from the manager's start
// to its close (a fd for the daemon's life, not per sandbox).
var parentUsage struct {
	mu sync.Mutex
	// +checklocks:mu
	f *os.File
}

// OpenV1MemoryUsageAll makes this daemon's memory parent (it exists otherwise from the
// first sandbox on) and keeps its usage file open for V1MemoryUsageAll. Precondition:
// Root is set (SetRootFor).
func OpenV1MemoryUsageAll() error {
	if !v1Mounted("memory") {
		return nil
	}
	d := v1Parent("memory")
	if err := os.MkdirAll(d, 0o755); err != nil {
		return err
	}
	f, err := os.Open(filepath.Join(d, "memory.usage_in_bytes"))
	if err != nil {
		return err
	}
	parentUsage.mu.Lock()
	if parentUsage.f != nil {
		parentUsage.f.Close()
	}
	parentUsage.f = f
	parentUsage.mu.Unlock()
	return nil
}

// CloseV1MemoryUsageAll closes what OpenV1MemoryUsageAll opened.
func CloseV1MemoryUsageAll() {
	parentUsage.mu.Lock()
	defer parentUsage.mu.Unlock()
	if parentUsage.f != nil {
		parentUsage.f.Close()
		parentUsage.f = nil
	}
}

// OOMKills is Usage's OOMKills alone: how many processes the memory limit made the
// kernel kill so far (read after each call to tell whether the call saw one). Safe for
// concurrent use.
func (v *V1) OOMKills() int64 {
	d := v.dirs["memory"]
	if d == "" {
		return 0
	}
	p := filepath.Join(d, "memory.oom_control")
	var b [512]byte
	if c, ok := v.oomFile.read(p, b[:]); ok {
		return parseKey(c, "oom_kill")
	}
	return readKey(p, "oom_kill")
}

// Dirs returns the sandbox's directory per controller.
func (v *V1) Dirs() map[string]string {
	out := map[string]string{}
	for c, d := range v.dirs {
		out[c] = d
	}
	return out
}

// Destroy removes the directories. The processes are normally gone already (the
// cgroup2 directory's cgroup.kill ends them); any left are killed. Removing a missing
// directory is not an error.
func (v *V1) Destroy(timeout time.Duration) error {
	v.oomFile.close()
	v.usageFile.close()
	deadline := time.Now().Add(timeout)
	var errs []error
	for _, c := range v1Controllers {
		d := v.dirs[c]
		if d == "" {
			continue
		}
		for _, sub := range subtree(d) {
			for {
				err := unix.Rmdir(sub)
				if err == nil || errors.Is(err, unix.ENOENT) {
					break
				}
				if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
					errs = append(errs, fmt.Errorf("remove cgroup %s: %w", sub, err))
					break
				}
				killTasks(sub)
				time.Sleep(2 * time.Millisecond)
			}
		}
	}
	return errors.Join(errs...)
}

// subtree lists the groups under d (children a sandbox made in its cgroup namespace
// too: a group cannot be removed before its children), deepest first, d last.
func subtree(d string) []string {
	var out []string
	ents, _ := os.ReadDir(d)
	for _, e := range ents {
		if e.IsDir() {
			out = append(out, subtree(filepath.Join(d, e.Name()))...)
		}
	}
	return append(out, d)
}

// killTasks SIGKILLs the threads' processes still listed in a v1 directory.
func killTasks(d string) {
	b, _ := os.ReadFile(filepath.Join(d, "tasks"))
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil && pid > 1 {
			unix.Kill(pid, unix.SIGKILL)
		}
	}
}

// OpenV1 returns the existing v1 directories of sandbox id (for the startup sweep and
// for tests).
func OpenV1(id string) *V1 {
	v := &V1{ID: id, dirs: map[string]string{}}
	for _, c := range v1Controllers {
		d := filepath.Join(v1Parent(c), id)
		if fi, err := os.Stat(d); err == nil && fi.IsDir() {
			v.dirs[c] = d
		} else if c == execController && v1Mounted(c) && os.MkdirAll(d, 0o755) == nil {
			v.dirs[c] = d // a sandbox started before exec groups were: its execs need it
		}
	}
	return v
}

// ListV1 returns the ids that have a directory in any v1 hierarchy (startup sweep).
func ListV1() []string {
	seen := map[string]bool{}
	var out []string
	for _, c := range v1Controllers {
		ents, _ := os.ReadDir(v1Parent(c))
		for _, e := range ents {
			if e.IsDir() && !seen[e.Name()] {
				seen[e.Name()] = true
				out = append(out, e.Name())
			}
		}
	}
	return out
}

// removeV1Roots removes this daemon's (empty) parent directories at shutdown, and its
// background group (background.go).
func removeV1Roots() {
	for _, c := range v1Controllers {
		unix.Rmdir(v1Parent(c))
	}
	unix.Rmdir(backgroundDir())
}

// Add moves process pid (a host PID, all its threads) into every limit group: a
// process the daemon placed by injection (a fast fork's copy), which spawn's join
// did not put there.
func (v *V1) Add(pid int) error {
	for _, c := range v1Controllers {
		if d := v.dirs[c]; d != "" {
			if err := writeFile(filepath.Join(d, "cgroup.procs"), strconv.Itoa(pid)); err != nil {
				return err
			}
		}
	}
	return nil
}
