"""A watchdog for calls that may never return (a simulator step caught in a MuJoCo/EGL
deadlock): if the guarded call has not returned after `timeout_s`, the process prints every
thread's stack ("Timeout (h:mm:ss)!", the stuck line on top) and exits; the launcher then
names the rank, its role and the run's last progress and tears the world down
(process/deathwatch.py).

It is `faulthandler`'s timer: a C thread that needs no GIL, so it fires even when the stuck
call holds it. Re-arming costs microseconds, so it can guard every step. With
`env.isolation=process` the envs run in workers the rank times out and restarts itself
(envs/isolated.py), so this rank-wide guard is off.
"""

from __future__ import annotations

import faulthandler
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
