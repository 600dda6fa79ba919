"""UCT over the scripted agent's actions, in one sandbox, with in-place rollback.

A trajectory of the search makes ``expansions`` expansions and ``rollbacks`` rollbacks
(default 100 and 49, as in the published evaluation). It runs ``rollbacks + 1``
iterations: each but the first starts with a rollback (``sb.restore``) to the node that
UCT selects, and then expands a chain of nodes *in place*, each from the one before
(the chain lengths share the expansion budget: 100 / 50 = 2). One expansion is one
agent step (think, apply one untried proposal, record it in the session, run the
tests) followed by a checkpoint, which becomes the new node.

Selection is classic UCT: from the root, stop at the first node that still has untried
proposals, else descend to the child with the best UCB1 score
``mean reward + c * sqrt(ln N(parent) / N(child))``. The node the sandbox stands on is
never selected (a rollback goes elsewhere: to continue in place is the chain's job).
A node is terminal when its tests all pass (solved) or at ``max_depth``; a chain stops
there, and what it did not use goes to the next chains. Should the last chain stop
early, the search makes extra iterations (so extra rollbacks) to spend the budget, and
says so.
"""

import math
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

from .agent import Agent, Step
from .trajectory import Trajectory

if TYPE_CHECKING:  # the client is imported by the examples (clients/python on sys.path)
    from deltabox import CheckpointResult, Sandbox


class Node:
    def __init__(self, idx: int, parent: Optional["Node"], step: Step, ckpt: "CheckpointResult",
                 untried: Sequence[Any], depth: int, reward: float) -> None:
        self.idx = idx
        self.parent = parent
        self.children: List[Node] = []
        self.step = step
        self.ckpt = ckpt
        self.untried = list(untried)
        self.depth = depth
        self.reward = reward
        self.visits = 0
        self.value = 0.0

    @property
    def path(self) -> List[str]:
        return self.step.path

    @property
    def solved(self) -> bool:
        return self.step.solved


