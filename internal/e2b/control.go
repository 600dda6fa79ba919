package e2b

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"sort"
	"strings"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/errdefs"
	"deltabox/internal/state"
)

// maxControlBody caps a control-plane request's JSON body.
const maxControlBody = 1 << 20

// opWait is how long a pause, resume or snapshot queues behind the sandbox's running
// calls (file operations, execs that are not E2B commands) before it gives up (409).
const opWait = 30 * time.Second

// snapshotLabel marks the nodes made by POST /sandboxes/{id}/snapshots.
const snapshotLabel = "e2b-snapshot"

func (s *Server) controlRoutes() {
	h := s.control.HandleFunc
	h("POST /sandboxes", s.create)
	h("POST /v2/sandboxes", s.create)
	h("GET /sandboxes", s.list)
	h("GET /v2/sandboxes", s.list)
	h("GET /sandboxes/{id}", s.get)
	h("DELETE /sandboxes/{id}", s.kill)
	h("POST /sandboxes/{id}/timeout", s.setTimeout)
	h("POST /sandboxes/{id}/refreshes", s.refresh)
	h("POST /sandboxes/{id}/pause", s.pause)
	h("POST /sandboxes/{id}/resume", s.connect)
	h("POST /sandboxes/{id}/connect", s.connect)
	h("POST /v2/sandboxes/{id}/connect", s.connect)
	h("GET /sandboxes/{id}/metrics", s.metrics)
	h("POST /sandboxes/{id}/snapshots", s.snapshot)
	h("GET /snapshots", s.snapshots)
	h("DELETE /templates/{id}", s.deleteSnapshot)
	h("POST /sandboxes/{id}/fork", s.fork)
	h("/", func(w http.ResponseWriter, r *http.Request) {
		apiErr(w, fmt.Errorf("%s %s is not served by DeltaBox's E2B API (docs/API.md, E2B lists what is): %w", r.Method, r.URL.Path, errdefs.ErrNotFound))
	})
}

// decode reads a control-plane JSON body: unknown fields allowed (E2B's SDKs send
// options DeltaBox does not use).
func decode(w http.ResponseWriter, r *http.Request, v any) error {
	return api.DecodeBody(w, r, v, maxControlBody, false, "E2B's control-plane bodies are small JSON objects")
}

// newSandbox is the body of POST /sandboxes (fields DeltaBox uses; others are ignored,
// as E2B's API ignores what a plan does not offer).
type newSandbox struct {
	TemplateID string            `json:"templateID"`
	Timeout    *int64            `json:"timeout"` // seconds
	AutoPause  *bool             `json:"autoPause"`
	Metadata   map[string]string `json:"metadata"`
	EnvVars    map[string]string `json:"envVars"`
}

// sandboxRef is E2B's Sandbox: what create and connect answer.
type sandboxRef struct {
	TemplateID      string `json:"templateID"`
	SandboxID       string `json:"sandboxID"`
	ClientID        string `json:"clientID"`
	EnvdVersion     string `json:"envdVersion"`
	EnvdAccessToken string `json:"envdAccessToken"`
	// TrafficAccessToken opens the sandbox's ports (getHost) and nothing else.
	TrafficAccessToken string `json:"trafficAccessToken"`
}

// sandboxDetail is E2B's SandboxDetail and ListedSandbox.
type sandboxDetail struct {
	TemplateID      string            `json:"templateID"`
	SandboxID       string            `json:"sandboxID"`
	ClientID        string            `json:"clientID"`
	StartedAt       time.Time         `json:"startedAt"`
	EndAt           time.Time         `json:"endAt"`
	CPUCount        int               `json:"cpuCount"`
	MemoryMB        int64             `json:"memoryMB"`
	DiskSizeMB      int64             `json:"diskSizeMB"`
	Metadata        map[string]string `json:"metadata"`
	State           string            `json:"state"`
	EnvdVersion     string            `json:"envdVersion"`
	EnvdAccessToken string            `json:"envdAccessToken,omitempty"`
}

func (s *Server) ref(ctx context.Context, b *box) sandboxRef {
	tok := s.token(ctx, b)
	b.mu.Lock()
	defer b.mu.Unlock()
	return sandboxRef{TemplateID: b.template, SandboxID: b.id, ClientID: "deltabox", EnvdVersion: EnvdVersion, EnvdAccessToken: tok,
		TrafficAccessToken: b.traffic}
}

