"""Tasks: bugs injected into the workload (CPython's json package as ``jsonlib``) so
that some of its own tests fail.

A :class:`Mutation` changes one line of a function the test suite covers (an
off-by-one, a swapped condition, a wrong escape, a wrong constant) and comes with
plausible wrong fixes (``decoys``) for the same line. A :class:`Task` injects one or
more mutations (seeded), and names a few other catalogue lines as distractors: places
an agent may edit although nothing is wrong there. Every edit an agent can make is
"set line L of file F to text T", so it applies in any state.

Verification (``python3 -m workload.tasks --verify``, against a daemon) checks in a
sandbox, with the real test suite, that the pristine code passes every relevant test,
that each bug makes some but not all relevant tests fail, and that each decoy leaves
at least one relevant test failing (so the fix is the only right answer).
"""

import argparse
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

from .workspace import REPO, Workload, install

if TYPE_CHECKING:  # the client is imported by the examples (clients/python on sys.path)
    from deltabox import Sandbox

P = "jsonlib/"
T = "tests.test_jsonlib."


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str          # relative to the repository
    function: str
    kind: str          # off-by-one, swapped condition, wrong escape, wrong constant
    orig: str          # the line as the workload has it
    bug: str           # the injected line
    decoys: Tuple[str, ...]  # plausible wrong fixes
    tests: Tuple[str, ...]   # relevant test modules (without the T prefix)
    occurrence: Optional[int] = None  # which occurrence of orig (None: orig is unique)


