// Package store owns DeltaBox's state directory: the reflink filesystem that holds
// images and layers, and the bbolt index of nodes and sandboxes.
//
// Layout (all on one XFS with reflink=1, so overlay copy-up clones extents):
//
//	ROOT/index.db              bbolt: buckets "nodes", "sandboxes"
//	ROOT/images/NAME/rootfs    an image's tree, the bottom lower of every stack
//	ROOT/images/NAME/image.json written last: an image without it is incomplete
//	ROOT/layers/ID/diff        a layer while it is a sandbox's upper
//	ROOT/layers/ID/work        overlay's workdir while the layer is an upper
//	ROOT/layers/ID/frozen      the layer frozen (Freeze): a node's lower, never written
//	                           again; diff and work go once the index names the node
//	ROOT/sandboxes/ID/         per-sandbox files (init root mount point, init log)
//	ROOT/imported/NODE/        an imported node's process image (state/transfer.go)
//	ROOT/tmp/                  scratch, emptied at every start
//	ROOT/reserve               room the index committer frees on ENOSPC (reserve.go)
//	ROOT/projects              the claim on the store's range of XFS project ids (projrange.go)
//
// Every layer directory carries an XFS project id of the store's range (project.go,
// projrange.go), inherited by all made in it; usage.go measures the uppers by project
// for the disk quota.
//
// Crash safety. The index is the truth; the filesystem is made to agree with it at
// every start (Sweep). New directories are created before the index names them, and
// removed only after the index has stopped naming them, so a crash between the two
// leaves an orphan that the sweep deletes, never an index entry without its data.
// Index writes are applied in order by one committer goroutine (see Index), which
// syncs the filesystem first, so a node the index calls durable has durable layers.
package store

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
)

// DefaultRoot is the state directory unless configured otherwise.
const DefaultRoot = "/var/lib/deltabox"

// Node is one checkpoint as index.db records it: an immutable point of the snapshot tree.
// It is the store's record, not the API's: a field the API gains is not written to disk,
// and one the disk gains is not shown, unless the daemon converts it (state/tree.go:
// apiNode). Its JSON is the form index.db has held since the first release (the fields
// of apitypes.Node, which was the record then): TestIndexLoadsNodesWrittenAsAPITypes.
type Node struct {
	ID      string    `json:"id"`
	Parent  string    `json:"parent,omitempty"` // empty: the node sits directly on its image
	Image   string    `json:"image"`
	Created time.Time `json:"created"`
	Label   string    `json:"label,omitempty"`
	Sandbox string    `json:"sandbox,omitempty"` // the sandbox it was taken from
	// Layer is the top layer of the node's stack: its own (Own) frozen from the
	// sandbox's upper, or its parent's when nothing changed (0: the image alone).
	Layer uint64 `json:"layer"`
	Own   bool   `json:"own_layer"`
	Bytes int64  `json:"layer_bytes"` // apparent size of its own layer, -1 until measured
	// Squash is a layer that shows the node's whole stack (its layers over the image)
	// in one (state/squash.go): set, the node's stack and its descendants' stop there.
	// Owned by the node, removed with it. 0: none.
	Squash uint64 `json:"squash_layer,omitempty"`
}

