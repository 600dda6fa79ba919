"""Sandbox, with its files and sessions, and CheckpointResult (what a checkpoint did,
whose fork() makes Sandboxes).

The requests are built, and the answers read, by functions of this module that the
asyncio client (aio.py) shares: only the sending differs."""

import base64
import codecs
import datetime as _dt
import json
import warnings
from dataclasses import dataclass, field
from typing import (Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional,
                    Sequence, Tuple, Union)

from ._http import q
from .client import Client, default_client
from .errors import Conflict, MemoryWarning, NotFound, from_answer
from .models import (FileInfo, Listing, Node, OpMemory, RestoreResult, Result, SandboxMemory,
                     Tree, _phases, name_of, parse_time)

OnOutput = Callable[[str, str], None]
Command = Union[str, Sequence[str]]


class _ClientTimeout:
    """The default ``timeout`` of run(): the client's (``Client(timeout=...)``)."""

    def __repr__(self) -> str:
        return "<the client's timeout>"


CLIENT_TIMEOUT = _ClientTimeout()
Timeout = Union[float, None, _ClientTimeout]

# Extra seconds the client waits for an answer beyond a command's own timeout: the
# daemon reads output for 200 ms more, waits up to 10 s for a killed command's exit, or
# up to 10 s for a session's command to stop after ^C, then answers.
_ANSWER_GRACE = 60.0

# How long checkpoint() and restore() queue behind running commands and file operations
# by default, in seconds, before the daemon answers Conflict. The daemon's own default
# is 0 (refuse at once); a few seconds cover the short calls an agent makes from other
# threads (a file write, a quick command) without a retry loop, while a long command
# still gives a Conflict soon, naming it. Calls made meanwhile wait behind the
# checkpoint (docs/API.md, "Checkpoints that wait").
DEFAULT_WAIT = 5.0

# The daemon's bound on a wait (wait_ms 600000).
_MAX_WAIT = 600.0


def _client_or_default(client: Optional[Client]) -> Client:
    return client if client is not None else default_client()


def _env_list(env: Union[Mapping[str, Any], Iterable[str], None]) -> Optional[List[str]]:
    if not env:
        return None
    if isinstance(env, Mapping):
        return ["%s=%s" % (k, v) for k, v in env.items()]
    out = [str(e) for e in env]
    for e in out:
        if "=" not in e:
            raise ValueError("env entries are KEY=VALUE strings (or pass a dict), got %r" % e)
    return out


def _timeout_ms(timeout: Optional[float]) -> Optional[int]:
    """timeout_ms of a request: None (no timeout) is -1."""
    if timeout is None:
        return -1
    if timeout <= 0:
        raise ValueError("timeout must be > 0 seconds (None: no timeout), got %r" % (timeout,))
    return max(1, int(round(timeout * 1000)))


def _wait_ms(wait: Optional[float]) -> int:
    if wait is None:
        return 0
    if not 0 <= wait <= _MAX_WAIT:
        raise ValueError("wait is in seconds, 0 to %d (None or 0: refuse at once while a "
                         "command runs), got %r" % (_MAX_WAIT, wait))
    return int(round(wait * 1000))


def _warn(ws: List[str]) -> None:
    for w in ws:
        warnings.warn(w, MemoryWarning, stacklevel=3)


def _stdin_b64(stdin: Union[str, bytes, bytearray, memoryview]) -> str:
    data = stdin.encode("utf-8") if isinstance(stdin, str) else bytes(stdin)
    return base64.b64encode(data).decode("ascii")


def _mode(mode: Union[int, str, None]) -> Optional[str]:
    if mode is None:
        return None
    if isinstance(mode, str):
        int(mode, 8)  # raises ValueError unless octal
        return mode
    if not 0 <= mode <= 0o7777:
        raise ValueError("mode is permission bits (0 to 0o7777), got %r" % (mode,))
    return "%04o" % mode


def _data_bytes(data: Union[bytes, bytearray, memoryview, str, Any]) -> bytes:
    """The body of a file write: bytes as they are, str as UTF-8, a binary file's
    content."""
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if hasattr(data, "read"):
        body = data.read()
        return body.encode("utf-8") if isinstance(body, str) else bytes(body)
    raise TypeError("data must be bytes, str or a file object, not %s" % type(data).__name__)


