package auth

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
)

type remoteKey struct{}

// WithRemote marks a request's context as one from the TCP listener (package gateway):
// a key holder on another machine, who may use the sandboxes but not the daemon host.
// A route that names a path on the host (POST /v1/images's source) checks IsRemote and
// refuses: the daemon reads the host as root, and a key is not root of the host. key is
// the Hash of the API key the request showed ("": it showed a sandbox's access token).
func WithRemote(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, remoteKey{}, key)
}

// IsRemote reports whether ctx is a request that came in over the TCP listener (the unix
// socket's requests are root's, and unmarked).
func IsRemote(ctx context.Context) bool {
	_, ok := ctx.Value(remoteKey{}).(string)
	return ok
}

// RemoteKey is the Hash of the API key a remote request showed, "" for none.
func RemoteKey(ctx context.Context) string {
	k, _ := ctx.Value(remoteKey{}).(string)
	return k
}

// Hash is how the keys file names key: the hex SHA-256 of it.
func Hash(key string) string {
	h := sha256.Sum256([]byte(key))
	return hex.EncodeToString(h[:])
}
