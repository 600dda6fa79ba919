package security

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"strings"
	"testing"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// runasAttack is run as the sandbox's user (1000): every way back to root the image
// offers. Each line that worked prints "ROOT: what"; the test fails on any. It relies on
// nothing but the credentials (no no_new_privs, no seccomp: another engineer's, and the
// setuid-root binaries of the image are run for real).
const runasAttack = `
cd /tmp
check() { if [ "$1" = 0 ]; then echo "ROOT: $2"; fi; }
check "$(id -u)" "id -u at start"
grep -E '^Cap(Inh|Prm|Eff|Amb):' /proc/self/status | grep -v '0000000000000000' | sed 's/^/ROOT: capability /'
python3 - <<'PY'
import os
for name, f in [("setuid(0)", lambda: os.setuid(0)), ("setresuid(0,0,0)", lambda: os.setresuid(0, 0, 0)),
                ("seteuid(0)", lambda: os.seteuid(0)), ("setgid(0)", lambda: os.setgid(0)),
                ("setgroups([0])", lambda: os.setgroups([0]))]:
    try:
        f(); print("ROOT: " + name)
    except OSError:
        pass
PY
check "$(su -c 'id -u' root </dev/null 2>/dev/null)" "su root (empty password)"
check "$(su -c 'id -u' </dev/null 2>/dev/null)" "su"
check "$(echo 'id -g' | newgrp root 2>/dev/null)" "newgrp root"
command -v sudo >/dev/null && check "$(sudo -n id -u 2>/dev/null)" "sudo"
mount -t tmpfs none /etc 2>/dev/null && echo "ROOT: mount over /etc"
chsh -s /bin/sh root </dev/null 2>/dev/null && echo "ROOT: chsh root"
passwd -d root </dev/null 2>/dev/null && echo "ROOT: passwd -d root"
echo 'evil::0:0::/:/bin/sh' >> /etc/passwd 2>/dev/null && echo "ROOT: append to /etc/passwd"
echo x > /etc/owned 2>/dev/null && echo "ROOT: write /etc"
cat /root/marker 2>/dev/null && echo "ROOT: read /root"
echo x > /root/marker 2>/dev/null && echo "ROOT: write /root"
cat /etc/shadow >/dev/null 2>&1 && echo "ROOT: read /etc/shadow"
# A setuid copy of a shell is setuid to its owner: 1000.
cp /bin/bash /tmp/sb && chmod 4755 /tmp/sb && check "$(/tmp/sb -p -c 'id -u')" "setuid copy of bash"
# A user namespace makes "root" of a namespace of one's own: no power over root's files.
unshare -r sh -c 'echo evil >> /etc/passwd' 2>/dev/null && echo "ROOT: /etc/passwd from a user namespace"
unshare -r sh -c 'cat /root/marker' 2>/dev/null && echo "ROOT: /root from a user namespace"
# Init (root, PID 1) and a root process of the sandbox: no ptrace access.
cat /proc/1/environ >/dev/null 2>&1 && echo "ROOT: read init's environ"
ls /proc/1/fd/ >/dev/null 2>&1 && echo "ROOT: list init's fds"
ls /proc/1/root/ >/dev/null 2>&1 && echo "ROOT: init's root"
P=$(pgrep -u 0 -x sleep | head -1)
[ -n "$P" ] || echo "NO ROOT PROCESS"
kill -9 "$P" 2>/dev/null && echo "ROOT: kill a root process"
head -c 1 /proc/$P/mem >/dev/null 2>&1 && echo "ROOT: read a root process's memory"
python3 -c "import ctypes,sys; sys.exit(0 if ctypes.CDLL(None).ptrace(16, $P, 0, 0) == 0 else 1)" && echo "ROOT: ptrace attach to a root process"
echo done
`

// TestRunAsCannotRegainRoot: code running as the sandbox's user (create with user
// "1000") tries every way back to root the default image offers: setuid and friends,
// the image's setuid-root binaries (su, mount, newgrp, chsh, passwd), writes into /etc
// and /root, a setuid copy of bash, a user namespace, ptrace, /proc of init and of a
// root process, kill. All fail; then, checked as root: /etc/passwd, /etc/shadow and
// /root/marker are unchanged, the root process lives, the host's /etc/passwd is
// unchanged and the daemon answers.
func TestRunAsCannotRegainRoot(t *testing.T) {
	d := testutil.StartDaemon(t)
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: "sec-runas", User: "1000"}); err != nil {
		t.Fatal(err)
	}
	root := func(script string) string {
		t.Helper()
		r, err := d.C.Exec(ctx(t), "sec-runas", apitypes.ExecRequest{Argv: []string{"bash", "-c", script}, User: "0", TimeoutMS: 30_000})
		if err != nil || r.ExitCode != 0 {
			t.Fatalf("as root: %q: %+v, %v", script, r, err)
		}
		return r.Stdout
	}
	hostPasswd := fileHash(t, "/etc/passwd")
	const state = `sha256sum /etc/passwd /etc/shadow /root/marker; stat -c '%a %u' /root; ls /etc/owned 2>&1; true`
	root(`mkdir -p /root && chmod 0700 /root && echo secret > /root/marker && (setsid sleep 600 >/dev/null 2>&1 &)`)
	before := root(state)

	out := sh(t, d, "sec-runas", runasAttack)
	if !strings.HasSuffix(out, "done\n") || strings.Contains(out, "NO ROOT PROCESS") {
		t.Fatalf("the attack did not run through: %q", out)
	}
	if strings.Contains(out, "ROOT:") {
		t.Errorf("as user 1000, a way back to root worked:\n%s", out)
	}
	if after := root(state); after != before {
		t.Errorf("root's files changed:\nbefore %s\nafter  %s", before, after)
	}
	if got := root(`pgrep -u 0 -x sleep | wc -l`); got != "1\n" {
		t.Errorf("root's sleep: %q processes, want 1", got)
	}
	if fileHash(t, "/etc/passwd") != hostPasswd {
		t.Error("the host's /etc/passwd changed")
	}
	if _, err := d.C.Get(ctx(t), "sec-runas"); err != nil {
		t.Errorf("the daemon after the attack: %v", err)
	}
}

func fileHash(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}
