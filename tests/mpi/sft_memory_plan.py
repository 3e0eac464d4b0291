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


def plan():
    memory = planned_memory(cfg, world, torch.device("cuda:0"), env_spec(cfg.env))
    print(json.dumps({"rank": world.Get_rank(), "gpu": memory.gpu, "device": memory.device}),
          flush=True)


code = run_guarded(world, "sft learner", plan)
print(f"rank {world.Get_rank()} ended: {code}", flush=True)
sys.exit(code)
