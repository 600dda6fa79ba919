package e2e

import (
	"testing"

	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// TestKernelStateNoKeyrings: kernel keyrings are shared beyond the sandbox (its session
// keyring was the daemon's, its user keyring the host root's) and beyond any checkpoint
// (a template shares its session keyring): a sandbox's processes cannot use them.
// add_key, request_key and keyctl fail with EPERM (the x32 numbers with ENOSYS, as every
// x32 call under the sandbox's seccomp filter: internal/sbinit/seccomp.go) in an exec, in
// a session, and in a session's process restored from a template. Before, add_key put a
// key into a keyring shared with the host (the key this test adds then expires in 2 s).
func TestKernelStateNoKeyrings(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "keys")
	probe := `python3 -c "
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *a):
    r = libc.syscall(nr, *a)
    return 'ok' if r >= 0 else str(ctypes.get_errno())
out = []
for ring in (-3, -4):  # KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING
    k = libc.syscall(248, b'user', b'deltabox-test', b'v', 1, ctypes.c_long(ring))
    out.append('ok' if k >= 0 else str(ctypes.get_errno()))
    if k >= 0:
        libc.syscall(250, 15, k, 2)  # KEYCTL_SET_TIMEOUT: gone in 2 s
out.append(call(249, b'user', b'deltabox-test', None, 0))
out.append(call(250, 0, ctypes.c_long(-3), 0))  # KEYCTL_GET_KEYRING_ID
out.append(call(0x40000000 + 250, 0, ctypes.c_long(-3), 0))
print(' '.join(out))
"`
	const want = "1 1 1 1 38\n" // EPERM each, ENOSYS for x32
	if got := dbxSh(t, d, "keys", probe); got != want {
		t.Fatalf("keyring calls in an exec: %q, want EPERM for each, ENOSYS for x32 (%q)", got, want)
	}
	if _, err := d.C.StartSession(dbxCtx(t), "keys", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	if got := sessRun(t, d, "keys", "main", probe); got != want {
		t.Fatalf("keyring calls in a session: %q", got)
	}
	n := dbxCheckpoint(t, d, "keys", "k").Node.ID
	dbxRestore(t, d, "keys", n)
	if got := sessRun(t, d, "keys", "main", probe); got != want {
		t.Fatalf("keyring calls in a restored session: %q", got)
	}
	pyProbe := "import ctypes; libc = ctypes.CDLL(None, use_errno=True); r = libc.syscall(250, 0, ctypes.c_long(-3), 0); (r, ctypes.get_errno())"
	if got := sessRun(t, d, "keys", "py", pyProbe); got != "(-1, 1)\n" {
		t.Fatalf("keyctl in a restored python session: %q", got)
	}
}
