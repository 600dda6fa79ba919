package mainthread

import (
	"runtime"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// TestNoGoroutineDiscardsTheMainThread: goroutines that lock a thread and exit without
// unlocking it (as the spawn, namespace and tracer goroutines do) never run on the main
// thread (its TID is the PID), so none can leave it wedged in a namespace it entered.
func TestNoGoroutineDiscardsTheMainThread(t *testing.T) {
	pid := unix.Getpid()
	var wg sync.WaitGroup
	var mu sync.Mutex
	onMain := 0
	for i := 0; i < 2000; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread() // never unlocked: the thread is discarded
			if unix.Gettid() == pid {
				mu.Lock()
				onMain++
				mu.Unlock()
			}
		}()
		if i%50 == 0 {
			wg.Wait() // let the main thread go idle now and then
		}
	}
	wg.Wait()
	if onMain > 0 {
		t.Fatalf("%d goroutines that discard their thread ran on the main thread", onMain)
	}
}
