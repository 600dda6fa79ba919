"""A PEP 517 / PEP 660 build backend for the deltabox client, standard library only.

pip runs it (pyproject.toml: build-backend = "_build_backend", backend-path = ["."]),
so installing needs neither setuptools nor wheel nor a package index:

    pip install ./clients/python            # a wheel of the pure-Python package
    pip install -e ./clients/python         # editable: a .pth pointing here

It reads the [project] table of pyproject.toml (tomllib on Python 3.11+, a small
reader of the same few keys before that) and packs the ``deltabox`` package.
"""

import base64
import hashlib
import io
import json
import os
import re
import tarfile
import zipfile
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "deltabox"
# Fixed timestamps make builds reproducible (and zip wants >= 1980).
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


# ---- metadata ----

def _toml_value(text: str) -> Any:
    """A TOML value of the few forms pyproject.toml uses here: basic strings and
    arrays of them (an inline table is returned as None)."""
    text = text.strip()
    if text.startswith('"'):
        return json.loads(text)
    if text.startswith("'"):
        return text[1:-1]
    if text.startswith("["):
        body = re.sub(r"#[^\n\"]*$", "", text, flags=re.M)
        return [json.loads(s) for s in re.findall(r'"(?:[^"\\]|\\.)*"', body)]
    if text in ("true", "false"):
        return text == "true"
    return None


def read_project(path: Optional[str] = None) -> Dict[str, Any]:
    """The [project] table of pyproject.toml."""
    path = path or os.path.join(HERE, "pyproject.toml")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        return _read_project_fallback(raw.decode("utf-8"))
    return tomllib.loads(raw.decode("utf-8")).get("project", {})


def _read_project_fallback(text: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    section = None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[] ")
            continue
        if section != "project" or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if value.startswith("[") and "]" not in value:
            while i < len(lines):
                value += "\n" + lines[i]
                i += 1
                if lines[i - 1].strip().startswith("]"):
                    break
        v = _toml_value(value)
        if v is not None:
            out[key.strip()] = v
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name)


def _metadata(project: Dict[str, Any]) -> str:
    lines = [
        "Metadata-Version: 2.1",
        "Name: %s" % project["name"],
        "Version: %s" % project["version"],
    ]
    if project.get("description"):
        lines.append("Summary: %s" % project["description"])
    if project.get("requires-python"):
        lines.append("Requires-Python: %s" % project["requires-python"])
    for c in project.get("classifiers") or []:
        lines.append("Classifier: %s" % c)
    for d in project.get("dependencies") or []:
        lines.append("Requires-Dist: %s" % d)
    readme = project.get("readme")
    body = ""
    if isinstance(readme, str) and os.path.exists(os.path.join(HERE, readme)):
        lines.append("Description-Content-Type: text/markdown")
        with open(os.path.join(HERE, readme), encoding="utf-8") as f:
            body = f.read()
    return "\n".join(lines) + "\n\n" + body


def _names() -> Tuple[Dict[str, Any], str, str]:
    project = read_project()
    dist = _norm(project["name"])
    return project, dist, "%s-%s" % (dist, project["version"])


