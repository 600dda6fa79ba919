// Package api is the daemon's HTTP+JSON API on a unix socket. Every route is listed
// in docs/API.md. Errors are {"error":{"code":..., "message":...}} with the status
// from errdefs.HTTPStatus; messages say what to do.
package api

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"
	"unicode/utf8"

	"deltabox/internal/apitypes"
	"deltabox/internal/auth"
	"deltabox/internal/errdefs"
	"deltabox/internal/sandbox"
	"deltabox/internal/state"
)

// Version is the API version prefix.
const Version = apitypes.Version

// maxBody caps JSON request bodies (exec stdin included): the body is read whole
// into the daemon's memory before it is decoded.
const maxBody = 16 << 20

// The request and answer bodies of the routes in this file; their wire form is defined
// once, in apitypes.
type (
	ExecRequest       = apitypes.ExecRequest
	StreamEvent       = apitypes.StreamEvent
	CheckpointRequest = apitypes.CheckpointRequest
	RestoreRequest    = apitypes.RestoreRequest
	// ErrorBody is every error response.
	ErrorBody = apitypes.ErrorBody
)

// Server serves the API for a state manager.
type Server struct {
	m   *state.Manager
	log *slog.Logger
	mux *http.ServeMux
}

// New builds the handler.
func New(m *state.Manager, log *slog.Logger) *Server {
	s := &Server{m: m, log: log, mux: http.NewServeMux()}
	h := s.mux.HandleFunc
	h("GET /v1/health", s.health)
	h("GET /v1/sandboxes", s.listSandboxes)
	h("POST /v1/sandboxes", s.createSandbox)
	h("GET /v1/sandboxes/{id}", s.getSandbox)
	h("DELETE /v1/sandboxes/{id}", s.removeSandbox)
	h("POST /v1/sandboxes/{id}/exec", s.exec)
	h("POST /v1/sandboxes/{id}/checkpoint", s.checkpoint)
	h("POST /v1/sandboxes/{id}/restore", s.restore)
	h("POST /v1/sandboxes/{id}/fork", s.forkSandbox)
	h("POST /v1/sandboxes/{id}/signal", s.signal)
	h("POST /v1/sandboxes/{id}/sessions", s.startSession)
	h("GET /v1/sandboxes/{id}/sessions", s.listSessions)
	h("GET /v1/sandboxes/{id}/sessions/{name}/logs", s.sessionLogs)
	h("DELETE /v1/sandboxes/{id}/sessions/{name}", s.killSession)
	h("GET /v1/tree", s.tree)
	h("GET /v1/tree/page", s.treePage)
	h("GET /v1/nodes/{id}", s.getNode)
	h("DELETE /v1/nodes/{id}", s.removeNode)
	h("POST /v1/nodes/{id}/pin", s.pinNode)
	h("POST /v1/nodes/{id}/prepare", s.prepareNode)
	h("POST /v1/nodes/{id}/evict", s.evictNode)
	h("POST /v1/nodes/{id}/fork", s.forkNode)
	s.transferRoutes()
	h("GET /v1/images", s.images)
	s.imageRoutes()
	h("POST /v1/sync", s.sync)
	s.filesRoutes()
	s.portsRoutes()
	h("/", func(w http.ResponseWriter, r *http.Request) {
		writeErr(w, fmt.Errorf("no route %s %s (see docs/API.md): %w", r.Method, r.URL.Path, errdefs.ErrNotFound))
	})
	return s
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// Listen serves on a unix socket at path with the given mode (0600: root only).
func (s *Server) Listen(ctx context.Context, path string, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	if c, err := net.Dial("unix", path); err == nil {
		_ = c.Close() // a probe: only that it connected matters
		return fmt.Errorf("another daemon is listening on %s", path)
	}
	_ = os.Remove(path) // a stale socket; if it stays, Listen says so
	l, err := net.Listen("unix", path)
	if err != nil {
		return err
	}
	if err := os.Chmod(path, mode); err != nil {
		_ = l.Close()
		return err
	}
	srv := &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx) // past its deadline Serve has returned anyway
	}()
	err = srv.Serve(l)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v) // the client went away: nothing to tell it
}

func writeErr(w http.ResponseWriter, err error) {
	status, code := errdefs.HTTPStatus(err)
	var b ErrorBody
	b.Error.Code, b.Error.Message = code, err.Error()
	writeJSON(w, status, b)
}

// decode reads a JSON body into v (DecodeBody, strict, maxBody).
func decode(w http.ResponseWriter, r *http.Request, v any) error {
	return DecodeBody(w, r, v, maxBody, true, "send files with PUT /v1/sandboxes/{id}/files?path=P (up to 64 MiB a write) rather than in an exec's stdin")
}

