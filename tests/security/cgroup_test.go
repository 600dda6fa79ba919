package security

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// alive runs `echo alive` in id with a short deadline: a frozen or killed sandbox
// fails it.
func alive(d *testutil.Daemon, id string) error {
	c, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := d.C.Exec(c, id, apitypes.ExecRequest{Argv: []string{"echo", "alive"}, TimeoutMS: 4000})
	if err == nil && strings.TrimSpace(r.Stdout) != "alive" {
		err = os.ErrInvalid
	}
	return err
}

// thawAll writes 0 into every cgroup.freeze under the host's cgroup2 root that names
// id, so that a frozen victim can be torn down.
func thawAll(id string) {
	filepath.WalkDir("/sys/fs/cgroup/unified", func(p string, e os.DirEntry, err error) error {
		if err == nil && e.Name() == "cgroup.freeze" && strings.Contains(p, id) {
			os.WriteFile(p, []byte("0"), 0)
		}
		return nil
	})
}

// TestCgroupsOfOthersUnreachable: a sandbox mounted cgroup2 and reached the host's
// hierarchy: it froze (cgroup.freeze) and killed (cgroup.kill) another sandbox. With a
// cgroup namespace per sandbox its mount shows its own group only; the victim keeps
// answering.
func TestCgroupsOfOthersUnreachable(t *testing.T) {
	d := testutil.StartDaemon(t)
	const victim, attacker = "sec-cg-victim", "sec-cg-attacker"
	for _, id := range []string{victim, attacker} {
		if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { thawAll(victim) })
	for _, file := range []string{"cgroup.freeze", "cgroup.kill"} {
		out := sh(t, d, attacker, `mkdir -p /tmp/cg; mount -t cgroup2 none /tmp/cg 2>&1
cat /proc/self/cgroup | grep ^0::
for f in $(find /tmp/cg -path '*`+victim+`*' -name `+file+` 2>/dev/null); do echo 1 > $f && echo "wrote $f"; done; true`)
		t.Logf("%s: %s", file, strings.TrimSpace(out))
		if err := alive(d, victim); err != nil {
			t.Fatalf("the victim sandbox stopped answering after the attacker wrote its %s: %v", file, err)
		}
	}
}
