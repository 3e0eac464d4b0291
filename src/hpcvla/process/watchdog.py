"""Watchdogs.

`deadline`, for calls that may never return (a simulator step caught in a MuJoCo/EGL
deadlock): if the guarded call has not returned after `timeout_s`, the process prints every
thread's stack ("Timeout (h:mm:ss)!", the stuck line on top) and exits; the launcher then
names the rank, its role and the run's last progress and tears the world down
(process/deathwatch.py). It is `faulthandler`'s timer: a C thread that needs no GIL, so it
fires even when the stuck call holds it. Each arming starts that thread anew (42-51 us here,
~1 ms on a loaded core): a simulator's steps are guarded by `StepGuard`, which re-arms it once
per tenth of the timeout (0.9 us a step). With `env.isolation=process` the envs run in
workers the rank times out and restarts itself (envs/isolated.py), so this rank-wide guard is
off.

`reminding`, for waits that may rightly be long (a teardown whose peers write a checkpoint):
it says every so often that the rank still waits, so a peer that hangs is the one not saying
it.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager


@contextmanager
def deadline(timeout_s: float):
    """Guard the block: exit the process with every stack if it runs past `timeout_s` (0: no
    guard)."""
    if not timeout_s:
        yield
        return
    faulthandler.dump_traceback_later(timeout_s, exit=True, file=_stacks_file())
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _stacks_file():
    """Where a guard writes the stacks: stderr, or where it has no descriptor (a notebook's,
    a test's capture) the process's own."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__


class StepGuard:
    """`deadline` for a call made many times a second (a simulator's steps). Each arming of
    faulthandler's timer starts a thread, and each cancel joins it: ~1 ms a step on a loaded
    core, half of a fast simulator's step. This guard re-arms only when its timer is older
    than a tenth of `timeout_s`, so a guarded call gets between 0.9 and 1 x timeout_s before
    the process is ended; between calls the timer runs on, and the caller's wait loop calls
    `idle()`, which cancels it once it is half spent (a long wait is no hang); leaving the
    `with` block cancels it. timeout_s 0: no guard."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._armed_at: float | None = None

    @contextmanager
    def guard(self):
        if self.timeout_s:
            now = time.monotonic()
            if self._armed_at is None or now - self._armed_at > 0.1 * self.timeout_s:
                faulthandler.dump_traceback_later(self.timeout_s, exit=True,
                                                  file=_stacks_file())
                self._armed_at = now
        yield

    def idle(self) -> None:
        if self._armed_at is not None and \
                time.monotonic() - self._armed_at > 0.5 * self.timeout_s:
            self.close()

    def close(self) -> None:
        if self._armed_at is not None:
            faulthandler.cancel_dump_traceback_later()
            self._armed_at = None

    def __enter__(self) -> "StepGuard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def step_deadline_s(env_cfg) -> float:
    """The deadline to guard a rank's env steps with (0: none; isolated envs have their own)."""
    return env_cfg.step_timeout_s if env_cfg.isolation == "inline" else 0.0


def build_deadline_s(env_cfg) -> float:
    """The deadline to guard a rank's envs' build with (0: none; isolated envs have their
    own)."""
    return env_cfg.build_timeout_s if env_cfg.isolation == "inline" else 0.0


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