CATALOGUE = [
    Mutation("decoder.uXXXX-slice", P + "decoder.py", "_decode_uXXXX", "off-by-one",
             r"    esc = s[pos + 1:pos + 5]",
             r"    esc = s[pos + 1:pos + 4]",
             (r"    esc = s[pos:pos + 4]", r"    esc = s[pos + 2:pos + 6]", r"    esc = s[pos:pos + 5]"),
             ("test_scanstring", "test_unicode", "test_decode", "test_fail")),
    Mutation("decoder.surrogate-lookahead", P + "decoder.py", "py_scanstring", "off-by-one",
             r"            if 0xd800 <= uni <= 0xdbff and s[end:end + 2] == '\\u':",
             r"            if 0xd800 <= uni <= 0xdbff and s[end:end + 1] == '\\u':",
             (r"            if 0xd800 <= uni <= 0xdbff and s[end + 1:end + 3] == '\\u':",
              r"            if 0xdc00 <= uni <= 0xdfff and s[end:end + 2] == '\\u':",
              r"            if 0xd800 <= uni <= 0xdbff and s[end:end + 2] == 'u':"),
             ("test_scanstring", "test_unicode")),
    Mutation("decoder.surrogate-combine", P + "decoder.py", "py_scanstring", "wrong constant",
             r"                    uni = 0x10000 + (((uni - 0xd800) << 10) | (uni2 - 0xdc00))",
             r"                    uni = 0x10000 + (((uni - 0xd800) << 8) | (uni2 - 0xdc00))",
             (r"                    uni = 0x10000 + (((uni - 0xd800) << 12) | (uni2 - 0xdc00))",
              r"                    uni = 0x10000 + (((uni - 0xdc00) << 10) | (uni2 - 0xd800))",
              r"                    uni = (((uni - 0xd800) << 10) | (uni2 - 0xdc00))"),
             ("test_scanstring", "test_unicode")),
    Mutation("decoder.escape-table", P + "decoder.py", "BACKSLASH (py_scanstring)", "wrong escape",
             r"    'b': '\b', 'f': '\f', 'n': '\n', 'r': '\r', 't': '\t',",
             r"    'b': '\b', 'f': '\f', 'n': '\r', 'r': '\n', 't': '\t',",
             (r"    'b': '\f', 'f': '\b', 'n': '\n', 'r': '\r', 't': '\t',",
              r"    'b': '\b', 'f': '\f', 'n': '\n\r', 'r': '\r', 't': '\t',",
              r"    'b': '\b', 'f': '\f', 'r': '\r', 't': '\t',"),
             ("test_scanstring", "test_decode", "test_pass1", "test_unicode")),
    Mutation("decoder.array-delimiter-pos", P + "decoder.py", "JSONArray", "off-by-one",
             r"""            raise JSONDecodeError("Expecting ',' delimiter", s, end - 1)""",
             r"""            raise JSONDecodeError("Expecting ',' delimiter", s, end)""",
             (r"""            raise JSONDecodeError("Expecting ',' delimiter", s, end - 2)""",
              r"""            raise JSONDecodeError("Expecting ',' delimiter", s, end + 1)""",
              r"""            raise JSONDecodeError("Expecting ']' delimiter", s, end)"""),
             ("test_fail", "test_decode"), occurrence=1),
    Mutation("decoder.colno", P + "decoder.py", "JSONDecodeError.__init__", "off-by-one",
             r"        colno = pos - doc.rfind('\n', 0, pos)",
             r"        colno = pos - doc.rfind('\n', 0, pos) - 1",
             (r"        colno = pos - doc.rfind('\n', 0, pos) + 1",
              r"        colno = pos - doc.find('\n', 0, pos)",
              r"        colno = pos - doc.rfind('\n', 1, pos)"),
             ("test_fail", "test_decode")),
    Mutation("decoder.empty-object-end", P + "decoder.py", "JSONObject", "off-by-one",
             r"            return pairs, end + 1",
             r"            return pairs, end",
             (r"            return pairs, end + 2", r"            return {}, end",
              r"            return pairs, end - 1"),
             ("test_decode", "test_pass1", "test_fail")),
    Mutation("scanner.null-end", P + "scanner.py", "py_make_scanner", "off-by-one",
             r"            return None, idx + 4",
             r"            return None, idx + 3",
             (r"            return None, idx + 5", r"            return None, idx",
              r"            return None, idx + 2"),
             ("test_decode", "test_pass1", "test_fail")),
    Mutation("scanner.false-literal", P + "scanner.py", "py_make_scanner", "off-by-one",
             r"        elif nextchar == 'f' and string[idx:idx + 5] == 'false':",
             r"        elif nextchar == 'f' and string[idx:idx + 4] == 'false':",
             (r"        elif nextchar == 'f' and string[idx:idx + 6] == 'false':",
              r"        elif nextchar == 'F' and string[idx:idx + 5] == 'false':",
              r"        elif nextchar == 'f' and string[idx + 1:idx + 5] == 'false':"),
             ("test_decode", "test_pass1", "test_fail")),
    Mutation("scanner.float-condition", P + "scanner.py", "py_make_scanner", "swapped condition",
             r"            if frac or exp:",
             r"            if frac and exp:",
             (r"            if frac:", r"            if exp:", r"            if not (frac or exp):"),
             ("test_float", "test_decode", "test_pass1")),
    Mutation("scanner.number-exponent", P + "scanner.py", "NUMBER_RE", "wrong constant",
             r"    r'(-?(?:0|[1-9]\d*))(\.\d+)?([eE][-+]?\d+)?',",
             r"    r'(-?(?:0|[1-9]\d*))(\.\d+)?([eE][+]?\d+)?',",
             (r"    r'(-?(?:0|[1-9]\d*))(\.\d)?([eE][-+]?\d+)?',",
              r"    r'(-?(?:[0-9]\d*))(\.\d+)?([eE][-+]?\d+)?',",
              r"    r'((?:0|[1-9]\d*))(\.\d+)?([eE][-+]?\d+)?',"),
             ("test_float", "test_decode", "test_pass1", "test_fail")),
    Mutation("encoder.u-escape-width", P + "encoder.py", "py_encode_basestring_ascii", "wrong escape",
             r"                return '\\u{0:04x}'.format(n)",
             r"                return '\\u{0:4x}'.format(n)",
             (r"                return '\\u{0:04X}'.format(n)", r"                return '\\u{0:x}'.format(n)",
              r"                return '\\x{0:04x}'.format(n)"),
             ("test_encode_basestring_ascii", "test_unicode", "test_dump")),
    Mutation("encoder.surrogate-high", P + "encoder.py", "py_encode_basestring_ascii", "wrong constant",
             r"                s1 = 0xd800 | ((n >> 10) & 0x3ff)",
             r"                s1 = 0xd800 | ((n >> 8) & 0x3ff)",
             (r"                s1 = 0xdc00 | ((n >> 10) & 0x3ff)", r"                s1 = 0xd800 | ((n >> 11) & 0x3ff)",
              r"                s1 = 0xd800 | (n & 0x3ff)"),
             ("test_encode_basestring_ascii", "test_unicode")),
    Mutation("encoder.float-infinity", P + "encoder.py", "JSONEncoder.iterencode.floatstr", "swapped condition",
             r"            elif o == _inf:",
             r"            elif o == _neginf:",
             (r"            elif o != _inf:", r"            elif o is _inf:", r"            elif o >= _neginf:"),
             ("test_float", "test_enum", "test_dump")),
    Mutation("encoder.list-dedent", P + "encoder.py", "_make_iterencode._iterencode_list", "off-by-one",
             r"            _current_indent_level -= 1",
             r"            _current_indent_level -= 2",
             (r"            _current_indent_level += 1", r"            _current_indent_level = 0",
              r"            _current_indent_level -= 0"),
             ("test_indent", "test_dump", "test_separators"), occurrence=0),
    Mutation("encoder.list-separator", P + "encoder.py", "_make_iterencode._iterencode_list", "wrong constant",
             r"                buf = separator",
             r"                buf = _item_separator",
             (r"                buf = newline_indent", r"                buf += separator",
              r"                buf = _item_separator + _indent"),
             ("test_indent", "test_separators", "test_dump")),
    Mutation("encoder.sort-keys", P + "encoder.py", "_make_iterencode._iterencode_dict", "swapped condition",
             r"            items = sorted(dct.items())",
             r"            items = sorted(dct.items(), reverse=True)",
             (r"            items = sorted(dct)", r"            items = dct.items()",
              r"            items = sorted(dct.items(), key=lambda kv: kv[1])"),
             ("test_dump", "test_indent", "test_separators", "test_encode_basestring_ascii")),
    Mutation("encoder.true-key", P + "encoder.py", "_make_iterencode._iterencode_dict", "wrong constant",
             r"                key = 'true'",
             r"                key = 'True'",
             (r"                key = True", r"                key = 'false'", r"                key = '1'"),
             ("test_dump",)),
]
BY_ID = {m.id: m for m in CATALOGUE}


