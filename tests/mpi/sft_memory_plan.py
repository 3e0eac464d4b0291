"""Run under MPI: `hpcvla sft`'s learners plan their GPUs' memory once their devices are bound
(imitation/sft.planned_memory), as on a GPU node: every rank gets rank 0's figures; where they
overfill the GPUs (`placement.gpu_memory_gb`, argv[1]) every rank refuses alike and the world
ends with one message and exit 2 (job/runtime.run_guarded), not an abort. A torch.device
names a GPU without CUDA: the plan needs the learners' devices, not the GPUs."""

import json
import sys

import torch
from mpi4py import MPI

from hpcvla.config import load_config
from hpcvla.envs import env_spec
from hpcvla.imitation.sft import planned_memory
from hpcvla.job.runtime import run_guarded

cfg = load_config("configs/reach_flow.yaml", ["policy.size=tiny", "sft.batch_size=64",
                                              f"placement.gpu_memory_gb={sys.argv[1]}"])
world = MPI.COMM_WORLD


planned = []


def plan():
    memory = planned_memory(cfg, world, torch.device("cuda:0"), env_spec(cfg.env))
    planned.append({"gpu": memory.gpu, "device": memory.device})


code = run_guarded(world, "sft learner", plan, "sft")
# every rank's exit status and plan, one line from rank 0 (the ranks' own lines interleave)
everyone = world.gather({"code": code, "plan": planned[0] if planned else None}, root=0)
if world.Get_rank() == 0:
    print(json.dumps(everyone), flush=True)
sys.exit(code)
