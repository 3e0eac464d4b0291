"""Run under MPI (2 ranks): `hpcvla eval`'s ranks evaluate rank 0's choice of policies. Each
rank of an eval world lists the run's checkpoints itself, and a run still training publishes
and prunes them meanwhile: here rank 1 lists one more (the untrained policy twice, no
checkpoint needed). Rank 0 prints one JSON line: every rank's evaluated versions."""

import json
import sys
from pathlib import Path

from mpi4py import MPI

from hpcvla.config import load_config
from hpcvla.evaluate import evaluate_policies

run_dir = Path(sys.argv[1])
cfg = load_config(run_dir / "config.yaml")
world = MPI.COMM_WORLD
policies = [None] * (1 + world.Get_rank())  # what each rank listed
curve = evaluate_policies(cfg, run_dir, policies, episodes=2, envs=1, deterministic=True,
                          world=world)
everyone = world.gather([r["version"] for r in curve], root=0)
if world.Get_rank() == 0:
    print(json.dumps(everyone), flush=True)
