"""The learners' data-parallel engine (`learner.backend`): DeepSpeed ZeRO (zero.py) or Horovod
(horovod.py) where it is installed, both behind the non-finite guard (nonfinite.py) and both
speaking the `Engine` interface (base.py) that the learner loop and the checkpoints use."""

from __future__ import annotations

import torch

from hpcvla.engines.base import (Engine, adamw, critic_steps_only, full_state, param_groups,
                                 unbroadcast_state)
from hpcvla.engines.nonfinite import SkipNonfinite


def init_engine(cfg, policy, learners_comm, device: torch.device | None = None) -> SkipNonfinite:
    """The configured engine over `policy` on the learner communicator (collective there),
    wrapped in the non-finite guard. The learner's copy of the policy recomputes its
    activations in the backward pass under learner.gradient_checkpointing. Every learner
    starts from learner 0's parameters (DeepSpeed broadcasts the module's parameters, Horovod
    its state dict), so learner 0 alone reads a folder or checkpoint: a policy's state is its
    parameters (unbroadcast_state says what is not)."""
    left = unbroadcast_state(policy)
    assert not left, f"{policy.family}: {left[:3]} are not parameters; DeepSpeed's start " \
        "broadcasts parameters only, so they would differ between the learners"
    if cfg.learner.gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    if cfg.learner.backend == "horovod":
        from hpcvla.engines.horovod import init_horovod

        device = torch.device("cpu") if device is None else torch.device(device)
        engine = init_horovod(cfg, policy, learners_comm, adamw(cfg, policy), device)  # [dist]
    else:
        from hpcvla.engines.zero import deepspeed_engine

        engine = deepspeed_engine(cfg, policy, learners_comm, device)  # [dist]
    return SkipNonfinite(engine, cfg.learner.max_nonfinite_steps)


def preload(cfg, device: torch.device) -> None:
    """Import what init_engine will on `device`: the backend, and TorchDynamo, which torch's
    optimizers import when the first is built (~2 s of a core; DeepSpeed ~0.7 s more). A
    learner rank calls it while the simulators build their envs, so that its engine, which
    every first version waits for, starts with them loaded."""
    import torch._dynamo  # noqa: F401
    if cfg.learner.backend == "horovod":
        import horovod.torch  # noqa: F401
    else:
        from hpcvla.engines.zero import lean_deepspeed
        lean_deepspeed(device)


__all__ = ["Engine", "SkipNonfinite", "critic_steps_only", "full_state", "init_engine",
           "param_groups", "preload", "unbroadcast_state"]
