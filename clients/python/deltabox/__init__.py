"""DeltaBox Python client: sandboxes for LLM agents whose files and processes
checkpoint and roll back in about a millisecond.

Talks to the DeltaBox daemon over its unix socket (HTTP/1.1 + JSON); standard library
only, Python 3.9+.

    from deltabox import Sandbox

    with Sandbox.create(image="default", workdir="/workspace") as sb:
        sb.files.write("hello.py", "print('hi')\\n")
        r = sb.run("python3 hello.py", timeout=30)
        print(r.exit_code, r.stdout)
        ckpt = sb.checkpoint(label="clean")  # a CheckpointResult; ckpt.node is the Node
        sb.run("rm hello.py")
        sb.restore(ckpt)                  # hello.py is back
        for child in ckpt.fork(count=2):  # two more sandboxes on that node, processes too
            with child:
                child.run("python3 hello.py").check()

The daemon is $DELTABOX_HOST (a TCP listener, with the key $DELTABOX_API_KEY), else its
socket $DELTABOX_SOCKET, else /run/deltabox/deltabox.sock; or pass
``Client(socket_path=...)`` as ``client=``. For asyncio programs, :mod:`deltabox.aio`
has the same API with coroutines (``AsyncSandbox``, ``AsyncClient``).

The modules depend on each other in one direction only: errors, _http, models (the
values), client (the daemon and its tree), sandbox (sandboxes, CheckpointResult), aio
(asyncio, with its transport _aio_http).
"""

from ._http import DEFAULT_SOCKET
from .client import Client, default_client
from .client import Images
from .errors import (CommandError, Conflict, DaemonUnreachable, DeltaBoxError, InvalidRequest,
                     MemoryWarning, NotFound, Forbidden, RequestTimeout, TooLarge, Unavailable,
                     DiskQuotaExceeded, TemplateBudgetExceeded)
from .models import (Checkpoint, FileInfo, Listing, Node, NodeClient, OpMemory, RestoreResult,
                     Result, ProcessImage, SandboxMemory, Templates, Tree)
from .sandbox import DEFAULT_WAIT, CheckpointResult, Files, ForkBranch, NodeRef, Session, Sessions, Sandbox

__version__ = "0.5.0"

__all__ = [
    "DEFAULT_SOCKET",
    "DEFAULT_WAIT",
    "Checkpoint",
    "CheckpointResult",
    "ForkBranch",
    "Client",
    "CommandError",
    "Conflict",
    "DaemonUnreachable",
    "DeltaBoxError",
    "FileInfo",
    "Files",
    "Images",
    "InvalidRequest",
    "Listing",
    "MemoryWarning",
    "Node",
    "NodeClient",
    "NodeRef",
    "NotFound",
    "Forbidden",
    "OpMemory",
    "RequestTimeout",
    "RestoreResult",
    "Result",
    "Sandbox",
    "SandboxMemory",
    "Session",
    "Sessions",
    "ProcessImage",
    "Templates",
    "TooLarge",
    "Tree",
    "Unavailable",
    "DiskQuotaExceeded",
    "TemplateBudgetExceeded",
    "default_client",
    "__version__",
]
