// Package procfs reads the few facts the daemon needs about a process from
// /proc/PID/status, /proc/PID/stat and /proc/PID/statm (memory.go), and the host's CPU
// pressure (pressure.go), parsed in one place.
//
// A process's PID differs in every PID namespace it is visible in: the daemon sees
// host PIDs, a sandbox's init and its commands see the sandbox's. The kernel lists them
// all in the status file's NSpid line, outermost (the reader's namespace) first and the
// process's own namespace last (Documentation/filesystems/proc.rst). Every translation
// between the two goes through NSpid here.
package procfs

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
)

// ErrNoNSpid is returned when a status file has no NSpid line (a kernel before 4.1).
var ErrNoNSpid = errors.New("no NSpid line in /proc/PID/status")

// ParseNSpid returns the PIDs of the NSpid line of a /proc/PID/status file's content,
// outermost namespace first.
func ParseNSpid(status []byte) ([]int, error) {
	for _, l := range bytes.Split(status, []byte("\n")) {
		rest, ok := bytes.CutPrefix(l, []byte("NSpid:"))
		if !ok {
			continue
		}
		f := bytes.Fields(rest)
		if len(f) == 0 {
			return nil, ErrNoNSpid
		}
		out := make([]int, len(f))
		for i, s := range f {
			n, err := strconv.Atoi(string(s))
			if err != nil {
				return nil, errors.New("bad NSpid line in /proc/PID/status: " + string(l))
			}
			out[i] = n
		}
		return out, nil
	}
	return nil, ErrNoNSpid
}

// NSpid returns hostPid's PIDs in each PID namespace it is visible in, outermost first
// (so the first is hostPid itself and the last its PID in its own namespace). The error
// is the read's when the process is gone.
func NSpid(hostPid int) ([]int, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(hostPid) + "/status")
	if err != nil {
		return nil, err
	}
	return ParseNSpid(b)
}

// InnerPid returns hostPid's PID in its own (innermost) PID namespace.
func InnerPid(hostPid int) (int, error) {
	ns, err := NSpid(hostPid)
	if err != nil {
		return 0, err
	}
	return ns[len(ns)-1], nil
}

// Stat returns the fields of /proc/pid/stat from field 3 (state) on: the comm before
// them may hold spaces and parentheses, so the fields start after its last ')'. Field n
// of proc(5) is at index n-3 (starttime, 22, at 19).
func Stat(pid int) ([][]byte, error) {
	rest, err := afterComm(pid)
	if err != nil {
		return nil, err
	}
	return bytes.Fields(rest), nil
}

// StatFields is Stat of a /proc/PID/stat already read (b, read through a sandbox's
// proc, for one): the fields from state on, nil if b has no comm.
func StatFields(b []byte) [][]byte {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return bytes.Fields(b[i+1:])
}

// State returns the state letter of /proc/pid/stat (R, S, T, t, Z...), or 0 if the
// process is gone. It splits nothing: a restore asks it of every template.
func State(pid int) byte {
	rest, err := afterComm(pid)
	if err != nil {
		return 0
	}
	return rest[1]
}

// afterComm returns /proc/pid/stat from the space after the comm's last ')' on, at
// least two bytes (the space and the state).
func afterComm(pid int) ([]byte, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return nil, errors.New("/proc/" + strconv.Itoa(pid) + "/stat: no state after the comm")
	}
	return b[i+1:], nil
}

// StatusUint returns the number on the line "key:" of a /proc/PID/status file's content
// (voluntary_ctxt_switches, for one).
func StatusUint(status []byte, key string) (uint64, error) {
	for _, l := range bytes.Split(status, []byte("\n")) {
		rest, ok := bytes.CutPrefix(l, []byte(key+":"))
		if !ok {
			continue
		}
		return strconv.ParseUint(string(bytes.TrimSpace(rest)), 10, 64)
	}
	return 0, errors.New("no " + key + " line in /proc/PID/status")
}

// StartTime returns /proc/pid/stat's starttime (field 22, clock ticks after boot): with
// the PID, what names one process for good (a PID is reused, a PID and start time are
// not).
func StartTime(pid int) (uint64, error) {
	f, err := Stat(pid)
	if err != nil {
		return 0, err
	}
	if len(f) < 20 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields, no starttime", pid, len(f)+2)
	}
	return strconv.ParseUint(string(f[19]), 10, 64)
}

// PPid returns hostPid's parent, as seen from the caller's PID namespace (field 4 of
// /proc/PID/stat).
func PPid(hostPid int) (int, error) {
	f, err := Stat(hostPid)
	if err != nil {
		return 0, err
	}
	if len(f) < 2 {
		return 0, fmt.Errorf("process %d: unreadable stat", hostPid)
	}
	return strconv.Atoi(string(f[1]))
}