def _create_body(image: str, workdir: str, name: Optional[str], memory_mb: Optional[int],
                 pids: Optional[int], cpus: Optional[float], hostname: Optional[str],
                 warm_processes: bool, user: Optional[str], disk_mb: Optional[int],
                 template_budget_mb: Optional[int],
                 network: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    body: Dict[str, Any] = {"image": image, "workdir": workdir}
    if network is not None:
        unknown = set(network) - {"allow_out", "deny_out", "model"}
        if unknown:
            raise TypeError("network: unknown keys %s (want allow_out, deny_out, model)" % sorted(unknown))
        body["network"] = {k: (dict(v) if k == "model" else list(v)) for k, v in network.items()}
    for k, v in (("id", name), ("hostname", hostname), ("memory_mb", memory_mb),
                 ("pids", pids), ("cpus", cpus), ("user", user), ("disk_mb", disk_mb),
                 ("template_budget_mb", template_budget_mb)):
        if v is not None:
            body[k] = v
    if warm_processes:
        body["warm_processes"] = True
    return body


class _Exec(NamedTuple):
    """An exec request: its argv (for the Result), its body, and how long the client
    waits for the answer (None: for ever)."""

    argv: List[str]
    body: Dict[str, Any]
    wait: Optional[float]


def _exec_request(cmd: Command, timeout: Timeout, session: Union[str, bool, None],
                  env: Union[Mapping[str, Any], Iterable[str], None], cwd: Optional[str],
                  stdin: Union[str, bytes, None], output_limit: Optional[int],
                  client_timeout: Optional[float]) -> _Exec:
    if session is True:
        session = "main"
    elif session is False:
        session = None
    if isinstance(cmd, str):
        argv = [cmd] if session else ["bash", "-c", cmd]
    else:
        argv = [str(a) for a in cmd]
        if not argv:
            raise ValueError("empty command")
    body: Dict[str, Any] = {"argv": argv, "encoding": "base64"}
    e = _env_list(env)
    if e:
        body["env"] = e
    if cwd:
        body["dir"] = cwd
    if stdin is not None:
        body["stdin"] = _stdin_b64(stdin)
    t: Optional[float]
    if isinstance(timeout, _ClientTimeout):
        t = client_timeout
        ms = None if t is None else _timeout_ms(t)  # None: the daemon's default
    else:
        t = timeout
        ms = _timeout_ms(timeout)
    if ms is not None:
        body["timeout_ms"] = ms
    if output_limit:
        body["output_limit"] = int(output_limit)
    if session:
        body["session"] = session
    return _Exec(argv, body, None if t is None else t + _ANSWER_GRACE)


class _Output:
    """Reads the events of a streamed exec: the pieces of text for on_output, in order,
    and the Result at the end."""

    def __init__(self, argv: List[str]) -> None:
        self.argv = argv
        self.result: Optional[Dict[str, Any]] = None
        self.got: Dict[str, List[bytes]] = {"stdout": [], "stderr": []}
        self.text = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in self.got}

    def feed(self, ev: Dict[str, Any]) -> Optional[Tuple[str, str]]:
        """The (stream, text) of an output event, None for another event; an error
        event is raised."""
        kind = ev.get("type")
        if kind == "stdout" or kind == "stderr":
            data = base64.b64decode(ev.get("data") or "")
            self.got[kind].append(data)
            piece = self.text[kind].decode(data)
            return (kind, piece) if piece else None
        if kind == "result":
            self.result = ev.get("result") or {}
        elif kind == "error":
            err = (ev.get("error") or {}).get("error") or {}
            raise from_answer(None, err.get("code"), err.get("message") or "the command failed")
        return None

    def rest(self) -> List[Tuple[str, str]]:
        """The text the decoders held back (a character cut at the end)."""
        out = []
        for kind, dec in self.text.items():
            piece = dec.decode(b"", final=True)
            if piece:
                out.append((kind, piece))
        return out

    def done(self) -> Result:
        if self.result is None:
            raise from_answer(500, "internal", "the daemon ended the output stream without a result")
        return Result.from_api(self.result, self.argv, b"".join(self.got["stdout"]),
                               b"".join(self.got["stderr"]))


_ANSWERS = (None, "early", "complete")


def _checkpoint_body(label: Optional[str], end_background: bool, wait: Optional[float],
                     pin: bool, answer: Optional[str] = None) -> Tuple[Dict[str, Any], int]:
    body: Dict[str, Any] = {}
    if answer not in _ANSWERS:
        raise ValueError("answer=%r: want 'early', 'complete' or None (the daemon's choice)" % (answer,))
    if answer:
        body["answer"] = answer
    if pin:
        body["pin"] = True
    if label:
        body["label"] = label
    if end_background:
        body["end_background"] = True
    ms = _wait_ms(wait)
    if ms:
        body["wait_ms"] = ms
    return body, ms


def _node_id(node: "NodeRef") -> str:
    if isinstance(node, str):
        return node
    nid = getattr(node, "id", None)
    if isinstance(nid, str):
        return nid
    raise TypeError("a node is a Node, what sb.checkpoint() or sb.restore() returned, or "
                    "a node id, not %s" % type(node).__name__)


def _as_node(node: "NodeRef", client: Client) -> Node:
    """The Node of node (read from the daemon for an id)."""
    if isinstance(node, Node):
        return node
    if isinstance(node, str):
        return client.node(node)
    return node.node


def _restore_body(node: "NodeRef", wait: Optional[float],
                  lazy_image: Optional[bool]) -> Tuple[Dict[str, Any], int]:
    body: Dict[str, Any] = {"node": _node_id(node)}
    if lazy_image is not None:
        body["lazy_image"] = "always" if lazy_image else "never"
    ms = _wait_ms(wait)
    if ms:
        body["wait_ms"] = ms
    return body, ms


def _op_timeout(client_timeout: Optional[float], wait_ms: int) -> Optional[float]:
    """The client's timeout, stretched to cover a checkpoint's or restore's wait."""
    if client_timeout is None:
        return None
    return max(client_timeout, wait_ms / 1000.0 + _ANSWER_GRACE)


def _removable_nodes(t: Tree, sandbox: str) -> List[str]:
    """The highest nodes of the subtrees that sandbox made and nothing else uses
    (Sandbox.remove_nodes)."""
    memo: Dict[str, bool] = {}

    def removable(nid: str) -> bool:
        if nid not in memo:
            n = t.nodes[nid]
            memo[nid] = (n.sandbox == sandbox and not n.sandboxes and
                         all(removable(c) for c in n.children if c in t.nodes))
        return memo[nid]

    return [n.id for n in t if removable(n.id) and not (n.parent in t.nodes and removable(n.parent))]


# The create arguments a fork takes for its branches (Sandbox.create's).
_FORK_CREATE_ARGS = ("image", "workdir", "name", "memory_mb", "pids", "cpus", "hostname",
                     "warm_processes", "user", "disk_mb", "template_budget_mb", "network")


