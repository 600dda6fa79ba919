"""The scripted agent: deterministic stand-in for an LLM agent that fixes a task's bugs.

At a node (the edits applied so far, its ``path``), the agent

1. *thinks*: sleeps ``think`` seconds of real wall time, standing in for the LLM call
   (0 s, or 2 s as a paper-like setting). Work that DeltaBox does asynchronously after
   a checkpoint overlaps it, as it would overlap a real LLM call;
2. *proposes* ``k`` candidate edits, deterministic from (seed, task, path): a true fix
   of a line that is still wrong, among plausible wrong ones (other versions of the
   buggy lines, or edits of lines that are fine), in an order that is its "prior"
   (the fix first with probability ``skill``, 0.5, else anywhere). Search takes them
   in that order; sampling (Best-of-N, RL) draws one with weights
   ``exp((pref - rank) / temperature)``;
3. *applies* one (a command in the sandbox: ``python3 -c APPLY FILE LINE TEXT``);
4. *records* the edit in its persistent python session (``_applied``, a list kept in
   the session's globals: its working memory of what it did along this path);
5. *runs* the relevant tests for real (``python3 -m unittest tests.test_jsonlib.X ...``)
   and scores the node.

Score = tests passed + ``state_points`` (2) x state, where state is 1 when the
session's memory is exactly the node's path (``_applied`` == path; 1 at the root), else
0. Checkpoints and rollbacks that keep process state keep the session's memory, so
state is 1 everywhere: DeltaBox's process fast path does that for sessions, within the
sandbox that made the node. One that ends processes (a daemon run with
``DELTABOX_FASTPATH=0``, a node restored into another sandbox, a system that
checkpoints files only) restarts the session with an empty memory, so state drops to 0
from depth 2 on. Replaying a node's recorded commands from the root (the baselines)
rebuilds the memory and gets state 1. ``solved`` is about the tests alone: every
relevant test passes.

Every command that runs in the sandbox is recorded (``commands`` of a step), so a
trajectory can be replayed elsewhere.
"""

import contextlib
import hashlib
import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple

from .tasks import Edit, Task, TestRun, edit_argv, run_tests
from .workspace import REPO

if TYPE_CHECKING:  # the client is imported by the examples (clients/python on sys.path)
    from deltabox import Result, Sandbox

SESSION = "agent"
STATE_POINTS = 2.0
SKILL = 0.5        # how often the agent ranks the true fix first among its proposals
TEMPERATURE = 1.5  # of its sampling over its ranked proposals


class Timers:
    """Wall time per kind of work (thread-safe): think, edit, session, tests,
    checkpoint, restore, fork, setup."""

    def __init__(self) -> None:
        self.total: Dict[str, float] = {}
        self.count: Dict[str, int] = {}
        self._lock = threading.Lock()
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, dt: float) -> None:
        with self._lock:
            self.total[name] = self.total.get(name, 0.0) + dt
            self.count[name] = self.count.get(name, 0) + 1

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def get(self, name: str) -> float:
        return self.total.get(name, 0.0)

    def summary(self) -> dict:
        return {k: {"seconds": round(v, 4), "count": self.count[k],
                    "mean_ms": round(1000 * v / max(1, self.count[k]), 3)}
                for k, v in sorted(self.total.items())}

    def report(self, wall: Optional[float] = None) -> List[str]:
        """Lines: where the time went, checkpoint/restore/fork against the total."""
        wall = self.elapsed() if wall is None else wall
        lines = []
        for k in ("checkpoint", "restore", "fork", "create", "think", "edit", "session", "tests", "setup"):
            if k in self.total:
                lines.append("  %-10s %8.3f s  %5d calls  %8.2f ms each" % (
                    k, self.total[k], self.count[k], 1000 * self.total[k] / max(1, self.count[k])))
        cr = sum(self.total.get(k, 0.0) for k in ("checkpoint", "restore", "fork"))
        lines.append("  time in checkpoint/restore/fork: %.3f s of %.3f s total (%.2f%%)"
                     % (cr, wall, 100 * cr / wall if wall else 0.0))
        return lines


