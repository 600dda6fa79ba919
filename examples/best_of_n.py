#!/usr/bin/env python3
"""Best-of-N from one checkpoint: the task's start state is checkpointed once, N
sandboxes are forked from it, and N sampled attempts of the scripted agent run at once
(each up to --steps edits, stopping when the tests pass); the best final state wins
and the first sandbox is rolled over to it.

    python3 examples/best_of_n.py            # N=8 attempts of up to 4 steps
    python3 examples/best_of_n.py --short    # N=2, 2 steps: CI
    python3 examples/best_of_n.py --think 2  # 2 s of "LLM call" per step

Needs the daemon ($DELTABOX_SOCKET, else /run/deltabox/deltabox.sock) and the workload
prepared by scripts/setup.sh. Prints every step, the winner, where the time went, and
writes trajectory.json.
"""

import os
import sys
import threading
import time
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "clients", "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from deltabox import Sandbox  # noqa: E402

from workload import cli  # noqa: E402
from workload.agent import Timers, setup_task  # noqa: E402
from workload.tasks import run_tests  # noqa: E402
from workload.trajectory import Trajectory, default_out  # noqa: E402


def main() -> int:
    ap = cli.parser(__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=None, help="attempts (8; short 2)")
    ap.add_argument("--steps", type=int, default=None, help="most edits per attempt (4; short 2)")
    args = ap.parse_args()
    n = cli.pick(args.n, 8, 2, args.short)
    steps = cli.pick(args.steps, 4, 2, args.short)
    k = cli.pick(args.k, 4, 3, args.short)

    wl, task = cli.load_task(args)
    cli.header("Best-of-N from one checkpoint", wl, task, [
        "N=%d attempts forked from one checkpoint, up to %d steps each, %d proposals per step "
        "(sampled), think %.1f s" % (n, steps, k, args.think)])
    timers = Timers()
    agent = cli.agent(args, task, k, timers)
    traj = Trajectory("best_of_n", task, {"n": n, "steps": steps, "k": k, "think": args.think,
                                          "seed": args.seed, "short": args.short,
                                          "state_points": agent.state_points})
    client = cli.client()
    lock = threading.Lock()

    def say(s: str) -> None:
        if not args.quiet:
            with lock:
                print(s, flush=True)

    results: list = [None] * n
    with cli.cleanup_nodes(client, args.keep) as roots:
        with timers.time("create"):
            sb = Sandbox.create(client=client)
        with sb:
            rec, root = setup_task(sb, agent)
            traj.set_setup(rec, root)
            t0 = time.perf_counter()
            with timers.time("fork"):
                # One request: the start state's checkpoint and n sandboxes on it, the
                # live processes placed by the fast path (pages shared copy-on-write).
                forks = sb.fork(count=n, label="best-of-n start")
            start = client.node(sb.head)
            roots.append(start.id)
            root_id = traj.add_node(dict(root.record(), parent=None, checkpoint=start.id))
            print("start: tests %d/%d, checkpoint %s" % (root.tests.passed, root.tests_total, start.id))
            print("forked %d sandboxes from %s in %.1f ms, its checkpoint included" % (
                n, start.id, 1000 * (time.perf_counter() - t0)))
            print(cli.fork_paths(forks))
            try:
                def attempt(i: int) -> None:
                    fsb = forks[i]
                    path: List[str] = []
                    parent, last = root_id, None
                    for s in range(steps):
                        agent.think()
                        edit = agent.sample(path, key=("best-of-n", i))
                        st = agent.step(fsb, path, edit)
                        parent = traj.add_node(dict(st.record(), parent=parent, attempt=i, step=s + 1))
                        say("attempt %d step %d: %-36s tests %3d/%d  state %.0f  score %5.1f%s" % (
                            i, s + 1, edit.id, st.tests.passed, st.tests_total, st.state, st.score,
                            "  FIXED" if st.solved else ""))
                        path, last = st.path, st
                        if st.solved:
                            break
                    with timers.time("checkpoint"):
                        ck = fsb.checkpoint(label="attempt %d" % i)
                    results[i] = (last, ck, parent)

                threads = [threading.Thread(target=attempt, args=(i,)) for i in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if any(r is None for r in results):
                    raise RuntimeError("an attempt failed (see its traceback above)")
            finally:
                for f in forks:
                    f.close()
            # The winner: best final score, then fewest steps, then lowest index.
            best = max(range(n), key=lambda i: (results[i][0].score, -len(results[i][0].path), -i))
            last, ck, node = results[best]
            with timers.time("restore"):
                sb.restore(ck)
            check, _ = run_tests(sb, task.tests, task.kind)
    wall = timers.elapsed()
    solved = [i for i in range(n) if results[i][0].solved]
    traj.summary = {"attempts": n, "solved_attempts": solved, "best_attempt": best,
                    "best_score": last.score, "best_path": last.path, "best_node": node,
                    "best_checkpoint": ck.id, "fix_found": bool(solved),
                    "restored_check": {"tests_passed": check.passed, "tests_total": check.counted},
                    "wall_seconds": round(wall, 3), "timers": timers.summary()}
    path = traj.write(default_out("best_of_n", args.out))
    print("-- summary")
    for i in range(n):
        st = results[i][0]
        print("attempt %d: %d steps, tests %d/%d, score %.1f%s" % (
            i, len(st.path), st.tests.passed, st.tests_total, st.score, "  FIXED" if st.solved else ""))
    print("best of %d: attempt %d, score %.1f, path %s" % (n, best, last.score, " -> ".join(last.path)))
    print("fix found: %s" % ("yes, by %d of %d attempts" % (len(solved), n) if solved else "no"))
    print("rolled the first sandbox over to the winner (%s): tests %d/%d there" % (
        ck.id, check.passed, check.counted))
    print("time:")
    for line in timers.report(wall):
        print(line)
    print("trajectory: %s" % path)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
