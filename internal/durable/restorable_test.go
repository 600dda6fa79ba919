package durable

import (
	"strings"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fown"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/regfile"
	skinet "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-inet"
	skunix "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-unix"
	"google.golang.org/protobuf/proto"
)

// cannotRestore names what CRIU's restore into a sandbox fails on, and only that.
func TestCannotRestore(t *testing.T) {
	owner := func(pid, euid uint32) *fown.FownEntry {
		return &fown.FownEntry{Uid: proto.Uint32(euid), Euid: proto.Uint32(euid), Signum: proto.Uint32(0), PidType: proto.Uint32(1), Pid: proto.Uint32(pid)}
	}
	for _, c := range []struct {
		name string
		f    *fdinfo.FileEntry
		want string // "" : restorable
	}{
		{"ghost unix socket", &fdinfo.FileEntry{Usk: &skunix.UnixSkEntry{Name: []byte("/workspace/d/sock"), Deleted: proto.Bool(true), Fown: owner(0, 0)}}, "unix socket bound to /workspace/d/sock"},
		{"relative ghost unix socket", &fdinfo.FileEntry{Usk: &skunix.UnixSkEntry{Name: []byte("sock"), Deleted: proto.Bool(true), Fown: owner(0, 0)}}, ""},
		{"bound unix socket", &fdinfo.FileEntry{Usk: &skunix.UnixSkEntry{Name: []byte("/workspace/sock"), Fown: owner(0, 0)}}, ""},
		{"closed TCP connection", &fdinfo.FileEntry{Isk: &skinet.InetSkEntry{Proto: proto.Uint32(6), State: proto.Uint32(7), SrcPort: proto.Uint32(1), DstPort: proto.Uint32(2),
			SrcAddr: []uint32{0x0100007f}, DstAddr: []uint32{0x0100007f}, Fown: owner(0, 0)}}, "TCP connection (127.0.0.1:1 to 127.0.0.1:2, CLOSE)"},
		{"listening TCP socket", &fdinfo.FileEntry{Isk: &skinet.InetSkEntry{Proto: proto.Uint32(6), State: proto.Uint32(10), SrcPort: proto.Uint32(1), DstPort: proto.Uint32(0), Fown: owner(0, 0)}}, ""},
		{"accepted ghost unix socket", &fdinfo.FileEntry{Usk: &skunix.UnixSkEntry{Name: []byte("/workspace/sock"), Type: proto.Uint32(1), State: proto.Uint32(1), Deleted: proto.Bool(true), Fown: owner(0, 0)}}, ""},
		{"listening ghost unix socket", &fdinfo.FileEntry{Usk: &skunix.UnixSkEntry{Name: []byte("/workspace/sock"), Type: proto.Uint32(1), State: proto.Uint32(10), Deleted: proto.Bool(true), Fown: owner(0, 0)}}, "unix socket bound to"},
		{"fd owned by another uid", &fdinfo.FileEntry{Reg: &regfile.RegFileEntry{Name: proto.String("/workspace/leased"), Fown: owner(22, 1)}}, "uid 1, not the process's own"},
		{"fd owned by root", &fdinfo.FileEntry{Reg: &regfile.RegFileEntry{Name: proto.String("/workspace/leased"), Fown: owner(22, 0)}}, "signal owner"},
		{"fd owned by a user", &fdinfo.FileEntry{Reg: &regfile.RegFileEntry{Name: proto.String("/workspace/leased"), Fown: owner(22, 18943)}}, ""},
		{"socket owned by root", &fdinfo.FileEntry{Usk: &skunix.UnixSkEntry{Fown: owner(22, 0)}}, "signal owner"},
	} {
		got := cannotRestore(c.f, []uint32{18943, 18943, 18943}, false)
		if (c.want == "") != (got == "") || !strings.Contains(got, c.want) {
			t.Errorf("%s: %q, want %q", c.name, got, c.want)
		}
		// A dump that took TCP connections (--tcp-established) restores them; the
		// rest is refused as before.
		want := c.want
		if strings.HasPrefix(want, "TCP connection") {
			want = ""
		}
		if got := cannotRestore(c.f, []uint32{18943, 18943, 18943}, true); (want == "") != (got == "") || !strings.Contains(got, want) {
			t.Errorf("%s, with TCP connections taken: %q, want %q", c.name, got, want)
		}
	}
}
