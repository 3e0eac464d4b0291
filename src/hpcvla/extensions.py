"""Stale build locks of JIT-compiled extensions.

DeepSpeed compiles some ops on first use (on CPU: its shared-memory communication op, when the
learners initialise) through torch's cpp_extension, which holds a `lock` file in the op's
build directory while it builds, and *waits for that file to vanish* whenever it exists, even
when the op is already built. A build killed mid-way (a job hitting its time limit, a Ctrl-C)
leaves the file behind, and every later run waits forever inside `deepspeed.initialize`,
silently. A real build takes about a minute, so a lock older than `STALE_AFTER_S` is removed,
with a warning that names it.
"""

from __future__ import annotations

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
