"""The values the client returns: Result, Node (a node of the snapshot tree), Tree,
RestoreResult (what a restore did), Templates, OpMemory, SandboxMemory, FileInfo and
Listing. (CheckpointResult is in sandbox.py: its fork() makes Sandboxes.)

Nothing here imports the client or the sandbox: a Node's methods reach the daemon
through the NodeClient it was read with."""

import base64
import datetime as _dt
import re
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterable, Iterator, List, Optional, Protocol, Set

from .errors import CommandError

_TIME_RE = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?(Z|[+-]\d{2}:?\d{2})?$")


def parse_time(s: Any) -> Optional[_dt.datetime]:
    """Parses the daemon's RFC 3339 times (nanoseconds, "Z") into an aware datetime;
    None for empty or unparsable values, and for Go's zero time (year 1: an ended
    session's ``started``). (datetime.fromisoformat of Python 3.9 takes neither "Z" nor
    9 fractional digits.)"""
    if not isinstance(s, str) or not s or s.startswith("0001-01-01T00:00:00"):
        return None
    m = _TIME_RE.match(s)
    if not m:
        return None
    y, mo, d, h, mi, sec, frac, tz = m.groups()
    us = int((frac or "0")[:6].ljust(6, "0"))
    if tz is None or tz == "Z":
        tzinfo = _dt.timezone.utc
    else:
        sign = -1 if tz[0] == "-" else 1
        hh, mm = int(tz[1:3]), int(tz[-2:])
        tzinfo = _dt.timezone(sign * _dt.timedelta(hours=hh, minutes=mm))
    try:
        return _dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(sec), us, tzinfo=tzinfo)
    except ValueError:
        return None


@dataclass
class Result:
    """What a command returned. Like subprocess.run, a non-zero exit code is not an
    exception: call :meth:`check` for that.

    Attributes:
        exit_code: the command's status; -1 when it was killed by a signal
            (``signal`` says which), e.g. on timeout.
        stdout, stderr: its output as text, decoded as UTF-8 (invalid bytes become
            U+FFFD). In a session, stdout is the terminal's merged output and stderr
            is empty.
        stdout_bytes, stderr_bytes: the same output, the exact bytes (binary output,
            other encodings).
        duration: seconds the command took, measured by the daemon.
        timed_out: the timeout was reached: a plain command's process group was
            killed; a session's command was interrupted (^C) and the session lives on.
        timeout: the timeout that applied, in seconds (None: none).
        truncated: stdout or stderr went over the output limit: its first quarter and
            last three quarters were kept, with a marker between them,
            ``[deltabox: N bytes of stdout dropped]``.
        stdout_dropped, stderr_dropped: how many bytes were dropped.
        session_restarted: the session had been ended by a checkpoint or restore and
            was started again for this call (its state is gone).
        oom: set when the sandbox's memory limit made the kernel kill a process
            while the command ran (this command's, or another of the sandbox's): the
            limit, how much of it the templates of the sandbox's checkpoints hold, by
            node, and what to do. :meth:`check` raises with it.
    """

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    duration: float = 0.0
    timed_out: bool = False
    truncated: bool = False
    session_restarted: bool = False
    signal: Optional[int] = None
    session: Optional[str] = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    oom: Optional[str] = None
    argv: Optional[List[str]] = field(default=None, repr=False, compare=False)
    stdout_bytes: bytes = field(default=b"", repr=False)
    stderr_bytes: bytes = field(default=b"", repr=False)
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    timeout: Optional[float] = None

    def __post_init__(self) -> None:
        # Made from text alone (by hand): the bytes are its UTF-8.
        if not self.stdout_bytes and self.stdout:
            self.stdout_bytes = self.stdout.encode("utf-8")
        if not self.stderr_bytes and self.stderr:
            self.stderr_bytes = self.stderr.encode("utf-8")

    @classmethod
    def from_api(cls, d: Dict[str, Any], argv: Optional[List[str]] = None,
                 stdout_bytes: Optional[bytes] = None,
                 stderr_bytes: Optional[bytes] = None) -> "Result":
        """A Result from the daemon's answer (``encoding`` base64 or text); a streamed
        call gives the output its events carried as ``stdout_bytes``/``stderr_bytes``."""
        so, se = bool(d.get("stdout_truncated")), bool(d.get("stderr_truncated"))
        out, err = stdout_bytes, stderr_bytes
        if d.get("encoding") == "base64":
            if out is None:
                out = base64.b64decode(d.get("stdout") or "")
            if err is None:
                err = base64.b64decode(d.get("stderr") or "")
        else:
            if out is None:
                out = (d.get("stdout") or "").encode("utf-8")
            if err is None:
                err = (d.get("stderr") or "").encode("utf-8")
        ms = d.get("timeout_ms")
        return cls(
            exit_code=int(d.get("exit_code", -1)),
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            duration=float(d.get("duration_ms") or 0.0) / 1000.0,
            timed_out=bool(d.get("timed_out")),
            truncated=so or se,
            session_restarted=bool(d.get("session_restarted")),
            signal=d.get("signal") or None,
            session=d.get("session") or None,
            stdout_truncated=so,
            stderr_truncated=se,
            oom=d.get("oom") or None,
            argv=argv,
            stdout_bytes=out,
            stderr_bytes=err,
            stdout_dropped=int(d.get("stdout_dropped") or 0),
            stderr_dropped=int(d.get("stderr_dropped") or 0),
            timeout=float(ms) / 1000.0 if ms else None,
        )

    @property
    def ok(self) -> bool:
        """Exit code 0 and no timeout."""
        return self.exit_code == 0 and not self.timed_out

    def check(self) -> "Result":
        """Raises CommandError unless :attr:`ok`; returns self, so
        ``sb.run("make").check().stdout`` reads well."""
        if not self.ok:
            raise CommandError(self, self.argv)
        return self


