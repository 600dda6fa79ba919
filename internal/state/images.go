package state

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"deltabox/internal/errdefs"
	"deltabox/internal/image"
	"deltabox/internal/store"
)

// CheckImport makes the quick checks of an import (name valid and free, source
// present) so that the API can answer with the right status before streaming.
func (m *Manager) CheckImport(name, source string) error {
	return image.Check(m.st.Root, name, source)
}

// ImportImage imports source as image name (see package image). Nothing is left in
// the store if it fails.
func (m *Manager) ImportImage(ctx context.Context, name, source string, o image.Options, progress func(done, total int64)) (*store.Image, error) {
	return image.Import(ctx, m.st.Root, name, source, o, progress)
}

// imageUsers lists the sandboxes and the nodes on image name. Precondition: mu held.
// +checklocks:m.mu
func (m *Manager) imageUsers(name string) (sandboxes, nodes []string) {
	for id, s := range m.sandboxes {
		if s.rec.Image == name { // Image never changes after creation
			sandboxes = append(sandboxes, id)
		}
	}
	for id, n := range m.nodes {
		if n.Image == name {
			nodes = append(nodes, id)
		}
	}
	sort.Strings(sandboxes)
	sort.Strings(nodes)
	return sandboxes, nodes
}

// ImageUsers lists the ids of the sandboxes, then of the nodes, that use image name.
func (m *Manager) ImageUsers(name string) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	sbs, nodes := m.imageUsers(name)
	return append(sbs, nodes...)
}

// RemoveImage removes an image no sandbox and no node uses. Under mu, the image is
// renamed out of the way (to a .new-* name, which the start-up sweep deletes if the
// daemon dies before the removal ends): a Create that checked the image just before
// then fails to mount it instead of standing on a removed image.
func (m *Manager) RemoveImage(name string) error {
	if err := image.ValidName(name); err != nil {
		return err
	}
	dir := filepath.Join(m.st.Root, "images", name)
	b := make([]byte, 4)
	rand.Read(b)
	// Image names start with a letter or digit: ".new-." never collides with an import's .new-NAME.
	trash := filepath.Join(m.st.Root, "images", ".new-.rm."+name+"."+hex.EncodeToString(b))
	m.mu.Lock()
	sbs, nodes := m.imageUsers(name)
	if len(sbs)+len(nodes) > 0 {
		m.mu.Unlock()
		var who []string
		if len(sbs) > 0 {
			who = append(who, "sandbox(es) "+listUpTo(sbs, 5))
		}
		if len(nodes) > 0 {
			who = append(who, "node(s) "+listUpTo(nodes, 5))
		}
		return fmt.Errorf("image %s is used by %s: remove them first (deltabox rm, deltabox tree rm): %w", name, strings.Join(who, " and "), errdefs.ErrConflict)
	}
	if _, err := os.Lstat(dir); err != nil {
		m.mu.Unlock()
		return fmt.Errorf("no image %q (deltabox image ls lists them): %w", name, errdefs.ErrNotFound)
	}
	err := os.Rename(dir, trash)
	m.mu.Unlock()
	if err != nil {
		return fmt.Errorf("remove image %s: %w", name, err)
	}
	return store.RemoveAll(trash)
}

func listUpTo(ids []string, n int) string {
	if len(ids) <= n {
		return strings.Join(ids, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(ids[:n], ", "), len(ids)-n)
}
