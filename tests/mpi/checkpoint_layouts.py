"""Under MPI, every rank a learner (colocated). `write` takes a few optimizer steps at each ZeRO
stage 0-3 and checkpoints, and beside each checkpoint writes the reference: the full fp32
masters, Adam moments and step as DeepSpeed itself assembles them from the partitions
(deepspeed.utils.safe_get_full_*; the torch optimizer's own state where nothing is
partitioned). `read` loads each checkpoint into engines of two other stages on this world's
learner count (LOADED_AT: every stage loads two others' checkpoints), assembles their full
state the same way and requires it equal to the reference, bit for bit.

    mpiexec -n 2 python -m mpi4py tests/mpi/checkpoint_layouts.py write DIR CONFIG [k=v ...]
    mpiexec -n 3 python -m mpi4py tests/mpi/checkpoint_layouts.py read DIR CONFIG [k=v ...]
"""

import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hpcvla.checkpoint import catalog, store
from hpcvla.config import load_config
from hpcvla.engines import full_state as gathered
from hpcvla.engines import init_engine
from hpcvla.envs import make_env
from hpcvla.factory import build_policy
from hpcvla.job.runtime import run_ranks

STAGES = (0, 1, 2, 3)
# the stages each saved stage's checkpoint is loaded at: 8 of the 12 pairs of two stages, each
# stage saving for two and loading from two (a checkpoint holds whole tensors, whatever the
# stage that wrote it: what can break is a stage's writing or a stage's reading)
LOADED_AT = {saved: ((saved + 1) % 4, (saved + 3) % 4) for saved in STAGES}
KEYS = ("exp_avg", "exp_avg_sq")


def setup(stage, seed):
    cfg = load_config(sys.argv[3], [*sys.argv[4:], f"learner.zero_stage={stage}"])
    env = make_env("reach", cfg.learner.micro_batch, seed=seed, image_size=32)
    torch.manual_seed(seed)
    return cfg, env, build_policy(cfg, env.spec)


def full_state(engine) -> dict[str, torch.Tensor]:
    """Every trainable parameter's fp32 master, moments and step, whole (collective)."""
    return dict(state_items(engine))


def state_items(engine) -> Iterator[tuple[str, torch.Tensor]]:
    """full_state's tensors one at a time, in the same order on every learner (collective:
    each partitioned one is assembled as it is yielded, so a caller need not hold them all)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    torch_optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19.8 (ZeRO-1/2, bf16) links its views of the optimizer state once, after
        # the first group's first step, when the critic's group has no state yet: link again
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    copies = {id(lp): hp for lps, hps in zip(getattr(engine.optimizer, "fp16_groups", []),
                                              getattr(engine.optimizer, "fp32_groups", []))
              for lp, hp in zip(lps, hps)}  # stage 0 under bf16: DeepSpeed's fp32 copies

    def host(value: torch.Tensor) -> torch.Tensor:
        return value.detach().float().cpu().contiguous()

    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):  # partitioned
            yield f"{name}/master", host(safe_get_full_fp32_param(p))  # [dist]
            for key in KEYS:
                yield f"{name}/{key}", host(safe_get_full_optimizer_state(p, key))  # [dist]
        else:
            master = copies.get(id(p), p)
            yield f"{name}/master", host(master)
            for key in KEYS:
                yield f"{name}/{key}", host(torch_optimizer.state[master][key])
    steps = {float(s["step"]) for s in torch_optimizer.state.values()}
    assert len(steps) == 1, steps
    yield "step", torch.tensor(steps.pop())


def write(learners, root: Path):
    for stage in STAGES:
        cfg, env, policy = setup(stage, seed=stage)
        engine = init_engine(cfg, policy, learners)  # [dist]
        obs = {k: torch.as_tensor(v) for k, v in env.reset().items()}
        actions = torch.randn(env.num_envs, env.spec.chunk_len, env.spec.action_dim)
        for _ in range(3 * cfg.learner.micro_batches):  # three optimizer steps
            logprob, value, entropy = engine(obs, actions)
            engine.backward(-logprob.mean() + value.pow(2).mean() - 0.01 * entropy.mean())
            engine.step()
        reference = full_state(engine)
        store.save(root / f"stage{stage}", engine, gathered(engine), version=3,
                   counters={}, learners=learners)  # [dist]
        if learners.Get_rank() == 0:
            save_file(reference, str(root / f"stage{stage}.reference.safetensors"))


def read(learners, root: Path):
    for saved in STAGES:
        path = catalog.latest(root / f"stage{saved}")
        reference = load_file(str(root / f"stage{saved}.reference.safetensors"))
        for stage in LOADED_AT[saved]:
            # another initialisation: everything must come from disk
            cfg, env, policy = setup(stage, seed=100 + stage)
            policy.load_arrays(store.load_weights(path, policy.state_dict()))
            engine = init_engine(cfg, policy, learners)  # [dist]
            store.load_optimizer(path, engine, learners)
            resumed = full_state(engine)
            assert resumed.keys() == reference.keys(), sorted(resumed.keys() ^ reference.keys())
            for key, value in reference.items():
                assert torch.equal(resumed[key], value), \
                    f"{key}: saved at stage {saved} on 2 learners, loaded at stage {stage} " \
                    f"on {learners.Get_size()}: max |diff| {(resumed[key] - value).abs().max()}"
            if learners.Get_rank() == 0:
                print(f"stage {saved} x2 -> stage {stage} x{learners.Get_size()}: "
                      f"{len(reference)} tensors equal", flush=True)


def main(cfg, plan, comms):
    learners, root = comms.learners, Path(sys.argv[2])
    (write if sys.argv[1] == "write" else read)(learners, root)
    learners.Barrier()  # leave together, gloo closed first (else std::terminate at exit)
    torch.distributed.destroy_process_group()
    learners.Barrier()  # nobody exits while a peer's gloo threads still run (job/runtime.py)


if __name__ == "__main__":
    sys.exit(run_ranks(load_config(sys.argv[3], sys.argv[4:]), main))
