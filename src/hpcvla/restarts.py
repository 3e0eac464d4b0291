"""What a restart inside the allocation loses, recorded with the run.

When a world fails, jobs/launch.sh starts it again on the nodes left (HPCVLA_RESTARTS), from
the newest checkpoint. Before it does, it calls

    python -m hpcvla.restarts JOB_RUN_ROOT STATUS "DROPPED NODES" "NODES LEFT" RANKS

which appends one line to the run's `restarts.jsonl` and prints it: when, the exit status, the
nodes dropped and kept, the policy version it resumes from, and the work lost: the env steps
the learners had trained beyond that checkpoint (from metrics.jsonl), trained again after the
restart from fresh trajectories (those in flight are dropped, none is trained twice).
summary.json carries the list (`restarts`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hpcvla.checkpoint import latest, read_state

FILE = "restarts.jsonl"


def newest_run(run_root: Path) -> Path | None:
    """The run directory a restart continues: the newest one under the job's run root."""
    configs = sorted(Path(run_root).glob("*/config.yaml"), key=lambda p: p.stat().st_mtime)
    return configs[-1].parent if configs else None


def newest_version(run_root: Path) -> int:
    """The policy version of the newest checkpoint of the job's run; -1 when there is none."""
    run_dir = newest_run(run_root)
    point = latest(run_dir) if run_dir is not None else None
    return read_state(point)["version"] if point is not None else -1


def record(run_root: Path, status: int, dropped: list[str], nodes: list[str],
           ranks: int) -> dict | None:
    """Append this restart to the run's restarts.jsonl; None when there is no run yet."""
    run_dir = newest_run(run_root)
    if run_dir is None:
        return None
    point = latest(run_dir)
    state = read_state(point) if point is not None else {"version": 0, "counters": {}}
    kept = state["counters"].get("trained_env_steps", 0)
    trained = kept
    metrics = run_dir / "metrics.jsonl"
    for line in reversed(metrics.read_text().splitlines() if metrics.exists() else []):
        try:  # the world may have died in the middle of the last line
            trained = json.loads(line)["trained_env_steps"]
            break
        except (ValueError, KeyError):
            continue
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "exit_status": status,
             "dropped_nodes": dropped, "nodes": nodes, "ranks": ranks,
             "resumed_from_version": state["version"], "trained_env_steps": trained,
             "lost_env_steps": max(0, trained - kept)}
    with open(run_dir / FILE, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def recorded(run_dir: Path) -> list[dict]:
    """The restarts of a run so far (for summary.json)."""
    path = Path(run_dir) / FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


if __name__ == "__main__":
    root, status, dropped, nodes, ranks = sys.argv[1:6]
    print(json.dumps(record(Path(root), int(status), dropped.split(), nodes.split(),
                            int(ranks))))
