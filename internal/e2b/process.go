package e2b

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"deltabox/internal/e2b/spec/process"
	"deltabox/internal/sandbox"
)

// outputLimit is a command's output kept per stream (sandbox.capture): the first
// quarter (1 MiB, what a native exec returns of a stream by default) streams live, the
// rest (its last 3 MiB) is sent when the command ends. A sandbox holds up to maxProcs
// commands, ended ones for keepEnded, so this is per command what 256 of them may hold:
// 2 GiB a sandbox at worst (at 64 MiB it was 32 GiB).
const outputLimit = 4 << 20

// sendTimeout is how long a command's output waits for a slow stream before that
// stream is dropped (the command and the other streams go on).
const sendTimeout = 30 * time.Second

// keepEnded is how long an ended command stays for a late Connect (envd keeps its exit
// for the same purpose).
const keepEnded = 60 * time.Second

// stdinWait bounds a SendInput or a StreamInput chunk: a command that does not read its
// stdin would otherwise hold the call forever (io.Pipe's Write returns once the reader
// has taken every byte).
const stdinWait = 30 * time.Second

// killGrace is how much later than a request's Connect-Timeout-Ms a command is killed:
// the client's own deadline fires first, so the SDK reports a timeout
// (TimeoutError), not the kill's exit status.
const killGrace = 250 * time.Millisecond

// proc is one command started through process.Start.
type proc struct {
	pid    uint32
	tag    *string
	cfg    *process.ProcessConfig
	cancel context.CancelFunc
	stdin  *io.PipeWriter // nil: started without stdin
	// stdinBusy holds the one write to stdin under way: a write that timed out goes
	// on in its goroutine (until the command reads, or ends and the pipe closes), and
	// the next waits behind it rather than starting another goroutine.
	stdinBusy chan struct{}
	done      chan struct{} // closed once end is set

	mu sync.Mutex // protects subs and end
	// +checklocks:mu
	subs map[*sub]bool
	// +checklocks:mu
	end *process.ProcessEvent_EndEvent
}

// sub is one stream attached to a command.
type sub struct {
	ch      chan *process.ProcessEvent
	dropped chan struct{} // closed when the stream fell sendTimeout behind
}

func (p *proc) subscribe() *sub {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := &sub{ch: make(chan *process.ProcessEvent, 64), dropped: make(chan struct{})}
	p.subs[s] = true
	return s
}

func (p *proc) unsubscribe(s *sub) {
	p.mu.Lock()
	delete(p.subs, s)
	p.mu.Unlock()
}

// publish hands ev to every attached stream; one that does not take it within
// sendTimeout is dropped. Called from the exec's output goroutines (two at once).
func (p *proc) publish(ev *process.ProcessEvent) {
	p.mu.Lock()
	subs := make([]*sub, 0, len(p.subs))
	for s := range p.subs {
		subs = append(subs, s)
	}
	p.mu.Unlock()
	for _, s := range subs {
		select {
		case s.ch <- ev:
			continue
		default:
		}
		t := time.NewTimer(sendTimeout)
		select {
		case s.ch <- ev:
		case <-t.C:
			p.mu.Lock()
			if p.subs[s] {
				delete(p.subs, s)
				close(s.dropped)
			}
			p.mu.Unlock()
		}
		t.Stop()
	}
}

