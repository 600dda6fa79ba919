// Package auth holds the daemon's API keys: what lets a client on the network (the TCP
// listener, `deltabox daemon --listen`) in. The unix socket needs none: it is root's
// (mode 0600), and root of the host is who creates and revokes keys.
//
// A key is "e2b_" and 40 hex digits (160 random bits), the form E2B's SDKs expect of
// E2B_API_KEY, so that a key works unchanged as one. Only its SHA-256 is kept, in
// ROOT/keys.json (mode 0600, root's): with 160 random bits a fast hash is enough (there
// is nothing to guess a password from), and the file read by someone else gives no key.
// A check hashes the key offered and compares it with every stored hash in constant time
// (crypto/subtle), so the answer's timing says nothing about how much of a hash matched.
//
// `deltabox key create|ls|rm` edit the file directly (as root, under an flock), and the
// daemon reads it at each check (parsing it again when its bytes changed), so a
// revoked key is refused from the next request on, without a restart.
package auth

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/hostids"
)

// lockWait bounds the wait for another `deltabox key` editing the file (an edit takes
// milliseconds; one that holds the lock longer is stuck).
var lockWait = 10 * time.Second

// FileName is the keys file in the daemon's root.
const FileName = "keys.json"

// Prefix starts every key (E2B's form: e2b_ and 40 hex digits).
const Prefix = "e2b_"

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$`)

// Key is a stored key: its name and the SHA-256 of the key, never the key.
type Key struct {
	Name    string    `json:"name"`
	Hash    string    `json:"sha256"`
	Created time.Time `json:"created"`
}

// Store is the keys file of one daemon root.
type Store struct {
	path string

	mu sync.Mutex // protects keys, raw and read
	// +checklocks:mu
	keys []Key
	// +checklocks:mu
	raw []byte // the file's bytes keys were parsed from (nil: absent)
	// +checklocks:mu
	read bool
}

// Open returns the store of the keys file in root (the file need not exist).
func Open(root string) *Store { return &Store{path: filepath.Join(root, FileName)} }

// Path is the keys file.
func (s *Store) Path() string { return s.path }

func hashOf(key string) string {
	h := sha256.Sum256([]byte(key))
	return hex.EncodeToString(h[:])
}

// Check reports the name of the key k, or ok=false. Every stored hash is compared, in
// constant time.
func (s *Store) Check(k string) (name string, ok bool) {
	keys, err := s.current()
	if err != nil || k == "" {
		return "", false
	}
	h := sha256.Sum256([]byte(k))
	for _, key := range keys {
		want, err := hex.DecodeString(key.Hash)
		if err != nil || len(want) != len(h) {
			continue
		}
		if subtle.ConstantTimeCompare(want, h[:]) == 1 && !ok {
			name, ok = key.Name, true
		}
	}
	return name, ok
}

// Valid reports whether the key of hash (Hash) is still in the file: what was handed
// out under a key (a sandbox's access token) stops working when the key is revoked.
func (s *Store) Valid(hash string) bool {
	keys, err := s.current()
	if err != nil || hash == "" {
		return false
	}
	for _, key := range keys {
		if subtle.ConstantTimeCompare([]byte(key.Hash), []byte(hash)) == 1 {
			return true
		}
	}
	return false
}

// current is the keys, parsed again when the file's bytes changed. The file is read
// at each check (a few hundred bytes a key; microseconds): its mtime, size and inode
// do not tell every edit apart (the kernel's file times move at the scheduler tick, a
// key of a same-length name keeps the size, and the inode the edit before freed is
// reused by the next).
func (s *Store) current() ([]Key, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, err := os.ReadFile(s.path)
	if errors.Is(err, os.ErrNotExist) {
		b, err = nil, nil
	}
	if err != nil {
		return nil, err
	}
	if s.read && bytes.Equal(b, s.raw) {
		return s.keys, nil
	}
	keys, err := parse(s.path, b)
	if err != nil {
		return nil, err
	}
	s.keys, s.raw, s.read = keys, b, true
	return keys, nil
}

func load(path string) ([]Key, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return parse(path, b)
}

func parse(path string, b []byte) ([]Key, error) {
	if len(b) == 0 {
		return nil, nil
	}
	var f struct {
		Keys []Key `json:"keys"`
	}
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, fmt.Errorf("%s: %v (fix or remove the file; its keys then stop working)", path, err)
	}
	return f.Keys, nil
}

// edit runs fn on the keys under an exclusive flock of ROOT/keys.json.lock and writes
// the result atomically (a temporary file, fsync, rename, fsync of the directory): a
// crash leaves the old file or the new one.
func (s *Store) edit(fn func([]Key) ([]Key, error)) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("API keys are managed by root (the keys file %s is root's): run as root", s.path)
	}
	dir := filepath.Dir(s.path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	unlock, err := hostids.LockFile(s.path+".lock", lockWait, "another `deltabox key` command")
	if err != nil {
		return err
	}
	defer unlock()
	keys, err := load(s.path)
	if err != nil {
		return err
	}
	keys, err = fn(keys)
	if err != nil {
		return err
	}
	b, err := json.MarshalIndent(struct {
		Keys []Key `json:"keys"`
	}{keys}, "", "  ")
	if err != nil {
		return err
	}
	tmp := s.path + ".new"
	os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(append(b, '\n')); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, s.path); err != nil {
		return err
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// Create makes a key named name and returns it; only its hash is stored.
func (s *Store) Create(name string) (string, error) {
	if !nameRE.MatchString(name) {
		return "", fmt.Errorf("key name %q: use 1-63 of A-Z a-z 0-9 . _ -: %w", name, errdefs.ErrInvalid)
	}
	var raw [20]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return "", err
	}
	key := Prefix + hex.EncodeToString(raw[:])
	err := s.edit(func(keys []Key) ([]Key, error) {
		for _, k := range keys {
			if k.Name == name {
				return nil, fmt.Errorf("a key named %s exists (deltabox key rm %s first, or pick another name): %w", name, name, errdefs.ErrConflict)
			}
		}
		return append(keys, Key{Name: name, Hash: hashOf(key), Created: time.Now().UTC().Truncate(time.Second)}), nil
	})
	if err != nil {
		return "", err
	}
	return key, nil
}

// Remove revokes the key named name.
func (s *Store) Remove(name string) error {
	return s.edit(func(keys []Key) ([]Key, error) {
		out := keys[:0]
		for _, k := range keys {
			if k.Name != name {
				out = append(out, k)
			}
		}
		if len(out) == len(keys) {
			return nil, fmt.Errorf("no key named %q (deltabox key ls lists them): %w", name, errdefs.ErrNotFound)
		}
		return out, nil
	})
}

// List is the keys (names and creation times), by name.
func (s *Store) List() ([]Key, error) {
	keys, err := load(s.path)
	if err != nil {
		return nil, err
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].Name < keys[j].Name })
	return keys, nil
}
