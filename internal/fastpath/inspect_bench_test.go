package fastpath

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"deltabox/internal/testutil/skip"
)

// startInspectSubject starts a python3 holding 20 open files, a writable shared file
// mapping, /dev/null as stdin/stdout/stderr, its cwd on the files' directory.
func startInspectSubject(b testing.TB) int {
	b.Helper()
	skip.Require(b, os.Geteuid() == 0, "needs root (/proc/PID/map_files)")
	py, err := exec.LookPath("python3")
	skip.Require(b, err == nil, "needs python3")
	dir := b.TempDir()
	prog := `import os, sys, mmap
os.closerange(3, 4096)
os.chdir(sys.argv[1])
fs = [open('f%d' % i, 'w+') for i in range(20)]
open('m', 'wb').write(bytes(4096))
g = open('m', 'r+b'); m = mmap.mmap(g.fileno(), 4096); g.close()
open('ready', 'w').close()
__import__("time").sleep(1000)
`
	cmd := exec.Command(py, "-c", prog, dir)
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for i := 0; i < 5000; i++ {
		if _, err := os.Stat(filepath.Join(dir, "ready")); err == nil {
			break
		}
		time.Sleep(time.Millisecond)
	}
	return cmd.Process.Pid
}

// BenchmarkForkCopyCheck measures what Fork adds to find memory the fork did not copy
// (checkForkCopy) when there is none: the statm of the process and of its template
// (here the process twice).
func BenchmarkForkCopyCheck(b *testing.B) {
	pid := startInspectSubject(b)
	p := &Proc{HostPid: pid, Pid: pid}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := checkForkCopy(p, pid); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkInspect measures inspect (Hold's reading of /proc) on startInspectSubject's
// python3: what a checkpoint pays per process before its fork.
func BenchmarkInspect(b *testing.B) {
	pid := startInspectSubject(b)
	noWrite := func(uint64, uint64, int) (bool, error) { return false, nil }
	p, err := inspect(pid, noWrite, lookupSelf)
	if err != nil {
		b.Fatal(err)
	}
	if len(p.FDs) != 24 || len(p.Maps) != 1 { // 0-2, 20 files, the mmap module's dup of m
		b.Fatalf("inspected %d fds, %d mappings: %+v", len(p.FDs), len(p.Maps), p)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := inspect(pid, noWrite, lookupSelf); err != nil {
			b.Fatal(err)
		}
	}
}
