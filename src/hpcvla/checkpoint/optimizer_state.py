"""A learner's optimizer state as per-parameter fragments, whatever the engine and ZeRO stage:
what checkpoints store, so that a run resumes on any learner count and any ZeRO stage.

For every trainable parameter (by its name in the policy) a learner holds a contiguous range
`[start, start + numel)` of the parameter flattened, in fp32: of its master weights and of each
optimizer moment (Adam's `exp_avg`, `exp_avg_sq`), plus the optimizer's step count.

* ZeRO-1/2 and DeepSpeed's bf16 optimizer (stage 0 with bf16): the range of the parameter that
  falls into this learner's partition of its group's flat fp32 tensor (DeepSpeed's
  `param._hp_mapping` says where it lies in both);
* ZeRO-3: the parameter's own partition; learner r holds `[r*P, (r+1)*P)`, the last one padded;
* stage 0 and Horovod: the whole parameter, the same on every learner (learner 0 saves it and,
  at a resume, reads it for all); the masters are the weights themselves in fp32, DeepSpeed's
  fp32 copies under bf16.

Saving copies each learner's ranges out (the ranges are not communicated; a barrier and an
allgather of the replicas' digests check the layout). Loading, a learner asks for its
own ranges in the new layout and gets them assembled from whichever saved ranges overlap them:
re-partitioning by address, exactly (store.py keeps the addresses in state.json).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

MASTER = "master"


@dataclass
class Fragment:
    """One trainable parameter's range on this learner, and how to read and write it.
    `tensor(key)` is the range of `key` (MASTER or an optimizer state's name) as a flat fp32
    tensor; `write(key, value)` puts a tensor of `numel` values there; `state` is the torch
    optimizer's state dict the range lives in (its step count; its moments' names).
    `replicated`: every learner holds the same whole parameter (learner 0 saves it)."""
    name: str
    start: int
    numel: int
    tensor: Callable[[str], torch.Tensor]
    write: Callable[[str, torch.Tensor], None]
    state: Callable[[], dict]
    replicated: bool = False


@contextmanager
def base_optimizer(engine):
    """The torch optimizer itself (ZeRO wraps it; stage 0 and Horovod hand it over as is).
    ZeRO-3 lends it its fp32 partitions only during a step; they are put in place meanwhile,
    as DeepSpeed's own checkpoints do."""
    zero = engine.optimizer
    stage3 = hasattr(zero, "_set_fp32_optimizer_param_groups")
    if stage3:
        zero._set_fp32_optimizer_param_groups()
    try:
        yield getattr(zero, "optimizer", zero)
    finally:
        if stage3:
            zero._clear_fp32_optimizer_param_groups()


def fragments(engine, rank: int) -> list[Fragment]:
    """This learner's fragments (learner `rank` of the engine's communicator), in the order
    of the policy's parameters."""
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO-3: unused
    # DeepSpeed's unfused bf16/fp16 optimizer (stage 0) keeps one fp32 copy per parameter
    masters = {id(lp): hp for lps, hps in zip(getattr(engine.optimizer, "fp16_groups", []),
                                               getattr(engine.optimizer, "fp32_groups", []))
               for lp, hp in zip(lps, hps)}
    out = []
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        if hasattr(param, "ds_id"):
            out += _zero3(name, param, rank)
        elif getattr(param, "_hp_mapping", None) is not None:
            out.append(_partitioned(name, param, optimizer))
        elif not hasattr(param, "_hp_mapping"):
            out.append(_replicated(name, masters.get(id(param), param), optimizer))
    return out


