"""The client for asyncio programs: the same API as :class:`~deltabox.Sandbox` and
:class:`~deltabox.Client`, with coroutines.

    import asyncio
    from deltabox.aio import AsyncSandbox

    async def main() -> None:
        async with await AsyncSandbox.create() as sb:
            ckpt = await sb.checkpoint(label="clean")
            results = await asyncio.gather(*(sb.run("sleep 1; echo %d" % i) for i in range(4)))
            res = await sb.restore(ckpt)
            print([r.stdout for r in results], res.processes)

    asyncio.run(main())

Each call runs the blocking client in a thread pool of its :class:`AsyncClient` (64
threads by default, so that that many calls, a command each, run at once; a thread is
started only when needed): the event loop is never blocked, and the wire protocol has
one implementation, the synchronous client's. The values are the same (Result, Checkpoint,
RestoreResult, Tree, FileInfo...); the methods of a :class:`~deltabox.Checkpoint` are
blocking, so their coroutines are on the client: ``await client.fork(ckpt, 2)``,
``await client.checkpoint(ckpt.id)`` (refresh), ``await client.remove_checkpoint(id)``.

Differences from the synchronous API: ``head`` and ``status`` are coroutine methods
(``await sb.head()``); ``on_output`` of ``run`` is called on the event loop (a plain
function or a coroutine function; its output is awaited before the next piece is read,
so it may apply back-pressure, and if it raises the command is abandoned and killed).
Cancelling a task that awaits a call does not stop what the daemon already does (a
command runs until it ends or its ``timeout``: the client's by default).
"""

import asyncio
import concurrent.futures
import datetime as _dt
import functools
import inspect
import threading
from dataclasses import dataclass, field
from typing import (Any, Awaitable, Callable, Dict, Iterable, List, Mapping, Optional, Sequence,
                    TypeVar, Union)

from .client import Client, OnProgress
from .models import Checkpoint, FileInfo, Listing, RestoreResult, Result, SandboxMemory, Tree
from .sandbox import CLIENT_TIMEOUT, DEFAULT_WAIT, Command, Files, Sandbox, Session, Sessions, Timeout

T = TypeVar("T")

# on_output of AsyncSandbox.run: called on the event loop, may be a coroutine function.
AsyncOnOutput = Callable[[str, str], Union[None, Awaitable[None]]]


class AsyncClient:
    """A DeltaBox daemon for asyncio code: :class:`~deltabox.Client` (``.blocking``)
    whose calls run in a thread pool of ``max_workers`` threads.

    Args:
        socket_path, timeout: as for :class:`~deltabox.Client`.
        max_workers: calls that can be under way at once (each blocks a thread while
            its command runs).
        client: a synchronous client to use instead of making one.
    """

    def __init__(self, socket_path: Optional[str] = None, timeout: Optional[float] = 600.0,
                 max_workers: int = 64, client: Optional[Client] = None) -> None:
        self.blocking = client if client is not None else Client(socket_path, timeout=timeout)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="deltabox-aio")
        #: ``await client.images()`` lists them; ``await client.images.import_(...)``.
        self.images = AsyncImages(self)

    def __repr__(self) -> str:
        return "AsyncClient(socket_path=%r)" % self.blocking.socket_path

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the client's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def close(self) -> None:
        """Lets the pool's threads end once their calls are done, and closes idle
        connections. Calls made after this fail."""
        self._pool.shutdown(wait=False)
        self.blocking.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ---- the daemon and the tree ----

    async def health(self) -> Dict[str, Any]:
        return await self.call(self.blocking.health)

    async def sync(self) -> None:
        """Returns once every change made so far (checkpoints included) is durable."""
        await self.call(self.blocking.sync)

    async def sandboxes(self) -> List["AsyncSandbox"]:
        return [AsyncSandbox(s, self) for s in await self.call(self.blocking.sandboxes)]

    async def create(self, **kwargs: Any) -> "AsyncSandbox":
        return await AsyncSandbox.create(client=self, **kwargs)

    async def sandbox(self, id: str) -> "AsyncSandbox":
        return await AsyncSandbox.connect(id, client=self)

    async def tree(self) -> Tree:
        return await self.call(self.blocking.tree)

    async def checkpoint(self, id: str) -> Checkpoint:
        """One node of the tree as the daemon sees it now (with its ``templates``)."""
        return await self.call(self.blocking.checkpoint, id)

    async def remove_checkpoint(self, id: str) -> List[str]:
        return await self.call(self.blocking.remove_checkpoint, id)

    async def pin_checkpoint(self, id: str, pinned: bool = True) -> Checkpoint:
        """:meth:`Client.pin_checkpoint`."""
        return await self.call(self.blocking.pin_checkpoint, id, pinned)

    async def fork(self, checkpoint: Checkpoint, count: int = 1,
                   **create_kwargs: Any) -> List["AsyncSandbox"]:
        """:meth:`Checkpoint.fork`: ``count`` new sandboxes on the checkpoint."""
        create_kwargs.setdefault("client", self.blocking)
        made = await self.call(checkpoint.fork, count, **create_kwargs)
        return [AsyncSandbox(s, self) for s in made]