def _fork_body(count: int, create_kwargs: Dict[str, Any], processes: str,
               image_wait: Optional[float]) -> Tuple[Dict[str, Any], int]:
    """The body of POST /v1/nodes/ID/fork and how long its answer may take (ms): each
    branch is made by the daemon, image and workdir by default the node's (the
    workdir of the sandbox that made it)."""
    if count < 1:
        raise ValueError("fork count must be >= 1, got %r" % (count,))
    if processes not in ("auto", "require", "never"):
        raise ValueError("fork processes must be 'auto', 'require' or 'never', got %r" % (processes,))
    unknown = set(create_kwargs) - set(_FORK_CREATE_ARGS)
    if unknown:
        raise TypeError("fork: unknown arguments %s (it takes create's: %s)" % (sorted(unknown), ", ".join(_FORK_CREATE_ARGS)))
    kw = dict(create_kwargs)
    body = _create_body(kw.get("image") or "", kw.get("workdir") or "", kw.get("name"), kw.get("memory_mb"),
                        kw.get("pids"), kw.get("cpus"), kw.get("hostname"), bool(kw.get("warm_processes")),
                        kw.get("user"), kw.get("disk_mb"), kw.get("template_budget_mb"), kw.get("network"))
    for k in ("image", "workdir"):
        if not body[k]:
            del body[k]
    body["count"] = count
    body["processes"] = processes
    wait_ms = 120000
    if image_wait is not None:
        if image_wait <= 0:
            raise ValueError("image_wait must be > 0 seconds, got %r" % (image_wait,))
        wait_ms = max(1, int(image_wait * 1000))
        body["image_wait_ms"] = wait_ms
    # Each branch is a create and a restore (from the image: a few hundred ms each).
    return body, wait_ms + 30000 * count


@dataclass
class ForkBranch:
    """How a fork made one of its sandboxes (``sb.fork_branch``).

    Attributes:
        branch: its index, 0 to count-1.
        path: ``"durable"``: the node's processes were restored into it from the
            node's durable image (same PIDs, sessions with their state); ``"files"``:
            its files only, its sessions start afresh; ``"fast"``: forked from the
            node's templates (designed, not built).
        reason: why that path.
        identity: what ``/run/deltabox/identity`` says inside it (sandbox, branch,
            count, parent_node): agent code reseeds its random generators from it.
        restore: the restore that put it on the node (``processes``, ``sessions``...).
    """

    branch: int
    path: str
    reason: str
    identity: Dict[str, Any]
    restore: RestoreResult

    @property
    def processes(self) -> int:
        """How many of the node's processes run in the branch."""
        return self.restore.processes


@dataclass
class CheckpointResult:
    """What ``sb.checkpoint()`` did: the node it made (:attr:`node`, a :class:`Node`)
    and how. Pass it where a node is taken (``sb.restore(ckpt)``); :meth:`fork`,
    :meth:`refresh`, :meth:`remove` and :meth:`pin` act on its node.

    Attributes:
        node: the node made (as the daemon's answer describes it: no ``templates``;
            ``ckpt.refresh()`` reads them).
        sandbox: the sandbox's id.
        processes: how many processes were forked into the node's templates: every
            bash and python session's and the background jobs' (0 when no session
            ran, or with ``DELTABOX_FASTPATH=0``, which ends the sessions instead).
        process_errors: the processes that could not be kept, which were ended
            (``"session py: ..."``); empty when all were.
        sessions: the sessions whose processes the node keeps, sorted.
        sessions_ended: sessions the checkpoint ended (only with
            ``DELTABOX_FASTPATH=0``); their next call starts them afresh.
        killed_processes: processes the checkpoint ended: the background jobs that
            ``end_background=True`` ended (with ``DELTABOX_FASTPATH=0``, every
            process but the sandbox's init).
        criu_processes: background processes the fast path refused (several
            threads, children, pipes, sockets) that CRIU took instead, with their
            trees; not counted in ``processes``.
        mounted: a new layer was mounted (False when nothing had changed since the
            sandbox's head: the node shares its parent's layer; False too in an early
            answer, which does not know it yet).
        prepared: the next state had been mounted ahead of time (early answer: False).
        duration: seconds inside the daemon, until the answer.
        complete: seconds until the node was complete; 0.0 when the checkpoint answered
            early (``node.pending``: its templates are made after the answer, and the
            sandbox's next call waits for them; ``ckpt.refresh().complete`` then).
        phases_us: microseconds per step (seize, fork, kill, upper, freeze, mount,
            move, publish, ...).
        waited: seconds it queued behind running commands (``wait``) before it
            started (not part of ``duration``).
        memory: the sandbox's memory after it (:class:`OpMemory`): its limit, usage,
            and the new templates' resident memory.
        warnings: what to act on, such as templates holding over half the memory
            limit (also raised as a :class:`~deltabox.MemoryWarning`).
    """

    node: Node
    sandbox: str = ""
    processes: int = 0
    process_errors: List[str] = field(default_factory=list)
    sessions: List[str] = field(default_factory=list)
    sessions_ended: List[str] = field(default_factory=list)
    killed_processes: int = 0
    criu_processes: int = 0
    mounted: bool = False
    prepared: bool = False
    duration: float = 0.0
    phases_us: Dict[str, int] = field(default_factory=dict)
    waited: float = 0.0
    memory: Optional[OpMemory] = None
    warnings: List[str] = field(default_factory=list)
    complete: float = 0.0
    _client: Optional[Client] = field(default=None, repr=False, compare=False)

    @classmethod
    def from_api(cls, d: Dict[str, Any], client: Optional[Client] = None,
                 workdir: Optional[str] = None) -> "CheckpointResult":
        return cls(
            node=Node.from_api(d["node"], client, workdir=workdir),
            sandbox=d.get("sandbox") or "",
            processes=int(d.get("processes") or 0),
            process_errors=[str(e) for e in (d.get("process_errors") or [])],
            sessions=[str(s) for s in (d.get("sessions") or [])],
            sessions_ended=[str(s) for s in (d.get("sessions_ended") or [])],
            killed_processes=int(d.get("killed_processes") or 0),
            criu_processes=int(d.get("criu_processes") or 0),
            mounted=bool(d.get("mounted")),
            prepared=bool(d.get("prepared")),
            duration=float(d.get("duration_ms") or 0.0) / 1000.0,
            phases_us=_phases(d),
            waited=float(d.get("waited_ms") or 0.0) / 1000.0,
            memory=OpMemory.from_api(d.get("memory")),
            warnings=[str(w) for w in (d.get("warnings") or [])],
            complete=float(d.get("complete_ms") or 0.0) / 1000.0,
            _client=client,
        )

    @property
    def id(self) -> str:
        """The node's id."""
        return self.node.id

    def __str__(self) -> str:
        return self.node.id

    def fork(self, count: int = 1, **create_kwargs: Any) -> List["Sandbox"]:
        """:meth:`Sandbox.fork_from` of the node: ``count`` new sandboxes on it, its
        processes with them (with the client that made the checkpoint, unless
        ``client=`` is given)."""
        if self._client is not None:
            create_kwargs.setdefault("client", self._client)
        return Sandbox.fork_from(self.node, count, **create_kwargs)

    def refresh(self) -> Node:
        """:meth:`Node.refresh`: the node as the daemon sees it now (with its
        ``templates``)."""
        return self.node.refresh()

    def remove(self) -> List[str]:
        """:meth:`Node.remove`."""
        return self.node.remove()

    def pin(self, pinned: bool = True) -> Node:
        """:meth:`Node.pin`."""
        return self.node.pin(pinned)

    def prepare(self, sandbox: Optional[str] = None) -> Node:
        """:meth:`Node.prepare`: a spare of this node in ``sandbox`` (None: the node's
        own), for its next restore."""
        return self.node.prepare(sandbox)