// Sandbox is the persistent record of a sandbox as index.db records it: the store's,
// not the API's, like Node (state/sandboxes.go: apiSandbox converts). Its JSON is what
// index.db has held since apitypes.Sandbox was the record:
// TestIndexLoadsSandboxesWrittenAsAPITypes.
type Sandbox struct {
	ID       string `json:"id"`
	Image    string `json:"image"`
	Head     string `json:"head,omitempty"` // node the current state descends from
	Upper    uint64 `json:"upper"`          // layer id of the writable upper
	Workdir  string `json:"workdir"`
	Hostname string `json:"hostname"`
	// User is the create's user as given ("": root).
	User    string    `json:"user,omitempty"`
	Created time.Time `json:"created"`
	// Limits are resolved at create time (no zero field) and applied again whenever the
	// sandbox starts; zero fields in records older than limits mean the defaults. (The
	// cgroup package's type, which the API shows as it is.)
	Limits apitypes.Limits `json:"limits"`
	// WarmProcesses turns on the async warm-up of processes after a restore
	// (state/procwarm.go) for this sandbox.
	WarmProcesses bool `json:"warm_processes,omitempty"`
	// UIDBase is the host uid and gid that root of the sandbox's user namespace maps
	// to; its 65536 ids follow. Each sandbox has a range of its own, allocated at
	// create and kept in its record. 0: no user namespace (the daemon runs with
	// isolation off).
	UIDBase uint32 `json:"uid_base,omitempty"`
	// DiskMB is the quota on its upper layer, resolved at create (0 in records older than
	// quotas: the default).
	DiskMB int64 `json:"disk_mb,omitempty"`
	// TemplateBudgetMB is the create's template budget resolved (-1: none; 0 in records
	// older than budgets: the daemon's default). The sandbox's kernel memory limit is
	// Limits.MemoryBytes plus this.
	TemplateBudgetMB int64 `json:"template_budget_mb,omitempty"`
	// Init names the running init for the next daemon, which adopts the sandbox, its
	// processes and sessions instead of starting it afresh; nil: none recorded.
	Init *InitRef `json:"init,omitempty"`
	// Network is the create's egress rules, the model endpoint's key included (this
	// root-only index is the one place the key is kept; the API redacts it). nil: none.
	Network *apitypes.Network `json:"network,omitempty"`
	// ForkOf is the node whose processes this sandbox, a fork's branch, was made to run
	// (state/fork.go): its boots keep the PIDs of it and its ancestors free, and its
	// restores may bring them back from their images. Fixed at create.
	ForkOf string `json:"fork_of,omitempty"`
	// Family names, for a member of a fast fork's family (state/family.go), the family's
	// holder, which the next daemon adopts before the members. nil: none.
	Family *FamilyRef `json:"family,omitempty"`
	// Cgroup names its runtime's cgroups when they are not named by ID: a member of a
	// family whose runtime was a spare, made while its runtime held ID's
	// (state/spares.go). The next daemon adopts that runtime by it. "": ID.
	Cgroup string `json:"cgroup,omitempty"`
}

// FamilyRef is a fast fork's family as its members' records name it. A fork writes its
// branches' records with Made false as it makes them, then, once the source has moved,
// the source's and every branch's with Made true: a start that finds no member of a
// family Made (a crash cut its fork) removes the branches, and one that finds any adopts
// the holder and every member.
type FamilyRef struct {
	// ID names the holder's cgroups and its templates' owner in the process records.
	ID string `json:"id"`
	// Source is the sandbox whose first runtime the holder is: its directory holds the
	// family's host id range (hostids' proof of life) until the holder ends.
	Source string `json:"source"`
	// Holder is the family init (PID 1 of the family's PID namespace).
	Holder InitRef `json:"holder"`
	// Made: the fork that made the family finished.
	Made bool `json:"made,omitempty"`
}

// InitRef names one process for good: its host PID and its /proc/PID/stat starttime
// (clock ticks after boot), which a reused PID does not have, and what its code does.
type InitRef struct {
	Pid   int    `json:"pid"`
	Start uint64 `json:"start"`
	// Level is the feature level of the daemon that started it (sbinit.FeatureLevel):
	// what init does for each command it spawns. 0 in records older than levels.
	Level int `json:"level,omitempty"`
}

// Image is an imported image (image.json); its wire form, also its form on disk, is
// still defined once, in apitypes.
type Image = apitypes.Image

// Store is an opened state directory.
type Store struct {
	Root  string
	Index *Index

	noProjects  atomic.Bool // the filesystem refused a project id (NewLayer)
	reserveUsed atomic.Bool // the index committer released the reserve (reserve.go)

	projMu sync.Mutex
	proj   projects // +checklocks:projMu
}

