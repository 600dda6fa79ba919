"""The client for asyncio programs: the same API as :class:`~deltabox.Sandbox` and
:class:`~deltabox.Client`, with coroutines.

    import asyncio
    from deltabox.aio import AsyncSandbox

    async def main() -> None:
        async with AsyncSandbox.create() as sb:
            ckpt = await sb.checkpoint(label="clean")
            results = await asyncio.gather(*(sb.run("sleep 1; echo %d" % i) for i in range(4)))
            res = await sb.restore(ckpt)
            print([r.stdout for r in results], res.processes)

    asyncio.run(main())

The calls are asyncio all the way to the daemon's socket (``asyncio.open_unix_connection``,
HTTP/1.1 as the blocking client writes it; standard library only): no thread, and any
number of calls at once, each on a kept-alive connection of its own.

**Cancelling a call stops it.** A cancelled task (``task.cancel()``, ``asyncio.wait_for``
running out, a ``TaskGroup`` failing) aborts its call's connection, and the daemon
interrupts what the call started: an exec's process group is killed, a session's command
gets ^C (the session lives on, ready for the next call). A checkpoint, restore or
creation the daemon has started still runs to its end (it is never left half done): a
sandbox whose creation was cancelled may exist, so name it (``name=``) to find it.

``AsyncSandbox.create(...)`` may be awaited (``sb = await AsyncSandbox.create()``) or
used directly as an async context manager (``async with AsyncSandbox.create() as sb``),
which removes the sandbox at the end of the block.

The values are the blocking client's (Result, CheckpointResult, RestoreResult, Node,
Tree, FileInfo...). Their own methods block (``node.refresh()``, ``ckpt.fork()``), so
their coroutines are on the client: ``await client.fork(ckpt, 2)``,
``await client.node(id)``, ``await client.remove_checkpoint(id)``.

Differences from the blocking API: ``head`` and ``status`` are coroutine methods
(``await sb.head()``); ``on_output`` of ``run`` (and ``on_progress`` of an import) is
called on the event loop, a plain function or a coroutine function whose result is
awaited before the next piece is read (back-pressure); if it raises, the command is
abandoned and killed.
"""

import datetime as _dt
import inspect
import json
from dataclasses import dataclass, field
from typing import (Any, Awaitable, Callable, Dict, Generator, Iterable, List, Mapping,
                    Optional, Sequence, Union)

from ._aio_http import AsyncTransport
from ._http import q
from .client import Client, default_client
from .errors import Conflict, NotFound, from_answer
from .models import FileInfo, Listing, Node, RestoreResult, Result, SandboxMemory, Tree, name_of, parse_time
from .sandbox import (CLIENT_TIMEOUT, DEFAULT_WAIT, CheckpointResult, Command, ForkBranch, NodeRef, Sandbox,
                      Timeout, _as_node, _checkpoint_body, _create_body, _data_bytes, _env_list,
                      _exec_request, _fork_body, _forked, _mode, _op_timeout, _Output,
                      _node_id, _removable_nodes, _restore_body, _warn)

# on_output of AsyncSandbox.run: called on the event loop, may be a coroutine function.
AsyncOnOutput = Callable[[str, str], Union[None, Awaitable[None]]]
# on_progress of AsyncImages.import_: (done, total) bytes, on the event loop.
AsyncOnProgress = Callable[[int, int], Union[None, Awaitable[None]]]


async def _call(fn: Callable[..., Any], *args: Any) -> None:
    out = fn(*args)
    if inspect.isawaitable(out):
        await out


