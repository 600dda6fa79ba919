"""Builds the django workload's tree (run by scripts/setup.sh, step_workload_django).

The workload is Django's own release, as Debian ships its source (python-django's
orig tarball: the sdist, with Django's whole test suite, ``tests/runtests.py``), and the
Python environment its tests need, from Debian's binary packages (python3-asgiref,
python3-sqlparse: Django's two requirements; the suite runs on sqlite, which Python
brings), laid out as a SWE-bench image holds a task: the repository and its
environment, both in the workspace:

    repo/               Django's source tree, a git repository of one commit (its
                        objects packed; the index is left out: it holds stat data, the
                        install rebuilds it with ``git read-tree HEAD``)
    env/site-packages/  the packages' /usr/lib/python3/dist-packages trees
    env/licenses/       their Debian copyright files

    python3 workload/prepare_django.py --orig TARBALL --deb DEB [--deb DEB ...] \\
        --dest DIR [--meta KEY=VALUE ...]

Bytecode is compiled here (``compileall --invalidation-mode checked-hash``, by the
interpreter that runs this script: the image's Python minor version) for django/ and
env/, as a SWE-bench environment holds it: the tests run with PYTHONDONTWRITEBYTECODE=1
and a changed source file's bytecode no longer matches its hash, so it is compiled
again in memory, never used stale. Nothing is rewritten: the tests run as Django's contributors run them
(``python3 tests/runtests.py --settings=test_sqlite``), with ``PYTHONPATH`` naming the
repository and env/site-packages. Writes DIR/tree/... and, last, DIR/manifest.json (files
with sha256, sources, sizes, how to run the tests). Standard library only.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile

NAME = "django"
# Django 4.2's own requirements (setup.cfg install_requires), from Debian.
ENV_PACKAGES = ("python3-asgiref", "python3-sqlparse")


README = """# django workload

Django's own source and test suite, and the Python environment its tests need, made by
scripts/setup.sh (step_workload_django) with workload/prepare_django.py. Nothing here was
written for DeltaBox and nothing in Django is rewritten.

- repo/: {orig}, sha256 {orig_sha256}: Debian's python-django source package
  (`apt-get source --download-only`, trixie), unpacked as it is (it is Django's PyPI
  sdist: the code, docs/, tests/ with runtests.py), made a git repository of one commit
  ({commit}, fixed author and date), its objects packed; bytecode of django/ compiled
  with checked hashes.
- env/site-packages/: Django 4.2's requirements from Debian bookworm (the image's Python):
{env}
  their copyright files in env/licenses/.

Every file's sha256 is in manifest.json; workload/workspace.py checks them at each load.

Size: {files} files, {mb:.1f} MB. The repository: {repo_files} files, {repo_mb:.1f} MB
(source {src_files} files, {src_mb:.1f} MB; .git {git_mb:.1f} MB; bytecode {pyc_files}
files, {pyc_mb:.1f} MB); the environment: {env_files} files, {env_mb:.2f} MB.

Run the tests (in the workspace, as the bench does):

    cd /workspace/repo
    PYTHONPATH=/workspace/repo:/workspace/env/site-packages PYTHONDONTWRITEBYTECODE=1 \\
        python3 tests/runtests.py --settings=test_sqlite --parallel=1 utils_tests.test_text
