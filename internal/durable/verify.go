package durable

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
)

// VerifyImage checks one template's image whose pages are materialized (pages-N.img,
// as an exported image carries them): durable.json is a Manifest with a root task, and
// each pagemap-PID.img parses and names a pages-N.img that holds exactly the pages it
// lists as present. It does not restore: it refuses an image that could not be.
func VerifyImage(dir string) error {
	b, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		return fmt.Errorf("no %s: %w", ManifestFile, err)
	}
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return fmt.Errorf("%s: %w", ManifestFile, err)
	}
	if m.Pid <= 0 {
		return fmt.Errorf("%s names no root task", ManifestFile)
	}
	pms, err := filepath.Glob(filepath.Join(dir, "pagemap-*.img"))
	if err != nil {
		return err
	}
	if len(pms) == 0 {
		return fmt.Errorf("no pagemap-*.img: not a CRIU image")
	}
	for _, pm := range pms {
		p, err := readPagemap(pm)
		if err != nil {
			return err
		}
		name := filepath.Join(dir, fmt.Sprintf("pages-%d.img", p.PagesID))
		fi, err := os.Lstat(name)
		if err != nil {
			return fmt.Errorf("%s: its pages: %w", filepath.Base(pm), err)
		}
		if want := p.presentPages() * pageSize; !fi.Mode().IsRegular() || fi.Size() != want {
			return fmt.Errorf("%s holds %d bytes, its pagemap lists %d", filepath.Base(name), fi.Size(), want)
		}
	}
	return nil
}