@dataclass
class Templates:
    """Process templates: the processes a node keeps, forked at its checkpoint, that a
    restore in the sandbox that made it forks back (GET /v1/tree and /v1/nodes/ID).

    Attributes:
        processes: how many (sessions' and background jobs').
        sessions: the sessions they belong to (a node's; empty for a total).
        rss_bytes, pss_bytes, private_dirty_bytes: their memory, from each template's
            /proc/PID/smaps_rollup; ``private_dirty_bytes`` is what the node alone
            keeps (what removing it frees). See docs/API.md.
    """

    processes: int = 0
    sessions: List[str] = field(default_factory=list)
    rss_bytes: int = 0
    pss_bytes: int = 0
    private_dirty_bytes: int = 0

    @classmethod
    def from_api(cls, d: Any) -> Optional["Templates"]:
        if not isinstance(d, dict):
            return None
        return cls(processes=int(d.get("processes") or 0),
                   sessions=list(d.get("sessions") or []),
                   rss_bytes=int(d.get("rss_bytes") or 0),
                   pss_bytes=int(d.get("pss_bytes") or 0),
                   private_dirty_bytes=int(d.get("private_dirty_bytes") or 0))


@dataclass
class ProcessImage:
    """A node's durable process image: its templates written to CRIU images in the
    background, from which the node's processes come back once its templates are gone
    (evicted over the template budget, killed, or their sandbox ended).

    Attributes:
        state: ``pending`` (queued or being written), ``complete`` or ``failed``.
        error: why it failed.
        stored_bytes: what the image added to the daemon's store (each distinct page
            once: mostly what changed since the images before it).
        full_bytes: what a full CRIU dump of the same processes takes.
        lag_ms: how long it has waited (pending), or waited before it was complete.
        dump_ms: how long its dump and storing took.
    """

    state: str = ""
    error: str = ""
    stored_bytes: int = 0
    full_bytes: int = 0
    lag_ms: int = 0
    dump_ms: int = 0

    @classmethod
    def from_api(cls, d: Any) -> Optional["ProcessImage"]:
        if not isinstance(d, dict):
            return None
        return cls(state=str(d.get("state") or ""), error=str(d.get("error") or ""),
                   stored_bytes=int(d.get("stored_bytes") or 0),
                   full_bytes=int(d.get("full_bytes") or 0),
                   lag_ms=int(d.get("lag_ms") or 0), dump_ms=int(d.get("dump_ms") or 0))


