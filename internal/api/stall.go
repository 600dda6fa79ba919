package api

import (
	"io"
	"net/http"
	"time"
)

// StallWait bounds each 32 KiB of a file's bytes between the daemon and a client. A
// file read or write holds its sandbox's file call (a checkpoint or restore waits for
// it, or answers 409) while the bytes move, so a client that stops reading or sending
// must not hold it longer: its connection is cut after StallWait without progress.
const StallWait = 10 * time.Second

// chunk is the most one write sends under one deadline.
const chunk = 32 << 10

// GuardWrites returns w whose body writes go out chunk bytes at a time, each within
// wait of its start (http.ResponseController.SetWriteDeadline; the server resets the
// deadline after the answer's last flush).
func GuardWrites(w http.ResponseWriter, wait time.Duration) http.ResponseWriter {
	return &stallWriter{ResponseWriter: w, rc: http.NewResponseController(w), wait: wait}
}

type stallWriter struct {
	http.ResponseWriter
	rc   *http.ResponseController
	wait time.Duration
}

func (s *stallWriter) Write(b []byte) (int, error) {
	n := 0
	for len(b) > 0 {
		c := b[:min(len(b), chunk)]
		_ = s.rc.SetWriteDeadline(time.Now().Add(s.wait)) // ErrNotSupported: no deadline to set
		m, err := s.ResponseWriter.Write(c)
		n += m
		if err != nil {
			return n, err
		}
		b = b[m:]
	}
	return n, nil
}

// Unwrap lets http.ResponseController reach the server's writer (Flush).
func (s *stallWriter) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// GuardBody returns body (r's, or a reader over it) whose reads each finish within wait
// of their start (SetReadDeadline on w's connection).
func GuardBody(w http.ResponseWriter, body io.Reader, wait time.Duration) io.Reader {
	return stallReader{r: body, rc: http.NewResponseController(w), wait: wait}
}

type stallReader struct {
	r    io.Reader
	rc   *http.ResponseController
	wait time.Duration
}

func (s stallReader) Read(b []byte) (int, error) {
	_ = s.rc.SetReadDeadline(time.Now().Add(s.wait)) // ErrNotSupported: no deadline to set
	if len(b) > chunk {
		b = b[:chunk]
	}
	return s.r.Read(b)
}
