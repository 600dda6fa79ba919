package durable

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"deltabox/internal/criu"
	"deltabox/internal/deadline"
)

// A lazy restore (RestoreOptions.Lazy) gives the tree back before its memory: CRIU
// restores every mapping empty and registers the anonymous private ones with a
// userfaultfd, and a `criu lazy-pages` server, started before the restore, copies each
// page in from the image when the tree first touches it and the rest in the background
// until every page is in. Measured here with plain CRIU (docs/research/criu-sandbox/
// lazy-restore-experiment.txt), time until a restored python answered: 50 MiB 113-132 ms
// lazily against 200-237 eagerly, 500 MiB 136-163 ms against 936-972.
//
// The danger is the end: when the server's userfaultfd closes (it exits, is killed, or
// reaches its deadline) before every page is in, the kernel unregisters the ranges and
// the pages still missing read as zeros from then on, a silent corruption of the
// process. The caller must treat the restored tree, and every process forked from it
// meanwhile (a fork of a registered process gets a userfaultfd of its own, served by
// the same server through UFFD_FEATURE_EVENT_FORK), as untrustworthy until Lazy.Done
// reports success, and end them all if it reports an error.
//
// A task restored into a user namespace cannot open a userfaultfd that handles kernel
// faults (userfaultfd(2) wants CAP_SYS_PTRACE in the initial user namespace, or the
// vm.unprivileged_userfaultfd sysctl, which we leave off): patch 0007 has CRIU open
// /dev/userfaultfd as root beforehand and the tasks make theirs with USERFAULTFD_IOC_NEW.
// The descriptors end in the server; the restored tasks keep none (tested).

// LazyTimeout bounds a lazy-pages server's whole run: by then it must have copied every
// page of the trees it serves (a 500 MiB python takes about 0.8 s here).
const LazyTimeout = 2 * time.Minute

// LazyLog is the lazy-pages server's log, in the images directory.
const LazyLog = "lazy-pages.log"

// lazySocket is where the server listens, relative to the images directory (CRIU's
// LAZY_PAGES_SOCK_NAME; both ends chdir there).
const lazySocket = "lazy-pages.socket"

// lazyListenWait bounds the wait for the server's socket before the restore starts.
const lazyListenWait = 5 * time.Second

// Lazy is the lazy-pages server of one lazy restore. Its goroutine owns the process; Done
// is closed when it has exited, and Err then says whether every page went in.
type Lazy struct {
	dir  string
	cmd  *deadline.Cmd
	done chan struct{}
	mu   sync.Mutex
	// +checklocks:mu
	err error
}

// Done is closed when the server has exited.
func (l *Lazy) Done() <-chan struct{} { return l.done }

// Err is nil when the server copied every page and exited cleanly; the error names the
// server and quotes its log otherwise. Valid once Done is closed.
func (l *Lazy) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

// Wait waits, d at most, for the server to finish, and returns Err; past d it says what
// it waited for.
func (l *Lazy) Wait(d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-l.done:
		return l.Err()
	case <-t.C:
		return fmt.Errorf("the lazy restore from %s had not copied every page in %v (criu lazy-pages still running)", l.dir, d)
	}
}

// Kill ends the server at once (the pages not yet in then read as zeros: see above) and
// waits for its goroutine.
func (l *Lazy) Kill() {
	if l.cmd.Process != nil {
		_ = l.cmd.Process.Kill() // ErrProcessDone: it ended already; the wait below is what counts
	}
	<-l.done
}

// startLazy starts `criu lazy-pages` on dir and waits until it listens.
func startLazy(r *criu.Runner, dir string, logLevel int32) (*Lazy, error) {
	sock := filepath.Join(dir, lazySocket)
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	// It says it listens by a byte on --status-fd (written after listen(2): the socket
	// file alone appears at bind(2), and a restore that connects before listen gets
	// ECONNREFUSED).
	ready, readyW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer func() { _ = ready.Close() }() // read end, after the read
	cmd := deadline.Command(context.Background(), LazyTimeout, r.Bin, "lazy-pages",
		"--images-dir", dir, "--log-file", LazyLog, fmt.Sprintf("-v%d", logLevel), "--status-fd", "3")
	cmd.ExtraFiles = []*os.File{readyW}
	cmd.What = "criu lazy-pages for " + dir
	cmd.Env = append(criu.Environ(), r.Env()...)
	// Its output to a file, not a pipe of ours: a daemon that dies leaves the server
	// running to the end, and a write to a pipe no one reads would kill it (SIGPIPE).
	outf, err := os.OpenFile(filepath.Join(dir, "lazy-pages.out"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, err
	}
	defer func() { _ = outf.Close() }() // the server writes through its own copy
	cmd.Stdout, cmd.Stderr = outf, outf
	err = cmd.Start()
	_ = readyW.Close() // the server has its own copy
	if err != nil {
		return nil, err
	}
	l := &Lazy{dir: dir, cmd: cmd, done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		if err != nil {
			out, _ := os.ReadFile(filepath.Join(dir, "lazy-pages.out"))
			err = fmt.Errorf("%s: %w%s; the end of its log %s: %s", cmd.What, err, outputNote(string(out)),
				filepath.Join(dir, LazyLog), (&call{dir: dir, log: LazyLog}).logTail())
		}
		l.mu.Lock()
		l.err = err
		l.mu.Unlock()
		close(l.done)
	}()
	_ = ready.SetReadDeadline(time.Now().Add(lazyListenWait)) // a pipe is pollable: only a closed one refuses
	var b [1]byte
	if n, err := ready.Read(b[:]); n == 1 {
		return l, nil
	} else if errors.Is(err, os.ErrDeadlineExceeded) {
		l.Kill()
		return nil, fmt.Errorf("criu lazy-pages for %s did not listen on %s within %v", dir, lazySocket, lazyListenWait)
	}
	<-l.done // it closed its end without the byte: it is exiting
	return nil, fmt.Errorf("criu lazy-pages exited before it listened: %v", l.Err())
}
