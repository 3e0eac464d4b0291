"""The default small policy: a CNN + bag-of-tokens + MLP Gaussian actor-critic.

Small enough to train on CPU in tests and benchmarks, yet shaped like a VLA: it reads an
image (uint8 HWC), a tokenised instruction (int ids, 0 = padding) and, when the environment
provides one, a proprioceptive state vector, and emits a whole action chunk
(chunk_len x action_dim) from one Gaussian with a state-independent learnable log-std.

Log-probability and entropy are summed over every dimension of the chunk, so the chunk is
one PPO "action". Sampled actions are not squashed: the environment clips. Behaviour cloning
(`imitation_loss`, `hpcvla sft`) maximises the same Gaussian's likelihood of the demonstrated
chunks, so the std it ends with is the demonstrations' spread: the exploration RL starts from.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributions import Normal

from hpcvla.policies.base import ActOutput, Policy, real_steps_mean

INSTRUCTION_EMBED_DIM = 32


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    """CleanRL-style orthogonal weight init with constant bias."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class DefaultPolicy(Policy):
    """Actor-critic over (image, instruction, optional state) producing Gaussian action chunks.

    Args:
        obs_spec: per-env field spec, ``{name: (shape, dtype_str)}``; "image" is (H, W, C)
            uint8, "instruction" is (L,) int token ids, "state" (optional) is (S,) float.
        action_dim: dimensions of one action.
        chunk_len: actions per chunk.
        vocab_size: instruction token vocabulary size (id 0 is padding).
        hidden: width of the image projection, state projection and MLP trunk.
        init_log_std: initial value of the (state-independent) log standard deviation.
    """

    family = "default"
    config_fields = ("hidden", "init_log_std")  # PolicyConfig fields the pipeline passes

    @classmethod
    def folder_problems(cls, folder, policy_cfg, env_cfg) -> list[tuple[str, str, str]]:
        return [("policy.pretrained", folder, "a folder written by `hpcvla sft` (its "
                 "`policy/`) or save_pretrained: the default policy has no published weights")]

    def __init__(
        self,
        obs_spec: dict,
        action_dim: int,
        chunk_len: int,
        vocab_size: int,
        hidden: int = 128,
        init_log_std: float = -0.7,
    ):
        super().__init__()
        # what config.json records to rebuild it (policies/folders.save_pretrained)
        self.obs_spec = {k: (tuple(shape), dt) for k, (shape, dt) in obs_spec.items()}
        self.vocab_size = int(vocab_size)
        self.init_args = {"hidden": int(hidden), "init_log_std": float(init_log_std)}
        self.action_dim = int(action_dim)
        self.chunk_len = int(chunk_len)
        self.has_image = "image" in obs_spec
        self.has_instruction = "instruction" in obs_spec
        self.has_state = "state" in obs_spec
        if not (self.has_image or self.has_instruction or self.has_state):
            raise ValueError(f"obs_spec has none of image/instruction/state: {sorted(obs_spec)}")

        feat_dim = 0
        if self.has_image:
            h, w, c = obs_spec["image"][0]
            convs = nn.Sequential(
                layer_init(nn.Conv2d(c, 16, 5, stride=2)), nn.ReLU(),
                layer_init(nn.Conv2d(16, 32, 3, stride=2)), nn.ReLU(),
                layer_init(nn.Conv2d(32, 32, 3, stride=2)), nn.ReLU(),
                nn.Flatten(),
            )
            with torch.no_grad():  # infer the flattened size instead of hand-computing it
                n_flat = convs(torch.zeros(1, c, h, w)).shape[1]
            self.image_encoder = nn.Sequential(convs, layer_init(nn.Linear(n_flat, hidden)), nn.ReLU())
            feat_dim += hidden
        if self.has_instruction:
            self.token_embedding = nn.Embedding(vocab_size, INSTRUCTION_EMBED_DIM, padding_idx=0)
            feat_dim += INSTRUCTION_EMBED_DIM
        if self.has_state:
            (state_dim,) = obs_spec["state"][0]
            self.state_encoder = nn.Sequential(layer_init(nn.Linear(state_dim, hidden)), nn.Tanh())
            feat_dim += hidden

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
        self.log_std = nn.Parameter(torch.full((n_out,), float(init_log_std)))

    def features(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Encode each present modality and concatenate: (B, feat_dim)."""
        parts = []
        if self.has_image:
            # uint8 HWC -> float CHW in [0, 1]; done here so callers can ship compact uint8.
            img = obs["image"].permute(0, 3, 1, 2).float().div_(255.0)
            parts.append(self.image_encoder(img))
        if self.has_instruction:
            tokens = obs["instruction"].long()
            mask = (tokens != 0).unsqueeze(-1).float()
            summed = (self.token_embedding(tokens) * mask).sum(dim=1)
            # Mean over real tokens; an all-padding instruction gives a zero vector.
            parts.append(summed / mask.sum(dim=1).clamp(min=1.0))
        if self.has_state:
            parts.append(self.state_encoder(obs["state"].float()))
        return torch.cat(parts, dim=-1)

    def _dist_and_value(self, obs: dict[str, torch.Tensor]) -> tuple[Normal, torch.Tensor]:
        """Flat Normal over chunk_len*action_dim dims, and the value (B,)."""
        h = self.features(obs)
        mean = self.mean_head(self.trunk(h))
        std = self.log_std.exp().expand_as(mean)
        return Normal(mean, std), self.value_head(self.value_trunk(h)).squeeze(-1)

    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False) -> ActOutput:
        with torch.no_grad():
            dist, value = self._dist_and_value(obs)
            flat = dist.mean if deterministic else dist.sample()
            logprob = dist.log_prob(flat).sum(-1)
            actions = flat.view(-1, self.chunk_len, self.action_dim)
        return ActOutput(actions=actions, logprob=logprob, value=value)

    def evaluate(
        self, obs: dict[str, torch.Tensor], actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dist, value = self._dist_and_value(obs)
        flat = actions.reshape(actions.shape[0], -1).to(dist.mean.dtype)
        logprob = dist.log_prob(flat).sum(-1)
        entropy = dist.entropy().sum(-1)
        return logprob, value, entropy

    def imitation_loss(self, obs, actions, real):
        """Negative log-likelihood per action dimension of the real steps (so the scale does
        not grow with chunk_len x action_dim)."""
        dist, _ = self._dist_and_value(obs)
        flat = actions.reshape(actions.shape[0], -1).to(dist.mean.dtype)
        nll = -dist.log_prob(flat).view(-1, self.chunk_len, self.action_dim)
        return real_steps_mean(nll, real)


def count_parameters(module: nn.Module) -> int:
    """Number of trainable parameters (handy for logs and sizing weight broadcasts)."""
    return int(sum(p.numel() for p in module.parameters() if p.requires_grad))


__all__ = ["DefaultPolicy", "count_parameters", "layer_init"]