// DecodeBody reads a JSON body of at most max bytes into v; an empty body leaves v as
// it is. A body over max is ErrTooLarge (413) whose message ends with hint (what to
// send instead); http.MaxBytesReader also closes the connection after the answer, so
// the rest of the body is never read. strict refuses unknown fields (DeltaBox's API:
// a misspelt option is an error); E2B's API (package e2b) takes them, as its SDKs send
// options DeltaBox ignores.
func DecodeBody(w http.ResponseWriter, r *http.Request, v any, max int64, strict bool, hint string) error {
	b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, max))
	if mb := (*http.MaxBytesError)(nil); errors.As(err, &mb) {
		return fmt.Errorf("request body over the limit of %d bytes: %s: %w", max, hint, errdefs.ErrTooLarge)
	}
	if err != nil {
		return fmt.Errorf("read body: %v: %w", err, errdefs.ErrInvalid)
	}
	if len(bytes.TrimSpace(b)) == 0 {
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if strict {
		dec.DisallowUnknownFields()
	}
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("bad JSON body: %v: %w", err, errdefs.ErrInvalid)
	}
	return nil
}

func (s *Server) health(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, 200, apitypes.Health{API: Version, OK: true})
}

func (s *Server) listSandboxes(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, 200, apitypes.SandboxList{Sandboxes: s.m.List()})
}

func (s *Server) createSandbox(w http.ResponseWriter, r *http.Request) {
	var o state.CreateOptions
	if err := decode(w, r, &o); err != nil {
		writeErr(w, err)
		return
	}
	in, err := s.m.Create(r.Context(), o)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 201, in)
}

func (s *Server) getSandbox(w http.ResponseWriter, r *http.Request) {
	in, err := s.m.Get(r.PathValue("id"))
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 200, in)
}

func (s *Server) removeSandbox(w http.ResponseWriter, r *http.Request) {
	if err := s.m.Remove(r.PathValue("id")); err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 200, apitypes.Removed{Removed: r.PathValue("id")})
}

func (s *Server) exec(w http.ResponseWriter, r *http.Request) {
	var q ExecRequest
	if err := decode(w, r, &q); err != nil {
		writeErr(w, err)
		return
	}
	req, err := execRequest(q)
	if err != nil {
		writeErr(w, err)
		return
	}
	b64 := q.Encoding == apitypes.EncodingBase64
	// A client that goes away cancels r.Context() (the server reads the connection
	// once the body is read): a plain command's process group is killed, a session's
	// command is interrupted (^C) and the session kept.
	if !q.Stream && r.URL.Query().Get("stream") == "" {
		res, err := s.m.Exec(r.Context(), r.PathValue("id"), req)
		s.logAbandoned(r, err)
		if err != nil {
			writeErr(w, err)
			return
		}
		res.TimeoutMS = req.Timeout.Milliseconds()
		if b64 {
			res.Stdout = base64.StdEncoding.EncodeToString([]byte(res.Stdout))
			res.Stderr = base64.StdEncoding.EncodeToString([]byte(res.Stderr))
			res.Encoding = apitypes.EncodingBase64
		}
		writeJSON(w, 200, res)
		return
	}
	// Streaming: NDJSON, one event per line, flushed as output arrives. Errors found
	// before anything was sent keep their status code; later ones become an event.
	fl, _ := w.(http.Flusher)
	var mu sync.Mutex // protects started, carry and the writes
	started := false
	// Text: a UTF-8 sequence cut by a read waits for its end, so that the bytes of
	// a character are not replaced each on its own.
	carry := map[string][]byte{}
	enc := json.NewEncoder(w)
	// emit writes ev, with data in the request's encoding. Precondition: mu held.
	emit := func(ev StreamEvent, data []byte) {
		if !started {
			w.Header().Set("Content-Type", "application/x-ndjson")
			w.WriteHeader(200)
			started = true
		}
		if b64 {
			ev.Data = base64.StdEncoding.EncodeToString(data)
		} else {
			ev.Data = string(data)
		}
		_ = enc.Encode(ev) // the client went away: nothing to tell it
		if fl != nil {
			fl.Flush()
		}
	}
	// flush sends a stream's carried bytes as they are (before a marker, at the end).
	flush := func(stream string) {
		if c := carry[stream]; len(c) > 0 {
			delete(carry, stream)
			emit(StreamEvent{Type: stream}, c)
		}
	}
	req.OnOutput = func(stream string, data []byte) {
		mu.Lock()
		defer mu.Unlock()
		if !b64 {
			data = append(carry[stream], data...)
			var rest []byte
			data, rest = cutIncompleteRune(data)
			carry[stream] = append([]byte(nil), rest...)
			if len(data) == 0 {
				return
			}
		}
		emit(StreamEvent{Type: stream}, data)
	}
	req.OnMarker = func(stream, kind, text string, dropped int64) {
		mu.Lock()
		defer mu.Unlock()
		flush(stream)
		emit(StreamEvent{Type: stream, Marker: kind, Dropped: dropped}, []byte(text))
	}
	res, err := s.m.Exec(r.Context(), r.PathValue("id"), req)
	s.logAbandoned(r, err)
	mu.Lock()
	defer mu.Unlock()
	flush("stdout")
	flush("stderr")
	if err != nil {
		if !started {
			writeErr(w, err)
			return
		}
		_, code := errdefs.HTTPStatus(err)
		var eb ErrorBody
		eb.Error.Code, eb.Error.Message = code, err.Error()
		emit(StreamEvent{Type: "error", Error: &eb}, nil)
		return
	}
	// The events carried the output: the result does not repeat it.
	res.Stdout, res.Stderr = "", ""
	res.TimeoutMS = req.Timeout.Milliseconds()
	if b64 {
		res.Encoding = apitypes.EncodingBase64
	}
	emit(StreamEvent{Type: "result", Result: res}, nil)
}

