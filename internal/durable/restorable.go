package durable

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fown"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// What CRIU dumps but cannot restore into a sandbox. A checkpoint's CRIU trees are
// dumped, then ended (their PIDs must be free), then restored from their images onto the
// new state; its undo restores them onto the old one. An image that CRIU's restore
// refuses fails both, and the process is lost (docs/design/criu-files.md, "Failures";
// docs/research/criu-static/). unrestorable reads a dump's images, before anything is
// ended, for what a restore into the sandbox's user namespace, as DeltaBox runs it,
// cannot put back, so that the checkpoint refuses (409) with the tree still running:
//
//   - A unix socket bound to an absolute path that was removed, or that names another
//     file since (CRIU's "ghost" socket): the restore binds it again in the sandbox's
//     files, after access() on the path's directory, which fails for the restorer
//     (EACCES: its real uid is not the sandbox's; zdtm del_standalone_un). CRIU would
//     also rename the file that has the name now, and make the directories. A connected
//     stream socket with such a name (accepted: zdtm deleted_unix_sock) is not bound
//     again, and is CRIU's to carry; so is a relative name (bound in the cwd).
//   - An fd with an owner for SIGIO/SIGURG (F_SETOWN, or a lease, which makes its taker
//     the owner) whose effective uid is the sandbox's root, or none of the process's
//     uids: CRIU sets its effective uid to the owner's to set it again, which fails for
//     the restorer, or leaves it without the capabilities it needs next ("Can't set
//     UIDs", "Can't change root", "Can't set lease": zdtm file_fown, file_lease00,
//     file_lease01 as the sandbox's root; as uid 18943 they pass).
//   - A TCP socket with a peer (any state but listening or unconnected), in a dump
//     without its connections (DumpOptions.TCPEstablished): CRIU restores one only with
//     --tcp-established or --tcp-close. CRIU's dump refuses established ones itself; it
//     dumps closed ones (both ends shut down, zdtm socket-tcp-close2) and its restore
//     refuses them ("Connected TCP socket in image"). A checkpoint's dump takes them
//     (tcp.go), and bigQueues refuses the queues a restore cannot put back.

// criu/include/magic.h.
const (
	idsMagic  = 0x54432030
	coreMagic = 0x55053847
)

// unrestorable says what in the image in dir a restore into the sandbox cannot put back,
// naming the process (its PID in the sandbox) and the fd; nil if nothing.
//
// With tcp (the dump took TCP connections: DumpOptions.TCPEstablished), a connection
// is the restore's to repair, and is not refused.
func unrestorable(dir string, tcp bool) error {
	ids, err := filepath.Glob(filepath.Join(dir, "ids-*.img"))
	if err != nil {
		return err
	}
	files, err := imageFiles(dir)
	if err != nil {
		return err
	}
	var why []string
	for _, p := range ids {
		pid, err := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(filepath.Base(p), "ids-"), ".img"))
		if err != nil {
			continue
		}
		ents, err := readImageFile(p, idsMagic)
		if err != nil {
			return err
		}
		if len(ents) == 0 {
			return fmt.Errorf("%s: no entry", p)
		}
		var kids criucore.TaskKobjIdsEntry
		if err := proto.Unmarshal(ents[0], &kids); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		uids, err := taskUids(dir, pid)
		if err != nil {
			return err
		}
		fdp := filepath.Join(dir, fmt.Sprintf("fdinfo-%d.img", kids.GetFilesId()))
		fds, err := readImageFile(fdp, fdinfoMagic)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		for _, b := range fds {
			var fi fdinfo.FdinfoEntry
			if err := proto.Unmarshal(b, &fi); err != nil {
				return fmt.Errorf("%s: %w", fdp, err)
			}
			f := files[fi.GetId()]
			if f == nil {
				continue
			}
			if w := cannotRestore(f, uids, tcp); w != "" {
				s := fmt.Sprintf("process %d: fd %d %s", pid, fi.GetFd(), w)
				if !slices.Contains(why, s) {
					why = append(why, s)
				}
			}
		}
	}
	if len(why) > 0 {
		return fmt.Errorf("%s; CRIU's restore, which the checkpoint runs after ending the process, would fail, so it is not ended", strings.Join(why, "; "))
	}
	return nil
}

