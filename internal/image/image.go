// Package image imports images into the store: from a rootfs directory, a tar of one
// (optionally gzip'd), a `docker save` tarball or an OCI image layout (a tarball or a
// directory), whose layers are applied in order with their whiteouts.
//
// # Staging and commit
//
// An import is built in ROOT/images/.new-NAME/rootfs, gets its image.json, is synced,
// and is renamed to ROOT/images/NAME (renameat2 RENAME_NOREPLACE): the rename is the
// commit point. On any error the staging directory is removed, so a refused or failed
// import leaves nothing in the store; a crash leaves a .new-* directory that the
// daemon's start-up sweep (store.Sweep) deletes.
//
// # What an archive may hold (the rules, checked on every entry)
//
//   - Names are relative: an absolute name ("/etc/passwd") or any ".." component is
//     refused. "." and empty components are dropped ("./etc//x" is "etc/x").
//   - Nothing is ever created through a symbolic link. Every parent directory is
//     opened with openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_XDEV) from the
//     rootfs's descriptor, and the last component with O_NOFOLLOW / AT_SYMLINK_NOFOLLOW;
//     an entry whose parent path goes through a link (one the archive made earlier,
//     "evil -> /etc" then "evil/passwd") is refused. The same holds for whiteouts and
//     hard-link targets.
//   - Symbolic links: a relative target is resolved lexically against the link's own
//     directory and refused if it climbs above the image root ("a/l -> ../../etc").
//     An absolute target is kept: it names a path inside the image (at run time the
//     sandbox's root is the image, and the importer never follows a link).
//   - Hard links: the target is an archive name (relative, no ".."; absolute refused),
//     opened with the same confinement, so it is always a file already in the image.
//   - Character and block devices, fifos and sockets are refused (the error names the
//     entry and its kind), except under dev/ at the image root, where they are skipped:
//     every sandbox mounts its own /dev over that directory, and rootfs trees made by
//     debootstrap or mmdebstrap carry /dev/null and friends there.
//   - Setuid and setgid files (not directories, where setgid only sets the group of
//     new entries) and file capabilities (security.capability) are refused unless
//     Options.AllowSetuid.
//   - Size bombs: an entry whose declared size alone exceeds Options.MaxBytes, or that
//     would bring the extracted total over it, is refused before any of its data is
//     written; so is an archive with more than Options.MaxEntries entries (whiteouts
//     included), a docker/OCI archive with more than 1000 layers, and a gzip'd image
//     archive that decompresses to more than MaxBytes + 1 GiB.
//   - Extended attributes: user.* are kept; security.capability as above; others
//     (trusted.*, which overlayfs interprets, security.selinux, ACLs) are dropped.
//
// Modes, owners and times are preserved. A directory source is copied with the same
// rules (it goes through the same writer), file data cloned (FICLONE: a reflink, when
// the source is on the store's filesystem) or else copied; like `cp -ax` it does not
// descend into other filesystems mounted below the source.
//
// Finally the mount points every sandbox needs are made if missing: /proc, /dev and
// /dev/shm (replaced by directories if the image has something else there: mountns
// requires directories), and /tmp, /var/tmp (1777), /workspace, /sys, /run.
package image

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/store"
)

const (
	// DefaultMaxBytes caps the bytes an import extracts unless Options.MaxBytes says
	// otherwise: 4 GiB, 14 times the default image (293 MiB: python, gcc, node, git) and
	// room for a toolchain image, while one import can take at most a sixteenth of a
	// 64 GiB store (it was 16 GiB, a quarter) before the caller raises it.
	DefaultMaxBytes int64 = 4 << 30
	// DefaultMaxEntries caps the entries of an import unless Options.MaxEntries says otherwise.
	DefaultMaxEntries int64 = 4 << 20
	maxLayers               = 1000
	maxJSON                 = 16 << 20
)

// Options tune an import.
type Options struct {
	AllowSetuid bool  // keep setuid/setgid files and file capabilities
	MaxBytes    int64 // cap on the extracted bytes (0: DefaultMaxBytes)
	MaxEntries  int64 // cap on the entries (0: DefaultMaxEntries)
}

