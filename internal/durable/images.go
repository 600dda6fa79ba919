package durable

import (
	"fmt"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/pagemap"
	"google.golang.org/protobuf/proto"
)

// CRIU's image framing (criu/include/magic.h, criu/protobuf.c): a file starts with
// IMG_COMMON_MAGIC and the image's own magic; then each entry is a little-endian
// uint32 length and that many bytes of protobuf. pages-N.img is raw: the contents of
// the pages its pagemap-PID.img lists as present, in that order.
const (
	imgCommonMagic = 0x54564319
	pagemapMagic   = 0x56084025

	// PE_PRESENT (criu/include/pagemap.h): the entry's pages are in pages-N.img.
	// Without it they are in a parent image (PE_PARENT) or not written at all (lazy).
	pePresent = 1 << 2
	peParent  = 1 << 0
	peLazy    = 1 << 1

	pageSize = 4096
)

// pagemapFile is one pagemap-PID.img: which pages-N.img it uses and the runs of pages.
type pagemapFile struct {
	PagesID uint32
	Entries []*pagemap.PagemapEntry
}

func (m *pagemapFile) presentPages() (n int64) {
	for _, e := range m.Entries {
		if present(e) {
			n += int64(e.GetNrPages())
		}
	}
	return n
}

// present says whether e's pages are in pages-N.img. CRIU 4 writes flags; an entry
// without them is an old image's: present unless in_parent.
func present(e *pagemap.PagemapEntry) bool {
	if e.Flags != nil {
		return e.GetFlags()&pePresent != 0
	}
	return !e.GetInParent()
}

func readPagemap(path string) (*pagemapFile, error) {
	ents, err := readImageFile(path, pagemapMagic)
	if err != nil {
		return nil, err
	}
	if len(ents) == 0 {
		return nil, fmt.Errorf("%s: no head", path)
	}
	var h pagemap.PagemapHead
	if err := proto.Unmarshal(ents[0], &h); err != nil {
		return nil, fmt.Errorf("%s: head: %w", path, err)
	}
	m := &pagemapFile{PagesID: h.GetPagesId()}
	for _, b := range ents[1:] {
		var e pagemap.PagemapEntry
		if err := proto.Unmarshal(b, &e); err != nil {
			return nil, fmt.Errorf("%s: entry: %w", path, err)
		}
		m.Entries = append(m.Entries, &e)
	}
	return m, nil
}