@dataclass
class OpMemory:
    """The sandbox's memory after a checkpoint or restore (``ckpt.memory``,
    ``result.memory``). A node's process templates are stopped processes of the
    sandbox, within a budget of their own (``template_budget_bytes``; docs/API.md,
    "Template memory").

    Attributes:
        limit_bytes: the sandbox's memory limit.
        usage_bytes: what the sandbox uses now, templates and page cache included (what
            the limit caps).
        node_templates_rss_bytes: (a checkpoint's) resident memory of the templates it
            forked: shared with the live processes at first, the most the node comes to
            hold alone as they rewrite their memory.
        templates: every template of the sandbox and what they hold
            (``pss_bytes``: their share), measured only when the sandbox uses over half
            its limit (None otherwise: they cannot hold more than half of it).
        template_budget_bytes: the templates' budget (``template_budget_mb``; 0:
            none, they count against ``limit_bytes``).
        kernel_limit_bytes: the kernel's memory limit now: ``limit_bytes`` plus what
            the templates may come to hold alone, up to their budget.
    """

    limit_bytes: int = 0
    usage_bytes: int = 0
    node_templates_rss_bytes: int = 0
    templates: Optional[Templates] = None
    template_budget_bytes: int = 0
    kernel_limit_bytes: int = 0

    @classmethod
    def from_api(cls, d: Any) -> Optional["OpMemory"]:
        if not isinstance(d, dict):
            return None
        return cls(limit_bytes=int(d.get("limit_bytes") or 0),
                   usage_bytes=int(d.get("usage_bytes") or 0),
                   node_templates_rss_bytes=int(d.get("node_templates_rss_bytes") or 0),
                   templates=Templates.from_api(d.get("templates")),
                   template_budget_bytes=int(d.get("template_budget_bytes") or 0),
                   kernel_limit_bytes=int(d.get("kernel_limit_bytes") or 0))


@dataclass
class SandboxMemory:
    """``sb.memory()``: a sandbox's memory limit, what it uses, and what the process
    templates of its checkpoints (every node's) cost.

    Attributes:
        limit_bytes: its memory limit (``memory_mb``).
        usage_bytes, peak_bytes: what it uses now (templates included) and the most it
            used.
        oom_kills: processes the limit made the kernel kill so far.
        templates: its templates' total (None when it has none); ``pss_bytes`` is
            their share of the usage, ``private_dirty_bytes`` what removing their nodes
            frees.
        template_budget: the templates' memory against their budget, as the daemon
            answers it (``budget_bytes``, ``used_bytes``, ``pinned_bytes``,
            ``pinned_nodes``, ``evictable_bytes``, ``total_budget_bytes``,
            ``total_used_bytes``; docs/API.md, Template memory); None from a daemon
            without budgets.
    """

    limit_bytes: int = 0
    usage_bytes: int = 0
    peak_bytes: int = 0
    oom_kills: int = 0
    templates: Optional[Templates] = None
    template_budget: Optional[Dict[str, int]] = None

    @classmethod
    def from_info(cls, info: Dict[str, Any]) -> "SandboxMemory":
        limits = info.get("limits") or {}
        usage = info.get("usage") or {}
        return cls(limit_bytes=int(limits.get("memory_bytes") or 0),
                   usage_bytes=int(usage.get("memory_bytes") or 0),
                   peak_bytes=int(usage.get("memory_peak_bytes") or 0),
                   oom_kills=int(usage.get("oom_kills") or 0),
                   templates=Templates.from_api(info.get("templates")),
                   template_budget=_budget(info.get("template_budget")))