// execRequest checks an exec request and turns it into the sandbox's form.
func execRequest(q ExecRequest) (sandbox.ExecRequest, error) {
	req := sandbox.ExecRequest{Argv: q.Argv, Env: q.Env, Dir: q.Dir, User: q.User, OutputLimit: q.OutputLimit, Session: q.Session}
	switch {
	case q.TimeoutMS == 0:
		req.Timeout = apitypes.DefaultExecTimeoutMS * time.Millisecond
	case q.TimeoutMS > 0:
		req.Timeout = time.Duration(q.TimeoutMS) * time.Millisecond
	case q.TimeoutMS != -1:
		return req, fmt.Errorf("timeout_ms %d: want milliseconds > 0, 0 for the default (%d, 10 min) or -1 for none: %w",
			q.TimeoutMS, apitypes.DefaultExecTimeoutMS, errdefs.ErrInvalid)
	}
	if q.OutputLimit < 0 {
		return req, fmt.Errorf("output_limit %d: want bytes > 0, or 0 for the default (1 MiB): %w", q.OutputLimit, errdefs.ErrInvalid)
	}
	// A session call runs its code in the session's shell or interpreter, with the
	// session's working directory and environment, and no stdin of its own: these fields
	// would be ignored, so they are refused rather than dropped silently.
	if q.Session != "" {
		for _, f := range []struct {
			set  bool
			name string
		}{{q.Dir != "", "dir"}, {len(q.Env) > 0, "env"}, {q.Stdin != "", "stdin"}, {q.User != "", "user"}} {
			if f.set {
				return req, fmt.Errorf("%s is not taken by a session call (it runs in the session's shell, with its own directory and environment): cd or export in the code, start the session with them, or run the command without a session: %w", f.name, errdefs.ErrInvalid)
			}
		}
	}
	switch q.Encoding {
	case "", apitypes.EncodingText:
		req.Stdin = []byte(q.Stdin)
	case apitypes.EncodingBase64:
		b, err := base64.StdEncoding.DecodeString(q.Stdin)
		if err != nil {
			return req, fmt.Errorf("stdin is not base64 (encoding is base64): %v: %w", err, errdefs.ErrInvalid)
		}
		req.Stdin = b
	default:
		return req, fmt.Errorf("encoding %q: want %q (the default) or %q: %w", q.Encoding, apitypes.EncodingText, apitypes.EncodingBase64, errdefs.ErrInvalid)
	}
	return req, nil
}

// logAbandoned logs a call whose client went away: nobody else hears of it.
func (s *Server) logAbandoned(r *http.Request, err error) {
	if r.Context().Err() != nil {
		s.log.Info("exec: the client went away; the command was interrupted", "sandbox", r.PathValue("id"), "err", err)
	}
}

// cutIncompleteRune splits b before a UTF-8 sequence that its end cuts short.
func cutIncompleteRune(b []byte) (whole, rest []byte) {
	for i := len(b) - 1; i >= 0 && i >= len(b)-utf8.UTFMax+1; i-- {
		if utf8.RuneStart(b[i]) {
			if !utf8.FullRune(b[i:]) {
				return b[:i], b[i:]
			}
			break
		}
	}
	return b, nil
}

func (s *Server) checkpoint(w http.ResponseWriter, r *http.Request) {
	var q CheckpointRequest
	if err := decode(w, r, &q); err != nil {
		writeErr(w, err)
		return
	}
	wait, err := waitMS(q.WaitMS)
	if err != nil {
		writeErr(w, err)
		return
	}
	res, err := s.m.CheckpointWith(r.Context(), r.PathValue("id"), state.CheckpointOptions{Label: q.Label, EndBackground: q.EndBackground, Wait: wait, Pin: q.Pin, Answer: q.Answer})
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 201, res)
}

