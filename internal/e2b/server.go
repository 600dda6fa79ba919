package e2b

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"deltabox/internal/auth"
	"deltabox/internal/e2b/spec/filesystem/filesystemconnect"
	"deltabox/internal/e2b/spec/process/processconnect"
	"deltabox/internal/errdefs"
	"deltabox/internal/state"
)

// EnvdVersion is the envd version this package answers as. The SDKs gate features on
// it (E2B's packages/js-sdk/src/envd/versions.ts): 0.3.0 stdin may be off, 0.4.0 the
// server picks the default user, 0.5.2 closeStdin, 0.5.7 uploads as
// application/octet-stream; all are implemented. 0.6.2 (file metadata in user.e2b.*
// xattrs) is not, so the version stays below it.
const EnvdVersion = "0.5.7"

// DefaultUser is E2B's default user, and its home.
const (
	DefaultUser = "user"
	DefaultHome = "/home/user"
	defaultUID  = 1000
)

// DefaultTimeout is a sandbox's life when create names none (E2B's 300 s).
const DefaultTimeout = 300 * time.Second

// MaxTimeout caps a sandbox's timeout (E2B's plans: 1 h to 24 h).
const MaxTimeout = 24 * time.Hour

// maxProcs bounds the commands of one sandbox known to this package at once (running,
// or ended and kept for a late Connect): each may hold up to 2 x outputLimit of output.
const maxProcs = 256

// Server serves E2B's control plane and envd for a state manager.
type Server struct {
	m     *state.Manager
	log   *slog.Logger
	image string // the image "base" maps to
	// KeyValid reports whether an API key (auth.Hash) is still valid (auth.Store.Valid);
	// a sandbox's access token works while a key it was handed to does. nil: no keys
	// (every token handed out stays valid).
	KeyValid func(hash string) bool

	mu sync.Mutex // protects boxes and gone
	// +checklocks:mu
	boxes map[string]*box
	// gone are boxes of removed sandboxes, maxGone at most, so that their tokens get
	// E2B's answer for a sandbox that is no more (502), not a 401: the SDK's isRunning
	// says false on the one and throws on the other. A box made again under the id
	// drops its entry.
	// +checklocks:mu
	gone map[string]*box

	control *http.ServeMux
	envd    *http.ServeMux
}

// box is what this package keeps of a sandbox beside DeltaBox's record.
type box struct {
	id      string
	started time.Time
	token   string // envdAccessToken: 128 random bits, drawn when the box is made
	traffic string // trafficAccessToken (its ports, getHost): likewise, another draw

	// opMu serializes pause, resume, snapshot and fork of the sandbox: each is a
	// checkpoint or restore that must not interleave with another.
	opMu sync.Mutex

	mu sync.Mutex // protects the fields below
	// +checklocks:mu
	template string
	// +checklocks:mu
	metadata map[string]string // not changed once set: readers may keep the map
	// +checklocks:mu
	env map[string]string // likewise
	// +checklocks:mu
	endAt time.Time
	// +checklocks:mu
	timer *time.Timer
	// +checklocks:mu
	autoPause bool
	// +checklocks:mu
	paused string // the node a pause made; pausing while it is made; "": running
	// +checklocks:mu
	procs map[uint32]*proc
	// +checklocks:mu
	watches int // WatchDir streams open
	// +checklocks:mu
	nextPid uint32
	// tokenKeys are the API keys (auth.Hash) the token was handed to ("": a client
	// without one, as on a listener without keys).
	// +checklocks:mu
	tokenKeys map[string]bool
}