@dataclass(frozen=True)
class Edit:
    """Set line ``line`` of ``file`` to ``text``. ``id`` is ``MUTATION/VARIANT`` with
    VARIANT fix, bug or d1, d2, ... (a decoy)."""
    id: str
    file: str
    line: int
    text: str

    @property
    def mutation(self) -> str:
        return self.id.split("/")[0]

    @property
    def variant(self) -> str:
        return self.id.split("/")[1]


# Applies an edit inside the sandbox: python3 -c APPLY FILE LINE TEXT (in the repository).
APPLY = ("import sys\n"
         "p, n, t = sys.argv[1], int(sys.argv[2]), sys.argv[3]\n"
         "with open(p, encoding='utf-8') as f:\n"
         "    lines = f.read().split('\\n')\n"
         "lines[n - 1] = t\n"
         "with open(p, 'w', encoding='utf-8') as f:\n"
         "    f.write('\\n'.join(lines))\n")


def edit_argv(e: Edit) -> List[str]:
    return ["python3", "-c", APPLY, e.file, str(e.line), e.text]


def test_argv(modules: Sequence[str]) -> List[str]:
    return ["python3", "-m", "unittest"] + [T + m for m in modules]


TEST_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}
TEST_TIMEOUT = 300.0


@dataclass(frozen=True)
class Kind:
    """What a workload's tasks need: its catalogue and how its tests run.
    ``test_prefix`` is prepended to a mutation's test modules to make the command's
    labels; ``files_prefix`` is where the repository's files are among the
    workload's (the django workload also holds its environment, env/)."""
    name: str
    catalogue: List[Mutation]
    test_prefix: str
    files_prefix: str
    argv: Callable[[Sequence[str]], List[str]]  # labels -> the test command
    env: Dict[str, str]
    whole: List[str]    # labels of the suite verify runs whole on the pristine tree
    modules: List[str]  # every test module mutations may name, in order
    install_message: str

    @property
    def by_id(self) -> Dict[str, Mutation]:
        return {m.id: m for m in self.catalogue}

    def labels(self, modules: Sequence[str]) -> List[str]:
        return [self.test_prefix + m for m in modules]


