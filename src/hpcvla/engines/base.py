"""The engine interface the learner trains through, and what every engine shares: the
optimizer's parameter groups and the full weights gathered for publishing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from hpcvla.policies.base import is_critic


class Engine(Protocol):
    """A data-parallel training engine over one policy, on the learner communicator: the part
    of DeepSpeed's engine interface that the learner loop, the checkpoints and the non-finite
    guard use. DeepSpeed's engine has it; engines/horovod.py implements it; engines/nonfinite.py
    wraps either (and adds `skipped`)."""

    # Read-only here, so that a wrapper's properties (SkipNonfinite's) meet the interface too
    @property
    def module(self) -> torch.nn.Module: ...  # the policy
    @property
    def optimizer(self) -> Any: ...  # its param_groups are the ones param_groups() names
    @property
    def device(self) -> torch.device: ...
    @property  # optimizer steps the engine itself skipped (non-finite gradient)
    def skipped_steps(self) -> int: ...

    def __call__(self, obs: dict, actions: torch.Tensor, real: torch.Tensor | None = None):
        """The policy's forward: evaluate's (log-prob, value, entropy), or with the real-steps
        mask (hpcvla sft) its imitation loss."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of one micro-batch (averaged over the learners by the
        accumulation boundary)."""

    def step(self) -> None:
        """One micro-step; at the accumulation boundary the optimizer steps."""

    def is_gradient_accumulation_boundary(self) -> bool: ...

    def zero_optimization_stage(self) -> int: ...

    def bfloat16_enabled(self) -> bool: ...

    def fp16_enabled(self) -> bool: ...


def param_groups(policy, alg) -> list[dict]:
    """The optimizer's groups: the actor (and shared encoders) at `algorithm.lr`, the critic
    (`value_*` modules) at `algorithm.critic_lr`, each named for roles/learner.actor_scaled."""
    named = list(policy.named_parameters())
    groups = [{"params": [p for n, p in named if not is_critic(n)], "lr": alg.lr, "name": "actor"},
              {"params": [p for n, p in named if is_critic(n)], "lr": alg.critic_lr or alg.lr,
               "name": "critic"}]
    return [g for g in groups if g["params"]]


@contextmanager
def critic_steps_only(engine) -> Iterator[None]:
    """Inside, an optimizer step moves the critic's group (`param_groups`) alone: every other
    group (the actor, shared encoders, SAC's temperature) keeps its weights and its optimizer
    state, Adam's moments and step count, as they were. A learning rate of 0 would keep the
    weights only: DeepSpeed and Horovod give a parameter without a gradient a zero one, the
    moments would decay and the step count advance, and after k such steps the actor's first
    real steps would be up to ~3-6x Adam's usual (its bias correction spent on nothing).
    The groups leave the torch optimizer's `param_groups` for the length of its step, as
    DeepSpeed itself steps one group at a time (ZeRO hands the torch optimizer its flat fp32
    partitions group by group, ZeRO-3 sub-group by sub-group, inside the engine's step).
    Horovod's optimizer steps torch's inside its own step: the groups return at the outer
    step's end."""
    optimizer = engine.optimizer
    while not isinstance(optimizer, torch.optim.Optimizer):  # ZeRO's and bf16's wrappers
        optimizer = optimizer.optimizer
    held: list[tuple[dict, list]] = []
    depth = [0]

    def leave(opt, args, kwargs):
        depth[0] += 1
        for group in opt.param_groups:
            if group.get("name") != "critic" and group["params"]:
                held.append((group, group["params"]))
                group["params"] = []

    def come_back(opt=None, args=None, kwargs=None):
        depth[0] -= 1
        if depth[0] <= 0:
            for group, params in held:
                group["params"] = params
            held.clear()
    hooks = [optimizer.register_step_pre_hook(leave), optimizer.register_step_post_hook(come_back)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        depth[0] = 0
        come_back()  # a step that raised


def adamw(cfg, policy) -> torch.optim.AdamW:
    """AdamW over `param_groups`, fused on a GPU: torch's default there, the multi-tensor
    step, allocates a copy of every parameter it updates at its peak (4 bytes per parameter
    with fp32 masters: 12 GiB for π0, measured), which the fused kernel does not; and fused
    under learner.offload_optimizer, where it steps the host's fp32 state (torch's fused CPU
    kernel: DeepSpeedCPUAdam would be as fast, but its bias correction, kept incrementally,
    differs in the last bits after a resume, which then is not exact)."""
    alg = cfg.algorithm
    return torch.optim.AdamW(param_groups(policy, alg), betas=(0.9, alg.adam_beta2),
                             eps=alg.adam_eps, weight_decay=alg.weight_decay,
                             fused=policy.device.type == "cuda" or cfg.learner.offload_optimizer)


def full_state(engine: Engine, wanted: bool = True) -> dict[str, torch.Tensor] | None:
    """Full weights as host tensors in the module's dtype (bf16 stays bf16; ZeRO-3 gathers
    its shards one tensor at a time, so a learner's GPU holds the largest parameter whole,
    not the model: collective on the learners). On a CPU learner below ZeRO-3 they share the
    parameters' memory: copy them out before the next step. A learner that does not want
    them (not the one that publishes or checkpoints) gets None, without copying the model to
    host memory, and still takes part in ZeRO-3's gathers."""
    import deepspeed

    module = engine.module
    if engine.zero_optimization_stage() != 3:
        return {k: v.detach().cpu() for k, v in module.state_dict().items()} if wanted \
            else None
    state: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict(keep_vars=True).items():  # the same order everywhere
        if hasattr(value, "ds_id"):  # a partitioned parameter
            with deepspeed.zero.GatheredParameters([value]):  # [dist]
                if wanted:
                    state[key] = value.detach().cpu().clone()
        elif wanted:  # a buffer: whole on every learner
            state[key] = value.detach().cpu().clone()
    return state if wanted else None


def unbroadcast_state(policy: torch.nn.Module) -> list[str]:
    """What of `policy`'s state dict is no parameter (a persistent buffer): what an engine's
    start would not copy from learner 0 to the others."""
    params = {name for name, _ in policy.named_parameters(remove_duplicate=False)}
    return sorted(set(policy.state_dict()) - params)
