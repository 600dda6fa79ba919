package session

import "fmt"

// logBuf keeps the last size bytes written to it (a ring: a flood costs size bytes of
// memory and a copy of each byte once, whatever its length) and counts exactly what it
// dropped before them. A session's output that no call consumes goes here: a command
// session's output, and what a bash or python session prints between calls (a
// background job, a thread still writing after its call returned).
type logBuf struct {
	size    int
	b       []byte // grows to size, then wraps
	start   int    // where the oldest byte is once b is full
	dropped int64  // bytes written and no longer kept
}

func newLogBuf(size int) *logBuf { return &logBuf{size: size} }

func (l *logBuf) write(p []byte) {
	if over := len(p) - l.size; over > 0 {
		l.dropped += int64(over)
		p = p[over:]
	}
	if room := l.size - len(l.b); room > 0 {
		n := min(room, len(p))
		if len(l.b)+n > cap(l.b) {
			// Grow by doubling up to size, never past it: append's growth would round
			// a 1 MiB log up to 1.25 MiB.
			nb := make([]byte, len(l.b), min(l.size, max(2*cap(l.b), len(l.b)+n, 4096)))
			copy(nb, l.b)
			l.b = nb
		}
		l.b = append(l.b, p[:n]...)
		p = p[n:]
	}
	for len(p) > 0 {
		n := copy(l.b[l.start:], p)
		l.dropped += int64(n)
		l.start = (l.start + n) % l.size
		p = p[n:]
	}
}

// bytes returns a copy of what is kept, oldest first.
func (l *logBuf) bytes() []byte {
	out := make([]byte, 0, len(l.b))
	out = append(out, l.b[l.start:]...)
	return append(out, l.b[:l.start]...)
}

// reset drops everything (a call begins: what came before it is no call's output) and
// releases the memory.
func (l *logBuf) reset() { l.b, l.start, l.dropped = nil, 0, 0 }

// set replaces the content with p and the count of dropped bytes with dropped (a
// restore puts back the log of its checkpoint).
func (l *logBuf) set(p []byte, dropped int64) {
	l.reset()
	l.write(p)
	l.dropped += dropped
}

// withMarker is what the API answers for the log: the kept bytes, after a marker with
// the exact count of what went before them when anything did.
func (l *logBuf) withMarker() []byte {
	if l.dropped == 0 {
		return l.bytes()
	}
	m := fmt.Sprintf("[deltabox: %d earlier bytes dropped; the last %d kept]\n", l.dropped, len(l.b))
	return append([]byte(m), l.bytes()...)
}