func (s *Server) detail(b *box, in *state.SandboxInfo) sandboxDetail {
	b.mu.Lock()
	defer b.mu.Unlock()
	d := sandboxDetail{TemplateID: b.template, SandboxID: b.id, ClientID: "deltabox", StartedAt: b.started, EndAt: b.endAt,
		Metadata: b.metadata, State: "running", EnvdVersion: EnvdVersion, DiskSizeMB: in.DiskMB}
	if d.Metadata == nil {
		d.Metadata = map[string]string{}
	}
	if b.paused != "" {
		d.State = "paused"
	}
	if d.EndAt.IsZero() {
		d.EndAt = d.StartedAt.Add(MaxTimeout * 365) // no timeout: DeltaBox's own sandboxes
	}
	d.CPUCount = runtime.NumCPU()
	if c := in.Limits.CPUs; c > 0 {
		d.CPUCount = int(c + 0.999)
	}
	d.MemoryMB = in.Limits.MemoryBytes >> 20
	return d
}

func timeoutOrDefault(t *int64) (time.Duration, error) {
	if t == nil {
		return DefaultTimeout, nil
	}
	d := time.Duration(*t) * time.Second
	if *t < 0 || d > MaxTimeout {
		return 0, fmt.Errorf("timeout %d s: want 0 to %d s: %w", *t, int64(MaxTimeout/time.Second), errdefs.ErrInvalid)
	}
	return d, nil
}

// setTimer makes b end (killed, or paused with autoPause) d from now.
func (s *Server) setTimer(b *box, d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.endAt = time.Now().Add(d).UTC()
	if b.timer != nil {
		b.timer.Stop()
	}
	b.timer = time.AfterFunc(d, func() { s.expire(b) })
}

func (s *Server) expire(b *box) {
	b.mu.Lock()
	pause, paused := b.autoPause, b.paused != ""
	b.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 2*opWait)
	defer cancel()
	if pause {
		if paused {
			return
		}
		if err := s.doPause(ctx, b); err == nil {
			s.log.Info("e2b: sandbox paused at its timeout", "sandbox", b.id)
			return
		} else {
			s.log.Warn("e2b: pause at the timeout failed; killing the sandbox", "sandbox", b.id, "err", err)
		}
	}
	s.forget(b.id)
	if err := s.m.Remove(b.id); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		s.log.Warn("e2b: kill at the timeout failed", "sandbox", b.id, "err", err)
		return
	}
	s.log.Info("e2b: sandbox killed at its timeout", "sandbox", b.id)
}

// templateOf resolves an E2B template: "base" (or none) is the default image, then an
// image name, then a node id.
func (s *Server) templateOf(t string) (image, node string, err error) {
	if t == "" || t == "base" {
		return s.image, "", nil
	}
	ims, err := s.m.Images()
	if err != nil {
		return "", "", err
	}
	for _, im := range ims {
		if im.Name == t {
			return t, "", nil
		}
	}
	n, err := s.m.Node(t)
	if err != nil {
		names := make([]string, 0, len(ims))
		for _, im := range ims {
			names = append(names, im.Name)
		}
		return "", "", fmt.Errorf("template %q is neither an image (%s; \"base\" is %s) nor a node or snapshot id: %w",
			t, strings.Join(names, ", "), s.image, errdefs.ErrNotFound)
	}
	return n.Image, n.ID, nil
}

func (s *Server) create(w http.ResponseWriter, r *http.Request) {
	var q newSandbox
	if err := decode(w, r, &q); err != nil {
		apiErr(w, err)
		return
	}
	timeout, err := timeoutOrDefault(q.Timeout)
	if err != nil {
		apiErr(w, err)
		return
	}
	b, err := s.createBox(r.Context(), q.TemplateID, q.Metadata, q.EnvVars)
	if err != nil {
		apiErr(w, err)
		return
	}
	b.mu.Lock()
	b.autoPause = q.AutoPause != nil && *q.AutoPause
	b.mu.Unlock()
	s.setTimer(b, timeout)
	writeJSON(w, 201, s.ref(r.Context(), b))
}

// createBox creates a sandbox from an E2B template with E2B's user in it.
func (s *Server) createBox(ctx context.Context, template string, meta, env map[string]string) (*box, error) {
	image, node, err := s.templateOf(template)
	if err != nil {
		return nil, err
	}
	// The request's end must not leave half a sandbox: the steps run to their end.
	ctx = context.WithoutCancel(ctx)
	in, err := s.m.Create(ctx, state.CreateOptions{Image: image, Workdir: DefaultHome})
	if err != nil {
		return nil, err
	}
	undo := func(err error) error {
		if rerr := s.m.Remove(in.ID); rerr != nil {
			return fmt.Errorf("%w (and removing the half-made sandbox %s failed: %v)", err, in.ID, rerr)
		}
		return err
	}
	if node != "" {
		if _, err := s.m.RestoreWith(ctx, in.ID, state.RestoreOptions{Node: node, Wait: opWait}); err != nil {
			return nil, undo(fmt.Errorf("start from snapshot %s: %w", node, err))
		}
	}
	if err := s.ensureUser(ctx, in.ID); err != nil {
		return nil, undo(fmt.Errorf("adding E2B's user %q: %w", DefaultUser, err))
	}
	b, err := s.box(in.ID)
	if err != nil {
		return nil, err
	}
	if template == "" {
		template = "base"
	}
	b.mu.Lock() // b is published already: a list or an envd call may read it
	b.template, b.metadata, b.env = template, meta, env
	b.mu.Unlock()
	return b, nil
}

