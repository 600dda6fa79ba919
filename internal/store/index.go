package store

import (
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"
	"golang.org/x/sys/unix"
)

var (
	bucketNodes     = []byte("nodes")
	bucketSandboxes = []byte("sandboxes")
	// bucketProcesses holds, per node, what the next daemon needs to take its process
	// templates back (the state manager's JSON; opaque here). A node's entry goes with
	// the node.
	bucketProcesses = []byte("processes")
)

// Index is the bbolt index with an ordered, asynchronous committer.
//
// Why asynchronous: a bbolt commit ends in fdatasync, which costs more than the whole
// filesystem checkpoint on the hot path. The daemon keeps the authoritative state in
// memory, queues each change here (Apply returns its sequence number at once), and one
// goroutine commits the queue in order: syncfs of the store first (so the layer data a
// record names is on disk), then one bbolt transaction for everything queued, then the
// After actions (directory removals, which must follow the record that stops naming the
// directory). Durable(seq) tells whether a change has reached the disk; WaitDurable
// blocks until it has. After a crash the index holds a prefix of the changes, which
// the startup sweep makes the filesystem agree with.
//
// A commit that fails (a full disk, an I/O error) loses nothing: what it did not commit
// stays at the head of the queue and is tried again, with a growing pause, until it
// succeeds; changes queued meanwhile wait behind it, so that no change is ever reported
// durable before every change before it is. While it fails, WaitDurable returns the
// error instead of blocking, and Err reports it.
type Index struct {
	db *bolt.DB

	mu sync.Mutex // protects everything below
	// +checklocks:mu
	cond *sync.Cond
	// +checklocks:mu
	queue []Op
	// +checklocks:mu
	seq uint64 // last sequence number handed out
	// +checklocks:mu
	durable uint64 // last sequence number committed
	// +checklocks:mu
	err error // the last commit's error, nil once a commit succeeds
	// +checklocks:mu
	closing bool
	done    chan struct{}

	// SyncFS is called before each commit that names new layer data.
	SyncFS func() error
	// OnNoSpace is called when a commit fails with ENOSPC; true means it freed room
	// (the store's reserve: reserve.go), and the commit is tried again at once.
	OnNoSpace func() bool
}

// Op is one queued change. Exactly one field is set.
type Op struct {
	PutNode       *Node
	DeleteNode    string
	PutSandbox    *Sandbox
	DeleteSandbox string
	// PutProcesses sets a node's process record (nil Data deletes it).
	PutProcesses *Processes
	After        func() // runs after the transaction that holds the ops before it
	// MetaOnly marks a PutNode that changes no layer data (a size measured later),
	// so the committer need not sync the store for it.
	MetaOnly bool
	seq      uint64
}

func openIndex(path string) (*Index, error) {
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if err != nil {
		return nil, fmt.Errorf("open index %s (is another daemon running?): %w", path, err)
	}
	if err := db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketNodes, bucketSandboxes, bucketProcesses} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		_ = db.Close() // the Update's error is the one to report
		return nil, err
	}
	x := &Index{db: db, done: make(chan struct{})}
	x.cond = sync.NewCond(&x.mu)
	go x.committer()
	return x, nil
}

// Load reads every node and sandbox.
func (x *Index) Load() (nodes []Node, sandboxes []Sandbox, err error) {
	err = x.db.View(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketNodes).ForEach(func(k, v []byte) error {
			var n Node
			if err := json.Unmarshal(v, &n); err != nil {
				return fmt.Errorf("node %s: %w", k, err)
			}
			nodes = append(nodes, n)
			return nil
		}); err != nil {
			return err
		}
		return tx.Bucket(bucketSandboxes).ForEach(func(k, v []byte) error {
			var s Sandbox
			if err := json.Unmarshal(v, &s); err != nil {
				return fmt.Errorf("sandbox %s: %w", k, err)
			}
			sandboxes = append(sandboxes, s)
			return nil
		})
	})
	return
}

// Processes is a node's process record: Data, the state manager's encoding.
type Processes struct {
	Node string
	Data []byte
}

// LoadProcesses reads every node's process record.
func (x *Index) LoadProcesses() (map[string][]byte, error) {
	out := map[string][]byte{}
	err := x.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketProcesses).ForEach(func(k, v []byte) error {
			out[string(k)] = append([]byte(nil), v...)
			return nil
		})
	})
	return out, err
}

// Apply queues ops and returns the sequence number of the last one. The records are
// copied: the caller may change its structs afterwards.
func (x *Index) Apply(ops ...Op) uint64 {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, op := range ops {
		if op.PutNode != nil {
			n := *op.PutNode
			op.PutNode = &n
		}
		if op.PutSandbox != nil {
			s := *op.PutSandbox
			op.PutSandbox = &s
		}
		x.seq++
		op.seq = x.seq
		x.queue = append(x.queue, op)
	}
	x.cond.Broadcast()
	return x.seq
}

// Seq is the last sequence number handed out.
func (x *Index) Seq() uint64 {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.seq
}

// Durable reports whether change seq is committed.
func (x *Index) Durable(seq uint64) bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	return seq <= x.durable
}

// WaitDurable blocks until change seq is committed, or returns the error of the commit
// that is failing meanwhile (the change stays queued and is tried again).
func (x *Index) WaitDurable(seq uint64) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	for x.durable < seq && x.err == nil {
		x.cond.Wait()
	}
	if x.durable >= seq {
		return nil
	}
	return x.err
}

