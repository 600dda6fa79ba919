package api

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"deltabox/internal/errdefs"
	"deltabox/internal/transfer"
)

// transferRoutes registers the export and import of nodes (docs/design/transfer.md).
func (s *Server) transferRoutes() {
	s.mux.HandleFunc("GET /v1/nodes/{id}/export", s.exportNode)
	s.mux.HandleFunc("POST /v1/nodes/import", s.importNode)
}

// exportNode streams a node's archive (application/x-tar). Every refusal comes before
// the first byte, as a JSON error; a failure while streaming (the node removed
// meanwhile) aborts the connection, so that the client sees a cut body, never a
// short archive that looks whole (an import would refuse it anyway: its trailer is
// missing).
func (s *Server) exportNode(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	start := time.Now()
	e, err := s.m.PrepareExport(r.Context(), id)
	if err != nil {
		writeErr(w, err)
		return
	}
	defer e.Close()
	w.Header().Set("Content-Type", "application/x-tar")
	w.Header().Set("Content-Disposition", fmt.Sprintf("attachment; filename=%q", id+".dbx"))
	for _, warn := range e.Warnings {
		w.Header().Add("Deltabox-Warning", warn)
	}
	w.Header().Set("Deltabox-Process-Image", strconv.FormatBool(e.HasProcesses()))
	w.WriteHeader(http.StatusOK)
	if err := e.Write(w); err != nil {
		s.log.Warn("node export cut short", "node", id, "err", err)
		panic(http.ErrAbortHandler)
	}
	s.log.Info("node exported", "node", id, "process_image", e.HasProcesses(), "duration", time.Since(start))
}

// importNode reads a node archive from the body (bounded: max_bytes of layer data,
// max_entries entries, and the body to max_bytes plus 1 GiB of headers and layers
// the store already has).
func (s *Server) importNode(w http.ResponseWriter, r *http.Request) {
	var lim transfer.Limits
	for _, q := range []struct {
		name string
		v    *int64
	}{{"max_bytes", &lim.MaxBytes}, {"max_entries", &lim.MaxEntries}} {
		if v := r.URL.Query().Get(q.name); v != "" {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 0 {
				writeErr(w, fmt.Errorf("%s=%q: want a number >= 0 (0: the default): %w", q.name, v, errdefs.ErrInvalid))
				return
			}
			*q.v = n
		}
	}
	maxBytes := lim.MaxBytes
	if maxBytes == 0 {
		maxBytes = 4 << 30
	}
	body := http.MaxBytesReader(w, r.Body, maxBytes+1<<30)
	start := time.Now()
	res, err := s.m.ImportNode(r.Context(), body, lim)
	if mb := (*http.MaxBytesError)(nil); errors.As(err, &mb) {
		err = fmt.Errorf("the archive is over %d bytes (raise max_bytes): %w", mb.Limit, errdefs.ErrTooLarge)
	}
	if err != nil {
		s.log.Warn("node import refused", "err", err)
		writeErr(w, err)
		return
	}
	s.log.Info("node imported", "node", res.Node, "process_image", res.ProcessImage, "duration", time.Since(start))
	writeJSON(w, 201, res)
}