// New returns a server; image is what template "base" (the SDK's default) creates.
func New(m *state.Manager, log *slog.Logger, image string) *Server {
	s := &Server{m: m, log: log, boxes: map[string]*box{}, gone: map[string]*box{}, image: image,
		control: http.NewServeMux(), envd: http.NewServeMux()}
	s.controlRoutes()
	opts := []connect.HandlerOption{connect.WithReadMaxBytes(maxRPCBody), connect.WithSendMaxBytes(maxRPCBody)}
	p, ph := processconnect.NewProcessHandler(&processService{s}, opts...)
	s.envd.Handle(p, ph)
	f, fh := filesystemconnect.NewFilesystemHandler(&filesystemService{s}, opts...)
	s.envd.Handle(f, fh)
	s.envd.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(204) })
	s.envd.HandleFunc("GET /files", s.readFiles)
	s.envd.HandleFunc("POST /files", s.writeFiles)
	s.envd.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		envdErr(w, fmt.Errorf("envd route %s %s is not served by DeltaBox (docs/API.md, E2B): %w", r.Method, r.URL.Path, errdefs.ErrNotFound))
	})
	return s
}

// maxRPCBody caps an RPC message (SendInput's stdin chunk is the largest).
const maxRPCBody = 8 << 20

// SandboxHeader names a sandbox on envd traffic.
const SandboxHeader = "E2b-Sandbox-Id"

// IsEnvd reports whether r is sandbox (envd) traffic: it names a sandbox.
func IsEnvd(r *http.Request) bool { return r.Header.Get(SandboxHeader) != "" }

// ServeHTTP routes a sandbox's port (Host PORT-SANDBOXID.DOMAIN), envd traffic
// (E2b-Sandbox-Id) and the control plane, in this order.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if port, id, ok := PortHost(r.Host); ok {
		s.servePort(w, r, port, id)
		return
	}
	if IsEnvd(r) {
		s.serveEnvd(w, r)
		return
	}
	s.control.ServeHTTP(w, r)
}

// token hands out b's envdAccessToken to the client of ctx, and records its API key:
// the token works while one of the keys it was handed to is valid.
func (s *Server) token(ctx context.Context, b *box) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.tokenKeys[auth.RemoteKey(ctx)] = true
	return b.token
}

// TokenOK reports whether r carries the access token of the sandbox it names, handed
// out under an API key still valid. The token is the sandbox's own (drawn when this
// package first saw it), so it dies with the sandbox: another sandbox made later under
// the same id has another; a daemon restart draws new ones (Sandbox.connect gets it).
func (s *Server) TokenOK(r *http.Request) bool {
	id, t := r.Header.Get(SandboxHeader), r.Header.Get("X-Access-Token")
	if id == "" || t == "" {
		return false
	}
	b, err := s.box(id)
	if errors.Is(err, errdefs.ErrNotFound) {
		s.mu.Lock()
		b, err = s.gone[id], nil
		s.mu.Unlock()
	}
	if err != nil || b == nil || subtle.ConstantTimeCompare([]byte(t), []byte(b.token)) != 1 {
		return false
	}
	return s.tokenKeyValid(b)
}

// tokenKeyValid reports whether a key b's token was handed to is still valid.
func (s *Server) tokenKeyValid(b *box) bool {
	b.mu.Lock()
	keys := make([]string, 0, len(b.tokenKeys))
	for k := range b.tokenKeys {
		keys = append(keys, k)
	}
	b.mu.Unlock()
	for _, k := range keys {
		if s.KeyValid == nil || (k != "" && s.KeyValid(k)) {
			return true
		}
	}
	return false
}

type boxKey struct{}

func (s *Server) serveEnvd(w http.ResponseWriter, r *http.Request) {
	id := r.Header.Get(SandboxHeader)
	b, err := s.box(id)
	if err == nil && auth.IsRemote(r.Context()) && auth.RemoteKey(r.Context()) == "" &&
		subtle.ConstantTimeCompare([]byte(r.Header.Get("X-Access-Token")), []byte(b.token)) != 1 {
		// Let in by a gone sandbox's token (TokenOK), and the id made again since.
		w.Header().Set("Connection", "close")
		writeJSON(w, 401, apiError{Code: 401, Message: "the access token is not this sandbox's: Sandbox.connect gets it"})
		return
	}
	if err == nil {
		b.mu.Lock()
		if b.paused != "" {
			err = fmt.Errorf("sandbox %s is paused: resume it with Sandbox.connect (POST /sandboxes/%s/connect): %w", id, id, errPaused)
		}
		b.mu.Unlock()
	}
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) || errors.Is(err, errPaused) {
			// E2B's edge answers 502 for a sandbox that is not running; the SDKs turn
			// it into "sandbox was not found or has timed out".
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(502)
			json.NewEncoder(w).Encode(apiError{Code: 502, Message: err.Error()})
			return
		}
		envdErr(w, err)
		return
	}
	s.envd.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), boxKey{}, b)))
}

