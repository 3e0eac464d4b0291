"""Run under MPI with every rank a learner (colocated): one optimizer step of the configured
`learner.backend` (DeepSpeed's ZeRO or Horovod) over two micro-batches of fixed segments of
`reach` per learner (each learner its own), from the one policy every run builds (seeded);
rank 0 writes the weights before and after it to the safetensors file OUT. Run once per
backend, the same segments: their updates should agree (tests/test_horovod.py).

    mpiexec -n 2 python -m mpi4py tests/mpi/backend_parity.py OUT CONFIG [key=value ...]
"""

import faulthandler
import signal
import sys

import torch
from safetensors.torch import save_file

from hpcvla.config import load_config
from hpcvla.engines import full_state, init_engine
from hpcvla.envs import make_env
from hpcvla.factory import build_policy
from hpcvla.job.runtime import run_ranks
from hpcvla.metrics.timeline import Timeline
from hpcvla.roles.learner import MicroBatch, train_micro_batch
from nonfinite import segments


def main(cfg, plan, comms):
    # a world the launcher's --timeout ends (SIGTERM, then SIGKILL) says where each thread
    # was, before the stop handler run_ranks installed: one Horovod run of this test hung
    # once, beside another test file's worlds (stop 111)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    rank = comms.learners.Get_rank()
    spec = make_env("reach", 1, seed=0, image_size=cfg.env.image_size).spec
    torch.manual_seed(0)  # the policy every backend starts from (rank 0's, broadcast)
    engine = init_engine(cfg, build_policy(cfg, spec), comms.learners)
    before = {k: torch.as_tensor(v).clone() for k, v in full_state(engine).items()}
    torch.manual_seed(100 + rank)  # each learner's own segments, the same in every run
    batches = [segments(cfg, build_policy(cfg, spec), seed=10 * rank + i) for i in range(2)]
    timeline = Timeline(None, rank, "learner")
    for batch in batches:  # learner.micro_batches=2: one optimizer step
        train_micro_batch(cfg, engine, MicroBatch.arrived(cfg, [batch], engine.device), timeline)
    after = {k: torch.as_tensor(v) for k, v in full_state(engine).items()}
    if rank == 0:
        save_file({**{f"before/{k}": v.contiguous() for k, v in before.items()},
                   **{f"after/{k}": v.contiguous() for k, v in after.items()}}, sys.argv[1])
    comms.learners.Barrier()  # (as nonfinite.py: gloo closed before any rank exits)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    comms.learners.Barrier()


if __name__ == "__main__":
    sys.exit(run_ranks(load_config(sys.argv[2], sys.argv[3:]), main))
