"""The workload's source tree, and putting it into a sandbox's workspace.

``scripts/setup.sh`` (step_workload) prepares the tree once on the host, under
``/var/lib/deltabox/workloads/NAME/`` (``tree/`` and ``manifest.json``, see
``workload/prepare.py``). :func:`install` copies a version of it (pristine, or with a
task's bugs) into a sandbox as a git repository at ``/workspace/repo``, in one command:
a tar.gz stream, base64 on the command's stdin (exec's stdin is text), then
``git init`` and one commit, so ``git diff`` shows exactly what an agent changed.
"""

import base64
import hashlib
import io
import json
import os
import shlex
import tarfile
from typing import IO, TYPE_CHECKING, Dict, List, Optional, cast

if TYPE_CHECKING:  # the client is imported by the examples (clients/python on sys.path)
    from deltabox import Sandbox

DEFAULT_BASE = "/var/lib/deltabox/workloads"
REPO = "/workspace/repo"
GIT_USER = ["-c", "user.name=DeltaBox workload", "-c", "user.email=workload@deltabox.invalid"]


class WorkloadMissing(RuntimeError):
    pass


class Workload:
    """A prepared workload: its manifest and its files (relative path -> bytes)."""

    def __init__(self, name: str, base: str, manifest: dict, files: Dict[str, bytes]) -> None:
        self.name = name
        self.base = base
        self.manifest = manifest
        self.files = files

    @classmethod
    def load(cls, name: str = "jsonlib", base: Optional[str] = None) -> "Workload":
        """Reads ``BASE/NAME`` (BASE: ``$DELTABOX_WORKLOADS``, else
        /var/lib/deltabox/workloads) and checks every file against the manifest."""
        base = base or os.environ.get("DELTABOX_WORKLOADS") or DEFAULT_BASE
        d = os.path.join(base, name)
        mpath = os.path.join(d, "manifest.json")
        if not os.path.isfile(mpath):
            raise WorkloadMissing("workload %r is not prepared: no %s (run scripts/setup.sh, "
                                  "whose step_workload builds it)" % (name, mpath))
        with open(mpath) as f:
            manifest = json.load(f)
        files = {}
        for rel, digest in manifest["files"].items():
            with open(os.path.join(d, "tree", rel), "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != digest:
                raise WorkloadMissing("%s/tree/%s does not match its manifest (remove %s and "
                                      "re-run scripts/setup.sh)" % (d, rel, d))
            files[rel] = data
        return cls(name, base, manifest, files)

    @property
    def test_modules(self) -> List[str]:
        return list(self.manifest["test_modules"])

    def text(self, rel: str) -> str:
        return self.files[rel].decode("utf-8")


def tarball(files: Dict[str, bytes]) -> bytes:
    """A deterministic tar.gz of files (sorted, root-owned, mtime 0)."""
    buf = io.BytesIO()
    # mtime=0 in the gzip header too, so equal files give equal bytes.
    import gzip
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        with tarfile.open(fileobj=cast(IO[bytes], gz), mode="w") as t:
            for rel in sorted(files):
                data = files[rel]
                ti = tarfile.TarInfo(rel)
                ti.size = len(data)
                ti.mode = 0o644
                ti.mtime = 0
                t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def install_command(files: Dict[str, bytes], message: str, repo: str = REPO) -> dict:
    """The one command that installs files as a git repository at repo: a dict with
    ``argv`` and ``stdin`` for ``sb.run`` (and the trajectory's record)."""
    files = dict(files)
    files.setdefault(".gitignore", b"__pycache__/\n*.pyc\n")
    blob = tarball(files)
    r = shlex.quote(repo)
    git = "git " + " ".join(shlex.quote(a) for a in GIT_USER)
    script = " && ".join([
        "set -e",
        "rm -rf %s && mkdir -p %s" % (r, r),
        "base64 -d | tar -xzf - -C %s" % r,
        # Importable from anywhere in the sandbox, as `pip install -e` would make it
        # (the test suite's subprocesses run python -I, which ignores PYTHONPATH).
        "printf '%%s\\n' %s > \"$(python3 -c 'import site; print(site.getsitepackages()[0])')/deltabox-workload.pth\"" % r,
        "cd %s" % r,
        "git init -q -b main",
        "git add -A",
        "%s commit -q -m %s" % (git, shlex.quote(message)),
        "git rev-parse HEAD",
    ])
    return {"kind": "exec", "argv": ["bash", "-c", script],
            "stdin": base64.b64encode(blob).decode("ascii"),
            "tar_sha256": hashlib.sha256(blob).hexdigest(), "files": len(files)}


def install(sb: "Sandbox", files: Dict[str, bytes], message: str, repo: str = REPO) -> dict:
    """Installs files into the sandbox as a git repository at repo (replacing what is
    there). Returns the command's record, with the commit id."""
    cmd = install_command(files, message, repo)
    r = sb.run(cmd["argv"], stdin=cmd["stdin"], timeout=120)
    if r.exit_code != 0:
        raise RuntimeError("installing the workload failed (exit %d): %s%s"
                           % (r.exit_code, r.stdout, r.stderr))
    rec = dict(cmd)
    rec["commit"] = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    return rec