func (o Options) withDefaults() Options {
	if o.MaxBytes <= 0 {
		o.MaxBytes = DefaultMaxBytes
	}
	if o.MaxEntries <= 0 {
		o.MaxEntries = DefaultMaxEntries
	}
	return o
}

var nameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]{0,62}$`)

// ValidName checks an image name: 1-63 of a-z 0-9 . _ -, starting with a letter or digit.
func ValidName(name string) error {
	if !nameRE.MatchString(name) {
		return fmt.Errorf("image name %q: use 1-63 characters of a-z, 0-9, '.', '_', '-', starting with a letter or digit: %w", name, errdefs.ErrInvalid)
	}
	return nil
}

// Check makes the quick checks of an import (name, name free, source present) so that
// an API can refuse with the right status before it starts streaming progress.
func Check(storeRoot, name, source string) error {
	if err := ValidName(name); err != nil {
		return err
	}
	if _, err := os.Lstat(filepath.Join(storeRoot, "images", name)); err == nil {
		return fmt.Errorf("image %s already exists (deltabox image rm %s first, or choose another name): %w", name, name, errdefs.ErrConflict)
	}
	if source == "" || !filepath.IsAbs(source) {
		return fmt.Errorf("source %q must be an absolute path on the daemon's host: %w", source, errdefs.ErrInvalid)
	}
	fi, err := os.Stat(source)
	if err != nil {
		return fmt.Errorf("source %s: %v (a rootfs directory, a tar, a docker save or OCI layout tarball on the daemon's host): %w", source, errors.Unwrap(err), errdefs.ErrInvalid)
	}
	if !fi.IsDir() && !fi.Mode().IsRegular() {
		return fmt.Errorf("source %s is neither a directory nor a regular file: %w", source, errdefs.ErrInvalid)
	}
	if fi.IsDir() {
		src, err1 := filepath.EvalSymlinks(source)
		st, err2 := filepath.EvalSymlinks(storeRoot)
		if err1 == nil && err2 == nil && (src == st || strings.HasPrefix(st, strings.TrimSuffix(src, "/")+"/")) {
			return fmt.Errorf("source directory %s contains the store %s: import a rootfs directory, not a parent of the store: %w", source, storeRoot, errdefs.ErrInvalid)
		}
	}
	return nil
}

var (
	inflightMu sync.Mutex
	// +checklocks:inflightMu
	inflight = map[string]bool{}
)

// Import imports source as image name into the store at storeRoot. progress, if not
// nil, is called as the import advances (done and total in bytes of the source; total
// may change once the source's kind is known) and once at the end with done == total.
// Errors are classified with errdefs: ErrInvalid (bad name, refused or unreadable
// archive), ErrConflict (name taken). On error nothing is left in the store.
func Import(ctx context.Context, storeRoot, name, source string, opts Options, progress func(done, total int64)) (*store.Image, error) {
	if err := Check(storeRoot, name, source); err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	key := filepath.Join(storeRoot, name)
	inflightMu.Lock()
	if inflight[key] {
		inflightMu.Unlock()
		return nil, fmt.Errorf("image %s is being imported by another request: %w", name, errdefs.ErrConflict)
	}
	inflight[key] = true
	inflightMu.Unlock()
	defer func() {
		inflightMu.Lock()
		delete(inflight, key)
		inflightMu.Unlock()
	}()

	images := filepath.Join(storeRoot, "images")
	if err := os.MkdirAll(images, 0o700); err != nil {
		return nil, err
	}
	staging := filepath.Join(images, ".new-"+name)
	if err := os.RemoveAll(staging); err != nil { // a crashed import's leftover
		return nil, fmt.Errorf("remove the leftover %s: %w", staging, err)
	}
	im, err := build(ctx, staging, name, source, opts, progress)
	if err == nil {
		err = commit(staging, filepath.Join(images, name), name)
	}
	if err != nil {
		if rerr := os.RemoveAll(staging); rerr != nil {
			err = errors.Join(err, fmt.Errorf("could not remove the staging directory (the daemon's next start sweeps it): %w", rerr))
		}
		return nil, err
	}
	return im, nil
}

// build makes staging/rootfs and staging/image.json.
func build(ctx context.Context, staging, name, source string, opts Options, progress func(done, total int64)) (*store.Image, error) {
	rootfs := filepath.Join(staging, "rootfs")
	if err := os.Mkdir(staging, 0o755); err != nil {
		return nil, err
	}
	if err := os.Mkdir(rootfs, 0o755); err != nil {
		return nil, err
	}
	t, err := openTree(ctx, rootfs, opts)
	if err != nil {
		return nil, err
	}
	defer t.close()
	if err := unix.Fchmod(t.root, 0o755); err != nil {
		return nil, err
	}
	m := &meter{fn: progress}
	kind, err := importSource(ctx, t, staging, source, m)
	if err != nil {
		return nil, fmt.Errorf("import %s from %s: %w", name, source, err)
	}
	// Every command and session of a sandbox starts a program of the image (a shell, at
	// the least): an image without /bin (an empty archive, a docker save with no layers)
	// would make sandboxes in which nothing runs.
	var st unix.Stat_t
	if err := unix.Fstatat(t.root, "bin", &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, fmt.Errorf("import %s from %s: %w", name, source,
			refuse("the %s has no /bin, so nothing could run in a sandbox made of it: import a root filesystem (a rootfs tar or directory, or docker save of an image with a shell)", kind))
	}
	if err := t.ensureMountPoints(); err != nil {
		return nil, fmt.Errorf("import %s: %w", name, err)
	}
	t.finish()
	m.finish()
	im := &store.Image{Name: name, Created: time.Now().UTC(), Source: source + " (" + kind + ")", Bytes: store.DirBytes(rootfs)}
	b, err := json.Marshal(im)
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(staging, "image.json"), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, err
	}
	_, err = f.Write(append(b, '\n'))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return im, err
}

// commit makes the staged image durable and renames it into place.
func commit(staging, final, name string) error {
	fd, err := unix.Open(staging, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	err = unix.Syncfs(fd)
	unix.Close(fd)
	if err != nil {
		return fmt.Errorf("syncfs: %w", err)
	}
	err = unix.Renameat2(unix.AT_FDCWD, staging, unix.AT_FDCWD, final, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EEXIST) || errors.Is(err, unix.ENOTEMPTY) {
		return fmt.Errorf("image %s already exists (it appeared during the import): %w", name, errdefs.ErrConflict)
	}
	if err != nil {
		return fmt.Errorf("commit image %s: %w", name, err)
	}
	return nil
}

// refuse is the error of a hostile or unsupported archive.
func refuse(format string, args ...any) error {
	return fmt.Errorf("%s: %w", fmt.Sprintf(format, args...), errdefs.ErrInvalid)
}

// meter turns the positions of the passes over a source into progress calls.
type meter struct {
	fn    func(done, total int64)
	total int64
	base  int64
	span  int64
	unit  int64
	last  int64
	lastT time.Time
}

// pass starts a pass that covers [base, base+span) of the total, whose positions run to unit.
func (m *meter) pass(total, base, span, unit int64) {
	m.total, m.base, m.span, m.unit = total, base, span, unit
	m.at(0)
}

func (m *meter) at(pos int64) {
	if m == nil || m.fn == nil {
		return
	}
	done := m.base
	if m.unit > 0 {
		if pos > m.unit {
			pos = m.unit
		}
		done += int64(float64(m.span) * float64(pos) / float64(m.unit))
	}
	now := time.Now()
	if done != m.base && done-m.last < m.total/100 && now.Sub(m.lastT) < 200*time.Millisecond {
		return
	}
	m.last, m.lastT = done, now
	m.fn(done, m.total)
}

func (m *meter) finish() {
	if m == nil || m.fn == nil {
		return
	}
	m.fn(m.total, m.total)
}
