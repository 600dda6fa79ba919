package api

import (
	"net/http"

	"deltabox/internal/apitypes"
	"deltabox/internal/state"
)

func (s *Server) startSession(w http.ResponseWriter, r *http.Request) {
	var o state.SessionOptions
	if err := decode(w, r, &o); err != nil {
		writeErr(w, err)
		return
	}
	in, err := s.m.StartSession(r.Context(), r.PathValue("id"), o)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 201, in)
}

func (s *Server) listSessions(w http.ResponseWriter, r *http.Request) {
	l, err := s.m.Sessions(r.PathValue("id"))
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 200, apitypes.SessionList{Sessions: l})
}

func (s *Server) sessionLogs(w http.ResponseWriter, r *http.Request) {
	b, err := s.m.SessionLogs(r.PathValue("id"), r.PathValue("name"))
	if err != nil {
		writeErr(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	_, _ = w.Write(b) // the client went away: nothing to tell it
}

func (s *Server) killSession(w http.ResponseWriter, r *http.Request) {
	if err := s.m.KillSession(r.PathValue("id"), r.PathValue("name")); err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, 200, apitypes.SessionKilled{Killed: r.PathValue("name")})
}