def _unittest_argv(labels: Sequence[str]) -> List[str]:
    return ["python3", "-m", "unittest"] + list(labels)


JSONLIB = Kind(name="jsonlib", catalogue=CATALOGUE, test_prefix=T, files_prefix="", argv=_unittest_argv,
               env=TEST_ENV, whole=[T.rstrip(".")], modules=[],
               install_message="jsonlib: CPython's json package with its tests")


def kind_of(name: str) -> Kind:
    """The Kind of a workload by name (ValueError naming the known ones)."""
    if name == "jsonlib":
        return JSONLIB
    if name == "django":
        from .djangowl import KIND
        return KIND
    raise ValueError("unknown workload %r (known: jsonlib, django)" % name)


@dataclass
class TestRun:
    ran: int = 0
    failures: int = 0
    errors: int = 0
    skipped: int = 0
    failed: List[str] = field(default_factory=list)  # ids of failing tests
    timed_out: bool = False
    exit_code: int = 0
    duration: float = 0.0

    @property
    def passed(self) -> int:
        return max(0, self.ran - self.failures - self.errors - self.skipped)

    @property
    def counted(self) -> int:
        """Tests that ran and were not skipped."""
        return max(0, self.ran - self.skipped)


_RAN = re.compile(r"^Ran (\d+) tests? in ", re.M)
_SUMMARY = re.compile(r"^(OK|FAILED)(?: \((.*)\))?\s*$", re.M)
_FAILED = re.compile(r"^(?:FAIL|ERROR): \S+ \((\S+)\)", re.M)


def parse_unittest(out: str) -> TestRun:
    tr = TestRun()
    m = _RAN.search(out)
    if m:
        tr.ran = int(m.group(1))
    for m in _SUMMARY.finditer(out):
        for part in (m.group(2) or "").split(","):
            k, _, v = part.strip().partition("=")
            if v.isdigit():
                if k == "failures":
                    tr.failures = int(v)
                elif k == "errors":
                    tr.errors = int(v)
                elif k == "skipped":
                    tr.skipped = int(v)
    tr.failed = sorted(set(_FAILED.findall(out)))
    return tr


def run_tests(sb: "Sandbox", modules: Sequence[str], kind: Optional[Kind] = None) -> Tuple[TestRun, dict]:
    """Runs the modules' tests for real in the sandbox's repository (the workload
    kind's command, jsonlib's by default); returns the parsed result and the
    command's record."""
    kind = kind or JSONLIB
    argv = kind.argv(kind.labels(modules))
    r = sb.run(argv, cwd=REPO, env=kind.env, timeout=TEST_TIMEOUT)
    return test_result(r), {"kind": "exec", "argv": argv, "cwd": REPO, "env": dict(kind.env),
                            "state_changing": False}


def test_result(r) -> TestRun:
    """The TestRun of a finished test command (a client Result): what run_tests
    returns, also for a recorded test command replayed elsewhere."""
    tr = parse_unittest(r.stderr + "\n" + r.stdout)
    tr.timed_out, tr.exit_code, tr.duration = r.timed_out, r.exit_code, r.duration
    if tr.ran == 0 and not r.timed_out and r.exit_code != 0:
        tr.errors = 1  # nothing ran: the suite could not even be loaded
    return tr


def locate(wl: Workload, m: Mutation) -> int:
    """The 1-based line number of the mutation's line in the pristine file."""
    lines = wl.text(kind_of(wl.name).files_prefix + m.file).split("\n")
    hits = [i + 1 for i, l in enumerate(lines) if l == m.orig]
    n = 0 if m.occurrence is None else m.occurrence
    if n >= len(hits) or (m.occurrence is None and len(hits) != 1):
        raise ValueError("mutation %s: line %r found %d times in %s" % (m.id, m.orig, len(hits), m.file))
    return hits[n]


