package durable

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	criustats "github.com/checkpoint-restore/go-criu/v7/stats"
	"golang.org/x/sys/unix"

	"deltabox/internal/criu"
	"deltabox/internal/testutil"
)

// TestIncrementalDumps: a 50 MB python session dumped six times, rewriting 2 MB of its
// heap between dumps: each image after the first costs the page store at least 5x less
// than a full dump (issue 17's target), and the last one, pages back from the store,
// restores the session with the heap it had.
func TestIncrementalDumps(t *testing.T) {
	r := runner(t)
	s := newSandboxSession(t, "inc")
	s.run(t, "import os, hashlib\nx = bytearray(os.urandom(50 << 20))")
	ps, err := OpenPageStore(filepath.Join(s.d.Root, "durable", "pages"))
	if err != nil {
		t.Fatal(err)
	}
	defer ps.Close()
	var dir string
	var full int64
	for i := 0; i < 6; i++ {
		if i > 0 {
			s.run(t, fmt.Sprintf("x[%d:%d] = os.urandom(2 << 20)", i*4<<20, i*4<<20+2<<20))
		}
		dir = filepath.Join(s.d.Root, "durable", fmt.Sprint(i))
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		m, err := Dump(t.Context(), r, s.hostPid, dir, DumpOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		st, err := ps.Ingest(dir)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("dump %d: CRIU %.3f s, ingest %v: image %.1f MB, stored %.2f MB (%d of %d pages new, %d zero)", i, m.DumpS,
			time.Since(t0).Round(time.Millisecond), mb(st.ImageBytes), mb(st.StoredBytes), st.NewPages, st.Pages, st.ZeroPages)
		if i == 0 {
			full = st.ImageBytes
			continue
		}
		if st.StoredBytes*5 > st.ImageBytes {
			t.Errorf("dump %d after 2 MB rewritten: %d bytes stored of a %d-byte image, want at most a fifth", i, st.StoredBytes, st.ImageBytes)
		}
	}
	t.Logf("store: %d pages (%.1f MB) for 6 images of %.1f MB", ps.Pages(), mb(int64(ps.Pages())*pageSize), mb(full))

	h := s.run(t, "hashlib.sha256(x).hexdigest()")
	sb := nsFiles(t, s.hostPid)
	p := newPty(t, s.hostPid)
	m, _ := ReadManifest(dir)
	sb.TTYs = map[string]*os.File{m.TTYs[0]: p.slave}
	kill(t, s.hostPid)
	if err := ps.Materialize(dir); err != nil {
		t.Fatal(err)
	}
	st, err := Restore(t.Context(), r, dir, sb, RestoreOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(st.HostPid, syscall.SIGKILL) })
	p.slave.Close()
	if got := p.call(t, "hashlib.sha256(x).hexdigest()", 30*time.Second); got != h {
		t.Fatalf("restored from the last image: heap hash %s, want %s", got, h)
	}
}

func mb(b int64) float64 { return float64(b) / (1 << 20) }

