"""The record of a search: every node with its path, the commands that made it from its
parent, and its score; every rollback. Written as ``trajectory.json`` so that the
baselines can replay the same commands (from the task's root state, made by
``setup``: the task's files installed with :func:`workload.workspace.install_command`,
regenerated from the task's spec) without DeltaBox.
"""

import json
import os
import threading
from typing import Any, Dict, List, Optional


class Trajectory:
    def __init__(self, example: str, task, config: Dict[str, Any]) -> None:
        self.example = example
        self.task = task
        self.config = dict(config)
        self.setup: Dict[str, Any] = {}
        self.nodes: List[Dict[str, Any]] = []
        self.events: List[Dict[str, Any]] = []
        self.summary: Dict[str, Any] = {}
        self._lock = threading.Lock()

    def set_setup(self, install_record: Dict[str, Any], root_step) -> None:
        rec = {k: v for k, v in install_record.items() if k not in ("stdin", "blob")}
        if "upload" not in rec:
            rec["stdin"] = ("<base64 tar.gz of the task's files: regenerate with "
                            "workload.tasks.make_task(**task spec) and workload.workspace.install_command>")
        self.setup = {"commands": [rec] + root_step.commands,
                      "tests_passed": root_step.tests.passed,
                      "tests_total": root_step.tests_total}

    def add_node(self, rec: Dict[str, Any]) -> int:
        with self._lock:
            rec = dict(rec)
            rec["id"] = len(self.nodes)
            self.nodes.append(rec)
            return rec["id"]

    def event(self, kind: str, **kw: Any) -> None:
        with self._lock:
            d = {"type": kind}
            d.update(kw)
            self.events.append(d)

    def to_json(self) -> Dict[str, Any]:
        return {"example": self.example, "task": self.task.spec(), "config": self.config,
                "setup": self.setup, "nodes": self.nodes, "events": self.events,
                "summary": self.summary}

    def write(self, path: str) -> str:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
        return path


def default_out(example: str, out: Optional[str]) -> str:
    """Where an example writes trajectory.json: --out, else a new directory under
    $TMPDIR."""
    if out:
        return os.path.join(out, "trajectory.json") if not out.endswith(".json") else out
    import tempfile
    return os.path.join(tempfile.mkdtemp(prefix="deltabox-%s-" % example), "trajectory.json")
