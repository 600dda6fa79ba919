"""Tests of the deltabox Python client (unittest, standard library only).

The DaemonTest cases talk to a real daemon whose socket is $DELTABOX_SOCKET and are
skipped when it is unset; the OfflineTest cases need no daemon. The project's
`go test ./...` runs this file against a private daemon (tests/e2e/pyclient_test.go):

    DELTABOX_SOCKET=/run/deltabox/deltabox.sock PYTHONPATH=clients/python \\
        python3 -m unittest discover -s clients/python/tests -v

The package is imported from the source tree (clients/python) unless
DELTABOX_TEST_INSTALLED=1, which tests the installed one.
"""

import ast
import asyncio
import base64
import datetime
import hashlib
import json
import http.server
import os
import re
import socket
import socketserver
import sys
import tempfile
import threading
import time
import unittest
import warnings
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(HERE)
if os.environ.get("DELTABOX_TEST_INSTALLED") != "1" and SRC not in sys.path:
    sys.path.insert(0, SRC)

import deltabox  # noqa: E402
from deltabox import (Checkpoint, CheckpointResult, Client, CommandError, Conflict,  # noqa: E402
                      DaemonUnreachable, DeltaBoxError, InvalidRequest, MemoryWarning, Node,
                      NotFound, OpMemory, RestoreResult, Result, Sandbox, SandboxMemory, Templates,
                      Tree, ProcessImage)
from deltabox.aio import AsyncClient, AsyncSandbox, AsyncSession  # noqa: E402
from deltabox.errors import from_answer  # noqa: E402
from deltabox.models import parse_time  # noqa: E402

SOCKET = os.environ.get("DELTABOX_SOCKET")
NO_DAEMON = ("DELTABOX_SOCKET is not set: no daemon to test against (start `deltabox "
             "daemon` and set DELTABOX_SOCKET to its socket, or run `go test ./tests/e2e "
             "-run TestPythonClient`, which starts a private one)")


def _sources():
    """Every Python file of the client: the package, the build backend, the tests."""
    out = [os.path.join(SRC, "_build_backend.py")]
    for d in ("deltabox", "tests"):
        for f in sorted(os.listdir(os.path.join(SRC, d))):
            if f.endswith(".py"):
                out.append(os.path.join(SRC, d, f))
    return out



class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _FakeDaemon:
    """A server on a unix socket in a temporary directory, serving handler in threads,
    for the transport's tests: `with _FakeDaemon(H) as path: ...`."""

    def __init__(self, handler):
        self.handler = handler

    def __enter__(self):
        self.dir = tempfile.TemporaryDirectory()
        path = os.path.join(self.dir.name, "fake.sock")
        self.srv = _UnixServer(path, self.handler)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        return path

    def __exit__(self, *exc):
        self.srv.shutdown()
        self.srv.server_close()
        self.dir.cleanup()

