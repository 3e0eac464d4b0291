"""π0.5's adaptive RMS norms (adaRMS) on a transformers Gemma decoder.

π0.5 conditions its action expert on the flow time through every RMS norm instead of through
its input tokens: a norm of width W maps a condition c (B, W) to (scale, shift, gate) =
dense(c) (B, 3W), normalizes x̂ = x / sqrt(mean(x²) + eps) (in float32), and returns
x̂ (1 + scale) + shift; the sublayer the norm feeds (attention, MLP) then adds its output to
the residual stream times `gate`. The final norm's gate is unused.

`make_adaptive(decoder)` swaps a `GemmaModel`'s norms for `AdaRMSNorm`s and gates its layers'
attention and MLP outputs with forward hooks, so the decoder runs unchanged; the caller sets
`condition.value` before each forward. Parameter names stay those of the reference
(`layers.N.input_layernorm.dense.weight`, ..., `norm.dense.bias`).
"""

from __future__ import annotations

import torch
from torch import nn


class Condition:
    """The condition of the next forward pass, shared by a decoder's norms."""

    value: torch.Tensor | None = None


class AdaRMSNorm(nn.Module):
    def __init__(self, width: int, eps: float, condition: Condition):
        super().__init__()
        self.dense = nn.Linear(width, 3 * width)
        self.eps, self.condition = eps, condition
        self.gate: torch.Tensor | None = None  # for the sublayer this norm feeds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cond = self.condition.value
        if cond is None:
            raise RuntimeError("adaRMS norm called without a condition (set condition.value)")
        scale, shift, gate = self.dense(cond).unsqueeze(1).chunk(3, dim=-1)
        normed = x * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + self.eps)
        self.gate = gate.to(x.dtype)
        return (normed * (1 + scale.float()) + shift.float()).to(x.dtype)


def _gate_output(norm: AdaRMSNorm):
    """A forward hook multiplying a sublayer's output (or its first element) by the gate."""
    def hook(_module, _inputs, output):
        if isinstance(output, tuple):
            return (output[0] * norm.gate, *output[1:])
        return output * norm.gate
    return hook


def make_adaptive(decoder) -> Condition:
    """Make every norm of a transformers `GemmaModel` adaptive (module docstring)."""
    condition = Condition()
    width, eps = decoder.config.hidden_size, decoder.config.rms_norm_eps
    for layer in decoder.layers:
        layer.input_layernorm = AdaRMSNorm(width, eps, condition)
        layer.post_attention_layernorm = AdaRMSNorm(width, eps, condition)
        layer.self_attn.register_forward_hook(_gate_output(layer.input_layernorm))
        layer.mlp.register_forward_hook(_gate_output(layer.post_attention_layernorm))
    decoder.norm = AdaRMSNorm(width, eps, condition)
    return condition


__all__ = ["AdaRMSNorm", "Condition", "make_adaptive"]
