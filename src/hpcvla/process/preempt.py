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
import time

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Epoch time and number of the first signal; its being there is the flag. Not a
# threading.Event: its set() takes a lock, and a second signal whose handler runs inside the
# first's set() (Slurm and mpiexec may both send SIGTERM at once) would wait on it forever.
_first: list[tuple[float, int]] = []


def install(interactive: bool = False) -> None:
    """Catch SIGTERM/SIGUSR1 in this process (main thread only, as Python requires);
    `interactive` (a command run at a terminal, `hpcvla demos`): Ctrl-C asks the same stop,
    and a second Ctrl-C interrupts at once."""
    for sig in SIGNALS + ((signal.SIGINT,) if interactive else ()):
        signal.signal(sig, _on_signal)


def ignore_from_now() -> None:
    """The work is done: a stop signal from here on is ignored. Python's shutdown puts back
    the default action of the signals it handles, so a scheduler's SIGTERM in a rank's last
    moments would otherwise kill a finished run (mpiexec: BAD TERMINATION, exit 15)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _on_signal(signum, frame) -> None:
    if not _first:
        _first.append((time.time(), signum))
    if signum == signal.SIGINT:  # the next Ctrl-C: KeyboardInterrupt, wherever it lands
        signal.signal(signal.SIGINT, signal.default_int_handler)


def requested() -> bool:
    return bool(_first)


def requested_at() -> float | None:
    """Epoch time of the first stop signal this process got (None: none)."""
    return _first[0][0] if _first else None


def requested_by() -> int | None:
    """The number of the first stop signal this process got (None: none)."""
    return _first[0][1] if _first else None


def agreed(comm) -> bool:
    """Collective on `comm`: did any member get a stop signal?"""
    from mpi4py import MPI

    return comm.allreduce(requested(), op=MPI.LOR)  # [dist]
