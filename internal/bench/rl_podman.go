package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// ---- podman ----

// rlPodman is one branch of bench rl's podman baseline: a container of the bench's
// image running the same python (latDriverPy, on an abstract socket of the
// container's network namespace, which the bench dials from a thread that entered it),
// exported once at the step's start state by `podman container checkpoint
// --leave-running --export`; the reset removes the container and restores the archive
// under the same name (process and files: podman's archive carries the container's
// changed files). The action writes a file too, as deltabox's does.
type rlPodman struct {
	cli           podmanCLI
	name, archive string
	h             *latHost
}

func (b *rlPodman) act(ctx context.Context, step int) (rlActStat, error) {
	return b.h.act(ctx, rlActCode(step, true))
}

func (b *rlPodman) reset(ctx context.Context) error {
	if out, err := b.cli.output(ctx, time.Minute, "rm", "-f", "-t", "0", b.name); err != nil {
		return fmt.Errorf("podman rm %s: %v: %s", b.name, err, firstLine(out))
	}
	if out, err := b.cli.output(ctx, 5*time.Minute, "container", "restore", "--import", b.archive, "--name", b.name); err != nil {
		return fmt.Errorf("podman container restore %s: %v: %s", b.name, err, firstLine(out))
	}
	return b.attach(ctx)
}

// attach opens the network namespace of the container's python (its PID changes at
// each restore).
func (b *rlPodman) attach(ctx context.Context) error {
	pid := b.cli.containerPid(ctx, b.name)
	if pid <= 0 {
		return fmt.Errorf("podman inspect %s: no PID of a running container", b.name)
	}
	ns, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", pid))
	if err != nil {
		return err
	}
	if b.h.netns != nil {
		b.h.netns.Close()
	}
	b.h.netns, b.h.pid = ns, pid
	return nil
}

func (b *rlPodman) digest(ctx context.Context) (string, error) {
	out, err := b.h.call(ctx, "bench_digest() + ' ' + (open('action.txt').read() if __import__('os').path.exists('action.txt') else '-')")
	return latPyStr(out), err
}

func (b *rlPodman) close() {
	b.cli.run(context.Background(), time.Minute, "rm", "-f", "-t", "0", b.name)
	if b.h.netns != nil {
		b.h.netns.Close()
	}
	os.RemoveAll(filepath.Dir(b.archive))
}

// setupPodman starts b containers one after the other, each with the heap built and
// exported; cleanup removes any container of the point left behind.
func (r *rlRun) setupPodman(ctx context.Context, b int) ([]rlBranch, []string, func(), error) {
	prefix := r.podmanPrefix + strconv.Itoa(b) + "-"
	cleanup := func() {
		if err := r.podman.removeNamed(context.Background(), prefix); err != nil {
			r.logf("podman: cleanup: %v", err)
		}
	}
	var out []rlBranch
	for i := 0; i < b; i++ {
		dir, err := os.MkdirTemp(r.o.HostDir, "deltabox-bench-rl-podman-")
		if err != nil {
			return out, nil, cleanup, err
		}
		br := &rlPodman{cli: r.podman, name: prefix + strconv.Itoa(i), archive: filepath.Join(dir, "checkpoint.tar"),
			h: &latHost{sock: "deltabox-bench-rl-" + randHex(4)}}
		out = append(out, br)
		if o, err := r.podman.output(ctx, 2*time.Minute, "run", "-d", "--name", br.name, "--network=none",
			"--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", "--workdir", "/root", r.podmanTag,
			"python3", "-c", latDriverPy, br.h.sock); err != nil {
			return out, nil, cleanup, fmt.Errorf("podman run: %v: %s", err, firstLine(o))
		}
		if err := br.attach(ctx); err != nil {
			return out, nil, cleanup, err
		}
		if err := br.h.waitListening(ctx, time.Minute); err != nil {
			return out, nil, cleanup, err
		}
		if _, err := br.h.call(ctx, r.o.initCode()); err != nil {
			return out, nil, cleanup, fmt.Errorf("build the heap: %w", err)
		}
		if o, err := r.podman.output(ctx, 5*time.Minute, "container", "checkpoint", "--leave-running", "--export", br.archive, br.name); err != nil {
			return out, nil, cleanup, fmt.Errorf("podman container checkpoint: %v: %s", err, firstLine(o))
		}
	}
	return out, []string{"host call into the container's python (the action)",
		"podman rm -f NAME && podman container restore --import FILE --name NAME (and podman inspect for its PID)"}, cleanup, nil
}