def _package_files() -> List[str]:
    """Paths (relative to HERE, "/"-separated) of the package's files."""
    out = []
    for root, dirs, files in os.walk(os.path.join(HERE, PACKAGE)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for f in sorted(files):
            if f.endswith((".pyc", ".pyo")) or f.startswith("."):
                continue
            rel = os.path.relpath(os.path.join(root, f), HERE)
            out.append(rel.replace(os.sep, "/"))
    return out


# ---- wheels ----

class _Wheel:
    def __init__(self, path: str) -> None:
        self.zf = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED)
        self.record: List[str] = []

    def add(self, arcname: str, data: bytes, mode: int = 0o644) -> None:
        zi = zipfile.ZipInfo(arcname, _ZIP_TIME)
        zi.external_attr = (0o100000 | mode) << 16
        zi.compress_type = zipfile.ZIP_DEFLATED
        self.zf.writestr(zi, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.record.append("%s,sha256=%s,%d" % (arcname, digest, len(data)))

    def close(self, record_name: str) -> None:
        self.record.append("%s,," % record_name)
        zi = zipfile.ZipInfo(record_name, _ZIP_TIME)
        zi.external_attr = (0o100000 | 0o644) << 16
        zi.compress_type = zipfile.ZIP_DEFLATED
        self.zf.writestr(zi, "\n".join(self.record) + "\n")
        self.zf.close()


def _dist_info_files(project: Dict[str, Any]) -> Dict[str, bytes]:
    return {
        "METADATA": _metadata(project).encode("utf-8"),
        "WHEEL": ("Wheel-Version: 1.0\nGenerator: deltabox _build_backend\n"
                  "Root-Is-Purelib: true\nTag: py3-none-any\n").encode(),
    }


def _build(wheel_directory: str, editable: bool) -> str:
    project, dist, base = _names()
    name = "%s-py3-none-any.whl" % base
    os.makedirs(wheel_directory, exist_ok=True)
    w = _Wheel(os.path.join(wheel_directory, name))
    if editable:
        w.add("__editable__.%s.pth" % base, (HERE + "\n").encode("utf-8"))
    else:
        for rel in _package_files():
            with open(os.path.join(HERE, rel), "rb") as f:
                w.add(rel, f.read())
    di = "%s.dist-info" % base
    for fn, data in _dist_info_files(project).items():
        w.add("%s/%s" % (di, fn), data)
    w.close("%s/RECORD" % di)
    return name


def _prepare_metadata(metadata_directory: str) -> str:
    project, _, base = _names()
    di = "%s.dist-info" % base
    os.makedirs(os.path.join(metadata_directory, di), exist_ok=True)
    for fn, data in _dist_info_files(project).items():
        with open(os.path.join(metadata_directory, di, fn), "wb") as f:
            f.write(data)
    return di


# ---- PEP 517 hooks ----

def get_requires_for_build_wheel(config_settings: Any = None) -> List[str]:
    return []


def get_requires_for_build_sdist(config_settings: Any = None) -> List[str]:
    return []


def get_requires_for_build_editable(config_settings: Any = None) -> List[str]:
    return []


def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: Any = None) -> str:
    return _prepare_metadata(metadata_directory)


def prepare_metadata_for_build_editable(metadata_directory: str, config_settings: Any = None) -> str:
    return _prepare_metadata(metadata_directory)


def build_wheel(wheel_directory: str, config_settings: Any = None,
                metadata_directory: Optional[str] = None) -> str:
    return _build(wheel_directory, editable=False)


def build_editable(wheel_directory: str, config_settings: Any = None,
                   metadata_directory: Optional[str] = None) -> str:
    return _build(wheel_directory, editable=True)


def build_sdist(sdist_directory: str, config_settings: Any = None) -> str:
    project, _, base = _names()
    name = "%s.tar.gz" % base
    os.makedirs(sdist_directory, exist_ok=True)
    files = ["pyproject.toml", "_build_backend.py", "README.md"] + _package_files()
    tests = os.path.join(HERE, "tests")
    if os.path.isdir(tests):
        files += sorted("tests/" + f for f in os.listdir(tests) if f.endswith(".py"))

    def add(tf: tarfile.TarFile, arcname: str, data: bytes) -> None:
        ti = tarfile.TarInfo("%s/%s" % (base, arcname))
        ti.size, ti.mode, ti.mtime = len(data), 0o644, 315532800
        tf.addfile(ti, io.BytesIO(data))

    with tarfile.open(os.path.join(sdist_directory, name), "w:gz", format=tarfile.PAX_FORMAT) as tf:
        for rel in files:
            p = os.path.join(HERE, rel)
            if os.path.exists(p):
                with open(p, "rb") as f:
                    add(tf, rel, f.read())
        add(tf, "PKG-INFO", _metadata(project).encode("utf-8"))
    return name
