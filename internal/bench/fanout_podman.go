package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"deltabox/internal/criu"
	"deltabox/internal/deadline"
)

// podmanFanout is bench fanout's podman baseline: what a user of containers does to
// fan one live process out into N. A container of the bench's image runs the same
// python heap; `podman container checkpoint --export` writes it (process and the
// container's changed files) to one archive; a fork of N is N `podman container
// restore --import` of that archive under new names, run one per CPU at once as
// DeltaBox makes its branches, each timed until its python is seen running again with
// its heap.
type podmanFanout struct {
	podmanCLI
	dir     string // the archive's directory, removed by close
	archive string
	heapMB  int
	n       int // names made so far (containers are named NAME-k)
	name    string
	// CheckpointMS is the export's duration, ArchiveMB its size.
	CheckpointMS, ArchiveMB float64
}

// podmanFanoutScript is the container's python: it holds the heap and rewrites
// /tmp/alive every 10 ms with the heap's length, its bytes and the time, so that a
// restored copy shows it runs (a time after its restore) with its heap whole.
const podmanFanoutScript = `
import os, random, time
heap = [random.randbytes(1 << 20) for _ in range(%d)]
while True:
    with open("/tmp/alive.tmp", "w") as f:
        f.write("%%d %%d %%f" %% (len(heap), sum(len(h) for h in heap), time.time()))
    os.rename("/tmp/alive.tmp", "/tmp/alive")
    time.sleep(0.01)
`

// podmanCLI runs podman with the benches' global options (podmanGlobal) and the
// project's CRIU first on PATH: runc looks for `criu` there, and Debian's fails on this
// kernel.
type podmanCLI struct {
	bin string
	env []string
}

// newPodmanCLI finds podman and the project's CRIU, or says why the baseline cannot
// run here.
func newPodmanCLI() (podmanCLI, string) {
	bin, err := exec.LookPath("podman")
	if err != nil {
		return podmanCLI{}, "podman is not installed (apt-get install podman)"
	}
	if why := PodmanUnavailable(); why != "" {
		return podmanCLI{}, why
	}
	return podmanCLI{bin: bin, env: append(os.Environ(), "PATH="+filepath.Dir(criu.DefaultPath)+":"+os.Getenv("PATH"))}, ""
}

// PodmanUnavailable says why podman's checkpoint and restore cannot run on this machine
// ("" where they can, podman aside): the project's CRIU missing, or unusable, or usable
// only with CRIU_FAULT=130 (criu.Probe's no-breakpoints mode: this machine does not
// deliver the hardware breakpoints CRIU stops its tracees with, and a plain dump hangs
// at its end). podman's CRIU, started by runc, hung so (120 s) with CRIU_FAULT=130 in
// podman's environment too, so the baselines that checkpoint with podman are marked
// unavailable there rather than left to their deadline.
func PodmanUnavailable() string {
	if _, err := os.Stat(criu.DefaultPath); err != nil {
		return fmt.Sprintf("no CRIU at %s for podman's checkpoint (scripts/setup.sh builds it)", criu.DefaultPath)
	}
	switch r := criu.Probe(context.Background(), criu.DefaultPath); r.Mode {
	case criu.Plain:
		return ""
	case criu.NoBreakpoints:
		return "podman's checkpoint cannot run on this machine: it does not deliver the hardware breakpoints CRIU stops its tracees with " +
			"(DeltaBox runs CRIU with " + criu.NoBreakpointsEnv + "; podman's CRIU, started by runc, hung at the end of its dump with it in podman's environment too)"
	default:
		return "CRIU cannot run on this machine, so neither can podman's checkpoint: " + r.String()
	}
}

func (p podmanCLI) run(ctx context.Context, d time.Duration, args ...string) error {
	_, err := p.output(ctx, d, args...)
	return err
}

