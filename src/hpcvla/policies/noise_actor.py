"""SAC for the flow family: a small actor that steers a frozen flow policy through the initial
noise of its sampler (DSRL: Wagenmaker et al. 2025, "Steering Your Diffusion Policy with
Latent Space Reinforcement Learning").

A flow policy turns noise x_0 into an action chunk by integrating its velocity field
(policies/flow.py). With the noise chosen instead of drawn, the pretrained policy becomes a
deterministic map from (observation, noise) to a chunk that stays on the behaviours it learned
from demonstrations, and RL only has to choose among them: the actor here outputs the noise,
SAC trains it and its critics on the env's reward with the noise as their action, and the
flow policy's own weights never move (none of them takes a gradient; the weight plane sends
them once, then only the actor, its critics and the temperature).

    class FlowPolicy(NoiseActor, VLAPolicy): ...
    policy.add_noise_actor(obs_spec, vocab_size, hidden, bound, layer_norm, init_temperature,
                           fields)
    out, {"dsrl_noise": w} = policy.steered_sample(obs, deterministic)

The noise actor reads the env's observation through encoders of its own, the default policy's
small ones (default.add_encoders), not the VLA's prefix: acting costs one small network more,
and the learner's SAC steps never run the VLA (their transitions hold the noise, recorded with
every step as the extra field `dsrl_noise`). It may read fewer fields than the VLA
(algorithm.noise_obs: DSRL's own experiments steer from the low-dim state): without the
image a SAC step is a few small matrix products. Its Gaussian is SAC's (a log std of the
state), squashed by tanh and scaled into (-bound, bound) (algorithm.noise_bound): unbounded
noise would take the sampler where its training never went. It steers the executed part of the
chunk (chunk_len x action_dim); a published model's longer horizon and padded dims start at
0, the prior's mode, as deterministic acting from `zero` does (policy.denoise_from).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributions import TransformedDistribution

from hpcvla.config.learning import ENCODED_FIELDS
from hpcvla.policies.base import ActOutput
from hpcvla.policies.default import add_encoders, encode, layer_init
from hpcvla.policies.soft_critics import SoftCritics, log_std_layer, squashed_gaussian

NOISE = "dsrl_noise"  # the extra field each step records: the noise the actor chose


class ObsEncoder(nn.Module):
    """The default policy's encoders (default.add_encoders) as a module of their own."""

    def __init__(self, obs_spec: dict, vocab_size: int, hidden: int,
                 fields: tuple[str, ...] = ()):
        """`fields`: the observation fields it reads (empty: those of `obs_spec` the encoders
        read, ENCODED_FIELDS)."""
        super().__init__()
        missing = sorted(set(fields) - set(obs_spec))
        if missing:
            raise ValueError(f"algorithm.noise_obs: {', '.join(missing)} not among the env's "
                             f"observations ({', '.join(obs_spec)})")
        self.dim = add_encoders(self, {k: v for k, v in obs_spec.items()
                                       if k in (fields or ENCODED_FIELDS)}, vocab_size, hidden)

    def forward(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return encode(self, obs)


class NoiseActor(SoftCritics):
    """A flow policy's DSRL actor and SAC critics (mixed into FlowPolicy)."""

    soft_action_field = f"obs.{NOISE}"  # SAC's action: the recorded noise
    chunk_len: int
    action_dim: int
    model_horizon: int
    model_action_dim: int

    def add_noise_actor(self, obs_spec: dict, vocab_size: int, hidden: int, bound: float,
                        layer_norm: bool, init_temperature: float,
                        fields: tuple[str, ...] = ()) -> None:
        """The actor (its encoders, an MLP to the mean of the chunk's noise and to its log
        std, 0 at the start: the prior's spread), its twin critics over (its features of the
        observation `fields`, all if empty; the flat noise) with their targets, and the
        temperature; every parameter of the policy before them frozen."""
        self.requires_grad_(False)
        self.noise_encoder = ObsEncoder(obs_spec, vocab_size, hidden, fields)
        n_out = self.chunk_len * self.action_dim
        self.noise_trunk = nn.Sequential(
            layer_init(nn.Linear(self.noise_encoder.dim, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)), nn.Tanh())
        self.noise_mean = layer_init(nn.Linear(hidden, n_out), std=0.01)
        self.noise_log_std = log_std_layer(hidden, n_out, 0.0)
        self.noise_bound = float(bound)
        self.add_soft_critics(self.noise_encoder.dim, n_out, hidden, layer_norm,
                              init_temperature)

    def features(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The actor's and critics' features of the env's observations (B, dim)."""
        return self.noise_encoder(obs)

    def noise_dist(self, features: torch.Tensor) -> TransformedDistribution:
        """The flat noise distribution: a Gaussian squashed into (-bound, bound)."""
        h = self.noise_trunk(features.to(self.noise_mean.weight.dtype))
        return squashed_gaussian(self.noise_mean(h), self.noise_log_std(h), self.noise_bound)

    def soft_actions(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """SAC's reparameterised sample: flat noise (B, chunk_len * action_dim) whose
        gradient reaches the actor, and its log-probs (B,)."""
        dist = self.noise_dist(features)
        flat = dist.rsample()
        return flat, dist.log_prob(flat).sum(-1)

    def steered_sample(self, obs: dict[str, torch.Tensor], deterministic: bool = False
                       ) -> tuple[ActOutput, dict[str, torch.Tensor]]:
        """The actor's noise (its mean's squashed value when `deterministic`) through the
        flow policy's noiseless sampler: the chunk, the noise's log-prob, the flow policy's
        value, and the noise as the extra field the learner trains on."""
        device = self.noise_mean.weight.device
        with torch.no_grad():
            dist = self.noise_dist(self.features({k: v.to(device) for k, v in obs.items()}))
            flat = self.noise_bound * torch.tanh(dist.base_dist.mean) if deterministic \
                else dist.sample()
            edge = self.noise_bound * (1.0 - torch.finfo(flat.dtype).eps)  # tanh's open box
            logprob = dist.log_prob(flat.clamp(-edge, edge)).sum(-1)
            noise = flat.view(-1, self.chunk_len, self.action_dim)
            x0 = torch.zeros(len(noise), self.model_horizon, self.model_action_dim,
                             device=device)  # float32 whatever the actor's dtype
            x0[:, :self.chunk_len, :self.action_dim] = noise
            actions, _, value, _ = self._sample(self._inputs(obs), True, x0)
        if self.processor is not None:  # the env's units
            actions = self.processor.actions_out(actions, obs)
        return ActOutput(actions.float(), logprob.float(), value.float()), {NOISE: noise.float()}


__all__ = ["NOISE", "NoiseActor", "ObsEncoder"]
