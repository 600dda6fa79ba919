package e2e

// What an exec tells its caller, byte for byte (issue 16): the kept output is the
// head and the tail with a count of what was dropped between them; output and stdin
// are bytes end to end (encoding "base64"); a streamed answer does not repeat its
// output in its result; the CLI prints every marker on stderr and exits with a
// documented code (124 timeout, 130 interrupted, 125 its own failure); a client that
// goes away interrupts its call, a session's included; a call has a default timeout.
// Helpers of this file are prefixed trx.

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/client"
	"deltabox/internal/testutil"
)

// trxCLI runs the built binary against d with stdin and returns its stdout, its
// stderr and its exit code.
func trxCLI(t *testing.T, d *testutil.Daemon, stdin []byte, args ...string) (stdout, stderr []byte, code int) {
	t.Helper()
	cmd := testutil.Command(t, 3*time.Minute, testutil.Binary(t), append([]string{"--socket", d.Socket}, args...)...)
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		code = ee.ExitCode()
	default:
		t.Fatalf("deltabox %q: %v\nstderr: %s", args, err, e.Bytes())
	}
	return o.Bytes(), e.Bytes(), code
}

// trxEvents splits an NDJSON answer into its events.
func trxEvents(t *testing.T, body []byte) []map[string]any {
	t.Helper()
	var out []map[string]any
	dec := json.NewDecoder(bytes.NewReader(body))
	for {
		var ev map[string]any
		if err := dec.Decode(&ev); err == io.EOF {
			return out
		} else if err != nil {
			t.Fatalf("bad NDJSON answer: %v: %.300q", err, body)
		}
		out = append(out, ev)
	}
}

var trxMarkerRE = regexp.MustCompile(`\[deltabox: (\d+) bytes of (stdout|stderr) dropped\]`)