func (s *Server) list(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	states := map[string]bool{}
	for _, st := range strings.Split(q.Get("state"), ",") {
		if st != "" {
			states[st] = true
		}
	}
	want := map[string]string{}
	if md := q.Get("metadata"); md != "" {
		for _, kv := range strings.Split(md, "&") {
			k, v, _ := strings.Cut(kv, "=")
			want[k] = v
		}
	}
	out := []sandboxDetail{}
	all := s.m.List()
	s.prune(all)
	for _, in := range all {
		b, err := s.box(in.ID)
		if err != nil {
			continue
		}
		d := s.detail(b, in)
		if len(states) > 0 && !states[d.State] {
			continue
		}
		ok := true
		for k, v := range want {
			if d.Metadata[k] != v {
				ok = false
			}
		}
		if ok {
			out = append(out, d)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].StartedAt.Before(out[j].StartedAt) })
	writeJSON(w, 200, out)
}

// prune forgets the boxes of sandboxes removed by DeltaBox's own API (live lists them
// all).
func (s *Server) prune(live []*state.SandboxInfo) {
	ids := map[string]bool{}
	for _, in := range live {
		ids[in.ID] = true
	}
	s.mu.Lock()
	var gone []string
	for id := range s.boxes {
		if !ids[id] {
			gone = append(gone, id)
		}
	}
	s.mu.Unlock()
	for _, id := range gone {
		if _, err := s.m.Get(id); errors.Is(err, errdefs.ErrNotFound) {
			s.forget(id)
		}
	}
}

func (s *Server) get(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	b, err := s.box(id)
	if err != nil {
		apiErr(w, err)
		return
	}
	in, err := s.m.Get(id)
	if err != nil {
		apiErr(w, err)
		return
	}
	d := s.detail(b, in)
	d.EnvdAccessToken = s.token(r.Context(), b)
	writeJSON(w, 200, d)
}

func (s *Server) kill(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if _, err := s.m.Get(id); err != nil {
		apiErr(w, err)
		return
	}
	s.forget(id)
	if err := s.m.Remove(id); err != nil {
		apiErr(w, err)
		return
	}
	w.WriteHeader(204)
}

func (s *Server) setTimeout(w http.ResponseWriter, r *http.Request) {
	var q struct {
		Timeout *int64 `json:"timeout"`
	}
	if err := decode(w, r, &q); err != nil {
		apiErr(w, err)
		return
	}
	if q.Timeout == nil {
		apiErr(w, fmt.Errorf(`timeout needs {"timeout": SECONDS}: %w`, errdefs.ErrInvalid))
		return
	}
	s.retime(w, r, q.Timeout)
}

// retime sets the sandbox's timer to secs (timeoutOrDefault's rules) and answers 204:
// setTimeout and refresh.
func (s *Server) retime(w http.ResponseWriter, r *http.Request, secs *int64) {
	d, err := timeoutOrDefault(secs)
	if err != nil {
		apiErr(w, err)
		return
	}
	b, err := s.box(r.PathValue("id"))
	if err != nil {
		apiErr(w, err)
		return
	}
	s.setTimer(b, d)
	w.WriteHeader(204)
}

func (s *Server) refresh(w http.ResponseWriter, r *http.Request) {
	var q struct {
		Duration *int64 `json:"duration"`
	}
	if err := decode(w, r, &q); err != nil {
		apiErr(w, err)
		return
	}
	s.retime(w, r, q.Duration)
}

// doPause ends b's E2B commands (an exec cannot span a checkpoint; what they started
// in the background stays), checkpoints the sandbox and marks it paused.
func (s *Server) doPause(ctx context.Context, b *box) error {
	b.opMu.Lock()
	defer b.opMu.Unlock()
	b.mu.Lock()
	if b.paused != "" {
		b.mu.Unlock()
		return fmt.Errorf("sandbox %s is already paused: %w", b.id, errdefs.ErrConflict)
	}
	b.paused = pausing
	b.mu.Unlock()
	b.endProcs()
	res, err := s.checkpoint(ctx, b.id, "e2b-pause")
	b.mu.Lock()
	defer b.mu.Unlock()
	if err != nil {
		b.paused = ""
		return err
	}
	b.paused = res.Node.ID
	return nil
}