// Err is the error of the last commit, nil when it succeeded: changes are waiting to be
// tried again.
func (x *Index) Err() error {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.err
}

// Close commits what is queued and closes the database. If the commit fails, what is
// still queued is lost (the startup sweep makes the filesystem agree with the index)
// and Close says so.
func (x *Index) Close() error {
	x.mu.Lock()
	x.closing = true
	x.cond.Broadcast()
	x.mu.Unlock()
	<-x.done
	x.mu.Lock()
	err := x.err
	x.mu.Unlock()
	if cerr := x.db.Close(); err == nil {
		err = cerr
	}
	return err
}

// Pauses between tries of a failing commit.
var (
	retryFirst = 50 * time.Millisecond
	retryMax   = 5 * time.Second
)

func (x *Index) committer() {
	defer close(x.done)
	pause := retryFirst
	for {
		x.mu.Lock()
		for len(x.queue) == 0 && !x.closing {
			x.cond.Wait()
		}
		if len(x.queue) == 0 && x.closing {
			x.mu.Unlock()
			return
		}
		batch := x.queue
		x.queue = nil
		closing := x.closing
		x.mu.Unlock()

		n, err := x.commit(batch)
		// A full store: the reserve's room, and the same batch again at once, before
		// anyone is told of the error (a waiter would give up on a change that is
		// about to commit).
		retry := err != nil && errors.Is(err, unix.ENOSPC) && x.OnNoSpace != nil && x.OnNoSpace()

		x.mu.Lock()
		if n > 0 {
			x.durable = batch[n-1].seq
		}
		if err == nil {
			x.err = nil
			pause = retryFirst
			x.cond.Broadcast()
			x.mu.Unlock()
			continue
		}
		// What was not committed goes back to the head of the queue, before what was
		// queued meanwhile.
		x.queue = append(batch[n:len(batch):len(batch)], x.queue...)
		if retry {
			x.cond.Broadcast() // for what did commit
			x.mu.Unlock()
			continue
		}
		x.err = fmt.Errorf("index commit failed: %w; %d change(s) wait to be written again (free space on the store if it is full)", err, len(x.queue))
		x.cond.Broadcast()
		x.mu.Unlock()
		if closing {
			return // Close reports x.err
		}
		x.pauseOrClose(pause)
		pause = min(2*pause, retryMax)
	}
}

// pauseOrClose waits d, or less if Close is called meanwhile.
func (x *Index) pauseOrClose(d time.Duration) {
	t := time.AfterFunc(d, func() {
		x.mu.Lock()
		x.cond.Broadcast()
		x.mu.Unlock()
	})
	defer t.Stop()
	deadline := time.Now().Add(d)
	x.mu.Lock()
	for !x.closing && time.Now().Before(deadline) {
		x.cond.Wait()
	}
	x.mu.Unlock()
}

// commit writes a batch: ops up to each After go in one transaction, then the After
// runs. It returns how many ops of the batch are done (committed, or run for an After)
// and the first error.
func (x *Index) commit(batch []Op) (int, error) {
	start := 0
	for i := 0; i <= len(batch); i++ {
		if i < len(batch) && batch[i].After == nil {
			continue
		}
		if err := x.commitTx(batch[start:i]); err != nil {
			return start, err
		}
		if i < len(batch) {
			batch[i].After()
		}
		start = i + 1
	}
	return len(batch), nil
}

func (x *Index) commitTx(ops []Op) error {
	if len(ops) == 0 {
		return nil
	}
	needSync := false
	for _, op := range ops {
		if op.PutNode != nil && (op.PutNode.Own || op.PutNode.Squash != 0) && !op.MetaOnly {
			needSync = true
		}
	}
	if needSync && x.SyncFS != nil {
		if err := x.SyncFS(); err != nil {
			return fmt.Errorf("syncfs: %w", err)
		}
	}
	return x.db.Update(func(tx *bolt.Tx) error {
		nb, sb, pb := tx.Bucket(bucketNodes), tx.Bucket(bucketSandboxes), tx.Bucket(bucketProcesses)
		for _, op := range ops {
			var err error
			switch {
			case op.PutNode != nil:
				var b []byte
				b, err = json.Marshal(op.PutNode)
				if err == nil {
					err = nb.Put([]byte(op.PutNode.ID), b)
				}
			case op.DeleteNode != "":
				err = nb.Delete([]byte(op.DeleteNode))
				if err == nil {
					err = pb.Delete([]byte(op.DeleteNode))
				}
			case op.PutProcesses != nil && op.PutProcesses.Data == nil:
				err = pb.Delete([]byte(op.PutProcesses.Node))
			case op.PutProcesses != nil:
				err = pb.Put([]byte(op.PutProcesses.Node), op.PutProcesses.Data)
			case op.PutSandbox != nil:
				var b []byte
				b, err = json.Marshal(op.PutSandbox)
				if err == nil {
					err = sb.Put([]byte(op.PutSandbox.ID), b)
				}
			case op.DeleteSandbox != "":
				err = sb.Delete([]byte(op.DeleteSandbox))
			}
			if err != nil {
				return err
			}
		}
		return nil
	})
}
