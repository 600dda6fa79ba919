package durable

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/pagemap"
	"google.golang.org/protobuf/proto"

	"deltabox/internal/cgroup"
)

// writeImage writes a pagemap-1.img and pages-<id>.img as CRIU does: one present run
// holding pages, then a run in a parent image (no data).
func writeImage(t testing.TB, dir string, id uint32, pages []byte) {
	t.Helper()
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, [2]uint32{imgCommonMagic, pagemapMagic})
	entry := func(m proto.Message) {
		p, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		binary.Write(&b, binary.LittleEndian, uint32(len(p)))
		b.Write(p)
	}
	entry(&pagemap.PagemapHead{PagesId: proto.Uint32(id)})
	entry(&pagemap.PagemapEntry{Vaddr: proto.Uint64(0x400000), NrPages: proto.Uint32(uint32(len(pages) / pageSize)), Flags: proto.Uint32(pePresent)})
	entry(&pagemap.PagemapEntry{Vaddr: proto.Uint64(0x800000), NrPages: proto.Uint32(3), Flags: proto.Uint32(peParent)})
	if err := os.WriteFile(filepath.Join(dir, "pagemap-1.img"), b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("pages-%d.img", id)), pages, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "core-1.img"), []byte("core"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestPageStoreDedup: three images of one memory, each after a few pages changed, cost
// the store the changed pages only; zero pages cost nothing; every image comes back
// byte for byte; a reopened store knows its pages.
func TestPageStoreDedup(t *testing.T) {
	root := t.TempDir()
	s, err := OpenPageStore(filepath.Join(root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewSource(1))
	const n = 1000
	mem := make([]byte, n*pageSize)
	rng.Read(mem[:900*pageSize]) // the last 100 pages stay zeros
	copy(mem[10*pageSize:11*pageSize], mem[20*pageSize:21*pageSize])
	var want [][]byte
	for step := 0; step < 3; step++ {
		if step > 0 {
			for k := 0; k < 25; k++ { // 25 random pages rewritten
				rng.Read(mem[rng.Intn(900)*pageSize:][:pageSize])
			}
		}
		dir := filepath.Join(root, fmt.Sprint(step))
		os.Mkdir(dir, 0o700)
		writeImage(t, dir, 7, mem)
		want = append(want, bytes.Clone(mem))
		st, err := s.Ingest(dir)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("image %d: %+v", step, *st)
		if st.Pages != n || st.ZeroPages != 100 {
			t.Fatalf("image %d: %d pages, %d zero, want %d and 100", step, st.Pages, st.ZeroPages, n)
		}
		if step == 0 && st.NewPages != 899 { // one page twice
			t.Fatalf("first image: %d new pages, want 899", st.NewPages)
		}
		if step > 0 && (st.NewPages == 0 || st.NewPages > 25) {
			t.Fatalf("image %d: %d new pages after 25 rewritten", step, st.NewPages)
		}
		if _, err := os.Stat(filepath.Join(dir, "pages-7.img")); !os.IsNotExist(err) {
			t.Fatalf("pages-7.img still there after Ingest: %v", err)
		}
	}
	s.Close()
	if s, err = OpenPageStore(filepath.Join(root, "store")); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for step := range want {
		dir := filepath.Join(root, fmt.Sprint(step))
		if err := s.Materialize(dir); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join(dir, "pages-7.img"))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want[step]) {
			t.Fatalf("image %d: materialized pages differ", step)
		}
		if err := DropPages(dir); err != nil {
			t.Fatal(err)
		}
	}
	// Taken in again after a reopen: nothing new.
	st, err := s.Ingest(filepath.Join(root, "2"))
	if err == nil {
		t.Fatalf("ingest of an image without pages-N.img: %+v, want an error", st)
	}
	dir := filepath.Join(root, "again")
	os.Mkdir(dir, 0o700)
	writeImage(t, dir, 7, want[2])
	if st, err = s.Ingest(dir); err != nil || st.NewPages != 0 {
		t.Fatalf("the same image again: %+v, %v; want no new page", st, err)
	}
}

