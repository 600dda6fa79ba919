package api

import (
	"net/http"

	"deltabox/internal/apitypes"
)

func (s *Server) signal(w http.ResponseWriter, r *http.Request) {
	var q apitypes.SignalRequest
	if err := decode(w, r, &q); err != nil {
		writeErr(w, err)
		return
	}
	sig, err := s.m.Signal(r.PathValue("id"), q.Pid, q.Signal)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 200, apitypes.SignalResult{Pid: q.Pid, Signal: sig})
}
