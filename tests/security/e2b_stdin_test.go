package security

import (
	"encoding/base64"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"deltabox/internal/testutil"
)

// SendInput to a command that never reads its stdin must answer (DeadlineExceeded) by
// the request's own deadline, or 30 s without one, or when the command ends; it used to
// block in the daemon forever, holding the handler and its 1 MiB.
func TestE2BSendInputToCommandNotReadingStdin(t *testing.T) {
	d, addr := testutil.StartRemoteDaemon(t)
	c := e2bClient{t, addr}
	key := testutil.NewKey(t, d, "k")
	r := c.create(key)
	frame := func(js string) string {
		n := len(js)
		return string([]byte{0, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}) + js
	}
	go func() { // a command that never reads stdin, with stdin on
		req, _ := http.NewRequest("POST", "http://"+addr+"/process.Process/Start", strings.NewReader(frame(`{"process":{"cmd":"sleep","args":["120"]},"stdin":true}`)))
		req.Header.Set("E2b-Sandbox-Id", r.SandboxID)
		req.Header.Set("X-Access-Token", r.EnvdAccessToken)
		req.Header.Set("Content-Type", "application/connect+json")
		if res, err := http.DefaultClient.Do(req); err == nil {
			io.Copy(io.Discard, res.Body)
			res.Body.Close()
		}
	}()
	time.Sleep(2 * time.Second)
	data := base64.StdEncoding.EncodeToString(make([]byte, 1<<20))
	call := func(method, body, timeoutMS string) (int, string, time.Duration) {
		req, _ := http.NewRequest("POST", "http://"+addr+"/process.Process/"+method, strings.NewReader(body))
		req.Header.Set("E2b-Sandbox-Id", r.SandboxID)
		req.Header.Set("X-Access-Token", r.EnvdAccessToken)
		req.Header.Set("Content-Type", "application/json")
		if timeoutMS != "" {
			req.Header.Set("Connect-Timeout-Ms", timeoutMS)
		}
		cl := &http.Client{Timeout: 45 * time.Second}
		start := time.Now()
		res, err := cl.Do(req)
		if err != nil {
			t.Fatalf("%s to a command that does not read stdin: no answer after %v: %v", method, time.Since(start), err)
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		return res.StatusCode, string(b), time.Since(start)
	}
	input := `{"process":{"pid":1},"input":{"stdin":"` + data + `"}}`
	s, b, took := call("SendInput", input, "2000")
	if s == 200 || !strings.Contains(b, "deadline_exceeded") || took > 10*time.Second {
		t.Errorf("SendInput with a 2 s deadline: %d %.200s after %v, want deadline_exceeded within 10 s", s, b, took)
	}
	s, b, took = call("SendInput", input, "")
	if s == 200 || !strings.Contains(b, "deadline_exceeded") || took > 40*time.Second {
		t.Errorf("SendInput without a deadline: %d %.200s after %v, want deadline_exceeded within 40 s", s, b, took)
	}
	// The command's end answers a pending write at once.
	go func() {
		time.Sleep(time.Second)
		call("SendSignal", `{"process":{"pid":1},"signal":"SIGNAL_SIGKILL"}`, "")
	}()
	s, b, took = call("SendInput", input, "")
	if s == 200 || took > 15*time.Second {
		t.Errorf("SendInput to a command killed meanwhile: %d %.200s after %v, want an error within 15 s", s, b, took)
	}
	t.Logf("SendInput to a killed command: %d %.200s after %v", s, b, took)
}

// A Keepalive-Ping-Interval past time.Duration's range (or <= 0) must not panic the
// handler (time.NewTicker does on a period <= 0): it is clamped to 1 s - 1 h.
func TestE2BKeepaliveIntervalOverflow(t *testing.T) {
	d, addr := testutil.StartRemoteDaemon(t)
	c := e2bClient{t, addr}
	key := testutil.NewKey(t, d, "k")
	r := c.create(key)
	js := `{"process":{"cmd":"echo","args":["hi"]}}`
	n := len(js)
	body := string([]byte{0, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}) + js
	for _, v := range []string{"9223372036854775807", "9300000000", "-5"} {
		req, _ := http.NewRequest("POST", "http://"+addr+"/process.Process/Start", strings.NewReader(body))
		req.Header.Set("E2b-Sandbox-Id", r.SandboxID)
		req.Header.Set("X-Access-Token", r.EnvdAccessToken)
		req.Header.Set("Content-Type", "application/connect+json")
		req.Header.Set("Keepalive-Ping-Interval", v)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("Keepalive-Ping-Interval %s: %v", v, err)
		}
		b, err := io.ReadAll(res.Body)
		res.Body.Close()
		if err != nil || !strings.Contains(string(b), `"exited":true`) {
			t.Errorf("Keepalive-Ping-Interval %s: %d %q %v, want the command's end", v, res.StatusCode, b, err)
		}
	}
}