@dataclass
class Step:
    """One node's evaluation: the edit that led to it, the tests, the session's state."""
    path: List[str]
    edit: Optional[str]
    tests: TestRun
    tests_total: int
    state: float
    session_restarted: bool
    remembered: List[str]
    score: float
    solved: bool
    commands: List[dict] = field(default_factory=list)

    def record(self) -> dict:
        return {"path": list(self.path), "edit": self.edit, "commands": self.commands,
                "tests_passed": self.tests.passed, "tests_total": self.tests_total,
                "tests_failed": self.tests.failed, "tests_seconds": round(self.tests.duration, 4),
                "state": round(self.state, 4), "session_restarted": self.session_restarted,
                "session_remembers": self.remembered, "score": round(self.score, 4),
                "solved": self.solved}


def _rng(*parts: object) -> random.Random:
    return random.Random(hashlib.sha256("|".join(str(p) for p in parts).encode()).hexdigest())


class Agent:
    """The scripted agent for one task. Deterministic: its proposals depend only on
    (seed, task, path), its samples on an explicit key."""

    def __init__(self, task: Task, seed: int = 0, k: int = 4, think: float = 0.0,
                 state_points: float = STATE_POINTS, timers: Optional[Timers] = None,
                 skill: float = SKILL, temperature: float = TEMPERATURE) -> None:
        self.task = task
        self.seed = seed
        self.k = k
        self.skill = skill
        self.temperature = temperature
        self.think_s = think
        self.state_points = state_points
        self.timers = timers or Timers()
        self.tests_total = 0  # set by evaluate_root
        self._edits = task.edits()

    # ---- the "LLM" ----

    def think(self) -> None:
        if self.think_s > 0:
            with self.timers.time("think"):
                time.sleep(self.think_s)

    def propose(self, path: Sequence[str]) -> List[Edit]:
        """k candidate edits at the node reached by path, best first (the agent's
        prior): a true fix of a line that is still wrong, if there is one, among
        plausible wrong edits. No candidate leaves its line as it is."""
        rng = _rng("propose", self.seed, self.task.id, "/".join(path))
        st = self.task.line_state(path)
        wrong_now = [m for m in self.task.sites if st[m.id] != "fix"]
        cands: List[Edit] = []
        if wrong_now:
            cands.append(self.task.edit(rng.choice(wrong_now).id, "fix"))
        pool = [e for e in self._edits.values()
                if e.variant != "fix" and st[e.mutation] != e.variant]
        pool.sort(key=lambda e: e.id)
        rng.shuffle(pool)
        fix = cands[:1]
        cands = pool[:max(0, self.k - len(fix))]
        if fix:
            # A somewhat competent model: the fix comes first with probability skill,
            # else anywhere.
            pos = 0 if rng.random() < self.skill else rng.randrange(len(cands) + 1)
            cands.insert(pos, fix[0])
        return cands

    def sample(self, path: Sequence[str], key: object,
               prefs: Optional[Dict[str, float]] = None) -> Edit:
        """One of the proposals, drawn with probability ~ exp((prefs[edit] - rank) / T):
        the agent's prior favours its first proposals; prefs (RL) shift it."""
        props = self.propose(path)
        prefs = prefs or {}
        w = [math.exp((prefs.get(e.id, 0.0) - i) / self.temperature) for i, e in enumerate(props)]
        r = _rng("sample", self.seed, self.task.id, "/".join(path), key).random() * sum(w)
        for e, wi in zip(props, w):
            r -= wi
            if r <= 0:
                return e
        return props[-1]

    # ---- acting in the sandbox ----

    def evaluate_root(self, sb: "Sandbox") -> Step:
        """Runs the relevant tests on the task as given; sets tests_total."""
        tr, rec = self._tests(sb)
        self.tests_total = tr.counted
        score = tr.passed + self.state_points
        return Step([], None, tr, self.tests_total, 1.0, False, [], score,
                    tr.passed == self.tests_total, [rec])

    def step(self, sb: "Sandbox", path: Sequence[str], edit: Edit) -> Step:
        """Applies edit at the node reached by path (the sandbox must be in that state),
        records it in the session, runs the tests, scores the new node."""
        if not self.tests_total:
            raise RuntimeError("evaluate_root first")
        new_path = list(path) + [edit.id]
        cmds = []
        argv = edit_argv(edit)
        with self.timers.time("edit"):
            sb.run(argv, cwd=REPO, timeout=60).check()
        cmds.append({"kind": "exec", "argv": argv, "cwd": REPO, "state_changing": True})
        remembered, restarted, rec = self._remember(sb, edit)
        cmds.append(rec)
        tr, rec = self._tests(sb)
        cmds.append(rec)
        state, score = node_score(tr.passed, self.tests_total, self.state_points, remembered, new_path)
        return Step(new_path, edit.id, tr, self.tests_total, state, restarted, remembered, score,
                    tr.passed >= self.tests_total and tr.counted == self.tests_total, cmds)

    def reward(self, score: float) -> float:
        """score in [0, 1], for the search."""
        return score / (self.tests_total + self.state_points)

    def _tests(self, sb: "Sandbox") -> Tuple[TestRun, dict]:
        with self.timers.time("tests"):
            return run_tests(sb, self.task.tests, self.task.kind)

    def _remember(self, sb: "Sandbox", edit: Edit) -> Tuple[List[str], bool, dict]:
        code = ("try:\n    _applied\nexcept NameError:\n    _applied = []\n"
                "_applied.append(%r)\n"
                "print('AGENT-STATE ' + ' '.join(_applied))\n" % edit.id)
        with self.timers.time("session"):
            r = _session_run(sb, code)
        remembered = parse_remembered(r.stdout)
        if r.exit_code != 0 or not remembered:
            raise RuntimeError("the agent's python session failed: %r" % (r.stdout,))
        return remembered, bool(r.session_restarted), {
            "kind": "session", "session": SESSION, "session_kind": "python", "code": code,
            "state_changing": True}