def variants(m: Mutation) -> Dict[str, str]:
    """variant name -> line text, for every edit of this mutation's line."""
    v = {"fix": m.orig, "bug": m.bug}
    for i, d in enumerate(m.decoys):
        v["d%d" % (i + 1)] = d
    return v


@dataclass
class Task:
    """Bugs injected into the workload. ``files`` is the buggy tree."""
    id: str
    seed: int
    bugs: List[Mutation]
    distractors: List[Mutation]
    lines: Dict[str, int]          # mutation id -> line number
    files: Dict[str, bytes]
    tests: List[str]               # relevant test modules
    workload: str = "jsonlib"

    @property
    def sites(self) -> List[Mutation]:
        return self.bugs + self.distractors

    @property
    def kind(self) -> Kind:
        return kind_of(self.workload)

    def edit(self, mutation_id: str, variant: str) -> Edit:
        m = self.kind.by_id[mutation_id]
        return Edit("%s/%s" % (m.id, variant), m.file, self.lines[m.id], variants(m)[variant])

    def edits(self) -> Dict[str, Edit]:
        """Every edit an agent can make in this task, by id."""
        out = {}
        for m in self.sites:
            for v in variants(m):
                e = self.edit(m.id, v)
                out[e.id] = e
        return out

    def line_state(self, path: Sequence[str]) -> Dict[str, str]:
        """mutation id -> the variant its line holds after the edits of path."""
        st = {m.id: "bug" for m in self.bugs}
        st.update({m.id: "fix" for m in self.distractors})
        for eid in path:
            mid, v = eid.split("/")
            st[mid] = v
        return st

    def fixed(self, path: Sequence[str]) -> bool:
        st = self.line_state(path)
        return all(st[m.id] == "fix" for m in self.sites)

    def describe(self) -> str:
        return ", ".join("%s (%s in %s, %s:%d)" % (m.id, m.kind, m.function, m.file, self.lines[m.id])
                         for m in self.bugs)

    def spec(self) -> dict:
        return {"id": self.id, "workload": self.workload, "seed": self.seed,
                "bugs": [m.id for m in self.bugs], "distractors": [m.id for m in self.distractors],
                "lines": dict(self.lines), "tests": self.kind.labels(self.tests)}


def make_task(wl: Workload, seed: int = 0, n_bugs: int = 1,
              bugs: Optional[Sequence[str]] = None, n_distractors: int = 2) -> Task:
    """A task: n_bugs mutations of the catalogue, chosen by seed (or named by bugs),
    on different lines, and n_distractors other lines."""
    rng = random.Random("task|%s|%d" % (seed, n_bugs))
    kind = kind_of(wl.name)
    BY_ID = kind.by_id
    ids = [m.id for m in kind.catalogue]
    if bugs:
        unknown = [b for b in bugs if b not in BY_ID]
        if unknown:
            raise ValueError("unknown mutation(s) %s of workload %s (python3 -m workload.tasks "
                             "--workload %s lists them)" % (", ".join(unknown), wl.name, wl.name))
        chosen = [BY_ID[b] for b in bugs]
    else:
        chosen = [BY_ID[i] for i in rng.sample(ids, n_bugs)]
    rest = [i for i in ids if i not in {m.id for m in chosen}]
    distractors = [BY_ID[i] for i in rng.sample(rest, n_distractors)]
    lines = {m.id: locate(wl, m) for m in chosen + distractors}
    if len({(BY_ID[k].file, v) for k, v in lines.items()}) != len(lines):
        raise ValueError("two sites of the task share a line")
    files = dict(wl.files)
    for m in chosen:
        f = kind.files_prefix + m.file
        ls = files[f].decode("utf-8").split("\n")
        assert ls[lines[m.id] - 1] == m.orig
        ls[lines[m.id] - 1] = m.bug
        files[f] = "\n".join(ls).encode("utf-8")
    mods = kind.modules or [t[len(T):] for t in wl.test_modules]
    order = {t: i for i, t in enumerate(mods)}
    tests = sorted({t for m in chosen for t in m.tests}, key=lambda t: order[t])
    tid = "%s-s%d" % ("+".join(m.id for m in chosen), seed) if bugs else "seed%d-%dbug" % (seed, n_bugs)
    return Task(tid, seed, chosen, distractors, lines, files, tests, wl.name)