// Open checks that root is a usable store and opens its index.
func Open(root string) (*Store, error) {
	if err := CheckFS(root); err != nil {
		return nil, err
	}
	for _, d := range []string{"images", "layers", "sandboxes", "tmp"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o700); err != nil {
			return nil, err
		}
	}
	idx, err := openIndex(filepath.Join(root, "index.db"))
	if err != nil {
		return nil, err
	}
	s := &Store{Root: root, Index: idx}
	idx.OnNoSpace = s.releaseForIndex
	if err := s.TopUp(); err != nil {
		// Not fatal: the daemon must start on a full store to let its sandboxes be
		// deleted; the watcher tries again (state/diskquota.go).
		s.reserveUsed.Store(true)
	}
	// The store's range of XFS project ids, claimed now (one bulkstat pass, for a new
	// store) so that the store is complete before the daemon answers. Not fatal either
	// (a full store, btrfs): the first NewLayer tries again, and says why.
	s.projMu.Lock()
	_, _ = s.projectRange() // its error comes back at the first NewLayer
	s.projMu.Unlock()
	return s, nil
}

// Close stops the committer after it has written everything queued.
func (s *Store) Close() error { return s.Index.Close() }

// CheckFS verifies that root is on a filesystem where overlay copy-up reflinks.
func CheckFS(root string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err != nil {
		return fmt.Errorf("state directory %s: %w (run scripts/setup.sh)", root, errors.Join(err, errdefs.ErrUnavailable))
	}
	const xfsMagic, btrfsMagic = 0x58465342, 0x9123683e
	if st.Type != xfsMagic && st.Type != btrfsMagic {
		return fmt.Errorf("state directory %s is not on XFS or btrfs (copy-up would copy whole files): run scripts/setup.sh, which loop-mounts a reflink XFS there: %w", root, errdefs.ErrUnavailable)
	}
	return nil
}

func (s *Store) LayerDir(id uint64) string {
	return filepath.Join(s.Root, "layers", strconv.FormatUint(id, 10))
}
func (s *Store) LayerDiff(id uint64) string { return filepath.Join(s.LayerDir(id), "diff") }
func (s *Store) LayerWork(id uint64) string { return filepath.Join(s.LayerDir(id), "work") }

// ImageRootfs is the directory of image name's files. An image directory that is a
// symbolic link (a test's store shares the main store's images so) is followed here,
// once: an overlay's layers are reached through the sandbox's idmapped view of the
// store's filesystem (overlay.IDMapped), and an absolute link would lead out of it.
func (s *Store) ImageRootfs(name string) string {
	dir := filepath.Join(s.Root, "images", name)
	if t, err := os.Readlink(dir); err == nil && filepath.IsAbs(t) {
		dir = t
	}
	return filepath.Join(dir, "rootfs")
}
func (s *Store) SandboxDir(id string) string { return filepath.Join(s.Root, "sandboxes", id) }

// NewLayer creates the directories of a fresh, empty upper layer id. The layer's
// directory gets a project id of the store's range first (project.go, projrange.go),
// so that diff/, work/ and the frozen/ made later inherit it, and everything made in
// them.
func (s *Store) NewLayer(id uint64) error {
	dir := s.LayerDir(id)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if !s.noProjects.Load() {
		if err := s.tagLayer(dir); err != nil {
			if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.ENOTTY) && !errors.Is(err, unix.EINVAL) && !errors.Is(err, ErrNoBulkstat) {
				return err
			}
			// btrfs (CheckFS accepts it) has no project ids: usage falls back to a walk.
			s.noProjects.Store(true)
		}
	}
	if err := os.Mkdir(s.LayerDiff(id), 0o755); err != nil {
		return err
	}
	return os.Mkdir(s.LayerWork(id), 0o700)
}

// tagLayer gives the layer directory dir a project id of the store's range. The id is
// given and set under projMu, so that a scan of the layers' ids (projrange.go) sees
// every id given.
func (s *Store) tagLayer(dir string) error {
	s.projMu.Lock()
	defer s.projMu.Unlock()
	p, err := s.giveProject()
	if err != nil {
		return err
	}
	return SetProject(dir, p)
}

// Projects reports whether layers carry XFS project ids (false until a layer was made,
// and on a filesystem without them).
func (s *Store) Projects() bool { return !s.noProjects.Load() }

// RemoveAll removes a directory tree. Overlay work dirs hold 000-mode entries, which
// root removes anyway.
func RemoveAll(p string) error { return os.RemoveAll(p) }