class AsyncImages:
    """``client.images`` of an AsyncClient (:class:`~deltabox.client.Images`)."""

    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def __call__(self) -> List[Dict[str, Any]]:
        return await self.list()

    async def list(self) -> List[Dict[str, Any]]:
        return await self._c.call(self._c.blocking.images.list)

    async def import_(self, name: str, source: str, allow_setuid: bool = False,
                      max_bytes: Optional[int] = None, max_entries: Optional[int] = None,
                      on_progress: Optional[OnProgress] = None) -> Dict[str, Any]:
        """:meth:`Images.import_`; ``on_progress`` is called on the client's pool
        thread."""
        return await self._c.call(self._c.blocking.images.import_, name, source,
                                  allow_setuid=allow_setuid, max_bytes=max_bytes,
                                  max_entries=max_entries, on_progress=on_progress)

    async def remove(self, name: str) -> None:
        await self._c.call(self._c.blocking.images.remove, name)


_default = None  # type: Optional[AsyncClient]
_default_lock = threading.Lock()


def default_async_client() -> AsyncClient:
    """The AsyncClient used when none is given (over :func:`deltabox.default_client`)."""
    global _default
    with _default_lock:
        if _default is None:
            from .client import default_client
            _default = AsyncClient(client=default_client())
        return _default


def _async_client(client: Optional[AsyncClient]) -> AsyncClient:
    return client if client is not None else default_async_client()


class AsyncSandbox:
    """:class:`~deltabox.Sandbox` with coroutines (``.blocking`` is the Sandbox)."""

    def __init__(self, sandbox: Sandbox, client: Optional[AsyncClient] = None) -> None:
        self.blocking = sandbox
        self.client = _async_client(client)
        self.files = AsyncFiles(self)
        self.sessions = AsyncSessions(self)

    @property
    def id(self) -> str:
        return self.blocking.id

    @property
    def image(self) -> str:
        return self.blocking.image

    @property
    def workdir(self) -> str:
        return self.blocking.workdir

    def __repr__(self) -> str:
        return "AsyncSandbox(id=%r, image=%r)" % (self.id, self.image)

    @classmethod
    async def create(cls, image: str = "default", workdir: str = "/workspace",
                     name: Optional[str] = None, memory_mb: Optional[int] = None,
                     pids: Optional[int] = None, cpus: Optional[float] = None,
                     hostname: Optional[str] = None, warm_processes: bool = False,
                     client: Optional[AsyncClient] = None,
                     remove_nodes: bool = False, user: Optional[str] = None,
                     disk_mb: Optional[int] = None,
                     template_budget_mb: Optional[int] = None) -> "AsyncSandbox":
        """:meth:`Sandbox.create`."""
        c = _async_client(client)
        sb = await c.call(Sandbox.create, image=image, workdir=workdir, name=name,
                          memory_mb=memory_mb, pids=pids, cpus=cpus, hostname=hostname,
                          warm_processes=warm_processes, client=c.blocking,
                          remove_nodes=remove_nodes, user=user, disk_mb=disk_mb,
                          template_budget_mb=template_budget_mb)
        return cls(sb, c)

    @classmethod
    async def connect(cls, id: str, client: Optional[AsyncClient] = None) -> "AsyncSandbox":
        c = _async_client(client)
        return cls(await c.call(Sandbox.connect, id, client=c.blocking), c)

    @classmethod
    async def list(cls, client: Optional[AsyncClient] = None) -> List["AsyncSandbox"]:
        return await _async_client(client).sandboxes()

    async def remove(self) -> None:
        await self.client.call(self.blocking.remove)

    async def close(self, remove_nodes: Optional[bool] = None) -> None:
        """Removes the sandbox if it still exists; safe to call twice
        (:meth:`Sandbox.close`: ``remove_nodes``)."""
        await self.client.call(self.blocking.close, remove_nodes)

    async def remove_nodes(self) -> List[str]:
        """:meth:`Sandbox.remove_nodes`."""
        return await self.client.call(self.blocking.remove_nodes)

    kill = close

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def info(self) -> Dict[str, Any]:
        return await self.client.call(self.blocking.info)

    async def head(self) -> Optional[str]:
        """The node the sandbox stands on (None: directly on its image)."""
        return (await self.info()).get("head") or None

    async def status(self) -> str:
        return (await self.info()).get("status") or ""

    async def memory(self) -> SandboxMemory:
        """:meth:`Sandbox.memory`."""
        return await self.client.call(self.blocking.memory)

    async def run(self, cmd: Command, timeout: Timeout = CLIENT_TIMEOUT,
                  session: Union[str, bool, None] = None,
                  env: Union[Mapping[str, Any], Iterable[str], None] = None,
                  cwd: Optional[str] = None, stdin: Union[str, bytes, None] = None,
                  on_output: Optional[AsyncOnOutput] = None,
                  output_limit: Optional[int] = None) -> Result:
        """:meth:`Sandbox.run`; ``on_output`` is called on the event loop."""
        cb = None  # type: Optional[Callable[[str, str], None]]
        if on_output is not None:
            cb = _on_loop(asyncio.get_running_loop(), on_output)
        return await self.client.call(self.blocking.run, cmd, timeout=timeout, session=session,
                                      env=env, cwd=cwd, stdin=stdin, on_output=cb,
                                      output_limit=output_limit)

    async def checkpoint(self, label: Optional[str] = None, end_background: bool = False,
                         wait: Optional[float] = DEFAULT_WAIT, pin: bool = False) -> Checkpoint:
        """:meth:`Sandbox.checkpoint` (it queues behind running commands for ``wait``
        seconds: those of other tasks of this sandbox)."""
        return await self.client.call(self.blocking.checkpoint, label, end_background, wait, pin)

    async def restore(self, checkpoint: Union[Checkpoint, str],
                      wait: Optional[float] = DEFAULT_WAIT,
                      lazy_image: Optional[bool] = None) -> RestoreResult:
        """:meth:`Sandbox.restore`."""
        return await self.client.call(self.blocking.restore, checkpoint, wait, lazy_image)

    async def fork(self, count: int = 1, label: Optional[str] = None,
                   **create_kwargs: Any) -> List["AsyncSandbox"]:
        """Checkpoints this sandbox and starts ``count`` new sandboxes on it."""
        return await self.client.fork(await self.checkpoint(label=label), count, **create_kwargs)

    async def signal(self, pid: int, sig: int = 15) -> None:
        """:meth:`Sandbox.signal`."""
        await self.client.call(self.blocking.signal, pid, sig)

    async def tree(self) -> Tree:
        return await self.client.call(self.blocking.tree)