class AsyncClient:
    """A DeltaBox daemon for asyncio code.

    Args:
        socket_path, timeout: as for :class:`~deltabox.Client`.
        client: a blocking client whose socket and timeout to use; the nodes this
            client returns carry it (their own methods block). Default: one of
            ``socket_path``.
        max_workers: ignored (the thread pool of the client before 0.4.0).
    """

    def __init__(self, socket_path: Optional[str] = None, timeout: Optional[float] = 600.0,
                 max_workers: Optional[int] = None, client: Optional[Client] = None) -> None:
        self.blocking = client if client is not None else Client(socket_path, timeout=timeout)
        self.socket_path = self.blocking.socket_path
        self._t = AsyncTransport(self.socket_path, timeout=self.blocking._t.timeout,
                                 remote=self.blocking._t.remote)
        #: ``await client.images()`` lists them; ``await client.images.import_(...)``.
        self.images = AsyncImages(self)

    def __repr__(self) -> str:
        return "AsyncClient(socket_path=%r)" % self.socket_path

    async def close(self) -> None:
        """Closes idle connections. The client stays usable."""
        self._t.close()
        self.blocking.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ---- the daemon and the tree ----

    async def health(self) -> Dict[str, Any]:
        return dict(await self._t.json("GET", "/health"))

    async def sync(self) -> None:
        """Returns once every change made so far (checkpoints included) is durable."""
        await self._t.json("POST", "/sync")

    async def sandboxes(self) -> List["AsyncSandbox"]:
        """Every sandbox of the daemon."""
        d = await self._t.json("GET", "/sandboxes")
        return [AsyncSandbox(s["id"], self, s) for s in (d.get("sandboxes") or [])]

    def create(self, **kwargs: Any) -> "_Creating":
        """:meth:`AsyncSandbox.create` with this client (awaitable, or ``async with``)."""
        return AsyncSandbox.create(client=self, **kwargs)

    async def sandbox(self, id: str) -> "AsyncSandbox":
        return await AsyncSandbox.connect(id, client=self)

    async def tree(self) -> Tree:
        return Tree.from_api(await self._t.json("GET", "/tree"), self.blocking)

    async def node(self, id: str) -> Node:
        """One node of the tree as the daemon sees it now (with its ``templates``)."""
        return Node.from_api(await self._t.json("GET", "/nodes/" + q(id)), self.blocking)

    #: ``await client.checkpoint(id)``: :meth:`node` (its name before 0.4.0).
    checkpoint = node

    async def remove_checkpoint(self, id: str) -> List[str]:
        """Removes a node and its subtree; returns the removed ids."""
        return list((await self._t.json("DELETE", "/nodes/" + q(id))).get("removed") or [])

    async def pin_checkpoint(self, id: str, pinned: bool = True) -> Node:
        """:meth:`Client.pin_checkpoint`."""
        d = await self._t.json("POST", "/nodes/%s/pin" % q(id), {"pinned": bool(pinned)})
        return Node.from_api(d, self.blocking)

    async def prepare_checkpoint(self, id: str, sandbox: Optional[str] = None) -> Node:
        """:meth:`Client.prepare_checkpoint`."""
        body: Dict[str, Any] = {} if sandbox is None else {"sandbox": str(sandbox)}
        d = await self._t.json("POST", "/nodes/%s/prepare" % q(id), body)
        return Node.from_api(d, self.blocking)

    async def fork(self, node: NodeRef, count: int = 1, processes: str = "auto",
                   image_wait: Optional[float] = None, **create_kwargs: Any) -> List["AsyncSandbox"]:
        """:meth:`Sandbox.fork_from`: ``count`` new sandboxes on the node (a Node, a
        CheckpointResult or an id), its processes with them, in one request; each
        one's ``fork_branch`` says how. If one fails, the daemon removes those made."""
        create_kwargs.pop("client", None)
        remove_nodes = bool(create_kwargs.pop("remove_nodes", False))
        body, ms = _fork_body(count, create_kwargs, processes, image_wait)
        d = await self._t.json("POST", "/nodes/%s/fork" % q(_node_id(node)), body,
                               timeout=_op_timeout(self._t.timeout, ms))
        made: List[AsyncSandbox] = []
        for sb_id, info, b in _forked(d, self.blocking):
            sb = AsyncSandbox(sb_id, self, info, remove_nodes=remove_nodes)
            sb.fork_branch = b
            made.append(sb)
        return made


