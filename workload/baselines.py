"""Replays a recorded tree search (the ``trajectory.json`` of examples/mcts.py) with
other ways of managing state than DeltaBox's, for ``deltabox bench mcts``.

The replay makes the same nodes in the same order as the recorded search: after the
task's root state is set up (the recorded install command, with its tarball
regenerated from the task's spec and checked against the recorded sha256, then the
root's test run), it checkpoints the root, then follows the recorded events: an
``expand`` thinks (``--think`` seconds of real wall time, as the agent does), runs the
node's recorded commands as the agent ran them (apply the edit, record it in the
python session, run the tests), scores the node exactly as the agent does
(:func:`workload.agent.node_score`) and checkpoints it; a ``rollback`` goes back to a
node. Every command runs in a plain DeltaBox sandbox used as a machine (exec and
sessions only, no DeltaBox checkpoint unless the system is DeltaBox's filesystem
rollback), so commands and scores run in exactly the environment of the recorded
search. Systems (``--system``):

``isolated``
    the reference, no checkpoints: for each node, its parent's state is rebuilt from
    scratch (the install command again, a fresh python session, then every recorded
    state-changing command of the path: edits and session calls), untimed; then the
    node's own commands run, timed. Gives each node's reference score and the time
    of the search's commands without any state management.
``copytree+replay``
    checkpoint: ``cp -a --reflink=auto /workspace /snap/N`` in the sandbox; rollback:
    ``rm -rf /workspace && cp -a --reflink=auto /snap/N /workspace``, the python
    session killed; before the next session call a fresh session replays the path's
    recorded session code (one call, the codes concatenated) to rebuild its memory.
``fs-only+replay``
    DeltaBox's filesystem checkpoint and restore with no process state: the session is
    killed before each checkpoint (so the node holds no process template), and a
    fresh session replays the path's session code before the next session call (after
    a rollback, and after a checkpoint when the chain goes on).
``fs-only``
    the negative control: as fs-only+replay without the replay, so the fresh session
    forgets the path and nodes of depth >= 2 score lower.
``git-reset+replay``
    checkpoint: ``git add -A && git commit`` of /workspace/repo in a separate git
    directory (/snapgit; the repository's own .git, which the agent never changes, is
    not tracked); rollback: ``git reset --hard C && git clean -ffdx`` and the session
    replay as above.
``criu+copytree``
    files as copytree+replay; the session is a python process on the host (the same
    exec-in-one-globals loop as the daemon's python session) that CRIU dumps at each
    checkpoint (``criu dump --leave-running``, images on tmpfs) and restores at each
    rollback (``criu restore -d`` with its stdin and stdout pipes handed over by
    ``--inherit-fd``): no replay. CRIU cannot dump the sandbox's own session (``Can't
    dump a pid namespace without the process init``).

    python3 -m workload.baselines --trajectory T --system S [--think S] [--out FILE]

writes one JSON object: totals (``total_s`` from the root's checkpoint to the end,
``think_total_s``, ``state_s`` = checkpoint + rollback + replay, ``commands_s`` = the
nodes' edits, session calls and tests), per-operation timers, every node's score,
and ``commands``: the exact commands used for state management.
"""

import argparse
import base64
import ctypes
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import IO, TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .agent import SESSION, STATE_POINTS, Timers, node_score, parse_remembered
from .tasks import TEST_TIMEOUT, make_task, test_result
from .workspace import GIT_USER, Workload, install_command, run_install

if TYPE_CHECKING:  # the client is imported by the examples (clients/python on sys.path)
    from deltabox import CheckpointResult, Result, Sandbox

SYSTEMS = ("isolated", "copytree+replay", "fs-only+replay", "fs-only", "git-reset+replay",
           "criu+copytree")
WORKSPACE = "/workspace"
SNAP = "/snap"
GITDIR = "/snapgit"
WORKTREE = "/workspace/repo"
DEFAULT_CRIU = "/opt/deltabox/criu/sbin/criu"
STATE_TIMERS = ("checkpoint", "rollback", "replay")
COMMAND_TIMERS = ("edit", "session", "tests")