var errPaused = errors.New("paused")

// pausing marks a box whose pause is under way: envd traffic is refused already, so
// that no new command holds the checkpoint back.
const pausing = "(pausing)"

// box is the record of sandbox id, made for sandboxes DeltaBox's own API created.
func (s *Server) box(id string) (*box, error) {
	created, image, err := s.m.Created(id)
	if err != nil {
		s.forget(id)
		return nil, err
	}
	s.mu.Lock()
	b := s.boxes[id]
	if b != nil && !b.started.Equal(created) { // removed, and the id made again since
		s.mu.Unlock()
		s.forget(id)
		s.mu.Lock()
		b = s.boxes[id]
	}
	defer s.mu.Unlock()
	if b == nil {
		var tok, traffic [16]byte
		rand.Read(tok[:]) // crypto/rand does not fail on Linux >= 3.17
		rand.Read(traffic[:])
		b = &box{id: id, template: image, started: created, token: hex.EncodeToString(tok[:]), traffic: hex.EncodeToString(traffic[:]),
			procs: map[uint32]*proc{}, nextPid: 1, tokenKeys: map[string]bool{}}
		s.boxes[id] = b
		delete(s.gone, id)
	}
	return b, nil
}

// maxGone bounds Server.gone.
const maxGone = 4096

func (s *Server) forget(id string) {
	s.mu.Lock()
	b := s.boxes[id]
	delete(s.boxes, id)
	if b != nil {
		for k := range s.gone {
			if len(s.gone) < maxGone {
				break
			}
			delete(s.gone, k)
		}
		s.gone[id] = b
	}
	s.mu.Unlock()
	if b != nil {
		b.endProcs()
		b.mu.Lock()
		if b.timer != nil {
			b.timer.Stop()
		}
		b.mu.Unlock()
	}
}

func boxOf(ctx context.Context) *box { return ctx.Value(boxKey{}).(*box) }

// userOf is the user an envd request runs as: Authorization: Basic NAME: (the SDKs'
// `user` option), else E2B's default.
func userOf(h http.Header) string {
	a := h.Get("Authorization")
	if v, ok := strings.CutPrefix(a, "Basic "); ok {
		if b, err := base64.StdEncoding.DecodeString(v); err == nil {
			if name, _, _ := strings.Cut(string(b), ":"); name != "" {
				return name
			}
		}
	}
	return DefaultUser
}

// apiError is E2B's error body.
type apiError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

// apiErr answers err as E2B's API does: {"code": status, "message": ...}.
func apiErr(w http.ResponseWriter, err error) {
	status, _ := errdefs.HTTPStatus(err)
	if errors.Is(err, errRangeNotSatisfiable) {
		status = http.StatusRequestedRangeNotSatisfiable
	}
	writeJSON(w, status, apiError{Code: status, Message: err.Error()})
}

// envdErr answers an envd HTTP route's error (the same body as the API's).
func envdErr(w http.ResponseWriter, err error) { apiErr(w, err) }

// connectErr maps err to a Connect error code.
func connectErr(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return err
	}
	code := connect.CodeInternal
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		code = connect.CodeNotFound
	case errors.Is(err, errdefs.ErrTooLarge):
		code = connect.CodeResourceExhausted
	case errors.Is(err, errdefs.ErrInvalid):
		code = connect.CodeInvalidArgument
	case errors.Is(err, errdefs.ErrConflict):
		code = connect.CodeFailedPrecondition
	case errors.Is(err, errdefs.ErrQuota):
		code = connect.CodeResourceExhausted
	case errors.Is(err, errdefs.ErrUnavailable):
		code = connect.CodeUnavailable
	case errors.Is(err, context.DeadlineExceeded):
		code = connect.CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		code = connect.CodeCanceled
	}
	return connect.NewError(code, err)
}
