package e2b

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"deltabox/internal/api"
	"deltabox/internal/e2b/spec/filesystem"
	"deltabox/internal/errdefs"
	"deltabox/internal/files"
	"deltabox/internal/sandbox"
	"deltabox/internal/sbinit"
)

// Reads, stats and listings go through the daemon's confined file operations
// (Manager.FileOp and package files: openat2 RESOLVE_IN_ROOT on the sandbox's root).
// Writes, mkdir, moves and removes run inside the sandbox as the request's user
// (a short exec), as envd does them as that user: what they make belongs to the user,
// and the user's permissions decide what they may change.

// passwd is the names of the sandbox's /etc/passwd by uid, read confined to the
// sandbox, for the owners of envd's entries (a user's home is sbinit.LookupUser's).
type passwd struct {
	names map[uint32]string
}

func (s *Server) passwd(ctx context.Context, id string) (*passwd, error) {
	pw := &passwd{names: map[uint32]string{}}
	err := s.m.FileOp(ctx, id, "files read /etc/passwd", func(root int, _ string) error {
		b, _, err := files.Read(root, "/etc/passwd", 0, 0, 4<<20)
		if err != nil {
			return err
		}
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			f := strings.Split(sc.Text(), ":")
			if len(f) < 7 {
				continue
			}
			if uid, err := strconv.ParseUint(f[2], 10, 32); err == nil {
				if _, ok := pw.names[uint32(uid)]; !ok {
					pw.names[uint32(uid)] = f[0]
				}
			}
		}
		return nil
	})
	return pw, err
}

// homeOf is user's home in sandbox id ("/" for a user without one, as DeltaBox's exec
// sets HOME).
func (s *Server) homeOf(ctx context.Context, id, user string) (string, error) {
	var home string
	err := s.m.FileOp(ctx, id, "files read /etc/passwd", func(root int, _ string) error {
		u, err := sbinit.LookupUser(root, user) // what an exec as user resolves
		if err != nil {
			return fmt.Errorf("%v: %w", err, errdefs.ErrInvalid)
		}
		home = u.Home
		return nil
	})
	if err == nil && !path.IsAbs(home) {
		home = "/"
	}
	return home, err
}

// resolve is p, absolute or relative to the request's user's home, made absolute.
func (s *Server) resolve(ctx context.Context, id, user, p string) (string, error) {
	if p == "" {
		return "", fmt.Errorf("a path is required: %w", errdefs.ErrInvalid)
	}
	home := "/"
	if !strings.HasPrefix(p, "/") {
		h, err := s.homeOf(ctx, id, user)
		if err != nil {
			return "", err
		}
		home = h
	}
	return files.Resolve(home, p)
}

func (pw *passwd) name(id uint32) string {
	if n, ok := pw.names[id]; ok {
		return n
	}
	return strconv.FormatUint(uint64(id), 10)
}

// entry is in as envd's EntryInfo; ids as the sandbox sees them.
func (s *Server) entry(sbID string, pw *passwd, in *files.Info) *filesystem.EntryInfo {
	base := s.m.IDBase(sbID)
	uid, gid := files.SandboxID(in.UID, base), files.SandboxID(in.GID, base)
	e := &filesystem.EntryInfo{Name: in.Name, Path: in.Path, Size: in.Size, Mode: in.Mode, Permissions: in.Permissions,
		Owner: pw.name(uid), Group: pw.name(gid), ModifiedTime: timestamppb.New(in.ModTime)}
	switch in.Type {
	case "file":
		e.Type = filesystem.FileType_FILE_TYPE_FILE
	case "dir":
		e.Type = filesystem.FileType_FILE_TYPE_DIRECTORY
		e.Mode |= 1 << 31 // os.ModeDir, as envd sends Go's FileMode
	case "symlink":
		e.Type = filesystem.FileType_FILE_TYPE_SYMLINK
		t := in.LinkTarget
		e.SymlinkTarget = &t
	}
	return e
}