def _forked(d: Dict[str, Any], client: Optional[Client]) -> List[Tuple[str, Dict[str, Any], ForkBranch]]:
    """The sandboxes of a fork's answer: each one's id, info and ForkBranch."""
    out = []
    for b in d.get("branches") or []:
        info = dict(b.get("sandbox") or {})
        out.append((str(info["id"]), info, _fork_branch(b, client)))
    return out


def _fork_branch(b: Dict[str, Any], client: Optional[Client]) -> ForkBranch:
    """A ForkBranch from one of a fork's answer's branches."""
    res = RestoreResult.from_api(b.get("restore") or {}, client)
    _warn(res.warnings)
    return ForkBranch(branch=int(b.get("branch") or 0), path=str(b.get("path") or ""),
                      reason=str(b.get("reason") or ""), identity=dict(b.get("identity") or {}),
                      restore=res)


# What sb.restore() and Sandbox.fork_from() take for a node.
NodeRef = Union[Node, CheckpointResult, RestoreResult, str]


class Sandbox:
    """A sandbox: an isolated Linux environment whose files and processes can be
    checkpointed and rolled back in about a millisecond.

    Make one with :meth:`create` (or :meth:`connect` to an existing one). Use it as a
    context manager to remove it at the end::

        with Sandbox.create() as sb:
            r = sb.run("echo hi")
            ckpt = sb.checkpoint(label="clean")
            ...
            sb.restore(ckpt)
    """

    def __init__(self, id: str, client: Optional[Client] = None,
                 info: Optional[Dict[str, Any]] = None, remove_nodes: bool = False,
                 fork_branch: Optional["ForkBranch"] = None) -> None:
        self.id = id
        self.client = _client_or_default(client)
        self._info = dict(info or {})
        self._closed = False
        # close() (the end of a with block) also removes the nodes it made.
        self.remove_nodes_on_close = remove_nodes
        self.files = Files(self)
        self.sessions = Sessions(self)
        # How a fork made it (fork_from, fork), None otherwise.
        self.fork_branch: Optional[ForkBranch] = fork_branch

    # ---- life cycle ----

    @classmethod
    def create(cls, image: str = "default", workdir: str = "/workspace",
               name: Optional[str] = None, memory_mb: Optional[int] = None,
               pids: Optional[int] = None, cpus: Optional[float] = None,
               hostname: Optional[str] = None, warm_processes: bool = False,
               client: Optional[Client] = None, remove_nodes: bool = False,
               user: Optional[str] = None,
               disk_mb: Optional[int] = None,
               template_budget_mb: Optional[int] = None,
               network: Optional[Dict[str, Any]] = None) -> "Sandbox":
        """Creates and starts a sandbox.

        Args:
            image: the image to start from (``client.images()`` lists them).
            workdir: the directory commands run in (created if missing).
            name: the sandbox id, 1-63 of ``a-z 0-9 . _ -`` (default: generated).
            memory_mb, pids, cpus: limits (None: the daemon's defaults).
            disk_mb: quota on what the sandbox writes between checkpoints (its
                writable layer), in MiB (None: 10240). Over it, its processes are
                killed and commands, file writes and checkpoints raise
                :class:`DiskQuotaExceeded` until files are deleted or a checkpoint
                restored.
            template_budget_mb: the memory the process templates of its checkpoints
                may hold, in MiB, apart from ``memory_mb`` (None: the daemon's
                default, an eighth of its RAM; -1: none, templates count against
                ``memory_mb``). A checkpoint while they hold more waits (``wait``),
                then raises :class:`TemplateBudgetExceeded`.
            network: egress through the daemon's proxy, off when None:
                ``{"allow_out": [...], "deny_out": [...]}``, entries being domains
                (``"pypi.org"``), wildcards (``"*.github.com"``), ``"*"``, IPs or
                CIDRs; deny wins. Tools inside need no configuration (docs/API.md,
                Network). ``"model": {"url": ..., "key": ...}`` adds an
                OpenAI-compatible endpoint reached inside as
                ``http://model.deltabox.internal``, the daemon adding the key.
            hostname: default: the id.
            user: run sessions and commands as this user of the sandbox's own
                ``/etc/passwd`` instead of root: ``"NAME"``, ``"UID"``,
                ``"NAME:GROUP"`` or ``"UID:GID"`` (a numeric one need not be listed).
                A name the sandbox does not list is an InvalidRequest. The workdir, if
                created or empty, is given to the user. Checkpoints and restores of
                such a sandbox keep its files only: its sessions start afresh
                (docs/API.md says why).
            warm_processes: after each restore, pre-fault in the background the
                pages the restored processes had written (faster first command
                after a pause, slower next restore; see docs/DESIGN.md).
            client: default: a client of $DELTABOX_SOCKET or the default socket.
            remove_nodes: :meth:`close` (so the end of a ``with`` block) also removes
                the checkpoints this sandbox made that nothing else uses
                (:meth:`remove_nodes`). Default False: nodes outlive their sandbox (to
                fork or inspect them later), but its process templates go with it.
        """
        c = _client_or_default(client)
        body = _create_body(image, workdir, name, memory_mb, pids, cpus, hostname,
                            warm_processes, user, disk_mb, template_budget_mb, network)
        info = c._t.json("POST", "/sandboxes", body)
        return cls(info["id"], c, info, remove_nodes=remove_nodes)

    @classmethod
    def connect(cls, id: str, client: Optional[Client] = None) -> "Sandbox":
        """A handle on an existing sandbox (NotFound if there is none)."""
        c = _client_or_default(client)
        info = c._t.json("GET", "/sandboxes/" + q(id))
        return cls(info["id"], c, info)

    @classmethod
    def list(cls, client: Optional[Client] = None) -> List["Sandbox"]:
        """Every sandbox of the daemon."""
        c = _client_or_default(client)
        d = c._t.json("GET", "/sandboxes")
        return [cls(s["id"], c, s) for s in (d.get("sandboxes") or [])]

    @classmethod
    def fork_from(cls, node: NodeRef, count: int = 1, processes: str = "auto",
                  image_wait: Optional[float] = None, **create_kwargs: Any) -> List["Sandbox"]:
        """Starts ``count`` new sandboxes, each standing on ``node`` (a :class:`Node`,
        a :class:`CheckpointResult`, or an id), in one request
        (``POST /v1/nodes/ID/fork``), and returns them in branch order.

        Each is made with ``create_kwargs`` (:meth:`create`'s; by default the node's
        image and the workdir of the sandbox that made it) and gets the node's files
        (its layers shared, a writable layer of its own) and, where a path can carry
        them, its processes: the python and bash sessions' state and background
        processes, every one at its PID at the checkpoint, forked from the node's
        templates where a fork's family holds them (the node of a :meth:`Sandbox.fork`,
        or one its sandbox made before it), else restored from the node's durable image
        (the daemon waits for it while it is written, ``image_wait`` seconds at most,
        default 120). The node's sandbox may be running, elsewhere or gone.
        ``sb.fork_branch`` (:class:`ForkBranch`) says per sandbox which path was taken
        (``"fast"``, ``"durable"`` or ``"files"``) and why; ``processes="require"`` raises
        Conflict rather than fall back to files, ``"never"`` carries files only. Each
        branch reads its identity in ``/run/deltabox/identity``.

        If one branch cannot be made, the daemon removes those made and the error says
        which and why. ``name=`` names the forks ``name-0``, ``name-1``, ... (``name``
        alone when ``count`` is 1; a name is unique among sandboxes)."""
        client = _client_or_default(create_kwargs.pop("client", None))
        remove_nodes = bool(create_kwargs.pop("remove_nodes", False))
        nid = _node_id(node)
        body, ms = _fork_body(count, create_kwargs, processes, image_wait)
        d = client._t.json("POST", "/nodes/%s/fork" % q(nid), body, timeout=_op_timeout(client._t.timeout, ms))
        return [cls(sb_id, client, info, remove_nodes=remove_nodes, fork_branch=b)
                for sb_id, info, b in _forked(d, client)]

    def remove(self) -> None:
        """Removes the sandbox: kills its processes and deletes its writable layer.
        The checkpoints it made stay in the tree. NotFound if it is already gone."""
        self.client._t.json("DELETE", "/sandboxes/" + q(self.id))
        self._closed = True

    def close(self, remove_nodes: Optional[bool] = None) -> None:
        """Removes the sandbox if it still exists; safe to call twice. With
        ``remove_nodes`` (default: the ``remove_nodes`` it was created with) the
        checkpoints it made that nothing else uses go too (:meth:`remove_nodes`)."""
        if remove_nodes is None:
            remove_nodes = self.remove_nodes_on_close
        if not self._closed:
            try:
                self.remove()
            except NotFound:
                self._closed = True
        if remove_nodes:
            self.remove_nodes()

    def remove_nodes(self) -> List[str]:
        """Removes the checkpoints (nodes) this sandbox made that nothing else uses,
        and returns their ids. A node is kept when a sandbox stands on it or below it,
        or when a node below it was made by another sandbox (a fork's checkpoint): those
        are someone else's. Removing a node ends its process templates and frees its
        layers. Call it after :meth:`remove` (a live sandbox stands on its head, which is
        then kept), or use ``close(remove_nodes=True)``."""
        removed: List[str] = []
        for nid in _removable_nodes(self.client.tree(), self.id):
            try:
                removed.extend(self.client.remove_checkpoint(nid))
            except (Conflict, NotFound):
                pass  # used or removed meanwhile
        return removed

    kill = close

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "Sandbox(id=%r, image=%r)" % (self.id, self._info.get("image"))

    # ---- state ----

    def info(self) -> Dict[str, Any]:
        """The daemon's current record of the sandbox (id, image, head, workdir,
        status, limits, usage, stats...)."""
        self._info = self.client._t.json("GET", "/sandboxes/" + q(self.id))
        return self._info

    @property
    def image(self) -> str:
        return self._info.get("image") or ""

    @property
    def workdir(self) -> str:
        return self._info.get("workdir") or ""

    @property
    def head(self) -> Optional[str]:
        """The node the sandbox stands on now (None: directly on its image)."""
        return self.info().get("head") or None

    @property
    def status(self) -> str:
        """``running``, or ``broken`` (see ``info()["error"]``)."""
        return self.info().get("status") or ""

    def memory(self) -> SandboxMemory:
        """Its memory limit, what it uses, and what the process templates of its
        checkpoints hold (:class:`SandboxMemory`), against their budget
        (docs/API.md, "Template memory")."""
        return SandboxMemory.from_info(self.info())

    # ---- commands ----

    def run(self, cmd: Command, timeout: Timeout = CLIENT_TIMEOUT,
            session: Union[str, bool, None] = None,
            env: Union[Mapping[str, Any], Iterable[str], None] = None,
            cwd: Optional[str] = None, stdin: Union[str, bytes, None] = None,
            on_output: Optional[OnOutput] = None,
            output_limit: Optional[int] = None) -> Result:
        """Runs a command and returns its :class:`Result`; a non-zero exit code is not
        an error (``.check()`` makes it one).

        Args:
            cmd: a string is a shell command line, run as ``bash -c cmd``; a list is
                an argv, run as is (looked up in the sandbox's PATH). With
                ``session``, the string is code for the session (bash or python).
            timeout: seconds; a plain command's whole process group is then killed,
                a session's command is interrupted (^C) and the session lives on.
                Either way ``timed_out`` is set. By default the client's timeout
                (``Client(timeout=...)``, 600 s unless set; with ``Client(timeout=None)``
                the daemon's default, 10 minutes); None: no timeout.
            session: run in a persistent session instead of a new process: ``"main"``
                (or True) is the default bash session, started on first use; other
                names are started with ``sb.sessions.start``. One call at a time per
                session (Conflict otherwise).
            env: extra environment, a dict or ``KEY=VALUE`` strings.
            cwd: directory, absolute or relative to the workdir.
            stdin: given on the command's standard input: bytes as they are, str as
                UTF-8.
            on_output: ``on_output(stream, data)`` is called with each piece of output
                as it is produced (``stream`` is ``"stdout"`` or ``"stderr"``; ``data``
                is text, decoded as UTF-8 across pieces; the markers of dropped output
                and of a timeout included), in order. If it raises, the call is
                abandoned and the daemon kills the command. The result holds the whole
                output as well.
            output_limit: cap in bytes of each of stdout and stderr (default 1 MiB):
                the first quarter and the last three quarters are kept.

        If the call is abandoned (``on_output`` raises, KeyboardInterrupt, the
        client's wait runs out) the connection closes and the daemon interrupts the
        command: a plain command's process group is killed, a session's command gets
        ^C and the session is ready for the next call.
        """
        x = _exec_request(cmd, timeout, session, env, cwd, stdin, output_limit,
                          self.client._t.timeout)
        path = "/sandboxes/%s/exec" % q(self.id)
        if on_output is None:
            return Result.from_api(self.client._t.json("POST", path, x.body, timeout=x.wait), x.argv)
        x.body["stream"] = True
        out = _Output(x.argv)
        events = self.client._t.stream("POST", path, x.body, timeout=x.wait)
        try:
            for ev in events:
                piece = out.feed(ev)
                if piece is not None:
                    on_output(*piece)
        finally:
            events.close()
        res = out.done()
        for piece in out.rest():
            on_output(*piece)
        return res

    # ---- checkpoints ----

    def checkpoint(self, label: Optional[str] = None, end_background: bool = False,
                   wait: Optional[float] = DEFAULT_WAIT, pin: bool = False,
                   answer: Optional[str] = None) -> CheckpointResult:
        """Freezes the sandbox's files and its processes (its bash and python sessions',
        and background jobs a command left) into a new node of the tree, in one atomic
        step, and returns what it did (:class:`CheckpointResult`): ``ckpt.node`` is
        the node made, ``ckpt.processes`` says how many processes the node keeps,
        ``ckpt.process_errors`` which could not be kept (they were ended),
        ``ckpt.killed_processes`` how many were ended (``end_background``), and
        ``ckpt.sessions`` which sessions it carries. ``sb.restore(ckpt)`` and
        ``ckpt.fork(count)`` take it as they take its node.

        While commands or file operations run (from other threads), it queues behind
        them for ``wait`` seconds at most (default 5; calls made meanwhile wait behind
        it), then raises Conflict naming them; ``wait=0`` raises at once. Conflict
        too, naming the session or process and the reason, when a process cannot be
        checkpointed with its state (a pipe, a socket, threads, child processes...;
        nothing is changed). With ``end_background=True`` such processes outside the
        sessions are ended instead.

        ``ckpt.memory`` is the sandbox's memory after it (the new templates' resident
        memory included); when the templates of its checkpoints hold over half its
        memory limit, ``ckpt.warnings`` says so and a :class:`~deltabox.MemoryWarning`
        is warned.

        While the templates of the sandbox's checkpoints hold more than its
        ``template_budget_mb`` (or every sandbox's more than the daemon's total), it
        waits for room (``wait``; with ``wait=0``, a second), then raises
        :class:`~deltabox.TemplateBudgetExceeded` naming the budget. ``pin=True`` pins
        the new node (:meth:`Node.pin`).

        With processes to keep, it answers once they are stopped, before their
        templates are forked (``answer="early"``, the daemon's default): ``ckpt.node``
        is then ``pending``, and the sandbox's next call waits for the node (a few ms).
        If the checkpoint fails after that answer, it is undone (nothing changed), and
        the next call raises Conflict saying so. ``answer="complete"`` waits for the
        node (``ckpt.complete``). docs/API.md, "Checkpoints that answer early"."""
        body, ms = _checkpoint_body(label, end_background, wait, pin, answer)
        d = self.client._t.json("POST", "/sandboxes/%s/checkpoint" % q(self.id), body,
                                timeout=_op_timeout(self.client._t.timeout, ms))
        ck = CheckpointResult.from_api(d, self.client, workdir=self.workdir or None)
        _warn(ck.warnings)
        return ck

    def restore(self, checkpoint: NodeRef,
                wait: Optional[float] = DEFAULT_WAIT,
                lazy_image: Optional[bool] = None) -> RestoreResult:
        """Rolls the sandbox back (or over) to a checkpoint, files and processes
        together, and returns what it did (:class:`RestoreResult`). ``checkpoint`` is a
        :class:`Node`, what ``sb.checkpoint()`` returned, or a node id.

        Uncommitted changes are discarded and every process of the sandbox is ended;
        when this sandbox made the node, the node's processes come back from their
        templates with the same PIDs, the sessions' with their terminals
        (``result.processes``). Any node of the tree works; one made by another
        sandbox (or whose templates and durable image are gone) brings back its files only
        (``processes`` 0), and sessions start again on their next call
        (``session_restarted``): ``result.sessions_restored`` and
        ``result.sessions_ended`` name them. Conflict while a command runs, or if a
        template of the node is gone (nothing is changed). ``wait`` as for
        :meth:`checkpoint`: while commands run it queues behind them for that many
        seconds (default 5), then raises Conflict naming them. (Before 0.2.0 this
        returned the sandbox.) ``lazy_image``: when the node's processes come back
        from its durable image (``result.from_image``), True restores them lazily
        (their memory copied in on demand: the first command answers sooner for a
        large heap; the next checkpoint waits for the rest), False eagerly, None
        lets the daemon choose (lazily from 64 MiB)."""
        body, ms = _restore_body(checkpoint, wait, lazy_image)
        d = self.client._t.json("POST", "/sandboxes/%s/restore" % q(self.id), body,
                                timeout=_op_timeout(self.client._t.timeout, ms))
        res = RestoreResult.from_api(d, self.client)
        _warn(res.warnings)
        return res

    def fork(self, count: int = 1, label: Optional[str] = None, processes: str = "auto",
             image_wait: Optional[float] = None, wait: Optional[float] = DEFAULT_WAIT,
             **create_kwargs: Any) -> List["Sandbox"]:
        """Checkpoints this sandbox and starts ``count`` new sandboxes on that
        checkpoint, its files and processes with them, in one request
        (``POST /v1/sandboxes/ID/fork``; :meth:`fork_from` says what a fork does, a
        branch's ``fork_branch`` how it was made; ``name=`` with ``count`` > 1 names
        them ``name-0``, ``name-1``, ...). ``label`` and ``wait`` are the checkpoint's
        (:meth:`checkpoint`). This sandbox goes on as it was; the checkpoint's node
        stays in the tree, also when the fork fails."""
        create_kwargs.pop("client", None)
        remove_nodes = bool(create_kwargs.pop("remove_nodes", False))
        body, ms = _fork_body(count, create_kwargs, processes, image_wait)
        body["checkpoint"], ck_ms = _checkpoint_body(label, False, wait, False)
        d = self.client._t.json("POST", "/sandboxes/%s/fork" % q(self.id), body,
                                timeout=_op_timeout(self.client._t.timeout, ms + ck_ms))
        return [Sandbox(sb_id, self.client, info, remove_nodes=remove_nodes, fork_branch=b)
                for sb_id, info, b in _forked(d, self.client)]

    def signal(self, pid: int, sig: int = 15) -> None:
        """Sends signal ``sig`` (default SIGTERM) to process ``pid`` of this sandbox (its
        PID inside) from outside: a command cannot signal what another command started
        (each runs in a Landlock domain of its own), so this is how a server a command
        left in the background is stopped. InvalidRequest for pid 1 or a bad signal."""
        self.client._t.json("POST", "/sandboxes/%s/signal" % q(self.id), {"pid": pid, "signal": sig})

    def tree(self) -> Tree:
        """The snapshot tree, with ``head`` set to the node this sandbox stands on
        (``tree.path(tree.head)`` is its history). ``tree.nodes`` holds every node;
        ``render()`` shows this sandbox's lineage only (``render(all=True)``: all of
        it; ``tree.lineage()``: that part as a Tree)."""
        head = self.head
        t = self.client.tree()
        t.head, t.sandbox = head, self.id
        return t


