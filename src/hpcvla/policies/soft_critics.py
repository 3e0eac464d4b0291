"""What an off-policy learner (SAC, algorithms/sac.py) adds to a policy: twin Q critics over
(features, flat action chunk), their target copies, and the entropy temperature.

    class MyPolicy(SoftCritics, Policy): ...
    policy.add_soft_critics(feature_dim, action_dims, hidden, layer_norm, init_temperature)
    q1, q2 = policy.soft_q(features, flat_actions)                 # the critics
    q1, q2 = policy.soft_q(features, flat_actions, frozen=True)    # no gradient to them
    q1, q2 = policy.soft_q(features, flat_actions, target=True)    # the target copies

The modules are the policy's own (`value_q`, `value_q_target`, `sac_log_alpha`), so they train
in the learner's engine, checkpoint and resume with it: `value_*` names give the critics
`algorithm.critic_lr` (engines/base.param_groups); the target copies take no gradient
(requires_grad off: the weight plane sends them once, the actors never read them) and move
only by Polyak averaging. `layer_norm` puts a LayerNorm after each hidden layer of the critics,
as RLPD does: it bounds the critics' extrapolation to actions the data never shows, which a
high update-to-data ratio otherwise turns into divergence.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.distributions import AffineTransform, Normal, TanhTransform, TransformedDistribution
from torch.func import functional_call

from hpcvla.config.families import LOG_STD_BOUNDS


class TwinQ(nn.Module):
    """Two independent MLP critics Q(features, action) -> (B,), (B,)."""

    def __init__(self, in_dim: int, hidden: int, layer_norm: bool):
        super().__init__()

        def critic() -> nn.Sequential:
            layers: list[nn.Module] = []
            for width_in in (in_dim, hidden):
                layers += [nn.Linear(width_in, hidden),
                           *([nn.LayerNorm(hidden)] if layer_norm else []), nn.ReLU()]
            return nn.Sequential(*layers, nn.Linear(hidden, 1))

        self.q1, self.q2 = critic(), critic()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


class SoftCritics:
    """A policy's SAC critics (mixed into an nn.Module policy with `features` and
    `soft_actions`)."""

    value_q: TwinQ
    value_q_target: TwinQ
    sac_log_alpha: nn.Parameter
    soft_action_field = "actions"  # the segment field SAC's critics take as the action

    def add_soft_critics(self, feature_dim: int, action_dims: int, hidden: int,
                         layer_norm: bool, init_temperature: float) -> None:
        """Twin critics over (the policy's features, a flat chunk of `action_dims`), their
        target copies (equal at the start) and a log-temperature (alpha = init_temperature
        at the start)."""
        self.value_q = TwinQ(feature_dim + action_dims, hidden, layer_norm)
        self.value_q_target = copy.deepcopy(self.value_q).requires_grad_(False)
        # 1-d: DeepSpeed broadcasts parameters as bytes, which a 0-d tensor cannot be viewed as
        self.sac_log_alpha = nn.Parameter(torch.full((1,), math.log(init_temperature)))

    def soft_q(self, features: torch.Tensor, flat_actions: torch.Tensor, *,
               frozen: bool = False, target: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The twin critics at (features, flat action chunks). `frozen`: the online critics
        with their parameters detached, so the actor's loss moves the actor through the
        actions and never the critics; `target`: the target copies."""
        critics = self.value_q_target if target else self.value_q
        # in the critics' dtype: a bf16 learner may hold them apart from the features'
        x = torch.cat([features, flat_actions.to(features.dtype)], dim=-1).to(
            critics.q1[0].weight.dtype)
        if target:
            return critics(x)
        if frozen:
            params = {name: p.detach() for name, p in self.value_q.named_parameters()}
            return functional_call(self.value_q, params, (x,))
        return self.value_q(x)


def log_std_layer(hidden: int, n_out: int, init_log_std: float) -> nn.Linear:
    """SAC's actor's layer to its per-state log std (read through squashed_gaussian): zero
    weights (their gradient is not zero) and the bias that gives `init_log_std` in every state
    at the start."""
    low, high = LOG_STD_BOUNDS
    if not low < init_log_std < high:
        raise ValueError(f"init_log_std={init_log_std} must lie inside ({low}, {high})")
    layer = nn.Linear(hidden, n_out)
    nn.init.zeros_(layer.weight)
    nn.init.constant_(layer.bias, math.atanh(2 * (init_log_std - low) / (high - low) - 1))
    return layer


def squashed_gaussian(mean: torch.Tensor, raw_log_std: torch.Tensor, scale: float = 1.0
                      ) -> TransformedDistribution:
    """SAC's actor's distribution: a Gaussian of this `mean` and a log std of the state
    (`raw_log_std`, log_std_layer's output, mapped into LOG_STD_BOUNDS by a tanh), squashed by
    tanh into (-scale, scale)."""
    low, high = LOG_STD_BOUNDS
    log_std = low + 0.5 * (high - low) * (torch.tanh(raw_log_std) + 1)
    # Both transforms cache their last input: a sample's log-prob then reads the Gaussian's
    # value it came from, not atanh of a tanh that float32 rounded to +-1 (inf, then NaN)
    squash = [TanhTransform(cache_size=1)] + (
        [AffineTransform(0.0, scale, cache_size=1)] if scale != 1.0 else [])
    return TransformedDistribution(Normal(mean, log_std.exp()), squash)


__all__ = ["TwinQ", "SoftCritics", "log_std_layer", "squashed_gaussian"]