// stat is path p of the box's sandbox as envd's EntryInfo.
func (s *Server) stat(ctx context.Context, id, p string) (*filesystem.EntryInfo, error) {
	pw, err := s.passwd(ctx, id)
	if err != nil {
		return nil, err
	}
	var e *filesystem.EntryInfo
	err = s.m.FileOp(ctx, id, "files stat "+p, func(root int, _ string) error {
		in, err := files.Stat(root, p)
		if err != nil {
			return err
		}
		e = s.entry(id, pw, in)
		return nil
	})
	return e, err
}

// runAs runs argv in sandbox id as user, with stdin, and turns a failure into an
// error carrying its stderr.
func (s *Server) runAs(ctx context.Context, id, user string, stdin io.Reader, argv ...string) error {
	res, err := s.m.Exec(ctx, id, sandbox.ExecRequest{Argv: argv, User: user, StdinReader: stdin, Dir: "/", Timeout: 5 * time.Minute, OutputLimit: 64 << 10})
	if err != nil {
		return err
	}
	if res.ExitCode != 0 || res.Signal != 0 {
		msg := strings.TrimSpace(res.Stderr)
		kind := errdefs.ErrInvalid
		switch {
		case strings.Contains(msg, "No such file"):
			kind = errdefs.ErrNotFound
		case strings.Contains(msg, "Permission denied"):
			return connect.NewError(connect.CodePermissionDenied, fmt.Errorf("%s", msg))
		}
		return fmt.Errorf("%s: %w", msg, kind)
	}
	return nil
}

type filesystemService struct{ s *Server }

func (fs *filesystemService) Stat(ctx context.Context, req *connect.Request[filesystem.StatRequest]) (*connect.Response[filesystem.StatResponse], error) {
	b := boxOf(ctx)
	p, err := fs.s.resolve(ctx, b.id, userOf(req.Header()), req.Msg.Path)
	if err != nil {
		return nil, connectErr(err)
	}
	e, err := fs.s.stat(ctx, b.id, p)
	if err != nil {
		return nil, connectErr(err)
	}
	return connect.NewResponse(&filesystem.StatResponse{Entry: e}), nil
}

func (fs *filesystemService) MakeDir(ctx context.Context, req *connect.Request[filesystem.MakeDirRequest]) (*connect.Response[filesystem.MakeDirResponse], error) {
	b, user := boxOf(ctx), userOf(req.Header())
	p, err := fs.s.resolve(ctx, b.id, user, req.Msg.Path)
	if err != nil {
		return nil, connectErr(err)
	}
	if _, err := fs.s.stat(ctx, b.id, p); err == nil {
		return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("%s exists", p))
	}
	if err := fs.s.runAs(ctx, b.id, user, nil, "mkdir", "-p", "--", p); err != nil {
		return nil, connectErr(err)
	}
	e, err := fs.s.stat(ctx, b.id, p)
	if err != nil {
		return nil, connectErr(err)
	}
	return connect.NewResponse(&filesystem.MakeDirResponse{Entry: e}), nil
}

func (fs *filesystemService) Move(ctx context.Context, req *connect.Request[filesystem.MoveRequest]) (*connect.Response[filesystem.MoveResponse], error) {
	b, user := boxOf(ctx), userOf(req.Header())
	src, err := fs.s.resolve(ctx, b.id, user, req.Msg.Source)
	if err != nil {
		return nil, connectErr(err)
	}
	dst, err := fs.s.resolve(ctx, b.id, user, req.Msg.Destination)
	if err != nil {
		return nil, connectErr(err)
	}
	if _, err := fs.s.stat(ctx, b.id, src); err != nil {
		return nil, connectErr(err)
	}
	// mkdir -p of the destination's directory and rename(2) (mv -T: onto dst itself,
	// never into it), as envd's Move.
	if err := fs.s.runAs(ctx, b.id, user, nil, "sh", "-c", `mkdir -p -- "$(dirname -- "$2")" && mv -T -- "$1" "$2"`, "mv", src, dst); err != nil {
		return nil, connectErr(err)
	}
	e, err := fs.s.stat(ctx, b.id, dst)
	if err != nil {
		return nil, connectErr(err)
	}
	return connect.NewResponse(&filesystem.MoveResponse{Entry: e}), nil
}

