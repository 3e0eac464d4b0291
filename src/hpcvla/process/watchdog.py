"""Watchdogs.

`deadline`, for calls that may never return (a simulator step caught in a MuJoCo/EGL
deadlock): if the guarded call has not returned after `timeout_s`, the process prints every
thread's stack ("Timeout (h:mm:ss)!", the stuck line on top) and exits; the launcher then
names the rank, its role and the run's last progress and tears the world down
(process/deathwatch.py). It is `faulthandler`'s timer: a C thread that needs no GIL, so it
fires even when the stuck call holds it. Re-arming costs microseconds, so it can guard every
step. With `env.isolation=process` the envs run in workers the rank times out and restarts
itself (envs/isolated.py), so this rank-wide guard is off.

`reminding`, for waits that may rightly be long (a teardown whose peers write a checkpoint):
it says every so often that the rank still waits, so a peer that hangs is the one not saying
it.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager


@contextmanager
def deadline(timeout_s: float):
    """Guard the block: exit the process with every stack if it runs past `timeout_s` (0: no
    guard)."""
    if not timeout_s:
        yield
        return
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def step_deadline_s(env_cfg) -> float:
    """The deadline to guard a rank's env steps with (0: none; isolated envs have their own)."""
    return env_cfg.step_timeout_s if env_cfg.isolation == "inline" else 0.0


@contextmanager
def reminding(every_s: float, say: Callable[[float], str]):
    """While the block runs, print `say(seconds waited)` to stderr every `every_s`. A Python
    thread: the block must release the GIL while it waits, as mpi4py's MPI calls do."""
    stop = threading.Event()

    def remind() -> None:
        waited = 0.0
        while not stop.wait(every_s):
            waited += every_s
            print(say(waited), file=sys.stderr, flush=True)
    thread = threading.Thread(target=remind, name="hpcvla-reminder", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
