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
# DeepSpeed's defaults (zero/config.py): the gradient bucket's elements, and what ZeRO-3
# prefetches ahead of the layer it computes.
REDUCE_BUCKET = 500_000_000
PREFETCH_BUCKET = 50_000_000


def model_states(fp, zero_stage: int, learners: int) -> dict[str, int]:
    """What one of `learners` data-parallel learners keeps around a step under DeepSpeed at
    `zero_stage`, with AdamW and DeepSpeed's default buckets, as engines/zero.py configures it
    (bytes, by part): the weights in the policy's dtype (ZeRO-3: 1/N, plus what it gathers at
    a time, `gathered`); the gradients in that dtype (1/N from ZeRO-2) and, from ZeRO-1, the
    contiguous gradient bucket they are reduced through; where the policy is bf16 or ZeRO
    partitions the optimizer, fp32 master weights and an fp32 gradient partition; AdamW's two
    fp32 moments (1/N from ZeRO-1). In bf16 this is DeepSpeed's own estimate plus the bucket:
    2 + 18/N bytes per parameter at ZeRO-2; 18/N and the largest layer twice at ZeRO-3 (and
    the prefetch bucket)."""
    n, b, trained = learners, fp.dtype_bytes, fp.trainable
    share = (lambda nbytes, stage: nbytes // n if zero_stage >= stage else nbytes)
    out = {"weights": share(fp.weight_bytes, 3),
           "gradients": share(trained * b, 2) if zero_stage < 3 else 0,
           "gradient bucket": b * min(REDUCE_BUCKET, trained) if zero_stage >= 1 else 0,
           "masters": 0, "fp32 gradients": 0,
           "moments": share(8 * trained, 1),
           "gathered": b * min(fp.params, PREFETCH_BUCKET + 2 * fp.largest_layer)
           if zero_stage == 3 else 0}
    if b < 4 or zero_stage >= 1:
        out["masters"] = share(4 * trained, 1)
        out["fp32 gradients"] = share(4 * trained, 1)
    return out


def learner_bytes(fp, zero_stage: int, learners: int, on_gpu: bool) -> dict[str, int]:
    """A learner's peak: its model states, one micro-batch's forward and backward with the
    allocator's slack, and on a GPU the CUDA context and NCCL's buffers."""
    out = dict(model_states(fp, zero_stage, learners))
    out["activations"] = int(fp.train_bytes * (1 + ALLOCATOR_SLACK))
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