// checkpoint checkpoints sandbox id with its processes (the fast path's templates, CRIU
// trees for what it refuses); if a process can be carried by neither (409), it checkpoints
// again ending those, as E2B's pause never refuses for a process. EndBackground is not
// asked for at once: with it the processes CRIU would carry are ended too.
func (s *Server) checkpoint(ctx context.Context, id, label string) (*state.OpResult, error) {
	res, err := s.m.CheckpointWith(ctx, id, state.CheckpointOptions{Label: label, Wait: opWait})
	if errors.Is(err, errdefs.ErrConflict) {
		s.log.Info("e2b: checkpoint again, ending the processes it cannot carry", "sandbox", id, "err", err)
		res, err = s.m.CheckpointWith(ctx, id, state.CheckpointOptions{Label: label, Wait: opWait, EndBackground: true})
	}
	return res, err
}

func (s *Server) pause(w http.ResponseWriter, r *http.Request) {
	b, err := s.box(r.PathValue("id"))
	if err != nil {
		apiErr(w, err)
		return
	}
	if err := s.doPause(context.WithoutCancel(r.Context()), b); err != nil {
		apiErr(w, err)
		return
	}
	w.WriteHeader(204)
}

// connect answers a running sandbox's access (200) or resumes a paused one (201): a
// restore of the node its pause made, so it continues from that state.
func (s *Server) connect(w http.ResponseWriter, r *http.Request) {
	var q struct {
		Timeout   *int64 `json:"timeout"`
		AutoPause *bool  `json:"autoPause"`
	}
	if err := decode(w, r, &q); err != nil {
		apiErr(w, err)
		return
	}
	b, err := s.box(r.PathValue("id"))
	if err != nil {
		apiErr(w, err)
		return
	}
	status := 200
	b.opMu.Lock()
	defer b.opMu.Unlock()
	b.mu.Lock()
	node := b.paused
	b.mu.Unlock()
	if node != "" {
		if _, err := s.m.RestoreWith(context.WithoutCancel(r.Context()), b.id, state.RestoreOptions{Node: node, Wait: opWait}); err != nil {
			apiErr(w, fmt.Errorf("resume: restore of the pause's checkpoint %s: %w", node, err))
			return
		}
		b.mu.Lock()
		b.paused = ""
		if q.AutoPause != nil {
			b.autoPause = *q.AutoPause
		}
		b.mu.Unlock()
		status = 201
	} else if strings.HasSuffix(r.URL.Path, "/resume") {
		apiErr(w, fmt.Errorf("sandbox %s is not paused: %w", b.id, errdefs.ErrConflict))
		return
	}
	if q.Timeout != nil || status == 201 {
		d, err := timeoutOrDefault(q.Timeout)
		if err != nil {
			apiErr(w, err)
			return
		}
		b.mu.Lock()
		later := time.Now().Add(d).After(b.endAt)
		b.mu.Unlock()
		if later || status == 201 {
			s.setTimer(b, d)
		}
	}
	writeJSON(w, status, s.ref(r.Context(), b))
}

// metric is E2B's SandboxMetric: one sample, now (DeltaBox keeps no history).
type metric struct {
	Timestamp  time.Time `json:"timestamp"`
	CPUCount   int       `json:"cpuCount"`
	CPUUsedPct float64   `json:"cpuUsedPct"`
	MemUsed    int64     `json:"memUsed"`
	MemTotal   int64     `json:"memTotal"`
	DiskUsed   int64     `json:"diskUsed"`
	DiskTotal  int64     `json:"diskTotal"`
}

func (s *Server) metrics(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	b, err := s.box(id)
	if err != nil {
		apiErr(w, err)
		return
	}
	in, err := s.m.Get(id)
	if err != nil {
		apiErr(w, err)
		return
	}
	d := s.detail(b, in)
	m := metric{Timestamp: time.Now().UTC(), CPUCount: d.CPUCount, MemTotal: in.Limits.MemoryBytes, DiskTotal: in.DiskMB << 20}
	if u := in.Usage; u != nil {
		m.MemUsed = u.MemoryBytes
		// Average use since the start (DeltaBox keeps no window of samples).
		if el := time.Since(b.started); el > 0 && d.CPUCount > 0 {
			m.CPUUsedPct = 100 * float64(u.CPUNanos) / float64(el.Nanoseconds()) / float64(d.CPUCount)
		}
	}
	if in.Disk != nil {
		m.DiskUsed = in.Disk.UpperBytes
	}
	writeJSON(w, 200, []metric{m})
}

