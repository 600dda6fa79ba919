// Package mainthread keeps the main goroutine on the process's main thread for the
// process's whole life. Import it (blank) from every package that discards OS threads.
//
// Several goroutines here lock an OS thread and exit without unlocking it, so that the
// thread, whose mount namespace, fs state or cgroup they changed (setns, unshare
// CLONE_FS), dies with them: the sandbox init's spawn threads, the daemon's namespace
// builders (package mountns), the tracer threads (package remote). Go cannot end the
// main thread: a goroutine that exits locked to it leaves it wedged, asleep for good in
// whatever namespace it entered. The init's /proc/1/mountinfo then showed the sandbox's
// first state, whose read-write overlay, its upper frozen at the first checkpoint, stayed
// mounted for the sandbox's life (TestTemplatesParkedOnReadOnlyView caught it about once
// in 40 runs). A main goroutine locked to the main thread from package initialisation
// on (the runtime itself locks it there during init) leaves the thread to that goroutine
// alone, so no such goroutine can ever run on it.
package mainthread

import "runtime"

func init() { runtime.LockOSThread() }
