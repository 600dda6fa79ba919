package api

import (
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"unicode/utf8"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
	"deltabox/internal/files"
)

// The files API's answers; their wire form is defined once, in apitypes.
type (
	FileContent = apitypes.FileContent
	MkdirResult = apitypes.MkdirResult
)

// Headers of a raw read.
const (
	HeaderFileSize = apitypes.HeaderFileSize
	HeaderFileMode = apitypes.HeaderFileMode
)

// filesRoutes registers the files API (docs/API.md, "Files").
func (s *Server) filesRoutes() {
	h := s.mux.HandleFunc
	h("GET /v1/sandboxes/{id}/files", s.readFile)
	h("PUT /v1/sandboxes/{id}/files", s.writeFile)
	h("DELETE /v1/sandboxes/{id}/files", s.removeFile)
	h("GET /v1/sandboxes/{id}/files/list", s.listFiles)
	h("GET /v1/sandboxes/{id}/files/stat", s.statFile)
	h("POST /v1/sandboxes/{id}/files/mkdir", s.mkdirFile)
}

func qBool(q url.Values, name string) (bool, error) {
	v := q.Get(name)
	if v == "" {
		return false, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, fmt.Errorf("%s=%q: want 1 or 0: %w", name, v, errdefs.ErrInvalid)
	}
	return b, nil
}

func qInt(q url.Values, name string) (int64, error) {
	v := q.Get(name)
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%s=%q: want a number >= 0: %w", name, v, errdefs.ErrInvalid)
	}
	return n, nil
}

// qMode parses an octal mode (0644); ok is false when absent.
func qMode(q url.Values) (mode uint32, ok bool, err error) {
	v := q.Get("mode")
	if v == "" {
		return 0, false, nil
	}
	n, err := strconv.ParseUint(v, 8, 32)
	if err != nil || n > 0o7777 {
		return 0, false, fmt.Errorf("mode=%q: want octal permission bits such as 0644: %w", v, errdefs.ErrInvalid)
	}
	return uint32(n), true, nil
}

// qPath is the path query parameter; optional ones default to the workdir.
func qPath(q url.Values, optional bool) (string, error) {
	p := q.Get("path")
	if p == "" {
		if optional {
			return ".", nil
		}
		return "", fmt.Errorf("a ?path= (absolute, or relative to the sandbox's workdir) is required: %w", errdefs.ErrInvalid)
	}
	return p, nil
}

// fileOp runs fn on sandbox id's filesystem with the request's path resolved, and
// writes the error if fn has not written an answer.
func (s *Server) fileOp(w http.ResponseWriter, r *http.Request, optionalPath bool, fn func(root int, p string, view func(*files.Info) *files.Info) error) {
	p, err := qPath(r.URL.Query(), optionalPath)
	if err != nil {
		writeErr(w, err)
		return
	}
	err = s.m.FileOp(r.Context(), r.PathValue("id"), fileOpName(r, p), func(root int, workdir string) error {
		ap, err := files.Resolve(workdir, p)
		if err != nil {
			return err
		}
		// Owners as the sandbox sees them: the daemon reads host ids through the
		// sandbox's idmapped layers (root inside is uid_base outside).
		base := s.m.IDBase(r.PathValue("id"))
		return fn(root, ap, func(in *files.Info) *files.Info {
			in.UID, in.GID = files.SandboxID(in.UID, base), files.SandboxID(in.GID, base)
			return withBytes(in)
		})
	})
	if err != nil {
		writeErr(w, err)
	}
}

// fileOpName names a file operation for a checkpoint's or restore's 409 ("files write
// x.py": the path as given).
func fileOpName(r *http.Request, p string) string {
	verb := map[string]string{"GET": "read", "PUT": "write", "DELETE": "remove"}[r.Method]
	if i := strings.LastIndex(r.URL.Path, "/files/"); i >= 0 {
		verb = r.URL.Path[i+len("/files/"):]
	}
	return "files " + verb + " " + p
}

func (s *Server) readFile(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	off, err := qInt(q, "offset")
	if err != nil {
		writeErr(w, err)
		return
	}
	length, err := qInt(q, "length")
	if err != nil {
		writeErr(w, err)
		return
	}
	format := q.Get("format")
	if format != "" && format != "raw" && format != "json" {
		writeErr(w, fmt.Errorf("format=%q: want raw or json: %w", format, errdefs.ErrInvalid))
		return
	}
	w = GuardWrites(w, StallWait)
	s.fileOp(w, r, false, func(root int, p string, view func(*files.Info) *files.Info) error {
		f, in, err := files.Open(root, p)
		if err != nil {
			return err
		}
		defer func() { _ = f.Close() }() // read-only, after the read
		n, err := files.ReadRange(p, in.Size, off, length, files.DefaultMaxRead)
		if err != nil {
			return err
		}
		if format == "json" {
			b := make([]byte, n)
			m, err := f.ReadAt(b, off)
			if err != nil && err != io.EOF {
				return fmt.Errorf("read %s: %w", p, err)
			}
			writeJSON(w, 200, FileContent{Path: p, Size: in.Size, Offset: off, Encoding: "base64", Content: b[:m]})
			return nil
		}
		hd := w.Header()
		hd.Set("Content-Type", "application/octet-stream")
		hd.Set("Content-Length", strconv.FormatInt(n, 10))
		hd.Set(HeaderFileSize, strconv.FormatInt(in.Size, 10))
		hd.Set(HeaderFileMode, fmt.Sprintf("%04o", in.Mode))
		hd.Set("Last-Modified", in.ModTime.Format(http.TimeFormat))
		w.WriteHeader(200)
		if _, err := io.Copy(w, io.NewSectionReader(f, off, n)); err != nil {
			s.log.Warn("files: read cut short", "sandbox", r.PathValue("id"), "path", p, "err", err)
		}
		return nil
	})
}

