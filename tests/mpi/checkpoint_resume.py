"""Run under MPI with every rank a learner (colocated): train, checkpoint, train one more
step; then build a fresh engine from the checkpoint and take the same step. Weights and
optimizer state must come out bit-identical, whatever the ZeRO stage; so must an engine
resumed from a checkpoint written before any optimizer step (SAC's before `learning_starts`)
and trained all the way. At ZeRO-0, where every learner holds the whole state, learner 0
alone reads it at the resume (the others get it broadcast). At ZeRO-3 the full weights a
learner publishes are DeepSpeed's own consolidation's, gathered one tensor at a time (its
largest parameter, not the model, whole at once on a learner). Each variant (a list of
overrides, e.g. a stage; VARIANTS is a JSON list of them) in turn, in one world, into
RUN_DIR/<i>:

    mpiexec -n 2 python -m mpi4py tests/mpi/checkpoint_resume.py CONFIG RUN_DIR VARIANTS \
        [key=value ...]
"""

import json
import sys
from functools import partial
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from hpcvla.checkpoint import catalog, store
from hpcvla.config import load_config
from hpcvla.envs import make_env
from hpcvla.engines import full_state, init_engine
from hpcvla.factory import build_policy
from hpcvla.job.runtime import run_ranks
from hpcvla.transport import pieces


def train_step(engine, obs, actions):
    logprob, value, entropy = engine(obs, actions)
    engine.backward(-logprob.mean() + value.pow(2).mean() - 0.01 * entropy.mean())
    engine.step()


def main(cfg, plan, comms):
    for i, variant in enumerate(json.loads(sys.argv[3])):
        resume_exactly(load_config(sys.argv[1], [*sys.argv[4:], *variant]), comms.learners,
                       Path(sys.argv[2]) / str(i))
    comms.learners.Barrier()  # leave together (see nonfinite.py: gloo's threads)
    torch.distributed.destroy_process_group()
    comms.learners.Barrier()


def resume_exactly(cfg, learners, run_dir):
    env = make_env("reach", cfg.learner.micro_batch, seed=learners.Get_rank(), image_size=32)
    obs = {k: torch.as_tensor(v) for k, v in env.reset().items()}
    actions = torch.randn(env.num_envs, env.spec.chunk_len, env.spec.action_dim,
                          generator=torch.Generator().manual_seed(learners.Get_rank()))
    policy = build_policy(cfg, env.spec)
    engine = init_engine(cfg, policy, learners)
    store.save(run_dir / "unstepped", engine, full_state(engine), version=0, counters={},
               learners=learners)
    steps = cfg.learner.micro_batches  # DeepSpeed steps the optimizer after this many
    for _ in range(2 * steps):
        train_step(engine, obs, actions)
    weights = full_state(engine)
    # only the learner that publishes or checkpoints copies the model to host memory; the
    # others still join ZeRO-3's gather (else this one would wait forever)
    mine = full_state(engine, wanted=learners.Get_rank() == 0)
    assert (mine is None) == (learners.Get_rank() != 0)
    assert mine is None or all(torch.equal(mine[k], weights[k]) for k in weights)
    if cfg.learner.zero_stage == 3:
        gathered_like_deepspeed(engine, weights, learners)
    rng = torch.get_rng_state()  # each learner's stream goes on from here at a resume
    saved = store.save(run_dir, engine, weights, version=2, counters={"env_steps": 7},
                       learners=learners)
    for _ in range(steps):
        train_step(engine, obs, actions)
    continued = full_state(engine)

    path = catalog.latest(run_dir)
    assert learners.Get_rank() != 0 or saved == path, (saved, path)
    initial = build_policy(cfg, env.spec, load=False).state_dict()
    assert not all(torch.equal(weights[k], initial[k]) for k in weights)  # trained: the
    engine2 = engine_as_a_run_resumes(cfg, env.spec, path, learners)  # others' must change
    # in MPI calls of at most 1000 bytes, as a tensor past MAX_MESSAGE goes (π0's embedding)
    with mock.patch.object(store, "verify_file", wraps=store.verify_file) as verified, \
            mock.patch.object(pieces, "bcast", partial(pieces.bcast, limit=1000)):
        torch.manual_seed(12345)  # a resumed world's own seeding, before it loads
        state = store.load_optimizer(path, engine2, learners)
    assert torch.equal(torch.get_rng_state(), rng), "the learner's RNG stream was not resumed"
    read = {Path(call.args[0]).name for call in verified.call_args_list}
    if cfg.learner.zero_stage == 0 and learners.Get_rank() != 0:  # learner 0 reads for all
        assert read == {f"optimizer.rank{learners.Get_rank()}.safetensors"}, read
    assert state["version"] == 2 and state["counters"] == {"env_steps": 7}, state
    for _ in range(steps):
        train_step(engine2, obs, actions)
    resumed = full_state(engine2)
    for name in continued:
        assert torch.equal(continued[name], resumed[name]), f"{name} differs after resume"
    unstepped = catalog.latest(run_dir / "unstepped")
    engine3 = engine_as_a_run_resumes(cfg, env.spec, unstepped, learners)
    store.load_optimizer(unstepped, engine3, learners)
    for _ in range(3 * steps):
        train_step(engine3, obs, actions)
    resumed = full_state(engine3)
    for name in continued:
        assert torch.equal(continued[name], resumed[name]), \
            f"{name} differs after resuming from before the first step"
    if learners.Get_rank() == 0:
        dtype = next(iter(continued.values())).dtype
        print(f"resume bit-identical at ZeRO stage {cfg.learner.zero_stage}: "
              f"{len(continued)} tensors ({dtype})", flush=True)
    learners.Barrier()  # leave together, gloo closed first (else std::terminate at exit)