func (p podmanCLI) output(ctx context.Context, d time.Duration, args ...string) (string, error) {
	cmd := deadline.Command(ctx, d, p.bin, podmanArgs(args...)...)
	cmd.Env = p.env
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// image imports the store's image's rootfs as localhost/deltabox-bench:IMAGE, once
// (kept for later runs), and returns its tag, or why it cannot. podman's restore
// --import needs an image: a container run from --rootfs cannot be restored
// ("repository name must have at least one component").
func (p podmanCLI) image(ctx context.Context, root, image string, logf func(string, ...any)) (tag, why string) {
	rootfs := filepath.Join(root, "images", image, "rootfs")
	if _, err := os.Stat(rootfs); err != nil {
		return "", fmt.Sprintf("no rootfs of image %s to import into podman: %v", image, err)
	}
	tag = "localhost/deltabox-bench:" + image
	if p.run(ctx, time.Minute, "image", "exists", tag) == nil {
		return tag, ""
	}
	logf("podman: importing %s's rootfs as %s (once)", image, tag)
	// $1 the rootfs, $2 podman, the rest podman's arguments (shifted off first: "$@"
	// would pass the rootfs and podman to podman too).
	imp := deadline.Command(ctx, 10*time.Minute, "sh", "-c", `r=$1 b=$2; shift 2; tar -C "$r" -c . | "$b" "$@"`, "sh", rootfs, p.bin)
	imp.Args = append(imp.Args, podmanArgs("import", "-", tag)...)
	imp.Env = p.env
	if out, err := imp.CombinedOutput(); err != nil {
		return "", fmt.Sprintf("podman import of the image failed here: %v: %s", err, firstLine(string(out)))
	}
	return tag, ""
}

// removeNamed removes every container whose name starts with prefix.
func (p podmanCLI) removeNamed(ctx context.Context, prefix string) error {
	out, err := p.output(ctx, time.Minute, "ps", "-a", "--format", "{{.Names}}", "--filter", "name="+prefix)
	if err != nil {
		return fmt.Errorf("podman ps: %v: %s", err, firstLine(out))
	}
	for _, name := range strings.Fields(out) {
		if strings.HasPrefix(name, prefix) {
			if out, rerr := p.output(ctx, time.Minute, "rm", "-f", "-t", "0", name); rerr != nil {
				err = errors.Join(err, fmt.Errorf("podman rm %s: %v: %s", name, rerr, firstLine(out)))
			}
		}
	}
	return err
}

// startPodmanFanout starts and exports the baseline's container, or says why it
// cannot run here (why != "", nil error), or fails (err).
func startPodmanFanout(ctx context.Context, root, image string, heapMB, workspaceMB int, logf func(string, ...any)) (_ *podmanFanout, why string, err error) {
	cli, why := newPodmanCLI()
	if why != "" {
		return nil, why, nil
	}
	p := &podmanFanout{podmanCLI: cli, heapMB: heapMB, name: "deltabox-bench-fanout-" + randHex(3)}
	if p.dir, err = os.MkdirTemp("", "deltabox-bench-podman-"); err != nil {
		return nil, "", err
	}
	defer func() {
		if err != nil || why != "" {
			err = errors.Join(err, p.close(context.WithoutCancel(ctx)))
		}
	}()
	tag, why := p.image(ctx, root, image, logf)
	if why != "" {
		return p, why, nil
	}
	src := p.name + "-src"
	if out, rerr := p.output(ctx, 2*time.Minute, "run", "-d", "--name", src, "--network=none",
		"--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", tag,
		"python3", "-c", fmt.Sprintf(podmanFanoutScript, heapMB)); rerr != nil {
		return p, fmt.Sprintf("podman run failed here: %v: %s", rerr, firstLine(out)), nil
	}
	if workspaceMB > 0 {
		script := fmt.Sprintf("mkdir -p /workspace/ws && for i in $(seq %d); do head -c 4M /dev/urandom > /workspace/ws/f$i; done", (workspaceMB+3)/4)
		if out, werr := p.output(ctx, 10*time.Minute, "exec", src, "sh", "-c", script); werr != nil {
			return p, "", fmt.Errorf("podman: write the workspace: %v: %s", werr, firstLine(out))
		}
	}
	if err := p.alive(ctx, src, time.Time{}); err != nil {
		return p, "", err
	}
	p.archive = filepath.Join(p.dir, "checkpoint.tar")
	t0 := time.Now()
	if out, cerr := p.output(ctx, 5*time.Minute, "container", "checkpoint", "--export", p.archive, src); cerr != nil {
		return p, fmt.Sprintf("podman container checkpoint failed here: %v: %s", cerr, firstLine(out)), nil
	}
	p.CheckpointMS = ms(time.Since(t0))
	if st, serr := os.Stat(p.archive); serr == nil {
		p.ArchiveMB = float64(st.Size()) / (1 << 20)
	}
	if out, rerr := p.output(ctx, time.Minute, "rm", "-f", "-t", "0", src); rerr != nil {
		return p, "", fmt.Errorf("podman rm %s: %v: %s", src, rerr, firstLine(out))
	}
	logf("podman: checkpoint exported in %.0f ms (%.0f MiB)", p.CheckpointMS, p.ArchiveMB)
	return p, "", nil
}

// fork restores n containers from the archive, one per CPU at once, and returns each
// one's time from its restore's start until its python was seen running with its heap,
// the time until all were, and their mean PSS in MiB; the containers are removed
// before it returns.
func (p *podmanFanout) fork(ctx context.Context, n int) (per []float64, total, pss float64, err error) {
	names := make([]string, n)
	for i := range names {
		p.n++
		names[i] = p.name + "-" + strconv.Itoa(p.n)
	}
	per = make([]float64, n)
	errs := make([]error, n)
	sem := make(chan struct{}, runtime.NumCPU())
	var wg sync.WaitGroup
	t0 := time.Now()
	for i := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			tb := time.Now()
			if out, rerr := p.output(ctx, 5*time.Minute, "container", "restore", "--import", p.archive, "--name", names[i]); rerr != nil {
				errs[i] = fmt.Errorf("podman container restore %s: %v: %s", names[i], rerr, firstLine(out))
				return
			}
			if errs[i] = p.alive(ctx, names[i], tb); errs[i] == nil {
				per[i] = ms(time.Since(tb))
			}
		}()
	}
	wg.Wait()
	total = ms(time.Since(t0))
	err = errors.Join(errs...)
	if err == nil {
		var pids []int
		for _, name := range names {
			if pid := p.containerPid(ctx, name); pid > 0 {
				pids = append(pids, pid)
			}
		}
		pss = pssMB(pids) / float64(n)
	}
	for _, name := range names {
		if out, rerr := p.output(context.WithoutCancel(ctx), time.Minute, "rm", "-f", "-t", "0", name); rerr != nil &&
			!strings.Contains(out, "no such container") {
			err = errors.Join(err, fmt.Errorf("podman rm %s: %v: %s", name, rerr, firstLine(out)))
		}
	}
	return per, total, pss, err
}