class ReplayError(RuntimeError):
    pass


# ---- the recorded search -------------------------------------------------------------------

class Plan:
    """A trajectory.json: nodes by id, the expand/rollback events in order."""

    def __init__(self, d: dict) -> None:
        self.d = d
        self.nodes = d["nodes"]
        for i, n in enumerate(self.nodes):
            if n.get("id") != i:
                raise ReplayError("trajectory: node %d has id %r" % (i, n.get("id")))
        self.events = [e for e in d["events"] if e["type"] in ("expand", "rollback")]
        self.config = d.get("config") or {}
        sp = self.config.get("state_points")
        self.state_points = STATE_POINTS if sp is None else float(sp)
        self.tests_total = int(d["setup"]["tests_total"])
        if not self.tests_total:
            raise ReplayError("trajectory: the root ran no test")
        self._install: Optional[dict] = None

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            return cls(json.load(f))

    def ancestors(self, nid: int) -> List[int]:
        """Node ids from the root's first descendant down to nid (root excluded)."""
        out = []
        while nid:
            out.append(nid)
            nid = self.nodes[nid]["parent"]
        return out[::-1]

    def session_codes(self, nid: int) -> List[str]:
        """The recorded state-changing session code of the path to nid, in order."""
        return [c["code"] for a in self.ancestors(nid) for c in self.nodes[a]["commands"]
                if c["kind"] == "session" and c.get("state_changing")]

    def install(self) -> dict:
        """The recorded install command with its stdin regenerated from the task's spec
        (the recorded sha256 of the tarball must match); made once."""
        if self._install is not None:
            return self._install
        rec = dict(self.d["setup"]["commands"][0])
        spec = self.d["task"]
        name = spec.get("workload") or "jsonlib"
        wl = Workload.load(name)
        task = make_task(wl, seed=spec["seed"], n_bugs=len(spec["bugs"]), bugs=spec["bugs"])
        cmd = install_command(task.files, "regenerated", workload=name)
        if cmd["tar_sha256"] != rec.get("tar_sha256"):
            raise ReplayError("the task's files regenerated from its spec differ from the recorded "
                              "ones (tar sha256 %s, recorded %s)" % (cmd["tar_sha256"], rec.get("tar_sha256")))
        if "upload" in cmd:
            rec["blob"] = cmd["blob"]
        else:
            rec["stdin"] = cmd["stdin"]
        self._install = rec
        return rec

    def root_tests(self) -> dict:
        return self.d["setup"]["commands"][1]


# ---- sessions --------------------------------------------------------------------------------

class ApiSession:
    """The agent's python session in the sandbox, through the daemon's API."""

    def __init__(self, sb: "Sandbox") -> None:
        self.sb = sb
        self.alive = False

    def start(self) -> None:
        self.sb.sessions.start(SESSION, kind="python")
        self.alive = True

    def kill(self) -> None:
        from deltabox import NotFound
        try:
            self.sb.sessions.kill(SESSION)
        except NotFound:
            pass
        self.alive = False

    def call(self, code: str) -> str:
        r = self.sb.run(code, session=SESSION, timeout=60)
        if r.exit_code != 0 or r.session_restarted:
            raise ReplayError("session call failed (exit %d, restarted %s): %s"
                              % (r.exit_code, r.session_restarted, r.stdout[-500:]))
        return r.stdout

    def close(self) -> None:
        pass


# The host session: the daemon's python session loop (exec in one globals dict), over
# pipes instead of a terminal. One request line: "ID BASE64(code)"; the answer is the
# code's output, then a sentinel line.
CRIU_DRIVER = r"""
import base64, sys, traceback
g = {"__name__": "__main__", "__builtins__": __builtins__}
while True:
    line = sys.stdin.readline()
    if not line:
        break
    cid, _, b64 = line.strip().partition(" ")
    rc = 0
    try:
        exec(compile(base64.b64decode(b64).decode(), "<session>", "exec"), g)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        rc = 1
    sys.stdout.write("\x1eDBX:%s:%d\x1e\n" % (cid, rc))
    sys.stdout.flush()
"""


