package fastpath

import (
	"fmt"

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
)

// Park moves a template onto a read-only view of its node's layers, whose mount
// namespace ns (the daemon's fd, handed over): injected setns and chdir to its working directory,
// and every file or directory fd reopened there read-only at the same offset. Until then
// the template sits in the namespace of the state it was forked on, whose read-write
// overlay has, since the checkpoint, a frozen layer's directory as its upper; parked, it
// keeps no read-write mount alive (its private file mappings still pin the files they
// map, as any mapping does).
//
// Restore never uses a template's own file descriptors (Revive reopens each from the
// recorded Proc on the restored state and dup3s it over), but it needs their numbers
// taken: a reopen that lands on a free number equal to a later fd's would make that
// dup3 fail. So they are replaced, not closed. The terminal and device fds are kept.
//
// The template stays stopped and runs none of its code: tr holds it seized in a
// ptrace-stop for its whole life (Template.tr says why). If Park fails half way the template is still
// a valid template (each fd is either the old one or its read-only replacement) and
// stays where it is.
func Park(tr *remote.Tracer, tmpl *Template, ns int) error {
	t, err := holdTemplate(tr, tmpl)
	if err != nil {
		return err
	}
	err = tr.Do(func() error {
		h, err := handFD(t, ns)
		if err != nil {
			return fmt.Errorf("hand over the read-only view's namespace: %w", err)
		}
		var b remote.Batch
		h.recvCalls(&b)
		b.Add("setns", unix.SYS_SETNS, h.tx, unix.CLONE_NEWNS)
		b.Add("close the namespace fd", unix.SYS_CLOSE, h.tx)
		if _, err := t.RunBatch(&b); err != nil {
			h.cleanup(t)
			return fmt.Errorf("enter the read-only view: %w", err)
		}
		if err := t.Chdir(tmpl.Cwd); err != nil {
			return fmt.Errorf("chdir %s: %w", tmpl.Cwd, err)
		}
		for _, f := range tmpl.FDs {
			if f.Kind != "file" && f.Kind != "dir" {
				continue
			}
			flags := unix.O_RDONLY
			if f.Kind == "dir" {
				flags |= unix.O_DIRECTORY
			}
			nfd, err := t.Open(f.Path, flags, 0)
			if err != nil {
				return fmt.Errorf("reopen fd %d (%s) read-only: %w", f.Num, f.Path, err)
			}
			if f.Kind == "file" && f.Pos != 0 {
				if _, err := t.Lseek(nfd, f.Pos, 0); err != nil {
					_ = t.Close(nfd) // a failed injected close kills the tracee (remote)
					return fmt.Errorf("seek fd %d: %w", f.Num, err)
				}
			}
			err = t.Dup3(nfd, f.Num, f.Flags&unix.O_CLOEXEC)
			_ = t.Close(nfd) // a failed injected close kills the tracee (remote)
			if err != nil {
				return fmt.Errorf("dup3 fd %d: %w", f.Num, err)
			}
		}
		return nil
	})
	// Put back as it was (registers, scratch memory) and kept seized (Template.tr).
	if rerr := t.Restore(); err == nil && rerr != nil {
		err = fmt.Errorf("put the template back: %w", rerr)
	}
	return err
}
