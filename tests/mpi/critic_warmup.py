"""Run under MPI with every rank a learner (colocated): PPO's critic warm-up
(algorithm.critic_warmup_versions) through the learner's own version step `learn` on the real
engine (DeepSpeed or Horovod, `learner.backend`). A warm-up version moves the critic
(`value_*`) and nothing else, on every learner alike, and leaves the actor's optimizer state
unspent (its step count 0), its weight decay too; the first version after it moves the actor
too. The optimizer is AdamW with the algorithm's beta2, epsilon and weight decay.

    mpiexec -n 2 python -m mpi4py tests/mpi/critic_warmup.py CONFIG [key=value ...]
"""

import sys

import numpy as np
import torch.distributed
from mpi4py import MPI

from hpcvla.checkpoint.optimizer_state import base_optimizer, fragments
from hpcvla.config import load_config
from hpcvla.engines import full_state, init_engine
from hpcvla.envs import make_env
from hpcvla.factory import build_policy
from hpcvla.job.runtime import run_ranks
from hpcvla.metrics.progress import Progress
from hpcvla.metrics.timeline import Timeline
from hpcvla.roles.learner import learn
from nonfinite import segments


def main(cfg, plan, comms):
    rank = comms.learners.Get_rank()
    spec = make_env("reach", 1, seed=0, image_size=cfg.env.image_size).spec
    engine = init_engine(cfg, build_policy(cfg, spec), comms.learners)
    alg = cfg.algorithm
    with base_optimizer(engine) as optimizer:  # the algorithm's AdamW settings, every group
        assert {(tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in optimizer.param_groups
                } == {((0.9, alg.adam_beta2), alg.adam_eps, alg.weight_decay)}
    group = dict(segments(cfg, build_policy(cfg, spec), seed=rank), version=np.zeros(1, int))
    timeline = Timeline(None, rank, "learner")
    progress = Progress(None, cfg.pipeline.total_updates, spec.chunk_len, 1e9, enabled=False)
    warmup = cfg.algorithm.critic_warmup_versions

    def moved(version):
        before = {k: v.clone() for k, v in full_state(engine).items()}
        learn(cfg, engine, [[group]], version, timeline, progress)
        after = full_state(engine)
        return {k for k in before if not np.array_equal(before[k], after[k])}

    def steps():  # each parameter range's optimizer step count: the actor's, the critic's
        counts: dict[bool, set[float]] = {True: set(), False: set()}
        for fragment in fragments(engine, rank):
            state = fragment.state()
            counts[fragment.name.startswith("value_")].add(float(state.get("step", 0)))
        return counts[False], counts[True]

    for version in range(warmup):
        changed = moved(version)
        assert changed and all(k.startswith("value_") for k in changed), sorted(changed)
    # the warm-up's steps spent none of the actor's optimizer state (Adam's step count)
    per_version = cfg.learner.epochs + cfg.algorithm.critic_epochs
    assert steps() == ({0.0}, {float(warmup * per_version)}), steps()
    changed = moved(warmup)
    assert any(not k.startswith("value_") for k in changed), sorted(changed)
    assert steps() == ({float(cfg.learner.epochs)}, {float((warmup + 1) * per_version)}), steps()
    # every learner holds the same weights: the warm-up steps were the same on all of them
    digest = [float(v.double().sum()) for v in full_state(engine).values()]
    assert comms.learners.allreduce(digest, MPI.MAX) == comms.learners.allreduce(digest, MPI.MIN)
    if rank == 0:
        print(f"critic warm-up: {warmup} versions moved the critic alone, version {warmup} "
              f"moved {len(changed)} tensors", flush=True)
    comms.learners.Barrier()  # leave together (see nonfinite.py: gloo's threads)
    if torch.distributed.is_initialized():  # DeepSpeed's; Horovod has none
        torch.distributed.destroy_process_group()
    comms.learners.Barrier()


if __name__ == "__main__":
    sys.exit(run_ranks(load_config(sys.argv[1], sys.argv[2:]), main))
