package state

import (
	"strings"
	"testing"

	"deltabox/internal/sbinit"
	"deltabox/internal/store"
)

// TestAdoptableRefusesOlderInit: a record whose init was started by a daemon below this
// one's feature level (none recorded: older than levels) is not adopted, with the reason
// naming what that init lacks; one at the current level is tried.
func TestAdoptableRefusesOlderInit(t *testing.T) {
	m := &Manager{st: &store.Store{Root: t.TempDir()}} // no frozen upper: not refused for that
	for _, c := range []struct {
		level int
		want  string
	}{{0, "init predates Landlock domains"}, {sbinit.FeatureLevel - 1, "init predates"}, {sbinit.FeatureLevel, ""}} {
		r := store.Sandbox{ID: "a", UIDBase: 1 << 20, Init: &store.InitRef{Pid: 1, Start: 1, Level: c.level}}
		got := m.adoptable(r)
		if c.want == "" && got != "" || c.want != "" && !strings.Contains(got, c.want) {
			t.Errorf("level %d: adoptable = %q, want %q", c.level, got, c.want)
		}
	}
}