class MCTS:
    def __init__(self, sb: "Sandbox", agent: Agent, trajectory: Trajectory, expansions: int = 100,
                 rollbacks: int = 49, c: float = 0.5, max_depth: int = 6,
                 stop_on_fix: bool = False, log: Callable[[str], None] = print) -> None:
        if expansions < 1 or rollbacks < 0:
            raise ValueError("expansions >= 1 and rollbacks >= 0")
        self.sb = sb
        self.agent = agent
        self.traj = trajectory
        self.expansions = expansions
        self.rollbacks = rollbacks
        self.c = c
        self.max_depth = max_depth
        self.stop_on_fix = stop_on_fix
        self.log = log
        self.nodes: List[Node] = []
        self.current: Optional[Node] = None
        self.n_expanded = 0
        self.n_rollbacks = 0
        self.first_fix: Optional[Node] = None
        self.first_fix_expansion = 0

    # ---- tree ----

    def expandable(self, n: Node) -> bool:
        return bool(n.untried) and not n.solved and n.depth < self.max_depth

    def _open(self, n: Node, memo: dict) -> bool:
        if n.idx not in memo:
            memo[n.idx] = ((self.expandable(n) and n is not self.current)
                           or any(self._open(ch, memo) for ch in n.children))
        return memo[n.idx]

    def ucb(self, ch: Node) -> float:
        parent = ch.parent
        assert parent is not None and ch.visits > 0
        return ch.value / ch.visits + self.c * math.sqrt(math.log(parent.visits) / ch.visits)

    def select(self) -> Optional[Node]:
        memo: dict = {}
        n = self.nodes[0]
        if not self._open(n, memo):
            return None
        while True:
            if self.expandable(n) and n is not self.current:
                return n
            kids = [ch for ch in n.children if self._open(ch, memo)]
            # ties: the older node (deterministic)
            n = max(kids, key=lambda ch: (self.ucb(ch), -ch.idx))

    def backprop(self, n: Node, reward: float) -> None:
        m: Optional[Node] = n
        while m is not None:
            m.visits += 1
            m.value += reward
            m = m.parent

    # ---- acting ----

    def _add(self, parent: Optional[Node], step: Step, ckpt: "CheckpointResult", ckpt_ms: float) -> Node:
        reward = self.agent.reward(step.score)
        n = Node(len(self.nodes), parent, step, ckpt, self.agent.propose(step.path),
                 0 if parent is None else parent.depth + 1, reward)
        self.nodes.append(n)
        if parent is not None:
            parent.children.append(n)
        rec = step.record()
        rec.update({"parent": None if parent is None else parent.idx, "depth": n.depth,
                    "checkpoint": ckpt.id, "checkpoint_ms": round(ckpt_ms, 3),
                    "reward": round(reward, 5), "expansion": self.n_expanded,
                    "proposals": [e.id for e in n.untried]})
        self.traj.add_node(rec)
        return n

    def _checkpoint(self, label: str) -> Tuple["CheckpointResult", float]:
        import time
        t0 = time.perf_counter()
        with self.agent.timers.time("checkpoint"):
            ck = self.sb.checkpoint(label=label)
        return ck, 1000 * (time.perf_counter() - t0)

    def start(self, root_step: Step) -> Node:
        ck, ms = self._checkpoint("root")
        root = self._add(None, root_step, ck, ms)
        self.backprop(root, root.reward)
        self.current = root
        self.log("root: %s  tests %d/%d  score %.1f  checkpoint %s (%.2f ms)" % (
            "solved" if root.solved else "unsolved", root_step.tests.passed,
            root_step.tests_total, root_step.score, ck.id, ms))
        return root

    def expand(self, n: Node) -> Node:
        assert n is self.current and self.expandable(n)
        self.agent.think()
        edit = n.untried.pop(0)
        step = self.agent.step(self.sb, n.path, edit)
        self.n_expanded += 1
        ck, ms = self._checkpoint("e%d %s" % (self.n_expanded, edit.id))
        ch = self._add(n, step, ck, ms)
        self.backprop(ch, ch.reward)
        self.current = ch
        if ch.solved and self.first_fix is None:
            self.first_fix, self.first_fix_expansion = ch, self.n_expanded
        self.traj.event("expand", expansion=self.n_expanded, node=ch.idx, parent=n.idx,
                        edit=edit.id, checkpoint=ck.id, checkpoint_ms=round(ms, 3),
                        processes=ck.processes)
        self.log("[%3d] n%-3d <- n%-3d d%d %-36s tests %3d/%d  state %.2f%s  score %5.1f  ckpt %.2f ms%s" % (
            self.n_expanded, ch.idx, n.idx, ch.depth, edit.id, step.tests.passed, step.tests_total,
            step.state, " (session restarted)" if step.session_restarted else "", step.score, ms,
            "  FIXED" if ch.solved else ""))
        return ch

    def rollback(self, target: Node) -> None:
        import time
        src = self.current
        t0 = time.perf_counter()
        with self.agent.timers.time("restore"):
            res = self.sb.restore(target.ckpt)
        ms = 1000 * (time.perf_counter() - t0)
        self.n_rollbacks += 1
        self.current = target
        # processes: brought back from the node's templates (the agent's session)
        self.traj.event("rollback", rollback=self.n_rollbacks, src=src.idx if src else None,
                        node=target.idx, checkpoint=target.ckpt.id, restore_ms=round(ms, 3),
                        processes=res.processes)
        self.log("      rollback %d: n%d -> n%d (depth %d, %d untried)  restore %.2f ms" % (
            self.n_rollbacks, src.idx if src else -1, target.idx, target.depth,
            len(target.untried), ms))

    def run(self, root_step: Step) -> dict:
        import time
        t0 = time.perf_counter()
        timers = self.agent.timers
        before = {k: (timers.total[k], timers.count[k]) for k in timers.total}
        self.start(root_step)
        iterations = self.rollbacks + 1
        it = 0
        extra = 0
        while self.n_expanded < self.expansions:
            if self.stop_on_fix and self.first_fix is not None:
                break
            if it > 0:
                target = self.select()
                if target is None:
                    self.log("      the tree is exhausted: nothing left to expand")
                    break
                if it >= iterations:
                    extra += 1
                self.rollback(target)
            left_iters = max(1, iterations - it)
            chain = -(-(self.expansions - self.n_expanded) // left_iters)  # ceil
            for _ in range(chain):
                cur = self.current
                if cur is None or not self.expandable(cur):
                    break
                self.expand(cur)
                if self.stop_on_fix and self.first_fix is not None:
                    break
            it += 1
        search_s = time.perf_counter() - t0
        search_timers = {}
        for k, v in timers.total.items():
            s0, c0 = before.get(k, (0.0, 0))
            if timers.count[k] > c0:
                search_timers[k] = {"seconds": round(v - s0, 4), "count": timers.count[k] - c0}
        best = max(self.nodes, key=lambda n: (n.step.score, -n.idx))
        return {
            # wall time of the search: the root's checkpoint, every expansion (think,
            # commands, checkpoint) and rollback; not the setup or the root's tests;
            # and the agent's timers over that time alone
            "search_seconds": round(search_s, 4),
            "search_timers": search_timers,
            "expansions": self.n_expanded, "rollbacks": self.n_rollbacks,
            "planned": {"expansions": self.expansions, "rollbacks": self.rollbacks},
            "extra_rollbacks": extra, "nodes": len(self.nodes),
            "fix_found": self.first_fix is not None,
            "fix_expansion": self.first_fix_expansion if self.first_fix else None,
            "fix_node": self.first_fix.idx if self.first_fix else None,
            "fix_path": self.first_fix.path if self.first_fix else None,
            "best_node": best.idx, "best_score": best.step.score, "best_path": best.path,
            "max_depth": max(n.depth for n in self.nodes),
            "state_intact_nodes": sum(1 for n in self.nodes[1:] if n.step.state >= 1.0),
        }
