"""Builds the jsonlib workload's source tree (run by scripts/setup.sh, step_workload).

The workload is CPython's own ``json`` package and its own test suite
(``test.test_json``), made into a standalone project that no one here wrote:

    jsonlib/            the package, from the image's libpython3.X-stdlib (json/)
    tests/test_jsonlib/ its tests, from Debian's libpython3.X-testsuite (test/test_json/)
    LICENSE             the Python license (Debian's copyright file of the stdlib)
    README.md           where it all comes from

Imports are renamed so that the tests exercise the copy, never the interpreter's own
json: ``json`` -> ``jsonlib``, ``test.test_json`` -> ``tests.test_jsonlib``, the
doctests' ``import json`` -> ``import jsonlib as json``, ``-m json.tool`` ->
``-m jsonlib.tool``. Every rewrite must match the number of times it is expected to,
so a different upstream version fails here instead of yielding a suite that quietly
tests something else. The C accelerator ``_json`` stays as in CPython: the suite's
CTest classes run the copy's Python code with the interpreter's C scanner/encoder, its
PyTest classes run the copy's pure Python code.

    python3 workload/prepare.py --json-src DIR --tests-src DIR --license FILE \\
        --dest DIR [--meta KEY=VALUE ...]

writes DIR/tree/... and, last, DIR/manifest.json (files with sha256, sources, how to
run the tests). Standard library only; any Python 3.7+ runs it.
"""

import argparse
import hashlib
import json
import os
import py_compile
import re
import shutil
import sys
import tempfile

NAME = "jsonlib"
PKG_FILES = ["__init__.py", "decoder.py", "encoder.py", "scanner.py", "tool.py"]

# (file, pattern, replacement, expected count); patterns are regular expressions.
PKG_REWRITES = [
    ("__init__.py", r">>> import json$", ">>> import jsonlib as json", 6),
    ("__init__.py", r"python -m json\.tool", "python -m jsonlib.tool", 2),
    ("__init__.py", r"^:mod:`json` exposes", ":mod:`jsonlib` (CPython's json) exposes", 1),
    ("decoder.py", r"^from json import scanner$", "from jsonlib import scanner", 1),
    ("encoder.py", r">>> from json\.encoder import JSONEncoder$", ">>> from jsonlib.encoder import JSONEncoder", 1),
    ("tool.py", r"^import json$", "import jsonlib as json", 1),
    ("tool.py", r"python -m json\.tool", "python -m jsonlib.tool", 3),
]

TEST_REWRITES = [
    ("*", r"^from test\.test_json import ", "from tests.test_jsonlib import ", None),
    ("__init__.py", r"^import json$",
     "import jsonlib as json\nimport json as _stdlib_json  # the interpreter's, see below", 1),
    ("__init__.py", r"import_fresh_module\('json',", "import_fresh_module('jsonlib',", 2),
    # The C accelerator raises the interpreter's json.decoder.JSONDecodeError.
    ("__init__.py", r"= json\.JSONDecodeError$", "= _stdlib_json.JSONDecodeError", 1),
    ("__init__.py", r"'json\.(scanner|decoder|encoder)'", r"'jsonlib.\1'", 3),
    ("test_tool.py", r"'json\.tool'", "'jsonlib.tool'", 15),
    # test.support.load_package_tests discovers relative to the stdlib's directory.
    ("__init__.py", r"^    return support\.load_package_tests\(pkg_dir, loader, suite, pattern\)$",
     "    # test.support.load_package_tests, with this project's root as the top level\n"
     "    top_dir = os.path.dirname(os.path.dirname(pkg_dir))\n"
     "    suite.addTests(loader.discover(start_dir=pkg_dir, top_level_dir=top_dir,\n"
     "                                   pattern=pattern or 'test*'))\n"
     "    return suite", 1),
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):
            h.update(chunk)
    return h.hexdigest()


def rewrite(path, rules, name):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for fname, pat, repl, want in rules:
        if fname not in ("*", name):
            continue
        text, n = re.subn(pat, repl, text, flags=re.M)
        if want is not None and n != want:
            raise SystemExit("prepare: %s: %r matched %d times, expected %d (another upstream "
                             "version?)" % (name, pat, n, want))
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text


