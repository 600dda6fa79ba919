package fastpath

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
	"deltabox/internal/testutil/skip"
)

func TestParseMaps(t *testing.T) {
	in := `55d0c8a00000-55d0c8a01000 r--p 00000000 fd:01 123                        /usr/bin/x
7f0d50ef6000-7f0d50ef7000 rw-s 00002000 00:90 67380045                   /workspace/a file with spaces
7f0d50ef8000-7f0d50ef9000 rw-s 00000000 00:01 1024                       /dev/zero (deleted)
7ffc1a1e5000-7ffc1a206000 rw-p 00000000 00:00 0                          [stack]
7ffc1a300000-7ffc1a301000 rw-p 00000000 00:00 0
`
	got := parseMaps([]byte(in))
	if len(got) != 5 {
		t.Fatalf("%d lines: %+v", len(got), got)
	}
	m := got[1]
	if m.start != 0x7f0d50ef6000 || m.end != 0x7f0d50ef7000 || m.perms != "rw-s" || m.offset != 0x2000 || m.path != "/workspace/a file with spaces" {
		t.Errorf("shared file mapping parsed as %+v", m)
	}
	if got[2].path != "/dev/zero (deleted)" || got[4].path != "" {
		t.Errorf("paths %q %q", got[2].path, got[4].path)
	}
}

