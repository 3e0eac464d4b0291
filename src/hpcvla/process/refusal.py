"""A command's refusal, said once, before it has done anything: exit status 2. On a rank of a
world (hpcvla train, sft or eval started by srun or mpirun) every rank finds the same and
raises Refused, which ends the world with one message from rank 0 (job/runtime.py)."""

from __future__ import annotations

import sys

from hpcvla.process.deathwatch import WORLD_COMMANDS, Refused
from hpcvla.process.mpi_select import launcher_rank


def refused(command: str, why) -> int:
    """Exit status 2, `why` said once (by the process alone, or rank 0 of a world)."""
    if command in WORLD_COMMANDS and launcher_rank() is not None:
        raise Refused(str(why))
    if not launcher_rank():  # alone, or rank 0 of a world every rank of which finds the same
        print(f"hpcvla {command}: {why}", file=sys.stderr)
    return 2