// TestExecKeepsHeadAndTail: over output_limit, the answer keeps the first quarter and
// the last three quarters of the limit, with a marker in between that counts the
// bytes dropped; a streamed answer sends the same bytes as events (the head live, the
// marker as an event of its own, the tail at the end) and its result does not repeat
// them. (On main the head alone was kept, so the last line was lost, and a streamed
// result repeated the whole output.)
func TestExecKeepsHeadAndTail(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "").ID
	const limit = 4000
	// 10000 numbered lines of 10 bytes on stdout, 5000 on stderr, then END on both.
	script := `for i in $(seq -w 0 9999); do echo "line-$i"; done; for i in $(seq -w 0 4999); do echo "errl-$i" >&2; done; echo END; echo END >&2`
	var fullOut, fullErr strings.Builder
	for i := 0; i < 10000; i++ {
		fmt.Fprintf(&fullOut, "line-%04d\n", i)
	}
	for i := 0; i < 5000; i++ {
		fmt.Fprintf(&fullErr, "errl-%04d\n", i)
	}
	fullOut.WriteString("END\n")
	fullErr.WriteString("END\n")
	want := func(full, name string) (string, int) {
		head, tail := full[:limit/4], full[len(full)-(limit-limit/4):]
		dropped := len(full) - limit
		return head + fmt.Sprintf("\n[deltabox: %d bytes of %s dropped]\n", dropped, name) + tail, dropped
	}
	wantOut, outDropped := want(fullOut.String(), "stdout")
	wantErr, errDropped := want(fullErr.String(), "stderr")

	t.Run("Whole", func(t *testing.T) {
		res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", script}, OutputLimit: limit})
		if res.Stdout != wantOut {
			t.Errorf("stdout:\n%q\nwant head, marker, tail:\n%q", res.Stdout, wantOut)
		}
		if res.Stderr != wantErr {
			t.Errorf("stderr:\n%q\nwant:\n%q", res.Stderr, wantErr)
		}
		if !res.StdoutTruncated || !res.StderrTruncated || res.StdoutDropped != int64(outDropped) || res.StderrDropped != int64(errDropped) {
			t.Errorf("flags %v %v, dropped %d %d; want true, true, %d, %d", res.StdoutTruncated, res.StderrTruncated,
				res.StdoutDropped, res.StderrDropped, outDropped, errDropped)
		}
	})

	t.Run("Streamed", func(t *testing.T) {
		body, _ := json.Marshal(map[string]any{"argv": []string{"bash", "-c", script}, "output_limit": limit, "stream": true})
		st, b := dbxRaw(t, d, "POST", "/sandboxes/"+id+"/exec", string(body))
		if st != 200 {
			t.Fatalf("status %d: %s", st, b)
		}
		var got = map[string]*strings.Builder{"stdout": {}, "stderr": {}}
		var result map[string]any
		markers := 0
		for _, ev := range trxEvents(t, b) {
			switch ev["type"] {
			case "stdout", "stderr":
				data, _ := ev["data"].(string)
				got[ev["type"].(string)].WriteString(data)
				if ev["marker"] != nil {
					markers++
					m := trxMarkerRE.FindStringSubmatch(data)
					if ev["marker"] != "dropped" || m == nil || m[2] != ev["type"] || m[1] != fmt.Sprint(ev["dropped"]) {
						t.Errorf("marker event %v: want marker \"dropped\" with its count in dropped and in the text", ev)
					}
				}
			case "result":
				result, _ = ev["result"].(map[string]any)
			default:
				t.Errorf("event %v", ev)
			}
		}
		if got["stdout"].String() != wantOut || got["stderr"].String() != wantErr {
			t.Errorf("streamed stdout:\n%q\nstderr:\n%q\nwant what a whole answer holds:\n%q\n%q", got["stdout"], got["stderr"], wantOut, wantErr)
		}
		if markers != 2 {
			t.Errorf("%d marker events, want 2", markers)
		}
		if result == nil {
			t.Fatalf("no result event")
		}
		if result["stdout"] != "" || result["stderr"] != "" {
			t.Errorf("the result event repeats the output: stdout %.100q stderr %.100q", result["stdout"], result["stderr"])
		}
		if result["stdout_dropped"] != float64(outDropped) || result["stdout_truncated"] != true {
			t.Errorf("result %v: want stdout_dropped %d", result, outDropped)
		}
	})

	t.Run("UnderTheLimit", func(t *testing.T) {
		res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", "seq 1 100"}, OutputLimit: limit})
		want := ""
		for i := 1; i <= 100; i++ {
			want += strconv.Itoa(i) + "\n"
		}
		if res.Stdout != want || res.StdoutTruncated || res.StdoutDropped != 0 {
			t.Errorf("under the limit: %q (truncated %v), want all of it", res.Stdout, res.StdoutTruncated)
		}
	})
}