@dataclass
class Session:
    """A persistent session of a sandbox (a bash or python process on a terminal, or
    a long-lived command)."""

    name: str
    kind: str = "bash"
    argv: List[str] = field(default_factory=list)
    pid: int = 0
    started: Optional[_dt.datetime] = None
    running: bool = False
    busy: bool = False
    exit: Optional[str] = None
    _sandbox: Optional[Sandbox] = field(default=None, repr=False, compare=False)

    @classmethod
    def from_api(cls, d: Dict[str, Any], sb: Sandbox) -> "Session":
        return cls(name=d.get("name") or "", kind=d.get("kind") or "bash",
                   argv=list(d.get("argv") or []), pid=int(d.get("pid") or 0),
                   started=parse_time(d.get("started")), running=bool(d.get("running")),
                   busy=bool(d.get("busy")), exit=d.get("exit") or None, _sandbox=sb)

    def run(self, code: str, timeout: Timeout = CLIENT_TIMEOUT,
            on_output: Optional[OnOutput] = None) -> Result:
        """Runs code in this session (``sb.run(code, session=name)``)."""
        assert self._sandbox is not None
        return self._sandbox.run(code, timeout=timeout, session=self.name, on_output=on_output)

    def kill(self) -> None:
        assert self._sandbox is not None
        self._sandbox.sessions.kill(self.name)

    def logs(self) -> str:
        assert self._sandbox is not None
        return self._sandbox.sessions.logs(self.name)


