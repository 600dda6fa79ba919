// Package errdefs holds the few error classes DeltaBox uses and their mapping to
// HTTP status codes. Errors are wrapped with context (fmt.Errorf("...: %w", ErrNotFound))
// and classified with errors.Is in exactly one place: HTTPStatus.
package errdefs

import (
	"errors"
	"fmt"
	"net/http"
)

var (
	// ErrNotFound: an unknown sandbox, node or image id.
	ErrNotFound = errors.New("not found")
	// ErrConflict: the object is busy (an exec is running) or in a state that
	// forbids the operation (a node a sandbox stands on).
	ErrConflict = errors.New("conflict")
	// ErrInvalid: the request itself is malformed.
	ErrInvalid = errors.New("invalid argument")
	// ErrForbidden: the caller may not do this from where it is (a key holder on the
	// TCP listener naming a path on the daemon's host); the message says where to.
	ErrForbidden = errors.New("forbidden")
	// ErrUnavailable: the machine lacks something (store not set up, kernel feature).
	ErrUnavailable = errors.New("unavailable")
	// ErrTooLarge: a request body over the API's limit (413). It is an ErrInvalid too,
	// as such a request was (a 400) before it had a status of its own.
	ErrTooLarge = fmt.Errorf("too large: %w", ErrInvalid)
	// ErrQuota: the sandbox is over its disk quota (disk_mb), or the store is full.
	ErrQuota = errors.New("insufficient storage")
	// ErrTemplateBudget: a checkpoint waited for room under a template memory budget
	// (the sandbox's template_budget_mb, or the daemon's total) and found none (507). It
	// is an ErrQuota too: a client that knows only the status sees that class.
	ErrTemplateBudget = fmt.Errorf("template memory budget: %w", ErrQuota)
)

// HTTPStatus maps an error to its HTTP status and a short code string.
func HTTPStatus(err error) (int, string) {
	switch {
	case err == nil:
		return http.StatusOK, "ok"
	case errors.Is(err, ErrNotFound):
		return http.StatusNotFound, "not_found"
	case errors.Is(err, ErrConflict):
		return http.StatusConflict, "conflict"
	case errors.Is(err, ErrForbidden):
		return http.StatusForbidden, "forbidden"
	case errors.Is(err, ErrTooLarge):
		return http.StatusRequestEntityTooLarge, "too_large"
	case errors.Is(err, ErrInvalid):
		return http.StatusBadRequest, "invalid"
	case errors.Is(err, ErrUnavailable):
		return http.StatusServiceUnavailable, "unavailable"
	case errors.Is(err, ErrTemplateBudget):
		return http.StatusInsufficientStorage, "template_budget"
	case errors.Is(err, ErrQuota):
		return http.StatusInsufficientStorage, "insufficient_storage"
	default:
		return http.StatusInternalServerError, "internal"
	}
}

// FromStatus turns a status code received by a client back into its class,
// so errors.Is works on both sides of the socket.
func FromStatus(status int) error {
	switch status {
	case http.StatusNotFound:
		return ErrNotFound
	case http.StatusConflict:
		return ErrConflict
	case http.StatusForbidden:
		return ErrForbidden
	case http.StatusBadRequest:
		return ErrInvalid
	case http.StatusRequestEntityTooLarge:
		return ErrTooLarge
	case http.StatusServiceUnavailable:
		return ErrUnavailable
	case http.StatusInsufficientStorage:
		return ErrQuota
	default:
		return nil
	}
}