def _budget(d: Any) -> Optional[Dict[str, int]]:
    if not isinstance(d, dict):
        return None
    return {str(k): int(v) for k, v in d.items()}


def _phases(d: Dict[str, Any]) -> Dict[str, int]:
    return {str(k): int(v) for k, v in (d.get("phases_us") or {}).items()}


class NodeClient(Protocol):
    """What a :class:`Node`'s methods ask of the client that read it (a
    :class:`~deltabox.Client`): a protocol, so that this module needs no client."""

    def node(self, id: str) -> "Node": ...

    def remove_checkpoint(self, id: str) -> List[str]: ...

    def pin_checkpoint(self, id: str, pinned: bool = True) -> "Node": ...

    def prepare_checkpoint(self, id: str, sandbox: Optional[str] = None) -> "Node": ...

    def export_node(self, id: str, path: str) -> List[str]: ...


@dataclass
class Node:
    """A node of the snapshot tree: a sandbox's files, and its processes, frozen at one
    moment. What the daemon keeps (``GET /v1/nodes/ID``); what a checkpoint *did* is
    its :class:`~deltabox.CheckpointResult`, whose ``node`` this is.

    ``client.tree()`` holds them, ``client.node(id)`` reads one; ``sb.restore(node)``
    rolls a sandbox back (or over) to it, ``Sandbox.fork_from(node, count)`` starts new
    sandboxes on it.

    Attributes:
        id: the node id (``n3fa9c2``).
        label: the label given at checkpoint time ("" if none).
        parent: the parent node, None for a node directly on its image.
        created: when it was taken (aware datetime, UTC).
        layer_bytes: apparent size of its own layer; -1 until the daemon measured it.
        durable: its record has reached the disk (false for a few ms after a
            checkpoint; ``client.sync()`` waits for it).
        image: the image its stack starts from.
        sandbox: the sandbox it was taken from.
        layer, own_layer: the number of its layer, and whether the layer is its own
            (False when nothing had changed since its parent: it shares the parent's).
        children: ids of its child nodes, oldest first.
        sandboxes: sandboxes standing on it now.
        depth: layers a restore of it mounts (image excluded).
        squash_layer: the layer the daemon wrote in the background to stand for its
            whole stack (long chains: restores and descendants mount it instead); 0: none.
        templates: its process templates (which sessions, how many processes, their
            memory); None when it has none. The daemon measures them for the tree and
            for ``GET /v1/nodes/ID`` only, so the node in a checkpoint's answer has
            None: ``ckpt.refresh().templates``.
        pinned: the hint that it will be restored again (:meth:`pin`): its templates
            are never evicted over the template budget.
        last_restored: its last restore (aware datetime, UTC), None if never.
        process_image: its durable process image (:class:`ProcessImage`), None when
            none was asked for (no process template, or images off).
        pending: in a checkpoint's early answer only: its templates are still being
            made (whatever names the node, a read, a restore, a fork, waits for them).
        complete: seconds its checkpoint took until the node was complete (0.0: not
            known, for a node made before the daemon started).
        spares: the sandboxes holding a spare of it (:meth:`prepare`), sorted; read
            by ``client.node(id)`` and :meth:`refresh` only.
    """

    id: str
    label: str = ""
    parent: Optional[str] = None
    created: Optional[_dt.datetime] = None
    layer_bytes: int = -1
    durable: bool = False
    image: str = ""
    sandbox: Optional[str] = None
    layer: int = 0
    own_layer: bool = False
    children: List[str] = field(default_factory=list)
    sandboxes: List[str] = field(default_factory=list)
    depth: int = 0
    squash_layer: int = 0
    templates: Optional[Templates] = None
    pinned: bool = False
    last_restored: Optional[_dt.datetime] = None
    process_image: Optional[ProcessImage] = None
    pending: bool = False
    complete: float = 0.0
    spares: List[str] = field(default_factory=list)
    _client: Optional[NodeClient] = field(default=None, repr=False, compare=False)
    # The workdir of the sandbox that made it, when known (a fork's default).
    _workdir: Optional[str] = field(default=None, repr=False, compare=False)

    @classmethod
    def from_api(cls, d: Dict[str, Any], client: Optional[NodeClient] = None,
                 workdir: Optional[str] = None) -> "Node":
        return cls(
            id=d["id"],
            label=d.get("label") or "",
            parent=d.get("parent") or None,
            created=parse_time(d.get("created")),
            layer_bytes=int(d.get("layer_bytes", -1)),
            durable=bool(d.get("durable")),
            image=d.get("image") or "",
            sandbox=d.get("sandbox") or None,
            layer=int(d.get("layer") or 0),
            own_layer=bool(d.get("own_layer")),
            children=list(d.get("children") or []),
            sandboxes=list(d.get("sandboxes") or []),
            depth=int(d.get("depth") or 0),
            squash_layer=int(d.get("squash_layer") or 0),
            templates=Templates.from_api(d.get("templates")),
            pinned=bool(d.get("pinned")),
            last_restored=parse_time(d.get("last_restored")),
            process_image=ProcessImage.from_api(d.get("process_image")),
            pending=bool(d.get("pending")),
            complete=float(d.get("complete_ms") or 0.0) / 1000.0,
            spares=[str(s) for s in (d.get("spares") or [])],
            _client=client,
            _workdir=workdir,
        )

    def __str__(self) -> str:
        return self.id

    def _need_client(self) -> NodeClient:
        if self._client is None:
            raise ValueError("node %s was built without a client (Node.from_api(d) with no "
                             "client=): use client.node(%r) for one that has it" % (self.id, self.id))
        return self._client

    def refresh(self) -> "Node":
        """The node as the daemon sees it now (durable, layer_bytes, children,
        templates...)."""
        return self._need_client().node(self.id)

    def remove(self) -> List[str]:
        """Removes this node and its subtree; returns the removed ids. Conflict if a
        sandbox stands on a node of the subtree."""
        return self._need_client().remove_checkpoint(self.id)

    def pin(self, pinned: bool = True) -> "Node":
        """Pins this node (``pinned=False`` unpins it): a hint that it will be restored
        again, so that its process templates are never evicted over the template
        budget. Returns the node as the daemon sees it now."""
        return self._need_client().pin_checkpoint(self.id, pinned)

    def prepare(self, sandbox: Optional[str] = None) -> "Node":
        """Makes sure ``sandbox`` (None: the node's own) holds a spare of this node:
        its processes forked and placed ahead of time, so that the sandbox's next
        restore of it swaps them in instead of forking (``from_spare``). For a node
        made before a fork, restored in a member of its family (``sb.fork``);
        ConflictError otherwise, saying why. Returns once the spare is ready."""
        return self._need_client().prepare_checkpoint(self.id, sandbox)

    def export(self, path: str) -> List[str]:
        """Writes this node, its layer chain and its process image to the file
        ``path`` (on the caller's machine), for ``client.import_node(path)`` on another
        host. Returns the daemon's warnings (what the archive does not carry)."""
        return self._need_client().export_node(self.id, path)


