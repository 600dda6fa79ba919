package durable

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"deltabox/internal/cgroup"
)

// PageStore keeps the memory pages of CRIU images, each distinct 4 KiB page once, so
// that images of the same process at successive checkpoints cost what changed between
// them. This kernel has no soft-dirty tracking (CONFIG_MEM_SOFT_DIRTY is off, so CRIU's
// pre-dump and --track-mem do nothing here): every dump is a full one, and the changed
// pages are found afterwards by content.
//
// On disk, in its directory:
//
//	pages.pack  the pages, page k (k >= 1) at offset (k-1)*4096; only appended
//	pages.idx   the SHA-256 of each page of the pack, 32 bytes each, in pack order
//
// and in each image directory it took in (Ingest), pages-N.img is replaced by
// pages-N.refs: one little-endian uint64 per page of pages-N.img, its number in the
// pack, 0 for a page of zeros (not stored). Materialize writes pages-N.img back for a
// restore; with the pack on the same reflink filesystem as the image, copy_file_range
// shares the pack's blocks instead of copying them.
//
// Crash order: the pack's new pages are synced before the index names them, and a
// refs file is synced before the pages-N.img it replaces is removed; at open, index
// records past the pack's end and a pack's tail the index does not name are dropped.
//
// Collect frees the pages no image names any more (their images were removed with
// their nodes): each such page's index record is zeroed, and synced, before its blocks
// are punched out of the pack (FALLOC_FL_PUNCH_HOLE: page numbers never move, so no
// refs file is rewritten). A zeroed record names no page: Ingest never dedups onto a
// freed page, even after a crash between the two steps (the page then stays allocated
// until the next Collect punches it again).
type PageStore struct {
	dir string

	mu     sync.Mutex // guards everything below; Ingest and Collect hold it throughout
	pack   *os.File
	idx    *os.File
	byHash map[[32]byte]uint64
	n      uint64 // page numbers handed out: the pack's length in pages
	freed  uint64 // of which collected (zeroed in the index, punched out of the pack)
}

const (
	packFile = "pages.pack"
	idxFile  = "pages.idx"
	refsExt  = ".refs"
	hashLen  = sha256.Size
)

var zeroPage [pageSize]byte

