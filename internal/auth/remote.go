package auth

import "context"

type remoteKey struct{}

// WithRemote marks a request's context as one from the TCP listener (package gateway):
// a key holder on another machine, who may use the sandboxes but not the daemon host.
// A route that names a path on the host (POST /v1/images's source) checks IsRemote and
// refuses: the daemon reads the host as root, and a key is not root of the host.
func WithRemote(ctx context.Context) context.Context {
	return context.WithValue(ctx, remoteKey{}, true)
}

// IsRemote reports whether ctx is a request that came in over the TCP listener (the unix
// socket's requests are root's, and unmarked).
func IsRemote(ctx context.Context) bool {
	v, _ := ctx.Value(remoteKey{}).(bool)
	return v
}