# The name of Node before 0.4.0, when one class was both the node and what
# sb.checkpoint() did (now a CheckpointResult, whose .node is the Node).
Checkpoint = Node


@dataclass
class RestoreResult:
    """What ``sb.restore(node)`` did: the files are the node's, and the processes are
    the node's templates forked back (same PIDs, the sessions with their terminals)
    when this sandbox made the node; every other process of the sandbox was ended.

    Attributes:
        node: the node the sandbox now stands on (as the daemon's answer describes it).
        sandbox: the sandbox's id.
        processes: processes brought back from the node's templates (sessions' and
            background jobs'); 0 for a node made with no process running, restored
            into another sandbox than the one that made it, or whose templates and
            durable image are both gone: a restore of files only.
        process_errors: templates that could not be forked back (their sessions
            were ended); empty when all were.
        killed_processes: the sandbox's processes the restore ended (the live
            sessions' included: they are replaced by the node's).
        criu_processes: the node's background processes restored by CRIU (in the
            sandbox that made the node only); not counted in ``processes``.
        mounted: the node's state was mounted (False when the sandbox already stood
            on it, unchanged).
        warm: the node's state had been mounted ahead of time.
        from_image: the node's templates were gone (evicted, killed) and came back
            from its durable image first.
        from_spare: the restore swapped in a spare of the node (:meth:`Node.prepare`)
            instead of forking its processes.
        lazy_image: that restore from the image was lazy: it answered before every
            page was read (the next checkpoint waits for the rest).
        duration: seconds inside the daemon.
        phases_us: microseconds per step (templates, upper, mount, kill, reap,
            processes, publish).
        sessions_restored: the sessions brought back from the node (their process
            the node's, same PID and state), sorted.
        sessions_ended: the sessions the restore ended, sorted: the node has no
            process of theirs (made without them, or in another sandbox), or theirs
            could not be resumed; their next call starts them afresh
            (``session_restarted``).
        waited: seconds it queued behind running commands (``wait``).
        memory: the sandbox's memory after it (:class:`OpMemory`).
        warnings: what to act on (templates holding over half the memory limit).
    """

    node: Node
    sandbox: str
    processes: int = 0
    process_errors: List[str] = field(default_factory=list)
    killed_processes: int = 0
    criu_processes: int = 0
    mounted: bool = False
    warm: bool = False
    from_image: bool = False
    from_spare: bool = False
    lazy_image: bool = False
    duration: float = 0.0
    phases_us: Dict[str, int] = field(default_factory=dict)
    sessions_restored: List[str] = field(default_factory=list)
    sessions_ended: List[str] = field(default_factory=list)
    waited: float = 0.0
    memory: Optional[OpMemory] = None
    warnings: List[str] = field(default_factory=list)

    @classmethod
    def from_api(cls, d: Dict[str, Any], client: Optional[NodeClient] = None,
                 workdir: Optional[str] = None) -> "RestoreResult":
        return cls(
            node=Node.from_api(d["node"], client, workdir=workdir),
            sandbox=d.get("sandbox") or "",
            processes=int(d.get("processes") or 0),
            process_errors=[str(e) for e in (d.get("process_errors") or [])],
            killed_processes=int(d.get("killed_processes") or 0),
            criu_processes=int(d.get("criu_processes") or 0),
            mounted=bool(d.get("mounted")),
            warm=bool(d.get("warm")),
            from_image=bool(d.get("from_image")),
            from_spare=bool(d.get("from_spare")),
            lazy_image=bool(d.get("lazy_image")),
            duration=float(d.get("duration_ms") or 0.0) / 1000.0,
            phases_us=_phases(d),
            sessions_restored=[str(s) for s in (d.get("sessions") or [])],
            sessions_ended=[str(s) for s in (d.get("sessions_ended") or [])],
            waited=float(d.get("waited_ms") or 0.0) / 1000.0,
            memory=OpMemory.from_api(d.get("memory")),
            warnings=[str(w) for w in (d.get("warnings") or [])],
        )

    @property
    def id(self) -> str:
        """The node's id."""
        return self.node.id

    def __str__(self) -> str:
        return self.node.id


