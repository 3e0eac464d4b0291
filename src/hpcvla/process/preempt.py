"""Preemption: a signal asks the run to stop at the next policy version, with a checkpoint.

Slurm (`--signal=TERM@<grace>`, `scancel`, a preempting job), PBS (`qdel`, which sends
SIGTERM before SIGKILL) and `mpiexec` (which forwards SIGTERM to every rank) all end a job
with SIGTERM; Slurm's `--signal` can also send SIGUSR1. The handler only sets a flag; the
learners agree on it once per policy version (one small allreduce) so they all stop after
the same version, write a checkpoint, and shut the pipeline down as at a normal end.
Simulator and inference ranks ignore the flag: they stop when the weight plane says so.
`hpcvla train run.resume=RUN_DIR` continues from that checkpoint.
"""

from __future__ import annotations

import signal
import threading
import time

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_requested = threading.Event()
_first_at: list[float] = []  # epoch time of the first signal


def install() -> None:
    """Catch SIGTERM/SIGUSR1 in this process (main thread only, as Python requires)."""
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)


def _on_signal(signum, frame) -> None:
    if not _first_at:
        _first_at.append(time.time())
    _requested.set()


def requested() -> bool:
    return _requested.is_set()


def requested_at() -> float | None:
    """Epoch time of the first stop signal this process got (None: none)."""
    return _first_at[0] if _first_at else None


def agreed(comm) -> bool:
    """Collective on `comm`: did any member get a stop signal?"""
    from mpi4py import MPI

    return comm.allreduce(_requested.is_set(), op=MPI.LOR)  # [dist]
