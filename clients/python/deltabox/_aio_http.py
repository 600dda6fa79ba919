"""HTTP/1.1 over the daemon's unix socket for asyncio: the asyncio client's transport.

Each call takes a kept-alive connection of its own (asyncio streams from
``asyncio.open_unix_connection``), writes its request as one write and reads the answer
with its own buffer, as the blocking transport does (the request bytes, the status line,
header and chunk parsing, the error mapping are _http's). Standard library only.

Cancelling a call (``task.cancel()``, ``asyncio.wait_for`` running out) aborts its
connection: the daemon sees the client go and interrupts what the call started (an
exec's process group is killed, a session's command gets ^C; docs/API.md, "A client
that goes away interrupts its call"). A checkpoint, restore or sandbox creation the
daemon already started runs to its end all the same: it is never left half done.
"""

import asyncio
import json
import socket
import ssl
import threading
from typing import Any, AsyncGenerator, Awaitable, Dict, List, Optional, Tuple, TypeVar

from ._http import (CHUNKED, DEFAULT, LENGTH, NO_BODY, TO_CLOSE, _MAX_HEAD, Answer, _BadAnswer,
                    _Closed, body_framing, chunk_size, decode_event, decode_json, error_of,
                    make_request, make_url, parse_header, parse_status, unreachable, Remote)
from .errors import DaemonUnreachable, DeltaBoxError, RequestTimeout

T = TypeVar("T")

# Errors that mean the peer closed the connection.
_DISCONNECTS = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


async def _within(aw: Awaitable[T], timeout: Optional[float]) -> T:
    if timeout is None:
        return await aw
    return await asyncio.wait_for(aw, timeout)


class _Conn:
    """A connection to the daemon on one event loop, with its own read buffer."""

    __slots__ = ("reader", "writer", "loop", "buf", "got_any")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.reader, self.writer, self.loop = reader, writer, loop
        self.buf, self.got_any = bytearray(), False

    def abort(self) -> None:
        """Closes the socket at once (the daemon sees the client go)."""
        try:
            self.writer.transport.abort()
        except RuntimeError:  # its loop is closed (asyncio.run ended): shut the socket down
            sock = self.writer.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    async def _more(self, timeout: Optional[float]) -> None:
        b = await _within(self.reader.read(65536), timeout)
        if not b:
            raise _Closed(self.got_any or bool(self.buf))
        self.got_any = True
        self.buf += b

    async def line(self, timeout: Optional[float]) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[:i + 2]
                return out
            if len(self.buf) > _MAX_HEAD:
                raise _BadAnswer("a line longer than %d bytes" % _MAX_HEAD)
            await self._more(timeout)

    async def exactly(self, n: int, timeout: Optional[float]) -> bytes:
        while len(self.buf) < n:
            await self._more(timeout)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def some(self, most: int, timeout: Optional[float]) -> bytes:
        """Up to most bytes (at least one)."""
        if not self.buf:
            await self._more(timeout)
        out = bytes(self.buf[:most])
        del self.buf[:len(out)]
        return out

    async def head(self, req: bytes, method: str,
                   timeout: Optional[float]) -> Tuple[int, Dict[str, str], bool]:
        """Sends req and reads the answer's status and headers: (status, headers,
        keep_alive)."""
        self.got_any = False
        self.writer.write(req)
        await _within(self.writer.drain(), timeout)
        while True:  # 1xx answers are skipped
            http11, status = parse_status(await self.line(timeout))
            headers: Dict[str, str] = {}
            while True:
                h = await self.line(timeout)
                if not h:
                    break
                parse_header(h, headers)
            if not 100 <= status < 200:
                break
        return status, headers, http11 and headers.get("connection", "").lower() != "close"


class _Body:
    """The body of an answer, read piece by piece (de-chunked)."""

    def __init__(self, conn: _Conn, framing: int, length: int, timeout: Optional[float]) -> None:
        self.conn, self.framing, self.left, self.timeout = conn, framing, length, timeout
        self.done = framing == NO_BODY or (framing == LENGTH and length == 0)
        self.in_chunk = 0

    async def piece(self) -> bytes:
        """The next bytes of the body; b"" at its end."""
        c, t = self.conn, self.timeout
        if self.done:
            return b""
        if self.framing == CHUNKED:
            if self.in_chunk == 0:
                n = chunk_size(await c.line(t))
                if n == 0:
                    while await c.line(t):  # trailers
                        pass
                    self.done = True
                    return b""
                self.in_chunk = n
            out = await c.some(self.in_chunk, t)
            self.in_chunk -= len(out)
            if self.in_chunk == 0 and await c.exactly(2, t) != b"\r\n":
                raise _BadAnswer("a chunk not followed by CRLF")
            return out
        if self.framing == LENGTH:
            out = await c.some(self.left, t)
            self.left -= len(out)
            self.done = self.left == 0
            return out
        try:  # TO_CLOSE: the body ends with the connection
            return await c.some(65536, t)
        except _Closed:
            self.done = True
            return b""

    async def read(self) -> bytes:
        parts: List[bytes] = []
        while True:
            p = await self.piece()
            if not p:
                return b"".join(parts)
            parts.append(p)


