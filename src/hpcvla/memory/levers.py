"""The settings that shrink what a learner's GPU holds (memory levers), in one list: what the
memory plan advises where a GPU overfills (layout.knobs) and what `hpcvla plan --auto` turns,
one more at a time, where no layout fits (scale/memory_fit.py). A lever is offered only where
the config's rules take it turned, after the ones before it (config.checks: SAC and RLPD
refuse ZeRO-3, Horovod refuses the optimizer's offload and bf16 and has no ZeRO stages), so
no advice names a setting the next run refuses."""

from __future__ import annotations

import copy
from typing import NamedTuple

from hpcvla.config.checks import cross_field_problems
from hpcvla.config.families import family


class Lever(NamedTuple):
    field: str
    value: object
    why: str  # what it does, for the advice
    automatic: bool  # plan --auto may turn it (it changes memory, not what is learned)


def memory_levers(cfg, automatic_only: bool = False) -> list[Lever]:
    """The levers for `cfg`, largest first: gradient checkpointing (the VLA families), LoRA
    (advice: it changes what trains), each higher ZeRO stage, the optimizer state offloaded
    to host memory, bf16 weights (advice: the VLA families; the default one has no dtype).
    Every lever alone where `cfg` with it has no new cross-field problem (the advice's
    alternatives); `automatic_only`: the ones plan --auto turns, each kept where `cfg` with it
    and the kept ones before it has none (the search turns them one after another)."""
    vla = family(cfg.policy.name).vla
    candidates = []
    if vla and not cfg.learner.gradient_checkpointing:
        candidates.append(Lever("learner.gradient_checkpointing", True,
                                "activations recomputed in backward", True))
    if vla and not cfg.policy.lora_rank:
        candidates.append(Lever("policy.lora_rank", 16,
                                "LoRA: optimizer state for the adapters only", False))
    if cfg.learner.backend == "deepspeed":
        candidates += [Lever("learner.zero_stage", stage, "with more learners", True)
                       for stage in range(max(1, cfg.learner.zero_stage + 1), 4)]
    if not cfg.learner.offload_optimizer:
        candidates.append(Lever("learner.offload_optimizer", True,
                                "optimizer state in host memory", True))
    if vla and cfg.policy.dtype != "bfloat16":
        candidates.append(Lever("policy.dtype", "bfloat16", "half the weights' bytes", False))
    known = set(map(repr, cross_field_problems(cfg)))
    kept, current = [], cfg
    for lever in candidates:
        if automatic_only and not lever.automatic:
            continue
        trial = turned(current if automatic_only else cfg, lever.field, lever.value)
        if set(map(repr, cross_field_problems(trial))) <= known:
            kept.append(lever)
            current = trial
    return kept


def turned(cfg, field: str, value):
    """`cfg` with one lever set."""
    out = copy.deepcopy(cfg)
    section, name = field.split(".")
    setattr(getattr(out, section), name, value)
    return out


def override(field: str, value) -> str:
    return f"{field}={str(value).lower() if isinstance(value, bool) else value}"


__all__ = ["Lever", "memory_levers", "override", "turned"]
