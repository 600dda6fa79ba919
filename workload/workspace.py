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
    from deltabox import Result, Sandbox

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


def tarball(files: Dict[str, bytes], gz: bool = True) -> bytes:
    """A deterministic tar.gz (or plain tar) of files (sorted, root-owned, mtime 0)."""
    buf = io.BytesIO()

    def fill(out: IO[bytes]) -> None:
        with tarfile.open(fileobj=out, mode="w") as t:
            for rel in sorted(files):
                data = files[rel]
                ti = tarfile.TarInfo(rel)
                ti.size = len(data)
                ti.mode = 0o644
                ti.mtime = 0
                t.addfile(ti, io.BytesIO(data))
    if not gz:
        fill(buf)
        return buf.getvalue()
    # mtime=0 in the gzip header too, so equal files give equal bytes.
    import gzip
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as g:
        fill(cast(IO[bytes], g))
    return buf.getvalue()


WORKSPACE = "/workspace"
UPLOAD_PART = 32 << 20


def upload_install_command(files: Dict[str, bytes], message: str, repo: str = REPO) -> dict:
    """The install of a workload whose tree holds ``repo/`` (a git repository whose
    objects are packed, without its index) and ``env/``, as the django workload's: a
    plain tar uploaded once to /tmp (PUT files: 75 MB as base64 on an exec's stdin
    would cost seconds), then one command that unpacks it into /workspace, rebuilds
    the index and commits the task's files on top of the pristine commit, so ``git
    diff`` shows exactly what an agent changed. ``upload`` in the record names the
    tarball: :func:`install` and the replays put it there first."""
    if os.path.dirname(repo) != WORKSPACE:
        raise ValueError("the repository must be %s/NAME, not %s" % (WORKSPACE, repo))
    blob = tarball(files, gz=False)
    digest = hashlib.sha256(blob).hexdigest()
    up = "/tmp/deltabox-workload-%s.tar" % digest[:16]
    r = shlex.quote(repo)
    git = "git " + " ".join(shlex.quote(a) for a in GIT_USER)
    script = " && ".join([
        "set -e",
        "test \"$(sha256sum < %s | cut -c1-64)\" = %s" % (up, digest),
        "rm -rf %s %s/env && mkdir -p %s" % (r, WORKSPACE, WORKSPACE),
        "tar -xf %s -C %s --no-same-owner" % (up, WORKSPACE),
        "cd %s" % r,
        "mkdir -p .git/refs/heads .git/refs/tags .git/objects/info",  # a tarball holds no empty directory
        "git config core.fileMode false",  # the tarball's modes are 0644 (as jsonlib's)
        "git read-tree HEAD",
        "git add -A",
        "%s commit -q --allow-empty -m %s" % (git, shlex.quote(message)),
        "git rev-parse HEAD",
    ])
    return {"kind": "exec", "argv": ["bash", "-c", script], "upload": {"path": up, "sha256": digest},
            "blob": blob, "tar_sha256": digest, "files": len(files)}


def install_command(files: Dict[str, bytes], message: str, repo: str = REPO,
                    workload: str = "jsonlib") -> dict:
    """The one command that installs files as a git repository at repo: a dict with
    ``argv`` and ``stdin`` for ``sb.run`` (and the trajectory's record). The django
    workload's is :func:`upload_install_command`'s."""
    if workload == "django":
        return upload_install_command(files, message, repo)
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


def install(sb: "Sandbox", files: Dict[str, bytes], message: str, repo: str = REPO,
            workload: str = "jsonlib") -> dict:
    """Installs files into the sandbox as a git repository at repo (replacing what is
    there). Returns the command's record, with the commit id (and without the
    uploaded tarball's bytes)."""
    cmd = install_command(files, message, repo, workload)
    r = run_install(sb, cmd)
    if r.exit_code != 0:
        raise RuntimeError("installing the workload failed (exit %d): %s%s"
                           % (r.exit_code, r.stdout, r.stderr))
    rec = {k: v for k, v in cmd.items() if k != "blob"}
    rec["commit"] = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    return rec


def run_install(sb: "Sandbox", cmd: dict, uploaded: Optional[set] = None) -> "Result":
    """Runs an install command (install_command's dict, ``blob`` regenerated for an
    ``upload`` one): the upload first unless ``uploaded`` (a set kept per sandbox)
    says it is there, then the command."""
    up = cmd.get("upload")
    if up:
        if uploaded is None or up["sha256"] not in uploaded:
            if cmd.get("blob") is None:
                raise RuntimeError("install: the tarball for %s was not regenerated" % up["path"])
            blob = cmd["blob"]
            # The daemon takes at most 64 MiB per write (files.DefaultMaxWrite).
            parts = ["%s.part%03d" % (up["path"], i) for i in range(0, max(1, -(-len(blob) // UPLOAD_PART)))]
            for i, part in enumerate(parts):
                sb.files.write(part, blob[i * UPLOAD_PART:(i + 1) * UPLOAD_PART])
            q = " ".join(shlex.quote(p) for p in parts)
            dest = shlex.quote(up["path"])
            r = sb.run(["bash", "-c", "cat %s > %s.tmp && mv %s.tmp %s && rm -f %s" % (q, dest, dest, dest, q)],
                       timeout=300)
            if r.exit_code != 0:
                raise RuntimeError("install: joining the uploaded parts failed: %s" % r.stderr[-300:])
            if uploaded is not None:
                uploaded.add(up["sha256"])
        return sb.run(cmd["argv"], timeout=600)
    return sb.run(cmd["argv"], stdin=cmd["stdin"], timeout=600)