class Stream:
    """The events of an NDJSON answer: ``await stream.next()`` until None, then
    ``close()`` (which, before the end, aborts the connection: the daemon interrupts
    the call)."""

    def __init__(self, t: "AsyncTransport", conn: _Conn, body: _Body, keep: bool, what: str) -> None:
        self.t, self.conn, self.body, self.keep, self.what = t, conn, body, keep, what
        self.pending = bytearray()
        self.ended = False
        self.closed = False

    async def next(self) -> Optional[Dict[str, Any]]:
        while True:
            i = self.pending.find(b"\n")
            if i >= 0:
                line = bytes(self.pending[:i]).strip()
                del self.pending[:i + 1]
                if line:
                    ev: Dict[str, Any] = decode_event(line)
                    return ev
                continue
            if self.ended:
                line = bytes(self.pending).strip()
                self.pending = bytearray()
                if line:
                    last: Dict[str, Any] = decode_event(line)
                    return last
                return None
            try:
                p = await self.body.piece()
            except (asyncio.TimeoutError, _Closed, _BadAnswer, OSError) as e:
                self.close()
                raise self.t._failure(e, self.what, mid_answer=True) from None
            if p:
                self.pending += p
            else:
                self.ended = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.ended and self.body.done and self.keep:
            self.t._put(self.conn)
        else:
            self.conn.abort()


