"""The default small policy: a CNN + bag-of-tokens + MLP Gaussian actor-critic.

Small enough to train on CPU in tests and benchmarks, yet shaped like a VLA: it reads whichever
of an image (uint8 HWC), a tokenised instruction (int ids, 0 = padding) and a proprioceptive
state vector the environment provides (at least one), and emits a whole action chunk
(chunk_len x action_dim) from one Gaussian with a state-independent learnable log-std (as
CleanRL's PPO); with soft critics (SAC's actor) a log std of the state, as published SAC.

Log-probability and entropy are summed over every dimension of the chunk, so the chunk is
one PPO "action". Sampled actions are not squashed (the environment clips), but for SAC's
actor, which tanh-squashes them into the box (`actor_dist`). Behaviour cloning
(`imitation_loss`, `hpcvla sft`) maximises the same Gaussian's likelihood of the demonstrated
chunks, so the std it ends with is the demonstrations' spread: the exploration RL starts from.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributions import Normal, TransformedDistribution

from hpcvla.config.learning import ENCODED_FIELDS
from hpcvla.policies.base import ActOutput, Policy, real_steps_mean
from hpcvla.policies.log_std import bounded_log_std
from hpcvla.policies.soft_critics import SoftCritics, log_std_layer, squashed_gaussian

INSTRUCTION_EMBED_DIM = 32
IMAGE_CONVS = ((16, 5, 2), (32, 3, 2), (32, 3, 2))  # image encoder: (channels, kernel, stride)


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    """CleanRL-style orthogonal weight init with constant bias."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class DefaultPolicy(SoftCritics, Policy):
    """Actor-critic over the image, instruction and state the env gives, producing Gaussian
    action chunks.

    Args:
        obs_spec: per-env field spec, ``{name: (shape, dtype_str)}``; "image" is (H, W, C)
            uint8, "instruction" is (L,) int token ids, "state" is (S,) float; each optional,
            at least one.
        action_dim: dimensions of one action.
        chunk_len: actions per chunk.
        vocab_size: instruction token vocabulary size (id 0 is padding).
        hidden: width of the image projection, state projection and MLP trunk.
        init_log_std: initial value of the log standard deviation (state-independent; with
            soft critics a function of the state, this in every state at the start).
        soft_critics: add SAC's twin critics, their targets and the temperature
            (policies/soft_critics.py), for an off-policy learner; the value head stays
            (PPO's, unused there).
        critic_layer_norm: with soft_critics, LayerNorm in the critics (RLPD).
        init_temperature: with soft_critics, SAC's entropy temperature at the start.
    """

    family = "default"

    def __init__(
        self,
        obs_spec: dict,
        action_dim: int,
        chunk_len: int,
        vocab_size: int,
        hidden: int = 128,
        init_log_std: float = -0.7,
        soft_critics: bool = False,
        critic_layer_norm: bool = False,
        init_temperature: float = 1.0,
    ):
        super().__init__()
        # what config.json records to rebuild it (policies/folders.save_pretrained)
        self.obs_spec = {k: (tuple(shape), dt) for k, (shape, dt) in obs_spec.items()}
        self.vocab_size = int(vocab_size)
        self.init_args = {"hidden": int(hidden), "init_log_std": float(init_log_std),
                          "soft_critics": bool(soft_critics),
                          "critic_layer_norm": bool(critic_layer_norm),
                          "init_temperature": float(init_temperature)}
        self.action_dim = int(action_dim)
        self.chunk_len = int(chunk_len)
        feat_dim = add_encoders(self, obs_spec, vocab_size, hidden)

        # Separate actor and critic trunks over the shared encoders (as CleanRL's continuous
        # PPO): value-loss gradients, larger than policy ones, must not steer the actor.
        self.trunk = nn.Sequential(
            layer_init(nn.Linear(feat_dim, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
        )
        self.value_trunk = nn.Sequential(
            layer_init(nn.Linear(feat_dim, hidden)), nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
        )
        n_out = self.chunk_len * self.action_dim
        # Small gain keeps the initial mean near zero so early exploration is driven by log_std.
        self.mean_head = layer_init(nn.Linear(hidden, n_out), std=0.01)
        self.value_head = layer_init(nn.Linear(hidden, 1), std=1.0)
        self.squash = bool(soft_critics)  # SAC's actor acts in the box (actor_dist)
        if soft_critics:
            self.log_std_head = log_std_layer(hidden, n_out, float(init_log_std))
            self.add_soft_critics(feat_dim, n_out, hidden, critic_layer_norm, init_temperature)
        else:
            self.log_std = nn.Parameter(torch.full((n_out,), float(init_log_std)))

    def features(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Encode each present modality and concatenate: (B, feat_dim)."""
        return encode(self, obs)

    def _dist_and_value(self, obs: dict[str, torch.Tensor]
                        ) -> tuple[Normal | TransformedDistribution, torch.Tensor]:
        """The flat action distribution over chunk_len*action_dim dims (`actor_dist`), and
        the value (B,)."""
        h = self.features(obs)
        return self.actor_dist(h), self.value_head(self.value_trunk(h)).squeeze(-1)

    def actor_dist(self, features: torch.Tensor) -> Normal | TransformedDistribution:
        """The flat action distribution of encoded observations (`features`): a Normal, or
        with soft critics a Normal squashed by tanh into the action box (SAC's actor: an
        unbounded Gaussian whose entropy is rewarded would widen past the box and act at its
        edges)."""
        h = self.trunk(features)
        mean = self.mean_head(h)
        if self.squash:
            return squashed_gaussian(mean, self.log_std_head(h))
        return Normal(mean, bounded_log_std(self.log_std).exp().expand_as(mean))

    def soft_actions(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """SAC's reparameterised sample: flat chunks (B, chunk_len * action_dim) whose
        gradient reaches the actor, and their log-probs (B,)."""
        dist = self.actor_dist(features)
        flat = dist.rsample()
        return flat, dist.log_prob(flat).sum(-1)

    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False) -> ActOutput:
        with torch.no_grad():
            dist, value = self._dist_and_value(obs)
            flat = _mode(dist) if deterministic else dist.sample()
            logprob = dist.log_prob(_inside(dist, flat)).sum(-1)
            actions = flat.view(-1, self.chunk_len, self.action_dim)
        return ActOutput(actions=actions, logprob=logprob, value=value)

    def evaluate(
        self, obs: dict[str, torch.Tensor], actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dist, value = self._dist_and_value(obs)
        logprob = dist.log_prob(self._flat(dist, actions)).sum(-1)
        return logprob, value, _base(dist).entropy().sum(-1)  # squashed: the Gaussian's

    def imitation_loss(self, obs, actions, real):
        """Negative log-likelihood per action dimension of the real steps (so the scale does
        not grow with chunk_len x action_dim)."""
        dist, _ = self._dist_and_value(obs)
        nll = -dist.log_prob(self._flat(dist, actions)).view(-1, self.chunk_len,
                                                             self.action_dim)
        return real_steps_mean(nll, real)

    def _flat(self, dist, actions: torch.Tensor) -> torch.Tensor:
        """Recorded chunks (B, chunk_len, action_dim) as the distribution's flat samples."""
        return _inside(dist, actions.reshape(actions.shape[0], -1).to(_base(dist).mean.dtype))


def add_encoders(module: nn.Module, obs_spec: dict, vocab_size: int, hidden: int) -> int:
    """The observation encoders of `module` (the default policy's, the flow family's noise
    actor's): a small CNN for the image, a bag of token embeddings for the instruction, a
    layer for the state, whichever `obs_spec` has; returns the width of their features. A
    field they do not read (a wrist camera) is refused, not carried unread."""
    unread = sorted(set(obs_spec) - set(ENCODED_FIELDS))
    if unread:
        raise ValueError(f"the small network's encoders read {', '.join(ENCODED_FIELDS)}, not "
                         f"{', '.join(unread)}: leave it out of the env (env.wrist_image=false)"
                         " or use a VLA family")
    module.has_image = "image" in obs_spec
    module.has_instruction = "instruction" in obs_spec
    module.has_state = "state" in obs_spec
    if not (module.has_image or module.has_instruction or module.has_state):
        raise ValueError(f"obs_spec has none of image/instruction/state: {sorted(obs_spec)}")
    feat_dim = 0
    if module.has_image:
        h, w, c = obs_spec["image"][0]
        layers: list[nn.Module] = []
        for channels, kernel, stride in IMAGE_CONVS:
            layers += [layer_init(nn.Conv2d(c, channels, kernel, stride=stride)), nn.ReLU()]
            # the output's size from the layer's own numbers: probing with a zero image
            # would run torch's meta kernels where the policy is built on the meta device
            # (`hpcvla plan`, the doctor), ~1 s of CPU at their first use in a process
            c, h, w = channels, (h - kernel) // stride + 1, (w - kernel) // stride + 1
        convs = nn.Sequential(*layers, nn.Flatten())
        module.image_encoder = nn.Sequential(convs, layer_init(nn.Linear(c * h * w, hidden)),
                                             nn.ReLU())
        feat_dim += hidden
    if module.has_instruction:
        module.token_embedding = nn.Embedding(vocab_size, INSTRUCTION_EMBED_DIM, padding_idx=0)
        feat_dim += INSTRUCTION_EMBED_DIM
    if module.has_state:
        (state_dim,) = obs_spec["state"][0]
        module.state_encoder = nn.Sequential(layer_init(nn.Linear(state_dim, hidden)), nn.Tanh())
        feat_dim += hidden
    return feat_dim


def encode(module: nn.Module, obs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The features of `module`'s encoders (add_encoders) for a batch of observations, in the
    dtype of its parameters (a bf16 learner casts the whole policy)."""
    parts, dtype = [], next(module.parameters()).dtype
    if module.has_image:
        # uint8 HWC -> float CHW in [0, 1]; done here so callers can ship compact uint8.
        img = obs["image"].permute(0, 3, 1, 2).float().div_(255.0).to(dtype)
        parts.append(module.image_encoder(img))
    if module.has_instruction:
        tokens = obs["instruction"].long()
        mask = (tokens != 0).unsqueeze(-1).float()
        summed = (module.token_embedding(tokens) * mask).sum(dim=1)
        # Mean over real tokens; an all-padding instruction gives a zero vector.
        parts.append(summed / mask.sum(dim=1).clamp(min=1.0))
    if module.has_state:
        parts.append(module.state_encoder(obs["state"].to(dtype)))
    return torch.cat(parts, dim=-1)


def _base(dist: Normal | TransformedDistribution) -> Normal:
    return dist.base_dist if isinstance(dist, TransformedDistribution) else dist


def _mode(dist: Normal | TransformedDistribution) -> torch.Tensor:
    """The deterministic action: the Gaussian's mean, squashed where the policy squashes."""
    return torch.tanh(dist.base_dist.mean) if isinstance(dist, TransformedDistribution) \
        else dist.mean


def _inside(dist: Normal | TransformedDistribution, flat: torch.Tensor) -> torch.Tensor:
    """A squashed policy scores only actions strictly inside (-1, 1): a demonstrated or
    clipped chunk on the box's edge would have log-prob -inf (tanh never reaches it)."""
    if isinstance(dist, TransformedDistribution):
        edge = 1.0 - torch.finfo(flat.dtype).eps
        return flat.clamp(-edge, edge)
    return flat


__all__ = ["DefaultPolicy", "add_encoders", "encode", "layer_init"]
