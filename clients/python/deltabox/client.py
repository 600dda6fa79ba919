"""Client: one daemon, reached on its unix socket, and what is the daemon's as a whole
(health, images, the snapshot tree and its nodes).

Sandboxes are made with ``Sandbox.create(client=...)`` (sandbox.py), which imports this
module; this module imports neither sandbox.py nor aio.py, so the modules form a chain
(errors, _http, models, client, sandbox, aio) with no loop."""

import os
import shutil
import threading
from typing import Any, Callable, Dict, List, Optional

from ._http import Transport, q, remote_from_env, socket_path_from_env
from .errors import from_answer
from .models import Node, Tree

# on_progress(done, total) of an import: bytes of the source read so far, and its size
# (which may grow once the source's kind is known).
OnProgress = Callable[[int, int], None]


class Images:
    """``client.images``: the images sandboxes start from. Calling it lists them
    (``client.images()``, as before 0.3.0)."""

    def __init__(self, client: "Client") -> None:
        self._c = client

    def __call__(self) -> List[Dict[str, Any]]:
        return self.list()

    def list(self) -> List[Dict[str, Any]]:
        """The images (name, created, source, bytes)."""
        return list(self._c._t.json("GET", "/images").get("images") or [])

    def import_(self, name: str, source: str, allow_setuid: bool = False,
                max_bytes: Optional[int] = None, max_entries: Optional[int] = None,
                on_progress: Optional[OnProgress] = None) -> Dict[str, Any]:
        """Imports an image and returns it (name, created, source, bytes).

        ``source`` is an absolute path **on the daemon's host**: a rootfs directory, a
        tar of one (plain or gzip), a ``docker save`` tarball, or an OCI image layout
        (tarball or directory). ``on_progress(done, total)`` is called as the source is
        read (bytes). Refused archives (an entry escaping the image, a device, setuid
        files without ``allow_setuid``, more than ``max_bytes`` or ``max_entries``)
        raise InvalidRequest naming the entry; a name in use raises Conflict. Nothing is
        left in the store by a failed import. (``import`` is a keyword: hence the
        underscore.)"""
        body: Dict[str, Any] = {"name": name, "source": source}
        if allow_setuid:
            body["allow_setuid"] = True
        if max_bytes:
            body["max_bytes"] = int(max_bytes)
        if max_entries:
            body["max_entries"] = int(max_entries)
        # Always the NDJSON answer: its progress lines keep the connection alive, so
        # the client's timeout bounds silence, not the length of a large import.
        events = self._c._t.stream("POST", "/images?progress=1", body)
        try:
            for ev in events:
                if "error" in ev:
                    err = ev.get("error") or {}
                    raise from_answer(None, err.get("code"), err.get("message") or "the import failed")
                if "image" in ev:
                    return dict(ev["image"])
                if on_progress is not None and "done" in ev:
                    on_progress(int(ev.get("done") or 0), int(ev.get("total") or 0))
        finally:
            events.close()
        raise from_answer(500, "internal", "the daemon ended the import's stream without an answer")

    def remove(self, name: str) -> None:
        """Removes an image; Conflict if a sandbox or a node uses it (named)."""
        self._c._t.json("DELETE", "/images/" + q(name))


