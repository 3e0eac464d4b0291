"""Run under MPI: a world srun or mpirun started directly (no launcher planned it) plans its
GPUs' memory once its ranks know their GPUs, and ends with one message and exit 2 where they
are overfilled. argv: the job ("train": roles/prologue.world_memory, tell_verdict and
refuse_overfilled, as the prologue calls them under job/runtime.run_ranks, a simulator hearing
the verdict last; "eval": evaluate.refuse_placed under run_guarded, as `hpcvla eval` runs),
placement.gpu_memory_gb, how the ranks see the node's GPUs ("bound": each its own as its
cuda:0, as Slurm's --gpus-per-task binds them; "shared": one GPU for all), the run root.
Devices are named without CUDA: the plan needs the ranks' devices and GPU identities (UUIDs),
not the GPUs. Rank 0 prints one JSON line: every rank's exit status and the memory model's GPU
figures (train: memory.json)."""

import json
import sys
import time
from pathlib import Path

from mpi4py import MPI

from hpcvla.config import load_config
from hpcvla.devices import assign_node
from hpcvla.envs import env_spec
from hpcvla.evaluate import refuse_placed
from hpcvla.job.runtime import create_run_dir, run_guarded, run_ranks
from hpcvla.roles.outputs import MEMORY_PLAN
from hpcvla.roles.prologue import refuse_overfilled, tell_verdict, world_memory
from hpcvla.topology.plan import INF, SIM

job, capacity, seen, root = sys.argv[1:5]
cfg = load_config("configs/reach_flow.yaml", ["policy.size=tiny", f"run.root={root}",
                                              f"placement.gpu_memory_gb={capacity}"])
world = MPI.COMM_WORLD
rank = world.Get_rank()
planned = []


def placed(roles) -> list[tuple[str, str | None]]:
    """Every rank's device and GPU as devices.rank_device finds them (one node here)."""
    visible = world.allgather((f"GPU-{rank}" if seen == "bound" else "GPU-0",))
    gpus = assign_node(roles, visible, sim_gpu=False)
    return [("cpu", None) if gpu is None else (f"cuda:{visible[r].index(gpu)}", gpu)
            for r, gpu in enumerate(gpus)]


def train(cfg, plan, comms):
    where = placed([i.roles for i in plan.ranks])
    run_dir = create_run_dir(cfg, world)
    problems = []
    if rank == plan.weight_root:
        problems = world_memory(cfg, plan, where, env_spec(cfg.env), run_dir)
        planned.append(json.loads((Path(run_dir) / MEMORY_PLAN).read_text())["gpu"])
    told = tell_verdict(world, plan, problems)
    if rank == 1:  # a simulator hears the verdict once its envs are built, after the others
        time.sleep(2.0)
    refuse_overfilled(world, plan, problems, [], told)
    for request in told:
        request.wait()


def evaluate():
    refuse_placed(cfg, world, placed([(SIM, INF)] * world.Get_size()), envs=16)
    planned.append("fits")


code = run_ranks(cfg, train, command="train") if job == "train" else \
    run_guarded(world, "evaluator", evaluate, "eval")
everyone = world.gather({"code": code, "plan": planned[0] if planned else None}, root=0)
if rank == 0:
    print(json.dumps(everyone), flush=True)
sys.exit(code)
