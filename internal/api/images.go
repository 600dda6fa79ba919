package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/auth"
	"deltabox/internal/errdefs"
	"deltabox/internal/image"
	"deltabox/internal/store"
)

// The image import's request and streamed answer; their wire form is defined once, in
// apitypes.
type (
	ImportRequest = apitypes.ImportRequest
	ImportEvent   = apitypes.ImportEvent
	ErrorDetail   = apitypes.ErrorDetail
)

// hostPathRefused is the answer to a route that reads a path on the daemon's host, asked
// over the TCP listener: the daemon reads as root, and an API key is not root of the
// host. The refusal comes before the path is looked at, so it says nothing about what
// exists there.
func hostPathRefused(r *http.Request, what string) error {
	if !auth.IsRemote(r.Context()) {
		return nil
	}
	return fmt.Errorf("%s reads a path on the daemon's host, which an API key does not open: run it on the host as root, over the unix socket (deltabox image import NAME PATH): %w", what, errdefs.ErrForbidden)
}

func (s *Server) importImage(w http.ResponseWriter, r *http.Request) {
	if err := hostPathRefused(r, "POST /v1/images (image import)"); err != nil {
		s.log.Warn("image import refused over the network", "remote", r.RemoteAddr)
		writeErr(w, err)
		return
	}
	var q ImportRequest
	if err := decode(w, r, &q); err != nil {
		writeErr(w, err)
		return
	}
	if q.MaxBytes < 0 || q.MaxEntries < 0 {
		writeErr(w, fmt.Errorf("max_bytes and max_entries must be >= 0: %w", errdefs.ErrInvalid))
		return
	}
	if err := s.m.CheckImport(q.Name, q.Source); err != nil {
		writeErr(w, err)
		return
	}
	o := image.Options{AllowSetuid: q.AllowSetuid, MaxBytes: q.MaxBytes, MaxEntries: q.MaxEntries}
	start := time.Now()
	logResult := func(im *store.Image, err error) {
		if err != nil {
			s.log.Warn("image import failed", "name", q.Name, "source", q.Source, "err", err)
		} else {
			s.log.Info("image imported", "name", q.Name, "source", im.Source, "bytes", im.Bytes, "duration", time.Since(start))
		}
	}
	if p := r.URL.Query().Get("progress"); p == "" || p == "0" || p == "false" {
		im, err := s.m.ImportImage(r.Context(), q.Name, q.Source, o, nil)
		logResult(im, err)
		if err != nil {
			writeErr(w, err)
			return
		}
		writeJSON(w, 201, im)
		return
	}
	// Streamed: the status (200) is sent before the outcome is known; the last line
	// carries it.
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(http.StatusOK)
	enc := json.NewEncoder(w)
	fl, _ := w.(http.Flusher)
	send := func(ev ImportEvent) {
		_ = enc.Encode(ev) // the client went away: nothing to tell it
		if fl != nil {
			fl.Flush()
		}
	}
	im, err := s.m.ImportImage(r.Context(), q.Name, q.Source, o, func(done, total int64) {
		send(ImportEvent{Done: &done, Total: &total})
	})
	logResult(im, err)
	if err != nil {
		_, code := errdefs.HTTPStatus(err)
		send(ImportEvent{Error: &ErrorDetail{Code: code, Message: err.Error()}})
		return
	}
	send(ImportEvent{Image: im})
}

func (s *Server) removeImage(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	if err := s.m.RemoveImage(name); err != nil {
		writeErr(w, err)
		return
	}
	s.log.Info("image removed", "name", name)
	writeJSON(w, 200, apitypes.Removed{Removed: name})
}

// imageRoutes registers the image routes other than GET /v1/images.
func (s *Server) imageRoutes() {
	s.mux.HandleFunc("POST /v1/images", s.importImage)
	s.mux.HandleFunc("DELETE /v1/images/{name}", s.removeImage)
}