def engine_as_a_run_resumes(cfg, spec, path, learners):
    """A fresh engine from the checkpoint `path` as a run's learners build it: learner 0
    alone reads its weights, the engine's start gives them to the others (which built theirs
    from run.seed, not the checkpoint): every learner must then hold the checkpoint's."""
    fresh = build_policy(cfg, spec, load=False)
    if learners.Get_rank() == 0:
        fresh.load_arrays(store.load_weights(path, fresh.state_dict()))
    engine = init_engine(cfg, fresh, learners)
    saved, held = store.load_weights(path), full_state(engine)  # [dist] at ZeRO-3
    assert saved.keys() == held.keys() and all(
        torch.equal(held[k].cpu(), saved[k]) for k in saved), \
        f"learner {learners.Get_rank()} does not start from learner 0's weights"
    return engine


def gathered_like_deepspeed(engine, weights, learners):
    """full_state's ZeRO-3 weights are DeepSpeed's consolidated state dict (gathered module by
    module), and none of its gathers asks for more than the largest parameter at once (the
    tiny models' parameters all stay gathered, below DeepSpeed's persistence threshold: what
    is asked is what a large model's learner gathers)."""
    import deepspeed
    reference = engine.engine._zero3_consolidated_16bit_state_dict()  # [dist] (SkipNonfinite)
    if learners.Get_rank() == 0:
        assert reference.keys() == weights.keys()
        assert all(torch.equal(reference[k], weights[k]) for k in weights)
    params = list(engine.module.parameters())
    real, asked = deepspeed.zero.GatheredParameters, []

    class Recording(real):
        def __init__(self, gathered, *args, **kwargs):
            asked.append(sum(p.ds_numel for p in gathered))
            super().__init__(gathered, *args, **kwargs)
    deepspeed.zero.GatheredParameters = Recording
    try:
        full_state(engine)  # [dist]
    finally:
        deepspeed.zero.GatheredParameters = real
    largest, total = max(p.ds_numel for p in params), sum(p.ds_numel for p in params)
    assert max(asked) == largest < total == sum(asked), (max(asked), largest, total)


if __name__ == "__main__":
    sys.exit(run_ranks(load_config(sys.argv[1], sys.argv[4:]), main))
