package durable

import (
	"os"
	"slices"
	"testing"
)

func TestUnescapeMount(t *testing.T) {
	for in, want := range map[string]string{`/a\040b`: "/a b", `/x\134y`: `/x\y`, "/plain": "/plain", `/end\04`: `/end\04`} {
		if got := unescapeMount(in); got != want {
			t.Errorf("unescapeMount(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestTmpfsMountsAndCgroups: this process's tmpfs mounts include /dev/shm (a tmpfs on
// this machine kind), and each cgroup directory CgroupsOf names exists and holds it.
func TestTmpfsMountsAndCgroups(t *testing.T) {
	mps, err := tmpfsMounts(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(mps, "/dev/shm") {
		t.Errorf("tmpfs mounts %v: no /dev/shm", mps)
	}
	dirs, err := CgroupsOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if len(dirs) == 0 {
		t.Fatal("no cgroup directories")
	}
	for _, d := range dirs {
		if _, err := os.Stat(d + "/cgroup.procs"); err != nil {
			t.Errorf("%s: %v", d, err)
		}
	}
}
