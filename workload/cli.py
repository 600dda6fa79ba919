"""What the examples share: common options, the task, the header, cleanup."""

import argparse
import contextlib
import sys
from typing import Iterator, List

from .tasks import make_task
from .workspace import Workload


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--short", action="store_true",
                    help="a few nodes, for CI (smaller defaults; explicit options still win)")
    ap.add_argument("--think", type=float, default=0.0,
                    help="seconds of real wall time per agent step, standing in for the LLM call "
                         "(0; 2 is a paper-like setting)")
    ap.add_argument("--seed", type=int, default=0, help="task and agent seed (default 0)")
    ap.add_argument("--bugs", type=int, default=None, help="bugs to inject (default 2, short 1)")
    ap.add_argument("--workload", default="jsonlib",
                    help="jsonlib (CPython's json package, default) or django (Django 4.2's "
                         "repository, its test suite and environment; scripts/setup.sh prepares both)")
    ap.add_argument("--task", default=None,
                    help="inject these catalogue mutations (comma-separated ids) instead of "
                         "seeded ones; python3 -m workload.tasks lists them")
    ap.add_argument("--k", type=int, default=None, help="proposals per node (default 4, short 3)")
    ap.add_argument("--out", default=None,
                    help="directory (or .json path) for trajectory.json (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the checkpoints in the daemon's tree (default: removed at the end)")
    ap.add_argument("--state-points", type=float, default=None,
                    help="score points for an intact session memory (default 2)")
    ap.add_argument("--quiet", action="store_true", help="no line per step")
    ap.add_argument("--template-budget-mb", type=int, default=None,
                    help="the sandbox's template_budget_mb: over it, nodes whose durable image "
                         "is complete lose their templates and restore from the image "
                         "(default: the daemon's)")
    return ap


def pick(value, full, short, is_short: bool):
    """An option's value: explicit, else the short or the full default."""
    if value is not None:
        return value
    return short if is_short else full


def agent(args, task, k, timers):
    from .agent import STATE_POINTS, Agent
    sp = STATE_POINTS if args.state_points is None else args.state_points
    return Agent(task, seed=args.seed, k=k, think=args.think, state_points=sp, timers=timers)


def load_task(args):
    wl = Workload.load(args.workload)
    n_bugs = pick(args.bugs, 2, 1, args.short)
    bugs = [b for b in args.task.split(",") if b] if args.task else None
    task = make_task(wl, seed=args.seed, n_bugs=len(bugs) if bugs else n_bugs, bugs=bugs)
    return wl, task


def header(name: str, wl, task, extra: List[str]) -> None:
    src = wl.manifest.get("sources", {})
    print("== %s" % name)
    if wl.name == "jsonlib":
        print("workload: %s (%s; tests: %s)" % (wl.name, src.get("json_from", "?"), src.get("tests_from", "?")))
    else:
        print("workload: %s (%s)" % (wl.name, src.get("orig", src.get("orig_top", "?"))))
    print("task: %s: %d bug(s): %s" % (task.id, len(task.bugs), task.describe()))
    print("relevant tests: %s" % " ".join(task.tests))
    for line in extra:
        print(line)
    sys.stdout.flush()


@contextlib.contextmanager
def cleanup_nodes(client, keep: bool) -> Iterator[list]:
    """Yields a list to append root checkpoint ids to; removes their subtrees at the
    end (after the sandboxes are gone) unless keep."""
    roots: list = []
    try:
        yield roots
    finally:
        if not keep:
            for r in roots:
                try:
                    client.remove_checkpoint(r)
                except Exception as e:  # reported, not fatal
                    print("note: could not remove checkpoint %s: %s" % (r, e), file=sys.stderr)


def client():
    from deltabox import default_client
    return default_client()



def run_main(main) -> int:
    """Runs an example's main, turning the two errors a user can fix (no daemon, no
    prepared workload) into one line each."""
    from deltabox import DaemonUnreachable

    from .workspace import WorkloadMissing
    try:
        return main()
    except (DaemonUnreachable, WorkloadMissing) as e:
        print("error: %s" % e, file=sys.stderr)
        return 2


def fork_paths(sandboxes) -> str:
    """What the branches of a fork kept: how many took each path, and the first reason
    of each (Sandbox.fork_branch: "durable", the node's processes at their PIDs, or
    "files", its files only)."""
    counts: dict = {}
    for sb in sandboxes:
        b = sb.fork_branch
        path, why = (b.path, b.reason) if b is not None else ("?", "not made by a fork")
        n, _ = counts.get(path, (0, why))
        counts[path] = (n + 1, why)
    return "fork paths: " + "; ".join("%d %s (%s)" % (n, p, why) for p, (n, why) in sorted(counts.items()))
