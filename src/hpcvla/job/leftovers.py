"""What a failed MPI world leaves on a node: shared-memory segments in /dev/shm, and the
hwloc topology file of each node's Hydra proxy in /tmp.

The ranks remove their segments (MPICH's `/dev/shm/mpich_*`, Open MPI 4's `vader_segment.*`
and 5's `sm_segment.*`, NCCL's `nccl-*`: MBs each, the node's memory) when they end cleanly;
ranks killed or aborted leave them there, filling a shared node's /dev/shm over failed runs,
and a requeued Slurm job's new MPICH ranks, whose step ids are the killed ones', would join
them. Hydra's proxy (mpiexec's process on each node) writes the node's topology for its ranks
to `/tmp/hydra_hwloc_xmlfile_*` and holds it open; it removes it as it exits, even after a rank
was killed, but not when it is killed itself (a Slurm time limit or scancel, the OOM killer).
So every launcher removes, after a failed world, the orphans: `hpcvla launch`
(job/launch.py) on its machine, jobs/launch.sh on every node of the world at once (and on a
requeued job's nodes before its first world), each node running

    python -m hpcvla.job.leftovers remove-orphans

and each says what it removed (`removal_report`). A segment is an orphan when no process
maps it at two looks a second apart: another world on the node maps each segment it creates
an instant after creating it, so one it is still creating is never taken for an orphan. A
topology file is an orphan when no process has it open: its proxy opens it as it creates it.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
SETTLE_S = 1.0  # between the two looks: far beyond a segment's creation and first mapping
TOPOLOGY_DIR = Path("/tmp")  # Hydra's proxy writes there whatever TMPDIR says
TOPOLOGY_PREFIX = "hydra_hwloc_xmlfile_"


# the names MPI libraries and NCCL give their shared-memory segments (checked against
# MPICH 4-5, Open MPI 4.1 and 5.0 ranks killed in a shared window)
SEGMENT_PREFIXES = ("mpich_", "vader_segment.", "sm_segment.", "nccl-")


def segments() -> set[Path]:
    """This user's MPI and NCCL segments on this node (another user's are not ours to
    remove)."""
    return set().union(*(_mine(SHM_DIR, prefix) for prefix in SEGMENT_PREFIXES))


def topology_files() -> set[Path]:
    """This user's Hydra topology files on this node."""
    return _mine(TOPOLOGY_DIR, TOPOLOGY_PREFIX)


def _mine(directory: Path, prefix: str) -> set[Path]:
    if not directory.is_dir():
        return set()
    uid = os.geteuid()
    mine = set()
    for path in directory.glob(f"{prefix}*"):
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


def topology_orphans() -> set[Path]:
    """This user's Hydra topology files that no live process has open."""
    return topology_files() - held_open(TOPOLOGY_PREFIX)


def remove_orphans(before: set[Path] = frozenset(), settle_s: float = SETTLE_S) -> set[Path]:
    """Remove the orphans: the segments (see `orphans`) and the topology files (see
    `topology_orphans`); the ones removed."""
    removed = orphans(before, settle_s) | topology_orphans()
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


def held_open(prefix: str, pid: int | None = None) -> set[Path]:
    """The files named `prefix`... in TOPOLOGY_DIR that a live process (or process `pid`)
    has open."""
    start = str(TOPOLOGY_DIR / prefix)
    held = set()
    for fd in Path("/proc").glob(f"{pid or '[0-9]*'}/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:  # the process or the descriptor ended, or is not ours to read
            continue
        if target.startswith(start):
            held.add(Path(target))
    return held


def _main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpcvla.job.leftovers")
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("remove-orphans", help="remove this user's MPI segments in /dev/shm that "
                   "no process maps and Hydra topology files in /tmp that no process has "
                   "open, and print them")
    parser.parse_args(argv)
    for line in removal_report(remove_orphans()):
        print(line)


def removal_report(removed: set[Path]) -> list[str]:
    """What `remove_orphans` removed, a line per kind, naming this host and every file."""
    host, lines = socket.gethostname(), []
    for directory, what, how in ((SHM_DIR, "MPI segment(s)", "maps"),
                                 (TOPOLOGY_DIR, "Hydra topology file(s)", "has open")):
        names = sorted(p.name for p in removed if p.parent == directory)
        if names:
            lines.append(f"{host}: removed {len(names)} {what} that no process {how} from "
                         f"{directory}: {' '.join(names)}")
    return lines


if __name__ == "__main__":
    _main()
