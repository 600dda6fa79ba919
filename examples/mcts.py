#!/usr/bin/env python3
"""MCTS with in-place rollback: UCT over a scripted agent's edits to a real project
(CPython's json package with its own tests, a bug injected), in ONE sandbox that is
rolled back to the selected node before each new chain of expansions.

    python3 examples/mcts.py            # 100 expansions, 49 rollbacks (the published setting)
    python3 examples/mcts.py --short    # 6 expansions, 2 rollbacks: CI
    python3 examples/mcts.py --think 2  # 2 s of "LLM call" per expansion

Needs the daemon ($DELTABOX_SOCKET, else /run/deltabox/deltabox.sock) and the workload
prepared by scripts/setup.sh. Prints every expansion and rollback, then where the time
went, and writes trajectory.json (every node: path, commands, score).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "clients", "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from deltabox import Sandbox  # noqa: E402

from workload import cli  # noqa: E402
from workload.agent import Timers, setup_task  # noqa: E402
from workload.mcts import MCTS  # noqa: E402
from workload.trajectory import Trajectory, default_out  # noqa: E402


def search_tree(search, traj, daemon_nodes) -> list:
    restores: dict = {}
    for e in traj.events:
        if e["type"] == "rollback":
            restores[e["node"]] = restores.get(e["node"], 0) + 1
    out = []
    for n in search.nodes:
        d = daemon_nodes.get(n.ckpt.id)
        t = d.templates if d is not None else None
        out.append({"id": n.idx, "parent": n.parent.idx if n.parent is not None else None,
                    "node": n.ckpt.id, "score": n.step.score, "reward": round(n.reward, 4),
                    "visits": n.visits, "restores": restores.get(n.idx, 0), "solved": n.solved,
                    "layer_bytes": d.layer_bytes if d is not None else -1,
                    "template_bytes": t.private_dirty_bytes if t is not None else 0,
                    "template_processes": t.processes if t is not None else 0})
    return out


def main() -> int:
    ap = cli.parser(__doc__.split("\n")[0])
    ap.add_argument("--expansions", type=int, default=None, help="per trajectory (100; short 6)")
    ap.add_argument("--rollbacks", type=int, default=None, help="per trajectory (49; short 2)")
    ap.add_argument("--c", type=float, default=0.5, help="UCT exploration constant (0.5)")
    ap.add_argument("--max-depth", type=int, default=6, help="deepest node (6)")
    ap.add_argument("--stop-on-fix", action="store_true", help="stop at the first fix")
    args = ap.parse_args()
    expansions = cli.pick(args.expansions, 100, 6, args.short)
    rollbacks = cli.pick(args.rollbacks, 49, 2, args.short)
    k = cli.pick(args.k, 4, 3, args.short)

    wl, task = cli.load_task(args)
    config = {"expansions": expansions, "rollbacks": rollbacks, "k": k, "c": args.c,
              "max_depth": args.max_depth, "think": args.think, "seed": args.seed,
              "stop_on_fix": args.stop_on_fix, "short": args.short}
    cli.header("MCTS with in-place rollback", wl, task, [
        "search: UCT, %d expansions and %d rollbacks per trajectory, %d proposals per node, "
        "c=%.2f, max depth %d, think %.1f s" % (expansions, rollbacks, k, args.c, args.max_depth, args.think)])

    timers = Timers()
    agent = cli.agent(args, task, k, timers)
    config["state_points"] = agent.state_points
    config["workload"] = {"name": wl.name, "size": wl.manifest.get("size"),
                          "files": len(wl.files), "bytes": sum(len(b) for b in wl.files.values())}
    traj = Trajectory("mcts", task, config)
    client = cli.client()
    with cli.cleanup_nodes(client, args.keep) as roots:
        with timers.time("create"):
            sb = Sandbox.create(client=client, template_budget_mb=args.template_budget_mb)
        with sb:
            rec, root = setup_task(sb, agent)
            traj.set_setup(rec, root)
            search = MCTS(sb, agent, traj, expansions=expansions, rollbacks=rollbacks, c=args.c,
                          max_depth=args.max_depth, stop_on_fix=args.stop_on_fix,
                          log=(lambda s: None) if args.quiet else (lambda s: print(s, flush=True)))
            try:
                summary = search.run(root)
            finally:
                if search.nodes:
                    roots.append(search.nodes[0].ckpt.id)
            # What the template budget did: nodes evicted, restores from their images.
            info = sb.info()
            st = info.get("stats", {})
            summary["sandbox_stats"] = {
                "template_used_bytes": (info.get("template_budget") or {}).get("used_bytes", 0),
                "evicted_nodes": st.get("evicted_nodes", 0),
                "image_restores": st.get("restore_paths", {}).get("image", 0),
                "process_restores": st.get("process_restores", 0)}
            # What the nodes' durable images stored, against full CRIU dumps of the same
            # processes: the root's image (every page) apart, the complete ones.
            ids = set(n.ckpt.id for n in search.nodes[1:])
            images = [c.process_image for i, c in client.tree().nodes.items()
                      if i in ids and c.process_image is not None and c.process_image.state == "complete"]
            summary["sandbox_stats"].update({
                "images_complete": len(images),
                "image_stored_bytes": sum(im.stored_bytes for im in images),
                "image_full_bytes": sum(im.full_bytes for im in images)})
            # The tree the search built, for its picture (deltabox bench report): each
            # node's reward, visits, restores (rollbacks to it), own layer and template
            # memory as the daemon counts them, before the checkpoints are removed.
            summary["tree"] = search_tree(search, traj, client.tree().nodes)
    wall = timers.elapsed()
    summary["wall_seconds"] = round(wall, 3)
    summary["timers"] = timers.summary()
    traj.summary = summary
    path = traj.write(default_out("mcts", args.out))

    print("-- summary")
    print("expansions: %d  rollbacks: %d  (planned %d and %d%s)" % (
        summary["expansions"], summary["rollbacks"], expansions, rollbacks,
        "; %d extra to spend the budget" % summary["extra_rollbacks"] if summary["extra_rollbacks"] else ""))
    print("nodes: %d  max depth: %d" % (summary["nodes"], summary["max_depth"]))
    if summary["fix_found"]:
        print("fix found: yes, at expansion %d (node n%d, path %s)" % (
            summary["fix_expansion"], summary["fix_node"], " -> ".join(summary["fix_path"])))
    else:
        print("fix found: no")
    print("best score: %.1f (node n%d)" % (summary["best_score"], summary["best_node"]))
    print("session state intact at %d of %d expanded nodes (a rollback that ends processes "
          "loses it)" % (summary["state_intact_nodes"], summary["nodes"] - 1))
    print("time:")
    for line in timers.report(wall):
        print(line)
    print("trajectory: %s" % path)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
