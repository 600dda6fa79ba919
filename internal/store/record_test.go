package store

import (
	"encoding/json"
	"path/filepath"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"deltabox/internal/apitypes"
)

// TestIndexLoadsNodesWrittenAsAPITypes: store.Node is the index's own record, apart from
// the API's apitypes.Node, which was the record until then. An index.db whose node was
// written as apitypes.Node loads with every field, and a node written now reads back as
// apitypes.Node with every field (a daemon of the old type opens this index too).
func TestIndexLoadsNodesWrittenAsAPITypes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "index.db")
	created := time.Date(2026, 11, 30, 12, 0, 0, 123456789, time.UTC)
	old := apitypes.Node{ID: "n1", Parent: "n0", Image: "default", Created: created, Label: "l",
		Sandbox: "sb", Layer: 42, Own: true, Bytes: 4096}
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(old)
	if err := db.Update(func(tx *bolt.Tx) error {
		nb, err := tx.CreateBucketIfNotExists(bucketNodes)
		if err != nil {
			return err
		}
		return nb.Put([]byte(old.ID), b)
	}); err != nil {
		t.Fatal(err)
	}
	db.Close()

	x, err := openIndex(path)
	if err != nil {
		t.Fatal(err)
	}
	x.SyncFS = func() error { return nil }
	nodes, _, err := x.Load()
	if err != nil {
		t.Fatal(err)
	}
	want := Node{ID: "n1", Parent: "n0", Image: "default", Created: created, Label: "l", Sandbox: "sb", Layer: 42, Own: true, Bytes: 4096}
	if len(nodes) != 1 || nodes[0] != want {
		t.Fatalf("loaded %+v from a record written as apitypes.Node %s, want %+v", nodes, b, want)
	}

	n2 := want
	n2.ID, n2.Parent = "n2", "n1"
	if err := x.WaitDurable(x.Apply(Op{PutNode: &n2})); err != nil {
		t.Fatal(err)
	}
	if err := x.Close(); err != nil {
		t.Fatal(err)
	}
	db, err = bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var got apitypes.Node
	if err := db.View(func(tx *bolt.Tx) error { return json.Unmarshal(tx.Bucket(bucketNodes).Get([]byte("n2")), &got) }); err != nil {
		t.Fatal(err)
	}
	wantOld := old
	wantOld.ID, wantOld.Parent = "n2", "n1"
	if got != wantOld {
		t.Fatalf("a node written now reads as apitypes.Node %+v, want %+v", got, wantOld)
	}
}

// TestIndexLoadsSandboxesWrittenAsAPITypes: the same for store.Sandbox, which was
// apitypes.Sandbox, with every field set (its init and limits too).
func TestIndexLoadsSandboxesWrittenAsAPITypes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "index.db")
	created := time.Date(2026, 11, 30, 12, 0, 0, 5, time.UTC)
	old := apitypes.Sandbox{ID: "sb", Image: "default", Head: "n1", Upper: 7, Workdir: "/workspace", Hostname: "h",
		User: "u", Created: created, Limits: apitypes.Limits{MemoryBytes: 1 << 30, Pids: 100, CPUs: 1.5},
		WarmProcesses: true, UIDBase: 1 << 20, DiskMB: 512, TemplateBudgetMB: -1, Init: &apitypes.InitRef{Pid: 42, Start: 99}}
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(old)
	if err := db.Update(func(tx *bolt.Tx) error {
		sb, err := tx.CreateBucketIfNotExists(bucketSandboxes)
		if err != nil {
			return err
		}
		return sb.Put([]byte(old.ID), b)
	}); err != nil {
		t.Fatal(err)
	}
	db.Close()
	x, err := openIndex(path)
	if err != nil {
		t.Fatal(err)
	}
	_, sbs, err := x.Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(sbs) != 1 {
		t.Fatalf("loaded %d sandboxes", len(sbs))
	}
	got, _ := json.Marshal(sbs[0])
	if string(got) != string(b) || sbs[0].Init == nil || sbs[0].Init.Start != 99 || sbs[0].Limits.CPUs != 1.5 {
		t.Fatalf("a record written as apitypes.Sandbox %s loads as %+v (%s)", b, sbs[0], got)
	}
	if err := x.Close(); err != nil {
		t.Fatal(err)
	}
}