class AsyncTransport:
    """Sends requests to one daemon from coroutines; each request takes an idle
    kept-alive connection of the running event loop, or opens one. Connections belong
    to their event loop (asyncio streams cannot move), so the idle ones are kept by loop:
    one client may serve several loops (threads, or asyncio.run called again)."""

    def __init__(self, socket_path: str, timeout: Optional[float] = 600.0, max_idle: int = 8,
                 remote: Optional[Remote] = None) -> None:
        self.remote = remote
        # Named in messages: the socket, or the TCP listener's URL.
        self.socket_path = remote.url if remote is not None else socket_path
        self.timeout = timeout
        self.max_idle = max_idle
        self._idle: Dict[asyncio.AbstractEventLoop, List[_Conn]] = {}
        self._watches: Dict[asyncio.AbstractEventLoop, AsyncGenerator[None, None]] = {}
        self._lock = threading.Lock()  # _idle and _watches, between several loops' threads

    async def _watch(self, loop: asyncio.AbstractEventLoop) -> AsyncGenerator[None, None]:
        """Stays suspended for the loop's life. asyncio.run ends a loop by closing its
        suspended async generators (shutdown_asyncgens) while it still runs: this one's
        finally then closes the loop's idle connections, which could not be closed
        once the loop is (their sockets would stay open until the garbage collector
        warned of them)."""
        try:
            yield
        finally:
            with self._lock:
                conns = self._idle.pop(loop, [])
                self._watches.pop(loop, None)
            for c in conns:
                c.abort()
            await asyncio.sleep(0)  # the transports' connection_lost closes the sockets

    def _take(self) -> Optional[_Conn]:
        loop = asyncio.get_running_loop()
        with self._lock:
            gone = [lp for lp in self._idle if lp.is_closed()]
            dead = [c for lp in gone for c in self._idle.pop(lp)]
            pool = self._idle.get(loop) or []
            conn = None
            while pool:
                c = pool.pop()
                if not c.reader.at_eof():
                    conn = c
                    break
                dead.append(c)  # the daemon closed it
        for c in dead:
            c.abort()
        return conn

    def _put(self, conn: _Conn) -> None:
        with self._lock:
            pool = self._idle.setdefault(conn.loop, [])
            if len(pool) < self.max_idle:
                pool.append(conn)
                return
        conn.abort()

    def close(self) -> None:
        """Closes the idle connections (calls under way finish); those of another
        running loop are closed by that loop."""
        with self._lock:
            idle, self._idle = self._idle, {}
        try:
            mine: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:
            mine = None
        for loop, conns in idle.items():
            for c in conns:
                if loop is mine or loop.is_closed():
                    c.abort()
                else:
                    try:
                        loop.call_soon_threadsafe(c.abort)
                    except RuntimeError:  # closed meanwhile
                        c.abort()

    async def _connect(self, timeout: Optional[float]) -> _Conn:
        try:
            if self.remote is not None:
                ctx = ssl.create_default_context() if self.remote.tls else None
                opening = asyncio.open_connection(self.remote.host, self.remote.port, ssl=ctx)
            else:
                opening = asyncio.open_unix_connection(self.socket_path)
            r, w = await _within(opening, timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout("the DeltaBox daemon on %s did not accept a connection within %ss"
                                 % (self.socket_path, timeout)) from None
        except OSError as e:
            raise unreachable(self.socket_path, e) from None
        loop = asyncio.get_running_loop()
        with self._lock:
            watch = None if loop in self._watches else self._watch(loop)
            if watch is not None:
                self._watches[loop] = watch
        if watch is not None:
            await watch.__anext__()
        return _Conn(r, w, loop)

    def _failure(self, e: BaseException, what: str, mid_answer: bool = False) -> DeltaBoxError:
        if isinstance(e, asyncio.TimeoutError):
            return RequestTimeout("the DeltaBox daemon on %s did not answer %s within the "
                                  "client's timeout" % (self.socket_path, what))
        if isinstance(e, _BadAnswer):
            return DeltaBoxError("protocol", "bad HTTP answer from the DeltaBox daemon to %s: %s"
                                 % (what, e))
        if mid_answer or (isinstance(e, _Closed) and e.got_any):
            return DaemonUnreachable(
                "the DeltaBox daemon on %s hung up in the middle of its answer to %s: did it "
                "stop? See its log." % (self.socket_path, what))
        if isinstance(e, (_Closed,) + _DISCONNECTS):
            return DaemonUnreachable(
                "the DeltaBox daemon on %s hung up before answering %s: did it stop? See its "
                "log." % (self.socket_path, what))
        return unreachable(self.socket_path, e)

    async def _open(self, method: str, path: str, query: Optional[Dict[str, Any]],
                    body: Optional[bytes], content_type: Optional[str],
                    timeout: Any) -> Tuple[_Conn, int, Dict[str, str], bool, Optional[float], str]:
        """Sends a request and reads its answer's head: (conn, status, headers,
        keep_alive, timeout, what). The caller reads the body, and aborts conn on any
        error (a cancellation included)."""
        if timeout is DEFAULT:
            timeout = self.timeout
        url = make_url(path, query)
        what = "%s %s" % (method, url)
        req = make_request(method, url, body, content_type,
                           self.remote.api_key if self.remote is not None else None)
        for attempt in range(2):
            conn = self._take()
            reused = conn is not None
            if conn is None:
                conn = await self._connect(timeout)
            try:
                status, headers, keep = await conn.head(req, method, timeout)
            except (asyncio.TimeoutError, _Closed, _BadAnswer, OSError) as e:
                conn.abort()
                got_any = isinstance(e, _Closed) and e.got_any
                # A kept-alive connection the daemon had closed: the request never
                # reached it, so sending it again on a new connection is safe.
                if reused and attempt == 0 and not got_any and isinstance(e, (_Closed,) + _DISCONNECTS):
                    continue
                raise self._failure(e, what) from None
            except BaseException:  # cancelled: the daemon sees the connection close
                conn.abort()
                raise
            return conn, status, headers, keep, timeout, what
        raise AssertionError("unreachable")

    async def request(self, method: str, path: str, query: Optional[Dict[str, Any]] = None,
                      body: Optional[bytes] = None, content_type: Optional[str] = None,
                      timeout: Any = DEFAULT) -> Tuple[bytes, Answer]:
        """Sends a request and returns the whole body of a successful answer (and its
        status and headers); an error answer is raised as an exception."""
        conn, status, headers, keep, t, what = await self._open(method, path, query, body,
                                                                content_type, timeout)
        framing, length = body_framing(method, status, headers)
        try:
            data = await _Body(conn, framing, length, t).read()
        except (asyncio.TimeoutError, _Closed, _BadAnswer, OSError) as e:
            conn.abort()
            raise self._failure(e, what, mid_answer=True) from None
        except BaseException:
            conn.abort()
            raise
        if keep and framing != TO_CLOSE:
            self._put(conn)
        else:
            conn.abort()
        if status >= 300:
            raise error_of(status, data)
        return data, Answer(status, headers)

    async def json(self, method: str, path: str, payload: Any = None,
                   query: Optional[Dict[str, Any]] = None, timeout: Any = DEFAULT) -> Any:
        """Sends payload as JSON (None: no body) and decodes the JSON answer."""
        body = None if payload is None else json.dumps(payload).encode("utf-8")
        data, _ = await self.request(method, path, query, body, None, timeout)
        return decode_json(data, method, path)

    async def stream(self, method: str, path: str, payload: Any, timeout: Any = DEFAULT) -> Stream:
        """Sends payload as JSON and returns the events of the NDJSON answer; an error
        answer is raised."""
        body = json.dumps(payload).encode("utf-8")
        conn, status, headers, keep, t, what = await self._open(method, path, None, body, None, timeout)
        framing, length = body_framing(method, status, headers)
        b = _Body(conn, framing, length, t)
        if status >= 300:
            try:
                data = await b.read()
            except BaseException:
                conn.abort()
                raise
            conn.abort()
            raise error_of(status, data)
        return Stream(self, conn, b, keep and framing != TO_CLOSE, what)
