package security

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"deltabox/internal/testutil"
)

// vmHWM is a process's peak resident memory in KiB.
func vmHWM(t *testing.T, pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmHWM:" {
			n, _ := strconv.ParseInt(f[1], 10, 64)
			return n
		}
	}
	t.Fatal("no VmHWM")
	return 0
}

// E2B uploads (POST /files) stream to the sandbox: 6 concurrent 60 MiB uploads must not
// take the daemon's memory up by their size (they were read whole, 64 MiB each, before
// the write began); and an upload that stalls is cut, so that a checkpoint waiting for
// it gets through.
func TestE2BUploadsStreamNotHeldInMemory(t *testing.T) {
	d, addr := testutil.StartRemoteDaemon(t)
	c := e2bClient{t, addr}
	key := testutil.NewKey(t, d, "k")
	r := c.create(key)
	before := vmHWM(t, d.Pid())
	const n, size = 6, 60 << 20
	var wg sync.WaitGroup
	errs := make(chan string, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("POST", "http://"+addr+"/files?path=/home/user/up"+strconv.Itoa(i), io.LimitReader(zeros{}, size))
			req.ContentLength = size
			req.Header.Set("Content-Type", "application/octet-stream")
			req.Header.Set("E2b-Sandbox-Id", r.SandboxID)
			req.Header.Set("X-Access-Token", r.EnvdAccessToken)
			res, err := http.DefaultClient.Do(req)
			if err != nil {
				errs <- err.Error()
				return
			}
			b, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if res.StatusCode != 200 {
				errs <- fmt.Sprintf("%d %s", res.StatusCode, b)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatalf("upload: %s", e)
	}
	grew := (vmHWM(t, d.Pid()) - before) << 10
	t.Logf("%d concurrent uploads of %d MiB: the daemon's peak RSS grew by %d MiB", n, size>>20, grew>>20)
	if grew > 64<<20 {
		t.Errorf("the daemon's peak RSS grew by %d MiB over %d uploads of %d MiB: uploads are held in memory", grew>>20, n, size>>20)
	}
	bearer := map[string]string{"Authorization": "Bearer " + key, "Content-Type": "application/json"}
	if s, b := c.do("POST", "/v1/sandboxes/"+r.SandboxID+"/exec", bearer, `{"argv":["sh","-c","stat -c %s /home/user/up0"]}`); s != 200 || !strings.Contains(string(b), strconv.Itoa(size)) {
		t.Errorf("the uploaded file: %d %s, want %d bytes", s, b, size)
	}
	// A stalled upload: headers and a little of the body, then nothing.
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /files?path=/home/user/stalled HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: %s\r\nX-Access-Token: %s\r\nContent-Type: application/octet-stream\r\nContent-Length: 1000000\r\n\r\nabc", r.SandboxID, r.EnvdAccessToken)
	time.Sleep(time.Second)
	start := time.Now()
	s, b := c.do("POST", "/v1/sandboxes/"+r.SandboxID+"/checkpoint", bearer, `{"wait_ms":25000}`)
	if s != 200 && s != 201 {
		t.Fatalf("a checkpoint while an upload stalls: %d after %v: %.300s", s, time.Since(start), b)
	}
	t.Logf("checkpoint through after %v of a stalled upload", time.Since(start))
}

type zeros struct{}

func (zeros) Read(b []byte) (int, error) {
	clear(b)
	return len(b), nil
}
