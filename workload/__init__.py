"""DeltaBox's tree-search workload: real code with its own test suite, a task generator
that injects bugs into it, a scripted deterministic agent, and UCT over that agent's
actions. Standard library only; uses the Python client (clients/python).

    workspace  the workload's source tree (prepared by scripts/setup.sh) into a sandbox
    tasks      the catalogue of mutations, task generation, their verification
    agent      the scripted agent: proposals, edits, real test runs, scores, records
    mcts       UCT with in-place rollback (expansions and rollbacks configurable)
"""
