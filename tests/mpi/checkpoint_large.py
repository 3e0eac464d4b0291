"""Under MPI on 2 ranks, both learners (colocated): a checkpoint whose optimizer state passes
2^31 bytes, as every full-size one does (π0: ~45 GB of model and optimizer state). The policy
is the default one 5,600 wide (190 M fp32 parameters); after two optimizer steps at ZeRO-0,
learner 0 saves the state every learner holds, fp32 masters and Adam's two moments (2.3 GB in
one file), and the weights (0.8 GB). Then both learners build a ZeRO-1 engine from another
initialisation, load the checkpoint re-partitioned, and DeepSpeed's full assembly of what they
hold must equal the saved state bit for bit. Each side keeps a digest of each tensor, not the
tensor (a copy of GBs that would outlive the first engine). Memory: about 7 GB on learner 0,
5 on learner 1.

    mpiexec -n 2 python -m mpi4py tests/mpi/checkpoint_large.py DIR
"""

import gc
import hashlib
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from checkpoint_layouts import state_items
from hpcvla.checkpoint import catalog, store
from hpcvla.config import load_config
from hpcvla.engines import full_state as gathered
from hpcvla.engines import init_engine
from hpcvla.envs import make_env
from hpcvla.factory import build_policy
from hpcvla.job.runtime import run_ranks
from hpcvla.transport.backoff import idle_barrier

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["env.image_size=32", "policy.hidden=5600", "learner.micro_batch=2"]


def setup(stage: int, seed: int):
    cfg = load_config(ROOT / "configs/colocated.yaml",
                      [*OVERRIDES, f"learner.zero_stage={stage}"])
    env = make_env("reach", cfg.learner.micro_batch, seed=seed, image_size=32)
    torch.manual_seed(seed)
    # The default policy's orthogonal init of 5,600-wide layers takes ~40 s on 2 cores; where
    # the weights start does not matter to a checkpoint.
    with mock.patch("torch.nn.init.orthogonal_", lambda w, gain=1.0: torch.nn.init.normal_(w, 0, 0.01)):
        return cfg, env, build_policy(cfg, env.spec)


def digests(engine) -> dict[str, tuple]:
    """Each tensor of the full state (collective): its dtype, shape and SHA-256."""
    return {key: (value.dtype, tuple(value.shape),
                  hashlib.sha256(value.reshape(-1).view(torch.uint8).numpy()).hexdigest())
            for key, value in state_items(engine)}


def main(cfg, plan, comms):
    learners, root = comms.learners, Path(sys.argv[1])
    rank, times = learners.Get_rank(), {}
    cfg, env, policy = setup(stage=0, seed=0)
    engine = init_engine(cfg, policy, learners)  # [dist]
    obs = {k: torch.as_tensor(v) for k, v in env.reset().items()}
    actions = torch.randn(env.num_envs, env.spec.chunk_len, env.spec.action_dim)
    for _ in range(2):  # two optimizer steps: moments that differ from their start
        logprob, value, entropy = engine(obs, actions)
        engine.backward(-logprob.mean() + value.pow(2).mean() - 0.01 * entropy.mean())
        engine.step()
    saved = digests(engine)
    t0 = time.monotonic()
    store.save(root, engine, gathered(engine), version=2, counters={},
               learners=learners)  # [dist]
    idle_barrier(learners)  # [dist] learner 0 has published it
    path = catalog.checkpoint_dir(root, 2)
    times["save_s"] = round(time.monotonic() - t0, 1)
    del engine, policy
    gc.collect()

    cfg, _, policy = setup(stage=1, seed=1)  # another initialisation: all from disk
    t0 = time.monotonic()
    policy.load_arrays(store.load_weights(path, policy.state_dict()))
    engine = init_engine(cfg, policy, learners)  # [dist]
    store.load_optimizer(path, engine, learners)
    times["load_s"] = round(time.monotonic() - t0, 1)
    resumed = digests(engine)  # [dist] ZeRO-1's partitions assembled
    assert resumed.keys() == saved.keys(), sorted(resumed.keys() ^ saved.keys())
    differ = [key for key, value in saved.items() if resumed[key] != value]
    assert not differ, f"not bit-exact after the resume: {differ}"
    files = {p.name: p.stat().st_size for p in path.iterdir() if p.suffix == ".safetensors"}
    learners.Barrier()  # leave together, gloo closed first (else std::terminate at exit)
    torch.distributed.destroy_process_group()
    learners.Barrier()  # nobody exits while a peer's gloo threads still run (job/runtime.py)
    if rank == 0:
        print(json.dumps({"bit_exact": True, "files": files,
                          "optimizer_bytes": files["optimizer.rank0.safetensors"],
                          **times}), flush=True)


if __name__ == "__main__":
    sys.exit(run_ranks(load_config(ROOT / "configs/colocated.yaml", OVERRIDES), main))
