package security

import (
	"bytes"
	"encoding/json"
	"io"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"os"
	"testing"

	"deltabox/internal/testutil"
)

// E2B's SDK writes several files in one multipart POST /files, each part's filename the
// file's full path: each lands at its path (Go's Part.FileName kept only the base), and
// a path climbing out (../../) stays confined to the sandbox.
func TestE2BMultipartWriteKeepsPathsConfined(t *testing.T) {
	d, addr := testutil.StartRemoteDaemon(t)
	c := e2bClient{t, addr}
	key := testutil.NewKey(t, d, "k")
	r := c.create(key)
	hostFile := "/tmp/deltabox-e2b-mp-" + t.Name()
	os.Remove(hostFile)
	defer os.Remove(hostFile)
	post := func(files ...[2]string) (int, []byte) {
		var body bytes.Buffer
		mw := multipart.NewWriter(&body)
		for _, f := range files {
			h := textproto.MIMEHeader{}
			h.Set("Content-Disposition", `form-data; name="file"; filename="`+f[0]+`"`)
			h.Set("Content-Type", "application/octet-stream")
			pw, _ := mw.CreatePart(h)
			pw.Write([]byte(f[1]))
		}
		mw.Close()
		req, _ := http.NewRequest("POST", "http://"+addr+"/files?username=user", &body)
		req.Header.Set("Content-Type", mw.FormDataContentType())
		req.Header.Set("E2b-Sandbox-Id", r.SandboxID)
		req.Header.Set("X-Access-Token", r.EnvdAccessToken)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		return res.StatusCode, b
	}
	s, b := post([2]string{"/tmp/deep/dir/x.txt", "hello"}, [2]string{"rel/y.txt", "world"})
	var got []struct{ Path string }
	json.Unmarshal(b, &got)
	if s != 200 || len(got) != 2 || got[0].Path != "/tmp/deep/dir/x.txt" || got[1].Path != "/home/user/rel/y.txt" {
		t.Fatalf("multipart write: %d %s, want /tmp/deep/dir/x.txt and /home/user/rel/y.txt", s, b)
	}
	if s, b := post([2]string{"../../../../../.." + hostFile, "escaped"}); s != 400 {
		t.Errorf("a part named ../..%s: %d %s, want 400 (the path leaves the sandbox)", hostFile, s, b)
	}
	if _, err := os.Stat(hostFile); err == nil {
		t.Fatalf("a part named ../..%s wrote the host's file", hostFile)
	}
	for p, want := range map[string]string{"/tmp/deep/dir/x.txt": "hello", "/home/user/rel/y.txt": "world"} {
		if s, b := c.do("GET", "/files?path="+p, envdHdr(r.SandboxID, r.EnvdAccessToken), ""); s != 200 || string(b) != want {
			t.Errorf("GET /files?path=%s: %d %q, want %q", p, s, b, want)
		}
	}
}
