"""Client: one daemon, reached on its unix socket."""

import threading
from typing import Any, Dict, List, Optional

from ._http import Transport, q, socket_path_from_env
from .models import Checkpoint, Tree
from .sandbox import Sandbox


class Client:
    """A connection to a DeltaBox daemon on its unix socket.

    Args:
        socket_path: the daemon's socket; default $DELTABOX_SOCKET, else
            /run/deltabox/deltabox.sock.
        timeout: seconds that bound every call: the wait for an answer, and the
            command's timeout of a ``run`` that gives none (the daemon interrupts the
            command then; the client waits a minute more for its answer). None: no
            bound (``run`` then has the daemon's default timeout, 10 minutes).

    Thread-safe: concurrent calls use separate kept-alive connections.
    """

    def __init__(self, socket_path: Optional[str] = None, timeout: Optional[float] = 600.0) -> None:
        self.socket_path = socket_path_from_env(socket_path)
        self._t = Transport(self.socket_path, timeout=timeout)

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

    def images(self) -> List[Dict[str, Any]]:
        """The images sandboxes can start from (name, created, source, bytes)."""
        return list(self._t.json("GET", "/images").get("images") or [])

    def sync(self) -> None:
        """Returns once every change made so far (checkpoints included) is durable."""
        self._t.json("POST", "/sync")

    # ---- sandboxes ----

    def create(self, **kwargs: Any) -> Sandbox:
        """Sandbox.create(..., client=self)."""
        return Sandbox.create(client=self, **kwargs)

    def sandbox(self, id: str) -> Sandbox:
        """Sandbox.connect(id, client=self)."""
        return Sandbox.connect(id, client=self)

    def sandboxes(self) -> List[Sandbox]:
        """Every sandbox of the daemon."""
        d = self._t.json("GET", "/sandboxes")
        return [Sandbox(s["id"], self, s) for s in (d.get("sandboxes") or [])]

    # ---- the tree ----

    def tree(self) -> Tree:
        """The whole snapshot tree."""
        return Tree.from_api(self._t.json("GET", "/tree"), self)

    def checkpoint(self, id: str) -> Checkpoint:
        """One node of the tree (NotFound if none)."""
        return Checkpoint.from_api(self._t.json("GET", "/nodes/" + q(id)), self)

    node = checkpoint

    def remove_checkpoint(self, id: str) -> List[str]:
        """Removes a node and its subtree; returns the removed ids."""
        return list(self._t.json("DELETE", "/nodes/" + q(id)).get("removed") or [])


_default = None  # type: Optional[Client]
_default_lock = threading.Lock()


def default_client() -> Client:
    """The client used when none is given: $DELTABOX_SOCKET or the default socket,
    read on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Client()
        return _default

