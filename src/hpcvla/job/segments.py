"""MPICH's shared-memory segments that a failed world leaves in a node's /dev/shm.

MPICH's ranks remove their segments (`/dev/shm/mpich_*`, a few MB each, the node's memory)
when they end cleanly; ranks killed or aborted leave them there, and a requeued Slurm job's
new ranks, whose step ids are the killed ones', would join them. So every launcher removes,
after a failed world, the segments no live process maps: `hpcvla launch` (job/launch.py) on
its machine, jobs/launch.sh on every node of the world at once (and on a requeued job's nodes
before its first world), each node running

    python -m hpcvla.job.segments remove-orphans

which prints the segments it removed. A segment is an orphan when no process maps it at two
looks a second apart: another world on the node maps each segment it creates an instant
after creating it, so one it is still creating is never taken for an orphan.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
SETTLE_S = 1.0  # between the two looks: far beyond a segment's creation and first mapping


def segments() -> set[Path]:
    """This user's MPICH segments on this node (another user's are not ours to remove)."""
    if not SHM_DIR.is_dir():
        return set()
    uid = os.geteuid()
    mine = set()
    for path in SHM_DIR.glob("mpich_*"):
        try:
            if path.stat().st_uid == uid:
                mine.add(path)
        except FileNotFoundError:  # removed meanwhile (its world ended cleanly)
            continue
    return mine


def orphans(before: set[Path] = frozenset(), settle_s: float = 0.0) -> set[Path]:
    """This user's segments not in `before` that no live process maps; with `settle_s`,
    unmapped at a second look that much later too."""
    unmapped = segments() - before - _mapped()
    if unmapped and settle_s > 0:
        time.sleep(settle_s)
        unmapped &= segments() - _mapped()
    return unmapped


def remove_orphans(before: set[Path] = frozenset(), settle_s: float = SETTLE_S) -> set[Path]:
    """Remove the orphans (see `orphans`); the ones removed."""
    removed = orphans(before, settle_s)
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def _mapped() -> set[Path]:
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(Path(line.split()[-1]) for line in maps.read_text().splitlines()
                          if "/dev/shm/" in line)
        except OSError:  # the process ended, or is not ours to read
            continue
    return mapped


def _main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpcvla.job.segments")
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("remove-orphans", help="remove this user's MPICH segments in /dev/shm that "
                   "no process maps, and print them")
    parser.parse_args(argv)
    removed = remove_orphans()
    if removed:
        print(f"{socket.gethostname()}: removed {len(removed)} MPICH segment(s) that no process "
              f"maps from {SHM_DIR}: {' '.join(sorted(p.name for p in removed))}")


if __name__ == "__main__":
    _main()
