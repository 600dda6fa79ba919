"""What run() tells its caller, byte for byte (issue 16): output and stdin are bytes,
kept output is the head and the tail with the count of what was dropped, a streamed
call's result is not sent twice, the client's timeout bounds run(), an abandoned call
interrupts its command (a session's included), and file names that are not UTF-8 can
be listed and named again. Run like test_client.py (tests/e2e/pyclient_test.go)."""

import os
import re
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(HERE)
if os.environ.get("DELTABOX_TEST_INSTALLED") != "1" and SRC not in sys.path:
    sys.path.insert(0, SRC)

from deltabox import Client, Result, Sandbox  # noqa: E402

SOCKET = os.environ.get("DELTABOX_SOCKET")
NO_DAEMON = ("DELTABOX_SOCKET is not set: no daemon to test against (run `go test "
             "./tests/e2e -run TestPythonClient`, which starts a private one)")

MARKER = re.compile(r"\[deltabox: (\d+) bytes of (stdout|stderr) dropped\]")


class OfflineResultTest(unittest.TestCase):
    def test_result_made_from_text_has_its_bytes(self):
        r = Result(exit_code=0, stdout="h\u00e9", stderr="e")
        self.assertEqual((r.stdout_bytes, r.stderr_bytes), (b"h\xc3\xa9", b"e"))

    def test_result_from_a_base64_answer(self):
        r = Result.from_api({"exit_code": 0, "encoding": "base64", "stdout": "/wBh", "stderr": "",
                             "timeout_ms": 1500, "stdout_dropped": 7, "stdout_truncated": True})
        self.assertEqual(r.stdout_bytes, b"\xff\x00a")
        self.assertEqual(r.stdout, "\ufffd\x00a")
        self.assertEqual((r.timeout, r.stdout_dropped, r.truncated), (1.5, 7, True))