class Sessions:
    """``sb.sessions``: persistent bash and python sessions and long-lived commands."""

    def __init__(self, sb: Sandbox) -> None:
        self._sb = sb

    def _path(self, *parts: str) -> str:
        return "/sandboxes/%s/sessions" % q(self._sb.id) + "".join("/" + q(p) for p in parts)

    def start(self, name: str, kind: Optional[str] = None, argv: Optional[Sequence[str]] = None,
              cwd: Optional[str] = None,
              env: Union[Mapping[str, Any], Iterable[str], None] = None) -> Session:
        """Starts a session: ``kind="bash"`` (the default) or ``"python"`` keep their
        state between calls; ``argv=[...]`` starts a long-lived command (a server)
        whose output ``logs()`` returns. Conflict if a session of that name runs."""
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
        return Session.from_api(self._sb.client._t.json("POST", self._path(), body), self._sb)

    def list(self) -> List[Session]:
        """The sandbox's sessions; ended ones have ``running`` False and ``exit``."""
        d = self._sb.client._t.json("GET", self._path())
        return [Session.from_api(s, self._sb) for s in (d.get("sessions") or [])]

    def get(self, name: str) -> Session:
        for s in self.list():
            if s.name == name:
                return s
        raise NotFound("not_found", "no session %r in sandbox %s" % (name, self._sb.id), 404)

    def kill(self, name: str) -> None:
        """Kills a session's process group."""
        self._sb.client._t.json("DELETE", self._path(name))

    def logs(self, name: str) -> str:
        """Output of the session that no call consumed (a command session's output,
        its last 1 MiB)."""
        data, _ = self._sb.client._t.request("GET", self._path(name, "logs"))
        return data.decode("utf-8", "replace")

    def run(self, name: str, code: str, timeout: Timeout = CLIENT_TIMEOUT,
            on_output: Optional[OnOutput] = None) -> Result:
        """Runs code in session ``name``."""
        return self._sb.run(code, timeout=timeout, session=name, on_output=on_output)


