package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"deltabox/internal/errdefs"
)

// TestBodyOverLimit: a JSON body over maxBody is a 413 naming the limit, read no
// further than the limit; one at the limit is decoded.
func TestBodyOverLimit(t *testing.T) {
	s := New(nil, slog.New(slog.DiscardHandler))
	body := `{"id":"` + strings.Repeat("a", maxBody) + `"}`
	w := httptest.NewRecorder()
	s.ServeHTTP(w, httptest.NewRequest("POST", "/v1/sandboxes", strings.NewReader(body)))
	var eb ErrorBody
	json.Unmarshal(w.Body.Bytes(), &eb)
	if w.Code != http.StatusRequestEntityTooLarge || eb.Error.Code != "too_large" || !strings.Contains(eb.Error.Message, "16777216 bytes") {
		t.Fatalf("%d %+v", w.Code, eb)
	}
	if !errors.Is(errdefs.FromStatus(w.Code), errdefs.ErrInvalid) {
		t.Errorf("a 413 is no longer an ErrInvalid to Go clients")
	}

	var v struct{ ID string }
	pad := `{"id":"x"}` + strings.Repeat(" ", maxBody-10)
	r := httptest.NewRequest("POST", "/", bytes.NewReader([]byte(pad)))
	if err := decode(httptest.NewRecorder(), r, &v); err != nil || v.ID != "x" {
		t.Fatalf("a body of exactly %d bytes: %v %+v", maxBody, err, v)
	}
}
