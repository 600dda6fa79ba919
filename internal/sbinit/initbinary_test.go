package sbinit

import (
	"debug/buildinfo"
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"deltabox/internal/testutil/skip"
)

// TestInitBinaryUsable: the small init (cmd/deltabox-init) stands for the daemon's
// binary as a branch init only when it is there, static, built from the daemon's commit
// by the same Go, and no earlier than the daemon's binary; otherwise the daemon execs
// its own, and says why.
func TestInitBinaryUsable(t *testing.T) {
	_, err := exec.LookPath("go")
	skip.Require(t, err == nil, "no go toolchain to build %s: %v", InitBinaryName, err)
	dir := t.TempDir()
	p := filepath.Join(dir, InitBinaryName)
	cmd := exec.Command("go", "build", "-o", p, "./cmd/"+InitBinaryName)
	cmd.Dir = filepath.Join("..", "..")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	theirs, err := buildinfo.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	// The daemon's build information is the init's but for its package.
	ours := *theirs
	ours.Path = "deltabox/cmd/deltabox"
	self := filepath.Join(dir, "deltabox")
	if err := os.WriteFile(self, []byte("the daemon"), 0o755); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	setTime := func(f string, at time.Time) {
		t.Helper()
		if err := os.Chtimes(f, at, at); err != nil {
			t.Fatal(err)
		}
	}
	setTime(self, fi.ModTime().Add(-time.Minute))
	if err := initBinaryUsable(p, self, &ours); err != nil {
		t.Fatalf("the init built after the daemon from its commit: %v, want usable", err)
	}
	want := func(what, errPart string, err error) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), errPart) {
			t.Errorf("%s: %v, want an error saying %q", what, err, errPart)
		}
	}
	want("absent", "no such file", initBinaryUsable(filepath.Join(dir, "none"), self, &ours))
	setTime(self, fi.ModTime().Add(time.Minute))
	want("the daemon rebuilt after it", "older than", initBinaryUsable(p, self, &ours))
	setTime(self, fi.ModTime().Add(-time.Minute))
	other := ours
	other.Settings = withSetting(ours.Settings, "vcs.revision", "0123abc")
	want("another commit", "vcs.revision", initBinaryUsable(p, self, &other))
	other = ours
	other.GoVersion = "go1.0"
	want("another Go", "not of the daemon's", initBinaryUsable(p, self, &other))
	// A dynamically linked executable (the daemon's own kind) is refused: the exec root
	// has no ELF interpreter for it.
	dyn := ""
	for _, c := range []string{"/bin/true", "/usr/bin/true"} {
		if f, err := elf.Open(c); err == nil {
			for _, pr := range f.Progs {
				if pr.Type == elf.PT_INTERP {
					dyn = c
				}
			}
			f.Close()
		}
	}
	skip.Require(t, dyn != "", "no dynamically linked true to check the refusal of a dynamic init with")
	b, err := os.ReadFile(dyn)
	if err != nil {
		t.Fatal(err)
	}
	d := filepath.Join(dir, "dyn")
	if err := os.WriteFile(d, b, 0o755); err != nil {
		t.Fatal(err)
	}
	want("dynamically linked", "dynamically linked", initBinaryUsable(d, self, &ours))
}

// withSetting returns a copy of s with key set to value.
func withSetting(s []debug.BuildSetting, key, value string) []debug.BuildSetting {
	out := []debug.BuildSetting{{Key: key, Value: value}}
	for _, x := range s {
		if x.Key != key {
			out = append(out, x)
		}
	}
	return out
}
