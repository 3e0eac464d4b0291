"""Parallel-decoded action tokens (OpenVLA-OFT style): 256 bins per action dim, one pass.

The prefix (SigLIP patches + instruction, and the proprioceptive state as one more token
through `proprio_projector`, as OFT does) is followed by H x D learned *action query*
tokens, one per (action h, dim d) of the chunk. A Llama-style language model runs over all of
it once: queries see the prefix and each other (bidirectional, OFT's parallel decoding), the
prefix does not see the queries. Each query's last hidden state goes through `action_head`
to 256 logits: a categorical over bins that split [-1, 1] (the env's action range) evenly.

Sampling draws a bin per token, independently given the observation; the action is the
bin's centre, -1 + (i + 0.5) * 2 / 256, exactly representable in float32, so `evaluate`
recovers the bins from the chunk alone (`bins_of`) and the chunk log-prob is the sum of the
H x D token log-probs. `deterministic=True` takes each token's most likely bin.

Granularity (constructor option): evaluate returns logprob and entropy per chunk (B,), per
action (B, H) or per token (B, H, D); `unit_logprobs` always gives the (B, H, D) token
log-probs; act returns the chunk log-prob (B,).

Initialisation matters for RL from scratch. With independent random rows, the 256 bins of a
token are unrelated classes: a reward raises only the bin that was sampled, and the gradient
reaching the model, sum_i (onehot_i - p_i) * W_i, is noise. `action_head` therefore starts
*ordinal*: row i = c_i * u / s^2 and bias i = -c_i^2 / (2 s^2) (c_i the bin centre, u a small
random vector, s = exp(init_log_std)), i.e. logits -(c_i - u.h)^2 / (2 s^2) + const: a
discretised Gaussian of std s whose mean u.h is linear in the query's hidden state h. Then
the gradient to h is A * (c_sampled - E[c]) * u / s^2, as for a Gaussian policy's mean: the
model learns where to put the mass, not one bin at a time. The rows stay free parameters
(OFT's plain linear head); only their starting point is structured. Value: an MLP on the mean
of the prefix's last hidden states.

HF key map: the language model follows OpenVLA's layout (`language_model.model.*`); OpenVLA
keeps its (timm) vision featurizers under `vision_backbone.*`, ours are HF SigLIP names there
(a timm checkpoint needs converting). OpenVLA decodes bins with the last 256 rows of its
`lm_head`; ours is the separate `action_head` (256 rows, bin i = row i).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hpcvla.policies.vla import VisionLanguagePrefix, VLAPolicy, masked_mean, resolve_size, \
    value_mlp

BINS = 256
INIT_MEAN_SCALE = 0.5  # initial bin-distribution means ~ N(0, 0.5^2)


def bin_centres(device=None) -> torch.Tensor:
    return -1.0 + (torch.arange(BINS, device=device, dtype=torch.float32) + 0.5) * (2.0 / BINS)


def bins_of(actions: torch.Tensor) -> torch.Tensor:
    """The bin of each action value (values outside [-1, 1] fall in the end bins)."""
    return ((actions.float() + 1.0) * (BINS / 2)).floor().clamp(0, BINS - 1).long()


class ActionTokenPolicy(VLAPolicy):
    """OpenVLA-OFT-style VLA; see the module docstring.

    Args (beyond the Policy ones):
        size: "tiny" | "small" | "full" (vla.SIZES) or a resolved dict of configs.
        logprob_granularity: "chunk" | "action" | "token", the shape evaluate returns.
        init_log_std: log std of the initial Gaussian-shaped bin distribution.
        dtype: "auto" (bf16 on CUDA, float32 on CPU), "float32" or "bfloat16".
    """

    family = "tokens"
    HF_KEY_MAP = (
        ("prefix.vision_tower.", "vision_backbone.siglip.vision_model."),
        ("prefix.multi_modal_projector.", "projector."),
        ("prefix.language_model.", "language_model.model."),
        ("value_head.", "rl.value_head."),
    )  # action_queries, action_head, proprio_projector keep their names

    def __init__(self, obs_spec, action_dim, chunk_len, vocab_size, size="tiny",
                 logprob_granularity: str = "chunk", init_log_std: float = -0.7,
                 dtype: str = "auto"):
        super().__init__()
        parts = resolve_size("tokens", size, obs_spec, vocab_size)
        self._setup(obs_spec, action_dim, chunk_len, vocab_size, logprob_granularity, dtype,
                    dict(size=parts, logprob_granularity=logprob_granularity,
                         init_log_std=init_log_std, dtype=dtype))
        self.prefix = VisionLanguagePrefix(parts, "llama", self.compute_dtype)
        width = self.prefix.width
        if self.has_state:
            self.proprio_projector = nn.Linear(obs_spec["state"][0][0], width)
        self.n_queries = self.chunk_len * self.action_dim
        self.action_queries = nn.Embedding(self.n_queries, width)
        self.action_head = nn.Linear(width, BINS)
        with torch.no_grad():  # ordinal init: a discretised Gaussian, mean linear in h
            variance = math.exp(2 * init_log_std)
            direction = torch.randn(width) * (INIT_MEAN_SCALE / math.sqrt(width))
            self.action_head.weight.copy_(bin_centres()[:, None] * direction / variance)
            self.action_head.bias.copy_(-0.5 * bin_centres() ** 2 / variance)
        self.value_head = value_mlp(width, min(256, width))
        self.to(self.compute_dtype)

    def lora_models(self):
        return [self.prefix.language_model]

    def _logits_and_value(self, obs):
        """Bin logits (B, H, D, 256) float32 and value (B,)."""
        embeds, pad = self.prefix.embed(obs)
        if self.has_state:
            state = self.proprio_projector(obs["state"].to(embeds.dtype))
            embeds = torch.cat([embeds, state[:, None]], dim=1)
            pad = torch.cat([pad, pad.new_ones(pad.shape[0], 1)], dim=1)
        B, P = pad.shape
        ids = torch.arange(self.n_queries, device=pad.device)
        queries = self.action_queries(ids)[None].expand(B, -1, -1).to(embeds.dtype)
        embeds = torch.cat([embeds, queries], dim=1)
        pad = torch.cat([pad, pad.new_ones(B, self.n_queries)], dim=1)
        blocks = torch.cat([torch.zeros(P, dtype=torch.long, device=pad.device),
                            torch.ones(self.n_queries, dtype=torch.long, device=pad.device)])
        hidden = self.prefix(embeds, pad, blocks)
        logits = self.action_head(hidden[:, P:]).float()
        value = self.value_head(masked_mean(hidden[:, :P], pad[:, :P])).squeeze(-1).float()
        return logits.view(B, self.chunk_len, self.action_dim, BINS), value

    def _sample(self, obs, deterministic):
        logits, value = self._logits_and_value(obs)
        logp = torch.log_softmax(logits, dim=-1)
        if deterministic:
            bins = logits.argmax(dim=-1)
        else:
            bins = torch.multinomial(logp.exp().reshape(-1, BINS), 1).view(logits.shape[:-1])
        terms = logp.gather(-1, bins[..., None]).squeeze(-1)
        return bin_centres(logits.device)[bins], terms, value, {}

    def _score(self, obs, actions):
        logits, value = self._logits_and_value(obs)
        logp = torch.log_softmax(logits, dim=-1)
        terms = logp.gather(-1, bins_of(actions)[..., None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        return terms, entropy, value


__all__ = ["ActionTokenPolicy", "BINS", "bin_centres", "bins_of"]