def _on_loop(loop: asyncio.AbstractEventLoop, fn: AsyncOnOutput) -> Callable[[str, str], None]:
    """A callback for the worker thread that runs fn on loop and waits for it. Its
    exception is raised in the thread, which abandons the command; so is the loop's
    end (closed, or stopped with fn not run)."""

    async def call(stream: str, data: str) -> None:
        out = fn(stream, data)
        if inspect.isawaitable(out):
            await out

    def cb(stream: str, data: str) -> None:
        fut = asyncio.run_coroutine_threadsafe(call(stream, data), loop)
        while True:
            try:
                return fut.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if loop.is_closed() or not loop.is_running():
                    fut.cancel()
                    raise RuntimeError("the event loop of on_output ended; the command is "
                                       "abandoned") from None

    return cb


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
    def of(cls, s: Session, sb: AsyncSandbox) -> "AsyncSession":
        return cls(s.name, s.kind, list(s.argv), s.pid, s.started, s.running, s.busy, s.exit, sb)

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
        self._s = Sessions(sb.blocking)

    async def start(self, name: str, kind: Optional[str] = None,
                    argv: Optional[Sequence[str]] = None, cwd: Optional[str] = None,
                    env: Union[Mapping[str, Any], Iterable[str], None] = None) -> AsyncSession:
        s = await self._sb.client.call(self._s.start, name, kind=kind, argv=argv, cwd=cwd, env=env)
        return AsyncSession.of(s, self._sb)

    async def list(self) -> List[AsyncSession]:
        return [AsyncSession.of(s, self._sb) for s in await self._sb.client.call(self._s.list)]

    async def get(self, name: str) -> AsyncSession:
        return AsyncSession.of(await self._sb.client.call(self._s.get, name), self._sb)

    async def kill(self, name: str) -> None:
        await self._sb.client.call(self._s.kill, name)

    async def logs(self, name: str) -> str:
        return await self._sb.client.call(self._s.logs, name)

    async def run(self, name: str, code: str, timeout: Timeout = CLIENT_TIMEOUT,
                  on_output: Optional[AsyncOnOutput] = None) -> Result:
        return await self._sb.run(code, timeout=timeout, session=name, on_output=on_output)


class AsyncFiles:
    """``sb.files`` of an AsyncSandbox (:class:`~deltabox.sandbox.Files`)."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb
        self._f = Files(sb.blocking)

    async def read(self, path: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        return await self._sb.client.call(self._f.read, path, offset, length)

    async def read_text(self, path: str, encoding: str = "utf-8", errors: str = "strict") -> str:
        return await self._sb.client.call(self._f.read_text, path, encoding, errors)

    async def write(self, path: str, data: Union[bytes, bytearray, memoryview, str, Any],
                    mode: Union[int, str, None] = None, mkdir: bool = True) -> FileInfo:
        return await self._sb.client.call(self._f.write, path, data, mode, mkdir)

    async def list(self, path: str = ".", recursive: bool = False, depth: Optional[int] = None,
                   max_entries: Optional[int] = None) -> Listing:
        return await self._sb.client.call(self._f.list, path, recursive, depth, max_entries)

    async def stat(self, path: str) -> FileInfo:
        return await self._sb.client.call(self._f.stat, path)

    async def exists(self, path: str) -> bool:
        return await self._sb.client.call(self._f.exists, path)

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._sb.client.call(self._f.remove, path, recursive)

    async def mkdir(self, path: str, mode: Union[int, str, None] = None,
                    parents: bool = True) -> bool:
        return await self._sb.client.call(self._f.mkdir, path, mode, parents)
