"""A helper process of a rank, for work that must not run on the rank's own thread: a
simulator that may hang or crash (envs/isolated.py), HDF5 writes whose gzip holds the GIL
(metrics/dump_writer.py).

    parent (the rank)                         worker (python -m MODULE FD RANK_PID ...)
    start(MODULE, ...) -> (process, conn)     entered(RANK_PID) -> True: serve conn
    conn.send(request) / conn.recv()          conn.recv() / conn.send(answer)
                                              leave(): exit without the interpreter's teardown

The worker is no MPI process (the launcher's PMI variables are not passed on, so an import
of mpi4py there could not join or confuse the world); it sees the rank's GPU alone; it dies
with its rank (Linux PR_SET_PDEATHSIG), even when stuck in C, and ignores SIGINT/SIGTERM,
which are its rank's to handle (a checkpoint, then an orderly close of its workers).
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

MPI_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPIR_")
RANKS_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # the rank's to handle (checkpoint, stop)


def start(module: str, *args: str) -> tuple[subprocess.Popen, Connection]:
    """`python -m module FD RANK_PID *args` and this end of its connection. Call it from a
    thread that lives as long as the worker (the rank's main thread): Linux's
    PR_SET_PDEATHSIG fires when the thread that started it ends, not the process."""
    parent, child = socket.socketpair()
    env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_PREFIXES)}
    if "HPCVLA_GPU" in env:  # the rank's GPU (devices.py) is the worker's only one
        env["CUDA_VISIBLE_DEVICES"] = env["HPCVLA_GPU"]
    # the worker starts with the rank's signals blocked (a mask survives exec), until it
    # ignores them: a job-wide SIGTERM during its interpreter's start would end it
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, RANKS_SIGNALS)
    try:
        process = subprocess.Popen([sys.executable, "-m", module, str(child.fileno()),
                                    str(os.getpid()), *args], pass_fds=[child.fileno()],
                                   env=env)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    child.close()
    return process, Connection(parent.detach())


def cpu_seconds() -> float:
    """CPU seconds (user and system, every thread) of this process and of the helper
    processes it has reaped: an env worker or dump writer counts once it is closed (or
    killed and waited for)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def exit_status(process: subprocess.Popen) -> str:
    """How a worker ended, in words, waiting up to 5 s for it."""
    try:
        code = process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return "exit status unknown"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def entered(rank_pid: int) -> bool:
    """Worker side, first: tie this process to its rank; False if the rank is gone already."""
    if sys.platform.startswith("linux"):  # die with the rank, even when stuck in C
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != rank_pid:  # the rank died before the line above took effect
        return False
    for sig in RANKS_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RANKS_SIGNALS)  # blocked by start()
    return True


def leave() -> None:
    """Worker side, last: end as multiprocessing's workers do, without the interpreter's
    teardown of what the work imported (~1 s for a simulator's modules, for nothing)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