class AsyncImages:
    """``client.images`` of an AsyncClient (:class:`~deltabox.client.Images`)."""

    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def __call__(self) -> List[Dict[str, Any]]:
        return await self.list()

    async def list(self) -> List[Dict[str, Any]]:
        return list((await self._c._t.json("GET", "/images")).get("images") or [])

    async def import_(self, name: str, source: str, allow_setuid: bool = False,
                      max_bytes: Optional[int] = None, max_entries: Optional[int] = None,
                      on_progress: Optional[AsyncOnProgress] = None) -> Dict[str, Any]:
        """:meth:`Images.import_`; ``on_progress`` is called on the event loop.
        Cancelling it cancels the import (nothing is left in the store)."""
        body: Dict[str, Any] = {"name": name, "source": source}
        if allow_setuid:
            body["allow_setuid"] = True
        if max_bytes:
            body["max_bytes"] = int(max_bytes)
        if max_entries:
            body["max_entries"] = int(max_entries)
        events = await self._c._t.stream("POST", "/images?progress=1", body)
        try:
            while True:
                ev = await events.next()
                if ev is None:
                    break
                if "error" in ev:
                    err = ev.get("error") or {}
                    raise from_answer(None, err.get("code"), err.get("message") or "the import failed")
                if "image" in ev:
                    while await events.next() is not None:  # the end: the connection is kept
                        pass
                    return dict(ev["image"])
                if on_progress is not None and "done" in ev:
                    await _call(on_progress, int(ev.get("done") or 0), int(ev.get("total") or 0))
        finally:
            events.close()
        raise from_answer(500, "internal", "the daemon ended the import's stream without an answer")

    async def remove(self, name: str) -> None:
        await self._c._t.json("DELETE", "/images/" + q(name))


_default: Optional[AsyncClient] = None


def default_async_client() -> AsyncClient:
    """The AsyncClient used when none is given (of :func:`deltabox.default_client`'s
    socket and timeout)."""
    global _default
    if _default is None:
        _default = AsyncClient(client=default_client())
    return _default


def _async_client(client: Optional[AsyncClient]) -> AsyncClient:
    return client if client is not None else default_async_client()


class _Creating:
    """What :meth:`AsyncSandbox.create` returns: awaiting it creates the sandbox
    (``sb = await AsyncSandbox.create()``); ``async with AsyncSandbox.create() as sb``
    creates it and removes it at the end of the block. Either, once."""

    def __init__(self, make: Callable[[], Awaitable["AsyncSandbox"]]) -> None:
        self._make: Optional[Callable[[], Awaitable[AsyncSandbox]]] = make
        self._sb: Optional[AsyncSandbox] = None

    def _start(self) -> Awaitable["AsyncSandbox"]:
        if self._make is None:
            raise RuntimeError("AsyncSandbox.create(...) was awaited or entered already: "
                               "call create() again for another sandbox")
        make, self._make = self._make, None
        return make()

    def __await__(self) -> Generator[Any, None, "AsyncSandbox"]:
        return self._start().__await__()

    async def __aenter__(self) -> "AsyncSandbox":
        self._sb = await self._start()
        return self._sb

    async def __aexit__(self, *exc: Any) -> None:
        if self._sb is not None:
            await self._sb.close()