func TestParseTimers(t *testing.T) {
	in := `ID: 1
signal: 35/0000000000000abc
notify: signal/pid.1234
ClockID: 1
ID: 7
signal: 0/0000000000000000
notify: none/pid.1234
ClockID: -6
ID: 9
signal: 36/0000000000000000
notify: signal/tid.99
ClockID: 0
`
	got, err := parseTimers([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	want := []procTimer{
		{PosixTimer{ID: 1, Clock: 1, Signo: 35, Notify: remote.SigevSignal, Value: 0xabc}, 1234},
		{PosixTimer{ID: 7, Clock: -6, Notify: remote.SigevNone}, 1234},
		{PosixTimer{ID: 9, Clock: 0, Signo: 36, Notify: remote.SigevSignal | remote.SigevThreadID}, 99},
	}
	if len(got) != len(want) {
		t.Fatalf("got %+v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("timer %d: %+v, want %+v", i, got[i], want[i])
		}
	}
	if _, err := parseTimers([]byte("ID: 1\nnotify: bogus/pid.1\n")); err == nil {
		t.Error("an unknown notification parsed")
	}
	// Host pid 1234, pid 5 in the sandbox.
	for _, c := range []struct {
		tm     PosixTimer
		target int
		refuse string
	}{
		{got[0].PosixTimer, 1234, ""},
		{got[1].PosixTimer, 1234, ""}, // -6: its own process CPU clock (pid 0)
		{got[2].PosixTimer, 99, "signals thread 99"},
		{got[2].PosixTimer, 1234, ""},
		{PosixTimer{Clock: int32(^5<<3 | 2)}, 1234, ""}, // CPU clock of pid 5: itself
		{PosixTimer{Clock: int32(^6<<3 | 2)}, 1234, "CPU-time clock of process 6"},
		{PosixTimer{Clock: int32(^3<<3 | 3)}, 1234, "dynamic POSIX clock"},
	} {
		r := timerRefused(c.tm, c.target, 1234, 5, func(tid int) string { return strconv.Itoa(tid) })
		if (c.refuse == "") != (r == "") || !strings.Contains(r, c.refuse) {
			t.Errorf("timer %+v signalling %d: refused %q, want %q", c.tm, c.target, r, c.refuse)
		}
	}
}

// lookupSelf is lookupFunc for this process (tests only: the daemon never resolves a
// sandbox's path itself).
func lookupSelf(path string) (dev, ino uint64, found bool, err error) {
	var st unix.Stat_t
	if unix.Lstat(path, &st) != nil {
		return 0, 0, false, nil
	}
	return st.Dev, st.Ino, true, nil
}

// anyMount takes a file on any mount.
func anyMount(string, uint64) error { return nil }

// TestSharedMappings classifies real mappings of this process: a writable shared file
// mapping and a read-only one of a file opened for writing are remapped; a read-only one
// of a file opened read-only is kept; shared anonymous memory, a memfd and a deleted file
// make the process ineligible, with the mapping named.
func TestSharedMappings(t *testing.T) {
	skip.Require(t, os.Geteuid() == 0, "needs root (/proc/PID/map_files)")
	dir := t.TempDir()
	file := filepath.Join(dir, "data")
	if err := os.WriteFile(file, make([]byte, 8192), 0o644); err != nil {
		t.Fatal(err)
	}
	mapFile := func(flags, prot int, off int64) []byte {
		t.Helper()
		fd, err := unix.Open(file, flags, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		b, err := unix.Mmap(fd, off, 4096, prot, unix.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	classify := func() ([]Mapping, error) {
		return sharedMappings("/proc/self", os.Getpid(), smapsMayWrite("/proc/self"), lookupSelf, anyMount)
	}

	rw := mapFile(unix.O_RDWR, unix.PROT_READ|unix.PROT_WRITE, 4096)
	roMayWrite := mapFile(unix.O_RDWR, unix.PROT_READ, 0)
	ro := mapFile(unix.O_RDONLY, unix.PROT_READ, 0)
	maps, err := classify()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, m := range maps {
		if m.Path == file {
			n++
			if m.End-m.Start != 4096 {
				t.Errorf("mapping %v: length %d", m, m.End-m.Start)
			}
		}
	}
	if n != 2 {
		t.Fatalf("%d mappings of %s to remap, want 2: %v", n, file, maps)
	}
	for _, m := range maps {
		switch uintptr(m.Start) {
		case addr(rw):
			if m.Prot != unix.PROT_READ|unix.PROT_WRITE || m.Offset != 4096 {
				t.Errorf("writable mapping recorded as %+v", m)
			}
		case addr(roMayWrite):
			if m.Prot != unix.PROT_READ || m.Offset != 0 {
				t.Errorf("read-only mapping of a writable file recorded as %+v", m)
			}
		case addr(ro):
			t.Errorf("read-only mapping of a file opened read-only recorded: %+v", m)
		}
	}
	for _, b := range [][]byte{rw, roMayWrite, ro} {
		unix.Munmap(b)
	}

	refused := func(what, want string, b []byte) {
		t.Helper()
		_, err := classify()
		var in *Ineligible
		if !errors.As(err, &in) || !strings.Contains(in.Reason, want) {
			t.Errorf("%s: %v, want ineligible: %q", what, err, want)
		}
		unix.Munmap(b)
	}
	anon, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	refused("MAP_SHARED|MAP_ANONYMOUS", "shared anonymous memory", anon)
	mfd, err := unix.MemfdCreate("fpt", 0)
	if err != nil {
		t.Fatal(err)
	}
	unix.Ftruncate(mfd, 4096)
	mb, err := unix.Mmap(mfd, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	unix.Close(mfd)
	if err != nil {
		t.Fatal(err)
	}
	refused("memfd", "memfd:fpt", mb)
	db := mapFile(unix.O_RDWR, unix.PROT_READ|unix.PROT_WRITE, 0)
	os.Remove(file)
	refused("deleted file", "the file was deleted", db)
}

func addr(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }

// TestQuerySharedAgreesWithMaps: the PROCMAP_QUERY walk finds exactly the shared
// mappings the maps text lists, with the same range, permissions, offset and name
// (a file, shared anonymous memory, a memfd, a deleted file).
func TestQuerySharedAgreesWithMaps(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "data")
	if err := os.WriteFile(file, make([]byte, 3*4096), 0o644); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Open(file, unix.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	var maps [][]byte
	for _, m := range []struct {
		fd   int
		off  int64
		prot int
	}{{fd, 4096, unix.PROT_READ | unix.PROT_WRITE}, {fd, 0, unix.PROT_READ}, {fd, 8192, unix.PROT_READ | unix.PROT_EXEC}, {-1, 0, unix.PROT_READ | unix.PROT_WRITE}} {
		flags := unix.MAP_SHARED
		if m.fd < 0 {
			flags |= unix.MAP_ANONYMOUS
		}
		b, err := unix.Mmap(m.fd, m.off, 4096, m.prot, flags)
		if err != nil {
			t.Fatal(err)
		}
		maps = append(maps, b)
	}
	unix.Close(fd)
	gone := filepath.Join(dir, "gone")
	os.WriteFile(gone, make([]byte, 4096), 0o644)
	gfd, _ := unix.Open(gone, unix.O_RDWR, 0)
	gb, err := unix.Mmap(gfd, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	unix.Close(gfd)
	if err != nil {
		t.Fatal(err)
	}
	os.Remove(gone)
	maps = append(maps, gb)
	defer func() {
		for _, b := range maps {
			unix.Munmap(b)
		}
	}()

	f, err := os.Open("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got, err := queryShared(int(f.Fd()))
	if err != nil {
		t.Fatalf("PROCMAP_QUERY: %v (Linux 6.11 or later has it)", err)
	}
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	var want []mapsLine
	for _, m := range parseMaps(b) {
		if m.perms[3] == 's' {
			want = append(want, m)
		}
	}
	if len(want) < len(maps) {
		t.Fatalf("maps lists %d shared mappings, the test made %d", len(want), len(maps))
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("PROCMAP_QUERY:\n%v\nmaps text:\n%v", got, want)
	}
}

// TestParseLock parses fdinfo "lock:" lines as this kernel prints them (flock, a POSIX
// range, an OFD lock to the end of the file) and refuses what cannot be set again.
func TestParseLock(t *testing.T) {
	for _, c := range []struct {
		line string
		want Lock
		err  string
	}{
		{"1: FLOCK  ADVISORY  READ 32000 fe:00:9978123 0 EOF", Lock{Kind: "flock", Start: 0, End: -1}, ""},
		{"1: POSIX  ADVISORY  WRITE 32000 fe:00:9978124 5 14", Lock{Kind: "posix", Write: true, Start: 5, End: 14}, ""},
		{"2: POSIX  ADVISORY  READ 32000 fe:00:9978124 50 EOF", Lock{Kind: "posix", Start: 50, End: -1}, ""},
		{"1: OFDLCK ADVISORY  WRITE -1 fe:00:9978125 0 EOF", Lock{Kind: "ofd", Write: true, End: -1}, ""},
		{"1: LEASE  ACTIVE    READ 4242 fe:00:12 0 EOF", Lock{}, "a lease (LEASE ACTIVE READ)"},
		{"1: DELEG  ACTIVE    READ 4242 fe:00:12 0 EOF", Lock{}, "a lease"},
		{"1: ACCESS ADVISORY  READ 4242 fe:00:12 0 EOF", Lock{}, "a lock of kind ACCESS"},
		{"1: POSIX  ADVISORY  WRITE 32000 fe:00:9978124", Lock{}, "unreadable lock"},
	} {
		got, err := parseLock(strings.Fields(c.line))
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%q: err %v, want one containing %q", c.line, err, c.err)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("%q: %+v %v, want %+v", c.line, got, err, c.want)
		}
	}
	if b := flockBytes(Lock{Kind: "posix", Write: true, Start: 5, End: 14}, false); len(b) != 32 || b[0] != 1 || b[8] != 5 || b[16] != 10 {
		t.Errorf("struct flock for bytes 5-14 (F_WRLCK, len 10): % x", b)
	}
	if b := flockBytes(Lock{Kind: "ofd", Start: 20, End: -1}, false); b[0] != 0 || b[8] != 20 || b[16] != 0 {
		t.Errorf("struct flock from 20 to the end (F_RDLCK, len 0): % x", b)
	}
}