// alive waits (at most a minute) until container name's /tmp/alive was written after
// since with the whole heap.
func (p *podmanFanout) alive(ctx context.Context, name string, since time.Time) error {
	want := fmt.Sprintf("%d %d ", p.heapMB, p.heapMB<<20)
	end := time.Now().Add(time.Minute)
	var last string
	for time.Now().Before(end) {
		out, err := p.output(ctx, 30*time.Second, "exec", name, "cat", "/tmp/alive")
		last = strings.TrimSpace(out)
		if err == nil && strings.HasPrefix(last, want) {
			if f := strings.Fields(last); len(f) == 3 {
				if t, perr := strconv.ParseFloat(f[2], 64); perr == nil && t >= float64(since.UnixNano())/1e9 {
					return nil
				}
			}
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		time.Sleep(5 * time.Millisecond)
	}
	return fmt.Errorf("podman: container %s's python was not seen running with its %d MiB heap within a minute (last /tmp/alive: %q)", name, p.heapMB, last)
}

// close removes the archive and any container of this run left behind.
func (p *podmanFanout) close(ctx context.Context) error {
	return errors.Join(p.removeNamed(ctx, p.name), os.RemoveAll(p.dir))
}

// pssMB is the proportional set size (MiB) of the processes pids: each shared page
// counts for its share only (smaps_rollup's Pss), so a branch whose pages are shared
// copy-on-write with its siblings shows what it adds. Processes gone meanwhile count 0.
func pssMB(pids []int) float64 {
	var kb int64
	for _, pid := range pids {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "Pss:" {
				v, _ := strconv.ParseInt(f[1], 10, 64)
				kb += v
			}
		}
	}
	return float64(kb) / 1024
}

// cgroupPids lists the processes of cgroup v2 directory dir (nil if it cannot be read).
func cgroupPids(dir string) []int {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// containerPid is the host PID of a running container's first process (0 if unknown).
func (p podmanCLI) containerPid(ctx context.Context, name string) int {
	out, err := p.output(ctx, time.Minute, "inspect", "--format", "{{.State.Pid}}", name)
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(out))
	return pid
}
