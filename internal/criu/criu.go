// Package criu runs the CRIU binary that scripts/setup.sh builds (CRIU 4.1.1 in
// /opt/deltabox/criu, because Debian bookworm's criu fails `criu check` on this kernel).
// It builds the exact command lines, so that a caller can record what it ran, and
// turns a failure into an error that quotes the end of CRIU's log.
package criu

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
)

// DefaultPath is where scripts/setup.sh installs CRIU.
const DefaultPath = "/opt/deltabox/criu/sbin/criu"

// Find returns the CRIU binary: DefaultPath if it is there, else criu on PATH.
func Find() (string, error) {
	if st, err := os.Stat(DefaultPath); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
		return DefaultPath, nil
	}
	p, err := exec.LookPath("criu")
	if err != nil {
		return "", fmt.Errorf("no CRIU at %s nor on PATH (scripts/setup.sh builds it): %w", DefaultPath, err)
	}
	return p, nil
}

// Log files CRIU writes into the images directory (-o is relative to -D).
const (
	DumpLog    = "dump.log"
	RestoreLog = "restore.log"
)

// DumpArgs is `criu dump` of the process tree rooted at pid into dir. With
// leaveRunning the tree goes on running after the dump (else CRIU kills it). -v1
// logs errors only, so that logging costs the dump nothing measurable.
func DumpArgs(bin string, pid int, dir string, leaveRunning bool) []string {
	a := []string{bin, "dump", "-t", strconv.Itoa(pid), "-D", dir, "-v1", "-o", DumpLog}
	if leaveRunning {
		a = append(a, "--leave-running")
	}
	return a
}

// RestoreArgs is `criu restore` of the images in dir, detached (-d): the command
// returns once the restored tree runs, which is then reparented to the caller's
// nearest child subreaper (or to init).
func RestoreArgs(bin, dir string) []string {
	return []string{bin, "restore", "-D", dir, "-d", "-v1", "-o", RestoreLog}
}

// Run runs a CRIU command line (argv[0] is the binary). logName is the log file in
// dir, quoted on failure.
func Run(ctx context.Context, argv []string, dir, logName string) error {
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	if err == nil {
		return nil
	}
	msg := strings.TrimSpace(string(out))
	if b, e := os.ReadFile(filepath.Join(dir, logName)); e == nil {
		msg = strings.TrimSpace(msg + "\n" + tail(string(b), 2000))
	}
	return fmt.Errorf("%s: %v: %s", strings.Join(argv, " "), err, msg)
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}