class AsyncSandbox:
    """:class:`~deltabox.Sandbox` with coroutines."""

    def __init__(self, id: Union[str, Sandbox], client: Optional[AsyncClient] = None,
                 info: Optional[Dict[str, Any]] = None, remove_nodes: bool = False) -> None:
        if isinstance(id, Sandbox):  # AsyncSandbox(sandbox) before 0.4.0
            info = info or id._info
            remove_nodes = remove_nodes or id.remove_nodes_on_close
            id = id.id
        self.id = id
        self.client = _async_client(client)
        self._info = dict(info or {})
        self._closed = False
        # close() (the end of an async with block) also removes the nodes it made.
        self.remove_nodes_on_close = remove_nodes
        # How a fork made it (AsyncClient.fork), None otherwise.
        self.fork_branch: Optional[ForkBranch] = None
        self.files = AsyncFiles(self)
        self.sessions = AsyncSessions(self)

    @property
    def blocking(self) -> Sandbox:
        """A blocking :class:`~deltabox.Sandbox` on the same sandbox."""
        return Sandbox(self.id, self.client.blocking, self._info, self.remove_nodes_on_close)

    @property
    def image(self) -> str:
        return str(self._info.get("image") or "")

    @property
    def workdir(self) -> str:
        return str(self._info.get("workdir") or "")

    def __repr__(self) -> str:
        return "AsyncSandbox(id=%r, image=%r)" % (self.id, self.image)

    def _p(self, sub: str) -> str:
        return "/sandboxes/%s%s" % (q(self.id), sub)

    @classmethod
    def create(cls, image: str = "default", workdir: str = "/workspace",
               name: Optional[str] = None, memory_mb: Optional[int] = None,
               pids: Optional[int] = None, cpus: Optional[float] = None,
               hostname: Optional[str] = None, warm_processes: bool = False,
               client: Optional[AsyncClient] = None,
               remove_nodes: bool = False, user: Optional[str] = None,
               disk_mb: Optional[int] = None,
               template_budget_mb: Optional[int] = None,
               network: Optional[Dict[str, Any]] = None) -> _Creating:
        """:meth:`Sandbox.create`: ``sb = await AsyncSandbox.create(...)``, or
        ``async with AsyncSandbox.create(...) as sb:`` (removed at the end)."""
        body = _create_body(image, workdir, name, memory_mb, pids, cpus, hostname,
                            warm_processes, user, disk_mb, template_budget_mb, network)

        async def make() -> AsyncSandbox:
            c = _async_client(client)
            info = await c._t.json("POST", "/sandboxes", body)
            return cls(info["id"], c, info, remove_nodes=remove_nodes)

        return _Creating(make)

    @classmethod
    async def connect(cls, id: str, client: Optional[AsyncClient] = None) -> "AsyncSandbox":
        """A handle on an existing sandbox (NotFound if there is none)."""
        c = _async_client(client)
        info = await c._t.json("GET", "/sandboxes/" + q(id))
        return cls(info["id"], c, info)

    @classmethod
    async def list(cls, client: Optional[AsyncClient] = None) -> List["AsyncSandbox"]:
        return await _async_client(client).sandboxes()

    async def remove(self) -> None:
        await self.client._t.json("DELETE", self._p(""))
        self._closed = True

    async def close(self, remove_nodes: Optional[bool] = None) -> None:
        """Removes the sandbox if it still exists; safe to call twice
        (:meth:`Sandbox.close`: ``remove_nodes``)."""
        if remove_nodes is None:
            remove_nodes = self.remove_nodes_on_close
        if not self._closed:
            try:
                await self.remove()
            except NotFound:
                self._closed = True
        if remove_nodes:
            await self.remove_nodes()

    async def remove_nodes(self) -> List[str]:
        """:meth:`Sandbox.remove_nodes`."""
        removed: List[str] = []
        for nid in _removable_nodes(await self.client.tree(), self.id):
            try:
                removed.extend(await self.client.remove_checkpoint(nid))
            except (Conflict, NotFound):
                pass  # used or removed meanwhile
        return removed

    kill = close

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def info(self) -> Dict[str, Any]:
        self._info = dict(await self.client._t.json("GET", self._p("")))
        return self._info

    async def head(self) -> Optional[str]:
        """The node the sandbox stands on (None: directly on its image)."""
        return (await self.info()).get("head") or None

    async def status(self) -> str:
        return str((await self.info()).get("status") or "")

    async def memory(self) -> SandboxMemory:
        """:meth:`Sandbox.memory`."""
        return SandboxMemory.from_info(await self.info())

    async def run(self, cmd: Command, timeout: Timeout = CLIENT_TIMEOUT,
                  session: Union[str, bool, None] = None,
                  env: Union[Mapping[str, Any], Iterable[str], None] = None,
                  cwd: Optional[str] = None, stdin: Union[str, bytes, None] = None,
                  on_output: Optional[AsyncOnOutput] = None,
                  output_limit: Optional[int] = None) -> Result:
        """:meth:`Sandbox.run`; ``on_output`` is called on the event loop. Cancelled,
        the command is interrupted (a plain command's process group killed, a
        session's command ^C'd)."""
        x = _exec_request(cmd, timeout, session, env, cwd, stdin, output_limit,
                          self.client._t.timeout)
        if on_output is None:
            d = await self.client._t.json("POST", self._p("/exec"), x.body, timeout=x.wait)
            return Result.from_api(d, x.argv)
        x.body["stream"] = True
        out = _Output(x.argv)
        events = await self.client._t.stream("POST", self._p("/exec"), x.body, timeout=x.wait)
        try:
            while True:
                ev = await events.next()
                if ev is None:
                    break
                piece = out.feed(ev)
                if piece is not None:
                    await _call(on_output, *piece)
        finally:
            events.close()
        res = out.done()
        for piece in out.rest():
            await _call(on_output, *piece)
        return res

    async def checkpoint(self, label: Optional[str] = None, end_background: bool = False,
                         wait: Optional[float] = DEFAULT_WAIT, pin: bool = False,
                         answer: Optional[str] = None) -> CheckpointResult:
        """:meth:`Sandbox.checkpoint` (it queues behind running commands for ``wait``
        seconds: those of other tasks of this sandbox)."""
        body, ms = _checkpoint_body(label, end_background, wait, pin, answer)
        d = await self.client._t.json("POST", self._p("/checkpoint"), body,
                                      timeout=_op_timeout(self.client._t.timeout, ms))
        ck = CheckpointResult.from_api(d, self.client.blocking, workdir=self.workdir or None)
        _warn(ck.warnings)
        return ck

    async def restore(self, checkpoint: NodeRef, wait: Optional[float] = DEFAULT_WAIT,
                      lazy_image: Optional[bool] = None) -> RestoreResult:
        """:meth:`Sandbox.restore`."""
        body, ms = _restore_body(checkpoint, wait, lazy_image)
        d = await self.client._t.json("POST", self._p("/restore"), body,
                                      timeout=_op_timeout(self.client._t.timeout, ms))
        res = RestoreResult.from_api(d, self.client.blocking)
        _warn(res.warnings)
        return res

    async def fork(self, count: int = 1, label: Optional[str] = None, processes: str = "auto",
                   image_wait: Optional[float] = None, wait: Optional[float] = DEFAULT_WAIT,
                   **create_kwargs: Any) -> List["AsyncSandbox"]:
        """:meth:`Sandbox.fork`: a checkpoint and ``count`` new sandboxes on it, its
        processes with them, in one request."""
        create_kwargs.pop("client", None)
        remove_nodes = bool(create_kwargs.pop("remove_nodes", False))
        body, ms = _fork_body(count, create_kwargs, processes, image_wait)
        body["checkpoint"], ck_ms = _checkpoint_body(label, False, wait, False)
        d = await self.client._t.json("POST", self._p("/fork"), body,
                                      timeout=_op_timeout(self.client._t.timeout, ms + ck_ms))
        made: List[AsyncSandbox] = []
        for sb_id, info, b in _forked(d, self.client.blocking):
            sb = AsyncSandbox(sb_id, self.client, info, remove_nodes=remove_nodes)
            sb.fork_branch = b
            made.append(sb)
        return made

    async def signal(self, pid: int, sig: int = 15) -> None:
        """:meth:`Sandbox.signal`."""
        await self.client._t.json("POST", self._p("/signal"), {"pid": pid, "signal": sig})

    async def tree(self) -> Tree:
        """:meth:`Sandbox.tree`."""
        head = await self.head()
        t = await self.client.tree()
        t.head, t.sandbox = head, self.id
        return t