def parse_remembered(stdout: str) -> List[str]:
    """The session's memory as the agent's session code prints it (its last
    ``AGENT-STATE`` line)."""
    remembered: List[str] = []
    for line in stdout.splitlines():
        if line.startswith("AGENT-STATE"):
            remembered = line.split()[1:]
    return remembered


def node_score(tests_passed: int, tests_total: int, state_points: float,
               remembered: Sequence[str], path: Sequence[str]) -> tuple:
    """(state, score) of a node: state is 1 when the session remembers exactly the
    node's path; score = tests passed (at most tests_total) + state_points x state."""
    state = 1.0 if list(remembered) == list(path) else 0.0
    return state, min(tests_passed, tests_total) + state_points * state


def _session_run(sb: "Sandbox", code: str) -> "Result":
    """Runs code in the agent's python session, starting it if the sandbox has none
    (a new or forked sandbox). A checkpoint or restore that ended it restarts it."""
    from deltabox import NotFound
    try:
        return sb.run(code, session=SESSION, timeout=60)
    except NotFound:
        sb.sessions.start(SESSION, kind="python")
        return sb.run(code, session=SESSION, timeout=60)


def setup_task(sb: "Sandbox", agent: Agent) -> Tuple[dict, Step]:
    """Puts the agent's task into the sandbox (its files as a git repository at
    /workspace/repo) and evaluates the root: returns (install record, root Step)."""
    from .workspace import install
    task = agent.task
    with agent.timers.time("setup"):
        rec = install(sb, task.files, task.kind.install_message, workload=task.workload)
    root = agent.evaluate_root(sb)
    return rec, root