"""


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):
            h.update(chunk)
    return h.hexdigest()


def extract_orig(tarball, dest):
    """The orig tarball's single top directory's contents into dest; no link or device
    may leave it."""
    with tarfile.open(tarball) as t:
        members = t.getmembers()
        tops = {m.name.split("/", 1)[0] for m in members}
        if len(tops) != 1:
            raise SystemExit("prepare_django: %s has %d top directories, want 1" % (tarball, len(tops)))
        top = tops.pop()
        for m in members:
            if m.name == top:
                continue
            rel = m.name.split("/", 1)[1]
            if rel.startswith("/") or ".." in rel.split("/"):
                raise SystemExit("prepare_django: unsafe member %r" % m.name)
            out = os.path.join(dest, rel)
            if m.isdir():
                os.makedirs(out, exist_ok=True)
            elif m.isfile():
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with t.extractfile(m) as src, open(out, "wb") as f:  # type: ignore[union-attr]
                    f.write(src.read())
                os.chmod(out, 0o755 if m.mode & 0o100 else 0o644)
            else:
                raise SystemExit("prepare_django: %s: %r is not a file or directory" % (tarball, m.name))
    return top


def deb_field(deb, field):
    return subprocess.check_output(["dpkg-deb", "-f", deb, field], text=True).strip()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--orig", required=True, help="python-django's orig tarball")
    ap.add_argument("--deb", action="append", default=[], help="an environment package (.deb)")
    ap.add_argument("--dest", required=True, help="output directory (must not exist)")
    ap.add_argument("--meta", action="append", default=[], help="KEY=VALUE for the manifest")
    a = ap.parse_args(argv)
    meta = dict(kv.split("=", 1) for kv in a.meta)
    if os.path.exists(a.dest):
        raise SystemExit("prepare_django: %s exists" % a.dest)
    tree = os.path.join(a.dest, "tree")
    repo = os.path.join(tree, "repo")
    os.makedirs(repo)
    top = extract_orig(a.orig, repo)
    for f in ("tests/runtests.py", "tests/test_sqlite.py", "django/__init__.py"):
        if not os.path.isfile(os.path.join(repo, f)):
            raise SystemExit("prepare_django: %s lacks %s: not Django's source" % (a.orig, f))

    site = os.path.join(tree, "env", "site-packages")
    lic = os.path.join(tree, "env", "licenses")
    os.makedirs(site)
    os.makedirs(lic)
    env = {}
    for deb in a.deb:
        pkg = deb_field(deb, "Package")
        if pkg not in ENV_PACKAGES:
            raise SystemExit("prepare_django: %s is %s, not one of %s" % (deb, pkg, ", ".join(ENV_PACKAGES)))
        with tempfile.TemporaryDirectory() as x:
            subprocess.check_call(["dpkg-deb", "-x", deb, x])
            dp = os.path.join(x, "usr", "lib", "python3", "dist-packages")
            for root, _, names in os.walk(dp):
                for n in names:
                    src = os.path.join(root, n)
                    out = os.path.join(site, os.path.relpath(src, dp))
                    os.makedirs(os.path.dirname(out), exist_ok=True)
                    with open(src, "rb") as s, open(out, "wb") as d:
                        d.write(s.read())
            with open(os.path.join(x, "usr", "share", "doc", pkg, "copyright"), "rb") as s, \
                    open(os.path.join(lic, pkg), "wb") as d:
                d.write(s.read())
        env[pkg] = {"version": deb_field(deb, "Version"), "deb": os.path.basename(deb), "deb_sha256": sha256(deb)}
    missing = [p for p in ENV_PACKAGES if p not in env]
    if missing:
        raise SystemExit("prepare_django: no .deb for %s" % ", ".join(missing))

    # A repository of one commit, fixed author and date, so its id depends on the files alone.
    genv = dict(os.environ, GIT_AUTHOR_NAME="Django (Debian python-django orig tarball)",
                GIT_AUTHOR_EMAIL="workload@deltabox.invalid", GIT_AUTHOR_DATE="2000-01-01T00:00:00Z",
                GIT_COMMITTER_NAME="DeltaBox workload", GIT_COMMITTER_EMAIL="workload@deltabox.invalid",
                GIT_COMMITTER_DATE="2000-01-01T00:00:00Z", GIT_CONFIG_GLOBAL="/dev/null", GIT_CONFIG_NOSYSTEM="1")

    def git(*args):
        # gc.auto=0: an automatic gc after the commit would race the repack (two packs).
        subprocess.check_call(["git", "-C", repo, "-c", "gc.auto=0"] + list(args), env=genv,
                              stdout=subprocess.DEVNULL)
    git("init", "-q", "-b", "main")
    git("add", "-A")
    git("commit", "-q", "-m", "Django %s (%s)" % (meta.get("version", "?"), os.path.basename(a.orig)))
    git("-c", "pack.threads=1", "repack", "-adq")
    git("prune-packed")
    gd = os.path.join(repo, ".git")
    for f in ("index", "COMMIT_EDITMSG", "description", "ORIG_HEAD"):
        if os.path.exists(os.path.join(gd, f)):
            os.remove(os.path.join(gd, f))
    for d in ("hooks", "logs"):
        subprocess.check_call(["rm", "-rf", os.path.join(gd, d)])
    os.makedirs(os.path.join(gd, "info"), exist_ok=True)
    with open(os.path.join(gd, "info", "exclude"), "w") as fh:
        fh.write("__pycache__/\n*.pyc\n")
    commit = subprocess.check_output(["git", "-C", repo, "rev-parse", "HEAD"], env=genv, text=True).strip()
    subprocess.check_call([sys.executable, "-m", "compileall", "-q", "-j0", "--invalidation-mode", "checked-hash",
                           os.path.join(repo, "django"), site])

    files = {}
    size = {"repo": [0, 0], "env": [0, 0], "git": [0, 0], "pyc": [0, 0]}
    for root, _, names in os.walk(tree):
        for f in names:
            p = os.path.join(root, f)
            rel = os.path.relpath(p, tree)
            files[rel] = sha256(p)
            for part in (size[rel.split("/", 1)[0]], size["git"] if rel.startswith("repo/.git/") else None,
                         size["pyc"] if rel.endswith(".pyc") else None):
                if part is not None:
                    part[0] += 1
                    part[1] += os.path.getsize(p)
    manifest = {
        "name": NAME,
        "description": "Django's source (Debian's python-django orig tarball) with its test suite, "
                       "and its Python environment from Debian's packages",
        "sources": dict(meta, orig_top=top, env=env, commit=commit),
        "layout": {"repo": "repo", "env": "env/site-packages"},
        "size": {"repo_files": size["repo"][0], "repo_bytes": size["repo"][1],
                 "env_files": size["env"][0], "env_bytes": size["env"][1],
                 "git_files": size["git"][0], "git_bytes": size["git"][1],
                 "pyc_files": size["pyc"][0], "pyc_bytes": size["pyc"][1]},
        "test_command": "PYTHONPATH=/workspace/repo:/workspace/env/site-packages "
                        "python3 tests/runtests.py --settings=test_sqlite --parallel=1 LABEL...",
        "test_modules": [],
        "files": dict(sorted(files.items())),
    }
    sz = manifest["size"]
    with open(os.path.join(a.dest, "README.md"), "w") as fh:
        fh.write(README.format(
            orig=meta.get("orig", os.path.basename(a.orig)), orig_sha256=meta.get("orig_sha256", sha256(a.orig)),
            env="\n".join("  - %s %s (%s, sha256 %s)" % (p, e["version"], e["deb"], e["deb_sha256"])
                          for p, e in sorted(env.items())),
            commit=commit, files=len(files), mb=(sz["repo_bytes"] + sz["env_bytes"]) / 1e6,
            repo_files=sz["repo_files"], repo_mb=sz["repo_bytes"] / 1e6, git_mb=sz["git_bytes"] / 1e6,
            pyc_files=sz["pyc_files"], pyc_mb=sz["pyc_bytes"] / 1e6,
            src_files=sz["repo_files"] - sz["git_files"] - sz["pyc_files"],
            src_mb=(sz["repo_bytes"] - sz["git_bytes"] - sz["pyc_bytes"]) / 1e6,
            env_files=sz["env_files"], env_mb=sz["env_bytes"] / 1e6))
    tmp = os.path.join(a.dest, "manifest.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.rename(tmp, os.path.join(a.dest, "manifest.json"))
    print("%d files: repo %d files %d bytes, env %d files %d bytes" % (
        len(files), size["repo"][0], size["repo"][1], size["env"][0], size["env"][1]))


if __name__ == "__main__":
    sys.exit(main())