// OpenPageStore opens (creating it if need be) the page store in dir.
func OpenPageStore(dir string) (*PageStore, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	pack, err := os.OpenFile(filepath.Join(dir, packFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	idx, err := os.OpenFile(filepath.Join(dir, idxFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		_ = pack.Close() // the open's error is the one to report
		return nil, err
	}
	s := &PageStore{dir: dir, pack: pack, idx: idx, byHash: map[[32]byte]uint64{}}
	if err := s.load(); err != nil {
		_ = s.Close() // the load's error is the one to report
		return nil, fmt.Errorf("page store %s: %w", dir, err)
	}
	return s, nil
}

func (s *PageStore) load() error {
	pst, err := s.pack.Stat()
	if err != nil {
		return err
	}
	b, err := io.ReadAll(s.idx)
	if err != nil {
		return err
	}
	n := min(uint64(len(b))/hashLen, uint64(pst.Size())/pageSize)
	for i := uint64(0); i < n; i++ {
		var h [32]byte
		copy(h[:], b[i*hashLen:])
		if h == ([32]byte{}) {
			s.freed++ // collected
			continue
		}
		s.byHash[h] = i + 1
	}
	s.n = n
	// What a crash left half written.
	if err := s.idx.Truncate(int64(n * hashLen)); err != nil {
		return err
	}
	return s.pack.Truncate(int64(n * pageSize))
}

// Close closes the store's files.
func (s *PageStore) Close() error {
	return errors.Join(s.pack.Close(), s.idx.Close())
}

// Pages is how many distinct pages the store holds.
func (s *PageStore) Pages() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n - s.freed
}

// CollectStats says what Collect found and freed.
type CollectStats struct {
	RefsFiles int    // refs files read (the images that may still be restored)
	Live      uint64 // pages they name
	Freed     uint64 // pages freed now
	// PackBytes is the pack's allocated size before and after (st_blocks).
	PackBytesBefore, PackBytesAfter int64
}

// Collect frees the pages that no refs file matching refsGlob names: refsGlob must
// match the refs of every image that may still be materialized (an image whose refs
// it misses loses its pages). A refs file that cannot be read stops it before anything
// is freed. Ingest waits meanwhile.
func (s *PageStore) Collect(refsGlob string) (*CollectStats, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	files, err := filepath.Glob(refsGlob)
	if err != nil {
		return nil, err
	}
	st := &CollectStats{}
	used := make([]bool, s.n+1)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if errors.Is(err, os.ErrNotExist) {
			continue // its image went meanwhile
		}
		if err != nil {
			return nil, err
		}
		if len(b)%8 != 0 {
			return nil, fmt.Errorf("%s: %d bytes, not a refs file", f, len(b))
		}
		for i := 0; i < len(b); i += 8 {
			r := binary.LittleEndian.Uint64(b[i:])
			if r > s.n {
				return nil, fmt.Errorf("%s names pack page %d, the pack has %d", f, r, s.n)
			}
			if r != 0 && !used[r] {
				used[r] = true
				st.Live++
			}
		}
		st.RefsFiles++
	}
	idx := make([]byte, s.n*hashLen)
	if _, err := s.idx.ReadAt(idx, 0); err != nil && len(idx) > 0 {
		return nil, err
	}
	var zero [hashLen]byte
	var free []uint64
	for k := uint64(1); k <= s.n; k++ {
		if !used[k] && !bytes.Equal(idx[(k-1)*hashLen:k*hashLen], zero[:]) {
			free = append(free, k)
		}
	}
	st.PackBytesBefore = allocated(s.pack)
	if len(free) == 0 {
		st.PackBytesAfter = st.PackBytesBefore
		return st, nil
	}
	// The index first: once it is synced no Ingest can name these pages again.
	for _, k := range free {
		var h [32]byte
		copy(h[:], idx[(k-1)*hashLen:])
		delete(s.byHash, h)
		if _, err := s.idx.WriteAt(zero[:], int64(k-1)*hashLen); err != nil {
			return nil, err
		}
	}
	if err := s.idx.Sync(); err != nil {
		return nil, err
	}
	s.freed += uint64(len(free))
	st.Freed = uint64(len(free))
	for i := 0; i < len(free); {
		j := i + 1
		for j < len(free) && free[j] == free[j-1]+1 {
			j++
		}
		off, n := int64(free[i]-1)*pageSize, int64(j-i)*pageSize
		if err := unix.Fallocate(int(s.pack.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n); err != nil {
			return st, fmt.Errorf("punch pack pages %d-%d: %w", free[i], free[j-1], err)
		}
		i = j
	}
	st.PackBytesAfter = allocated(s.pack)
	return st, nil
}

// allocated is f's allocated size (st_blocks), -1 if it cannot be read.
func allocated(f *os.File) int64 {
	var st unix.Stat_t
	if unix.Fstat(int(f.Fd()), &st) != nil {
		return -1
	}
	return st.Blocks * 512
}

// IngestStats says what Ingest found and kept.
type IngestStats struct {
	Pages     int64 // pages in the image's pages-*.img
	ZeroPages int64 // of which zeros (not stored)
	NewPages  int64 // of which the store did not have: what it grew by
	// ImageBytes is the image directory's size as CRIU wrote it; StoredBytes what it
	// costs once ingested: the new pages, the refs and the other image files.
	ImageBytes, StoredBytes int64
}

// Ingest takes the pages of the CRIU image in dir into the store: each pages-N.img is
// replaced by pages-N.refs. When it returns the image is durable: the store's new
// pages, the refs, the image's other files and the directory are synced.
//
// The pages are hashed first, without the store's lock and at idle priority
// (hashPages); the lock is held for the lookups and writes only, at the caller's.
func (s *PageStore) Ingest(dir string) (*IngestStats, error) {
	pms, err := filepath.Glob(filepath.Join(dir, "pagemap-*.img"))
	if err != nil {
		return nil, err
	}
	st := &IngestStats{}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && fi.Mode().IsRegular() {
			st.ImageBytes += fi.Size()
			if !strings.HasPrefix(e.Name(), "pages-") {
				st.StoredBytes += fi.Size()
			}
		}
	}
	maps := make([]*pagemapFile, len(pms))
	sums := make([][][hashLen]byte, len(pms))
	for i, pm := range pms {
		if maps[i], err = readPagemap(pm); err != nil {
			return nil, err
		}
		if sums[i], err = hashPages(pagesName(dir, maps[i]), maps[i].presentPages()); err != nil {
			return nil, err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, m := range maps {
		if err := s.ingestPages(dir, m, sums[i], st); err != nil {
			return nil, err
		}
	}
	if err := syncDir(dir); err != nil {
		return nil, err
	}
	return st, nil
}

// pagesName is the pages-N.img file of m in dir.
func pagesName(dir string, m *pagemapFile) string {
	return filepath.Join(dir, fmt.Sprintf("pages-%d.img", m.PagesID))
}

// hashPages returns the SHA-256 of each of the want pages of the file name, and the
// zero hash for a page of zeros (no 4 KiB page hashes to it: that would be a SHA-256
// preimage). Hashing is nearly all of the page store's CPU (a 63 MB python's image is
// 57 MB of pages: 14,000 hashes; during bench latency, a third of the samples of the
// daemon and its CRIUs), and it runs beside the agents' operations. So it runs on an
// OS thread of its own in the daemon's background CPU group (cgroup.JoinBackground:
// in the daemon's own group, nice 19 shielded a restore from a CPU-bound thread no
// better than nice 0, docs/research/ab-6318f36), at nice 19 and the idle I/O class
// (where that group cannot be made), holding no lock an operation may wait for (a
// restore from an image materializes under it); the thread ends with it. Best effort:
// pages hashed at normal priority are the same pages.
func hashPages(name string, want int64) ([][hashLen]byte, error) {
	type result struct {
		sums [][hashLen]byte
		err  error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread, in the background group, ends with this goroutine
		tid := unix.Gettid()
		lowerPriority(tid)
		_ = cgroup.JoinBackground(tid) // best effort: without the group it hashes at nice 19
		sums, err := hashFile(name, want)
		ch <- result{sums, err}
	}()
	r := <-ch
	return r.sums, r.err
}

// hashFile is hashPages on the calling thread.
func hashFile(name string, want int64) ([][hashLen]byte, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }() // read only
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if fi.Size() != want*pageSize {
		return nil, fmt.Errorf("%s has %d bytes, its pagemap lists %d pages", name, fi.Size(), want)
	}
	sums := make([][hashLen]byte, want)
	buf := make([]byte, 256*pageSize)
	for i := int64(0); i < want; {
		k := min(int64(len(buf)/pageSize), want-i)
		if _, err := io.ReadFull(f, buf[:k*pageSize]); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		for j := int64(0); j < k; j++ {
			if pg := buf[j*pageSize : (j+1)*pageSize]; !bytes.Equal(pg, zeroPage[:]) {
				sums[i+j] = sha256.Sum256(pg)
			}
		}
		i += k
	}
	return sums, nil
}

// ingestPages replaces pages-<m.PagesID>.img, whose pages hash to sums (hashPages), by
// its refs. It reads again only the chunks that hold a page the store does not have.
// Precondition: s.mu held.
func (s *PageStore) ingestPages(dir string, m *pagemapFile, sums [][hashLen]byte, st *IngestStats) error {
	name := pagesName(dir, m)
	f, err := os.Open(name)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }() // read-only, after the read
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	want := m.presentPages()
	if fi.Size() != want*pageSize || int64(len(sums)) != want {
		return fmt.Errorf("%s has %d bytes and %d hashes, its pagemap lists %d pages", name, fi.Size(), len(sums), want)
	}
	refs := make([]byte, 8*want)
	var newHashes []byte
	var batch []byte // new pages, written to the pack in one go per MiB
	packEnd := int64(s.n) * pageSize
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		if _, err := s.pack.WriteAt(batch, packEnd); err != nil {
			return err
		}
		packEnd += int64(len(batch))
		batch = batch[:0]
		return nil
	}
	n := s.n
	added := map[[hashLen]byte]uint64{}
	buf := make([]byte, 256*pageSize)
	var i int64
	for i < want {
		k := min(int64(len(buf)/pageSize), want-i)
		read := false // buf holds this chunk
		for j := int64(0); j < k; j++ {
			h := sums[i+j]
			var ref uint64
			if h == ([hashLen]byte{}) {
				st.ZeroPages++
			} else {
				var ok bool
				if ref, ok = s.byHash[h]; !ok {
					if ref, ok = added[h]; !ok {
						if !read {
							if _, err := f.ReadAt(buf[:k*pageSize], i*pageSize); err != nil {
								return fmt.Errorf("%s: %w", name, err)
							}
							read = true
						}
						pg := buf[j*pageSize : (j+1)*pageSize] // as hashed: CRIU, its writer, has exited
						n++
						ref = n
						added[h] = ref
						newHashes = append(newHashes, h[:]...)
						batch = append(batch, pg...)
						st.NewPages++
						if len(batch) >= 1<<20 {
							if err := flush(); err != nil {
								return err
							}
						}
					}
				}
			}
			binary.LittleEndian.PutUint64(refs[8*(i+j):], ref)
		}
		i += k
	}
	st.Pages += want
	if err := flush(); err != nil {
		return err
	}
	// The pages before the index that names them, the index before the refs that
	// point into the pack, the refs before the pages-N.img they replace goes.
	if len(newHashes) > 0 {
		if err := s.pack.Sync(); err != nil {
			return err
		}
		if _, err := s.idx.WriteAt(newHashes, int64(s.n)*hashLen); err != nil {
			return err
		}
		if err := s.idx.Sync(); err != nil {
			return err
		}
	}
	for h, ref := range added {
		s.byHash[h] = ref
	}
	s.n = n
	refsName := strings.TrimSuffix(name, ".img") + refsExt
	if err := writeSynced(refsName, refs); err != nil {
		return err
	}
	st.StoredBytes += int64(len(refs)) + st.NewPages*pageSize
	return os.Remove(name)
}