// taskUids are the real, effective and saved uids of process pid (its PID in the
// sandbox) in the image in dir.
func taskUids(dir string, pid int) ([]uint32, error) {
	p := filepath.Join(dir, fmt.Sprintf("core-%d.img", pid))
	c, err := readCore(p)
	if err != nil {
		return nil, err
	}
	cr := c.GetThreadCore().GetCreds()
	if cr == nil {
		return nil, fmt.Errorf("%s: no credentials", p)
	}
	return []uint32{cr.GetUid(), cr.GetEuid(), cr.GetSuid()}, nil
}

// imageFiles reads files.img by id (an image without one has no files).
func imageFiles(dir string) (map[uint32]*fdinfo.FileEntry, error) {
	path := filepath.Join(dir, "files.img")
	ents, err := readImageFile(path, filesMagic)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	out := map[uint32]*fdinfo.FileEntry{}
	for _, b := range ents {
		var e fdinfo.FileEntry
		if err := proto.Unmarshal(b, &e); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		out[e.GetId()] = &e
	}
	return out, nil
}

// include/net/tcp_states.h.
const (
	tcpEstablished = 1
	tcpListen      = 10
)

var tcpStates = map[uint32]string{1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
	6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 11: "CLOSING"}

// cannotRestore says why f cannot be restored into the sandbox ("" if it can): the rest
// of a sentence that starts "fd N".
func cannotRestore(f *fdinfo.FileEntry, uids []uint32, tcp bool) string {
	if u := f.GetUsk(); u != nil && u.GetDeleted() && len(u.GetName()) > 0 && u.GetName()[0] == '/' &&
		(u.GetType() == unix.SOCK_DGRAM || u.GetState() != tcpEstablished) {
		return fmt.Sprintf("is a unix socket bound to %s, a name that was removed or names another file since, which CRIU would bind again in the sandbox's files and cannot (close it, or keep its name)", strings.TrimRight(string(u.GetName()), "\x00"))
	}
	if i := f.GetIsk(); !tcp && i != nil && i.GetProto() == 6 && i.GetDstPort() != 0 && i.GetState() != tcpListen {
		return fmt.Sprintf("is a TCP connection (%s to %s, %s), which CRIU restores only by repairing or closing it, as a checkpoint does not (close it before the checkpoint)",
			tcpEnd(i.GetSrcAddr(), i.GetSrcPort()), tcpEnd(i.GetDstAddr(), i.GetDstPort()), tcpState(i.GetState()))
	}
	if o := badOwner(f.ProtoReflect(), uids); o != nil {
		who := "the sandbox's root"
		if o.GetEuid() != 0 {
			who = fmt.Sprintf("uid %d, not the process's own", o.GetEuid())
		}
		return fmt.Sprintf("has a signal owner (fcntl F_SETOWN, or a lease, F_SETLEASE, which sets it; pid %d) whose effective uid is %s, which CRIU cannot set again in the sandbox (clear it: F_SETOWN 0, F_SETLEASE F_UNLCK; or set it as the process's own user, not root)", o.GetPid(), who)
	}
	return ""
}

func tcpState(s uint32) string {
	if n, ok := tcpStates[s]; ok {
		return n
	}
	return "state " + strconv.Itoa(int(s))
}

// tcpEnd is an end of a TCP socket of the image, as addr:port.
func tcpEnd(a []uint32, port uint32) string {
	if ap, err := imageAddrPort(a, port); err == nil {
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()).String()
	}
	return fmt.Sprintf("port %d", port)
}

// badOwner finds in m (a file entry, any of its kinds) an owner CRIU would set again (a
// pid) with an effective uid that CRIU's restore cannot take: the sandbox's root, or one
// that is none of the process's uids (uids: real, effective, saved). Measured (zdtm
// file_fown, file_lease00/01): an owner of the process's own uid, not root, is restored;
// one of uid 0 (a process of the sandbox's root) or of another uid (set while the
// effective uid was another) fails the restore.
func badOwner(m protoreflect.Message, uids []uint32) *fown.FownEntry {
	var found *fown.FownEntry
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Kind() != protoreflect.MessageKind || fd.IsList() || fd.IsMap() {
			return true
		}
		if o, ok := v.Message().Interface().(*fown.FownEntry); ok {
			if o.GetPid() != 0 && (o.GetEuid() == 0 || !slices.Contains(uids, o.GetEuid())) {
				found = o
			}
		} else {
			found = badOwner(v.Message(), uids)
		}
		return found == nil
	})
	return found
}