README = """# jsonlib

CPython's `json` package as a standalone project, with CPython's own test suite for
it. Nothing here was written for DeltaBox: only imports are renamed (`json` ->
`jsonlib`, `test.test_json` -> `tests.test_jsonlib`, `-m json.tool` -> `-m
jsonlib.tool`) so that the tests exercise this copy. License: the Python Software
Foundation License (LICENSE).

- `jsonlib/`: {json_from}
- `tests/test_jsonlib/`: {tests_from}

Run the tests (from this directory, with the interpreter the files came from):

    python3 -m unittest tests.test_jsonlib            # the whole suite
    python3 -m unittest tests.test_jsonlib.test_decode
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json-src", required=True, help="the json package directory")
    ap.add_argument("--tests-src", required=True, help="the test/test_json directory")
    ap.add_argument("--license", required=True, help="the license/copyright file")
    ap.add_argument("--dest", required=True, help="output directory (must not exist)")
    ap.add_argument("--meta", action="append", default=[], help="KEY=VALUE for the manifest")
    a = ap.parse_args(argv)
    meta = dict(kv.split("=", 1) for kv in a.meta)

    if os.path.exists(a.dest):
        raise SystemExit("prepare: %s exists" % a.dest)
    tree = os.path.join(a.dest, "tree")
    pkg = os.path.join(tree, NAME)
    tests = os.path.join(tree, "tests", "test_" + NAME)
    os.makedirs(pkg)
    os.makedirs(tests)

    for f in PKG_FILES:
        src = os.path.join(a.json_src, f)
        if not os.path.isfile(src):
            raise SystemExit("prepare: missing %s" % src)
        shutil.copyfile(src, os.path.join(pkg, f))
        rewrite(os.path.join(pkg, f), PKG_REWRITES, f)

    test_files = sorted(f for f in os.listdir(a.tests_src) if f.endswith(".py"))
    if "__init__.py" not in test_files or len(test_files) < 10:
        raise SystemExit("prepare: %s does not look like test/test_json" % a.tests_src)
    for f in test_files:
        shutil.copyfile(os.path.join(a.tests_src, f), os.path.join(tests, f))
        text = rewrite(os.path.join(tests, f), TEST_REWRITES, f)
        if re.search(r"^\s*(import json\b(?! as _stdlib_json)|from json\b)|'json\.|\"json\.|test\.test_json", text, re.M):
            raise SystemExit("prepare: %s still refers to json or test.test_json" % f)
    with open(os.path.join(tree, "tests", "__init__.py"), "w") as fh:
        fh.write("")
    shutil.copyfile(a.license, os.path.join(tree, "LICENSE"))
    with open(os.path.join(tree, "README.md"), "w") as fh:
        fh.write(README.format(json_from=meta.get("json_from", "?"),
                               tests_from=meta.get("tests_from", "?")))

    with tempfile.TemporaryDirectory() as tmp:  # everything still compiles
        for root, _, files in os.walk(tree):
            for f in files:
                if f.endswith(".py"):
                    py_compile.compile(os.path.join(root, f), cfile=os.path.join(tmp, "x.pyc"),
                                       doraise=True)

    files = {}
    for root, _, names in os.walk(tree):
        for f in names:
            p = os.path.join(root, f)
            files[os.path.relpath(p, tree)] = sha256(p)
    test_modules = ["tests.test_%s.%s" % (NAME, f[:-3]) for f in test_files
                    if f.startswith("test_")]
    manifest = {
        "name": NAME,
        "description": "CPython's json package with CPython's test.test_json, imports renamed",
        "sources": meta,
        "test_package": "tests.test_" + NAME,
        "test_modules": test_modules,
        "test_command": "python3 -m unittest tests.test_" + NAME,
        "files": dict(sorted(files.items())),
    }
    tmp = os.path.join(a.dest, "manifest.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.rename(tmp, os.path.join(a.dest, "manifest.json"))
    print("%d files, %d test modules" % (len(files), len(test_modules)))


if __name__ == "__main__":
    sys.exit(main())