func (b *box) findProc(sel *process.ProcessSelector) (*proc, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch v := sel.GetSelector().(type) {
	case *process.ProcessSelector_Pid:
		if p := b.procs[v.Pid]; p != nil {
			return p, nil
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", v.Pid))
	case *process.ProcessSelector_Tag:
		for _, p := range b.procs {
			if p.tag != nil && *p.tag == v.Tag {
				return p, nil
			}
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with tag %q not found", v.Tag))
	}
	return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("a process selector (pid or tag) is required"))
}

// endProcs kills the box's running commands and waits for them to end (each for
// 15 s at most: sandbox.Exec's kill waits up to 10 s).
func (b *box) endProcs() {
	b.mu.Lock()
	var ps []*proc
	for _, p := range b.procs {
		ps = append(ps, p)
	}
	b.mu.Unlock()
	for _, p := range ps {
		p.cancel()
	}
	for _, p := range ps {
		select {
		case <-p.done:
		case <-time.After(15 * time.Second):
		}
	}
}

type processService struct{ s *Server }

func (ps *processService) List(ctx context.Context, req *connect.Request[process.ListRequest]) (*connect.Response[process.ListResponse], error) {
	b := boxOf(ctx)
	b.mu.Lock()
	defer b.mu.Unlock()
	out := &process.ListResponse{}
	for _, p := range b.procs {
		select {
		case <-p.done:
			continue
		default:
		}
		out.Processes = append(out.Processes, &process.ProcessInfo{Config: p.cfg, Pid: p.pid, Tag: p.tag})
	}
	sort.Slice(out.Processes, func(i, j int) bool { return out.Processes[i].Pid < out.Processes[j].Pid })
	return connect.NewResponse(out), nil
}

func (ps *processService) Start(ctx context.Context, req *connect.Request[process.StartRequest], stream *connect.ServerStream[process.StartResponse]) error {
	s, b, msg := ps.s, boxOf(ctx), req.Msg
	if msg.Pty != nil {
		return connect.NewError(connect.CodeUnimplemented, errors.New("PTY is not served by DeltaBox's envd: run the command without a terminal (commands.run), or use a DeltaBox session (docs/API.md, E2B)"))
	}
	cfg := msg.GetProcess()
	if cfg == nil || cfg.Cmd == "" {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("process.cmd is required"))
	}
	timeout, err := timeoutOf(req.Header())
	if err != nil {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	user := userOf(req.Header())
	home, err := s.homeOf(ctx, b.id, user)
	if err != nil {
		return connectErr(err)
	}
	dir := home
	if cfg.Cwd != nil && *cfg.Cwd != "" {
		dir = *cfg.Cwd
		if !path.IsAbs(dir) {
			dir = path.Join(home, dir)
		}
	}
	var env []string
	b.mu.Lock()
	for k, v := range b.env {
		env = append(env, k+"="+v)
	}
	b.mu.Unlock()
	for k, v := range cfg.Envs {
		env = append(env, k+"="+v)
	}
	pctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	p := &proc{tag: msg.Tag, cfg: cfg, cancel: cancel, done: make(chan struct{}), subs: map[*sub]bool{}, stdinBusy: make(chan struct{}, 1)}
	var stdinR *io.PipeReader
	if msg.Stdin == nil || *msg.Stdin { // envd: absent means on (older SDKs)
		stdinR, p.stdin = io.Pipe()
	}
	b.mu.Lock()
	if len(b.procs) >= maxProcs {
		b.mu.Unlock()
		cancel()
		return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("sandbox %s holds %d commands, its limit: kill some (commands.kill) or wait for them to end", b.id, maxProcs))
	}
	p.pid = b.nextPid
	b.nextPid++
	b.procs[p.pid] = p
	b.mu.Unlock()
	sb := p.subscribe()
	defer p.unsubscribe(sb)

	er := sandbox.ExecRequest{Argv: append([]string{cfg.Cmd}, cfg.Args...), Env: env, Dir: dir, User: user, OutputLimit: outputLimit}
	if timeout > 0 {
		er.Timeout = timeout + killGrace
	}
	if stdinR != nil {
		er.StdinReader = stdinR
	}
	er.OnOutput = func(stream string, data []byte) {
		d := &process.ProcessEvent_DataEvent{}
		c := append([]byte(nil), data...)
		if stream == "stderr" {
			d.Output = &process.ProcessEvent_DataEvent_Stderr{Stderr: c}
		} else {
			d.Output = &process.ProcessEvent_DataEvent_Stdout{Stdout: c}
		}
		p.publish(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: d}})
	}
	if err := stream.Send(&process.StartResponse{Event: startEvent(p.pid)}); err != nil {
		cancel()
		b.dropProc(p)
		return err
	}
	go s.run(b, p, pctx, er, stdinR)
	return ps.follow(ctx, req.Header(), p, sb, func(ev *process.ProcessEvent) error {
		return stream.Send(&process.StartResponse{Event: ev})
	})
}