# ---- verification -------------------------------------------------------------------------

def verify(sb: "Sandbox", wl: Workload, ids: Optional[Sequence[str]] = None, out=sys.stdout) -> bool:
    """Checks the catalogue with the real test suite in sandbox sb (see the module's
    doc). Prints one line per mutation; returns True when all hold."""
    kind = kind_of(wl.name)
    BY_ID = kind.by_id
    install(sb, wl.files, "pristine " + wl.name, workload=wl.name)
    r = sb.run(kind.argv(kind.whole), cwd=REPO, env=kind.env, timeout=TEST_TIMEOUT)
    whole = parse_unittest(r.stderr + "\n" + r.stdout)
    ok = r.exit_code == 0 and whole.counted > 0 and whole.passed == whole.counted
    print("%-30s %-4s %d/%d (%d skipped)" % ("pristine whole suite", "ok" if ok else "FAIL",
                                             whole.passed, whole.counted, whole.skipped), file=out, flush=True)
    muts = [BY_ID[i] for i in ids] if ids else kind.catalogue
    base_cache: Dict[Tuple[str, ...], TestRun] = {}
    for m in muts:
        line = locate(wl, m)
        mods = list(m.tests)
        key = tuple(mods)
        if key not in base_cache:
            base_cache[key], _ = run_tests(sb, mods, kind)
        base = base_cache[key]
        res: Dict[str, TestRun] = {}
        for v, text in variants(m).items():
            if v == "fix":
                continue
            sb.run(edit_argv(Edit(m.id + "/" + v, m.file, line, text)), cwd=REPO).check()
            res[v], _ = run_tests(sb, mods, kind)
        sb.run(edit_argv(Edit(m.id + "/fix", m.file, line, m.orig)), cwd=REPO).check()
        problems = []
        if base.passed != base.counted or base.counted == 0:
            problems.append("pristine fails %d of %d" % (base.counted - base.passed, base.counted))
        b = res["bug"]
        if b.counted != base.counted:
            problems.append("bug changes the number of tests (%d vs %d)" % (b.counted, base.counted))
        if b.passed >= base.counted:
            problems.append("bug fails no test")
        if b.passed == 0:
            problems.append("bug fails every test")
        for v, tr in res.items():
            if v.startswith("d") and tr.passed >= base.counted:
                problems.append("decoy %s passes every test" % v)
        ok = ok and not problems
        print("%-30s %-4s pristine %3d/%-3d  bug %3d/%-3d  decoys %s%s" % (
            m.id, "ok" if not problems else "FAIL", base.passed, base.counted, b.passed, b.counted,
            " ".join("%d" % tr.passed for v, tr in sorted(res.items()) if v.startswith("d")),
            ("   <- " + "; ".join(problems)) if problems else ""), file=out, flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="the workload's bug catalogue")
    ap.add_argument("--verify", action="store_true",
                    help="check every mutation with the real tests in a sandbox ($DELTABOX_SOCKET)")
    ap.add_argument("--list", action="store_true", help="list the catalogue")
    ap.add_argument("--only", nargs="*", help="mutation ids (default: all)")
    ap.add_argument("--workload", default="jsonlib", help="jsonlib (default) or django")
    a = ap.parse_args(argv)
    kind = kind_of(a.workload)
    wl = Workload.load(a.workload)
    if a.list or not a.verify:
        for m in kind.catalogue:
            print("%-30s %-18s %s:%d %s" % (m.id, m.kind, m.file, locate(wl, m), m.function))
        if not a.verify:
            return 0
    from deltabox import Sandbox
    t0 = time.time()
    with Sandbox.create() as sb:
        good = verify(sb, wl, a.only)
    print("%s: %d mutations in %.1f s" % ("all hold" if good else "SOME FAIL",
                                          len(a.only or kind.catalogue), time.time() - t0))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
