package session

import (
	"bytes"
	"fmt"
	"strconv"
	"unicode/utf8"
)

// output is one call's output as Run answers it: the terminal's bytes with "\r\n" turned
// into "\n", passed to emit (streaming) as they come, and kept within limit bytes: the
// first quarter of the limit (the head: what the command began with) and the last three
// quarters (the tail, where a test run's summary or an error is), with an exact count
// of what was dropped between them.
//
// A trailing newline is held back until more output comes or the call ends: the newline
// bash prints when a call ends by exit or errexit (bash.go) is not the code's output,
// and finish drops it from the stream and the answer alike.
type output struct {
	limit   int
	headMax int
	head    []byte
	tail    []byte // what came after head; trimmed to its last limit-headMax bytes when twice that
	total   int64  // bytes passed on (after "\r\n" -> "\n")
	held    []byte // a trailing "\r" (maybe the start of "\r\n") or "\n", not yet passed on
	emit    func([]byte)
	note    []byte // deltabox's own markers, after the output (not counted, not truncated)
}

func newOutput(limit int, emit func([]byte)) *output {
	return &output{limit: limit, headMax: limit / 4, emit: emit}
}

var crlf, lf = []byte("\r\n"), []byte("\n")

// add takes raw terminal bytes.
func (o *output) add(raw []byte) {
	if len(raw) == 0 {
		return
	}
	b := bytes.ReplaceAll(append(o.held, raw...), crlf, lf)
	o.held = o.held[:0]
	if c := b[len(b)-1]; c == '\r' || c == '\n' {
		o.held = append(o.held, c)
		b = b[:len(b)-1]
	}
	o.pass(b)
}

// finish passes on what is held; unwound (the sentinel's ":x") drops the trailing
// newline bash printed as it unwound the call.
func (o *output) finish(unwound bool) {
	if unwound && len(o.held) == 1 && o.held[0] == '\n' {
		o.held = o.held[:0]
	}
	o.pass(o.held)
	o.held = o.held[:0]
}

// holding reports whether a trailing newline is held back.
func (o *output) holding() bool { return len(o.held) > 0 }

// flushHeld passes on the held-back newline: nothing followed it in time, so it is the
// command's own.
func (o *output) flushHeld() {
	o.pass(o.held)
	o.held = o.held[:0]
}

// addNote appends a marker of deltabox's own (a timeout, the session's end) after the
// output, and streams it.
func (o *output) addNote(s string) {
	o.finish(false)
	o.note = append(o.note, s...)
	if o.emit != nil {
		o.emit([]byte(s))
	}
}

func (o *output) pass(b []byte) {
	if len(b) == 0 {
		return
	}
	o.total += int64(len(b))
	if o.emit != nil {
		o.emit(b)
	}
	if room := o.headMax - len(o.head); room > 0 {
		n := min(room, len(b))
		o.head = append(o.head, b[:n]...)
		b = b[n:]
	}
	o.tail = append(o.tail, b...)
	if keep := o.limit - o.headMax; len(o.tail) > 2*keep+4096 {
		o.tail = o.tail[:copy(o.tail, o.tail[len(o.tail)-keep:])]
	}
}

// result is the answer's output and whether some of it was dropped.
func (o *output) result() (string, bool) {
	keep := o.limit - o.headMax
	if o.total <= int64(o.limit) {
		return string(o.head) + string(o.tail) + string(o.note), false
	}
	head, tail := o.head, o.tail[len(o.tail)-keep:]
	// No character cut in two: a partial rune at the head's end or the tail's start goes.
	for i := len(head) - 1; i >= max(0, len(head)-utf8.UTFMax); i-- {
		if utf8.RuneStart(head[i]) {
			if !utf8.FullRune(head[i:]) {
				head = head[:i]
			}
			break
		}
	}
	for i := 0; i < utf8.UTFMax-1 && len(tail) > 0 && !utf8.RuneStart(tail[0]); i++ {
		tail = tail[1:]
	}
	dropped := o.total - int64(len(head)) - int64(len(tail))
	marker := fmt.Sprintf("\n[deltabox: output truncated: %d bytes dropped here; kept the first %d and the last %d of %d bytes]\n",
		dropped, len(head), len(tail), o.total)
	return string(head) + marker + string(tail) + string(o.note), true
}

// A sentinel is "\x1eDBX:<id>:<status>\x1e", or "...:<status>:x\x1e" for a bash call
// that exit or errexit ended (bash.go).
var sentinelPrefix = []byte("\x1eDBX:")

// maxSentinel bounds a sentinel's length (ids are 26 characters), so that a stray 0x1e
// in the output holds back no more than this while it might still begin one.
const maxSentinel = 96

// sentinel is a parsed sentinel.
type sentinel struct {
	id      string
	status  int
	unwound bool
}

// parseSentinel reads a sentinel at the start of b (b[0] == 0x1e): n is its length, 0
// if b does not start with one; partial says b could still become one as more comes.
func parseSentinel(b []byte) (s sentinel, n int, partial bool) {
	if len(b) < len(sentinelPrefix) {
		return s, 0, bytes.HasPrefix(sentinelPrefix, b)
	}
	if !bytes.HasPrefix(b, sentinelPrefix) {
		return s, 0, false
	}
	end := bytes.IndexByte(b[1:], 0x1e) + 1
	if end == 0 {
		return s, 0, len(b) < maxSentinel
	}
	f := bytes.Split(b[len(sentinelPrefix):end], []byte(":"))
	if len(f) < 2 || len(f) > 3 || (len(f) == 3 && string(f[2]) != "x") || len(f[1]) == 0 {
		return s, 0, false
	}
	rc, err := strconv.Atoi(string(f[1]))
	if err != nil || f[1][0] == '+' {
		return s, 0, false
	}
	return sentinel{id: string(f[0]), status: rc, unwound: len(f) == 3}, end + 1, false
}