func (s *Server) restore(w http.ResponseWriter, r *http.Request) {
	var q RestoreRequest
	if err := decode(w, r, &q); err != nil {
		writeErr(w, err)
		return
	}
	if q.Node == "" {
		writeErr(w, fmt.Errorf(`restore needs {"node": ID}: %w`, errdefs.ErrInvalid))
		return
	}
	wait, err := waitMS(q.WaitMS)
	if err != nil {
		writeErr(w, err)
		return
	}
	switch q.LazyImage {
	case "", "always", "never":
	default:
		writeErr(w, fmt.Errorf(`restore: lazy_image %q: want "always", "never" or "" (the daemon's choice): %w`, q.LazyImage, errdefs.ErrInvalid))
		return
	}
	res, err := s.m.RestoreWith(r.Context(), r.PathValue("id"), state.RestoreOptions{Node: q.Node, Wait: wait, LazyImage: q.LazyImage})
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 200, res)
}

// waitMS checks a checkpoint's or restore's wait_ms (the state manager bounds it).
func waitMS(v int64) (time.Duration, error) {
	if v < 0 {
		return 0, fmt.Errorf("wait_ms must be >= 0 (0: refuse at once while a call runs): %w", errdefs.ErrInvalid)
	}
	return time.Duration(v) * time.Millisecond, nil
}

func (s *Server) tree(w http.ResponseWriter, r *http.Request) { writeJSON(w, 200, s.m.Tree()) }

func (s *Server) getNode(w http.ResponseWriter, r *http.Request) {
	n, err := s.m.Node(r.PathValue("id"))
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 200, n)
}

// prepareNode makes sure a sandbox holds a spare of a node (docs/design/spares.md) and
// answers the node once it does.
func (s *Server) prepareNode(w http.ResponseWriter, r *http.Request) {
	var q apitypes.PrepareRequest
	if err := decode(w, r, &q); err != nil {
		writeErr(w, err)
		return
	}
	n, err := s.m.PrepareSpare(r.Context(), r.PathValue("id"), q.Sandbox)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 200, n)
}

// pinNode pins or unpins a node ({"pinned": false} unpins; an empty body pins).
func (s *Server) pinNode(w http.ResponseWriter, r *http.Request) {
	q := apitypes.PinRequest{Pinned: true}
	if err := decode(w, r, &q); err != nil {
		writeErr(w, err)
		return
	}
	n, err := s.m.PinNode(r.PathValue("id"), q.Pinned)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 200, n)
}

// evictNode drops a node's templates; its durable image brings them back at its next
// restore (409 without one).
func (s *Server) evictNode(w http.ResponseWriter, r *http.Request) {
	n, err := s.m.EvictNode(r.PathValue("id"))
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 200, n)
}

// forkNode makes new sandboxes on a node, its processes carried where a path can
// (state/fork.go); 201 with each branch's path and why.
func (s *Server) forkNode(w http.ResponseWriter, r *http.Request) {
	var q apitypes.ForkRequest
	if err := decode(w, r, &q); err != nil {
		writeErr(w, err)
		return
	}
	res, err := s.m.Fork(r.Context(), r.PathValue("id"), q)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 201, res)
}

// forkSandbox checkpoints a sandbox and forks the node it made, in one request.
func (s *Server) forkSandbox(w http.ResponseWriter, r *http.Request) {
	var q apitypes.SandboxForkRequest
	if err := decode(w, r, &q); err != nil {
		writeErr(w, err)
		return
	}
	wait, err := waitMS(q.Checkpoint.WaitMS)
	if err != nil {
		writeErr(w, err)
		return
	}
	c := q.Checkpoint
	res, err := s.m.ForkSandbox(r.Context(), r.PathValue("id"), state.CheckpointOptions{Label: c.Label, EndBackground: c.EndBackground, Wait: wait, Pin: c.Pin}, q.ForkRequest)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 201, res)
}

func (s *Server) removeNode(w http.ResponseWriter, r *http.Request) {
	removed, err := s.m.RemoveNode(r.PathValue("id"))
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 200, apitypes.NodesRemoved{Removed: removed})
}

func (s *Server) images(w http.ResponseWriter, r *http.Request) {
	ims, err := s.m.Images()
	if err != nil {
		writeErr(w, err)
		return
	}
	if auth.IsRemote(r.Context()) { // the host's paths are the host's business
		for i := range ims {
			ims[i].Source = ""
		}
	}
	writeJSON(w, 200, apitypes.ImageList{Images: ims})
}

func (s *Server) sync(w http.ResponseWriter, r *http.Request) {
	if err := s.m.Sync(); err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 200, apitypes.Synced{Durable: true})
}
