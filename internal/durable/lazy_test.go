package durable

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestLazyRestoreSession: a python session of a sandbox (its own user namespace) with
// 512 MiB of random bytes is dumped, killed and restored lazily: the restore returns
// before the pages are in, the process answers with every byte as it was (its hash) while
// the server copies the rest, a child it forks meanwhile reads the same bytes, the server
// then exits cleanly, and neither the restored process nor the child keeps a
// userfaultfd or /dev/userfaultfd.
func TestLazyRestoreSession(t *testing.T) {
	r := runner(t)
	s := newSandboxSession(t, "lazy")
	h := strings.Trim(s.run(t, "import os, hashlib\nx = bytearray(os.urandom(512 << 20))\nhashlib.sha256(x).hexdigest()"), "'")
	dir := filepath.Join(s.d.Root, "durable", "lazy1")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	m, err := Dump(t.Context(), r, s.hostPid, dir, DumpOptions{LogLevel: logLevelFromEnv()})
	if err != nil {
		t.Fatal(err)
	}
	sb := nsFiles(t, s.hostPid)
	p := newPty(t, s.hostPid)
	sb.TTYs = map[string]*os.File{m.TTYs[0]: p.slave}
	kill(t, s.hostPid)

	t0 := time.Now()
	st, err := Restore(t.Context(), r, dir, sb, RestoreOptions{LogLevel: logLevelFromEnv(), Lazy: true})
	if err != nil {
		t.Fatal(err)
	}
	restored := time.Since(t0)
	t.Cleanup(func() { kill(t, st.HostPid) })
	if st.Lazy == nil {
		t.Fatal("a lazy restore returned no lazy-pages server")
	}
	select {
	case <-st.Lazy.Done():
		// The server copies the pages while the restore goes on: 200 MiB took it
		// about 0.3 s on one machine of this kind and under 0.12 s on another (a
		// restore that returned after 119 ms found it done), 512 MiB 0.86-0.95 s. It
		// must not be over when the restore returns, or the restore was not lazy.
		t.Fatalf("the lazy-pages server was done when the restore returned (%v): %v", restored, st.Lazy.Err())
	default:
	}
	served := make(chan time.Duration, 1)
	go func() {
		<-st.Lazy.Done()
		served <- time.Since(t0)
	}()
	p.slave.Close()
	// The fork happens at once, while most pages are still in the image.
	got := p.call(t, "pid = os.fork()\nif pid == 0:\n    os._exit(0 if hashlib.sha256(x).hexdigest() == "+fmt.Sprintf("%q", h)+" else 3)\n"+
		"(os.waitpid(pid, 0)[1] >> 8, hashlib.sha256(x).hexdigest())", 60*time.Second)
	answered := time.Since(t0)
	if want := fmt.Sprintf("(0, '%s')", h); got != want {
		t.Fatalf("the lazily restored session answered %s, want %s (a child's status 3: it read other bytes)", got, want)
	}
	if err := st.Lazy.Wait(LazyTimeout); err != nil {
		t.Fatal(err)
	}
	t.Logf("lazy restore returned after %v (CRIU %.3f s); first answer (a fork and two hashes of 512 MiB) after %v; server done after %v",
		restored, st.CRIUS, answered, <-served)
	for _, pid := range []int{st.HostPid} {
		ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		for _, e := range ents {
			l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, e.Name()))
			if strings.Contains(l, "userfaultfd") {
				t.Errorf("the restored process keeps fd %s: %s", e.Name(), l)
			}
		}
	}
	if got := p.call(t, "hashlib.sha256(x).hexdigest()", 30*time.Second); got != fmt.Sprintf("'%s'", h) {
		t.Fatalf("after the server's end the session's bytes hash to %s, want %s", got, h)
	}
}
