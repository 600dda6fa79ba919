package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
)

// `deltabox bench net`: what the network proxy costs (docs/design/network.md). A server
// runs in a network namespace the bench makes (a veth from the host, as a real host is
// reached); the same python request loop runs inside a sandbox (through the proxy) and
// on the host (direct), and a sandbox's checkpoint is timed right after requests (a
// kept-alive connection the checkpoint resets) and after none.

// Systems and ops of the net bench.
const (
	SysNetProxy    = "proxy"     // a request from inside a sandbox, through the daemon's proxy
	SysNetDirect   = "direct"    // the same request from the host
	SysNetAfterNet = "after-net" // a checkpoint right after the session made requests
	SysNetNoNet    = "no-net"    // a checkpoint of the same session after a call without any
	NetOpRequest   = "request"
	NetOpCheckpt   = "checkpoint"
)

// NetOptions configures `deltabox bench net`.
type NetOptions struct {
	Requests int    `json:"requests"` // timed requests per system
	Samples  int    `json:"samples"`  // checkpoints per system
	Image    string `json:"image"`

	Notes   []string  `json:"-"`
	Command string    `json:"-"`
	Log     io.Writer `json:"-"`
}

// DefaultNetOptions are the bench's defaults.
func DefaultNetOptions() NetOptions { return NetOptions{Requests: 200, Samples: 20, Image: "default"} }

// Validate checks the options' ranges.
func (o NetOptions) Validate() error {
	if o.Requests < 1 || o.Samples < 1 {
		return fmt.Errorf("want requests and samples >= 1")
	}
	return nil
}

// netLoop times n GETs of http://ADDR/, each on a new connection (a client without
// keep-alive: every request pays the proxy's accept, peek, decision and dial), in ms.
const netLoop = `
import http.client, json, sys, time
def req(addr):
    c = http.client.HTTPConnection(addr, 80, timeout=10)
    c.request("GET", "/")
    b = c.getresponse().read()
    c.close()
    return b
def loop(addr, n):
    req(addr)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        req(addr)
        ts.append((time.perf_counter() - t0) * 1000)
    return json.dumps(ts)
`

// RunNet runs the bench on the daemon c talks to (as root: it makes a namespace).
func RunNet(ctx context.Context, c *client.Client, o NetOptions) (f *File, err error) {
	start := time.Now()
	f = &File{Bench: "net", Command: o.Command, Machine: CurrentMachine(), Started: start.UTC()}
	if err := o.Validate(); err != nil {
		return f, err
	}
	f.Notes = append(f.Notes, o.Notes...)
	if err := c.Health(ctx); err != nil {
		return f, err
	}
	settings, _ := json.Marshal(o)
	json.Unmarshal(settings, &f.Settings)
	defer func() {
		f.Finished = time.Now().UTC()
		f.DurationS = float64(int(time.Since(start).Seconds()*10)) / 10
		f.Machine.LoadAvgEnd = LoadAvg()
	}()
	logf := func(format string, a ...any) { progress(o.Log, start, format, a...) }

	addr, cleanup, err := netServer(ctx)
	defer cleanup()
	if err != nil {
		return f, err
	}
	f.Description = fmt.Sprintf("The network proxy (docs/design/network.md). A python HTTP server (`python3 -m http.server`) runs at %s in a "+
		"network namespace the bench makes, joined to the host by a veth. `%s/%s`: %d GETs of http://%s/, each on a new connection "+
		"(http.client), timed in python inside a sandbox allowed `%s/32`, through the daemon's proxy; `%s/%s`: the same loop run by "+
		"the host's python3. `%s/%s`: a checkpoint (client call) of a sandbox whose python session just made two requests on a "+
		"kept-alive connection (the checkpoint resets it, and the session's socket is replaced); `%s/%s`: a checkpoint of the same "+
		"session after a call that made none; %d of each, alternating.",
		addr, SysNetProxy, NetOpRequest, o.Requests, addr, addr, SysNetDirect, NetOpRequest, SysNetAfterNet, NetOpCheckpt,
		SysNetNoNet, NetOpCheckpt, o.Samples)
	id := "bench-net-" + randHex(3)
	logf("sandbox %s", id)
	if _, err := c.Create(ctx, apitypes.CreateOptions{ID: id, Image: o.Image, Network: &apitypes.Network{AllowOut: []string{addr + "/32"}}}); err != nil {
		return f, err
	}
	var nodes []string
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if e := c.Remove(cctx, id); e != nil {
			err = errors.Join(err, fmt.Errorf("cleanup: remove sandbox %s: %w", id, e))
		}
		for i := len(nodes) - 1; i >= 0; i-- {
			c.RemoveNode(cctx, nodes[i])
		}
	}()
	if _, err := c.StartSession(ctx, id, apitypes.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		return f, err
	}
	run := func(code string) (string, error) {
		res, err := c.Run(ctx, id, "py", code, 5*time.Minute)
		if err != nil {
			return "", err
		}
		if res.ExitCode != 0 {
			return "", fmt.Errorf("python session: exit %d: %s", res.ExitCode, strings.TrimSpace(res.Stdout))
		}
		return strings.TrimSpace(res.Stdout), nil
	}
	if _, err := run(netLoop); err != nil {
		return f, err
	}
	logf("%s: %d requests", SysNetProxy, o.Requests)
	out, err := run(fmt.Sprintf("print(loop(%q, %d))", addr, o.Requests))
	if err != nil {
		return f, err
	}
	var proxy, direct []float64
	if err := json.Unmarshal([]byte(out), &proxy); err != nil {
		return f, fmt.Errorf("the sandbox's loop answered %q: %w", out, err)
	}
	logf("%s: %d requests", SysNetDirect, o.Requests)
	hb, err := exec.CommandContext(ctx, "python3", "-c", netLoop+fmt.Sprintf("\nprint(loop(%q, %d))", addr, o.Requests)).Output()
	if err != nil {
		return f, fmt.Errorf("the host's loop: %w", err)
	}
	if err := json.Unmarshal(hb, &direct); err != nil {
		return f, fmt.Errorf("the host's loop answered %q: %w", hb, err)
	}

	if _, err := run(fmt.Sprintf("k = http.client.HTTPConnection(%q, 80, timeout=10)\n"+
		"def ka():\n    global k\n    for _ in range(2):\n        try:\n            k.request('GET', '/'); k.getresponse().read()\n"+
		"        except (OSError, http.client.HTTPException):\n            k.close(); k.request('GET', '/'); k.getresponse().read()", addr)); err != nil {
		return f, err
	}
	var after, none []float64
	var afterPh, nonePh []map[string]int64
	for i := 0; i < o.Samples; i++ {
		for _, sys := range []string{SysNetAfterNet, SysNetNoNet} {
			code := "x = 1"
			if sys == SysNetAfterNet {
				code = "ka()"
			}
			if _, err := run(code); err != nil {
				return f, err
			}
			t0 := time.Now()
			op, err := c.Checkpoint(ctx, id, "")
			d := ms(time.Since(t0))
			if err != nil {
				return f, fmt.Errorf("%s checkpoint: %w", sys, err)
			}
			nodes = append(nodes, op.Node.ID)
			if op.Processes != 1 || op.CRIUProcesses != 0 {
				return f, fmt.Errorf("%s checkpoint took %d processes, %d by CRIU (%v): want the session on the fast path", sys, op.Processes, op.CRIUProcesses, op.ProcessErrors)
			}
			if sys == SysNetAfterNet {
				after, afterPh = append(after, d), append(afterPh, op.PhasesUS)
			} else {
				none, nonePh = append(none, d), append(nonePh, op.PhasesUS)
			}
		}
	}
	ident := func(m map[string]int64) map[string]int64 { return m }
	rp := Summarize(proxy).Row(SysNetProxy, NetOpRequest, 0, "inside the sandbox: http.client GET http://"+addr+"/ on a new connection")
	rd := Summarize(direct).Row(SysNetDirect, NetOpRequest, 0, "on the host: http.client GET http://"+addr+"/ on a new connection")
	ra := Summarize(after).Row(SysNetAfterNet, NetOpCheckpt, 0, "client.Checkpoint(sandbox) after two requests on a kept-alive connection")
	rn := Summarize(none).Row(SysNetNoNet, NetOpCheckpt, 0, "client.Checkpoint(sandbox) after a call without requests")
	ra.Info = map[string]any{"phases_p50_us": phaseMedians(afterPh, ident)}
	rn.Info = map[string]any{"phases_p50_us": phaseMedians(nonePh, ident)}
	f.Results = []Row{rp, rd, ra, rn}
	return f, nil
}

