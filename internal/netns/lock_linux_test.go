package netns

import (
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// newNS makes a network namespace with lo up and returns an fd of it.
func newNS(t *testing.T) int {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("needs root to make a network namespace")
		}
		t.Skip("needs root to make a network namespace")
	}
	fdc := make(chan int, 1)
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread's namespace is not the process's
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- err
			return
		}
		fd, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			errc <- err
			return
		}
		fdc <- fd
	}()
	var fd int
	select {
	case err := <-errc:
		t.Fatalf("new network namespace: %v", err)
	case fd = <-fdc:
	}
	t.Cleanup(func() { _ = unix.Close(fd) })
	h, err := netlink.NewHandleAt(vnetns.NsHandle(fd))
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		t.Fatal(err)
	}
	return fd
}

// pair makes a connected TCP pair on 127.0.0.1 (or ::1) in the namespace nsFD.
func pair(t *testing.T, nsFD int, network, host string) (client, server *net.TCPConn) {
	t.Helper()
	err := In(nsFD, func() error {
		l, err := net.Listen(network, net.JoinHostPort(host, "0"))
		if err != nil {
			return err
		}
		defer l.Close()
		c, err := net.Dial(network, l.Addr().String())
		if err != nil {
			return err
		}
		s, err := l.Accept()
		if err != nil {
			return err
		}
		client, server = c.(*net.TCPConn), s.(*net.TCPConn)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close(); server.Close() })
	return client, server
}

func addrPort(a net.Addr) netip.AddrPort { return a.(*net.TCPAddr).AddrPort() }

// TestLockDropsTCPUntilUnlock: bytes sent on a locked connection do not arrive; after
// Unlock the sender's kernel sends them again and they do, in order, none lost. Other
// connections of the namespace, new ones too (CRIU's kernel-features probe connects a
// socket to itself), and the daemon's own flow meanwhile.
func TestLockDropsTCPUntilUnlock(t *testing.T) {
	for _, f := range []struct{ network, host string }{{"tcp4", "127.0.0.1"}, {"tcp6", "::1"}} {
		t.Run(f.network, func(t *testing.T) {
			ns := newNS(t)
			c, s := pair(t, ns, f.network, f.host)
			other, otherS := pair(t, ns, f.network, f.host)
			if err := Lock(ns, []Tuple{{addrPort(c.LocalAddr()), addrPort(c.RemoteAddr())}}); err != nil {
				t.Fatal(err)
			}
			if ok, err := Locked(ns); err != nil || !ok {
				t.Fatalf("Locked after Lock: %v, %v", ok, err)
			}
			if _, err := c.Write([]byte("under the lock")); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 64)
			_ = s.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
			if n, err := s.Read(buf); err == nil {
				t.Fatalf("read %q through the lock", buf[:n])
			}
			// Not locked: another connection, and a new one.
			if _, err := other.Write([]byte("x")); err != nil {
				t.Fatal(err)
			}
			_ = otherS.SetReadDeadline(time.Now().Add(5 * time.Second))
			if _, err := otherS.Read(buf); err != nil {
				t.Fatalf("another connection of the namespace under the lock: %v", err)
			}
			pair(t, ns, f.network, f.host)
			// The lock is the namespace's alone: the daemon's (this process's) own
			// loopback traffic flows.
			hl, err := net.Listen(f.network, net.JoinHostPort(f.host, "0"))
			if err != nil {
				t.Fatal(err)
			}
			defer hl.Close()
			hc, err := net.DialTimeout(f.network, hl.Addr().String(), 2*time.Second)
			if err != nil {
				t.Fatalf("a connection in the daemon's namespace under a sandbox's lock: %v", err)
			}
			hc.Close()
			if err := Unlock(ns); err != nil {
				t.Fatal(err)
			}
			if ok, err := Locked(ns); err != nil || ok {
				t.Fatalf("Locked after Unlock: %v, %v", ok, err)
			}
			_ = s.SetReadDeadline(time.Now().Add(10 * time.Second))
			n, err := s.Read(buf)
			if err != nil || string(buf[:n]) != "under the lock" {
				t.Fatalf("after Unlock: read %q, %v; want the bytes sent under the lock", buf[:n], err)
			}
			if err := Unlock(ns); err != nil {
				t.Fatalf("Unlock with no lock: %v", err)
			}
		})
	}
}