// TestPageStoreCollect: once an image is removed, Collect frees the pages only it
// named (their blocks punched out of the pack) and keeps those another image names;
// the other image still comes back byte for byte; the freed pages are never deduped
// onto again (the same content ingested later is stored anew and comes back whole),
// also after a reopen.
func TestPageStoreCollect(t *testing.T) {
	root := t.TempDir()
	s, err := OpenPageStore(filepath.Join(root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewSource(2))
	const n, changed = 200, 50
	a := make([]byte, n*pageSize)
	rng.Read(a)
	b := bytes.Clone(a)
	rng.Read(b[:changed*pageSize]) // b shares the last 150 pages with a
	ingest := func(name string, mem []byte) *IngestStats {
		t.Helper()
		dir := filepath.Join(root, "img", name)
		os.MkdirAll(dir, 0o700)
		writeImage(t, dir, 7, mem)
		st, err := s.Ingest(dir)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	check := func(name string, want []byte) {
		t.Helper()
		dir := filepath.Join(root, "img", name)
		if err := s.Materialize(dir); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join(dir, "pages-7.img"))
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("image %s: materialized pages differ (%v)", name, err)
		}
		DropPages(dir)
	}
	glob := filepath.Join(root, "img", "*", "pages-*.refs")
	ingest("a", a)
	ingest("b", b)
	if p := s.Pages(); p != n+changed {
		t.Fatalf("%d pages in the store, want %d", p, n+changed)
	}
	if st, err := s.Collect(glob); err != nil || st.Freed != 0 || st.Live != n+changed {
		t.Fatalf("collect with both images: %+v %v, want nothing freed", st, err)
	}
	if err := os.RemoveAll(filepath.Join(root, "img", "a")); err != nil {
		t.Fatal(err)
	}
	st, err := s.Collect(glob)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("collect: %+v", *st)
	if st.Freed != changed || st.Live != n || s.Pages() != n {
		t.Fatalf("collect after a went: %+v, %d pages left; want %d freed, %d left", st, s.Pages(), changed, n)
	}
	if st.PackBytesBefore-st.PackBytesAfter < changed*pageSize {
		t.Fatalf("the pack's blocks went from %d to %d bytes: want %d fewer", st.PackBytesBefore, st.PackBytesAfter, changed*pageSize)
	}
	check("b", b)
	if st := ingest("c", a); st.NewPages != changed {
		t.Fatalf("a's memory again: %d new pages, want the %d freed ones stored anew", st.NewPages, changed)
	}
	check("c", a)
	s.Close()
	if s, err = OpenPageStore(filepath.Join(root, "store")); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if p := s.Pages(); p != n+changed {
		t.Fatalf("reopened: %d pages, want %d", p, n+changed)
	}
	if st := ingest("d", a); st.NewPages != 0 {
		t.Fatalf("reopened, a's memory again: %d new pages, want 0", st.NewPages)
	}
	check("b", b)
	check("d", a)
	if st, err := s.Collect(glob); err != nil || st.Freed != 0 {
		t.Fatalf("collect with nothing removed: %+v %v", st, err)
	}
}

// TestIngestHashesInBackground: Ingest hashes an image's pages on a thread of its own in
// the daemon's background CPU group (where the v1 cpu controller is mounted) at nice 19,
// not at the daemon's priority, and without the store's lock: Pages, which takes it,
// answers while the hashing thread still runs.
func TestIngestHashesInBackground(t *testing.T) {
	root := t.TempDir()
	cgroup.SetRootFor(root, "/nonexistent") // a background group of this test's own
	_, err := os.Stat(filepath.Join(cgroup.V1Mount, "cpu", "cpu.shares"))
	inGroup := err == nil
	group := "/" + filepath.Base(cgroup.Root) + "-background"
	t.Cleanup(func() {
		// Once the hashing thread has ended (it is in the group until then).
		for i := 0; i < 200 && os.Remove(filepath.Join(cgroup.V1Mount, "cpu", group)) != nil && inGroup; i++ {
			time.Sleep(10 * time.Millisecond)
		}
	})
	s, err := OpenPageStore(filepath.Join(root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const n = 32768 // 128 MiB of distinct pages: a few hundred ms of hashing
	mem := make([]byte, n*pageSize)
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint64(mem[i*pageSize:], uint64(i)+1)
	}
	dir := filepath.Join(root, "img")
	os.Mkdir(dir, 0o700)
	writeImage(t, dir, 1, mem)
	mem = nil
	done := make(chan error, 1)
	go func() {
		_, err := s.Ingest(dir)
		done <- err
	}()
	hashing := func() bool { return backgroundThread(t, 19, group, inGroup) }
	for seen := false; !seen; time.Sleep(100 * time.Microsecond) {
		select {
		case err := <-done:
			t.Fatalf("Ingest ended (err %v) with no thread of this process seen at nice 19 (in cpu group %s: %v)", err, group, inGroup)
		default:
		}
		seen = hashing()
	}
	s.Pages()
	if !hashing() {
		t.Fatal("the store's lock was held while the pages were hashed: Pages answered only once the hashing was over")
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// backgroundThread reports whether a thread of this process has nice value nice and,
// with inGroup, is in the v1 cpu group group.
func backgroundThread(t *testing.T, nice int, group string, inGroup bool) bool {
	t.Helper()
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range tasks {
		b, err := os.ReadFile(filepath.Join("/proc/self/task", e.Name(), "stat"))
		if err != nil {
			continue // ended meanwhile
		}
		// Field 19 is nice; fields 3 on follow the command's closing parenthesis.
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) <= 16 || f[16] != strconv.Itoa(nice) {
			continue
		}
		if !inGroup {
			return true
		}
		cg, _ := os.ReadFile(filepath.Join("/proc/self/task", e.Name(), "cgroup"))
		for _, l := range strings.Split(string(cg), "\n") {
			// "ID:controllers:path", the v1 cpu hierarchy's controllers naming cpu.
			if p := strings.SplitN(l, ":", 3); len(p) == 3 && slices.Contains(strings.Split(p[1], ","), "cpu") && p[2] == group {
				return true
			}
		}
	}
	return false
}