class CriuSession:
    """The agent's python session as a host process, checkpointed with CRIU."""

    def __init__(self, criu: str, images: str) -> None:
        self.criu = criu
        self.images = images
        self.alive = False
        self.pid = 0
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.win: Optional[IO[bytes]] = None
        self.rout: Optional[IO[bytes]] = None
        self.keys: Dict[str, tuple] = {}
        self.seq = 0
        self.dump_bytes = 0
        # Restored processes are reparented to us (criu restore -d exits), so that
        # we can reap them.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
            raise ReplayError("prctl(PR_SET_CHILD_SUBREAPER) failed: errno %d" % ctypes.get_errno())

    def argv(self) -> List[str]:
        return [sys.executable, "-u", "-c", CRIU_DRIVER]

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid
        self.win, self.rout = self.proc.stdin, self.proc.stdout
        self.alive = True

    def call(self, code: str) -> str:
        if self.win is None or self.rout is None:
            raise ReplayError("the host session is not running")
        self.seq += 1
        self.win.write(("%d %s\n" % (self.seq, base64.b64encode(code.encode()).decode())).encode())
        self.win.flush()
        out: List[bytes] = []
        while True:
            line = self.rout.readline()
            if not line:
                raise ReplayError("the host session ended")
            if line.startswith(b"\x1eDBX:"):
                rc = int(line.strip().strip(b"\x1e").split(b":")[2])
                if rc != 0:
                    raise ReplayError("session call failed: %s" % b"".join(out).decode()[-500:])
                return b"".join(out).decode()
            out.append(line)

    def dump(self, key: str) -> None:
        d = os.path.join(self.images, key)
        os.makedirs(d)
        keys = (os.readlink("/proc/%d/fd/0" % self.pid), os.readlink("/proc/%d/fd/1" % self.pid))
        _criu([self.criu, "dump", "-t", str(self.pid), "-D", d, "--leave-running", "-o", "dump.log"],
              "criu dump of pid %d" % self.pid, d, "dump.log")
        self.keys[key] = keys

    def kill(self) -> None:
        if not self.pid:
            return
        os.kill(self.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
            self.proc = None
        else:
            os.waitpid(self.pid, 0)
        for f in (self.win, self.rout):
            if f is not None:
                f.close()
        self.win = self.rout = None
        self.alive = False

    def restore(self, key: str) -> None:
        d = os.path.join(self.images, key)
        k_in, k_out = self.keys[key]
        r0, w0 = os.pipe()
        r1, w1 = os.pipe()
        try:
            _criu([self.criu, "restore", "-D", d, "-d", "-o", "restore.log",
                   "--inherit-fd", "fd[%d]:%s" % (r0, k_in), "--inherit-fd", "fd[%d]:%s" % (w1, k_out)],
                  "criu restore from %s" % d, d, "restore.log", pass_fds=(r0, w1))
        except BaseException:
            os.close(w0)
            os.close(r1)
            raise
        finally:
            os.close(r0)
            os.close(w1)
        self.win, self.rout = os.fdopen(w0, "wb"), os.fdopen(r1, "rb")
        self.alive = True

    def close(self) -> None:
        if self.alive:
            self.kill()
        self.dump_bytes = _du(self.images)
        shutil.rmtree(self.images, ignore_errors=True)


# A dump or restore of the host session takes about 0.1 s here: 30 s is a hang. On a
# machine that does not deliver hardware breakpoints a plain CRIU waits for ever for the
# trap; the bench then passes CRIU_FAULT=130 (criu.Probe in Go found that it works) in
# our environment, which CRIU inherits.
CRIU_TIMEOUT = 30


def _criu(argv: List[str], what: str, d: str, log: str, pass_fds: Sequence[int] = ()) -> None:
    """Runs a CRIU command in its own process group; past CRIU_TIMEOUT the group is
    killed and the error says what hung, with the end of its log."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=pass_fds,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=CRIU_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        if p.stdout is not None:
            p.stdout.close()
        hint = ("it already ran with CRIU_FAULT=130" if os.environ.get("CRIU_FAULT") == "130" else
                "if the log ends after \"Can't setup RLIMIT_NOFILE\", this machine does not deliver hardware "
                "breakpoints: run CRIU with CRIU_FAULT=130")
        raise ReplayError("%s did not finish within %d s (killed with its process group); the end of its log: %s; %s"
                          % (what, CRIU_TIMEOUT, _log_tail(d, log), hint))
    if p.returncode != 0:
        raise ReplayError("%s failed (exit %d): %s %s" % (what, p.returncode, _log_errors(d, log),
                                                          out.decode(errors="replace")[-300:]))


def _log_tail(d: str, name: str) -> str:
    try:
        with open(os.path.join(d, name)) as f:
            return repr(f.read()[-500:].strip())
    except OSError as e:
        return "(no log: %s)" % e


# The agent's session, through the daemon or as a host process.
AnySession = Union[ApiSession, CriuSession]


def _log_errors(d: str, name: str) -> str:
    try:
        with open(os.path.join(d, name)) as f:
            lines = [ln.strip() for ln in f if "Error" in ln and "RLIMIT_NOFILE" not in ln]
        return " | ".join(lines[-5:]) or "(no error lines in %s)" % name
    except OSError as e:
        return str(e)


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


# ---- systems ---------------------------------------------------------------------------------

class System:
    """How a system checkpoints, rolls back and rebuilds the session."""
    name = ""
    replay = True  # rebuild a fresh session's memory by replaying the path's session code
    commands: List[str] = []

    def __init__(self, r: "Runner") -> None:
        self.r = r
        self.sb = r.sb

    def make_session(self) -> AnySession:
        return ApiSession(self.sb)

    def setup(self) -> None:
        pass

    def checkpoint(self, nid: int) -> None:
        raise NotImplementedError

    def rollback(self, nid: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def exec(self, argv: List[str]) -> None:
        res = self.sb.run(argv, cwd="/", timeout=TEST_TIMEOUT)
        if res.exit_code != 0:
            raise ReplayError("%s: %s failed (exit %d): %s%s" % (self.name, shlex.join(argv), res.exit_code,
                                                                  res.stdout[-300:], res.stderr[-300:]))


API_EXEC = "POST /v1/sandboxes/{id}/exec"
API_KILL = "DELETE /v1/sandboxes/{id}/sessions/agent"
API_START = "POST /v1/sandboxes/{id}/sessions {name: agent, kind: python}"
REPLAY_CALL = ("one call in it (POST /v1/sandboxes/{id}/exec with session agent) of the path's "
               "recorded session code, concatenated")


def cp_snap(n: object) -> List[str]:
    return ["cp", "-a", "--reflink=auto", WORKSPACE, "%s/%s" % (SNAP, n)]


def cp_back(n: object) -> List[str]:
    return ["bash", "-c", "rm -rf %s && cp -a --reflink=auto %s/%s %s" % (WORKSPACE, SNAP, n, WORKSPACE)]


class CopyTree(System):
    name = "copytree+replay"
    commands = [
        "checkpoint: exec `%s` in the sandbox (%s)" % (shlex.join(cp_snap("N")), API_EXEC),
        "rollback: exec `%s` in the sandbox, then %s" % (shlex.join(cp_back("N")), API_KILL),
        "replay, before the next session call: %s, then %s" % (API_START, REPLAY_CALL),
    ]

    def setup(self) -> None:
        self.exec(["mkdir", "-p", SNAP])

    def checkpoint(self, nid: int) -> None:
        self.exec(cp_snap(nid))

    def rollback(self, nid: int) -> None:
        self.exec(cp_back(nid))
        self.r.kill_session("rollback")


class FSOnly(System):
    """DeltaBox's filesystem checkpoints, the session killed first (no template)."""
    name = "fs-only+replay"
    commands = [
        "checkpoint: %s, then sb.checkpoint(label): POST /v1/sandboxes/{id}/checkpoint (no session "
        "runs, so the node holds files only)" % API_KILL,
        "rollback: sb.restore(node): POST /v1/sandboxes/{id}/restore",
        "replay, before the next session call: %s, then %s" % (API_START, REPLAY_CALL),
    ]

    def __init__(self, r: "Runner") -> None:
        super().__init__(r)
        self.ckpts: Dict[int, CheckpointResult] = {}

    def checkpoint(self, nid: int) -> None:
        self.r.kill_session("checkpoint")
        self.ckpts[nid] = self.sb.checkpoint(label="n%d" % nid)

    def rollback(self, nid: int) -> None:
        self.sb.restore(self.ckpts[nid])

    def close(self) -> None:
        self.r.after_close.append(lambda: self.ckpts and self.sb.client.remove_checkpoint(self.ckpts[0].id))


class FSOnlyNoReplay(FSOnly):
    name = "fs-only"
    replay = False
    commands = FSOnly.commands[:2] + [
        "before the next session call: %s (a fresh session, no replay: it forgets the path)" % API_START]


def git(*args: str) -> str:
    return shlex.join(["git", "--git-dir=" + GITDIR, "--work-tree=" + WORKTREE] + GIT_USER + list(args))


class GitReset(System):
    name = "git-reset+replay"
    commands = [
        "checkpoint: exec `bash -c '%s && %s && %s'` in the sandbox (%s)" % (
            git("add", "-A"), git("commit", "-q", "--allow-empty", "-m", "nN"), git("rev-parse", "HEAD"), API_EXEC),
        "rollback: exec `bash -c '%s && %s'` in the sandbox, then %s" % (
            git("reset", "-q", "--hard", "C"), git("clean", "-ffdxq"), API_KILL),
        "replay, before the next session call: %s, then %s" % (API_START, REPLAY_CALL),
    ]

    def __init__(self, r: "Runner") -> None:
        super().__init__(r)
        self.commits: Dict[int, str] = {}

    def setup(self) -> None:
        self.exec(["bash", "-c", git("init", "-q")])

    def checkpoint(self, nid: int) -> None:
        res = self.sb.run(["bash", "-c", "%s && %s && %s" % (
            git("add", "-A"), git("commit", "-q", "--allow-empty", "-m", "n%d" % nid), git("rev-parse", "HEAD"))],
            cwd="/", timeout=TEST_TIMEOUT)
        if res.exit_code != 0:
            raise ReplayError("git commit failed: %s%s" % (res.stdout[-300:], res.stderr[-300:]))
        self.commits[nid] = res.stdout.strip().splitlines()[-1]

    def rollback(self, nid: int) -> None:
        self.exec(["bash", "-c", "%s && %s" % (git("reset", "-q", "--hard", self.commits[nid]),
                                               git("clean", "-ffdxq"))])
        self.r.kill_session("rollback")


class CriuCopyTree(CopyTree):
    name = "criu+copytree"
    replay = False

    def __init__(self, r: "Runner") -> None:
        super().__init__(r)
        self.criu = r.args.criu
        self.images = os.path.join(r.args.images, "deltabox-bench-criu-%d" % os.getpid())
        # CRIU_FAULT=130 when the bench's self-test found no hardware breakpoints here.
        criu_cmd = self.criu
        if os.environ.get("CRIU_FAULT"):
            criu_cmd = "CRIU_FAULT=%s %s" % (os.environ["CRIU_FAULT"], self.criu)
        self.commands = [
            "checkpoint: exec `%s` in the sandbox (%s), then `%s dump -t PID -D %s/N --leave-running "
            "-o dump.log` of the host session process" % (
                shlex.join(cp_snap("N")), API_EXEC, criu_cmd, self.images),
            "rollback: exec `%s` in the sandbox, then kill -9 PID, then `%s restore -D %s/N -d -o "
            "restore.log --inherit-fd fd[R]:pipe:[IN] --inherit-fd fd[W]:pipe:[OUT]` (new stdin and "
            "stdout pipes for the restored process)" % (
                shlex.join(cp_back("N")), criu_cmd, self.images),
        ]

    def make_session(self) -> AnySession:
        if not os.access(self.criu, os.X_OK):
            raise ReplayError("no CRIU at %s" % self.criu)
        os.makedirs(self.images)
        return CriuSession(self.criu, self.images)

    def host_session(self) -> CriuSession:
        s = self.r.session
        if not isinstance(s, CriuSession):
            raise ReplayError("criu+copytree runs with a host session, not %s" % type(s).__name__)
        return s

    def checkpoint(self, nid: int) -> None:
        self.exec(cp_snap(nid))
        self.host_session().dump(str(nid))

    def rollback(self, nid: int) -> None:
        self.exec(cp_back(nid))
        s = self.host_session()
        s.kill()
        s.restore(str(nid))


# ---- the replay ------------------------------------------------------------------------------

class Runner:
    def __init__(self, plan: Plan, system: str, think: float, args) -> None:
        self.plan = plan
        self.system_name = system
        self.think = think
        self.args = args
        self.timers = Timers()
        self._sb: Optional[Sandbox] = None
        self.sys: Optional[System] = None
        self._session: Optional[AnySession] = None
        self.scores: Dict[int, dict] = {}
        self.after_close: List[Callable[[], object]] = []
        self.dead_since = ""  # what ended the session last: rollback or checkpoint
        self.replays = {"rollback": [0, 0.0], "checkpoint": [0, 0.0], "start": [0, 0.0]}
        self.replay_mismatch = 0
        self.uploaded: set = set()  # install tarballs already in the sandbox (by sha256)
        self.info: Dict[str, object] = {}
        self.log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))

    @property
    def sb(self) -> "Sandbox":
        """The sandbox (run() makes it)."""
        if self._sb is None:
            raise ReplayError("no sandbox yet: Runner.run makes it")
        return self._sb

    @property
    def session(self) -> AnySession:
        """The agent's session (run() makes it)."""
        if self._session is None:
            raise ReplayError("no session yet: Runner.run makes it")
        return self._session

    # -- helpers used by the systems --

    def kill_session(self, why: str) -> None:
        self.session.kill()
        self.dead_since = why

    def ensure_session(self, parent: int) -> None:
        """Before a session call at a child of parent: a session whose memory is
        parent's path (a fresh one that replays it, when the system lost it)."""
        if self.session.alive:
            return
        t0 = time.perf_counter()
        with self.timers.time("replay"):
            self.session.start()
            codes = self.plan.session_codes(parent) if self.sys is None or self.sys.replay else []
            # With nothing to replay, an empty call still waits for the new session to
            # be ready, so that its start-up counts here, not in the node's own call.
            out = self.session.call("".join(codes) or "pass\n")
            if codes:
                want = [self.plan.nodes[a]["edit"] for a in self.plan.ancestors(parent)]
                if parse_remembered(out) != want:
                    self.replay_mismatch += 1
        k = self.replays[self.dead_since or "start"]
        k[0] += 1
        k[1] += time.perf_counter() - t0

    # -- commands --

    def run_exec(self, c: dict) -> "Result":
        return self.sb.run(c["argv"], cwd=c.get("cwd"), env=c.get("env"), stdin=c.get("stdin"),
                           timeout=TEST_TIMEOUT)

    def step(self, nid: int) -> dict:
        """Runs node nid's recorded commands (its parent's state is the current one)
        and scores it as the agent does."""
        node = self.plan.nodes[nid]
        tr = None
        remembered: Optional[List[str]] = None
        for c in node["commands"]:
            if c["kind"] == "exec":
                name = "edit" if c.get("state_changing") else "tests"
                with self.timers.time(name):
                    res = self.run_exec(c)
                if c.get("state_changing"):
                    if res.exit_code != 0:
                        raise ReplayError("node %d: %s failed: %s" % (nid, c["argv"][:3], res.stderr[-300:]))
                else:
                    tr = test_result(res)
            elif c["kind"] == "session":
                self.ensure_session(node["parent"])
                with self.timers.time("session"):
                    out = self.session.call(c["code"])
                remembered = parse_remembered(out)
            else:
                raise ReplayError("node %d: unknown command kind %r" % (nid, c["kind"]))
        if tr is None or remembered is None:
            raise ReplayError("node %d: no test run or no session call recorded" % nid)
        state, score = node_score(tr.passed, self.plan.tests_total, self.plan.state_points,
                                  remembered, node["path"])
        rec = {"id": nid, "score": score, "tests_passed": tr.passed, "state": state}
        self.scores[nid] = rec
        return rec

    def setup(self) -> None:
        """The task's root state in a fresh sandbox: the recorded install command and
        the root's tests (untimed)."""
        inst = self.plan.install()
        res = run_install(self.sb, inst, self.uploaded)
        if res.exit_code != 0:
            raise ReplayError("install failed: %s%s" % (res.stdout[-300:], res.stderr[-300:]))
        tr = test_result(self.run_exec(self.plan.root_tests()))
        self.scores[0] = {"id": 0, "score": tr.passed + self.plan.state_points, "tests_passed": tr.passed,
                          "state": 1.0}

    def measure_machine(self) -> None:
        """Untimed facts for the result: the workspace's size, an exec's round trip."""
        res = self.sb.run(["bash", "-c", "find %s | wc -l; du -sb %s | cut -f1" % (WORKSPACE, WORKSPACE)])
        lines = res.stdout.split()
        if len(lines) == 2:
            self.info["workspace_entries"] = int(lines[0])
            self.info["workspace_bytes"] = int(lines[1])
        xs = []
        for _ in range(10):
            t0 = time.perf_counter()
            self.sb.run(["true"])
            xs.append(1000 * (time.perf_counter() - t0))
        self.info["exec_true_p50_ms"] = round(statistics.median(xs), 3)

    def run(self) -> dict:
        from deltabox import Sandbox, default_client
        client = default_client()
        t_start = time.perf_counter()
        try:
            with Sandbox.create(client=client) as sb:
                self._sb = sb
                self.info["sandbox"] = sb.id
                if self.system_name == "isolated":
                    self._session = ApiSession(sb)
                    out = self.run_isolated()
                else:
                    system = {"copytree+replay": CopyTree, "fs-only+replay": FSOnly, "fs-only": FSOnlyNoReplay,
                              "git-reset+replay": GitReset, "criu+copytree": CriuCopyTree}[self.system_name](self)
                    self.sys = system
                    self._session = session = system.make_session()
                    try:
                        out = self.run_search(system)
                    finally:
                        session.close()
                        system.close()
        finally:
            for f in self.after_close:  # after the sandbox is gone: its checkpoints
                try:
                    f()
                except Exception as e:  # reported, not fatal
                    print("note: cleanup failed: %s" % e, file=sys.stderr)
        if isinstance(self._session, CriuSession):
            out["info"]["criu_images_bytes"] = self._session.dump_bytes
        out["wall_s"] = round(time.perf_counter() - t_start, 4)
        return out

    def run_search(self, system: System) -> dict:
        t0 = time.perf_counter()
        self.setup()
        system.setup()
        self.measure_machine()
        self.session.start()
        self.session.call("pass\n")
        setup_s = time.perf_counter() - t0
        self.log("%s: root state ready in %.2f s; replaying %d events" % (self.system_name, setup_s,
                                                                         len(self.plan.events)))
        t0 = time.perf_counter()
        with self.timers.time("checkpoint"):
            system.checkpoint(0)
        cur = 0
        n = 0
        for ev in self.plan.events:
            if ev["type"] == "expand":
                nid = ev["node"]
                if self.plan.nodes[nid]["parent"] != cur:
                    raise ReplayError("event %r: the replay stands on node %d" % (ev, cur))
                if self.think > 0:
                    with self.timers.time("think"):
                        time.sleep(self.think)
                self.step(nid)
                with self.timers.time("checkpoint"):
                    system.checkpoint(nid)
                cur = nid
                n += 1
                if n % 20 == 0:
                    self.log("%s: %d nodes, %.1f s" % (self.system_name, n, time.perf_counter() - t0))
            else:
                with self.timers.time("rollback"):
                    system.rollback(ev["node"])
                cur = ev["node"]
        total = time.perf_counter() - t0
        return self.result(total, setup_s)

    def run_isolated(self) -> dict:
        """Every node from scratch: parent state rebuilt by re-running recorded
        commands (untimed), then the node's own commands (timed)."""
        t0 = time.perf_counter()
        self.setup()
        self.measure_machine()
        setup_s = time.perf_counter() - t0
        per_node = {}
        t0 = time.perf_counter()
        for nid in range(1, len(self.plan.nodes)):
            parent = self.plan.nodes[nid]["parent"]
            with self.timers.time("rebuild"):
                res = run_install(self.sb, self.plan.install(), self.uploaded)
                if res.exit_code != 0:
                    raise ReplayError("install failed: %s" % res.stderr[-300:])
                self.session.kill()
                self.session.start()
                self.session.call("pass\n")  # ready before the timed call
                for a in self.plan.ancestors(parent):
                    for c in self.plan.nodes[a]["commands"]:
                        if not c.get("state_changing"):
                            continue
                        if c["kind"] == "exec":
                            if self.run_exec(c).exit_code != 0:
                                raise ReplayError("node %d: replaying %s failed" % (a, c["argv"][:3]))
                        else:
                            self.session.call(c["code"])
            before = {k: self.timers.get(k) for k in COMMAND_TIMERS}
            self.step(nid)
            per_node[nid] = round(sum(self.timers.get(k) - before[k] for k in COMMAND_TIMERS), 4)
            if nid % 20 == 0:
                self.log("isolated: %d nodes, %.1f s" % (nid, time.perf_counter() - t0))
        out = self.result(time.perf_counter() - t0, setup_s)
        for rec in out["nodes"]:
            rec["commands_s"] = per_node.get(rec["id"], 0.0)
        out["commands"] = ["none (no checkpoint): each node's parent state rebuilt untimed from the "
                           "recorded install command, a fresh session and the path's recorded "
                           "state-changing commands"]
        return out

    def result(self, total: float, setup_s: float) -> dict:
        t = self.timers
        state_s = sum(t.get(k) for k in STATE_TIMERS)
        commands_s = sum(t.get(k) for k in COMMAND_TIMERS)
        info = dict(self.info)
        info["setup_s"] = round(setup_s, 4)
        for k in STATE_TIMERS:
            if t.count.get(k):
                info["%s_n" % k] = t.count[k]
                info["%s_mean_ms" % k] = round(1000 * t.get(k) / t.count[k], 3)
        if self.sys is not None:
            for why, (cnt, sec) in self.replays.items():
                if cnt:
                    info["session_rebuilds_after_" + why] = cnt
                    info["session_rebuilds_after_%s_s" % why] = round(sec, 4)
            if self.replay_mismatch:
                info["replayed_memory_mismatches"] = self.replay_mismatch
            info["replay"] = self.sys.replay
        if isinstance(self._session, CriuSession):
            info["session"] = ("host process `%s -u -c DRIVER` (the daemon's python session loop over "
                               "pipes), pid %d" % (sys.executable, self._session.pid))
        return {
            "system": self.system_name,
            "think_s": self.think,
            "total_s": round(total, 4),
            "think_total_s": round(t.get("think"), 4),
            "state_s": round(state_s, 4),
            "commands_s": round(commands_s, 4),
            "timers": t.summary(),
            "nodes": [self.scores[i] for i in sorted(self.scores)],
            "commands": list(self.sys.commands) if self.sys is not None else [],
            "info": info,
        }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectory", required=True, help="trajectory.json of examples/mcts.py")
    ap.add_argument("--system", required=True, choices=SYSTEMS)
    ap.add_argument("--think", type=float, default=None,
                    help="seconds of think per expansion (default: the trajectory's)")
    ap.add_argument("--out", default=None, help="write the result here (default: stdout)")
    ap.add_argument("--criu", default=DEFAULT_CRIU, help="the criu binary (criu+copytree)")
    ap.add_argument("--images", default="/dev/shm", help="where criu+copytree puts its images (tmpfs)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    plan = Plan.load(a.trajectory)
    think = float(plan.config.get("think") or 0.0) if a.think is None else a.think
    out = Runner(plan, a.system, think, a).run()
    out["trajectory"] = os.path.abspath(a.trajectory)
    text = json.dumps(out, indent=1) + "\n"
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, a.out)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