// TestConfigureRemovesALeftLock: a daemon that died under a lock leaves its table;
// the next Configure (at adoption) removes it.
func TestConfigureRemovesALeftLock(t *testing.T) {
	ns := newNS(t)
	if err := Lock(ns, []Tuple{{netip.MustParseAddrPort("127.0.0.1:1"), netip.MustParseAddrPort("127.0.0.1:2")}}); err != nil {
		t.Fatal(err)
	}
	if err := Configure(ns, 1, 2); err != nil {
		t.Fatal(err)
	}
	if ok, err := Locked(ns); err != nil || ok {
		t.Fatalf("Locked after Configure: %v, %v", ok, err)
	}
}

// TestDestroyOrphan: a connection's end left in TIME_WAIT by its closer is destroyed;
// an end that a process holds is not. IPv4 and IPv6.
func TestDestroyOrphan(t *testing.T) {
	for _, f := range []struct{ network, host string }{{"tcp4", "127.0.0.1"}, {"tcp6", "::1"}} {
		t.Run(f.network, func(t *testing.T) {
			ns := newNS(t)
			d, err := NewDiag(ns)
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			c, s := pair(t, ns, f.network, f.host)
			cl, cr := addrPort(c.LocalAddr()), addrPort(c.RemoteAddr())
			// Held by this process: left alone.
			if ok, err := d.DestroyOrphan(cl, cr); err != nil || ok {
				t.Fatalf("DestroyOrphan of a held socket: %v, %v; want false, nil", ok, err)
			}
			// The client closes first and ends in TIME_WAIT once the server closes.
			c.Close()
			s.Close()
			deadline := time.Now().Add(5 * time.Second)
			for {
				msg, err := d.lookup(cl, cr)
				if err != nil {
					t.Fatal(err)
				}
				if msg != nil && msg[1] == 6 { // TCP_TIME_WAIT
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the client's end did not reach TIME_WAIT: %v", msg)
				}
				time.Sleep(5 * time.Millisecond)
			}
			if ok, err := d.DestroyOrphan(cl, cr); err != nil || !ok {
				t.Fatalf("DestroyOrphan of a TIME_WAIT socket: %v, %v; want true, nil", ok, err)
			}
			if msg, err := d.lookup(cl, cr); err != nil || msg != nil {
				t.Fatalf("the socket is still there after DestroyOrphan: %v, %v", msg, err)
			}
			if ok, err := d.DestroyOrphan(cl, cr); err != nil || ok {
				t.Fatalf("DestroyOrphan of no socket: %v, %v; want false, nil", ok, err)
			}
		})
	}
}

// TestLockManyConnections: a lock of 300 connections (a restore of trees holding as
// many) goes in, and holds one of them; one netlink batch of it failed with ENOBUFS
// past about 35 connections and EMSGSIZE past about 90.
func TestLockManyConnections(t *testing.T) {
	ns := newNS(t)
	c, s := pair(t, ns, "tcp4", "127.0.0.1")
	tuples := []Tuple{{addrPort(c.LocalAddr()), addrPort(c.RemoteAddr())}}
	for i := 0; i < 299; i++ {
		tuples = append(tuples, Tuple{netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(20000+i)), netip.MustParseAddrPort("127.0.0.1:80")})
	}
	if err := Lock(ns, tuples[150:]); err != nil {
		t.Fatal(err)
	}
	if err := Lock(ns, tuples[:150]); err != nil { // added to the lock there
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 8)
	_ = s.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, err := s.Read(buf); err == nil {
		t.Fatalf("read %q through the lock of 300 connections", buf[:n])
	}
	if err := Unlock(ns); err != nil {
		t.Fatal(err)
	}
	_ = s.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := s.Read(buf); err != nil {
		t.Fatalf("after Unlock: %v", err)
	}
}

// Locked says whether the namespace nsFD has a lock: Lock's, or a CRIU dump's.
func Locked(nsFD int) (bool, error) {
	ts, err := tables(nsFD)
	for _, t := range ts {
		if t == LockTable || strings.HasPrefix(t, criuTablePrefix) {
			return true, nil
		}
	}
	return false, err
}
