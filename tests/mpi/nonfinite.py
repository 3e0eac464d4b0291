"""Run under MPI with every rank a learner (colocated): real segments from `reach`, trained by
the learner's own micro-batch step. A NaN reward on learner 1 only poisons the averaged
gradient: every learner skips that optimizer step, weights stay bit-identical, the skip is
counted; a good batch trains again; `learner.max_nonfinite_steps` bad steps in a row stop.
Before them, the first (Adam) step's largest weight change, in learning rates: about 1 for
any gradient well above adam_eps, and tiny where algorithm.max_grad_norm clips the
gradient far below it (the setting reaches the engine's clipping).

    mpiexec -n 2 python -m mpi4py tests/mpi/nonfinite.py CONFIG [key=value ...]
"""

import sys

import numpy as np
import torch

from hpcvla.config import load_config
from hpcvla.envs import make_env
from hpcvla.metrics.timeline import Timeline
from hpcvla.engines import full_state, init_engine
from hpcvla.roles.learner import MicroBatch, train_micro_batch
from hpcvla.factory import build_policy
from hpcvla.roles.segments import SegmentBuilder, outcome_of
from hpcvla.job.runtime import run_ranks


def segments(cfg, policy, seed: int) -> dict:
    """One segment group of micro_batch envs, rolled out by `policy`, as the learner sees it."""
    env = make_env("reach", cfg.learner.micro_batch, seed=seed, image_size=cfg.env.image_size)
    spec = env.spec
    builder = SegmentBuilder(spec.obs, env.num_envs, spec.chunk_len, spec.action_dim,
                             cfg.rollout.segment_len, producer=seed, slot=0)
    obs, result = env.reset(), None
    while True:
        with torch.no_grad():
            actions, logprob, value = (t.numpy() for t in policy.act(policy.obs_to_tensors(obs)))
        if result is not None:
            builder.record_outcome(outcome_of(result))
        if builder.full:
            return builder.finish(value)
        builder.add_step(obs, actions, logprob, value, 0)
        result = env.step(actions)
        obs = result.obs


def main(cfg, plan, comms):
    rank = comms.learners.Get_rank()
    spec = make_env("reach", 1, seed=0, image_size=cfg.env.image_size).spec
    engine = init_engine(cfg, build_policy(cfg, spec), comms.learners)
    good = segments(cfg, build_policy(cfg, spec), seed=rank)
    bad = dict(good, reward=good["reward"].copy())
    if rank == 1:
        bad["reward"][0, 0] = np.nan  # e.g. a simulator's broken reward
    timeline = Timeline(None, rank, "learner")

    moved, logged = [], []  # each step's largest weight change, and its metrics

    def step(batch):
        before = {k: v.clone() for k, v in full_state(engine).items()}  # (views below ZeRO-3)
        logged.append(train_micro_batch(cfg, engine, MicroBatch.arrived(cfg, [batch],
                                                                        engine.device), timeline))
        after = full_state(engine)
        assert all(torch.isfinite(v).all() for v in after.values()), "NaN reached the weights"
        moved.append(max((after[k] - before[k]).abs().max().item() for k in before))
        return not all(torch.equal(before[k], after[k]) for k in before)

    assert step(good) and engine.skipped == 0
    # the step's gradient norm before clipping, the same on every learner (DeepSpeed's, or
    # the averaged gradients' at stage 0), and whether the clipping scaled it down
    norm, clip = logged[0]["grad_norm"], cfg.algorithm.max_grad_norm
    assert 0 < norm < float("inf") and logged[0]["grad_clipped"] == float(norm > clip)
    assert comms.learners.allgather(norm) == [norm] * comms.learners.Get_size()
    if rank == 0:
        lr = max(cfg.algorithm.lr, cfg.algorithm.critic_lr)
        print(f"first step: a weight moved {moved[0] / lr:.3g} learning rates at most "
              f"(max_grad_norm {cfg.algorithm.max_grad_norm:g})", flush=True)
    assert not step(bad) and engine.skipped == 1  # skipped on every learner, weights identical
    assert logged[-1]["nonfinite_skipped"] == 1.0
    assert step(good) and engine.consecutive == 0  # and training goes on
    for _ in range(cfg.learner.max_nonfinite_steps - 1):
        assert not step(bad)
    try:
        step(bad)
    except FloatingPointError as err:
        if rank == 0:
            print(f"ZeRO stage {cfg.learner.zero_stage}: skipped {engine.skipped} steps, "
                  f"then stopped: {err}", flush=True)
    else:
        raise AssertionError("repeated non-finite steps did not stop the run")
    # Leave together and close gloo first, every rank's before any exits (as job/runtime.py
    # does): a rank exiting while its peer's gloo threads still talk to it ends in
    # std::terminate (exit code 6; seen with the barrier before the close alone).
    comms.learners.Barrier()
    torch.distributed.destroy_process_group()
    comms.learners.Barrier()


if __name__ == "__main__":
    sys.exit(run_ranks(load_config(sys.argv[1], sys.argv[2:]), main))