// TestTimings measures, for a 50 MB python session, the durable path's dump, page
// store intake, restore and restore until the session's first answer, beside plain
// CRIU (command lines, as bench latency runs it) dumping and restoring a 50 MB python
// of the host, DELTABOX_DURABLE_ROUNDS rounds (default 5), the two interleaved in each
// round so that both see the same load, and logs p50 and max. DELTABOX_CRIU_PLAIN
// names another CRIU binary for the plain runs (stock CRIU, say); DELTABOX_DURABLE_MB
// sets the pythons' heap (default 50 MB).
func TestTimings(t *testing.T) {
	r := runner(t)
	plain := r
	if b := os.Getenv("DELTABOX_CRIU_PLAIN"); b != "" {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		plain = criu.Probe(ctx, b)
		cancel()
		testutil.Require(t, plain.Usable(), "plain CRIU %s does not work here: %s", b, plain)
	}
	rounds := 5
	if n, err := strconv.Atoi(os.Getenv("DELTABOX_DURABLE_ROUNDS")); err == nil && n > 0 {
		rounds = n
	}
	size := 50 // MB of random bytes in each python
	if n, err := strconv.Atoi(os.Getenv("DELTABOX_DURABLE_MB")); err == nil && n > 0 {
		size = n
	}
	s := newSandboxSession(t, "tim")
	s.run(t, fmt.Sprintf("import os, hashlib\nx = bytearray(os.urandom(%d << 20))\nn = 0", size))
	ps, err := OpenPageStore(filepath.Join(s.d.Root, "durable", "pages"))
	if err != nil {
		t.Fatal(err)
	}
	defer ps.Close()

	// Plain CRIU: Debian's python3, as in the sandbox's image (not PATH's, which may be
	// another build), on the host.
	ready := filepath.Join(t.TempDir(), "ready")
	py := exec.Command("/usr/bin/python3", "-c", fmt.Sprintf("import os, sys, time\nx = bytearray(os.urandom(%d << 20))\nopen(sys.argv[1], 'w').close()\ntime.sleep(1e6)", size), ready)
	py.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := py.Start(); err != nil {
		t.Fatal(err)
	}
	hp := py.Process.Pid
	go py.Wait()
	t.Cleanup(func() { syscall.Kill(hp, syscall.SIGKILL) })
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(ready); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the host python did not fill its %d MB within 20 s", size)
		}
	}

	// settle writes the store's dirty pages back before a timed step, so that no step
	// pays for the previous one's writeback (balance_dirty_pages throttled whichever
	// dump came after 500 MB of unwritten images).
	settle := func() {
		if f, err := os.Open(s.d.Root); err == nil {
			unix.Syncfs(int(f.Fd()))
			f.Close()
		}
	}
	var dump, ingest, restore, answer, pagesBack, pdump, prestore []time.Duration
	// CRIU's own account of each dump (stats-dump): frozen time, of which memdump
	// (pages drained into pipes) and memwrite (pipes to the image files).
	var frozen, memdump, memwrite, pfrozen, pmemdump, pmemwrite []time.Duration
	criuStats := func(dir string, fr, md, mw *[]time.Duration) {
		f, err := os.Open(dir)
		if err != nil {
			return
		}
		defer f.Close()
		if st, err := criustats.CriuGetDumpStats(f); err == nil {
			us := func(v uint32) time.Duration { return time.Duration(v) * time.Microsecond }
			*fr, *md, *mw = append(*fr, us(st.GetFrozenTime())), append(*md, us(st.GetMemdumpTime())), append(*mw, us(st.GetMemwriteTime()))
		}
	}
	var imageBytes, storedBytes, plainBytes []int64
	pid := s.hostPid
	var p *pty
	for i := 0; i < rounds; i++ {
		dir := filepath.Join(s.d.Root, "durable", fmt.Sprint(i))
		os.MkdirAll(dir, 0o700)
		settle()
		t0 := time.Now()
		m, err := Dump(t.Context(), r, pid, dir, DumpOptions{})
		if err != nil {
			t.Fatal(err)
		}
		dump = append(dump, time.Since(t0))
		criuStats(dir, &frozen, &memdump, &memwrite)
		t0 = time.Now()
		ist, err := ps.Ingest(dir)
		if err != nil {
			t.Fatal(err)
		}
		ingest = append(ingest, time.Since(t0))
		imageBytes, storedBytes = append(imageBytes, ist.ImageBytes), append(storedBytes, ist.StoredBytes)

		pdir := filepath.Join(s.d.Root, "plain", fmt.Sprint(i))
		os.MkdirAll(pdir, 0o700)
		settle()
		t0 = time.Now()
		if err := plain.Dump(hp, pdir, false).Run(t.Context()); err != nil {
			t.Fatal(err)
		}
		pdump = append(pdump, time.Since(t0))
		criuStats(pdir, &pfrozen, &pmemdump, &pmemwrite)
		plainBytes = append(plainBytes, dirBytes(pdir))

		sb := nsFiles(t, pid)
		old := p
		p = newPty(t, pid)
		sb.TTYs = map[string]*os.File{m.TTYs[0]: p.slave}
		kill(t, pid)
		if old != nil {
			old.master.Close()
		}
		settle()
		t0 = time.Now()
		if err := ps.Materialize(dir); err != nil {
			t.Fatal(err)
		}
		pagesBack = append(pagesBack, time.Since(t0))
		st, err := Restore(t.Context(), r, dir, sb, RestoreOptions{})
		if err != nil {
			t.Fatal(err)
		}
		restore = append(restore, time.Since(t0))
		p.slave.Close()
		// The first command rewrites 2 MB: the next dump has something new.
		if got := p.call(t, fmt.Sprintf("x[%d:%d] = os.urandom(2 << 20); n += 1; n", i*4<<20, i*4<<20+2<<20), 30*time.Second); got != fmt.Sprint(i+1) {
			t.Fatalf("round %d: the restored session answered %q", i, got)
		}
		answer = append(answer, time.Since(t0))
		pid = st.HostPid
		DropPages(dir)

		// CRIU killed the host python (no --leave-running): its PID is free.
		waitGone(t, hp)
		settle()
		t0 = time.Now()
		if err := plain.Restore(pdir).Run(t.Context()); err != nil {
			t.Fatal(err)
		}
		prestore = append(prestore, time.Since(t0))
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	load, _ := os.ReadFile("/proc/loadavg")
	t.Logf("%d MB python, %d rounds, p50 / max [each round, ms]; load average %s; durable: %s; plain: %s", size, rounds,
		strings.Join(strings.Fields(string(load))[:3], " "), r.Bin, plain.Bin)
	t.Logf("  durable dump (criu swrk, sandbox)   %s", stats(dump))
	t.Logf("  page store intake                   %s", stats(ingest))
	t.Logf("  pages back (copy_file_range)        %s", stats(pagesBack))
	t.Logf("  durable restore (pages back + CRIU) %s", stats(restore))
	t.Logf("  restore until first answer          %s", stats(answer))
	t.Logf("  plain criu dump (host python)       %s", stats(pdump))
	t.Logf("  plain criu restore -d               %s", stats(prestore))
	if len(frozen) == rounds && len(pfrozen) == rounds {
		t.Logf("  CRIU's stats, durable: frozen %s", stats(frozen))
		t.Logf("                         memdump %s", stats(memdump))
		t.Logf("                        memwrite %s", stats(memwrite))
		t.Logf("  CRIU's stats, plain:   frozen %s", stats(pfrozen))
		t.Logf("                         memdump %s", stats(pmemdump))
		t.Logf("                        memwrite %s", stats(pmemwrite))
	}
	t.Logf("  bytes: image %v", imageBytes)
	t.Logf("         stored %v", storedBytes)
	t.Logf("         plain criu image %v", plainBytes)
}

func waitGone(t testing.TB, pid int) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if syscall.Kill(pid, 0) == syscall.ESRCH {
			return
		}
		// A zombie of ours: reaped by py.Wait's goroutine (first round) or by init.
	}
	t.Fatalf("pid %d still there", pid)
}

func dirBytes(dir string) (n int64) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if fi, err := e.Info(); err == nil {
			n += fi.Size()
		}
	}
	return n
}

func stats(d []time.Duration) string {
	s := slices.Clone(d)
	slices.Sort(s)
	var parts []string
	for _, x := range d {
		parts = append(parts, fmt.Sprintf("%.0f", float64(x.Microseconds())/1000))
	}
	return fmt.Sprintf("%7.1f ms / %7.1f ms  [%s]", float64(s[len(s)/2].Microseconds())/1000,
		float64(s[len(s)-1].Microseconds())/1000, strings.Join(parts, " "))
}