@dataclass
class Tree:
    """The snapshot tree: every node (a :class:`Node`), oldest first.

    Attributes:
        nodes: id -> Node, in creation order (every node of the daemon's tree).
        roots: nodes directly on an image.
        on_image: image -> sandboxes standing on the image with no node yet.
        head: for ``sb.tree()``, the node that sandbox stands on (None: its image).
        sandbox: for ``sb.tree()``, that sandbox's id; :meth:`render` then shows its
            lineage only (:meth:`lineage`).
    """

    nodes: Dict[str, Node] = field(default_factory=dict)
    roots: List[str] = field(default_factory=list)
    on_image: Dict[str, List[str]] = field(default_factory=dict)
    head: Optional[str] = None
    sandbox: Optional[str] = None

    @classmethod
    def from_api(cls, d: Dict[str, Any], client: Optional[NodeClient] = None) -> "Tree":
        nodes: Dict[str, Node] = {}
        for n in d.get("nodes") or []:
            c = Node.from_api(n, client)
            nodes[c.id] = c
        return cls(nodes=nodes, roots=list(d.get("roots") or []),
                   on_image={k: list(v or []) for k, v in (d.get("on_image") or {}).items()})

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def __contains__(self, node: Any) -> bool:
        return str(node) in self.nodes

    def __getitem__(self, node: Any) -> Node:
        return self.nodes[str(node)]

    def get(self, node: Any) -> Optional[Node]:
        return self.nodes.get(str(node))

    def children(self, node: Any) -> List[Node]:
        """The child nodes of node, oldest first."""
        return [self.nodes[c] for c in self.nodes[str(node)].children if c in self.nodes]

    def path(self, node: Any) -> List[Node]:
        """The nodes from the root down to node (included)."""
        out: List[Node] = []
        cur = self.nodes.get(str(node))
        while cur is not None:
            out.append(cur)
            cur = self.nodes.get(cur.parent) if cur.parent else None
        out.reverse()
        return out

    def leaves(self) -> List[Node]:
        """Nodes with no children."""
        return [n for n in self.nodes.values() if not n.children]

    def lineage(self, sandbox: Optional[str] = None) -> "Tree":
        """The part of the tree one sandbox made or stands on (default: this tree's
        ``sandbox``): the nodes it made, the node it stands on, and their ancestors
        down to the image. The other nodes, other users' included, are left out;
        ``children`` of the nodes kept name only kept nodes."""
        sid = sandbox if sandbox is not None else self.sandbox
        if sid is None:
            raise ValueError("lineage of which sandbox? (sb.tree() knows; else pass sandbox=)")
        keep: Set[str] = set()
        starts = [n.id for n in self.nodes.values() if n.sandbox == sid or sid in n.sandboxes]
        if sid == self.sandbox and self.head:
            starts.append(self.head)
        for nid in starts:
            cur = self.nodes.get(nid)
            while cur is not None and cur.id not in keep:
                keep.add(cur.id)
                cur = self.nodes.get(cur.parent) if cur.parent else None
        nodes: Dict[str, Node] = {}
        for nid, n in self.nodes.items():
            if nid in keep:
                nodes[nid] = replace(n, children=[c for c in n.children if c in keep])
        on_image = {im: [x for x in sbs if x == sid] for im, sbs in self.on_image.items()}
        return Tree(nodes=nodes, roots=[r for r in self.roots if r in keep],
                    on_image={im: v for im, v in on_image.items() if v},
                    head=self.head if sid == self.sandbox else None, sandbox=sid)

    def render(self, all: bool = False) -> str:
        """The tree as indented text, one node a line, grouped by image, with each
        node's templates and what they hold alone. For ``sb.tree()`` only that
        sandbox's lineage (:meth:`lineage`) unless ``all``."""
        if self.sandbox is not None and not all:
            view = self.lineage()
            view.sandbox = None
            return view.render()
        lines: List[str] = []

        def walk(nid: str, prefix: str, last: bool) -> None:
            n = self.nodes[nid]
            desc = n.id
            if n.label:
                desc += " %r" % n.label
            t = n.templates
            if t is not None and t.processes:
                desc += " [%d process%s, %s private]" % (
                    t.processes, "" if t.processes == 1 else "es", _mib(t.private_dirty_bytes))
            if n.sandboxes:
                desc += " <- " + ", ".join(n.sandboxes)
            if self.head == n.id:
                desc += "  (head)"
            lines.append(prefix + ("`-- " if last else "|-- ") + desc)
            kids = [c for c in n.children if c in self.nodes]
            for i, c in enumerate(kids):
                walk(c, prefix + ("    " if last else "|   "), i == len(kids) - 1)

        images: List[str] = []
        for r in self.roots:
            im = self.nodes[r].image if r in self.nodes else ""
            if im not in images:
                images.append(im)
        for im in self.on_image:
            if im not in images:
                images.append(im)
        for im in images:
            head = "image %s" % im
            if self.on_image.get(im):
                head += " <- " + ", ".join(self.on_image[im])
            lines.append(head)
            roots = [r for r in self.roots if r in self.nodes and self.nodes[r].image == im]
            for i, r in enumerate(roots):
                walk(r, "", i == len(roots) - 1)
        return "\n".join(lines)


