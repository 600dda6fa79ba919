// Package deadline runs child processes that must finish by a deadline.
//
// A child that never returns hangs whatever waits for it: on some VMs CRIU 4.1.1
// waited for ever for a hardware-breakpoint trap that the kernel never delivered, and
// `scripts/test.sh` sat 20 minutes in one `criu dump` before it failed. So every child
// the benches and tests wait for runs through Command: it leads its own process group
// (CRIU, python and cp fork), the whole group gets SIGKILL when the deadline passes or
// the caller's context ends, and the error then names what did not finish and within
// how long, instead of a bare "signal: killed".
package deadline

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// waitDelay bounds Wait once the child is gone: a grandchild that left the process
// group (setsid) and kept a pipe of ours open would otherwise keep Wait copying.
const waitDelay = 5 * time.Second

// TimeoutError is the error of a command that did not finish within its deadline.
// It wraps context.DeadlineExceeded.
type TimeoutError struct {
	What    string
	Timeout time.Duration
}

func (e *TimeoutError) Error() string {
	return fmt.Sprintf("%s did not finish within %v (killed with its process group)", e.What, e.Timeout)
}

func (e *TimeoutError) Unwrap() error { return context.DeadlineExceeded }

// Cmd is an exec.Cmd with a deadline. Set its fields (Dir, Env, Stdout, ..., What) as
// for exec.Cmd, then call Run, Output, CombinedOutput, or Start and Wait.
type Cmd struct {
	*exec.Cmd
	// What names the command in errors; by default its program and first arguments.
	What string

	timeout time.Duration
	ctx     context.Context
	cancel  context.CancelFunc
	expired error // ctx's cause when the deadline passed
}

// Command returns a command that is killed, with its process group, timeout after
// this call or when ctx ends, whichever comes first. The clock starts here: create the
// command right before it runs.
func Command(ctx context.Context, timeout time.Duration, name string, args ...string) *Cmd {
	c := &Cmd{timeout: timeout, What: describe(name, args), expired: errors.New("deadline passed")}
	c.ctx, c.cancel = context.WithTimeoutCause(ctx, timeout, c.expired)
	c.Cmd = exec.CommandContext(c.ctx, name, args...)
	c.Cmd.Cancel = func() error {
		// The group, not only the child: what it forked dies with it.
		if err := syscall.Kill(-c.Process.Pid, syscall.SIGKILL); err != nil && err != syscall.ESRCH {
			return err
		}
		return nil
	}
	c.Cmd.WaitDelay = waitDelay
	return c
}

func describe(name string, args []string) string {
	parts := []string{filepath.Base(name)}
	for _, a := range args {
		if len(parts) == 4 {
			parts = append(parts, "...")
			break
		}
		if len(a) > 40 || strings.ContainsAny(a, "\n") {
			a = a[:min(len(a), 40)]
			if i := strings.IndexByte(a, '\n'); i >= 0 {
				a = a[:i]
			}
			a += "..."
		}
		parts = append(parts, a)
	}
	return strings.Join(parts, " ")
}

// Start starts the command in a new process group (unless SysProcAttr asks for a new
// session, which makes one too).
func (c *Cmd) Start() error {
	if c.SysProcAttr == nil {
		c.SysProcAttr = &syscall.SysProcAttr{}
	}
	if !c.SysProcAttr.Setsid {
		c.SysProcAttr.Setpgid = true
	}
	if err := c.Cmd.Start(); err != nil {
		c.cancel()
		return fmt.Errorf("start %s: %w", c.What, err)
	}
	return nil
}

// Wait waits for the command; past the deadline it returns a *TimeoutError, after the
// caller's context ended an error wrapping the context's.
func (c *Cmd) Wait() error {
	err := c.Cmd.Wait()
	defer c.cancel()
	return c.explain(err)
}

func (c *Cmd) explain(err error) error {
	if err == nil || c.ctx.Err() == nil {
		return err
	}
	if context.Cause(c.ctx) == c.expired {
		return &TimeoutError{What: c.What, Timeout: c.timeout}
	}
	return fmt.Errorf("%s was stopped (killed with its process group): %w", c.What, context.Cause(c.ctx))
}

// Run starts the command and waits for it.
func (c *Cmd) Run() error {
	if err := c.Start(); err != nil {
		return err
	}
	return c.Wait()
}

// Output runs the command and returns its stdout (see exec.Cmd.Output).
func (c *Cmd) Output() ([]byte, error) {
	if c.Stdout != nil {
		return nil, errors.New("deadline: Stdout already set")
	}
	var out, stderr bytes.Buffer
	c.Stdout = &out
	captured := c.Stderr == nil
	if captured {
		c.Stderr = &stderr
	}
	err := c.Run()
	var ee *exec.ExitError
	if captured && errors.As(err, &ee) {
		ee.Stderr = stderr.Bytes()
	}
	return out.Bytes(), err
}

// CombinedOutput runs the command and returns its stdout and stderr together.
func (c *Cmd) CombinedOutput() ([]byte, error) {
	if c.Stdout != nil || c.Stderr != nil {
		return nil, errors.New("deadline: Stdout or Stderr already set")
	}
	var out bytes.Buffer // one writer for both: exec.Cmd then writes from one goroutine
	c.Stdout, c.Stderr = &out, &out
	err := c.Run()
	return out.Bytes(), err
}