func (fs *filesystemService) ListDir(ctx context.Context, req *connect.Request[filesystem.ListDirRequest]) (*connect.Response[filesystem.ListDirResponse], error) {
	b := boxOf(ctx)
	p, err := fs.s.resolve(ctx, b.id, userOf(req.Header()), req.Msg.Path)
	if err != nil {
		return nil, connectErr(err)
	}
	depth := int(req.Msg.Depth)
	if depth < 1 {
		depth = 1
	}
	if depth > files.DefaultMaxDepth {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("depth %d: at most %d", depth, files.DefaultMaxDepth))
	}
	pw, err := fs.s.passwd(ctx, b.id)
	if err != nil {
		return nil, connectErr(err)
	}
	out := &filesystem.ListDirResponse{}
	err = fs.s.m.FileOp(ctx, b.id, "files list "+p, func(root int, _ string) error {
		in, err := files.Stat(root, p)
		if err != nil {
			return err
		}
		if in.Type != "dir" && !(in.Type == "symlink") {
			return fmt.Errorf("%s is not a directory: %w", p, errdefs.ErrInvalid)
		}
		l, err := files.List(root, p, files.ListOptions{Recursive: depth > 1, MaxDepth: depth - 1})
		if err != nil {
			return err
		}
		for i := range l.Entries {
			out.Entries = append(out.Entries, fs.s.entry(b.id, pw, &l.Entries[i]))
		}
		return nil
	})
	if err != nil {
		return nil, connectErr(err)
	}
	return connect.NewResponse(out), nil
}

func (fs *filesystemService) Remove(ctx context.Context, req *connect.Request[filesystem.RemoveRequest]) (*connect.Response[filesystem.RemoveResponse], error) {
	b, user := boxOf(ctx), userOf(req.Header())
	p, err := fs.s.resolve(ctx, b.id, user, req.Msg.Path)
	if err != nil {
		return nil, connectErr(err)
	}
	if _, err := fs.s.stat(ctx, b.id, p); err != nil {
		return nil, connectErr(err)
	}
	if err := fs.s.runAs(ctx, b.id, user, nil, "rm", "-rf", "--", p); err != nil {
		return nil, connectErr(err)
	}
	return connect.NewResponse(&filesystem.RemoveResponse{}), nil
}

// errRangeNotSatisfiable is a Range outside the file (416).
var errRangeNotSatisfiable = errors.New("range not satisfiable")

var errNoWatch = errors.New("the non-streaming watchers are not served by DeltaBox's envd: use WatchDir (files.watchDir)")

// watchPoll is how often a watched directory is listed. Watching polls (a listing
// compared with the last) rather than using inotify: the daemon would have to watch
// the overlay's upper and lower layers apart, and a restore replaces them all. A
// listing of 10,000 entries (the most a watch takes) costs a few ms.
const watchPoll = 200 * time.Millisecond

// maxWatches bounds the watches of one sandbox at once (each lists every watchPoll).
const maxWatches = 16

type watchState struct {
	typ   string
	size  int64
	mode  uint32
	mtime time.Time
}