// snapshotInfo is E2B's SnapshotInfo.
type snapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

// snapshot checkpoints the sandbox (it runs on): the node is the snapshot, a template
// to create from.
func (s *Server) snapshot(w http.ResponseWriter, r *http.Request) {
	var q struct {
		Name string `json:"name"`
	}
	if err := decode(w, r, &q); err != nil {
		apiErr(w, err)
		return
	}
	b, err := s.box(r.PathValue("id"))
	if err != nil {
		apiErr(w, err)
		return
	}
	label := snapshotLabel
	if q.Name != "" {
		label += ":" + q.Name
	}
	b.opMu.Lock()
	defer b.opMu.Unlock()
	res, err := s.checkpoint(context.WithoutCancel(r.Context()), b.id, label)
	if err != nil {
		apiErr(w, err)
		return
	}
	out := snapshotInfo{SnapshotID: res.Node.ID, Names: []string{}}
	if q.Name != "" {
		out.Names = append(out.Names, q.Name)
	}
	writeJSON(w, 201, out)
}

func (s *Server) snapshots(w http.ResponseWriter, r *http.Request) {
	sb := r.URL.Query().Get("sandboxID")
	out := []snapshotInfo{}
	for _, n := range s.m.Tree().Nodes {
		name, ok := strings.CutPrefix(n.Label, snapshotLabel)
		if !ok || (sb != "" && n.Sandbox != sb) {
			continue
		}
		si := snapshotInfo{SnapshotID: n.ID, Names: []string{}}
		if name, ok := strings.CutPrefix(name, ":"); ok {
			si.Names = append(si.Names, name)
		}
		out = append(out, si)
	}
	writeJSON(w, 200, out)
}

func (s *Server) deleteSnapshot(w http.ResponseWriter, r *http.Request) {
	if _, err := s.m.RemoveNode(r.PathValue("id")); err != nil {
		apiErr(w, err)
		return
	}
	w.WriteHeader(204)
}

// forkResult is one element of the fork's answer.
type forkResult struct {
	Sandbox *sandboxRef `json:"sandbox,omitempty"`
	Error   *apiError   `json:"error,omitempty"`
}

// fork checkpoints the sandbox in place and forks count sandboxes from that node, each
// with the node's files and its processes where a path carries them (state.Manager.Fork:
// the node's durable image restored into each branch; else its files, and the branch's
// fork_of and stats say why).
func (s *Server) fork(w http.ResponseWriter, r *http.Request) {
	var q struct {
		Timeout *int64 `json:"timeout"`
		Count   int    `json:"count"`
	}
	if err := decode(w, r, &q); err != nil {
		apiErr(w, err)
		return
	}
	if q.Count == 0 {
		q.Count = 1
	}
	if q.Count < 1 || q.Count > 64 {
		apiErr(w, fmt.Errorf("count %d: want 1 to 64: %w", q.Count, errdefs.ErrInvalid))
		return
	}
	timeout, err := timeoutOrDefault(q.Timeout)
	if err != nil {
		apiErr(w, err)
		return
	}
	b, err := s.box(r.PathValue("id"))
	if err != nil {
		apiErr(w, err)
		return
	}
	ctx := context.WithoutCancel(r.Context())
	b.opMu.Lock()
	res, err := s.checkpoint(ctx, b.id, "e2b-fork")
	b.opMu.Unlock()
	if err != nil {
		apiErr(w, err)
		return
	}
	fr, err := s.m.Fork(ctx, res.Node.ID, state.ForkOptions{Count: q.Count, CreateOptions: state.CreateOptions{Workdir: DefaultHome}})
	if err != nil {
		apiErr(w, err)
		return
	}
	b.mu.Lock()
	meta, env, template := b.metadata, b.env, b.template
	b.mu.Unlock()
	out := make([]forkResult, len(fr.Branches))
	for i, br := range fr.Branches {
		nb, err := s.box(br.Sandbox.ID)
		if err != nil {
			st, _ := errdefs.HTTPStatus(err)
			out[i].Error = &apiError{Code: st, Message: err.Error()}
			continue
		}
		nb.mu.Lock()
		nb.template, nb.metadata, nb.env = template, meta, env
		nb.mu.Unlock()
		s.setTimer(nb, timeout)
		ref := s.ref(r.Context(), nb)
		out[i].Sandbox = &ref
	}
	writeJSON(w, 200, out)
}