// Images lists complete images (those with image.json).
func (s *Store) Images() ([]Image, error) {
	ents, err := os.ReadDir(filepath.Join(s.Root, "images"))
	if err != nil {
		return nil, err
	}
	var out []Image
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(s.Root, "images", e.Name(), "image.json"))
		if err != nil {
			continue
		}
		var im Image
		if json.Unmarshal(b, &im) == nil {
			im.Name = e.Name()
			out = append(out, im)
		}
	}
	return out, nil
}

// Sweep deletes what is on disk but not referenced: layers that no node and no sandbox
// names, sandbox directories of unknown sandboxes, incomplete images (.new-*), process
// images of imported nodes the index does not have, tmp.
// Called at start, before anything else uses the store.
func (s *Store) Sweep(nodes []Node, sandboxes []Sandbox) (removed []string) {
	used := map[string]bool{}
	for _, n := range nodes {
		if n.Layer != 0 {
			used[strconv.FormatUint(n.Layer, 10)] = true
		}
		if n.Squash != 0 {
			used[strconv.FormatUint(n.Squash, 10)] = true
		}
	}
	sbs := map[string]bool{}
	for _, sb := range sandboxes {
		used[strconv.FormatUint(sb.Upper, 10)] = true
		sbs[sb.ID] = true
	}
	rm := func(p string) {
		if err := RemoveAll(p); err == nil {
			removed = append(removed, p)
		}
	}
	ents, _ := os.ReadDir(filepath.Join(s.Root, "layers"))
	for _, e := range ents {
		if !used[e.Name()] {
			rm(filepath.Join(s.Root, "layers", e.Name()))
		}
	}
	ents, _ = os.ReadDir(filepath.Join(s.Root, "sandboxes"))
	for _, e := range ents {
		if !sbs[e.Name()] {
			p := filepath.Join(s.Root, "sandboxes", e.Name())
			_ = unix.Unmount(filepath.Join(p, "initroot"), unix.MNT_DETACH) // EINVAL (not mounted) is the usual case; a mount that stays fails rm, and the next start sweeps again
			rm(p)
		}
	}
	ents, _ = os.ReadDir(filepath.Join(s.Root, "images"))
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".new-") {
			rm(filepath.Join(s.Root, "images", e.Name()))
		}
	}
	// Imported nodes' process images (state/transfer.go), by node id.
	nodeIDs := map[string]bool{}
	for _, n := range nodes {
		nodeIDs[n.ID] = true
	}
	ents, _ = os.ReadDir(filepath.Join(s.Root, "imported"))
	for _, e := range ents {
		if !nodeIDs[e.Name()] {
			rm(filepath.Join(s.Root, "imported", e.Name()))
		}
	}
	ents, _ = os.ReadDir(filepath.Join(s.Root, "tmp"))
	for _, e := range ents {
		rm(filepath.Join(s.Root, "tmp", e.Name()))
	}
	return removed
}

// MaxLayerID is the largest layer id on disk (to seed the allocator after a sweep).
func (s *Store) MaxLayerID() uint64 {
	var max uint64
	ents, _ := os.ReadDir(filepath.Join(s.Root, "layers"))
	for _, e := range ents {
		if v, err := strconv.ParseUint(e.Name(), 10, 64); err == nil && v > max {
			max = v
		}
	}
	return max
}

// DirBytes is the apparent size of the files under p (a layer's cost).
func DirBytes(p string) int64 {
	var n int64
	_ = filepath.WalkDir(p, func(_ string, d os.DirEntry, err error) error { // its callback never fails
		if err != nil {
			return nil
		}
		if fi, err := d.Info(); err == nil {
			n += fi.Size()
		}
		return nil
	})
	return n
}

// IsEmptyDir reports whether p has no entries: an upper with no changes. (Raw
// getdents: it is on the checkpoint's critical path; see Freeze.)
func IsEmptyDir(p string) (bool, error) {
	fd, err := openDir(p)
	if err != nil {
		return false, &os.PathError{Op: "open", Path: p, Err: err}
	}
	defer unix.Close(fd)
	names, err := dirNames(fd, 1)
	if err != nil {
		return false, &os.PathError{Op: "readdir", Path: p, Err: err}
	}
	return len(names) == 0, nil
}

// Syncfs flushes the store's filesystem.
func (s *Store) Syncfs() error {
	fd, err := unix.Open(s.Root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Syncfs(fd)
}