class Files:
    """``sb.files``: the sandbox's filesystem. Paths are absolute or relative to the
    sandbox's workdir; no path can leave the sandbox."""

    def __init__(self, sb: Sandbox) -> None:
        self._sb = sb

    def _path(self, sub: str = "") -> str:
        return "/sandboxes/%s/files%s" % (q(self._sb.id), sub)

    def read(self, path: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        """The content of a file (``length`` bytes from ``offset``; default: all)."""
        query: Dict[str, Any] = {"path": path}
        if offset:
            query["offset"] = int(offset)
        if length:
            query["length"] = int(length)
        data, _ = self._sb.client._t.request("GET", self._path(), query)
        return data

    def read_text(self, path: str, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read(path).decode(encoding, errors)

    def write(self, path: str, data: Union[bytes, bytearray, memoryview, str, Any],
              mode: Union[int, str, None] = None, mkdir: bool = True) -> FileInfo:
        """Replaces a file's content (atomically) and returns the file.

        ``data`` is bytes, str (written as UTF-8) or a binary file object. ``mode``
        (e.g. ``0o755``) sets the permission bits; otherwise an existing file keeps
        its mode and a new one gets 0644. ``mkdir`` creates missing parent
        directories."""
        body = _data_bytes(data)
        query = {"path": path, "mode": _mode(mode), "mkdir": "1" if mkdir else None}
        raw, _ = self._sb.client._t.request("PUT", self._path(), query, body,
                                            "application/octet-stream")
        return FileInfo.from_api(json.loads(raw.decode("utf-8")))

    def list(self, path: str = ".", recursive: bool = False, depth: Optional[int] = None,
             max_entries: Optional[int] = None) -> Listing:
        """The entries of a directory (default: the workdir), a list of FileInfo
        with ``.path`` and ``.truncated``. ``recursive`` descends ``depth`` levels
        (daemon default 32); at most ``max_entries`` (default 10000)."""
        query = {"path": path, "recursive": "1" if recursive else None,
                 "depth": depth or None, "max_entries": max_entries or None}
        d = self._sb.client._t.json("GET", self._path("/list"), query=query)
        return Listing([FileInfo.from_api(e) for e in (d.get("entries") or [])],
                       path=name_of(d, "path") or "", truncated=bool(d.get("truncated")))

    def stat(self, path: str) -> FileInfo:
        """Describes a path without following a final symlink (NotFound if none)."""
        return FileInfo.from_api(self._sb.client._t.json("GET", self._path("/stat"), query={"path": path}))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except NotFound as e:
            if e.message.startswith("no route"):
                raise
            return False

    def remove(self, path: str, recursive: bool = False) -> None:
        """Removes a file, or a directory (only when empty unless ``recursive``)."""
        self._sb.client._t.json("DELETE", self._path(),
                                query={"path": path, "recursive": "1" if recursive else None})

    def mkdir(self, path: str, mode: Union[int, str, None] = None, parents: bool = True) -> bool:
        """Creates a directory (and its parents, unless ``parents=False``); returns
        False if it existed already."""
        d = self._sb.client._t.json("POST", self._path("/mkdir"), query={
            "path": path, "mode": _mode(mode), "parents": None if parents else "0"})
        return bool(d.get("created"))
