"""The bound on the learned log std of every family's exploration Gaussian (LOG_STD_BOUNDS):
the `default` policy's (under PPO), OFT's L1 head's and the flow family's noise, each a
parameter per action entry that the optimizer moves. SAC's actors read theirs from a layer
through a tanh instead (soft_critics.squashed_gaussian).

The forward value is clamped into the bounds; the gradient passes inside them and, outside,
where a descent step moves the value back in. torch.clamp's gradient is zero outside: a log
std that one step carried past a bound (a large lr, an entropy bonus) stayed there for good,
a policy exploring with std e^2 in normalized action space, or with e^-5, whose log-probs of
its own earlier samples explode. Here the outward gradients stop at the bound (an optimizer's
momentum may carry it a few steps past), and it comes back when the loss asks.
"""

from __future__ import annotations

import torch

from hpcvla.config.families import LOG_STD_BOUNDS


class _InwardClamp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, low: float, high: float):
        ctx.save_for_backward(x < low, x > high)  # (not x: for fp32 it is the parameter)
        return x.clamp(low, high)

    @staticmethod
    def backward(ctx, grad):
        below, above = ctx.saved_tensors
        # a descent step moves x by -grad: back in from above where grad > 0, from below < 0
        passes = ~(below | above) | (above & (grad > 0)) | (below & (grad < 0))
        return torch.where(passes, grad, torch.zeros_like(grad)), None, None


def bounded_log_std(log_std: torch.Tensor) -> torch.Tensor:
    """`log_std` (a parameter, in any dtype) in float32, inside LOG_STD_BOUNDS (see above)."""
    low, high = LOG_STD_BOUNDS
    return _InwardClamp.apply(log_std.float(), low, high)


__all__ = ["bounded_log_std"]
