"""How many threads a rank computes with: one rule for every launcher and role.

The launcher decides each rank's share of its node's cores and says it in OMP_NUM_THREADS
(jobs/launch.sh: the cores the scheduler gave a node over its ranks; `hpcvla train --ranks
N`: this machine's over N); a rank started some other way (a user's own `mpirun`) takes its
cores over its node's ranks itself."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on: its affinity (a scheduler's cpuset, `taskset`), not
    the host's count, which a job given part of a node would oversubscribe."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def rank_threads(ranks_on_node: int, environ=os.environ) -> int:
    """A rank's threads: OMP_NUM_THREADS where its launcher set it (a whole number >= 1),
    else its usable cores over the `ranks_on_node` ranks sharing them, at least 1."""
    given = environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) >= 1:
        return int(given)
    return max(1, usable_cores() // max(1, ranks_on_node))
