package deadline

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

func TestFinishesInTime(t *testing.T) {
	out, err := Command(context.Background(), 10*time.Second, "sh", "-c", "echo out; echo err >&2").CombinedOutput()
	if err != nil || string(out) != "out\nerr\n" {
		t.Fatalf("%q, %v", out, err)
	}
	_, err = Command(context.Background(), 10*time.Second, "sh", "-c", "echo why >&2; exit 3").Output()
	if err == nil || strings.Contains(err.Error(), "did not finish") {
		t.Fatalf("a failing command: %v", err)
	}
}

// A command whose child keeps our stdout pipe open is killed with that child at the
// deadline, and the error names it.
func TestDeadlineKillsTheGroup(t *testing.T) {
	c := Command(context.Background(), 200*time.Millisecond, "sh", "-c", "sleep 1000 & wait")
	c.What = "a sleeping shell"
	start := time.Now()
	_, err := c.Output()
	took := time.Since(start)
	var te *TimeoutError
	if !errors.As(err, &te) || !errors.Is(err, context.DeadlineExceeded) ||
		err.Error() != "a sleeping shell did not finish within 200ms (killed with its process group)" {
		t.Fatalf("error %v", err)
	}
	// Within waitDelay: the grandchild holding the pipe died with the group.
	if took > 2*time.Second {
		t.Fatalf("returned after %v", took)
	}
}

func TestCallerCancels(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	err := Command(ctx, time.Minute, "sleep", "1000").Run()
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "sleep 1000 was stopped") {
		t.Fatalf("error %v", err)
	}
}