func writeSynced(name string, b []byte) error {
	tmp := name + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		_ = f.Close() // the write's error is the one to report
		return err
	}
	if err := f.Sync(); err != nil {
		_ = f.Close() // the sync's error is the one to report
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, name)
}

// Materialize writes back every pages-N.img of the image in dir from its refs, for a
// restore: runs of consecutive pack pages in one copy_file_range each (on a reflink
// filesystem, shared blocks, not copies), zero pages left as holes.
func (s *PageStore) Materialize(dir string) error {
	refsFiles, err := filepath.Glob(filepath.Join(dir, "pages-*"+refsExt))
	if err != nil {
		return err
	}
	for _, rf := range refsFiles {
		if err := s.materialize(rf); err != nil {
			return err
		}
	}
	return nil
}

func (s *PageStore) materialize(refsName string) error {
	b, err := os.ReadFile(refsName)
	if err != nil {
		return err
	}
	if len(b)%8 != 0 {
		return fmt.Errorf("%s: %d bytes, not a refs file", refsName, len(b))
	}
	n := int64(len(b) / 8)
	s.mu.Lock()
	have := s.n
	s.mu.Unlock()
	name := strings.TrimSuffix(refsName, refsExt) + ".img"
	out, err := os.OpenFile(name+".tmp", os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	defer func() { _ = out.Close() }() // the success path closes it and checks; this one is for the errors
	if err := out.Truncate(n * pageSize); err != nil {
		return err
	}
	ref := func(i int64) uint64 { return binary.LittleEndian.Uint64(b[8*i:]) }
	for i := int64(0); i < n; {
		r := ref(i)
		if r == 0 {
			i++
			continue
		}
		if r > have {
			return fmt.Errorf("%s: page %d is pack page %d, the pack has %d", refsName, i, r, have)
		}
		j := i + 1
		for j < n && ref(j) == r+uint64(j-i) {
			j++
		}
		if err := copyRange(s.pack, int64(r-1)*pageSize, out, i*pageSize, (j-i)*pageSize); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		i = j
	}
	if err := out.Close(); err != nil {
		return err
	}
	return os.Rename(name+".tmp", name)
}

// copyRange copies n bytes from src at off to dst at doff by copy_file_range (which
// reflinks on XFS when both are on it and aligned).
func copyRange(src *os.File, off int64, dst *os.File, doff int64, n int64) error {
	for n > 0 {
		c, err := unix.CopyFileRange(int(src.Fd()), &off, int(dst.Fd()), &doff, int(n), 0)
		if err != nil {
			return fmt.Errorf("copy_file_range: %w", err)
		}
		if c == 0 {
			return io.ErrUnexpectedEOF
		}
		n -= int64(c)
	}
	return nil
}

// PagesBytes is the size of the pages-N.img files in dir (those Materialize wrote).
func PagesBytes(dir string) int64 {
	ms, _ := filepath.Glob(filepath.Join(dir, "pages-*.img"))
	var n int64
	for _, p := range ms {
		if fi, err := os.Stat(p); err == nil {
			n += fi.Size()
		}
	}
	return n
}

// DropPages removes the pages-N.img that Materialize wrote (the refs stay).
func DropPages(dir string) error {
	refsFiles, err := filepath.Glob(filepath.Join(dir, "pages-*"+refsExt))
	if err != nil {
		return err
	}
	var errs []error
	for _, rf := range refsFiles {
		if err := os.Remove(strings.TrimSuffix(rf, refsExt) + ".img"); err != nil && !os.IsNotExist(err) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