// netServer makes a namespace joined to the host by a veth, with an HTTP server at an
// address of it; cleanup removes both (also after an error).
func netServer(ctx context.Context) (string, func(), error) {
	tag := randHex(2)
	ns, hostIf, inIf := "dbxbench"+tag, "dbxbh"+tag, "dbxbi"+tag
	b := []byte(tag)
	third := int(b[0])%64 + 10
	hostAddr, addr := fmt.Sprintf("100.127.%d.1", third), fmt.Sprintf("100.127.%d.2", third)
	var srv *exec.Cmd
	dir, err := os.MkdirTemp("", "deltabox-bench-net-")
	if err != nil {
		return "", func() {}, err
	}
	os.WriteFile(dir+"/index.html", []byte("ok\n"), 0o644)
	cleanup := func() {
		os.RemoveAll(dir)
		if srv != nil && srv.Process != nil {
			srv.Process.Kill()
			srv.Wait()
		}
		// Cleanup runs after ctx may have ended: its own deadline.
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		exec.CommandContext(cctx, "ip", "link", "del", hostIf).Run()
		exec.CommandContext(cctx, "ip", "netns", "del", ns).Run()
	}
	for _, args := range [][]string{
		{"netns", "add", ns},
		{"link", "add", hostIf, "type", "veth", "peer", "name", inIf, "netns", ns},
		{"addr", "add", hostAddr + "/24", "dev", hostIf},
		{"link", "set", hostIf, "up"},
		{"-n", ns, "link", "set", "lo", "up"},
		{"-n", ns, "addr", "add", addr + "/24", "dev", inIf},
		{"-n", ns, "link", "set", inIf, "up"},
	} {
		if out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput(); err != nil {
			return "", cleanup, fmt.Errorf("make the bench's server namespace (needs root and iproute2): ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	// Runs until cleanup kills it (or ctx ends).
	srv = exec.CommandContext(ctx, "ip", "netns", "exec", ns, "python3", "-m", "http.server", "80", "--bind", addr, "--directory", dir)
	if err := srv.Start(); err != nil {
		return "", cleanup, fmt.Errorf("start the bench's HTTP server: %w", err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := exec.CommandContext(pctx, "python3", "-c", netLoop+fmt.Sprintf("\nreq(%q)", addr)).Run()
		cancel()
		if err == nil {
			return addr, cleanup, nil
		}
		if time.Now().After(deadline) {
			return "", cleanup, fmt.Errorf("the bench's HTTP server at %s did not answer within 10 s", addr)
		}
	}
}
