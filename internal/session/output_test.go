package session

import (
	"bytes"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"unicode/utf8"
)

// TestOutputKeepsHeadAndTail: within the limit everything is kept; over it, the first
// quarter and the last three quarters, and the marker counts exactly what went, however
// the bytes were split into reads.
func TestOutputKeepsHeadAndTail(t *testing.T) {
	var whole bytes.Buffer
	for i := 0; i < 5000; i++ {
		fmt.Fprintf(&whole, "line %d\r\n", i)
	}
	raw := whole.Bytes()
	clean := strings.ReplaceAll(string(raw), "\r\n", "\n")
	for _, step := range []int{1, 7, 4096, len(raw)} {
		for _, limit := range []int{len(clean), len(clean) - 1, 1000} {
			var streamed strings.Builder
			o := newOutput(limit, func(b []byte) { streamed.Write(b) })
			for i := 0; i < len(raw); i += step {
				o.add(raw[i:min(i+step, len(raw))])
			}
			o.finish(false)
			got, trunc := o.result()
			if streamed.String() != clean {
				t.Fatalf("step %d limit %d: the stream is not the output", step, limit)
			}
			if limit >= len(clean) {
				if trunc || got != clean {
					t.Fatalf("step %d limit %d: truncated %v, %d bytes of %d", step, limit, trunc, len(got), len(clean))
				}
				continue
			}
			head, tail := limit/4, limit-limit/4
			want := clean[:head] + fmt.Sprintf("\n[deltabox: output truncated: %d bytes dropped here; kept the first %d and the last %d of %d bytes]\n",
				len(clean)-head-tail, head, tail, len(clean)) + clean[len(clean)-tail:]
			if !trunc || got != want {
				t.Fatalf("step %d limit %d: got %d bytes %q...%q", step, limit, len(got), got[:min(80, len(got))], got[max(0, len(got)-80):])
			}
		}
	}
}

// TestOutputCutsOnCharacters: a kept head or tail never ends or starts inside a
// UTF-8 sequence; the count says what went.
func TestOutputCutsOnCharacters(t *testing.T) {
	s := strings.Repeat("é€😀", 1000)
	for limit := 40; limit < 60; limit++ {
		o := newOutput(limit, nil)
		o.add([]byte(s))
		o.finish(false)
		got, _ := o.result()
		if !utf8.ValidString(got) {
			t.Fatalf("limit %d: invalid UTF-8: %q", limit, got)
		}
		var dropped, head, tail, total int
		if _, err := fmt.Sscanf(got[strings.Index(got, "[deltabox"):], "[deltabox: output truncated: %d bytes dropped here; kept the first %d and the last %d of %d bytes]",
			&dropped, &head, &tail, &total); err != nil {
			t.Fatal(err)
		}
		if total != len(s) || dropped+head+tail != total || head > limit/4 || tail > limit-limit/4 || head < limit/4-3 || tail < limit-limit/4-3 {
			t.Fatalf("limit %d: %q", limit, got)
		}
	}
}

// TestOutputDropsTheUnwindNewline: the newline bash prints when exit or errexit ends a
// call (the sentinel's ":x") is held back from the stream and dropped; any other
// trailing newline, or a lone "\r", is passed on at the end.
func TestOutputDropsTheUnwindNewline(t *testing.T) {
	for _, c := range []struct {
		in      []string
		unwound bool
		want    string
	}{
		{[]string{"hi\r\n", "\r\n"}, true, "hi\n"},
		{[]string{"hi\r", "\n\r", "\n"}, true, "hi\n"},
		{[]string{"hi\r\n", "\r\n"}, false, "hi\n\n"},
		{[]string{"no newline\r\n"}, true, "no newline"},
		{[]string{"progress\r"}, false, "progress\r"},
		{[]string{"a\r\nb\r\n"}, false, "a\nb\n"},
	} {
		var streamed strings.Builder
		o := newOutput(1<<20, func(b []byte) { streamed.Write(b) })
		for _, in := range c.in {
			o.add([]byte(in))
		}
		o.finish(c.unwound)
		if got, _ := o.result(); got != c.want || streamed.String() != c.want {
			t.Errorf("%q unwound %v: result %q, streamed %q, want %q", c.in, c.unwound, got, streamed.String(), c.want)
		}
	}
}

func TestParseSentinel(t *testing.T) {
	for _, c := range []struct {
		in      string
		n       int
		partial bool
		want    sentinel
	}{
		{"\x1eDBX:abc:0\x1erest", 11, false, sentinel{id: "abc"}},
		{"\x1eDBX::-1\x1e", 9, false, sentinel{status: -1}},
		{"\x1eDBX:ID:3:x\x1e", 12, false, sentinel{id: "ID", status: 3, unwound: true}},
		{"\x1eDB", 0, true, sentinel{}},
		{"\x1eDBX:ID:3", 0, true, sentinel{}},
		{"\x1eDBY", 0, false, sentinel{}},
		{"\x1eDBX:ID:3:y\x1e", 0, false, sentinel{}},
		{"\x1eDBX:ID:+3\x1e", 0, false, sentinel{}},
		{"\x1eDBX:ID:\x1e", 0, false, sentinel{}},
		{"\x1eDBX:" + strings.Repeat("a", maxSentinel), 0, false, sentinel{}},
	} {
		s, n, partial := parseSentinel([]byte(c.in))
		if n != c.n || partial != c.partial || s != c.want {
			t.Errorf("%q: %+v %d %v, want %+v %d %v", c.in, s, n, partial, c.want, c.n, c.partial)
		}
	}
}

// TestBashQuoteRoundTrips: the $'...' words, concatenated, are the code again for bash
// (NUL aside), and they hold nothing but printable ASCII and no '!'.
func TestBashQuoteRoundTrips(t *testing.T) {
	var all strings.Builder
	for c := 0; c < 256; c++ {
		all.WriteByte(byte(c))
	}
	code := all.String() + "é€😀 'quoted' \\back\\ !! $HOME `x` \"d\"\n" + strings.Repeat("x", 100)
	pieces := bashQuote(code, 50)
	var words []string
	for _, p := range pieces {
		if len(p) > 50 || strings.ContainsAny(p, "!'") {
			t.Fatalf("piece %q: over 50 bytes, or a ! or ' in it", p)
		}
		for _, c := range []byte(p) {
			if c < 0x20 || c >= 0x7f {
				t.Fatalf("piece %q holds byte %#x", p, c)
			}
		}
		words = append(words, "$'"+p+"'")
	}
	out, err := exec.Command("bash", "-c", "printf %s "+strings.Join(words, "")).Output()
	if err != nil {
		t.Skipf("no bash here: %v", err)
	}
	if want := strings.ReplaceAll(code, "\x00", ""); string(out) != want {
		t.Fatalf("bash decoded\n%q\nwant\n%q", out, want)
	}
	if p := bashQuote("", 50); len(p) != 1 || p[0] != "" {
		t.Fatalf("empty code: %q", p)
	}
}