// WatchDir streams changes under a directory (its entries; with recursive, the whole
// tree) as envd's events, found by polling every watchPoll.
func (fs *filesystemService) WatchDir(ctx context.Context, req *connect.Request[filesystem.WatchDirRequest], stream *connect.ServerStream[filesystem.WatchDirResponse]) error {
	b := boxOf(ctx)
	p, err := fs.s.resolve(ctx, b.id, userOf(req.Header()), req.Msg.Path)
	if err != nil {
		return connectErr(err)
	}
	b.mu.Lock()
	if b.watches >= maxWatches {
		b.mu.Unlock()
		return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("sandbox %s has %d watches, its limit: stop one first", b.id, maxWatches))
	}
	b.watches++
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		b.watches--
		b.mu.Unlock()
	}()
	list := func() (map[string]watchState, error) {
		out := map[string]watchState{}
		err := fs.s.m.FileOp(ctx, b.id, "files watch "+p, func(root int, _ string) error {
			in, err := files.Stat(root, p)
			if err != nil {
				return err
			}
			if in.Type != "dir" {
				return fmt.Errorf("%s is not a directory: %w", p, errdefs.ErrInvalid)
			}
			l, err := files.List(root, p, files.ListOptions{Recursive: req.Msg.Recursive})
			if err != nil {
				return err
			}
			for _, e := range l.Entries {
				out[strings.TrimPrefix(strings.TrimPrefix(e.Path, p), "/")] = watchState{e.Type, e.Size, e.Mode, e.ModTime}
			}
			return nil
		})
		return out, err
	}
	last, err := list()
	if err != nil {
		return connectErr(err)
	}
	if err := stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Start{Start: &filesystem.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	ka := keepaliveOf(req.Header(), 50*time.Second)
	lastSent := time.Now()
	tick := time.NewTicker(watchPoll)
	defer tick.Stop()
	send := func(name string, t filesystem.EventType) error {
		lastSent = time.Now()
		return stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Filesystem{Filesystem: &filesystem.FilesystemEvent{Name: name, Type: t}}})
	}
	for {
		select {
		case <-ctx.Done():
			return connectErr(ctx.Err())
		case <-tick.C:
		}
		b.mu.Lock()
		paused := b.paused != ""
		b.mu.Unlock()
		if paused {
			return connect.NewError(connect.CodeUnavailable, fmt.Errorf("sandbox %s was paused", b.id))
		}
		now, err := list()
		if err != nil {
			return connectErr(err)
		}
		names := make([]string, 0, len(now))
		for n := range now {
			names = append(names, n)
		}
		sort.Strings(names)
		for _, n := range names {
			cur, old := now[n], last[n]
			switch {
			case old == (watchState{}):
				err = send(n, filesystem.EventType_EVENT_TYPE_CREATE)
			case cur.typ != old.typ:
				if err = send(n, filesystem.EventType_EVENT_TYPE_REMOVE); err == nil {
					err = send(n, filesystem.EventType_EVENT_TYPE_CREATE)
				}
			case cur.size != old.size || !cur.mtime.Equal(old.mtime):
				err = send(n, filesystem.EventType_EVENT_TYPE_WRITE)
			case cur.mode != old.mode:
				err = send(n, filesystem.EventType_EVENT_TYPE_CHMOD)
			}
			if err != nil {
				return err
			}
		}
		for n := range last {
			if _, ok := now[n]; !ok {
				if err := send(n, filesystem.EventType_EVENT_TYPE_REMOVE); err != nil {
					return err
				}
			}
		}
		last = now
		if time.Since(lastSent) >= ka {
			lastSent = time.Now()
			if err := stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Keepalive{Keepalive: &filesystem.WatchDirResponse_KeepAlive{}}}); err != nil {
				return err
			}
		}
	}
}

func (fs *filesystemService) CreateWatcher(context.Context, *connect.Request[filesystem.CreateWatcherRequest]) (*connect.Response[filesystem.CreateWatcherResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errNoWatch)
}

func (fs *filesystemService) GetWatcherEvents(context.Context, *connect.Request[filesystem.GetWatcherEventsRequest]) (*connect.Response[filesystem.GetWatcherEventsResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errNoWatch)
}

func (fs *filesystemService) RemoveWatcher(context.Context, *connect.Request[filesystem.RemoveWatcherRequest]) (*connect.Response[filesystem.RemoveWatcherResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errNoWatch)
}

// envd's /files: GET reads a file (raw bytes), POST writes files (multipart parts named
// "file" whose file names are paths, or an application/octet-stream body for ?path).

// fileUser is the user of a /files request: ?username=, else the Authorization header's.
func fileUser(r *http.Request) string {
	if u := r.URL.Query().Get("username"); u != "" {
		return u
	}
	return userOf(r.Header)
}

// chunkWait bounds each write of a GET /files answer to its client. The read holds the
// sandbox's file call (a checkpoint or restore waits for it, or answers 409), so a
// client that stops reading must not hold it longer than this per 32 KiB.
const chunkWait = api.StallWait