@dataclass
class AsyncSession:
    """A session of an AsyncSandbox: the fields of :class:`~deltabox.sandbox.Session`,
    with coroutine methods."""

    name: str
    kind: str = "bash"
    argv: List[str] = field(default_factory=list)
    pid: int = 0
    started: Optional[_dt.datetime] = None
    running: bool = False
    busy: bool = False
    exit: Optional[str] = None
    _sandbox: Optional[AsyncSandbox] = field(default=None, repr=False, compare=False)

    @classmethod
    def from_api(cls, d: Dict[str, Any], sb: AsyncSandbox) -> "AsyncSession":
        return cls(name=d.get("name") or "", kind=d.get("kind") or "bash",
                   argv=list(d.get("argv") or []), pid=int(d.get("pid") or 0),
                   started=parse_time(d.get("started")), running=bool(d.get("running")),
                   busy=bool(d.get("busy")), exit=d.get("exit") or None, _sandbox=sb)

    def _sb(self) -> AsyncSandbox:
        if self._sandbox is None:
            raise ValueError("session %r belongs to no sandbox" % self.name)
        return self._sandbox

    async def run(self, code: str, timeout: Timeout = CLIENT_TIMEOUT,
                  on_output: Optional[AsyncOnOutput] = None) -> Result:
        return await self._sb().run(code, timeout=timeout, session=self.name, on_output=on_output)

    async def kill(self) -> None:
        await self._sb().sessions.kill(self.name)

    async def logs(self) -> str:
        return await self._sb().sessions.logs(self.name)