def replicas_agree(parts: list[Fragment], learners) -> None:
    """Learner 0 alone saves the state every learner holds whole (stage 0, Horovod): check,
    collectively, that the learners' copies agree (a digest of each replicated tensor's bits)
    before it stands for all of them. `parts`: this learner's fragments."""
    if learners.Get_size() == 1:
        return
    digest = []
    for fragment in parts:
        if fragment.replicated:
            state = fragment.state()
            for key in (MASTER, *(k for k, v in state.items()
                                  if k != "step" and torch.is_tensor(v))):
                digest.append(_digest(fragment.tensor(key)))
    everyone = learners.allgather(digest)  # [dist]
    if any(other != everyone[0] for other in everyone):
        differ = [r for r, other in enumerate(everyone) if other != everyone[0]]
        raise RuntimeError(f"learners {differ} hold optimizer states (weights, moments) that "
                           "differ from learner 0's, which should be replicas: the learners "
                           "did not step on the same averaged gradients")


def _digest(value: torch.Tensor) -> int:
    """The bits of a tensor, digested exactly (replicas hold the same bits). On the host,
    crc32 of its bytes: ~2 GB/s on a core, where sums in float64 took ~4x as long. On a GPU,
    the sum of its words modulo 2^64, there: integer addition, exact in any order, and no
    copy of GBs to the host."""
    words = value.detach().contiguous().view(-1)
    if words.device.type == "cpu":
        return zlib.crc32(words.view(torch.uint8).numpy())
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[words.element_size()]
    return int(words.view(as_int).sum(dtype=torch.int64))


def ensure_state(engine, keys: list[str]) -> None:
    """Give an engine that has not stepped yet its optimizer state (zeros, step 0) so that
    fragments can be written into it: torch creates Adam's state at the first step."""
    with base_optimizer(engine) as optimizer:
        if all(p in optimizer.state for g in optimizer.param_groups for p in g["params"]):
            return
        saved = optimizer.state_dict()
        saved["state"] = {i: {"step": torch.tensor(0.0),
                              **{k: torch.zeros_like(p) for k in keys}}
                          for i, p in enumerate(p for g in optimizer.param_groups
                                                for p in g["params"])}
        optimizer.load_state_dict(saved)


def _replicated(name, param, optimizer) -> Fragment:
    """`param`: the fp32 tensor the torch optimizer steps (its state's key)."""
    def tensor(key):
        return (param if key == MASTER else optimizer.state[param][key]).detach().view(-1)

    def write(key, value):
        with torch.no_grad():
            tensor(key).copy_(value)
    return Fragment(name, 0, param.numel(), tensor, write, lambda: optimizer.state[param],
                    replicated=True)


def _partitioned(name, param, optimizer) -> Fragment:
    mapping = param._hp_mapping
    flat = optimizer.param_groups[mapping.param_group_index]["params"][0]
    lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address

    def tensor(key):
        whole = flat if key == MASTER else optimizer.state[flat][key]
        return whole.detach().narrow(0, hp.start, hp.numel)

    def write(key, value):
        with torch.no_grad():
            tensor(key).copy_(value)
    return Fragment(name, lp.start, lp.numel, tensor, write, lambda: optimizer.state[flat])


def _zero3(name, param, rank) -> list[Fragment]:
    from deepspeed.utils import (safe_get_local_fp32_param, safe_get_local_optimizer_state,
                                 safe_set_local_fp32_param, safe_set_local_optimizer_state)

    zero = param._z3_optimizer
    size = param.ds_tensor.ds_numel  # the partition, padded
    start = rank * size
    numel = max(0, min(size, param.ds_numel - start))
    if numel == 0:
        return []

    def local(key):
        return (safe_get_local_fp32_param(param) if key == MASTER
                else safe_get_local_optimizer_state(param, key))

    def write(key, value):
        padded = local(key).detach().clone()
        padded[:numel].copy_(value)
        if key == MASTER:
            safe_set_local_fp32_param(param, padded)
        else:
            safe_set_local_optimizer_state(param, padded, key)

    def state():
        group = zero.grad_position[zero.get_param_id(param)][0]
        return zero.optimizer.state[zero.fp32_partitioned_groups_flat[group]]
    return [Fragment(name, start, numel, lambda key: local(key).detach()[:numel], write, state)]