class OfflineTest(unittest.TestCase):
    """No daemon needed."""

    def test_the_intended_package_is_tested(self):
        from_src = os.path.abspath(deltabox.__file__).startswith(SRC + os.sep)
        installed = os.environ.get("DELTABOX_TEST_INSTALLED") == "1"
        self.assertNotEqual(from_src, installed, "DELTABOX_TEST_INSTALLED=%s but deltabox comes from %s"
                            % (os.environ.get("DELTABOX_TEST_INSTALLED"), deltabox.__file__))

    def test_sources_are_python39(self):
        # Grammar of 3.9 (no match statements, no parenthesized context managers...),
        # and no annotations or dataclass options that 3.9 rejects at import time.
        bad_runtime = [
            (re.compile(r"@dataclass\([^)]*\b(slots|kw_only)\s*="), "dataclass slots/kw_only (3.10+)"),
            (re.compile(r"(:|->)\s*[\w.\[\], \"']+\s\|\s"), "X | Y annotation (3.10+)"),
            (re.compile(r"\bzip\([^)]*strict\s*="), "zip(strict=) (3.10+)"),
            (re.compile(r"^\s*import tomllib", re.M), "unguarded tomllib (3.11+)"),
        ]
        for path in _sources():
            with open(path, encoding="utf-8") as f:
                src = f.read()
            ast.parse(src, filename=path, feature_version=(3, 9))
            if os.path.basename(path) == "test_client.py":
                continue  # this file names the patterns
            for rx, what in bad_runtime:
                for m in rx.finditer(src):
                    line = src[:m.start()].count("\n") + 1
                    if what.startswith("unguarded") and "try:" in src[max(0, m.start() - 40):m.start()]:
                        continue
                    self.fail("%s:%d: %s" % (path, line, what))

    def test_unreachable_missing_socket(self):
        with tempfile.TemporaryDirectory() as d:
            c = Client(socket_path=os.path.join(d, "none.sock"))
            with self.assertRaises(DaemonUnreachable) as cm:
                c.health()
            e = cm.exception
            self.assertEqual(e.code, "unreachable")
            self.assertIsNone(e.status)
            self.assertIn("deltabox daemon", e.message)
            self.assertIn("none.sock", e.message)
            self.assertIsInstance(e, ConnectionError)
            self.assertIsInstance(e, DeltaBoxError)
            # Sandbox calls go through the same path.
            with self.assertRaises(DaemonUnreachable):
                Sandbox.create(client=c)

    def test_unreachable_refused(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "stale.sock")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(p)  # bound, never listening: connections are refused
            try:
                with self.assertRaises(DaemonUnreachable) as cm:
                    Client(socket_path=p).health()
                self.assertIn("refuses connections", cm.exception.message)
            finally:
                s.close()

    def test_env_socket(self):
        old = os.environ.get("DELTABOX_SOCKET")
        try:
            os.environ["DELTABOX_SOCKET"] = "/tmp/x.sock"
            self.assertEqual(Client().socket_path, "/tmp/x.sock")
            self.assertEqual(Client("/a.sock").socket_path, "/a.sock")
            del os.environ["DELTABOX_SOCKET"]
            self.assertEqual(Client().socket_path, deltabox.DEFAULT_SOCKET)
        finally:
            if old is None:
                os.environ.pop("DELTABOX_SOCKET", None)
            else:
                os.environ["DELTABOX_SOCKET"] = old

    def test_error_mapping(self):
        for status, code, cls in [(404, "not_found", NotFound), (409, "conflict", Conflict),
                                  (400, "invalid", InvalidRequest),
                                  (503, "unavailable", deltabox.Unavailable)]:
            e = from_answer(status, code, "msg")
            self.assertIs(type(e), cls)
            self.assertEqual((e.code, e.status, e.message, str(e)), (code, status, "msg", "msg"))
            e = from_answer(None, code, "m")  # a stream's error event has no status
            self.assertEqual(e.status, status)
            e = from_answer(status, None, "m")  # a body that is not the daemon's JSON
            self.assertIs(type(e), cls)
        e = from_answer(500, "internal", "boom")
        self.assertIs(type(e), DeltaBoxError)
        # Two codes share 507: the code decides, the status alone means the disk quota.
        e = from_answer(507, "template_budget", "m")
        self.assertIs(type(e), deltabox.TemplateBudgetExceeded)
        self.assertEqual(from_answer(None, "template_budget", "m").status, 507)
        self.assertIs(type(from_answer(507, None, "m")), deltabox.DiskQuotaExceeded)

    def test_result_check(self):
        ok = Result(exit_code=0, stdout="x")
        self.assertIs(ok.check(), ok)
        self.assertTrue(ok.ok)
        bad = Result(exit_code=2, stdout="", stderr="boom\n", argv=["bash", "-c", "f"])
        self.assertFalse(bad.ok)
        with self.assertRaises(CommandError) as cm:
            bad.check()
        e = cm.exception
        self.assertEqual((e.exit_code, e.code, e.stderr), (2, "command_failed", "boom\n"))
        self.assertIn("boom", str(e))
        self.assertIs(e.result, bad)
        with self.assertRaises(CommandError):
            Result(exit_code=0, timed_out=True).check()
        r = Result.from_api({"exit_code": -1, "signal": 9, "stdout": "a", "stderr": "b",
                             "duration_ms": 1500, "timed_out": True, "stderr_truncated": True})
        self.assertEqual((r.exit_code, r.signal, r.duration, r.timed_out, r.truncated),
                         (-1, 9, 1.5, True, True))

    def test_parse_time(self):
        t = parse_time("2026-12-02T17:01:31.054110854Z")
        self.assertEqual(t, datetime.datetime(2026, 12, 2, 17, 1, 31, 54110, tzinfo=datetime.timezone.utc))
        t = parse_time("2026-12-02T19:01:31+02:00")
        self.assertEqual(t, datetime.datetime(2026, 12, 2, 17, 1, 31, tzinfo=datetime.timezone.utc))
        self.assertIsNone(parse_time(""))
        self.assertIsNone(parse_time(None))
        self.assertIsNone(parse_time("yesterday"))
        self.assertIsNone(parse_time("0001-01-01T00:00:00Z"))  # Go's zero time: unset

    def test_tree_model(self):
        t = Tree.from_api({
            "nodes": [
                {"id": "n1", "image": "default", "label": "a", "children": ["n2", "n3"], "layer_bytes": 5},
                {"id": "n2", "parent": "n1", "image": "default", "sandboxes": ["sb1"]},
                {"id": "n3", "parent": "n1", "image": "default", "children": ["n4"]},
                {"id": "n4", "parent": "n3", "image": "default"},
            ],
            "roots": ["n1"], "on_image": {"default": ["sb2"]}})
        self.assertEqual(len(t), 4)
        self.assertIn("n4", t)
        self.assertEqual([n.id for n in t.path("n4")], ["n1", "n3", "n4"])
        self.assertEqual([n.id for n in t.children("n1")], ["n2", "n3"])
        self.assertEqual(sorted(n.id for n in t.leaves()), ["n2", "n4"])
        self.assertIsInstance(t["n1"], Node)
        self.assertEqual(t["n1"].layer_bytes, 5)
        self.assertEqual(
            t.render(),
            "image default <- sb2\n`-- n1 'a'\n    |-- n2 <- sb1\n    `-- n3\n        `-- n4")

    def test_process_models(self):
        # The answers of a checkpoint and a restore (shapes as the daemon sends them).
        node = {"id": "n2", "parent": "n1", "image": "default", "sandbox": "sb1", "durable": False}
        c = CheckpointResult.from_api({
            "node": node, "sandbox": "sb1", "killed_processes": 1, "mounted": True,
            "duration_ms": 2.5, "processes": 3, "process_errors": ["session py: gone"],
            "prepared": True, "phases_us": {"seize": 120, "fork": 480}, "criu_processes": 4})
        self.assertEqual((c.processes, c.process_errors, c.killed_processes, c.mounted, c.prepared),
                         (3, ["session py: gone"], 1, True, True))
        self.assertEqual(c.criu_processes, 4)
        self.assertEqual((c.duration, c.phases_us), (0.0025, {"seize": 120, "fork": 480}))
        self.assertIsNone(c.node.templates)
        # A node from the tree: no operation, maybe templates.
        n = Node.from_api(dict(node, templates={
            "processes": 2, "sessions": ["main", "py"], "rss_bytes": 10, "pss_bytes": 6,
            "private_dirty_bytes": 4}))
        self.assertEqual(n.templates, Templates(2, ["main", "py"], 10, 6, 4))
        self.assertIsNone(n.process_image)
        im = Node.from_api(dict(node, process_image={
            "state": "complete", "stored_bytes": 345000, "full_bytes": 61000000, "lag_ms": 90,
            "dump_ms": 80})).process_image
        self.assertEqual(im, ProcessImage("complete", "", 345000, 61000000, 90, 80))
        for op_field in ("processes", "process_errors", "killed_processes", "prepared", "phases_us"):
            self.assertFalse(hasattr(n, op_field), op_field)
        r = RestoreResult.from_api({
            "node": node, "sandbox": "sb1", "killed_processes": 2, "mounted": False,
            "duration_ms": 1.5, "processes": 2, "warm": True, "criu_processes": 1,
            "from_image": True, "lazy_image": True,
            "phases_us": {"kill": 50, "processes": 400}})
        self.assertEqual((r.criu_processes, r.from_image, r.lazy_image), (1, True, True))
        self.assertEqual((r.id, r.node.id, r.sandbox, r.processes, r.process_errors),
                         ("n2", "n2", "sb1", 2, []))
        self.assertEqual((r.killed_processes, r.mounted, r.warm, r.duration, r.phases_us),
                         (2, False, True, 0.0015, {"kill": 50, "processes": 400}))
        self.assertEqual((r.sessions_restored, r.sessions_ended), ([], []))
        r = RestoreResult.from_api({"node": node, "sandbox": "sb1", "processes": 1,
                                    "sessions": ["main"], "sessions_ended": ["py"]})
        self.assertEqual((r.sessions_restored, r.sessions_ended), (["main"], ["py"]))
        # Fields the daemon leaves out (omitempty) take their zero.
        r = RestoreResult.from_api({"node": node, "sandbox": "sb1", "processes": 0})
        self.assertEqual((r.warm, r.process_errors, r.phases_us, r.from_image, r.lazy_image),
                         (False, [], {}, False, False))

    def test_checkpoint_result_and_node_are_split(self):
        # A node of the tree holds what the daemon keeps; what a checkpoint did is a
        # CheckpointResult whose .node is that Node, as a RestoreResult's is.
        node = {"id": "n7", "parent": "n1", "image": "default", "sandbox": "sb1", "label": "x",
                "created": "2026-12-02T17:01:31Z"}
        ck = CheckpointResult.from_api({"node": node, "sandbox": "sb1", "processes": 2,
                                        "sessions": ["main", "py"], "mounted": True})
        self.assertIsInstance(ck.node, Node)
        self.assertEqual((ck.id, str(ck), ck.node.label, ck.node.parent), ("n7", "n7", "x", "n1"))
        self.assertEqual((ck.sandbox, ck.processes, ck.sessions, ck.mounted), ("sb1", 2, ["main", "py"], True))
        n = Node.from_api(node)
        self.assertEqual(n, ck.node)
        for op_field in ("processes", "sessions", "mounted", "duration", "memory", "warnings"):
            self.assertFalse(hasattr(n, op_field), "a Node has no %s: it is the checkpoint's" % op_field)
        self.assertFalse(hasattr(ck, "label"), "a CheckpointResult's node fields are on .node")
        self.assertIs(Checkpoint, Node)  # the old name of the node
        # An early answer: the node pending, no complete time; the node, once complete,
        # says it. The answer is asked for by name.
        early = CheckpointResult.from_api({"node": dict(node, pending=True), "sandbox": "sb1",
                                           "duration_ms": 1.2})
        self.assertEqual((early.node.pending, early.complete, early.duration), (True, 0.0, 0.0012))
        done = Node.from_api(dict(node, complete_ms=5.5))
        self.assertEqual((done.pending, done.complete), (False, 0.0055))
        from deltabox.sandbox import _checkpoint_body
        self.assertEqual(_checkpoint_body("x", False, 0, False, "complete")[0], {"label": "x", "answer": "complete"})
        self.assertNotIn("answer", _checkpoint_body("x", False, 0, False)[0])
        with self.assertRaises(ValueError):
            _checkpoint_body("x", False, 0, False, "soon")
        r = RestoreResult.from_api({"node": node, "sandbox": "sb2"})
        self.assertIsInstance(r.node, Node)
        # What takes a node takes any of them, or an id; and not another object.
        from deltabox.sandbox import _node_id
        self.assertEqual([_node_id(x) for x in (ck, n, r, "n7")], ["n7"] * 4)
        with self.assertRaises(TypeError):
            _node_id(7)
        # A node built without a client says how to get one that has it.
        with self.assertRaises(ValueError) as cm:
            n.refresh()
        self.assertIn("client.node('n7')", str(cm.exception))
        # In a tree, a CheckpointResult names its node.
        t = Tree.from_api({"nodes": [node], "roots": ["n7"]})
        self.assertIn(ck, t)
        self.assertEqual(t[ck].id, "n7")

    def test_modules_import_in_one_direction(self):
        # client.py, models.py and sandbox.py (and the rest of the package) import one
        # another in one direction only: no import at all, not under TYPE_CHECKING nor
        # inside a function, goes back up; and no "# type:" comment is left.
        pkg = os.path.join(SRC, "deltabox")
        order = ["errors", "_http", "models", "client", "sandbox", "_aio_http", "aio", "__init__"]
        self.assertEqual(sorted(order), sorted(f[:-3] for f in os.listdir(pkg) if f.endswith(".py")))
        for i, mod in enumerate(order):
            with open(os.path.join(pkg, mod + ".py"), encoding="utf-8") as f:
                src = f.read()
            self.assertNotRegex(src, r"#\s*type:", "%s.py has a # type: comment" % mod)
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.ImportFrom) and node.level == 1:
                    names = [node.module] if node.module else [a.name for a in node.names]
                    for name in names:
                        self.assertIn(name, order[:i], "%s.py:%d imports .%s, which comes after it"
                                      % (mod, node.lineno, name))
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        self.assertFalse(a.name.startswith("deltabox"), "%s.py imports %s" % (mod, a.name))

    def test_memory_models(self):
        # The memory of a checkpoint's and a restore's answers, and the warnings.
        node = {"id": "n2", "image": "default", "sandbox": "sb1"}
        mem = {"limit_bytes": 256 << 20, "usage_bytes": 190 << 20,
               "node_templates_rss_bytes": 64 << 20,
               "templates": {"processes": 3, "rss_bytes": 200 << 20, "pss_bytes": 150 << 20,
                             "private_dirty_bytes": 120 << 20}}
        c = CheckpointResult.from_api({"node": node, "sandbox": "sb1", "waited_ms": 1250.0,
                                       "memory": mem, "warnings": ["templates hold 150 MiB"]})
        self.assertEqual(c.memory, OpMemory(256 << 20, 190 << 20, 64 << 20,
                                            Templates(3, [], 200 << 20, 150 << 20, 120 << 20)))
        self.assertEqual((c.waited, c.warnings), (1.25, ["templates hold 150 MiB"]))
        c = CheckpointResult.from_api({"node": node, "memory": {"limit_bytes": 1, "usage_bytes": 2}})
        self.assertEqual((c.memory, c.warnings, c.waited), (OpMemory(1, 2, 0, None), [], 0.0))
        r = RestoreResult.from_api({"node": node, "memory": mem, "warnings": ["w"], "waited_ms": 3})
        self.assertEqual((r.memory.limit_bytes, r.warnings, r.waited), (256 << 20, ["w"], 0.003))
        self.assertIsNone(RestoreResult.from_api({"node": node}).memory)
        m = SandboxMemory.from_info({"limits": {"memory_bytes": 5}, "usage": {
            "memory_bytes": 4, "memory_peak_bytes": 5, "oom_kills": 1},
            "templates": {"processes": 1, "pss_bytes": 3}})
        self.assertEqual(m, SandboxMemory(5, 4, 5, 1, Templates(1, [], 0, 3, 0)))
        self.assertEqual(SandboxMemory.from_info({}), SandboxMemory())
        # A command the memory limit killed: the note is in the result and the error.
        r = Result.from_api({"exit_code": -1, "signal": 9, "oom": "killed by SIGKILL: the "
                             "sandbox's memory limit (256 MiB) was reached"}, ["python3", "x.py"])
        self.assertIn("memory limit (256 MiB)", r.oom)
        with self.assertRaises(CommandError) as cm:
            r.check()
        self.assertIn("memory limit (256 MiB)", str(cm.exception))
        self.assertIsNone(Result.from_api({"exit_code": 0}).oom)
        self.assertTrue(issubclass(MemoryWarning, UserWarning))

    def test_tree_lineage(self):
        # sb.tree().render() shows the sandbox's own nodes and their ancestors only.
        d = {"nodes": [
            {"id": "r", "image": "default", "sandbox": "a", "children": ["a1", "b1"]},
            {"id": "a1", "parent": "r", "image": "default", "sandbox": "a", "label": "mine",
             "children": ["a2"], "templates": {"processes": 1, "private_dirty_bytes": 3 << 20}},
            {"id": "a2", "parent": "a1", "image": "default", "sandbox": "a", "sandboxes": ["a"]},
            {"id": "b1", "parent": "r", "image": "default", "sandbox": "b", "children": ["b2"]},
            {"id": "b2", "parent": "b1", "image": "default", "sandbox": "b", "sandboxes": ["b"]},
            {"id": "o", "image": "other", "sandbox": "c"},
        ], "roots": ["r", "o"], "on_image": {"default": ["z"]}}
        t = Tree.from_api(d)
        t.head, t.sandbox = "a2", "a"
        self.assertEqual(t.render(),
                         "image default\n`-- r\n    `-- a1 'mine' [1 process, 3.0 MiB private]\n"
                         "        `-- a2 <- a  (head)")
        everything = t.render(all=True)
        for n in ("b1", "b2", "image other", "<- z"):
            self.assertIn(n, everything)
        self.assertEqual(len(t), 6)  # the nodes are all there; only the view is cut
        b = t.lineage("b")
        self.assertEqual(sorted(b.nodes), ["b1", "b2", "r"])
        self.assertEqual(b["r"].children, ["b1"])
        self.assertIsNone(b.head)
        # A fork standing on another sandbox's node sees that node's path.
        t2 = Tree.from_api(d)
        t2.head, t2.sandbox = "b1", "f"
        self.assertEqual(t2.render(), "image default\n`-- r\n    `-- b1  (head)")
        with self.assertRaises(ValueError):
            Tree.from_api(d).lineage()

    def test_wait_argument(self):
        from deltabox.sandbox import _wait_ms
        self.assertEqual(deltabox.DEFAULT_WAIT, 5.0)
        self.assertEqual((_wait_ms(None), _wait_ms(0), _wait_ms(2.5)), (0, 0, 2500))
        for bad in (-1, 601):
            with self.assertRaises(ValueError):
                _wait_ms(bad)

    def test_keepalive_retry_after_server_closed(self):
        # A server that closes each connection after answering without saying so:
        # the pooled connection is dead, and the client must resend on a new one.
        seen = []

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                seen.append(self.path)
                body = b'{"ok": true, "api": "v1"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

            def log_message(self, *a):
                pass

        with _FakeDaemon(H) as p:
            c = Client(socket_path=p, timeout=10)
            for _ in range(3):
                self.assertEqual(c.health(), {"ok": True, "api": "v1"})
                time.sleep(0.05)  # let the server close its end
            self.assertEqual(seen, ["/v1/health"] * 3)
            c.close()

    def test_raw_answers(self):
        # The client's own HTTP/1.1 reading: chunked bodies (with an extension and a
        # trailer), a body ended by the connection, an error answer in chunks, a 1xx
        # answer skipped, and a daemon that hangs up in the middle of an answer.
        err = b'{"error": {"code": "not_found", "message": "no x"}}'
        answers = {
            "/v1/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                           b"4;x=y\r\n{\"a\"\r\n6\r\n: [1]}\r\n0\r\nX-T: 1\r\n\r\n",
            "/v1/close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{\"b\": 2}",
            "/v1/error": b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n0\r\n\r\n" % (len(err), err),
            "/v1/continue": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\n"
                            b"Content-Length: 8\r\n\r\n{\"c\": 3}",
            "/v1/half": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"d\"",
        }

        class H(socketserver.StreamRequestHandler):
            def handle(self):
                while True:
                    line = self.rfile.readline()
                    if not line:
                        return
                    path = line.split()[1].decode()
                    n = 0
                    while True:
                        h = self.rfile.readline()
                        if h in (b"\r\n", b""):
                            break
                        if h.lower().startswith(b"content-length:"):
                            n = int(h.split(b":")[1])
                    self.rfile.read(n)
                    self.wfile.write(answers[path])
                    self.wfile.flush()
                    if path in ("/v1/close", "/v1/half"):
                        return

        with _FakeDaemon(H) as p:
            t = Client(socket_path=p, timeout=10)._t
            for _ in range(2):  # the second time on the kept-alive connection
                self.assertEqual(t.json("GET", "/chunked"), {"a": [1]})
            self.assertEqual(t.json("POST", "/close", {"x": 1}), {"b": 2})
            with self.assertRaises(NotFound) as cm:
                t.json("GET", "/error")
            self.assertEqual(cm.exception.message, "no x")
            self.assertEqual(t.json("POST", "/continue"), {"c": 3})
            with self.assertRaises(DaemonUnreachable) as cm:
                t.json("GET", "/half")
            self.assertIn("middle of its answer", str(cm.exception))
            t.close()

    def test_aio_calls_run_at_once(self):
        # AsyncClient's calls are asyncio on the socket: four half-second answers
        # together take about half a second, and the event loop runs meanwhile.
        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                time.sleep(0.5)
                body = b'{"ok": true, "api": "v1"}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        async def main(path):
            ticks = []

            async def tick():
                for _ in range(5):
                    ticks.append(time.monotonic())
                    await asyncio.sleep(0.05)

            async with AsyncClient(path, timeout=10) as c:
                start = time.monotonic()
                out = await asyncio.gather(tick(), *(c.health() for _ in range(4)))
                took = time.monotonic() - start
            self.assertEqual(out[1:], [{"ok": True, "api": "v1"}] * 4)
            self.assertLess(took, 1.5, "4 calls of 0.5 s took %.2f s: not at once" % took)
            self.assertEqual(len(ticks), 5)
            self.assertLess(ticks[-1] - ticks[0], 0.45, "the event loop was blocked")

        with _FakeDaemon(H) as p:
            asyncio.run(main(p))

    def test_aio_cancel_closes_the_connection(self):
        # A cancelled call aborts its connection at once (which is how the daemon knows
        # to interrupt it), rather than leaving a thread blocked on it.
        got, closed = threading.Event(), threading.Event()

        class H(socketserver.StreamRequestHandler):
            def handle(self):
                self.rfile.readline()
                got.set()
                while self.rfile.read(1):  # never answers; reads until the client goes
                    pass
                closed.set()

        async def main(path):
            async with AsyncClient(path, timeout=60) as c:
                task = asyncio.ensure_future(c.health())
                while not got.is_set():
                    await asyncio.sleep(0.01)
                task.cancel()
                with self.assertRaises(asyncio.CancelledError):
                    await task
                self.assertFalse(any(c._t._idle.values()), "a cancelled call's connection went back to the pool")

        with _FakeDaemon(H) as p:
            asyncio.run(main(p))
            self.assertTrue(closed.wait(5), "the cancelled call's connection is still open")

    def test_aio_client_outlives_its_event_loop(self):
        # Kept-alive connections belong to an event loop: a client used again under
        # another asyncio.run opens new ones (and streams, chunked, read as events).
        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                body = b'{"ok": true, "api": "v1"}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for part in (b'{"done": 1, "total": 2}\n{"do', b'ne": 2, "total": 2}\n',
                             b'{"image": {"name": "x"}}\n'):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *a):
                pass

        with _FakeDaemon(H) as p:
            c = AsyncClient(p, timeout=10)
            for _ in range(2):
                self.assertEqual(asyncio.run(c.health()), {"ok": True, "api": "v1"})
            seen = []

            async def progress(done, total):
                seen.append((done, total))

            self.assertEqual(asyncio.run(c.images.import_("x", "/src", on_progress=progress)),
                             {"name": "x"})
            self.assertEqual(seen, [(1, 2), (2, 2)])
            # Threads, each with its own loop, share the client.
            async def calls():
                return [await c.health() for _ in range(20)]

            outs = []
            threads = [threading.Thread(target=lambda: outs.append(asyncio.run(calls())))
                       for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            self.assertEqual(outs, [[{"ok": True, "api": "v1"}] * 20] * 3)

    def test_build_backend(self):
        sys.path.insert(0, SRC)
        try:
            import _build_backend as bb
        finally:
            sys.path.remove(SRC)
        project = bb.read_project()
        self.assertEqual(project["name"], "deltabox")
        self.assertEqual(project["version"], deltabox.__version__)
        self.assertEqual(project["requires-python"], ">=3.9")
        with open(os.path.join(SRC, "pyproject.toml"), encoding="utf-8") as f:
            fallback = bb._read_project_fallback(f.read())
        for k in ("name", "version", "description", "requires-python", "readme",
                  "dependencies", "classifiers"):
            self.assertEqual(fallback.get(k), project.get(k), k)
        with tempfile.TemporaryDirectory() as d:
            name = bb.build_wheel(d)
            self.assertEqual(name, "deltabox-%s-py3-none-any.whl" % deltabox.__version__)
            with zipfile.ZipFile(os.path.join(d, name)) as z:
                names = z.namelist()
                for want in ("deltabox/__init__.py", "deltabox/sandbox.py", "deltabox/py.typed"):
                    self.assertIn(want, names)
                self.assertFalse([n for n in names if "__pycache__" in n or n.startswith("tests/")])
                di = "deltabox-%s.dist-info/" % deltabox.__version__
                meta = z.read(di + "METADATA").decode()
                self.assertIn("Name: deltabox\n", meta)
                self.assertIn("Requires-Python: >=3.9\n", meta)
                record = z.read(di + "RECORD").decode().splitlines()
                self.assertEqual(len(record), len(names))
                for line in record:
                    path, digest, size = line.rsplit(",", 2)
                    if path == di + "RECORD":
                        continue
                    data = z.read(path)
                    want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                    self.assertEqual((digest, int(size)), ("sha256=" + want, len(data)), path)
            name = bb.build_editable(d)
            with zipfile.ZipFile(os.path.join(d, name)) as z:
                pth = [n for n in z.namelist() if n.endswith(".pth")]
                self.assertEqual(len(pth), 1)
                self.assertEqual(z.read(pth[0]).decode().strip(), SRC)


@unittest.skipUnless(SOCKET, NO_DAEMON)
def _fork_files_only(t: unittest.TestCase, b: "deltabox.ForkBranch") -> bool:
    """Whether a fork's branch carried files only because the daemon writes no durable
    images (DELTABOX_DURABLE=0, as the suite's daemon: tests/e2e/pyclient_test.go; its
    TestForkPythonClient runs the fork tests with images, DELTABOX_TEST_FORK_DURABLE=1)."""
    if os.environ.get("DELTABOX_TEST_FORK_DURABLE") == "1" or b.path != "files":
        return False
    t.assertIn("writes no durable images", b.reason)
    return True


class DaemonTest(unittest.TestCase):
    """Against the real daemon on $DELTABOX_SOCKET."""

    client: Client  # set by setUpClass

    @classmethod
    def setUpClass(cls):
        cls.client = Client(SOCKET, timeout=120)
        cls.client.health()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def sandbox(self, **kw):
        sb = Sandbox.create(client=self.client, **kw)
        self.addCleanup(sb.close)
        return sb

    def sh(self, sb, cmd, **kw):
        """Runs cmd and requires success; returns stdout."""
        kw.setdefault("timeout", 60)
        return sb.run(cmd, **kw).check().stdout

    def files_or_skip(self, sb):
        try:
            sb.files.stat(".")
        except NotFound as e:
            if e.message.startswith("no route"):
                self.skipTest("this daemon has no files API (GET .../files/stat answered: %s)" % e.message)
            raise

    # ---- sandboxes and commands ----

    def test_create_connect_list(self):
        name = "py-%d-%d" % (os.getpid(), int(time.time() * 1000) % 10**6)
        sb = self.sandbox(name=name, workdir="/srv/app", memory_mb=512, pids=200)
        self.assertEqual(sb.id, name)
        self.assertEqual((sb.image, sb.workdir), ("default", "/srv/app"))
        self.assertEqual(self.sh(sb, "pwd"), "/srv/app\n")
        info = sb.info()
        self.assertEqual(info["status"], "running")
        self.assertEqual(info["limits"]["memory_bytes"], 512 << 20)
        self.assertEqual(info["limits"]["pids"], 200)
        self.assertIsNone(sb.head)
        other = Sandbox.connect(name, client=self.client)
        self.assertEqual(other.id, name)
        self.assertIn(name, [s.id for s in Sandbox.list(client=self.client)])
        self.assertEqual(self.client.health()["api"], "v1")
        self.assertIn("default", [im["name"] for im in self.client.images()])

    def test_warm_processes_option(self):
        self.assertTrue(self.sandbox(warm_processes=True).info().get("warm_processes"))
        self.assertFalse(self.sandbox().info().get("warm_processes", False))

    def test_run_exit_codes_and_stderr(self):
        sb = self.sandbox()
        r = sb.run("echo out; echo err >&2; exit 3", timeout=30)
        self.assertEqual((r.exit_code, r.stdout, r.stderr), (3, "out\n", "err\n"))
        self.assertFalse(r.timed_out or r.truncated or r.session_restarted)
        self.assertGreater(r.duration, 0)
        self.assertLess(r.duration, 30)
        self.assertFalse(r.ok)
        with self.assertRaises(CommandError) as cm:
            r.check()
        self.assertEqual(cm.exception.exit_code, 3)
        self.assertIn("err", str(cm.exception))
        # A list is an argv, with no shell in between.
        self.assertEqual(self.sh(sb, ["printf", "%s|", "a b", "$HOME"]), "a b|$HOME|")
        self.assertEqual(sb.run(["false"]).exit_code, 1)
        # A command that does not exist is a result (bash says so), not an exception.
        r = sb.run("no-such-command-xyz")
        self.assertEqual(r.exit_code, 127)
        self.assertIn("not found", r.stderr)

    def test_run_env_cwd_stdin(self):
        sb = self.sandbox()
        out = self.sh(sb, 'echo "$FOO $BAR"; pwd; cat', env={"FOO": "bar", "BAR": 2},
                      cwd="/tmp", stdin="piped in\n")
        self.assertEqual(out, "bar 2\n/tmp\npiped in\n")
        self.assertEqual(self.sh(sb, "echo $X", env=["X=list"]), "list\n")
        self.assertEqual(self.sh(sb, "pwd"), "/workspace\n")
        self.assertEqual(self.sh(sb, "cat", stdin=b"bytes"), "bytes")

    def test_output_limit(self):
        sb = self.sandbox()
        r = sb.run("head -c 100000 /dev/zero | tr '\\0' x", output_limit=1000)
        self.assertTrue(r.truncated and r.stdout_truncated)
        self.assertIn("dropped", r.stdout)

    def test_timeout(self):
        sb = self.sandbox()
        start = time.monotonic()
        r = sb.run("echo before; sleep 30", timeout=1)
        took = time.monotonic() - start
        self.assertTrue(r.timed_out)
        self.assertEqual(r.exit_code, -1)
        self.assertEqual(r.signal, 9)
        self.assertIn("before", r.stdout)
        self.assertIn("timed out", r.stderr)
        self.assertLess(took, 10)
        with self.assertRaises(CommandError):
            r.check()
        with self.assertRaises(ValueError):
            sb.run("true", timeout=0)

    def test_streaming_callback_order(self):
        sb = self.sandbox()
        events = []
        start = time.monotonic()
        first = []

        def on_output(stream, data):
            if not first:
                first.append(time.monotonic() - start)
            events.append((stream, data))

        cmd = "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.4; done"
        r = sb.run(cmd, on_output=on_output, timeout=30)
        total = time.monotonic() - start
        self.assertEqual(r.exit_code, 0)
        self.assertEqual("".join(d for s, d in events if s == "stdout"), r.stdout)
        self.assertEqual("".join(d for s, d in events if s == "stderr"), r.stderr)
        self.assertEqual(r.stdout, "out1\nout2\nout3\n")
        self.assertEqual(r.stderr, "err1\nerr2\nerr3\n")
        # Each iteration's output comes before the next one's.
        flat = "".join(d for _, d in events)
        for i in (1, 2):
            for a in ("out%d" % i, "err%d" % i):
                for b in ("out%d" % (i + 1), "err%d" % (i + 1)):
                    self.assertLess(flat.index(a), flat.index(b), flat)
        # ... and as it is produced, not at the end.
        self.assertLess(first[0], total - 0.5, "first output after %.2fs of %.2fs" % (first[0], total))

        # In a session too.
        got = []
        r = sb.run("echo first; sleep 1; echo second", session="main",
                   on_output=lambda s, d: got.append((time.monotonic(), d)))
        self.assertEqual(r.stdout, "first\nsecond\n")
        self.assertEqual("".join(d for _, d in got), "first\nsecond\n")
        self.assertGreater(got[-1][0] - got[0][0], 0.5)

    def test_streaming_callback_error_abandons_command(self):
        sb = self.sandbox()

        class Stop(Exception):
            pass

        def on_output(stream, data):
            raise Stop()

        start = time.monotonic()
        with self.assertRaises(Stop):
            sb.run("echo go; sleep 30; touch /tmp/not-killed", on_output=on_output)
        self.assertLess(time.monotonic() - start, 10)
        # The client and the sandbox go on; the abandoned command was killed.
        self.assertEqual(self.sh(sb, "echo ok"), "ok\n")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if "sleep 30" not in self.sh(sb, "ps -eo args"):
                break
            time.sleep(0.1)
        else:
            self.fail("the abandoned command still runs")

    def test_concurrent_runs_share_a_client(self):
        sb = self.sandbox()
        results = {}

        def run(i):
            results[i] = sb.run("sleep 1; echo %d" % i, timeout=30)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.monotonic() - start
        self.assertEqual({i: r.stdout for i, r in results.items()}, {i: "%d\n" % i for i in range(4)})
        self.assertLess(took, 3.5, "4 one-second commands took %.1fs: not in parallel" % took)

    # ---- sessions ----

    def test_bash_session_keeps_state(self):
        sb = self.sandbox()
        self.sh(sb, "mkdir -p /tmp/w && cd /tmp/w; export A=1; B=2; f() { echo fn$1; }", session="main")
        for i in range(3):
            self.assertEqual(self.sh(sb, "echo $(pwd) $A $B; f %d" % i, session=True),
                             "/tmp/w 1 2\nfn%d\n" % i)
        r = sb.run("(exit 7)", session="main")
        self.assertEqual((r.exit_code, r.session), (7, "main"))
        # A timeout interrupts the command, not the session.
        r = sb.run("sleep 100", session="main", timeout=0.5)
        self.assertTrue(r.timed_out)
        self.assertIn("timed out", r.stdout)
        self.assertEqual(self.sh(sb, "echo $B", session="main"), "2\n")
        self.assertIn("main", [s.name for s in sb.sessions.list()])

    def test_python_session(self):
        sb = self.sandbox()
        s = sb.sessions.start("py", kind="python")
        self.assertEqual((s.name, s.kind, s.running), ("py", "python", True))
        self.assertEqual(s.run("import os\nx = 21\npid = os.getpid()").exit_code, 0)
        self.assertEqual(s.run("x * 2").stdout, "42\n")
        self.assertEqual(sb.run("x * 2, pid == os.getpid()", session="py").stdout, "(42, True)\n")
        r = sb.sessions.run("py", "1/0")
        self.assertEqual(r.exit_code, 1)
        self.assertIn("ZeroDivisionError", r.stdout)
        self.assertEqual(s.run("x").stdout, "21\n")
        with self.assertRaises(Conflict) as cm:
            sb.sessions.start("py", kind="python")
        self.assertEqual(cm.exception.status, 409)
        with self.assertRaises(NotFound):
            sb.run("1", session="nope")

    def test_command_session_logs_and_kill(self):
        sb = self.sandbox()
        s = sb.sessions.start("srv", argv=["bash", "-c", "echo hello-from-srv; exec sleep 1000"])
        self.assertEqual(s.kind, "command")
        deadline = time.monotonic() + 15
        while "hello-from-srv" not in sb.sessions.logs("srv"):
            self.assertLess(time.monotonic(), deadline, "no output in the session's logs")
            time.sleep(0.1)
        self.assertIn("hello-from-srv", s.logs())
        self.assertTrue(sb.sessions.get("srv").running)
        with self.assertRaises(InvalidRequest):
            sb.run("echo", session="srv")  # a command session takes no calls
        s.kill()
        deadline = time.monotonic() + 15
        while [x for x in sb.sessions.list() if x.name == "srv" and x.running]:
            self.assertLess(time.monotonic(), deadline, "the session still runs after kill")
            time.sleep(0.1)
        self.assertNotIn("sleep 1000", self.sh(sb, "ps -eo args"))

    # ---- checkpoints, restore, tree, fork ----

    def test_export_import_node(self):
        # A node exported to a file imports back: on the daemon that made it, every
        # node of the chain is there already (same image, same layers) and is reused.
        # A damaged file is refused (InvalidRequest) and adds no node.
        sb = self.sandbox()
        self.sh(sb, "echo travel > t")
        c1 = sb.checkpoint(label="travel")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "n.dbx")
            warnings = c1.node.export(path)
            self.assertIsInstance(warnings, list)
            self.assertFalse([f for f in os.listdir(d) if f != "n.dbx"], "the .part file stayed")
            res = self.client.import_node(path)
            self.assertEqual(res["node"], c1.id)
            self.assertTrue(res["nodes"][-1]["reused"])
            self.assertIn("sessions start afresh", " ".join(res["warnings"]))
            with open(path, "rb") as f:
                data = bytearray(f.read())
            data[len(data) // 2] ^= 0x10
            bad = os.path.join(d, "bad.dbx")
            with open(bad, "wb") as f:
                f.write(bytes(data[: len(data) - 2048]))
            before = len(self.client.tree().nodes)
            with self.assertRaises(InvalidRequest) as cm:
                self.client.import_node(bad)
            self.assertIn("import refused", str(cm.exception))
            self.assertEqual(len(self.client.tree().nodes), before)

    def test_checkpoint_restore_roundtrip(self):
        sb = self.sandbox()
        self.sh(sb, "mkdir -p d && echo v1 > d/f && echo keep > k")
        c1 = sb.checkpoint(label="v1")
        self.assertIsInstance(c1, CheckpointResult)
        self.assertIsInstance(c1.node, Node)
        self.assertEqual((c1.node.label, c1.node.sandbox, c1.node.image, c1.node.parent),
                         ("v1", sb.id, "default", None))
        self.assertEqual(c1.sandbox, sb.id)
        self.assertIsInstance(c1.node.created, datetime.datetime)
        self.assertIsInstance(c1.killed_processes, int)
        self.assertTrue(c1.mounted)
        self.assertGreaterEqual(c1.duration, 0)
        self.assertEqual(sb.head, c1.id)
        self.sh(sb, "echo v2 > d/f; rm k; touch new")
        c2 = sb.checkpoint(label="v2")
        self.assertEqual(c2.node.parent, c1.id)
        r = sb.restore(c1)
        self.assertIsInstance(r, RestoreResult)
        self.assertEqual((r.node.id, r.sandbox, r.processes, r.process_errors), (c1.id, sb.id, 0, []))
        self.assertEqual(self.sh(sb, "cat d/f k; ls"), "v1\nkeep\nd\nk\n")
        self.assertEqual(sb.head, c1.id)
        sb.restore(c2.id)  # an id works too
        self.assertEqual(self.sh(sb, "cat d/f; ls"), "v2\nd\nnew\n")
        # Uncommitted changes are discarded by a restore.
        self.sh(sb, "echo scratch > d/f")
        sb.restore(c2)
        self.assertEqual(self.sh(sb, "cat d/f"), "v2\n")
        # The node as the daemon keeps it; durable once synced.
        self.client.sync()
        n = c1.refresh()
        self.assertIsInstance(n, Node)
        self.assertEqual((n.id, n.label, n.durable), (c1.id, "v1", True))
        self.assertIn(c2.id, n.children)
        self.assertEqual(self.client.node(c2.id).parent, c1.id)
        self.assertEqual(self.client.checkpoint(c2.id).parent, c1.id)  # the name before 0.4.0
        # A node from the tree, or its id, is restored like the checkpoint's answer.
        sb.restore(self.client.tree()[c1.id])
        self.assertEqual(self.sh(sb, "cat d/f"), "v1\n")

    def test_background_process_refuses_or_ends(self):
        # A background job holding a pipe cannot be checkpointed with its state: Conflict
        # naming it, and nothing changes; end_background=True ends it instead.
        sb = self.sandbox()
        self.sh(sb, "nohup python3 -c 'import os, time; r, w = os.pipe(); "
                    "open(\"/workspace/pp\", \"w\").write(str(os.getpid())); time.sleep(1000)' "
                    "</dev/null >/dev/null 2>&1 & "
                    "for i in $(seq 500); do [ -s /workspace/pp ] && exit 0; sleep 0.01; done; exit 1")
        pid = self.sh(sb, "cat /workspace/pp").strip()
        with self.assertRaises(Conflict) as cm:
            sb.checkpoint(label="refused")
        self.assertIn("process " + pid, str(cm.exception))
        self.assertIn("end_background", str(cm.exception))
        # [ -e /proc/PID ]: another command cannot kill -0 it (a Landlock domain each).
        self.assertEqual(sb.run("[ -e /proc/%s ]" % pid).exit_code, 0)
        c = sb.checkpoint(label="ended", end_background=True)
        self.assertEqual((c.killed_processes, c.processes, c.process_errors), (1, 0, []))
        self.assertNotEqual(sb.run("[ -e /proc/%s ]" % pid).exit_code, 0)

    def test_session_state_follows_checkpoint_and_restore(self):
        # The process fast path: a session's process state is part of the checkpoint.
        sb = self.sandbox()
        self.sh(sb, "X=1", session="main")
        c = sb.checkpoint()
        r = sb.run("echo ${X:-unset}; X=2", session="main")
        self.assertFalse(r.session_restarted)
        self.assertEqual(r.stdout, "1\n")
        sb.restore(c)
        r = sb.run("echo ${X:-unset}", session="main")
        self.assertFalse(r.session_restarted)
        self.assertEqual(r.stdout, "1\n")

    def test_process_half_of_checkpoint_and_restore(self):
        # What a checkpoint and a restore did with a bash and a python session, as the
        # client reports it, checked against the sessions' state and the daemon's counts.
        sb = self.sandbox()
        c0 = sb.checkpoint(label="no sessions")
        self.assertEqual((c0.processes, c0.process_errors, c0.killed_processes), (0, [], 0))
        self.sh(sb, "X=1", session="main")
        py = sb.sessions.start("py", kind="python")
        self.assertEqual(py.run("y = 41").exit_code, 0)
        c1 = sb.checkpoint(label="two sessions")
        self.assertEqual((c1.processes, c1.process_errors, c1.killed_processes), (2, [], 0))
        self.assertEqual((c1.sessions, c1.sessions_ended), (["main", "py"], []))
        # It answered once the processes were seized (the daemon's default): their
        # templates were forked after the answer, and the node says when it was complete.
        self.assertTrue(c1.node.pending)
        self.assertIn("seize", c1.phases_us)
        self.assertNotIn("fork", c1.phases_us)
        self.assertEqual(c1.complete, 0.0)
        self.assertIsInstance(c1.prepared, bool)
        self.assertIsNone(c1.node.templates)  # not in a checkpoint's answer...
        n1 = c1.refresh()
        self.assertFalse(n1.pending)
        self.assertGreater(n1.complete, c1.duration)
        t = n1.templates  # ... but in the node's
        self.assertIsInstance(t, Templates)
        self.assertEqual((t.processes, t.sessions), (2, ["main", "py"]))
        self.assertGreater(t.rss_bytes, 0)
        self.assertEqual(self.client.tree()[c1.id].templates.sessions, ["main", "py"])
        self.assertIsNone(self.client.tree()[c0.id].templates)

        # Back to the node with both sessions' processes: both kept, with their state.
        self.sh(sb, "X=2", session="main")
        py.run("y = 0")
        r = sb.restore(c1)
        self.assertEqual((r.node.id, r.sandbox, r.processes, r.process_errors), (c1.id, sb.id, 2, []))
        self.assertEqual((r.sessions_restored, r.sessions_ended), (["main", "py"], []))
        self.assertGreaterEqual(r.killed_processes, 2)  # the live sessions' processes
        self.assertIn("processes", r.phases_us)
        self.assertIsInstance(r.warm, bool)
        res = sb.run("echo $X", session="main")
        self.assertEqual((res.stdout, res.session_restarted), ("1\n", False))
        res = py.run("y + 1")
        self.assertEqual((res.stdout, res.session_restarted), ("42\n", False))
        stats = sb.info()["stats"]
        self.assertEqual(stats["restore_paths"]["process"], 1)

        # To the node made with no session: no process comes back, both are ended and
        # start afresh on their next call.
        r = sb.restore(c0)
        self.assertEqual((r.node.id, r.processes, r.process_errors), (c0.id, 0, []))
        self.assertEqual((r.sessions_restored, r.sessions_ended), ([], ["main", "py"]))
        self.assertGreaterEqual(r.killed_processes, 2)
        ended = {s.name: s for s in sb.sessions.list()}
        self.assertFalse(ended["py"].running)
        self.assertIn(c0.id, ended["py"].exit or "")
        self.assertIsNone(ended["py"].started)
        self.assertEqual(sb.info()["stats"]["restore_paths"]["no_sessions"], 1)
        res = sb.run("echo ${X:-unset}", session="main")
        self.assertEqual((res.stdout, res.session_restarted), ("unset\n", True))

        # Back to c1: the ended python session comes back too.
        r = sb.restore(c1)
        self.assertEqual((r.processes, r.sessions_restored, r.sessions_ended), (2, ["main", "py"], []))
        res = py.run("y + 1")
        self.assertEqual((res.stdout, res.session_restarted), ("42\n", False))

        # Into another sandbox a node carries its files only: no process, and that
        # sandbox's own session is ended.
        other = self.sandbox()
        self.sh(other, "true", session="main")
        r = other.restore(c1)
        self.assertEqual((r.node.id, r.sandbox, r.processes), (c1.id, other.id, 0))
        self.assertEqual((r.sessions_restored, r.sessions_ended), ([], ["main"]))
        self.assertEqual(other.info()["stats"]["restore_paths"]["other_sandbox"], 1)

    def test_background_job_counts_as_a_process(self):
        # A background job outside the sessions is kept by a checkpoint and brought back
        # by a restore with its PID, and counted in processes.
        sb = self.sandbox()
        pid = self.sh(sb, "nohup sleep 1000 </dev/null >/dev/null 2>&1 & echo $!").strip()
        c = sb.checkpoint()
        self.assertEqual((c.processes, c.killed_processes), (1, 0))
        self.assertEqual(c.refresh().templates.sessions, [])
        # Through the daemon: another command cannot signal it (a Landlock domain each).
        sb.signal(int(pid), 9)
        self.sh(sb, "while [ -e /proc/%s ]; do sleep 0.01; done" % pid)
        r = sb.restore(c)
        self.assertEqual((r.processes, r.sessions_restored, r.sessions_ended), (1, [], []))
        self.assertEqual(sb.run("[ -e /proc/%s ]" % pid).exit_code, 0)

    def test_tree(self):
        sb = self.sandbox()
        self.sh(sb, "echo 1 > f")
        c1 = sb.checkpoint(label="root-%s" % sb.id)
        self.sh(sb, "echo 2 > f")
        c2 = sb.checkpoint(label="left")
        sb.restore(c1)
        self.sh(sb, "echo 3 > f")
        c3 = sb.checkpoint(label="right")
        t = sb.tree()
        self.assertIsInstance(t, Tree)
        self.assertEqual((t.head, t.sandbox), (c3.id, sb.id))
        for c in (c1, c2, c3):
            self.assertIn(c.id, t)
            self.assertEqual(t[c.id].label, c.node.label)
        self.assertIn(c1.id, t.roots)
        self.assertEqual([n.id for n in t.children(c1)], [c2.id, c3.id])
        self.assertEqual(t[c2.id].parent, c1.id)
        self.assertEqual([n.id for n in t.path(c3)], [c1.id, c3.id])
        self.assertEqual(t[c3.id].sandboxes, [sb.id])
        self.assertEqual(t[c2.id].sandboxes, [])
        self.assertIn(c2.id, [n.id for n in t.leaves()])
        text = t.render()
        self.assertIn("'left'", text)
        self.assertIn("%s 'right' <- %s  (head)" % (c3.id, sb.id), text)
        self.assertIn(c1.id, self.client.tree())
        # Removing: a subtree nobody stands on goes; one a sandbox stands in is refused.
        self.assertEqual(c2.remove(), [c2.id])
        self.assertNotIn(c2.id, self.client.tree())
        with self.assertRaises(Conflict) as cm:
            c1.remove()
        self.assertIn(sb.id, cm.exception.message)

    def test_fork(self):
        sb = self.sandbox(workdir="/srv/w")
        self.sh(sb, "echo base > f; mkdir -p sub && echo deep > sub/g")
        ckpt = sb.checkpoint(label="fork-me")
        kids = ckpt.fork(count=2)
        for k in kids:
            self.addCleanup(k.close)
        self.assertEqual(len(kids), 2)
        ids = {k.id for k in kids}
        self.assertEqual(len(ids), 2)
        self.assertNotIn(sb.id, ids)
        for i, k in enumerate(kids):
            self.assertEqual(k.head, ckpt.id)
            self.assertEqual(k.workdir, "/srv/w")
            self.assertEqual(self.sh(k, "pwd; cat f sub/g"), "/srv/w\nbase\ndeep\n")
            self.sh(k, "echo kid%d > f" % i)
        # Each fork has its own writable layer.
        self.assertEqual([self.sh(k, "cat f") for k in kids], ["kid0\n", "kid1\n"])
        self.assertEqual(self.sh(sb, "cat f"), "base\n")
        self.assertEqual(sorted(self.client.tree()[ckpt.id].sandboxes), sorted(ids | {sb.id}))
        # sb.fork checkpoints first.
        self.sh(sb, "echo later > f")
        (k3,) = sb.fork(count=1, label="later")
        self.addCleanup(k3.close)
        self.assertEqual(self.sh(k3, "cat f"), "later\n")
        # A node from the tree forks the same way (workdir from its sandbox), and so
        # does its id.
        (k4,) = Sandbox.fork_from(self.client.tree()[ckpt.id], client=self.client)
        self.addCleanup(k4.close)
        self.assertEqual(self.sh(k4, "pwd; cat f"), "/srv/w\nbase\n")
        (k5,) = Sandbox.fork_from(ckpt.id, client=self.client)
        self.addCleanup(k5.close)
        self.assertEqual(self.sh(k5, "pwd; cat f"), "/srv/w\nbase\n")
        with self.assertRaises(ValueError):
            ckpt.fork(count=0)
        for k in kids:
            k.close()
            with self.assertRaises(NotFound):
                Sandbox.connect(k.id, client=self.client)

    def test_fork_processes(self):
        # One request: each branch runs the node's python session (its objects, its
        # PID) and reads its identity; a branch's change reaches no sibling.
        sb = self.sandbox()
        py = sb.sessions.start("py", kind="python")
        pid = py.run("import os, json\nx = 41\nos.getpid()").stdout
        ckpt = sb.checkpoint(label="fork-procs")
        kids = ckpt.fork(count=2)
        for k in kids:
            self.addCleanup(k.close)
        files_only = False
        for i, k in enumerate(kids):
            b = k.fork_branch
            assert b is not None
            self.assertEqual(b.identity, {"sandbox": k.id, "branch": i, "count": 2, "parent_node": ckpt.id})
            self.assertEqual(self.sh(k, "cat /run/deltabox/identity"), json.dumps(b.identity, separators=(",", ":")) + "\n")
            if _fork_files_only(self, b):
                files_only = True
                continue
            self.assertEqual((b.branch, b.path, b.processes), (i, "durable", 1), b.reason)
            self.assertEqual(k.run("x + 1, os.getpid()", session="py").stdout, "(42, %s)\n" % pid.strip())
            self.assertEqual(k.run("json.load(open('/run/deltabox/identity'))['branch']", session="py").stdout, "%d\n" % i)
        if not files_only:
            kids[0].run("x = 0", session="py")
            self.assertEqual(kids[1].run("x", session="py").stdout, "41\n")
        with self.assertRaises(TypeError):
            ckpt.fork(count=1, nonsense=1)
        # sb.fork: the checkpoint and the fork in one request.
        py.run("x = 7")
        (k,) = sb.fork(label="again")
        self.addCleanup(k.close)
        assert k.fork_branch is not None
        self.assertEqual(self.client.node(k.head).label, "again")
        if not _fork_files_only(self, k.fork_branch):
            self.assertEqual(k.run("x", session="py").stdout, "7\n")

    def test_prepare_spare(self):
        # A member of a fast fork's family prepares the fork's node: its next restore
        # swaps in the spare (from_spare), exactly the node's python state.
        sb = self.sandbox()
        py = sb.sessions.start("py", kind="python")
        pid = py.run("import os\nx = 41\nos.getpid()").stdout
        (k,) = sb.fork(label="spare")
        self.addCleanup(k.close)
        assert k.fork_branch is not None
        if k.fork_branch.path != "fast":
            self.skipTest("the fork took the %s path: %s" % (k.fork_branch.path, k.fork_branch.reason))
        assert k.head is not None
        node = self.client.node(k.head)
        self.assertIn(k.id, node.prepare(sandbox=k.id).spares)
        k.run("x = 0", session="py")
        r = k.restore(node)
        self.assertTrue(r.from_spare)
        self.assertEqual(k.run("x, os.getpid()", session="py").stdout, "(41, %s)\n" % pid.strip())
        # A plain sandbox's node: refused, saying what to do.
        c = self.sandbox().checkpoint()
        with self.assertRaises(Conflict) as e:
            c.prepare()
        self.assertIn("fork", str(e.exception))

    def test_fork_names(self):
        sb = self.sandbox()
        base = "fk-%d-%d" % (os.getpid(), int(time.time() * 1000) % 10**6)
        kids = sb.fork(count=3, name=base)
        for k in kids:
            self.addCleanup(k.close)
        self.assertEqual([k.id for k in kids], ["%s-%d" % (base, i) for i in range(3)])
        (one,) = sb.fork(name=base + "-one")
        self.addCleanup(one.close)
        self.assertEqual(one.id, base + "-one")

    def test_images_import(self):
        with tempfile.TemporaryDirectory() as d:
            root = os.path.join(d, "rootfs")
            os.makedirs(os.path.join(root, "etc"))
            os.makedirs(os.path.join(root, "bin"))  # an image without /bin is refused
            with open(os.path.join(root, "etc", "hello"), "w") as f:
                f.write("hi\n")
            name = "pyimg-%d" % os.getpid()
            progress = []
            im = self.client.images.import_(name, root, on_progress=lambda d, t: progress.append((d, t)))
            try:
                self.assertEqual(im["name"], name)
                self.assertTrue(progress)
                self.assertEqual(progress[-1][0], progress[-1][1])  # done == total at the end
                self.assertIn(name, [i["name"] for i in self.client.images()])
                self.assertIn(name, [i["name"] for i in self.client.images.list()])
                with self.assertRaises(Conflict):
                    self.client.images.import_(name, root)
                with self.assertRaises(InvalidRequest):
                    self.client.images.import_(name + "-x", "relative/path")
            finally:
                self.client.images.remove(name)
            self.assertNotIn(name, [i["name"] for i in self.client.images()])

    def test_remove_nodes_on_close(self):
        # Nodes outlive their sandbox by default; remove_nodes=True takes them along,
        # but not a node another sandbox stands on, nor one below which it made a node.
        with Sandbox.create(client=self.client) as keep:
            kept = keep.checkpoint(label="kept")
        self.assertIn(kept.id, self.client.tree())
        self.assertEqual(kept.remove(), [kept.id])
        with Sandbox.create(client=self.client, remove_nodes=True) as sb:
            self.sh(sb, "echo 1 > f")
            a = sb.checkpoint(label="a")
            self.sh(sb, "echo 2 > f")
            b = sb.checkpoint(label="b")
            sb.restore(a)
            self.sh(sb, "echo 3 > f")
            c = sb.checkpoint(label="c")
            (kid,) = b.fork()  # stands on b
            self.addCleanup(kid.close, remove_nodes=True)
            self.sh(kid, "echo kid > f")
            kc = kid.checkpoint(label="kid's")
        t = self.client.tree()
        self.assertNotIn(c.id, t)  # made by sb, nobody on it: gone
        self.assertIn(b.id, t)  # the kid stands on it
        self.assertIn(a.id, t)  # b is below it
        self.assertEqual(t[b.id].children, [kc.id])
        kid.close(remove_nodes=True)  # its own node goes; sb's stay (not the kid's)
        t = self.client.tree()
        self.assertNotIn(kc.id, t)
        self.assertIn(b.id, t)
        self.assertEqual(sorted(Sandbox(sb.id, self.client).remove_nodes()), sorted([a.id, b.id]))
        self.assertNotIn(a.id, self.client.tree())

    def test_session_relative_cwd(self):
        sb = self.sandbox(workdir="/srv/w")
        self.sh(sb, "mkdir -p src/deep")
        s = sb.sessions.start("rel", cwd="src")
        self.assertEqual(s.run("pwd").stdout, "/srv/w/src\n")
        p = sb.sessions.start("relpy", kind="python", cwd="src/deep")
        self.assertEqual(p.run("import os; os.getcwd()").stdout, "'/srv/w/src/deep'\n")
        self.assertEqual(self.sh(sb, "pwd", cwd="src"), "/srv/w/src\n")
        with self.assertRaises(InvalidRequest):
            sb.sessions.start("nope", cwd="missing")

    # ---- asyncio ----

    def test_aio_sandbox(self):
        async def main():
            async with AsyncClient(SOCKET, timeout=120) as c:
                async with AsyncSandbox.create(client=c) as sb:
                    sid = sb.id
                    start = time.monotonic()
                    rs = await asyncio.gather(*(sb.run("sleep 1; echo %d" % i, timeout=30)
                                                for i in range(3)))
                    took = time.monotonic() - start
                    self.assertEqual([r.stdout for r in rs], ["0\n", "1\n", "2\n"])
                    self.assertLess(took, 2.5, "3 one-second commands took %.1fs" % took)
                    # on_output on the event loop, a coroutine function, in order.
                    got = []

                    async def on_output(stream, data):
                        await asyncio.sleep(0)
                        got.append((stream, data))

                    r = await sb.run("echo a; sleep 0.2; echo b >&2", on_output=on_output)
                    self.assertEqual((r.stdout, r.stderr), ("a\n", "b\n"))
                    self.assertEqual(got, [("stdout", "a\n"), ("stderr", "b\n")])
                    # A python session's process across a checkpoint and a restore.
                    py = await sb.sessions.start("py", kind="python")
                    self.assertIsInstance(py, AsyncSession)
                    self.assertEqual((await py.run("x = 41")).exit_code, 0)
                    ck = await sb.checkpoint(label="aio")
                    self.assertIsInstance(ck, CheckpointResult)
                    self.assertEqual((ck.processes, ck.process_errors, ck.node.label), (1, [], "aio"))
                    await py.run("x = 0")
                    res = await sb.restore(ck)
                    self.assertEqual((res.node.id, res.processes), (ck.id, 1))
                    self.assertEqual((res.sessions_restored, res.sessions_ended), (["py"], []))
                    r = await sb.sessions.run("py", "x + 1")
                    self.assertEqual((r.stdout, r.session_restarted), ("42\n", False))
                    self.assertEqual(await sb.head(), ck.id)
                    self.assertEqual((await c.node(ck.id)).templates.sessions, ["py"])
                    self.assertEqual(ck.memory.limit_bytes, (await sb.memory()).limit_bytes)
                    self.assertIn("default", [i["name"] for i in await c.images()])
                    self.assertIn("default", [i["name"] for i in await c.images.list()])
                    # Files, and a fork (the node's files and its python session).
                    await sb.files.write("f", "from aio")
                    self.assertEqual(await sb.files.read_text("f"), "from aio")
                    (kid,) = await c.fork(ck, 1)
                    try:
                        self.assertIsInstance(kid, AsyncSandbox)
                        self.assertEqual(await kid.head(), ck.id)
                        self.assertFalse(await kid.files.exists("f"))
                        assert kid.fork_branch is not None
                        if _fork_files_only(self, kid.fork_branch):
                            self.assertEqual([s.running for s in await kid.sessions.list()], [])
                        else:
                            self.assertEqual((kid.fork_branch.path, kid.fork_branch.processes), ("durable", 1))
                            self.assertEqual((await kid.sessions.run("py", "x + 1")).stdout, "42\n")
                    finally:
                        await kid.close()
                with self.assertRaises(NotFound):
                    await AsyncSandbox.connect(sid, client=c)

        asyncio.run(main())

    def test_aio_create_awaitable_and_context_manager(self):
        # AsyncSandbox.create(...) is awaited, or entered directly by async with (no
        # await inside), which removes the sandbox at the end, on an exception too.
        async def main():
            async with AsyncClient(SOCKET, timeout=120) as c:
                async with AsyncSandbox.create(client=c) as sb:
                    self.assertIsInstance(sb, AsyncSandbox)
                    sid = sb.id
                    self.assertEqual((await sb.run("echo in")).stdout, "in\n")
                with self.assertRaises(NotFound):
                    await AsyncSandbox.connect(sid, client=c)
                with self.assertRaises(ZeroDivisionError):
                    async with c.create() as sb:
                        sid = sb.id
                        1 / 0
                with self.assertRaises(NotFound):
                    await AsyncSandbox.connect(sid, client=c)
                async with await AsyncSandbox.create(client=c) as sb:  # the form before 0.4.0
                    sid = sb.id
                with self.assertRaises(NotFound):
                    await AsyncSandbox.connect(sid, client=c)
                creating = AsyncSandbox.create(client=c)
                sb = await creating
                try:
                    self.assertEqual(await sb.status(), "running")
                    with self.assertRaises(RuntimeError):  # once: never a second sandbox
                        await creating
                finally:
                    await sb.close()

        asyncio.run(main())

    def test_aio_cancel_ends_the_command(self):
        # Cancelling the task of a call stops the command on the daemon: a plain
        # command's process is gone, a session's command is interrupted and the session
        # lives on with its state; streamed or not.
        async def main():
            async with AsyncClient(SOCKET, timeout=120) as c:
                async with AsyncSandbox.create(client=c) as sb:
                    async def until(cond, what):
                        deadline = time.monotonic() + 15
                        while not cond((await sb.run(["ps", "-eo", "args"])).stdout):
                            self.assertLess(time.monotonic(), deadline, what)
                            await asyncio.sleep(0.05)

                    async def cancelled(call, proc):
                        task = asyncio.ensure_future(call)
                        await until(lambda ps: proc in ps, "%s never started" % proc)
                        task.cancel()
                        with self.assertRaises(asyncio.CancelledError):
                            await task
                        await until(lambda ps: proc not in ps,
                                    "%s still runs after its call was cancelled" % proc)

                    await cancelled(sb.run("sleep 301; true", timeout=None), "sleep 301")
                    await cancelled(sb.run("echo go; sleep 302; true", timeout=None,
                                           on_output=lambda s, d: None), "sleep 302")
                    await sb.run("X=5", session="main")
                    await cancelled(sb.run("sleep 303", session="main", timeout=None), "sleep 303")
                    r = await sb.run("echo $X", session="main")
                    self.assertEqual((r.stdout, r.session_restarted), ("5\n", False))
                    # The sandbox's other calls were not disturbed.
                    self.assertEqual((await sb.run("echo ok")).stdout, "ok\n")

        asyncio.run(main())

    def test_aio_on_output_raising_abandons_the_command(self):
        class Stop(Exception):
            pass

        def on_output(stream, data):
            raise Stop()

        async def main():
            async with AsyncClient(SOCKET, timeout=120) as c:
                async with await AsyncSandbox.create(client=c) as sb:
                    start = time.monotonic()
                    with self.assertRaises(Stop):
                        await sb.run("echo go; sleep 30", on_output=on_output)
                    self.assertLess(time.monotonic() - start, 10)
                    deadline = time.monotonic() + 10
                    while "sleep 30" in (await sb.run("ps -eo args")).stdout:
                        self.assertLess(time.monotonic(), deadline, "the abandoned command still runs")
                        await asyncio.sleep(0.1)

        asyncio.run(main())

    # ---- errors ----

    def test_typed_errors(self):
        with self.assertRaises(NotFound) as cm:
            Sandbox.connect("no-such-sandbox-xyz", client=self.client)
        e = cm.exception
        self.assertEqual((e.code, e.status), ("not_found", 404))
        self.assertIn("no-such-sandbox-xyz", e.message)
        with self.assertRaises(InvalidRequest) as cm:
            Sandbox.create(name="Bad Name!", client=self.client)
        self.assertEqual((cm.exception.code, cm.exception.status), ("invalid", 400))
        sb = self.sandbox()
        with self.assertRaises(Conflict) as cm:
            Sandbox.create(name=sb.id, client=self.client)
        self.assertEqual((cm.exception.code, cm.exception.status), ("conflict", 409))
        with self.assertRaises(NotFound):
            sb.restore("nnosuchnode")
        with self.assertRaises(NotFound):
            self.client.checkpoint("nnosuchnode")
        with self.assertRaises(DeltaBoxError):  # the base class catches them all
            Sandbox.connect("no-such-sandbox-xyz", client=self.client).run("true")

    def test_conflict_checkpoint_while_running(self):
        sb = self.sandbox()
        before = sb.checkpoint(label="before")
        started = threading.Event()
        out = {}

        def run():
            try:
                out["result"] = sb.run("echo started; sleep 3; echo done", timeout=60,
                                       on_output=lambda s, d: started.set())
            except BaseException as e:  # reported by the main thread
                out["error"] = e
                started.set()

        th = threading.Thread(target=run)
        th.start()
        try:
            self.assertTrue(started.wait(30), "the command did not start")
            self.assertNotIn("error", out)
            with self.assertRaises(Conflict) as cm:
                sb.checkpoint(label="busy", wait=0)
            e = cm.exception
            self.assertEqual((e.code, e.status), ("conflict", 409))
            self.assertIn("sleep 3", e.message)  # names the command
            with self.assertRaises(Conflict):
                sb.restore(before, wait=None)
            # A wait shorter than the command: Conflict once it is over, naming it.
            start = time.monotonic()
            with self.assertRaises(Conflict) as cm:
                sb.checkpoint(label="busy", wait=0.3)
            self.assertGreaterEqual(time.monotonic() - start, 0.25)
            self.assertIn("waited 300ms", cm.exception.message)
            self.assertIn("sleep 3", cm.exception.message)
        finally:
            th.join(60)
        self.assertNotIn("error", out)
        self.assertEqual(out["result"].stdout, "started\ndone\n")
        sb.checkpoint(label="idle")  # fine once the command ended

    def test_checkpoint_waits_for_running_command(self):
        # By default checkpoint and restore queue behind what runs (5 s at most).
        sb = self.sandbox()
        before = sb.checkpoint(label="before")
        started = threading.Event()
        out = {}

        def run():
            try:
                out["result"] = sb.run("echo started; sleep 2; echo done > f", timeout=60,
                                       on_output=lambda s, d: started.set())
            except BaseException as e:
                out["error"] = e
                started.set()

        th = threading.Thread(target=run)
        th.start()
        try:
            self.assertTrue(started.wait(30), "the command did not start")
            ck = sb.checkpoint(label="after the command")
        finally:
            th.join(60)
        self.assertNotIn("error", out)
        self.assertGreater(ck.waited, 1.0)
        self.assertLess(ck.waited, 5.0)
        sb.restore(before)
        self.assertFalse(sb.files.exists("f"))
        sb.restore(ck)
        self.assertEqual(sb.files.read_text("f"), "done\n")  # it waited for the command
        # A restore queues the same way.
        th = threading.Thread(target=lambda: sb.run("sleep 1; echo later > g", timeout=60))
        th.start()
        try:
            deadline = time.monotonic() + 10
            while "sleep 1" not in sb.run("ps -eo args").stdout and time.monotonic() < deadline:
                time.sleep(0.05)
            res = sb.restore(before)
        finally:
            th.join(60)
        self.assertGreater(res.waited, 0.2)
        self.assertFalse(sb.files.exists("g"))

    def test_memory_of_checkpoints_and_oom(self):
        # Without a budget of their own (template_budget_mb=-1), templates count
        # against the memory limit: the answers show it, warn, and a command the limit
        # kills says so.
        sb = self.sandbox(memory_mb=256, template_budget_mb=-1)
        sb.sessions.start("py", kind="python")
        heap = "h = bytearray(60 << 20)\nfor i in range(0, len(h), 4096): h[i] = 1\n"
        cks = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(3):
                sb.run(heap, session="py").check()
                cks.append(sb.checkpoint(label="heap %d" % i))
        first, last = cks[0], cks[-1]
        self.assertEqual(first.memory.limit_bytes, 256 << 20)
        self.assertGreater(first.memory.node_templates_rss_bytes, 60 << 20)
        self.assertEqual(first.warnings, [])
        self.assertEqual(last.memory.templates.processes, 3)
        self.assertGreater(last.memory.templates.pss_bytes, 128 << 20)
        self.assertTrue(last.warnings)
        self.assertIn("of its 256 MiB memory limit", last.warnings[0])
        self.assertIn(first.id, last.warnings[0])
        mw = [w for w in caught if issubclass(w.category, MemoryWarning)]
        self.assertEqual([str(w.message) for w in mw], last.warnings)
        self.assertEqual(mw[0].filename, __file__)  # warned at the caller's line
        mem = sb.memory()
        self.assertEqual((mem.limit_bytes, mem.templates.processes), (256 << 20, 3))
        self.assertGreater(mem.usage_bytes, 128 << 20)
        self.assertIn("[1 process, ", sb.tree().render())
        # The OOM killer's choice is the hog (oom_score_adj 1000), not a template.
        r = sb.run("echo 1000 > /proc/self/oom_score_adj; exec python3 -c 'b = bytearray(300 << 20)\n"
                   "for i in range(0, len(b), 4096): b[i] = 1'", timeout=60)
        self.assertEqual((r.exit_code, r.signal), (-1, 9))
        self.assertIn("killed by SIGKILL: the sandbox's memory limit (256 MiB) was reached", r.oom)
        self.assertIn("held by the templates of the sandbox's checkpoints", r.oom)
        with self.assertRaises(CommandError) as cm:
            r.check()
        self.assertIn("memory limit (256 MiB)", str(cm.exception))
        self.assertIsNone(sb.run("true").oom)
        self.assertEqual(sb.memory().oom_kills, 1)

    def test_template_budget_and_pins(self):
        # A budget of their own: past it a checkpoint waits, then raises
        # TemplateBudgetExceeded naming it, and the session is unchanged; pins show on
        # the node and in the sandbox's memory.
        warnings.simplefilter("ignore", MemoryWarning)  # past half the budget: expected
        self.addCleanup(warnings.resetwarnings)
        sb = self.sandbox(memory_mb=256, template_budget_mb=64)
        sb.sessions.start("py", kind="python")
        sb.run("h = bytearray(60 << 20)\nfor i in range(0, len(h), 4096): h[i] = 1\n", session="py").check()
        first = sb.checkpoint(pin=True)
        self.assertTrue(first.node.pinned)
        self.assertEqual(first.memory.template_budget_bytes, 64 << 20)
        sb.run("for i in range(0, len(h), 4096): h[i] = 2\n", session="py").check()
        sb.checkpoint()  # the first template holds 60 MiB: under 64
        sb.run("for i in range(0, len(h), 4096): h[i] = 3\n", session="py").check()
        t0 = time.monotonic()
        with self.assertRaises(deltabox.TemplateBudgetExceeded) as cm:
            sb.checkpoint(wait=0.3)
        self.assertGreaterEqual(time.monotonic() - t0, 0.3)
        self.assertEqual((cm.exception.status, cm.exception.code), (507, "template_budget"))
        self.assertIn("template_budget_mb 64 MiB", str(cm.exception))
        self.assertEqual(sb.run("print(h[4096])", session="py").check().stdout.strip(), "3")
        mem = sb.memory()
        self.assertEqual(mem.template_budget["budget_bytes"], 64 << 20)
        self.assertEqual(mem.template_budget["pinned_nodes"], 1)
        self.assertFalse(first.pin(False).pinned)
        self.assertTrue(self.client.checkpoint(first.id).pin().pinned)

    # ---- context managers ----

    def test_context_manager_removes(self):
        with Sandbox.create(client=self.client) as sb:
            sid = sb.id
            self.assertEqual(self.sh(sb, "echo in"), "in\n")
        with self.assertRaises(NotFound):
            Sandbox.connect(sid, client=self.client)
        self.assertNotIn(sid, [s.id for s in Sandbox.list(client=self.client)])
        sb.close()  # twice is fine
        with self.assertRaises(NotFound):
            sb.remove()
        # Also when the block raises.
        with self.assertRaises(KeyError):
            with Sandbox.create(client=self.client) as sb2:
                sid2 = sb2.id
                raise KeyError("boom")
        with self.assertRaises(NotFound):
            Sandbox.connect(sid2, client=self.client)
        # A client as a context manager closes its connections; it stays usable.
        with Client(SOCKET) as c:
            self.assertTrue(c.health()["ok"])
        self.assertTrue(c.health()["ok"])
        c.close()

    # ---- files ----

    def test_files(self):
        sb = self.sandbox()
        self.files_or_skip(sb)
        f = sb.files
        info = f.write("a/b/c.txt", "héllo\n")
        self.assertEqual((info.name, info.path, info.type, info.size), ("c.txt", "/workspace/a/b/c.txt", "file", 7))
        self.assertEqual(info.mode, 0o644)
        self.assertEqual(f.read("a/b/c.txt"), "héllo\n".encode())
        self.assertEqual(f.read_text("/workspace/a/b/c.txt"), "héllo\n")
        self.assertEqual(f.read("a/b/c.txt", offset=1, length=3), "héllo\n".encode()[1:4])
        blob = bytes(range(256)) * 1000
        f.write("bin", blob)
        self.assertEqual(f.read("bin"), blob)
        self.assertEqual(self.sh(sb, "sha256sum bin | cut -d' ' -f1"), hashlib.sha256(blob).hexdigest() + "\n")
        # Written files are seen by commands, and the other way round.
        self.assertEqual(self.sh(sb, "cat a/b/c.txt"), "héllo\n")
        self.sh(sb, "echo from-cmd > cmd.txt")
        self.assertEqual(f.read_text("cmd.txt"), "from-cmd\n")
        # Modes.
        f.write("run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
        st = f.stat("run.sh")
        self.assertEqual((st.mode, st.permissions, st.is_file), (0o755, "-rwxr-xr-x", True))
        self.assertEqual(self.sh(sb, "./run.sh"), "ran\n")
        # Listing.
        self.assertEqual(f.list().names, ["a", "bin", "cmd.txt", "run.sh"])
        self.assertEqual(f.list(".").path, "/workspace")
        rec = f.list("a", recursive=True)
        self.assertEqual([e.path for e in rec], ["/workspace/a/b", "/workspace/a/b/c.txt"])
        self.assertTrue(rec[0].is_dir)
        self.assertFalse(rec.truncated)
        # mkdir, exists, remove.
        self.assertTrue(f.mkdir("x/y"))
        self.assertFalse(f.mkdir("x/y"))
        self.assertTrue(f.stat("x/y").is_dir)
        self.assertTrue(f.exists("x/y"))
        self.assertFalse(f.exists("nope"))
        with self.assertRaises(Conflict):
            f.remove("x")  # not empty
        f.remove("x", recursive=True)
        self.assertFalse(f.exists("x"))
        f.remove("bin")
        with self.assertRaises(NotFound):
            f.read("bin")
        with self.assertRaises(NotFound):
            f.write("missing/dir/f", "x", mkdir=False)
        with self.assertRaises(InvalidRequest) as cm:
            f.read("../../../etc/passwd")
        self.assertIn("sandbox", cm.exception.message)  # the message says why
        # Files roll back with checkpoint/restore.
        ck = sb.checkpoint()
        f.write("a/b/c.txt", "changed")
        f.write("added", "new")
        sb.restore(ck)
        self.assertEqual(f.read_text("a/b/c.txt"), "héllo\n")
        self.assertFalse(f.exists("added"))


if __name__ == "__main__":
    unittest.main()