class AsyncSessions:
    """``sb.sessions`` of an AsyncSandbox (:class:`~deltabox.sandbox.Sessions`)."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb

    def _path(self, *parts: str) -> str:
        return self._sb._p("/sessions") + "".join("/" + q(p) for p in parts)

    async def start(self, name: str, kind: Optional[str] = None,
                    argv: Optional[Sequence[str]] = None, cwd: Optional[str] = None,
                    env: Union[Mapping[str, Any], Iterable[str], None] = None) -> AsyncSession:
        """:meth:`Sessions.start`."""
        body: Dict[str, Any] = {"name": name}
        if kind:
            body["kind"] = kind
        if argv is not None:
            body["argv"] = [str(a) for a in argv]
        if cwd:
            body["dir"] = cwd
        e = _env_list(env)
        if e:
            body["env"] = e
        return AsyncSession.from_api(await self._sb.client._t.json("POST", self._path(), body), self._sb)

    async def list(self) -> List[AsyncSession]:
        d = await self._sb.client._t.json("GET", self._path())
        return [AsyncSession.from_api(s, self._sb) for s in (d.get("sessions") or [])]

    async def get(self, name: str) -> AsyncSession:
        for s in await self.list():
            if s.name == name:
                return s
        raise NotFound("not_found", "no session %r in sandbox %s" % (name, self._sb.id), 404)

    async def kill(self, name: str) -> None:
        await self._sb.client._t.json("DELETE", self._path(name))

    async def logs(self, name: str) -> str:
        data, _ = await self._sb.client._t.request("GET", self._path(name, "logs"))
        return data.decode("utf-8", "replace")

    async def run(self, name: str, code: str, timeout: Timeout = CLIENT_TIMEOUT,
                  on_output: Optional[AsyncOnOutput] = None) -> Result:
        return await self._sb.run(code, timeout=timeout, session=name, on_output=on_output)


class AsyncFiles:
    """``sb.files`` of an AsyncSandbox (:class:`~deltabox.sandbox.Files`)."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb

    def _path(self, sub: str = "") -> str:
        return self._sb._p("/files" + sub)

    async def read(self, path: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        query: Dict[str, Any] = {"path": path}
        if offset:
            query["offset"] = int(offset)
        if length:
            query["length"] = int(length)
        data, _ = await self._sb.client._t.request("GET", self._path(), query)
        return data

    async def read_text(self, path: str, encoding: str = "utf-8", errors: str = "strict") -> str:
        return (await self.read(path)).decode(encoding, errors)

    async def write(self, path: str, data: Union[bytes, bytearray, memoryview, str, Any],
                    mode: Union[int, str, None] = None, mkdir: bool = True) -> FileInfo:
        query = {"path": path, "mode": _mode(mode), "mkdir": "1" if mkdir else None}
        raw, _ = await self._sb.client._t.request("PUT", self._path(), query, _data_bytes(data),
                                                  "application/octet-stream")
        return FileInfo.from_api(_json_of(raw))

    async def list(self, path: str = ".", recursive: bool = False, depth: Optional[int] = None,
                   max_entries: Optional[int] = None) -> Listing:
        query = {"path": path, "recursive": "1" if recursive else None,
                 "depth": depth or None, "max_entries": max_entries or None}
        d = await self._sb.client._t.json("GET", self._path("/list"), query=query)
        return Listing([FileInfo.from_api(e) for e in (d.get("entries") or [])],
                       path=name_of(d, "path") or "", truncated=bool(d.get("truncated")))

    async def stat(self, path: str) -> FileInfo:
        return FileInfo.from_api(await self._sb.client._t.json("GET", self._path("/stat"),
                                                               query={"path": path}))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
            return True
        except NotFound as e:
            if e.message.startswith("no route"):
                raise
            return False

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._sb.client._t.json("DELETE", self._path(),
                                      query={"path": path, "recursive": "1" if recursive else None})

    async def mkdir(self, path: str, mode: Union[int, str, None] = None,
                    parents: bool = True) -> bool:
        d = await self._sb.client._t.json("POST", self._path("/mkdir"), query={
            "path": path, "mode": _mode(mode), "parents": None if parents else "0"})
        return bool(d.get("created"))


def _json_of(raw: bytes) -> Dict[str, Any]:
    out: Dict[str, Any] = json.loads(raw.decode("utf-8"))
    return out


__all__ = ["AsyncClient", "AsyncFiles", "AsyncImages", "AsyncOnOutput", "AsyncOnProgress",
           "AsyncSandbox", "AsyncSession", "AsyncSessions", "default_async_client"]