// TestExecBase64: with "encoding": "base64" stdin, stdout, stderr and streamed data
// are base64 and exact; the default stays UTF-8 text (invalid bytes replaced) for
// curl. (On main the field was refused: 400 unknown field.)
func TestExecBase64(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "").ID
	blob := make([]byte, 0, 512)
	for i := 0; i < 512; i++ {
		blob = append(blob, byte(i*7+i/256))
	}
	b64 := base64.StdEncoding.EncodeToString(blob)
	argv := []string{"bash", "-c", "cat; head -c 3 /dev/zero | tr '\\0' '\\377' >&2"}

	body, _ := json.Marshal(map[string]any{"argv": argv, "stdin": b64, "encoding": "base64"})
	st, b := dbxRaw(t, d, "POST", "/sandboxes/"+id+"/exec", string(body))
	if st != 200 {
		t.Fatalf("status %d: %s", st, b)
	}
	var res struct {
		Stdout, Stderr, Encoding string
		ExitCode                 int `json:"exit_code"`
	}
	json.Unmarshal(b, &res)
	if res.Stdout != b64 || res.Stderr != "////" || res.Encoding != "base64" || res.ExitCode != 0 {
		t.Fatalf("base64 answer: %s\nwant stdout %q, stderr %q (3 bytes 0xff), encoding base64", b, b64, "////")
	}

	body, _ = json.Marshal(map[string]any{"argv": argv, "stdin": b64, "encoding": "base64", "stream": true})
	st, b = dbxRaw(t, d, "POST", "/sandboxes/"+id+"/exec", string(body))
	if st != 200 {
		t.Fatalf("stream: status %d: %s", st, b)
	}
	var out, errb []byte
	for _, ev := range trxEvents(t, b) {
		data, _ := ev["data"].(string)
		raw, err := base64.StdEncoding.DecodeString(data)
		if err != nil {
			t.Fatalf("stream event %v: data is not base64: %v", ev, err)
		}
		switch ev["type"] {
		case "stdout":
			out = append(out, raw...)
		case "stderr":
			errb = append(errb, raw...)
		}
	}
	if !bytes.Equal(out, blob) || !bytes.Equal(errb, []byte{0xff, 0xff, 0xff}) {
		t.Fatalf("streamed base64: stdout %d bytes equal %v, stderr %x", len(out), bytes.Equal(out, blob), errb)
	}

	// The default: text, invalid UTF-8 replaced (documented as lossy).
	st, b = dbxRaw(t, d, "POST", "/sandboxes/"+id+"/exec", `{"argv":["printf","a\\377b"]}`)
	if st != 200 || !strings.Contains(string(b), `"stdout":"a\ufffdb"`) {
		t.Fatalf("text answer: %d %s, want stdout \"a\\ufffdb\"", st, b)
	}
	// Refusals name the field.
	for _, bad := range []string{`{"argv":["true"],"encoding":"latin1"}`, `{"argv":["cat"],"encoding":"base64","stdin":"%%%"}`} {
		st, b = dbxRaw(t, d, "POST", "/sandboxes/"+id+"/exec", bad)
		if code, msg := dbxErrorBody(t, b); st != 400 || code != "invalid" || !strings.Contains(msg, "encoding") && !strings.Contains(msg, "stdin") {
			t.Errorf("%s: %d %s, want 400 naming the field", bad, st, b)
		}
	}
	// The Go client is exact: it asks for base64.
	r, err := d.C.Exec(dbxCtx(t), id, api.ExecRequest{Argv: []string{"cat"}, Stdin: string(blob)})
	if err != nil || r.Stdout != string(blob) {
		t.Fatalf("Go client: %v, stdout equal %v", err, r != nil && r.Stdout == string(blob))
	}
}

// TestExecDefaultTimeout: a call without timeout_ms gets the API's default (10 min),
// which the answer reports; -1 is no timeout. (On main nothing bounded such a call.)
func TestExecDefaultTimeout(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "").ID
	for _, c := range []struct {
		body string
		want any
	}{
		{`{"argv":["true"]}`, float64(600000)},
		{`{"argv":["true"],"timeout_ms":1500}`, float64(1500)},
		{`{"argv":["true"],"timeout_ms":-1}`, nil},
		{`{"argv":["true"],"session":"main"}`, float64(600000)},
	} {
		st, b := dbxRaw(t, d, "POST", "/sandboxes/"+id+"/exec", c.body)
		var res map[string]any
		json.Unmarshal(b, &res)
		if st != 200 || res["timeout_ms"] != c.want {
			t.Errorf("%s: %d %s, want timeout_ms %v", c.body, st, b, c.want)
		}
	}
	if st, b := dbxRaw(t, d, "POST", "/sandboxes/"+id+"/exec", `{"argv":["true"],"timeout_ms":-5}`); st != 400 {
		t.Errorf("timeout_ms -5: %d %s, want 400", st, b)
	}
}