// readFiles answers GET /files: the file's bytes, at most files.DefaultMaxRead of them
// (the native API's cap; larger files are read in ranges), honouring one Range
// (bytes=A-B, A-, -N).
func (s *Server) readFiles(w http.ResponseWriter, r *http.Request) {
	b := boxOf(r.Context())
	p, err := s.resolve(r.Context(), b.id, fileUser(r), r.URL.Query().Get("path"))
	if err != nil {
		envdErr(w, err)
		return
	}
	err = s.m.FileOp(r.Context(), b.id, "files read "+p, func(root int, _ string) error {
		f, in, err := files.Open(root, p)
		if err != nil {
			return err
		}
		defer f.Close()
		off, length, partial, err := byteRange(r.Header.Get("Range"), in.Size)
		if err != nil {
			w.Header().Set("Content-Range", "bytes */"+strconv.FormatInt(in.Size, 10))
			return err
		}
		n, err := files.ReadRange(p, in.Size, off, length, files.DefaultMaxRead)
		if err != nil {
			return fmt.Errorf("%w (send a Range header: bytes=OFFSET-LAST)", err)
		}
		hd := w.Header()
		hd.Set("Content-Type", "application/octet-stream")
		hd.Set("Content-Length", strconv.FormatInt(n, 10))
		hd.Set("Accept-Ranges", "bytes")
		hd.Set("Content-Disposition", mime.FormatMediaType("inline", map[string]string{"filename": path.Base(p)}))
		status := 200
		if partial {
			status = http.StatusPartialContent
			hd.Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", off, off+n-1, in.Size))
		}
		w.WriteHeader(status)
		if _, err := io.Copy(api.GuardWrites(w, chunkWait), io.NewSectionReader(f, off, n)); err != nil {
			s.log.Debug("e2b: file read cut short", "sandbox", b.id, "path", p, "err", err)
		}
		return nil
	})
	if err != nil {
		envdErr(w, err)
	}
}

// byteRange parses one Range header (bytes=A-B, bytes=A-, bytes=-N) against a file of
// size bytes: the offset and length to send, and whether it is a partial answer. A
// header it does not take (several ranges, another unit) is ignored, as RFC 9110
// allows: the whole file is the answer. A range past the end is an error (416).
func byteRange(h string, size int64) (off, length int64, partial bool, err error) {
	spec, ok := strings.CutPrefix(h, "bytes=")
	if !ok || strings.Contains(spec, ",") {
		return 0, 0, false, nil
	}
	a, bs, ok := strings.Cut(strings.TrimSpace(spec), "-")
	if !ok {
		return 0, 0, false, nil
	}
	unsat := fmt.Errorf("range %q is outside the file's %d bytes: %w", h, size, errRangeNotSatisfiable)
	if a == "" { // the last N bytes
		nn, err := strconv.ParseInt(bs, 10, 64)
		if err != nil || nn <= 0 {
			return 0, 0, false, nil
		}
		if size == 0 {
			return 0, 0, false, unsat
		}
		nn = min(nn, size)
		return size - nn, nn, true, nil
	}
	first, err := strconv.ParseInt(a, 10, 64)
	if err != nil || first < 0 {
		return 0, 0, false, nil
	}
	if first >= size {
		return 0, 0, false, unsat
	}
	last := size - 1
	if bs != "" {
		l, err := strconv.ParseInt(bs, 10, 64)
		if err != nil || l < first {
			return 0, 0, false, nil
		}
		last = min(l, size-1)
	}
	return first, last - first + 1, true, nil
}

// entryRef is what POST /files answers for each file written.
type entryRef struct {
	Name string `json:"name"`
	Type string `json:"type"`
	Path string `json:"path"`
}

// Uploads stream: each file's bytes go from the request body through a pipe to `cat`
// in the sandbox, 32 KiB at a time, so an upload holds no more than its buffers in the
// daemon. An upload is a running call of the sandbox (an exec), which a checkpoint
// waits for: a client that sends nothing for uploadWait is cut. maxUploads bounds the
// uploads under way in the daemon (and so their buffers: about 64 KiB each).
const (
	uploadWait = api.StallWait
	maxUploads = 64
)

var uploads = make(chan struct{}, maxUploads)

// errWriteEnded is what the upload's copy sees when `cat` has gone (its error is the
// answer).
var errWriteEnded = errors.New("the write in the sandbox ended")