func (s *Server) writeFile(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	mode, hasMode, err := qMode(q)
	if err != nil {
		writeErr(w, err)
		return
	}
	mkdir, err := qBool(q, "mkdir")
	if err != nil {
		writeErr(w, err)
		return
	}
	if r.ContentLength > files.DefaultMaxWrite {
		writeErr(w, fmt.Errorf("the content (%d bytes) is over the limit of %d bytes per write: %w", r.ContentLength, files.DefaultMaxWrite, errdefs.ErrInvalid))
		return
	}
	s.fileOp(w, r, false, func(root int, p string, view func(*files.Info) *files.Info) error {
		in, err := files.Write(root, p, GuardBody(w, r.Body, StallWait), files.WriteOptions{Mode: mode, HasMode: hasMode, MkdirParents: mkdir})
		if err != nil {
			return err
		}
		writeJSON(w, 200, view(in))
		return nil
	})
}

func (s *Server) removeFile(w http.ResponseWriter, r *http.Request) {
	recursive, err := qBool(r.URL.Query(), "recursive")
	if err != nil {
		writeErr(w, err)
		return
	}
	s.fileOp(w, r, false, func(root int, p string, view func(*files.Info) *files.Info) error {
		if err := files.Remove(root, p, recursive); err != nil {
			return err
		}
		writeJSON(w, 200, apitypes.Removed{Removed: p})
		return nil
	})
}

func (s *Server) listFiles(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var o files.ListOptions
	var err error
	if o.Recursive, err = qBool(q, "recursive"); err != nil {
		writeErr(w, err)
		return
	}
	depth, err := qInt(q, "depth")
	if err != nil {
		writeErr(w, err)
		return
	}
	max, err := qInt(q, "max_entries")
	if err != nil {
		writeErr(w, err)
		return
	}
	if depth > 1024 || max > 1_000_000 {
		writeErr(w, fmt.Errorf("depth is at most 1024 and max_entries at most 1000000: %w", errdefs.ErrInvalid))
		return
	}
	o.MaxDepth, o.MaxEntries = int(depth), int(max)
	s.fileOp(w, r, true, func(root int, p string, view func(*files.Info) *files.Info) error {
		l, err := files.List(root, p, o)
		if err != nil {
			return err
		}
		l.PathBase64 = bytesOf(l.Path)
		for i := range l.Entries {
			view(&l.Entries[i])
		}
		writeJSON(w, 200, l)
		return nil
	})
}

func (s *Server) statFile(w http.ResponseWriter, r *http.Request) {
	s.fileOp(w, r, true, func(root int, p string, view func(*files.Info) *files.Info) error {
		in, err := files.Stat(root, p)
		if err != nil {
			return err
		}
		writeJSON(w, 200, view(in))
		return nil
	})
}

func (s *Server) mkdirFile(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	mode, _, err := qMode(q)
	if err != nil {
		writeErr(w, err)
		return
	}
	// mkdir -p by default; parents=0 makes an existing directory or a missing parent
	// an error.
	parents := true
	if q.Get("parents") != "" {
		if parents, err = qBool(q, "parents"); err != nil {
			writeErr(w, err)
			return
		}
	}
	s.fileOp(w, r, false, func(root int, p string, view func(*files.Info) *files.Info) error {
		created, err := files.Mkdir(root, p, mode, parents)
		if err != nil {
			return err
		}
		in, err := files.Stat(root, p)
		if err != nil {
			return err
		}
		writeJSON(w, 200, MkdirResult{Created: created, Entry: *view(in)})
		return nil
	})
}

// withBytes sets the base64 fields of in's name, path and link target that are not
// valid UTF-8: JSON text would replace their invalid bytes, and the file could not be
// named again.
func withBytes(in *files.Info) *files.Info {
	in.NameBase64, in.PathBase64, in.LinkTargetBase64 = bytesOf(in.Name), bytesOf(in.Path), bytesOf(in.LinkTarget)
	return in
}

// bytesOf is base64 of s when s is not valid UTF-8, else "".
func bytesOf(s string) string {
	if utf8.ValidString(s) {
		return ""
	}
	return base64.StdEncoding.EncodeToString([]byte(s))
}