// run runs p to its end and keeps its exit for keepEnded.
func (s *Server) run(b *box, p *proc, ctx context.Context, er sandbox.ExecRequest, stdinR *io.PipeReader) {
	defer p.cancel()
	res, err := s.m.Exec(ctx, b.id, er)
	if stdinR != nil {
		stdinR.Close() // ends the exec's stdin goroutine, blocked in Read
	}
	end := &process.ProcessEvent_EndEvent{}
	switch {
	case err != nil:
		end.ExitCode, end.Status = -1, "error"
		msg := err.Error()
		end.Error = &msg
	case res.Signal != 0:
		end.ExitCode, end.Status = -1, "signal: "+signalName(res.Signal)
	default:
		end.ExitCode, end.Exited, end.Status = int32(res.ExitCode), true, "exit status "+strconv.Itoa(res.ExitCode)
	}
	p.mu.Lock()
	p.end = end
	p.mu.Unlock()
	close(p.done)
	time.AfterFunc(keepEnded, func() { b.dropProc(p) })
}

func (b *box) dropProc(p *proc) {
	b.mu.Lock()
	if b.procs[p.pid] == p {
		delete(b.procs, p.pid)
	}
	b.mu.Unlock()
}

func signalName(n int) string {
	switch n {
	case 9:
		return "killed"
	case 15:
		return "terminated"
	}
	return "signal " + strconv.Itoa(n)
}

func startEvent(pid uint32) *process.ProcessEvent {
	return &process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: pid}}}
}

// follow sends p's events to one stream until p ends (then its end event), the
// client goes away, or the stream falls behind; idle, it sends keepalives at the
// interval the client asked for (Keepalive-Ping-Interval, seconds).
func (ps *processService) follow(ctx context.Context, h http.Header, p *proc, sb *sub, send func(*process.ProcessEvent) error) error {
	ka := keepaliveOf(h, 50*time.Second)
	tick := time.NewTicker(ka)
	defer tick.Stop()
	for {
		select {
		case ev := <-sb.ch:
			if err := send(ev); err != nil {
				return err
			}
			tick.Reset(ka)
		case <-p.done:
			for {
				select {
				case ev := <-sb.ch:
					if err := send(ev); err != nil {
						return err
					}
					continue
				default:
				}
				break
			}
			p.mu.Lock()
			end := p.end
			p.mu.Unlock()
			return send(&process.ProcessEvent{Event: &process.ProcessEvent_End{End: end}})
		case <-sb.dropped:
			return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("this stream fell %v behind the command's output and was dropped; the command goes on (commands.connect to follow it again)", sendTimeout))
		case <-tick.C:
			if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Keepalive{Keepalive: &process.ProcessEvent_KeepAlive{}}}); err != nil {
				return err
			}
		case <-ctx.Done():
			return connectErr(ctx.Err())
		}
	}
}

func (ps *processService) Connect(ctx context.Context, req *connect.Request[process.ConnectRequest], stream *connect.ServerStream[process.ConnectResponse]) error {
	p, err := boxOf(ctx).findProc(req.Msg.GetProcess())
	if err != nil {
		return err
	}
	sb := p.subscribe()
	defer p.unsubscribe(sb)
	if err := stream.Send(&process.ConnectResponse{Event: startEvent(p.pid)}); err != nil {
		return err
	}
	return ps.follow(ctx, req.Header(), p, sb, func(ev *process.ProcessEvent) error {
		return stream.Send(&process.ConnectResponse{Event: ev})
	})
}

func (ps *processService) Update(ctx context.Context, req *connect.Request[process.UpdateRequest]) (*connect.Response[process.UpdateResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errors.New("resizing a PTY: DeltaBox's envd serves no PTY"))
}

func (ps *processService) StreamInput(ctx context.Context, st *connect.ClientStream[process.StreamInputRequest]) (*connect.Response[process.StreamInputResponse], error) {
	var p *proc
	for st.Receive() {
		switch ev := st.Msg().GetEvent().(type) {
		case *process.StreamInputRequest_Start:
			q, err := boxOf(ctx).findProc(ev.Start.GetProcess())
			if err != nil {
				return nil, err
			}
			p = q
		case *process.StreamInputRequest_Data:
			if p == nil {
				return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("stream input: a start event naming the process must come first"))
			}
			if err := p.write(ctx, ev.Data.GetInput()); err != nil {
				return nil, err
			}
		}
	}
	if err := st.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&process.StreamInputResponse{}), nil
}

