package sbinit

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// User is a run-as user resolved in a sandbox's own /etc/passwd and /etc/group.
type User struct {
	Name   string // "" for a numeric user the passwd file does not list
	UID    uint32
	GID    uint32
	Groups []uint32 // supplementary groups: those of /etc/group that list Name
	Home   string   // from passwd; "/" for a numeric user it does not list
}

// maxIDFile caps what is read of /etc/passwd or /etc/group: they are the sandbox's,
// written by its code, and init's spawn thread must not read without bound. A real one
// holds tens of entries (the default image's passwd: under 1 KiB).
const maxIDFile = 4 << 20

// LookupUser resolves spec ("NAME", "UID", "NAME:GROUP", "UID:GID", any mix) in the
// passwd and group files under root, an fd on the sandbox's root directory.
//
// The files are the sandbox's and hostile: they are opened with openat2
// RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS (a symlink cannot leave root or go through
// /proc's magic links), O_NOFOLLOW and O_NONBLOCK, refused unless regular (a FIFO
// would block the opener for ever), and read up to maxIDFile bytes.
//
// A numeric UID need not be listed: it runs with GID = the UID (not 0, as Docker does:
// group root often owns writable system files) unless a group is given, and HOME "/".
func LookupUser(root int, spec string) (*User, error) {
	name, group, hasGroup := strings.Cut(spec, ":")
	if name == "" || (hasGroup && group == "") || strings.ContainsAny(spec, "\n\x00") {
		return nil, fmt.Errorf("user %q: give NAME, UID, NAME:GROUP or UID:GID", spec)
	}
	u := &User{Home: "/"}
	uid, numeric := parseID(name)
	passwd, perr := readIDFile(root, "etc/passwd")
	if perr != nil && !numeric {
		return nil, fmt.Errorf("user %q: %w; give a numeric user (\"1000\" or \"1000:1000\")", spec, perr)
	}
	found := false
	var names []string
	for _, f := range idLines(passwd, 7) {
		id, ok := parseID(f[2])
		gid, gok := parseID(f[3])
		if !ok || !gok {
			continue
		}
		names = append(names, f[0])
		if found || !(f[0] == name || numeric && id == uid) {
			continue
		}
		found = true
		u.Name, u.UID, u.GID, u.Home = f[0], id, gid, f[5]
	}
	switch {
	case found:
	case numeric:
		u.UID, u.GID = uid, uid
	default:
		return nil, fmt.Errorf("no user %q in the sandbox's /etc/passwd (it lists %s); give one of those, or a numeric user (\"1000\" or \"1000:1000\")", name, listNames(names))
	}
	if u.Home == "" {
		u.Home = "/"
	}
	groups, gerr := readIDFile(root, "etc/group")
	if hasGroup {
		gid, gnum := parseID(group)
		if !gnum && gerr != nil {
			return nil, fmt.Errorf("user %q: %w; give a numeric group (\"1000:1000\")", spec, gerr)
		}
		gfound := gnum
		var gnames []string
		for _, f := range idLines(groups, 4) {
			id, ok := parseID(f[2])
			if !ok {
				continue
			}
			gnames = append(gnames, f[0])
			if !gfound && f[0] == group {
				gid, gfound = id, true
			}
		}
		if !gfound {
			return nil, fmt.Errorf("no group %q in the sandbox's /etc/group (it lists %s)", group, listNames(gnames))
		}
		u.GID = gid
	}
	// Supplementary groups as initgroups(3) makes them: the primary group, then every
	// group that lists the user by name.
	u.Groups = []uint32{u.GID}
	if u.Name != "" {
		for _, f := range idLines(groups, 4) {
			id, ok := parseID(f[2])
			if !ok || id == u.GID {
				continue
			}
			for _, m := range strings.Split(f[3], ",") {
				if m == u.Name {
					u.Groups = append(u.Groups, id)
					break
				}
			}
		}
	}
	return u, nil
}

// parseID parses a uid or gid: decimal, below 2^32-1 ((uid_t)-1 means "unchanged" to
// setresuid).
func parseID(s string) (uint32, bool) {
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil || n == 1<<32-1 {
		return 0, false
	}
	return uint32(n), true
}

// listNames says what a file lists, for an error: the first 20 names.
func listNames(names []string) string {
	if len(names) == 0 {
		return "no entries"
	}
	if len(names) > 20 {
		return strings.Join(names[:20], ", ") + fmt.Sprintf(" and %d more", len(names)-20)
	}
	return strings.Join(names, ", ")
}

// idLines splits a passwd or group file into lines of n colon-separated fields, skipping
// comments and malformed lines (as glibc's files backend does).
func idLines(b []byte, n int) [][]string {
	var out [][]string
	for _, line := range bytes.Split(b, []byte{'\n'}) {
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		f := strings.Split(string(line), ":")
		if len(f) != n || f[0] == "" {
			continue
		}
		out = append(out, f)
	}
	return out
}

// readIDFile reads rel (relative to root) with LookupUser's precautions.
func readIDFile(root int, rel string) ([]byte, error) {
	fd, err := unix.Openat2(root, rel, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_NOCTTY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	})
	if errors.Is(err, unix.ENOENT) {
		return nil, fmt.Errorf("the sandbox has no /%s", rel)
	}
	if err != nil {
		return nil, fmt.Errorf("open the sandbox's /%s: %w", rel, err)
	}
	f := os.NewFile(uintptr(fd), rel)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("the sandbox's /%s is not a regular file", rel)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxIDFile+1))
	if err != nil {
		return nil, fmt.Errorf("read the sandbox's /%s: %w", rel, err)
	}
	if len(b) > maxIDFile {
		return nil, fmt.Errorf("the sandbox's /%s is over %d MiB", rel, maxIDFile>>20)
	}
	return b, nil
}
