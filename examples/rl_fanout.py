#!/usr/bin/env python3
"""RL-style fan-out: N rollouts from one state, each K steps, repeated. N worker
sandboxes are forked once; each round rolls every worker back to the round's start
state (a restore), runs N sampled K-step rollouts of the scripted agent at once,
scores them with the real tests, nudges the agent's policy toward the better ones
(REINFORCE with a mean baseline on a table of per-edit preferences), and moves the
start state to the best rollout's end state (a checkpoint) when it improved.

    python3 examples/rl_fanout.py            # N=4 rollouts of K=3 steps, 5 rounds
    python3 examples/rl_fanout.py --short    # N=2, K=2, 2 rounds: CI
    python3 examples/rl_fanout.py --think 2  # 2 s of "LLM call" per step

Needs the daemon ($DELTABOX_SOCKET, else /run/deltabox/deltabox.sock) and the workload
prepared by scripts/setup.sh. Prints every round, where the time went, and writes
trajectory.json.
"""

import os
import sys
import threading
from typing import Any, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "clients", "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from deltabox import Sandbox  # noqa: E402

from workload import cli  # noqa: E402
from workload.agent import Timers, setup_task  # noqa: E402
from workload.trajectory import Trajectory, default_out  # noqa: E402


def main() -> int:
    ap = cli.parser(__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=None, help="rollouts per round (4; short 2)")
    ap.add_argument("--steps", type=int, default=None, help="K: steps per rollout (3; short 2)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (5; short 2)")
    ap.add_argument("--lr", type=float, default=1.0, help="policy step size (1.0)")
    args = ap.parse_args()
    n = cli.pick(args.n, 4, 2, args.short)
    steps = cli.pick(args.steps, 3, 2, args.short)
    rounds = cli.pick(args.rounds, 5, 2, args.short)
    k = cli.pick(args.k, 4, 3, args.short)

    wl, task = cli.load_task(args)
    cli.header("RL-style fan-out", wl, task, [
        "%d rounds of N=%d rollouts x K=%d steps from one state, %d proposals per step (sampled), "
        "lr %.2f, think %.1f s" % (rounds, n, steps, k, args.lr, args.think)])
    timers = Timers()
    agent = cli.agent(args, task, k, timers)
    traj = Trajectory("rl_fanout", task, {"n": n, "steps": steps, "rounds": rounds, "k": k,
                                          "lr": args.lr, "think": args.think, "seed": args.seed,
                                          "short": args.short, "state_points": agent.state_points})
    client = cli.client()
    lock = threading.Lock()
    prefs: dict = {}  # edit id -> preference (the policy's learned part)
    rounds_out = []

    def say(s: str) -> None:
        if not args.quiet:
            with lock:
                print(s, flush=True)

    with cli.cleanup_nodes(client, args.keep) as roots:
        with timers.time("create"):
            sb = Sandbox.create(client=client)
        with sb:
            rec, root = setup_task(sb, agent)
            traj.set_setup(rec, root)
            with timers.time("fork"):
                # One request: the start state's checkpoint and n workers on it, the live
                # processes placed by the fast path (pages shared copy-on-write).
                workers = sb.fork(count=n, label="rl start")
            start: Any = client.node(sb.head)
            roots.append(start.id)
            start_node = traj.add_node(dict(root.record(), parent=None, checkpoint=start.id))
            start_path: List[str] = []
            start_score, start_solved = root.score, root.solved
            print("start: tests %d/%d, score %.1f, checkpoint %s" % (
                root.tests.passed, root.tests_total, root.score, start.id))
            print(cli.fork_paths(workers))
            restores = 0
            try:
                for r in range(rounds):
                    if start_solved:
                        print("round %d: not run, the start state passes every test" % (r + 1))
                        break
                    if r > 0:  # roll every worker back to the round's start state
                        def back(w):
                            with timers.time("restore"):
                                w.restore(start)
                        ts = [threading.Thread(target=back, args=(w,)) for w in workers]
                        for t in ts:
                            t.start()
                        for t in ts:
                            t.join()
                        restores += n
                    out: list = [None] * n
                    policy = dict(prefs)

                    def rollout(i: int) -> None:
                        path, parent, last = list(start_path), start_node, None
                        for s in range(steps):
                            agent.think()
                            edit = agent.sample(path, key=("rl", r, i), prefs=policy)
                            st = agent.step(workers[i], path, edit)
                            parent = traj.add_node(dict(st.record(), parent=parent, round=r + 1,
                                                        rollout=i, step=s + 1))
                            say("  round %d rollout %d step %d: %-36s tests %3d/%d  state %.0f  score %5.1f%s" % (
                                r + 1, i, s + 1, edit.id, st.tests.passed, st.tests_total, st.state,
                                st.score, "  FIXED" if st.solved else ""))
                            path, last = st.path, st
                            if st.solved:
                                break
                        out[i] = (last, parent)

                    ts = [threading.Thread(target=rollout, args=(i,)) for i in range(n)]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join()
                    if any(o is None for o in out):
                        raise RuntimeError("a rollout failed (see its traceback above)")
                    rewards = [agent.reward(o[0].score) for o in out]
                    mean = sum(rewards) / n
                    for o, rw in zip(out, rewards):  # REINFORCE, mean baseline
                        for eid in o[0].path[len(start_path):]:
                            prefs[eid] = prefs.get(eid, 0.0) + args.lr * (rw - mean) * 10
                    best = max(range(n), key=lambda i: (out[i][0].score, -i))
                    last, node = out[best]
                    moved = last.score > start_score
                    if moved:
                        with timers.time("checkpoint"):
                            start = workers[best].checkpoint(label="rl round %d best" % (r + 1))
                        start_path, start_score, start_solved = last.path, last.score, last.solved
                        start_node = node
                        traj.nodes[node]["checkpoint"] = start.id
                    solved = sum(1 for o in out if o[0].solved)
                    rounds_out.append({"round": r + 1, "rewards": [round(x, 4) for x in rewards],
                                       "scores": [o[0].score for o in out], "best": best,
                                       "solved": solved, "moved": moved, "start": start.id,
                                       "start_path": list(start_path)})
                    traj.event("round", **rounds_out[-1])
                    print("round %d: scores %s  mean %.1f  max %.1f  solved %d/%d  -> %s" % (
                        r + 1, " ".join("%.1f" % o[0].score for o in out),
                        sum(o[0].score for o in out) / n, last.score, solved, n,
                        "new start state %s (score %.1f)" % (start.id, start_score) if moved
                        else "start state kept (score %.1f)" % start_score), flush=True)
            finally:
                for w in workers:
                    w.close()
    wall = timers.elapsed()
    fixed = sum(ro["solved"] for ro in rounds_out)
    first = next((ro["round"] for ro in rounds_out if ro["solved"]), None)
    traj.summary = {"rounds": rounds_out, "rollouts": n * len(rounds_out), "restores": restores,
                    "final_start_path": start_path, "final_score": start_score,
                    "final_solved": start_solved, "fix_found": fixed > 0, "fixing_rollouts": fixed,
                    "first_fix_round": first,
                    "policy": {k: round(v, 4) for k, v in sorted(prefs.items())},
                    "wall_seconds": round(wall, 3), "timers": timers.summary()}
    path = traj.write(default_out("rl_fanout", args.out))
    print("-- summary")
    print("rounds: %d  rollouts: %d  steps per rollout: %d  worker restores: %d" % (
        len(rounds_out), n * len(rounds_out), steps, restores))
    print("fix found: %s" % ("yes, by %d of %d rollouts (first in round %s)" % (
        fixed, n * len(rounds_out), first) if fixed else "no"))
    print("final start state: score %.1f%s, path %s" % (
        start_score, " (passes every test)" if start_solved else "",
        " -> ".join(start_path) or "(the task's start)"))
    top = sorted(prefs.items(), key=lambda kv: -kv[1])[:3]
    if top:
        print("policy's favourite edits: %s" % ", ".join("%s (%+.2f)" % kv for kv in top))
    print("time:")
    for line in timers.report(wall):
        print(line)
    print("trajectory: %s" % path)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
