"""Optimizer steps whose gradient is not finite are skipped, counted, and stopped when they
repeat.

A NaN or Inf in a loss (a simulator's NaN reward, an exploding log-prob ratio) reaches the
gradient. DeepSpeed's ZeRO stages 1 to 3 already check the global gradient norm at every
optimizer step (fp32 too, clipping on or off) and skip a non-finite one, leaving the
weights and the Adam moments untouched (`engine.skipped_steps` counts them). Stage 0 does not:
it would write NaN into every weight. There, at the accumulation boundary (the gradients are
averaged over the learners by then, so every learner decides alike), this wrapper lets the
engine's step run without the optimizer's. Either way the skip is counted; `limit`
consecutive skipped steps stop the run.

Each optimizer step's global gradient norm, before clipping (algorithm.max_grad_norm), is
kept for the metrics (`grad_norm`): DeepSpeed's own where it computes one (ZeRO 1-3 with
clipping on, its bf16 optimizer), else the averaged gradients' at stage 0 and under Horovod.
"""

from __future__ import annotations

import math

import torch

from hpcvla.engines.base import Engine


class SkipNonfinite:
    """An engine (engines/base.Engine) with `step()` guarded; the rest is the engine's.
    `skipped` counts the skipped optimizer steps."""

    def __init__(self, engine: Engine, limit: int):
        self.engine, self.limit = engine, limit
        self.skipped = self.consecutive = 0
        self.grad_norm: float | None = None  # the last optimizer step's, before clipping

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def optimizer(self):
        return self.engine.optimizer

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def zero_optimization_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    def bfloat16_enabled(self) -> bool:
        return self.engine.bfloat16_enabled()

    def fp16_enabled(self) -> bool:
        return self.engine.fp16_enabled()

    def step(self) -> None:
        engine = self.engine
        if not engine.is_gradient_accumulation_boundary():
            engine.step()  # only counts the micro-step
            return
        # stage 0: the averaged gradients' norm, taken before the step clears them: not
        # finite where a gradient is not (or is past fp32's square root of its range, which
        # DeepSpeed's ZeRO stages skip too)
        own = self._gradient_norm() if engine.zero_optimization_stage() == 0 else None
        dropped = own is not None and not math.isfinite(own)
        skipped_by_deepspeed = engine.skipped_steps
        if dropped:  # the engine's step runs (its counters, clipping, zero_grad), the
            optimizer = engine.optimizer  # optimizer's does not
            optimizer.step = lambda *args, **kwargs: None  # shadows the method, this once
            try:
                engine.step()
            finally:
                del optimizer.step
        else:
            engine.step()
        reported = getattr(engine, "get_global_grad_norm", lambda: None)()
        self.grad_norm = float(reported) if reported is not None else own
        if dropped or engine.skipped_steps > skipped_by_deepspeed:
            self.skipped += 1
            self.consecutive += 1
            if self.consecutive >= self.limit:
                raise FloatingPointError(
                    f"{self.consecutive} optimizer steps in a row skipped: the gradient was "
                    f"not finite every time (NaN/Inf in the loss: check the env's rewards and "
                    f"observations, lower algorithm.lr; learner.max_nonfinite_steps="
                    f"{self.limit})")
        else:
            self.consecutive = 0

    def step_stats(self, max_grad_norm: float) -> dict[str, float]:
        """What the last optimizer step's metrics record adds: its gradient norm before
        clipping, whether the clipping (algorithm.max_grad_norm) scaled it down, and the steps
        skipped so far (a gradient that was not finite)."""
        norm = self.grad_norm
        return {**({"grad_norm": norm, "grad_clipped": float(0 < max_grad_norm < norm)}
                   if norm is not None else {}), "nonfinite_skipped": float(self.skipped)}

    def _gradient_norm(self) -> float | None:
        """The L2 norm of every gradient the module holds, each tensor's in fp32 (no copy of an
        fp32 gradient), theirs together in float64 (None where it holds none: DeepSpeed's bf16
        optimizer has taken them)."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return None
        return float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).double()))