@unittest.skipUnless(SOCKET, NO_DAEMON)
class ExecTruthTest(unittest.TestCase):
    client: Client  # set by setUpClass

    @classmethod
    def setUpClass(cls):
        cls.client = Client(SOCKET, timeout=120)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def sandbox(self, client=None):
        sb = Sandbox.create(client=client or self.client)
        self.addCleanup(sb.close)
        return sb

    def test_run_is_binary_safe(self):
        # On main: stdin=b"\xff" raised UnicodeDecodeError, and output that was not
        # UTF-8 came back with U+FFFD.
        sb = self.sandbox()
        blob = bytes(range(256)) * 64
        r = sb.run("cat", stdin=blob, timeout=60)
        self.assertEqual(r.stdout_bytes, blob)
        self.assertEqual(r.stdout, blob.decode("utf-8", "replace"))
        self.assertEqual(sb.run("cat", stdin=b"\xff", timeout=60).stdout_bytes, b"\xff")
        self.assertEqual(sb.run("cat >&2", stdin=blob, timeout=60).stderr_bytes, blob)
        # Streamed: the bytes are exact, and on_output's text is decoded across pieces
        # (a character cut by a read is not replaced).
        pieces = []
        r = sb.run("cat", stdin=blob, on_output=lambda s, d: pieces.append(d), timeout=60)
        self.assertEqual(r.stdout_bytes, blob)
        text = "\u00e9\u20ac" * 100000
        pieces = []
        r = sb.run(["python3", "-c", "import sys; sys.stdout.write('\u00e9\u20ac' * 100000)"],
                   on_output=lambda s, d: pieces.append(d), timeout=60)
        self.assertEqual("".join(pieces), text)
        self.assertEqual(r.stdout, text)

    def test_output_keeps_head_and_tail(self):
        # On main the first output_limit bytes were kept: the end (END) was lost.
        sb = self.sandbox()
        full = "".join("%d\n" % i for i in range(1, 100001)) + "END\n"
        for streamed in (False, True):
            got = []
            r = sb.run("seq 1 100000; echo END", output_limit=4000, timeout=60,
                       on_output=(lambda s, d: got.append(d)) if streamed else None)
            dropped = len(full) - 4000
            want = full[:1000] + "\n[deltabox: %d bytes of stdout dropped]\n" % dropped + full[-3000:]
            what = "streamed" if streamed else "whole"
            self.assertTrue(r.stdout == want, "%s: %r...%r, want %r...%r" % (
                what, r.stdout[:40], r.stdout[-1100:], want[:40], want[-1100:]))
            self.assertEqual((r.stdout_dropped, r.stdout_truncated), (dropped, True))
            if streamed:
                self.assertTrue("".join(got) == want, "on_output: %r" % "".join(got)[-1100:])

    def test_streamed_result_is_not_sent_twice(self):
        # On main the result event repeated the whole output already streamed.
        sb = self.sandbox()
        events = []
        t = self.client._t
        stream = t.stream

        def spy(*a, **kw):
            for ev in stream(*a, **kw):
                events.append(ev)
                yield ev
        t.stream = spy
        try:
            r = sb.run("head -c 300000 /dev/zero | tr '\\0' y", on_output=lambda s, d: None, timeout=60)
        finally:
            del t.stream
        self.assertEqual(r.stdout, "y" * 300000)
        res = [ev["result"] for ev in events if ev.get("type") == "result"]
        self.assertEqual(len(res), 1)
        self.assertEqual((res[0]["stdout"], res[0]["stderr"]), ("", ""))

    def test_client_timeout_bounds_run(self):
        # On main Client(timeout=3) did not bound sb.run("sleep 100").
        c = Client(SOCKET, timeout=3)
        self.addCleanup(c.close)
        sb = self.sandbox(client=c)
        for session in (None, "main"):
            start = time.monotonic()
            r = sb.run("echo go; sleep 100", session=session)
            took = time.monotonic() - start
            self.assertTrue(r.timed_out, (session, r))
            self.assertEqual(r.timeout, 3.0)
            self.assertIn("go", r.stdout)
            self.assertLess(took, 20, "session %r: %.1fs" % (session, took))
        # timeout=None is none at all; the next session call is clean.
        r = sb.run("echo next", session="main", timeout=None)
        self.assertEqual((r.stdout, r.timeout), ("next\n", None))

    def test_abandoned_session_call_is_interrupted(self):
        # On main an abandoned session call ran on: the next call waited for it and
        # got its output.
        sb = self.sandbox()

        class Stop(Exception):
            pass

        def on_output(stream, data):
            if "go" in data:
                raise Stop()

        with self.assertRaises(Stop):
            sb.run("echo go; sleep 60; echo late", session="main", on_output=on_output, timeout=120)
        start = time.monotonic()
        r = sb.run("echo next", session="main", timeout=30)
        self.assertEqual(r.stdout, "next\n")
        self.assertLess(time.monotonic() - start, 5)
        self.assertNotIn("sleep", sb.run(["ps", "-eo", "comm"], timeout=30).stdout)

    def test_non_utf8_file_names(self):
        # On main the listing replaced the bytes with U+FFFD: the file could not be
        # named again.
        sb = self.sandbox()
        sb.run("mkdir d; printf content > d/$'caf\\xe9.txt'; mkdir d/$'r\\xe9p'", timeout=30).check()
        entries = sb.files.list("d")
        self.assertEqual(entries.names, ["caf\udce9.txt", "r\udce9p"])
        sub = sb.files.list(entries[1].path)
        self.assertEqual(sub.path.encode("utf-8", "surrogateescape"), b"/workspace/d/r\xe9p")
        e = entries[0]
        self.assertEqual(e.path_bytes, b"/workspace/d/caf\xe9.txt")
        self.assertEqual(sb.files.read(e.path), b"content")
        self.assertEqual(sb.files.stat(e.path).name, e.name)


if __name__ == "__main__":
    unittest.main()
