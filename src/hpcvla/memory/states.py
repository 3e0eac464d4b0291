"""Bytes per rank, by arithmetic on a policy's Footprint (footprint.py): what a learner's
engine keeps (the model states, by ZeRO stage), what its micro-batch and an inference batch
add, and the fixed costs of a GPU process. Pure: no torch, no MPI. docs/memory.md."""

from __future__ import annotations

GIB = 2 ** 30
# A CUDA process before it allocates a tensor: the context and the kernels' images torch
# loads (0.60 GiB measured on an H200, torch 2.11 / CUDA 13: device memory in use beyond
# torch's reserve), cuBLAS/cuDNN handles and, on learners, NCCL's buffers (not measured).
CUDA_CONTEXT_BYTES = int(1.0 * GIB)
NCCL_BYTES = int(0.5 * GIB)
# The caching allocator's rounding and fragmentation, over the activations' peak.
ALLOCATOR_SLACK = 0.10
# DeepSpeed's defaults (zero/config.py): the gradient bucket's elements, what ZeRO-3
# prefetches ahead of the layer it computes, and the sub-group ZeRO-3 steps at a time.
REDUCE_BUCKET = 500_000_000
PREFETCH_BUCKET = 50_000_000
SUB_GROUP = 1_000_000_000


def engine_states(fp, zero_stage: int, learners: int) -> tuple[dict, dict, dict]:
    """What one of `learners` data-parallel learners keeps under DeepSpeed at `zero_stage`,
    with AdamW (fused on GPUs) and DeepSpeed's default buckets, as engines/zero.py configures
    it, in bytes by part, grouped by when the parts are alive: (`kept` the whole step,
    `backward` beside the micro-batch's activations, `step` during the optimizer's step).

    kept: the weights in the policy's dtype (ZeRO-3: 1/N, plus what it gathers at a time);
    fp32 master weights where the policy is bf16 or ZeRO partitions the optimizer; AdamW's two
    fp32 moments (1/N from ZeRO-1); bf16 at stage 0 (DeepSpeed's BF16_Optimizer) its fp32
    gradients, and ZeRO-3 its gradient partition (1/N), both allocated once.
    backward: the gradients in the policy's dtype (1/N from ZeRO-2) and, from ZeRO-1, the
    contiguous bucket they are reduced through. step: those gradients and, from ZeRO-1, the
    fp32 gradient partition the optimizer steps on (ZeRO-3: one sub-group of it at a time).
    Measured on an H200 (docs/memory.md), DeepSpeed does not hold them all at once, which its
    estimators assume."""
    n, b, trained = learners, fp.dtype_bytes, fp.trainable
    share = (lambda nbytes, stage: nbytes // n if zero_stage >= stage else nbytes)
    kept = {"weights": share(fp.weight_bytes, 3), "moments": share(8 * trained, 1)}
    if b < 4 or zero_stage >= 1:
        kept["masters"] = share(4 * trained, 1)
    gradients = share(b * trained, 2)
    backward, step = {"gradients": gradients}, {"gradients": gradients}
    if zero_stage >= 1:
        backward["gradient bucket"] = b * min(REDUCE_BUCKET, trained)
        step["fp32 gradients"] = share(4 * trained, 1)
    if zero_stage == 0 and b < 4:
        kept["fp32 gradients"] = 4 * trained
    if zero_stage == 3:  # its gradient partition is allocated once
        kept["gradients"] = gradients
        del backward["gradients"], step["gradients"]
        kept["gathered"] = b * min(fp.params, PREFETCH_BUCKET + 2 * fp.largest_layer)
        step["fp32 gradients"] = 4 * min(SUB_GROUP, trained // n)
    return kept, backward, step


def model_states(fp, zero_stage: int, learners: int) -> dict[str, int]:
    """Every state of `engine_states` counted at once, as DeepSpeed's estimators count them
    (`estimate_zero2/3_model_states_mem_needs`: bf16, 2 + 18/N bytes per parameter at ZeRO-2,
    18/N and the largest layer at ZeRO-3); ZeRO-3's fp32 gradients whole, as they count it."""
    kept, backward, step = engine_states(fp, zero_stage, learners)
    out = {**step, **backward, **kept}
    if zero_stage == 3:
        out["fp32 gradients"] = 4 * fp.trainable // learners
    return out


OFFLOADED = ("masters", "moments", "fp32 gradients")  # learner.offload_optimizer: in host memory


def fields_bytes(fields: dict[str, tuple[tuple, str]]) -> int:
    """The bytes of one of each field (shape, dtype): a policy's extra_fields, per step."""
    import numpy as np
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
               for shape, dtype in fields.values())


STATE_BYTES = 12  # a trained parameter's checkpointed state: fp32 master, AdamW's two moments


def checkpoint_disk_bytes(weight_bytes: int, trainable: int) -> int:
    """A checkpoint's files: the model's weights in their dtype, and the states of the
    trained parameters (STATE_BYTES each; a frozen one has none)."""
    return weight_bytes + STATE_BYTES * trainable


def checkpoint_bytes(fp, zero_stage: int, learners: int, first: bool) -> int:
    """The host copy a learner makes of its states for a checkpoint (checkpoint/store.py),
    held until the background writer has written it: its fp32 masters and AdamW's two fp32
    moments (12 bytes a trained parameter; 1/N from ZeRO-1, whole on the first learner
    alone where they are replicated: ZeRO-0, Horovod), and on the first learner the model's
    weights in their dtype (`first`). Full-size π0 on 8 learners at ZeRO-1: ~4.5 GiB each
    and 6.0 GiB more on the first."""
    states = STATE_BYTES * fp.trainable
    mine = states // learners if zero_stage >= 1 else (states if first else 0)
    return mine + (fp.weight_bytes if first else 0)


def offloaded_bytes(fp, zero_stage: int, learners: int) -> dict[str, int]:
    """What learner.offload_optimizer keeps in a learner's (pinned) host memory instead: its
    fp32 masters, moments and fp32 gradient partition, whole (DeepSpeed's CPU buffers)."""
    parts = model_states(fp, zero_stage, learners)
    return {f"offloaded {k}": parts[k] for k in OFFLOADED if parts.get(k)}


def learner_bytes(fp, zero_stage: int, learners: int, on_gpu: bool,
                  offload: bool = False) -> dict[str, int]:
    """A learner's peak, by part: what its engine keeps, and then the larger of its backward
    (one micro-batch's activations with the allocator's slack, the gradients) and its
    optimizer step; on a GPU the CUDA context and NCCL's buffers. `offload`: without the
    parts ZeRO-Offload keeps in host memory (offloaded_bytes)."""
    kept, backward, step = engine_states(fp, zero_stage, learners)
    if offload:
        for phase in (kept, step):
            for name in OFFLOADED:
                phase.pop(name, None)
    backward["activations"] = int(fp.train_bytes * (1 + ALLOCATOR_SLACK))
    out = {**kept, **max(backward, step, key=lambda phase: sum(phase.values()))}
    if on_gpu:
        out["cuda context"] = CUDA_CONTEXT_BYTES + NCCL_BYTES
    return out


def inference_bytes(fp, on_gpu: bool) -> dict[str, int]:
    """An inference rank's peak: the weights, one batch of `act` (the prefix cache, the
    denoising loop) with the allocator's slack, and on a GPU the CUDA context."""
    out = {"weights": fp.weight_bytes, "activations": int(fp.act_bytes * (1 + ALLOCATOR_SLACK))}
    if on_gpu:
        out["cuda context"] = CUDA_CONTEXT_BYTES
    return out


def size(nbytes: int) -> str:
    """Bytes as a person reads them: GiB from 1 GiB, else MiB."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:.0f} MiB"