// TestExecAbandonedCallIsInterrupted: a client that goes away mid-call interrupts
// it: a plain command's process group is killed; a session's command gets ^C, and the
// session answers the next call at once with that call's output alone, even when the
// call is abandoned right after its command started (bash gives the terminal to it a
// moment later; a ^C before that was lost). (On main the session's command ran on, the
// session said it was not busy, and the next call waited for the command and got its
// output.)
func TestExecAbandonedCallIsInterrupted(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "").ID
	for _, sess := range []string{"", "main", "main", "main"} {
		argv := []string{"bash", "-c", "echo go; sleep 60; echo late"}
		if sess != "" {
			argv = []string{"echo go; sleep 60; echo late"}
		}
		ctx, cancel := context.WithCancel(dbxCtx(t))
		_, err := d.C.ExecStream(ctx, id, api.ExecRequest{Argv: argv, Session: sess}, func(stream, data string) {
			if strings.Contains(data, "go") {
				cancel()
			}
		})
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("session %q: the abandoned call returned %v", sess, err)
		}
		if sess != "" {
			start := time.Now()
			r, err := d.C.Run(dbxCtx(t), id, sess, "echo next", 15*time.Second)
			if err != nil || r.Stdout != "next\n" || r.TimedOut || time.Since(start) > 3*time.Second {
				t.Fatalf("the next call: %+v %v after %v; want \"next\\n\" at once", r, err, time.Since(start))
			}
			l, err := d.C.Sessions(dbxCtx(t), id)
			if err != nil || len(l) != 1 || l[0].Busy || !l[0].Running {
				t.Fatalf("sessions: %+v %v; want main running, not busy", l, err)
			}
		}
		trxNoSleep(t, d, id)
	}
}

// trxNoSleep waits up to 5 s for no sleep process in the sandbox.
func trxNoSleep(t *testing.T, d *testutil.Daemon, id string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		ps := dbxSh(t, d, id, "ps -eo comm")
		if !strings.Contains(ps, "sleep") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the interrupted command still runs:\n%s", ps)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestCLIExecTimeout: the CLI says on stderr that the command timed out and exits
// 124. (On main: nothing on stderr, exit 137.)
func TestCLIExecTimeout(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "").ID
	for _, sess := range []string{"", "main"} {
		args := []string{"exec", id, "--timeout", "2s", "--", "bash", "-c", "echo start; sleep 100"}
		if sess != "" {
			args = []string{"exec", id, "--session", sess, "--timeout", "2s", "--", "echo start; sleep 100"}
		}
		start := time.Now()
		out, errb, code := trxCLI(t, d, nil, args...)
		if code != 124 || !strings.HasPrefix(string(out), "start\n") || !strings.Contains(string(errb), "timed out after 2s") {
			t.Errorf("session %q: exit %d, stdout %q, stderr %q; want 124, start, and a timeout marker on stderr", sess, code, out, errb)
		}
		if took := time.Since(start); took > 15*time.Second {
			t.Errorf("session %q: took %v", sess, took)
		}
	}
}

