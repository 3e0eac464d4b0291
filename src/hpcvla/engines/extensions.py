"""JIT-compiled extensions: build them once, and never wait for a build that died.

DeepSpeed compiles some ops on first use (on CPU: its shared-memory communication op, when the
learners initialise) through torch's cpp_extension, with whichever `ninja` is first on PATH.

* Stale build locks: cpp_extension holds a `lock` file in the op's build directory while it
  builds, and *waits for that file to vanish* whenever it exists, even when the op is already
  built. A build killed mid-way (a job hitting its time limit, a Ctrl-C) leaves the file behind,
  and every later run waits forever inside `deepspeed.initialize`, silently. A real build takes
  about a minute, so a lock older than `STALE_AFTER_S` is removed, with a warning that names it.
* One ninja: ninja records a hash of each command in the build directory's `.ninja_log`, and
  ninja versions hash differently, so two ninjas taking turns on one build directory rebuild
  the op each time (about a minute on 2 cores). The environment's own ninja (beside its
  Python) goes first on PATH, whatever the launcher put there: Open MPI, for one, puts its own
  prefix's bin first on the PATH of the ranks it starts on other hosts.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STALE_AFTER_S = 600.0
DEEPSPEED_JIT_OPS = ("deepspeed_shm_comm",)  # the ops the learners build on CPU


def clear_stale_build_locks(names=DEEPSPEED_JIT_OPS, stale_after_s: float = STALE_AFTER_S,
                            rank: int | None = None) -> list[Path]:
    """Remove the build locks of `names` older than `stale_after_s`; returns those removed."""
    from torch.utils.cpp_extension import _get_build_directory  # honours TORCH_EXTENSIONS_DIR

    removed = []
    for name in names:
        lock = Path(_get_build_directory(name, False)) / "lock"
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            continue
        if age > stale_after_s:
            lock.unlink(missing_ok=True)  # another rank of this node may have been first
            removed.append(lock)
            print(f"[hpcvla] rank {rank}: removed {lock}, left {age / 60:.0f} min ago by an "
                  f"interrupted build (every run would wait for it forever)", file=sys.stderr,
                  flush=True)
    return removed


def use_the_environments_ninja() -> None:
    """Put the directory of this Python, where the environment installs ninja, first on PATH
    (if ninja is there), for the op builds of this process."""
    here = Path(sys.executable).parent
    if not (here / "ninja").is_file():
        return
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and Path(p) != here]
    os.environ["PATH"] = os.pathsep.join([str(here), *rest])
