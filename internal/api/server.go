// Package api is the daemon's HTTP+JSON API on a unix socket. Every route is listed
// in docs/API.md. Errors are {"error":{"code":..., "message":...}} with the status
// from errdefs.HTTPStatus; messages say what to do.
package api

import (
	"bytes"
	"context"
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

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
	"deltabox/internal/sandbox"
	"deltabox/internal/state"
)

// Version is the API version prefix.
const Version = apitypes.Version

// maxBody caps request bodies (exec stdin included).
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
	h("POST /v1/sandboxes/{id}/sessions", s.startSession)
	h("GET /v1/sandboxes/{id}/sessions", s.listSessions)
	h("GET /v1/sandboxes/{id}/sessions/{name}/logs", s.sessionLogs)
	h("DELETE /v1/sandboxes/{id}/sessions/{name}", s.killSession)
	h("GET /v1/tree", s.tree)
	h("GET /v1/nodes/{id}", s.getNode)
	h("DELETE /v1/nodes/{id}", s.removeNode)
	h("GET /v1/images", s.images)
	s.imageRoutes()
	h("POST /v1/sync", s.sync)
	s.filesRoutes()
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
		c.Close()
		return fmt.Errorf("another daemon is listening on %s", path)
	}
	os.Remove(path)
	l, err := net.Listen("unix", path)
	if err != nil {
		return err
	}
	if err := os.Chmod(path, mode); err != nil {
		l.Close()
		return err
	}
	srv := &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
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
	json.NewEncoder(w).Encode(v)
}

func writeErr(w http.ResponseWriter, err error) {
	status, code := errdefs.HTTPStatus(err)
	var b ErrorBody
	b.Error.Code, b.Error.Message = code, err.Error()
	writeJSON(w, status, b)
}

// decode reads a JSON body into v; an empty body leaves v as it is.
func decode(r *http.Request, v any) error {
	b, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil {
		return fmt.Errorf("read body: %v: %w", err, errdefs.ErrInvalid)
	}
	if len(b) > maxBody {
		return fmt.Errorf("request body over %d bytes: %w", maxBody, errdefs.ErrInvalid)
	}
	if len(b) == 0 {
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
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
	if err := decode(r, &o); err != nil {
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
	if err := decode(r, &q); err != nil {
		writeErr(w, err)
		return
	}
	if q.TimeoutMS < 0 {
		writeErr(w, fmt.Errorf("timeout_ms must be >= 0: %w", errdefs.ErrInvalid))
		return
	}
	req := sandbox.ExecRequest{
		Argv: q.Argv, Env: q.Env, Dir: q.Dir, Stdin: []byte(q.Stdin),
		Timeout: time.Duration(q.TimeoutMS) * time.Millisecond, OutputLimit: q.OutputLimit,
		Session: q.Session,
	}
	if !q.Stream && r.URL.Query().Get("stream") == "" {
		res, err := s.m.Exec(r.Context(), r.PathValue("id"), req)
		if err != nil {
			writeErr(w, err)
			return
		}
		writeJSON(w, 200, res)
		return
	}
	// Streaming: NDJSON, one event per line, flushed as output arrives. Errors found
	// before anything was sent keep their status code; later ones become an event.
	fl, _ := w.(http.Flusher)
	var mu sync.Mutex
	started := false
	enc := json.NewEncoder(w)
	emit := func(ev StreamEvent) {
		mu.Lock()
		defer mu.Unlock()
		if !started {
			w.Header().Set("Content-Type", "application/x-ndjson")
			w.WriteHeader(200)
			started = true
		}
		enc.Encode(ev)
		if fl != nil {
			fl.Flush()
		}
	}
	req.OnOutput = func(stream string, data []byte) { emit(StreamEvent{Type: stream, Data: string(data)}) }
	res, err := s.m.Exec(r.Context(), r.PathValue("id"), req)
	if err != nil {
		mu.Lock()
		st := started
		mu.Unlock()
		if !st {
			writeErr(w, err)
			return
		}
		_, code := errdefs.HTTPStatus(err)
		var eb ErrorBody
		eb.Error.Code, eb.Error.Message = code, err.Error()
		emit(StreamEvent{Type: "error", Error: &eb})
		return
	}
	emit(StreamEvent{Type: "result", Result: res})
}

func (s *Server) checkpoint(w http.ResponseWriter, r *http.Request) {
	var q CheckpointRequest
	if err := decode(r, &q); err != nil {
		writeErr(w, err)
		return
	}
	wait, err := waitMS(q.WaitMS)
	if err != nil {
		writeErr(w, err)
		return
	}
	res, err := s.m.CheckpointWith(r.Context(), r.PathValue("id"), state.CheckpointOptions{Label: q.Label, EndBackground: q.EndBackground, Wait: wait})
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 201, res)
}

func (s *Server) restore(w http.ResponseWriter, r *http.Request) {
	var q RestoreRequest
	if err := decode(r, &q); err != nil {
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
	res, err := s.m.RestoreWith(r.Context(), r.PathValue("id"), state.RestoreOptions{Node: q.Node, Wait: wait})
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
	writeJSON(w, 200, apitypes.ImageList{Images: ims})
}

func (s *Server) sync(w http.ResponseWriter, r *http.Request) {
	if err := s.m.Sync(); err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 200, apitypes.Synced{Durable: true})
}