class Client:
    """A connection to a DeltaBox daemon on its unix socket.

    Args:
        socket_path: the daemon's socket; default $DELTABOX_SOCKET, else
            /run/deltabox/deltabox.sock.
        host: a daemon's TCP listener (``deltabox daemon --listen``), HOST:PORT or
            http(s)://HOST:PORT; default $DELTABOX_HOST unless socket_path is given.
        api_key: the key for host (``deltabox key create NAME``); default
            $DELTABOX_API_KEY.
        timeout: seconds that bound every call: the wait for an answer, and the
            command's timeout of a ``run`` that gives none (the daemon interrupts the
            command then; the client waits a minute more for its answer). None: no
            bound (``run`` then has the daemon's default timeout, 10 minutes).

    Thread-safe: concurrent calls use separate kept-alive connections.
    """

    def __init__(self, socket_path: Optional[str] = None, timeout: Optional[float] = 600.0,
                 host: Optional[str] = None, api_key: Optional[str] = None) -> None:
        remote = remote_from_env(host, api_key) if socket_path is None or host else None
        self.socket_path = socket_path_from_env(socket_path)
        self._t = Transport(self.socket_path, timeout=timeout, remote=remote)
        if remote is not None:
            self.socket_path = remote.url
        #: ``client.images()`` lists the images; ``client.images.import_(name,
        #: source, on_progress=...)`` imports one, ``.remove(name)`` removes one.
        self.images = Images(self)

    def __repr__(self) -> str:
        return "Client(socket_path=%r)" % self.socket_path

    def close(self) -> None:
        """Closes idle connections. The client stays usable."""
        self._t.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- daemon ----

    def health(self) -> Dict[str, Any]:
        """``{"ok": True, "api": "v1"}``; DaemonUnreachable if no daemon answers."""
        return dict(self._t.json("GET", "/health"))

    def sync(self) -> None:
        """Returns once every change made so far (checkpoints included) is durable."""
        self._t.json("POST", "/sync")

    # ---- the tree ----

    def tree(self) -> Tree:
        """The whole snapshot tree."""
        return Tree.from_api(self._t.json("GET", "/tree"), self)

    def node(self, id: str) -> Node:
        """One node of the tree as the daemon sees it now, with its ``templates``
        (NotFound if none)."""
        return Node.from_api(self._t.json("GET", "/nodes/" + q(id)), self)

    #: ``client.checkpoint(id)``: :meth:`node` (its name before 0.4.0).
    checkpoint = node

    def remove_checkpoint(self, id: str) -> List[str]:
        """Removes a node and its subtree; returns the removed ids."""
        return list(self._t.json("DELETE", "/nodes/" + q(id)).get("removed") or [])

    def pin_checkpoint(self, id: str, pinned: bool = True) -> Node:
        """Pins (or unpins) a node: its templates are never evicted over the template
        budget (:meth:`Node.pin`)."""
        return Node.from_api(self._t.json("POST", "/nodes/%s/pin" % q(id),
                                          {"pinned": bool(pinned)}), self)

    def prepare_checkpoint(self, id: str, sandbox: Optional[str] = None) -> Node:
        """Makes sure ``sandbox`` (None: the node's own) holds a spare of node ``id``
        (:meth:`Node.prepare`); returns the node once it does."""
        body: Dict[str, Any] = {} if sandbox is None else {"sandbox": str(sandbox)}
        return Node.from_api(self._t.json("POST", "/nodes/%s/prepare" % q(id), body), self)

    # ---- nodes that travel ----

    def export_node(self, id: str, path: str) -> List[str]:
        """Writes node ``id``'s archive (its layer chain, metadata and durable process
        image; docs/API.md, Nodes that travel) to the file ``path`` on this machine:
        written next to it and renamed once complete, so a cut export leaves no file.
        Returns the daemon's warnings (e.g. no complete process image yet)."""
        tmp = "%s.part-%d" % (path, os.getpid())
        conn, resp = self._t.open("GET", "/nodes/%s/export" % q(id), timeout=None)
        try:
            with open(tmp, "wb") as f:
                shutil.copyfileobj(resp, f, 1 << 20)
                f.flush()
                os.fsync(f.fileno())
            warnings = list(resp.headers.get_all("Deltabox-Warning") or [])
        except BaseException:
            conn.close()
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._t._release(conn, resp)
        os.replace(tmp, path)
        return warnings

    def import_node(self, path: str, max_bytes: Optional[int] = None,
                    max_entries: Optional[int] = None) -> Dict[str, Any]:
        """Imports a node archive (``Node.export``, ``deltabox export``) from the file
        ``path`` on this machine and returns the daemon's answer: ``node`` (the node
        here, to restore or fork from), ``nodes`` (the chain, ``from`` its id on the
        exporting host, ``reused`` if this host had it), ``process_image``,
        ``warnings``. A damaged, truncated or hostile archive raises InvalidRequest
        and leaves nothing behind; an image this host lacks raises NotFound.

        The node's processes do not come back on this host (a durable process image
        restores only into the sandbox that made it): a restore of the imported node
        gives its files, and its sessions start afresh."""
        query: Dict[str, Any] = {}
        if max_bytes:
            query["max_bytes"] = int(max_bytes)
        if max_entries:
            query["max_entries"] = int(max_entries)
        with open(path, "rb") as f:
            conn, resp = self._t.open("POST", "/nodes/import", query or None, f,
                                      "application/x-tar", timeout=None)
            try:
                data = resp.read()
            except BaseException:
                conn.close()
                raise
        self._t._release(conn, resp)
        import json
        return dict(json.loads(data))


_default: Optional[Client] = None
_default_lock = threading.Lock()


def default_client() -> Client:
    """The client used when none is given: $DELTABOX_HOST (with $DELTABOX_API_KEY), else
    $DELTABOX_SOCKET or the default socket, read on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Client()
        return _default

