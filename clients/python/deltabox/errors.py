"""Exceptions raised by the DeltaBox client.

Every error the daemon answers becomes a :class:`DeltaBoxError` (or one of its
subclasses) that carries the daemon's error ``code`` (``not_found``, ``conflict``,
``invalid``, ``unavailable``, ``internal``), its ``message`` (which always says what to
do) and the HTTP ``status``.
"""

from typing import Any, Optional


class DeltaBoxError(Exception):
    """An error answered by the daemon, or met on the way to it.

    Attributes:
        code: the daemon's error code (``not_found``, ``conflict``, ``invalid``,
            ``unavailable``, ``internal``), or a client-side one (``unreachable``,
            ``timeout``, ``command_failed``, ``protocol``).
        message: what went wrong and what to do, as the daemon worded it.
        status: the HTTP status of the answer, or None when there was no answer.
    """

    def __init__(self, code: str, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return "%s(code=%r, message=%r, status=%r)" % (
            type(self).__name__, self.code, self.message, self.status)


class InvalidRequest(DeltaBoxError):
    """400 ``invalid``: malformed request, bad id, path or argument."""


class TooLarge(InvalidRequest):
    """413 ``too_large``: a request body over the daemon's limit (16 MiB: an exec's
    stdin included); send files with ``sandbox.files.write`` instead."""


class Forbidden(DeltaBoxError):
    """403 ``forbidden``: a route that reads a path on the daemon's host (an image
    import) asked over the network with an API key; run it on the host instead."""


class NotFound(DeltaBoxError):
    """404 ``not_found``: unknown sandbox, checkpoint (node), session, file or route."""


class Conflict(DeltaBoxError):
    """409 ``conflict``: busy (a command still runs when a checkpoint's or restore's
    ``wait`` is over), id already used, a checkpoint a sandbox stands on, a session call
    already running."""


class MemoryWarning(UserWarning):
    """Warned (``warnings.warn``) by a checkpoint or restore whose answer has
    ``warnings``: the process templates of the sandbox's checkpoints hold over half of
    its memory limit, and a process that writes more memory may be OOM-killed. Remove
    the nodes you no longer need (``ckpt.remove()``), or give the sandbox more memory
    (``memory_mb``). The text is also in ``ckpt.warnings``."""


class Unavailable(DeltaBoxError):
    """503 ``unavailable``: the daemon's store is not set up (run scripts/setup.sh)."""


class DiskQuotaExceeded(DeltaBoxError):
    """507 ``insufficient_storage``: the sandbox's writable layer went over its quota
    (``disk_mb``), or the store filled up: its processes were killed, and commands,
    file writes and checkpoints are refused until files are deleted
    (``sb.files.remove``) or a checkpoint restored."""


class TemplateBudgetExceeded(DeltaBoxError):
    """507 ``template_budget``: a checkpoint waited for room under a template memory
    budget (the sandbox's ``template_budget_mb``, or the daemon's total) and found
    none; nothing changed. The message names the budget, what the templates hold and
    the nodes that hold most: remove nodes you will not restore (``ckpt.remove()``), or
    create the sandbox with a larger ``template_budget_mb``."""


class DaemonUnreachable(DeltaBoxError, ConnectionError):
    """The daemon's socket is missing, refuses connections, cannot be opened, or the
    daemon hung up before answering."""

    def __init__(self, message: str) -> None:
        super().__init__("unreachable", message, None)


class RequestTimeout(DeltaBoxError, TimeoutError):
    """The daemon did not answer within the client's timeout. (A command's own
    ``timeout=`` is not this: it returns a Result with ``timed_out`` set.)"""

    def __init__(self, message: str) -> None:
        super().__init__("timeout", message, None)


class CommandError(DeltaBoxError):
    """Raised by :meth:`Result.check` when a command exited non-zero or timed out.

    ``result`` is the :class:`~deltabox.Result`; ``exit_code``, ``stdout`` and
    ``stderr`` are copied from it.
    """

    def __init__(self, result: Any, argv: Any = None) -> None:
        self.result = result
        self.argv = argv
        self.exit_code = result.exit_code
        self.stdout = result.stdout
        self.stderr = result.stderr
        what = "command %r" % (argv,) if argv is not None else "command"
        if result.timed_out:
            msg = "%s timed out" % what
        else:
            msg = "%s exited with status %d" % (what, result.exit_code)
        tail = (result.stderr or result.stdout or "").strip()
        if tail:
            if len(tail) > 2000:
                tail = "..." + tail[-2000:]
            msg += ":\n" + tail
        oom = getattr(result, "oom", None)
        if oom:
            msg += "\n" + oom
        super().__init__("command_failed", msg, None)


_BY_CODE = {
    "invalid": InvalidRequest,
    "too_large": TooLarge,
    "forbidden": Forbidden,
    "not_found": NotFound,
    "conflict": Conflict,
    "unavailable": Unavailable,
    "insufficient_storage": DiskQuotaExceeded,
    "template_budget": TemplateBudgetExceeded,
}

_CODE_BY_STATUS = {
    400: "invalid",
    403: "forbidden",
    404: "not_found",
    409: "conflict",
    413: "too_large",
    503: "unavailable",
    507: "insufficient_storage",
    500: "internal",
}

_STATUS_BY_CODE = {v: k for k, v in _CODE_BY_STATUS.items()}
_STATUS_BY_CODE["template_budget"] = 507


def from_answer(status: Optional[int], code: Optional[str], message: str) -> DeltaBoxError:
    """The exception for an error answer (status and/or code known)."""
    if not code:
        code = _CODE_BY_STATUS.get(status or 0, "internal")
    if status is None:
        status = _STATUS_BY_CODE.get(code, 500)
    cls = _BY_CODE.get(code, DeltaBoxError)
    return cls(code, message, status)
