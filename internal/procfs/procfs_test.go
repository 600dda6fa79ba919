package procfs

import (
	"os"
	"reflect"
	"strconv"
	"testing"
	"time"
)

func TestParseNSpid(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []int
		err  bool
	}{
		{"Name:\tbash\nNSpid:\t4242\t17\t1\nNSsid:\t1\n", []int{4242, 17, 1}, false},
		{"NSpid:\t99\n", []int{99}, false},
		{"Name:\tx\n", nil, true},
		{"NSpid:\n", nil, true},
		{"NSpid:\t12\tx\n", nil, true},
	} {
		got, err := ParseNSpid([]byte(c.in))
		if (err != nil) != c.err || !reflect.DeepEqual(got, c.want) {
			t.Errorf("ParseNSpid(%q) = %v, %v; want %v, error %v", c.in, got, err, c.want, c.err)
		}
	}
}

func TestNSpidSelf(t *testing.T) {
	ns, err := NSpid(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if ns[0] != os.Getpid() {
		t.Fatalf("NSpid of self starts with %d, want %d", ns[0], os.Getpid())
	}
	if _, err := NSpid(1 << 30); err == nil {
		t.Fatal("NSpid of a PID that cannot exist: no error")
	}
}

func TestStatSelf(t *testing.T) {
	f, err := Stat(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// /proc/PID/stat shows the main thread's state, and the test runs on another
	// thread: the main one may be running or asleep.
	if len(f) < 20 || (f[0][0] != 'R' && f[0][0] != 'S') {
		t.Fatalf("own stat fields from state on: %q", f)
	}
	if s := State(os.Getpid()); s != 'R' && s != 'S' {
		t.Errorf("own state %q, want R or S", s)
	}
	if string(f[1]) != strconv.Itoa(os.Getppid()) {
		t.Errorf("field 4 (ppid) %q, want %d", f[1], os.Getppid())
	}
}

func TestStatusUint(t *testing.T) {
	st := []byte("Name:\tx\nvoluntary_ctxt_switches:\t12\nnonvoluntary_ctxt_switches:\t3\n")
	if n, err := StatusUint(st, "voluntary_ctxt_switches"); err != nil || n != 12 {
		t.Errorf("voluntary: %d, %v", n, err)
	}
	if n, err := StatusUint(st, "nonvoluntary_ctxt_switches"); err != nil || n != 3 {
		t.Errorf("nonvoluntary: %d, %v", n, err)
	}
	if _, err := StatusUint(st, "Threads"); err == nil {
		t.Error("a missing key gave no error")
	}
}

func TestReadStatmSelf(t *testing.T) {
	s, err := ReadStatm(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if s.Size == 0 || s.Resident == 0 || s.Resident > s.Size || s.ResidentBytes() < s.AnonBytes() {
		t.Fatalf("statm of self: %+v (anonymous %d bytes)", s, s.AnonBytes())
	}
	if _, err := ReadStatm(1 << 30); err == nil {
		t.Fatal("statm of a PID that cannot exist: no error")
	}
	if _, err := parseStatm("statm", []byte("12 x 3 0 0 0 0\n")); err == nil {
		t.Fatal("an unparsable statm: no error")
	}
	if got := (Statm{Resident: 1, Shared: 2}).AnonBytes(); got != 0 {
		t.Fatalf("AnonBytes with shared above resident = %d, want 0", got)
	}
}

func TestPageTablesSelf(t *testing.T) {
	if PageTables(os.Getpid()) <= 0 {
		t.Fatal("PageTables of self: 0")
	}
	if PageTables(1<<30) != 0 {
		t.Fatal("PageTables of a PID that cannot exist: not 0")
	}
}

func TestParseCPUStall(t *testing.T) {
	in := "some avg10=0.00 avg60=0.10 avg300=0.05 total=123456\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
	if d, ok := parseCPUStall([]byte(in)); !ok || d != 123456*time.Microsecond {
		t.Fatalf("parseCPUStall = %v, %v", d, ok)
	}
	if _, ok := parseCPUStall([]byte("full avg10=0 total=1\n")); ok {
		t.Fatal("parseCPUStall without a some line: ok")
	}
}
