"""Horovod as the learners' data-parallel engine (`learner.backend: horovod`), where a site has
it: `HorovodEngine` implements the engine interface (engines/base.Engine, the part of
DeepSpeed's that the learner loop, checkpoints and the non-finite guard use), so Horovod plugs
in beside DeepSpeed. Every learner holds the whole model and optimizer (DeepSpeed's ZeRO
stage 0); gradients are averaged by MPI allreduce.

    hvd.init(comm=learners)                    # Horovod on the learner communicator only   [dist]
    hvd.DistributedOptimizer(..., backward_passes_per_step=micro_batches)  # allreduce hooks [dist]
    hvd.broadcast_parameters (root 0)           # one start everywhere                      [dist]

Installing it: `make install-horovod` (Horovod 0.28.1 from source against the pinned torch,
MPI controller, no Gloo; the Makefile says why each flag is there). Float32 policies only:
Horovod keeps no fp32 master weights for a bf16 model (use DeepSpeed's `bf16` for that).
"""

from __future__ import annotations

import torch


def horovod_available(on_gpus: bool = False) -> str:
    """'' when `horovod.torch` imports and was built with MPI (and, for learners `on_gpus`,
    with GPU operations), else why not (for errors and test skips)."""
    try:
        import horovod.torch as hvd
    except ImportError as err:
        return f"horovod is not installed ({err}); `make install-horovod` builds it"
    if not hvd.mpi_built():
        return "this horovod was built without MPI; rebuild it with `make install-horovod`"
    if on_gpus and not (hvd.nccl_built() or hvd.cuda_built()):
        # its MPI allreduce would be handed CUDA pointers: an error or a crash in MPI
        return ("this horovod was built without GPU operations (no NCCL or CUDA), and the "
                "learners are on GPUs: rebuild it with HOROVOD_GPU_OPERATIONS=NCCL, or train "
                "on CPUs (placement.gpus_per_node=0)")
    return ""


class HorovodEngine:
    """engines/base.Engine on Horovod."""

    def __init__(self, module: torch.nn.Module, optimizer, micro_batches: int,
                 max_grad_norm: float, device: torch.device):
        import horovod.torch as hvd

        self.module, self.micro_batches, self.max_grad_norm = module, micro_batches, max_grad_norm
        self.device = device
        self.micro_steps = 0
        self.skipped_steps = 0  # DeepSpeed's counter; the non-finite guard counts here itself
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)  # [dist] learner 0's weights
        self.optimizer = hvd.DistributedOptimizer(  # [dist] averages at the boundary pass
            optimizer, named_parameters=module.named_parameters(),
            backward_passes_per_step=micro_batches, op=hvd.Average)
        # No broadcast_optimizer_state: every learner's optimizer starts empty from one config
        # (Horovod's would make a state with a zero-gradient step: Adam's step count one
        # ahead of the updates, weight decay applied once), and a resume loads each its own
        # after this (store.load_optimizer).

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.micro_batches == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate (the loss scaled by 1/micro_batches, as DeepSpeed does); on the boundary
        pass wait for the averaged gradients, so every learner sees the same ones (the
        non-finite guard decides on them alike)."""
        (loss / self.micro_batches).backward()
        if self.is_gradient_accumulation_boundary():
            self.optimizer.synchronize()  # [dist] allreduce completes

    def step(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        with self.optimizer.skip_synchronize():  # done in backward
            self.optimizer.step()
        self.optimizer.zero_grad()

    @staticmethod
    def zero_optimization_stage() -> int:
        return 0

    @staticmethod
    def bfloat16_enabled() -> bool:
        return False

    @staticmethod
    def fp16_enabled() -> bool:
        return False


def init_horovod(cfg, policy, learners_comm, optimizer, device: torch.device) -> HorovodEngine:
    """Horovod on the learner communicator; `optimizer` as for DeepSpeed (named groups)."""
    import horovod.torch as hvd

    if any(p.dtype != torch.float32 for p in policy.parameters()):
        raise ValueError("learner.backend=horovod trains float32 policies only (no fp32 "
                         "master weights for bf16): set policy.dtype=float32, or use "
                         "learner.backend=deepspeed")
    missing = horovod_available(on_gpus=device.type == "cuda")
    if missing:
        raise ValueError(f"learner.backend=horovod: {missing}")
    hvd.init(comm=learners_comm)  # [dist] this communicator, not the whole world
    return HorovodEngine(policy.to(device), optimizer, cfg.learner.micro_batches,
                         cfg.algorithm.max_grad_norm, device)


__all__ = ["HorovodEngine", "horovod_available", "init_horovod"]