// writeFile streams data into file p of sandbox id as user (parents made). The file is
// created (or truncated) by the user's `cat`; an upload cut short (over
// files.DefaultMaxWrite, the client gone or stalled) kills it before the end of its
// input, so the file holds what arrived, and the answer is an error.
func (s *Server) writeFile(ctx context.Context, id, user, p string, data io.Reader) (*entryRef, error) {
	ap, err := s.resolve(ctx, id, user, p)
	if err != nil {
		return nil, err
	}
	t := time.NewTimer(uploadWait)
	defer t.Stop()
	select {
	case uploads <- struct{}{}:
		defer func() { <-uploads }()
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-t.C:
		return nil, fmt.Errorf("%d uploads are under way in the daemon, its limit: retry in a moment: %w", maxUploads, errdefs.ErrUnavailable)
	}
	ectx, cancel := context.WithCancel(ctx)
	defer cancel()
	pr, pw := io.Pipe()
	runErr := make(chan error, 1)
	go func() {
		runErr <- s.runAs(ectx, id, user, pr, "sh", "-c", `mkdir -p -- "$(dirname -- "$1")" && cat > "$1"`, "write", ap)
		pr.CloseWithError(errWriteEnded) // the exec has returned: nothing reads pr any more
	}()
	n, cerr := io.Copy(pw, io.LimitReader(data, files.DefaultMaxWrite+1))
	if cerr == nil && n > files.DefaultMaxWrite {
		cerr = fmt.Errorf("%s: over the limit of %d bytes per write: %w", p, files.DefaultMaxWrite, errdefs.ErrTooLarge)
	}
	if cerr != nil {
		cancel() // kills cat before its input ends
		err := <-runErr
		pw.Close()
		if errors.Is(cerr, errWriteEnded) && err != nil {
			return nil, err
		}
		if errors.Is(cerr, errdefs.ErrInvalid) {
			return nil, cerr
		}
		return nil, fmt.Errorf("read the upload of %s: %v: %w", p, cerr, errdefs.ErrInvalid)
	}
	pw.Close() // EOF: cat ends
	if err := <-runErr; err != nil {
		return nil, err
	}
	return &entryRef{Name: path.Base(ap), Type: "file", Path: ap}, nil
}

// partPath is the path a multipart part names: its Content-Disposition's filename,
// whole (E2B's SDK sends the file's path there; Part.FileName keeps only its base). It
// is resolved as any other path, confined to the sandbox.
func partPath(part *multipart.Part) string {
	_, params, err := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
	if err != nil {
		return ""
	}
	return params["filename"]
}

func (s *Server) writeFiles(w http.ResponseWriter, r *http.Request) {
	b, user := boxOf(r.Context()), fileUser(r)
	r.Body = http.MaxBytesReader(w, r.Body, files.DefaultMaxWrite+1<<20)
	body := api.GuardBody(w, r.Body, uploadWait)
	write := func(p string, data io.Reader) (*entryRef, error) {
		return s.writeFile(r.Context(), b.id, user, p, data)
	}
	var out []*entryRef
	ct, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	switch {
	case ct == "multipart/form-data":
		mr := multipart.NewReader(body, params["boundary"])
		for {
			part, err := mr.NextPart()
			if err == io.EOF {
				break
			}
			if err != nil {
				envdErr(w, fmt.Errorf("multipart body: %v: %w", err, errdefs.ErrInvalid))
				return
			}
			p := r.URL.Query().Get("path")
			if p == "" {
				p = partPath(part)
			}
			e, err := write(p, part)
			part.Close()
			if err != nil {
				envdErr(w, err)
				return
			}
			out = append(out, e)
		}
	default: // application/octet-stream (envd 0.5.7)
		if r.Header.Get("Content-Encoding") == "gzip" {
			envdErr(w, fmt.Errorf("gzip uploads are not taken: send the file as it is: %w", errdefs.ErrInvalid))
			return
		}
		e, err := write(r.URL.Query().Get("path"), body)
		if err != nil {
			envdErr(w, err)
			return
		}
		out = append(out, e)
	}
	writeJSON(w, 200, out)
}