def _mib(n: int) -> str:
    if n >= 10 << 20:
        return "%d MiB" % (n >> 20)
    return "%.1f MiB" % (n / float(1 << 20))


def name_of(d: Dict[str, Any], key: str) -> Optional[str]:
    """A file name of an answer as ``os.listdir`` gives it: its bytes decoded as UTF-8,
    with bytes that are not UTF-8 kept as surrogates (``surrogateescape``, taken from
    the ``KEY_base64`` field the daemon adds for such names), so that the name can be
    passed back as it is."""
    b64 = d.get(key + "_base64")
    if b64:
        return base64.b64decode(b64).decode("utf-8", "surrogateescape")
    v = d.get(key)
    return v if isinstance(v, str) else None


@dataclass
class FileInfo:
    """A file, directory or other entry of a sandbox's filesystem.

    ``name``, ``path`` and ``link_target`` are str as ``os.listdir`` gives them: a
    name that is not UTF-8 has its bytes as surrogates (``path_bytes`` has them), and
    works as it is as a path of ``sb.files``.

    ``mode`` is the permission bits (setuid/setgid/sticky included) as an int
    (``oct(info.mode)``); ``permissions`` is how ls prints them; ``type`` is one of
    file, dir, symlink, fifo, socket, char, block.
    """

    name: str
    path: str
    type: str
    size: int = 0
    mode: int = 0
    permissions: str = ""
    uid: int = 0
    gid: int = 0
    mtime: Optional[_dt.datetime] = None
    link_target: Optional[str] = None
    mount_point: bool = False

    @classmethod
    def from_api(cls, d: Dict[str, Any]) -> "FileInfo":
        return cls(
            name=name_of(d, "name") or "",
            path=name_of(d, "path") or "",
            type=d.get("type") or "",
            size=int(d.get("size") or 0),
            mode=int(d.get("mode") or 0),
            permissions=d.get("permissions") or "",
            uid=int(d.get("uid") or 0),
            gid=int(d.get("gid") or 0),
            mtime=parse_time(d.get("mtime")),
            link_target=name_of(d, "link_target") or None,
            mount_point=bool(d.get("mount_point")),
        )

    @property
    def path_bytes(self) -> bytes:
        """The path's exact bytes (``os.fsencode`` of it)."""
        return self.path.encode("utf-8", "surrogateescape")

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"

    @property
    def is_file(self) -> bool:
        return self.type == "file"

    @property
    def is_symlink(self) -> bool:
        return self.type == "symlink"


class Listing(List[FileInfo]):
    """The entries of a directory (a list of FileInfo) with the listed ``path`` and
    ``truncated`` (the entry limit was reached)."""

    def __init__(self, entries: Iterable[FileInfo] = (), path: str = "",
                 truncated: bool = False) -> None:
        super().__init__(entries)
        self.path = path
        self.truncated = truncated

    @property
    def names(self) -> List[str]:
        return [e.name for e in self]