// TestCLIExecLargeOutput: 100 MB of output through the CLI. By default the first
// 256 KiB and the last 768 KiB arrive, END included, with the count of the dropped
// bytes on stderr, exit 0; with --output-limit over the output, all of it arrives and
// the command's exit code is kept. (On main: 1 MiB, no marker, no END; with a large
// limit "bufio.Scanner: token too long" and exit 1.)
func TestCLIExecLargeOutput(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "").ID
	const n = 100_000_000
	script := fmt.Sprintf("head -c %d /dev/zero | tr '\\0' x; echo END", n)
	total := n + 4

	out, errb, code := trxCLI(t, d, nil, "exec", id, "--", "bash", "-c", script)
	if code != 0 || len(out) != 1<<20 || !bytes.HasSuffix(out, []byte("xxEND\n")) || bytes.Count(out, []byte("x")) != 1<<20-4 {
		t.Errorf("default limit: exit %d, %d bytes on stdout ending %q; want 0, 1 MiB ending with END", code, len(out), dbxTail(string(out), 20))
	}
	m := trxMarkerRE.FindStringSubmatch(string(errb))
	if m == nil || m[1] != strconv.Itoa(total-1<<20) || m[2] != "stdout" {
		t.Errorf("stderr %q: want [deltabox: %d bytes of stdout dropped]", dbxTail(string(errb), 300), total-1<<20)
	}

	out, errb, code = trxCLI(t, d, nil, "exec", id, "--output-limit", "200000000", "--", "bash", "-c", script+"; exit 3")
	if code != 3 || len(out) != total || !bytes.HasSuffix(out, []byte("xxEND\n")) || len(errb) != 0 {
		t.Errorf("--output-limit 200000000: exit %d, %d bytes on stdout ending %q, stderr %q; want 3, all %d bytes, nothing on stderr",
			code, len(out), dbxTail(string(out), 20), dbxTail(string(errb), 300), total)
	}
}

// TestCLIExecBinary: exec is binary-safe through the CLI, stdin and stdout. (On main
// invalid UTF-8 became U+FFFD both ways.)
func TestCLIExecBinary(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "").ID
	blob := make([]byte, 0, 256*64)
	for i := 0; i < 64; i++ {
		for b := 0; b < 256; b++ {
			blob = append(blob, byte(b^i))
		}
	}
	out, errb, code := trxCLI(t, d, blob, "exec", "-i", id, "--", "bash", "-c", "cat > /tmp/blob; cat /tmp/blob")
	if code != 0 || !bytes.Equal(out, blob) {
		t.Fatalf("exec -i cat: exit %d, %d bytes back (equal %v), stderr %q", code, len(out), bytes.Equal(out, blob), errb)
	}
	out, _, code = trxCLI(t, d, nil, "exec", id, "--", "cat", "/tmp/blob")
	if code != 0 || !bytes.Equal(out, blob) {
		t.Fatalf("exec cat FILE: exit %d, equal %v", code, bytes.Equal(out, blob))
	}
	// And on stderr.
	_, errb, _ = trxCLI(t, d, nil, "exec", id, "--", "bash", "-c", "cat /tmp/blob >&2")
	if !bytes.Equal(errb, blob) {
		t.Fatalf("exec cat FILE >&2: stderr equal %v (%d bytes)", bytes.Equal(errb, blob), len(errb))
	}
}

// trxInterrupt starts the CLI with args, waits for "go" on its stdout, sends SIGINT
// and returns its stderr and exit code.
func trxInterrupt(t *testing.T, d *testutil.Daemon, args ...string) (string, int) {
	t.Helper()
	cmd := testutil.Command(t, 2*time.Minute, testutil.Binary(t), append([]string{"--socket", d.Socket}, args...)...)
	pr, pw := io.Pipe()
	var errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = pw, &errb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	seen := make(chan struct{})
	var once sync.Once
	go func() {
		b := make([]byte, 4096)
		var acc []byte
		for {
			n, err := pr.Read(b)
			acc = append(acc, b[:n]...)
			if bytes.Contains(acc, []byte("go\n")) {
				once.Do(func() { close(seen) })
			}
			if err != nil {
				return
			}
		}
	}()
	select {
	case <-seen:
	case <-time.After(30 * time.Second):
		t.Fatalf("no output from %q within 30s; stderr %q", args, errb.String())
	}
	cmd.Process.Signal(syscall.SIGINT)
	err := cmd.Wait()
	pw.Close()
	var ee *exec.ExitError
	code := 0
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("%q: %v", args, err)
	}
	return errb.String(), code
}

