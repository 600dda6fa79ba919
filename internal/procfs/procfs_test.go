package procfs

import (
	"os"
	"reflect"
	"testing"
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