// write sends input to p's stdin, waiting until the command has read it, it ends, ctx
// ends, or stdinWait passes (DeadlineExceeded: the input stays queued, written as the
// command reads, and later input waits behind it).
func (p *proc) write(ctx context.Context, in *process.ProcessInput) error {
	if in.GetPty() != nil {
		return connect.NewError(connect.CodeUnimplemented, errors.New("PTY input: DeltaBox's envd serves no PTY"))
	}
	if p.stdin == nil {
		return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d was started without stdin: start it with stdin: true", p.pid))
	}
	ended := connect.NewError(connect.CodeNotFound, fmt.Errorf("process %d has ended", p.pid))
	select {
	case <-p.done:
		return ended
	default:
	}
	t := time.NewTimer(stdinWait)
	defer t.Stop()
	late := connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("process %d has not read its stdin for %v: the input is queued and written as it reads; send more once it does, or close its stdin (commands.closeStdin)", p.pid, stdinWait))
	select { // the write before this one still under way
	case p.stdinBusy <- struct{}{}:
	case <-p.done:
		return ended
	case <-ctx.Done():
		return connectErr(ctx.Err())
	case <-t.C:
		return late
	}
	errc := make(chan error, 1)
	data := in.GetStdin()
	go func() {
		_, err := p.stdin.Write(data) // ends at the latest when run closes the pipe's reader
		<-p.stdinBusy
		errc <- err
	}()
	select {
	case err := <-errc:
		if err != nil {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d: stdin: %v", p.pid, err))
		}
		return nil
	case <-p.done:
		return ended
	case <-ctx.Done():
		return connectErr(ctx.Err())
	case <-t.C:
		return late
	}
}

func (ps *processService) SendInput(ctx context.Context, req *connect.Request[process.SendInputRequest]) (*connect.Response[process.SendInputResponse], error) {
	p, err := boxOf(ctx).findProc(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.write(ctx, req.Msg.GetInput()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&process.SendInputResponse{}), nil
}

func (ps *processService) CloseStdin(ctx context.Context, req *connect.Request[process.CloseStdinRequest]) (*connect.Response[process.CloseStdinResponse], error) {
	p, err := boxOf(ctx).findProc(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if p.stdin == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d was started without stdin", p.pid))
	}
	p.stdin.Close()
	return connect.NewResponse(&process.CloseStdinResponse{}), nil
}

// SendSignal ends the command: SIGTERM and SIGKILL both kill its process group with
// SIGKILL (a DeltaBox exec ends only so).
func (ps *processService) SendSignal(ctx context.Context, req *connect.Request[process.SendSignalRequest]) (*connect.Response[process.SendSignalResponse], error) {
	p, err := boxOf(ctx).findProc(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	switch req.Msg.Signal {
	case process.Signal_SIGNAL_SIGKILL, process.Signal_SIGNAL_SIGTERM:
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("signal %v: want SIGKILL or SIGTERM", req.Msg.Signal))
	}
	select {
	case <-p.done:
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process %d has ended", p.pid))
	default:
	}
	p.cancel()
	return connect.NewResponse(&process.SendSignalResponse{}), nil
}

// keepaliveOf is the request's Keepalive-Ping-Interval (seconds), within 1 s and 1 h
// (a larger number would overflow time.Duration, and a ticker panics on a period <= 0);
// def when absent or not a number.
func keepaliveOf(h http.Header, def time.Duration) time.Duration {
	v, err := strconv.ParseInt(strings.TrimSpace(h.Get("Keepalive-Ping-Interval")), 10, 64)
	if err != nil {
		return def
	}
	return time.Duration(min(max(v, 1), 3600)) * time.Second
}

// timeoutOf is the request's Connect-Timeout-Ms (0: none), which envd makes the
// command's own timeout.
func timeoutOf(h http.Header) (time.Duration, error) {
	v := h.Get("Connect-Timeout-Ms")
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("Connect-Timeout-Ms %q: want milliseconds >= 0", v)
	}
	return time.Duration(n) * time.Millisecond, nil
}