// TestCLIExecInterrupt: Ctrl-C of the CLI interrupts the call: "interrupted" on
// stderr, exit 130, the command is killed; a session's command gets ^C and the session
// answers the next call at once with that call's output alone. (On main: "use of
// closed network connection", exit 1; the session's command ran on, and the next call
// waited for it and got its output.)
func TestCLIExecInterrupt(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "").ID

	t.Run("Plain", func(t *testing.T) {
		errs, code := trxInterrupt(t, d, "exec", id, "--", "bash", "-c", "echo go; sleep 60; echo late")
		if code != 130 || !strings.Contains(errs, "interrupted") || strings.Contains(errs, "closed network connection") {
			t.Errorf("exit %d, stderr %q; want 130 and \"interrupted\"", code, errs)
		}
		trxNoSleep(t, d, id)
	})

	t.Run("Session", func(t *testing.T) {
		errs, code := trxInterrupt(t, d, "exec", id, "--session", "main", "--", "echo go; sleep 60; echo late")
		if code != 130 || !strings.Contains(errs, "interrupted") {
			t.Errorf("exit %d, stderr %q; want 130 and \"interrupted\"", code, errs)
		}
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		r, err := d.C.Run(ctx, id, "main", "echo next", 15*time.Second)
		if err != nil || r.Stdout != "next\n" || r.TimedOut || time.Since(start) > 3*time.Second {
			t.Fatalf("the next call: %+v %v after %v; want \"next\\n\" at once", r, err, time.Since(start))
		}
		trxNoSleep(t, d, id)
		l, err := d.C.Sessions(dbxCtx(t), id)
		if err != nil || len(l) != 1 || l[0].Busy || !l[0].Running {
			t.Fatalf("sessions: %+v %v; want main running, not busy", l, err)
		}
	})
}

// TestFilesNonUTF8Names: a name that is not UTF-8 is listed with its bytes
// (name_base64, path_base64) and can be read back by them. (On main the listing
// replaced the bytes with U+FFFD and no request could name the file.)
func TestFilesNonUTF8Names(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "").ID
	dbxSh(t, d, id, `mkdir d; printf 'content' > d/$'caf\xe9.txt'; ln -s $'caf\xe9.txt' d/link`)
	st, b := dbxRaw(t, d, "GET", "/sandboxes/"+id+"/files/list?path=d", "")
	if st != 200 {
		t.Fatalf("list: %d %s", st, b)
	}
	var l struct {
		Entries []map[string]any
	}
	json.Unmarshal(b, &l)
	name := "caf\xe9.txt"
	enc := base64.StdEncoding.EncodeToString([]byte(name))
	encPath := base64.StdEncoding.EncodeToString([]byte("/workspace/d/" + name))
	var file, link map[string]any
	for _, e := range l.Entries {
		switch e["type"] {
		case "file":
			file = e
		case "symlink":
			link = e
		}
	}
	if file == nil || file["name_base64"] != enc || file["path_base64"] != encPath {
		t.Fatalf("listing %s: want the file with name_base64 %q and path_base64 %q", b, enc, encPath)
	}
	if link == nil || link["link_target_base64"] != enc || link["name_base64"] != nil {
		t.Fatalf("listing %s: want the link with link_target_base64 %q and no name_base64 (its name is UTF-8)", b, enc)
	}
	// Read back by its bytes, through the raw API and the Go client.
	st, b = dbxRaw(t, d, "GET", "/sandboxes/"+id+"/files?path=d/caf%E9.txt", "")
	if st != 200 || string(b) != "content" {
		t.Fatalf("read by the name's bytes: %d %s", st, b)
	}
	gl, err := d.C.ListFiles(dbxCtx(t), id, "d", client.ListFilesOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var got string
	for _, e := range gl.Entries {
		if e.Type == "file" {
			got = e.Path
		}
	}
	if got != "/workspace/d/"+name {
		t.Fatalf("Go client: path %q, want the name's bytes", got)
	}
	if c, err := d.C.ReadFile(dbxCtx(t), id, got); err != nil || string(c) != "content" {
		t.Fatalf("Go client read of %q: %q %v", got, c, err)
	}
}
