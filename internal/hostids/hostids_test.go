package hostids

import (
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

func holder(t *testing.T, store, id string) Holder {
	dir := filepath.Join(t.TempDir(), store, id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	return Holder{Store: store, Sandbox: id, Dir: dir}
}

// TestClaimRelease: two registries on one directory (two daemons) never hand out one
// range twice, even claiming concurrently; a range asked for by base is refused while
// another live holder has it; a release frees it; a stale record (its holder's
// directory gone) is taken over, and its old holder's release then leaves the new
// record alone.
func TestClaimRelease(t *testing.T) {
	dir := t.TempDir()
	rs := Ranges{First: 1 << 30, Size: 1 << 16, Count: 64}
	a, err := Open(dir, rs)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Open(dir, rs)

	var mu sync.Mutex
	got := map[uint32]string{}
	var wg sync.WaitGroup
	for i, r := range []*Registry{a, b, a, b, a, b, a, b} {
		h := holder(t, "store"+string(rune('0'+i%2)), "sb"+string(rune('0'+i)))
		wg.Add(1)
		go func() {
			defer wg.Done()
			base, err := r.Claim(h, 0)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if o, ok := got[base]; ok {
				t.Errorf("base %d given to %s and %s", base, o, h.Sandbox)
			}
			got[base] = h.Sandbox
		}()
	}
	wg.Wait()

	h1, h2 := holder(t, "s1", "x"), holder(t, "s2", "y")
	base, err := a.Claim(h1, 0)
	if err != nil {
		t.Fatal(err)
	}
	if again, err := a.Claim(h1, base); err != nil || again != base {
		t.Fatalf("claiming its own range again: %d, %v", again, err)
	}
	if _, err := b.Claim(h2, base); !errors.Is(err, ErrTaken) {
		t.Fatalf("claim of another's range: %v, want ErrTaken", err)
	}
	if err := a.Release(h1, base); err != nil {
		t.Fatal(err)
	}
	if got, err := b.Claim(h2, base); err != nil || got != base {
		t.Fatalf("claim of a released range: %d, %v", got, err)
	}
	// h2's sandbox goes without a release: the record is stale.
	os.Remove(h2.Dir)
	if _, live, _ := a.Holder(base); live {
		t.Fatal("a record whose directory is gone is live")
	}
	h3 := holder(t, "s3", "z")
	if got, err := a.Claim(h3, base); err != nil || got != base {
		t.Fatalf("take-over of a stale range: %d, %v", got, err)
	}
	if err := b.Release(h2, base); err != nil {
		t.Fatal(err)
	}
	if h, live, _ := a.Holder(base); !live || h != h3 {
		t.Fatalf("after the stale holder's release: %+v %v, want %+v", h, live, h3)
	}
	if _, err := a.Claim(h1, 12345); err == nil {
		t.Fatal("a base that is not a range's was accepted")
	}
}
