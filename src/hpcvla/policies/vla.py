"""What the VLA policy families share: size presets, the vision-language prefix, attention
masks, the per-unit log-prob reduction, and Hugging Face-style checkpoint folders (OFT,
policies/oft.py, has its own backbone and sizes and uses the VLAPolicy base and the masks).

The flow and tokens families (policies/flow.py, policies/tokens.py) read an observation as a
*prefix* of tokens: SigLIP patch tokens of each camera image (resized with padding to the
tower's size, as openpi and LeRobot do) projected to the language model's width (PaliGemma's
layout), then the instruction's token embeddings (id 0 = padding, masked out).
Prefix tokens attend to each other bidirectionally (PaliGemma's prefix-LM); what follows the
prefix (the action expert's tokens, or the action queries) sees the prefix but is not seen
by it. Masks are built here as 4D additive float masks, which transformers uses as given.

Log-probs are computed per *unit* (B, chunk_len, action_dim) and reduced to the configured
granularity (algorithms/granularity.py): `evaluate` returns logprob and entropy of shape
(B,) for "chunk", (B, H) for "action", (B, H, D) for "token"; `act` always returns the chunk
log-prob (B,), the sum of the units, which is what rollouts record.

Checkpoint folders (policies/folders.py): a family names its tensors as the model it follows
(`HF_KEY_MAP`, see `to_hf_key`) and declares the published layout's variants (`HF_LAYOUT`);
`config_json` records what rebuilds the policy (the family, the observation spec, the
constructor arguments with the size resolved into full transformers configs).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from hpcvla.algorithms.granularity import GRANULARITIES, reduce_units
from hpcvla.config.policy import SIZE_NAMES
from hpcvla.policies.backbones import backbone
from hpcvla.policies.base import ActOutput, Policy, real_steps_mean

# --------------------------------------------------------------------------- size presets
# Each preset: transformers config kwargs for the SigLIP vision tower ("vision"), the
# language model ("text": Gemma for flow, Llama for tokens) and, for flow, the action expert
# ("expert"; same depth, KV heads and head_dim as "text": it attends to the text model's
# keys/values layer by layer). vision image_size None = the env's image size.
_TINY_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                    num_attention_heads=2, patch_size=16, image_size=None)
_SMALL_VISION = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                     num_attention_heads=4, patch_size=8, image_size=None)
# SigLIP so400m/14 at 224 px, PaliGemma's (and OpenVLA's fused) vision tower.
_SO400M = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
               num_attention_heads=16, patch_size=14, image_size=224)

SIZES: dict[str, dict[str, dict]] = {
    "flow/tiny": dict(
        vision=_TINY_VISION,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32),
        expert=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=32)),
    "flow/small": dict(
        vision=_SMALL_VISION,
        text=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=64),
        expert=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=64)),
    # π0: PaliGemma-3B (SigLIP so400m + Gemma 2B) and the Gemma 300M action expert.
    "flow/full": dict(
        vision=_SO400M,
        text=dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                  num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                  vocab_size=257152),
        expert=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=18,
                    num_attention_heads=8, num_key_value_heads=1, head_dim=256)),
    "tokens/tiny": dict(
        vision=_TINY_VISION,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32)),
    "tokens/small": dict(
        vision=_SMALL_VISION,
        text=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=64)),
    # OpenVLA-7B-like: Llama 2 7B over SigLIP so400m (OpenVLA fuses DINOv2 + SigLIP).
    "tokens/full": dict(
        vision=_SO400M,
        text=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                  vocab_size=32000, rms_norm_eps=1e-5)),
}


def resolve_size(family: str, size, obs_spec: dict, vocab_size: int) -> dict[str, dict]:
    """A preset name (or an already resolved dict) -> full config kwargs per part: the image
    size is the env's (rounded down to whole patches) unless the preset fixes it, and the
    text vocabulary covers the env's token ids."""
    for name in ("image", "instruction"):
        if name not in obs_spec:
            raise ValueError(f"the {family} policy needs observation {name!r}; got "
                             f"{sorted(obs_spec)}")
    if isinstance(size, dict):
        return copy.deepcopy(size)
    key = f"{family}/{size}"
    if key not in SIZES:
        raise ValueError(f"unknown {family} size {size!r}; presets: {', '.join(SIZE_NAMES)}")
    parts = copy.deepcopy(SIZES[key])
    vision = parts["vision"]
    if vision["image_size"] is None:
        side = obs_spec["image"][0][0]
        vision["image_size"] = max(vision["patch_size"], side - side % vision["patch_size"])
    parts["text"]["vocab_size"] = max(parts["text"].get("vocab_size", 0), int(vocab_size))
    return parts


def resolve_dtype(dtype: str) -> torch.dtype:
    """"auto": bf16 where CUDA is, float32 on CPU (CPU bf16 matmuls are slow and imprecise)."""
    if dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


# --------------------------------------------------------------------------- masks, inputs
def block_mask(key_pad: torch.Tensor, key_blocks: torch.Tensor, query_blocks: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """4D additive mask (B, 1, Lq, Lk): a query of block b sees the non-padding keys of
    blocks <= b (π0's block-causal mask: bidirectional inside a block)."""
    allowed = (key_blocks[None, :] <= query_blocks[:, None])[None] & key_pad[:, None, :]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=key_pad.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def sinusoidal(t: torch.Tensor, dim: int, min_period: float = 4e-3,
               max_period: float = 4.0) -> torch.Tensor:
    """π0's time embedding of t (B,): sin/cos at periods geometric in [min, max]."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, device=t.device, dtype=torch.float64)
    period = min_period * (max_period / min_period) ** fraction
    angle = (2 * math.pi / period)[None, :] * t.double()[:, None]
    return torch.cat([angle.sin(), angle.cos()], dim=-1).float()


def resize_with_pad(image: torch.Tensor, side: int) -> torch.Tensor:
    """(B, C, H, W) in [0, 1] to (B, C, side, side): bilinear without antialiasing to fit the
    longer edge, then centred black padding (openpi's and LeRobot's resize_with_pad)."""
    height, width = image.shape[-2:]
    if (height, width) == (side, side):
        return image
    ratio = max(height / side, width / side)
    new_h, new_w = int(height / ratio), int(width / ratio)
    image = F.interpolate(image, size=(new_h, new_w), mode="bilinear",
                          align_corners=False).clamp(0.0, 1.0)
    top, left = (side - new_h) // 2, (side - new_w) // 2
    return F.pad(image, (left, side - new_w - left, top, side - new_h - top))


class PrefixCache:
    """A minimal stand-in for a transformers `Cache` (the `update` the attention layers call).

    Recording: the prefix forward stores each layer's keys/values; a layer recomputed in the
    backward pass (learner.gradient_checkpointing) records again, which keeps the first
    tensors, the ones later passes attended to. Serving (`freeze()` returns a serving view):
    a later forward (the action expert) attends to [prefix; its own tokens] without the cache
    growing, so one prefix serves every denoising step. Keys and values keep their autograd
    graph: gradients reach the prefix through them.
    """

    serving = False

    def __init__(self, keys: dict | None = None, values: dict | None = None):
        self.keys: dict[int, torch.Tensor] = {} if keys is None else keys
        self.values: dict[int, torch.Tensor] = {} if values is None else values

    def update(self, key, value, layer_idx, *args, **kwargs):
        if not self.serving:
            self.keys.setdefault(layer_idx, key)
            self.values.setdefault(layer_idx, value)
            return key, value
        return (torch.cat([self.keys[layer_idx], key], dim=-2),
                torch.cat([self.values[layer_idx], value], dim=-2))

    def freeze(self) -> "PrefixCache":
        """A serving view of the recorded keys/values (this cache goes on recording)."""
        out = PrefixCache(self.keys, self.values)
        out.serving = True
        return out

    def repeat(self, n: int) -> "PrefixCache":
        """Each batch element's keys/values repeated n times (consecutively), serving."""
        def repeated(tensors):
            return {layer: t.repeat_interleave(n, dim=0) for layer, t in tensors.items()}
        return PrefixCache(repeated(self.keys), repeated(self.values)).freeze()


MODEL_ACTIONS = "model_actions"  # a processor's policy records its chunk in the model's space
CAMERAS = ("image", "wrist_image")  # observation keys the prefix sees, in token order


class MultiModalProjector(nn.Module):
    """PaliGemma's projector (one linear layer); keeps its checkpoint name `linear`."""

    def __init__(self, vision_width: int, text_width: int):
        super().__init__()
        self.linear = nn.Linear(vision_width, text_width)

    def forward(self, x):
        return self.linear(x)


class VisionLanguagePrefix(nn.Module):
    """SigLIP vision tower + projector + a decoder language model (Gemma or Llama) over
    [image patches; instruction tokens; extra tokens the caller appends]. The transformers
    models are built in `dtype` directly (a bf16 π0 never holds a float32 copy)."""

    def __init__(self, parts: dict[str, dict], text_family: str,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        from transformers import (GemmaConfig, GemmaModel, LlamaConfig, LlamaModel,
                                  SiglipVisionConfig, SiglipVisionModel)

        self.vision_config = SiglipVisionConfig(**parts["vision"], vision_use_head=False)
        config_cls, model_cls = {"gemma": (GemmaConfig, GemmaModel),
                                 "llama": (LlamaConfig, LlamaModel)}[text_family]
        self.text_config = config_cls(**parts["text"], pad_token_id=0, bos_token_id=None,
                                      eos_token_id=None)
        self.vision_tower = backbone(SiglipVisionModel, self.vision_config, dtype)
        self.multi_modal_projector = MultiModalProjector(self.vision_config.hidden_size,
                                                         self.text_config.hidden_size)
        self.language_model = backbone(model_cls, self.text_config, dtype)
        self.width = self.text_config.hidden_size

    def embed(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix embeddings (B, P, W) and their padding mask (B, P) (True = a real token).
        Every camera (`image`, and `wrist_image` when the env gives one) goes through the
        same vision tower, in one batch; their patch tokens come one camera after another,
        as in π0."""
        cameras = [obs[k] for k in CAMERAS if k in obs]
        image = resize_with_pad(torch.cat(cameras).permute(0, 3, 1, 2).float().div(255.0),
                                self.vision_config.image_size) * 2.0 - 1.0  # SigLIP: [-1, 1]
        dtype = self.multi_modal_projector.linear.weight.dtype
        patches = self.vision_tower(pixel_values=image.to(dtype)).last_hidden_state
        image_tokens = torch.cat(self.multi_modal_projector(patches).chunk(len(cameras)), dim=1)
        tokens = obs["instruction"].long()
        text_tokens = self.language_model.embed_tokens(tokens)  # Gemma's scaled embedding
        pad = torch.cat([torch.ones(image_tokens.shape[:2], dtype=torch.bool,
                                    device=tokens.device), tokens != 0], dim=1)
        return torch.cat([image_tokens, text_tokens.to(image_tokens.dtype)], dim=1), pad

    def forward(self, embeds, pad, blocks, cache: PrefixCache | None = None):
        """Run the language model over `embeds` (B, L, W) with the block mask; returns the
        last hidden states (B, L, W). Positions count real tokens only."""
        positions = (pad.long().cumsum(dim=1) - 1).clamp(min=0)
        mask = block_mask(pad, blocks, blocks, embeds.dtype)
        return self.language_model(inputs_embeds=embeds, attention_mask=mask,
                                   position_ids=positions, past_key_values=cache,
                                   use_cache=False).last_hidden_state


def masked_mean(hidden: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """Mean over the real tokens: (B, L, W), (B, L) -> (B, W)."""
    weights = pad.to(hidden.dtype)[..., None]
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


class VocabularyHead(nn.Linear):
    """An LLM's `lm_head`; `rows` (a slice): those rows' logits alone, in float32 at least. A
    policy that reads a few hundred action ids of a 32k vocabulary scores them exactly (bf16
    logits of 20-30 are 0.06-0.125 apart, so inference's and training's kernels disagree by
    that much a token) and skips the other rows' product. Called as a module, so that ZeRO-3
    gathers its weight first."""

    def forward(self, hidden: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        if rows is None:
            return super().forward(hidden)
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        return F.linear(hidden.to(dtype), self.weight[rows].to(dtype))


def value_mlp(width: int, hidden: int) -> nn.Sequential:
    head = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, 1))
    nn.init.orthogonal_(head[0].weight, math.sqrt(2))
    nn.init.zeros_(head[0].bias)
    nn.init.orthogonal_(head[2].weight, 1.0)
    nn.init.zeros_(head[2].bias)
    return head


# --------------------------------------------------------------------------- policy base
class VLAPolicy(Policy):
    """Common plumbing: per-unit terms -> granularity, device/dtype of inputs, config.

    Subclasses implement `_sample(obs, deterministic)` -> (actions, terms, value, extras) and
    `_score(obs, actions)` -> (terms, entropy_terms, value); terms are (B, H, D) float32
    log-probs whose sum is the chunk log-prob.
    """

    family: str
    HF_KEY_MAP: tuple[tuple[str, str], ...] = ()  # (our prefix, checkpoint prefix); first wins

    @classmethod
    def resolved_size(cls, size: str, obs_spec: dict, vocab_size: int) -> dict | None:
        return resolve_size(cls.family, size, obs_spec, vocab_size)

    def _setup(self, obs_spec, action_dim, chunk_len, vocab_size, logprob_granularity, dtype,
               init_args: dict):
        if logprob_granularity not in GRANULARITIES:
            raise ValueError(f"logprob_granularity {logprob_granularity!r}: expected one of "
                             f"{', '.join(GRANULARITIES)}")
        self.obs_spec = {k: (tuple(shape), dt) for k, (shape, dt) in obs_spec.items()}
        self.action_dim, self.chunk_len, self.vocab_size = int(action_dim), int(chunk_len), \
            int(vocab_size)
        self.has_state = "state" in obs_spec
        self.logprob_granularity = logprob_granularity
        self.compute_dtype = resolve_dtype(dtype)
        self.init_args = init_args  # what config.json records to rebuild this policy

    def _inputs(self, obs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.processor is not None:
            obs = self.processor.inputs(obs)
        device = self.device
        return {k: v.to(device, non_blocking=True) for k, v in obs.items()}

    def _model_actions(self, actions: torch.Tensor, obs) -> torch.Tensor:
        """Actions in the env's units (demonstrations) of the raw observations `obs` -> the
        model's space, where they are scored."""
        actions = actions.to(self.device)
        return actions if self.processor is None else self.processor.actions_in(actions, obs)

    def extra_fields(self) -> dict[str, tuple[tuple, str]]:
        """Acting through a published folder's processor, the chunk as sampled in the model's
        space (MODEL_ACTIONS), which `evaluate` scores: the env's units do not always map back
        (a dim the checkpoint's statistics hold constant, q01 = q99 or std 0, comes out as that
        constant whatever was sampled: scored after the map back, it would be another action,
        tens of nats away; and the references' eps leaves the map back a little off)."""
        if not self.published:
            return {}
        return {MODEL_ACTIONS: ((self.chunk_len, self.action_dim), "<f4")}

    @property
    def device(self) -> torch.device:
        return self.value_head[0].weight.device  # metadata only: fine on ZeRO-3 shards

    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False) -> ActOutput:
        return self.sample(obs, deterministic)[0]

    def sample(self, obs, deterministic: bool = False) -> tuple[ActOutput, dict]:
        """`act` plus the family's extras (flow's denoising chain in chain mode)."""
        with torch.no_grad():
            actions, terms, value, extras = self._sample(self._inputs(obs), deterministic)
        if self.processor is not None:  # the env's units (the log-prob stays the model's)
            extras = {**extras, MODEL_ACTIONS: actions.float()}
            actions = self.processor.actions_out(actions, obs)
        return ActOutput(actions.float(), terms.sum(dim=(1, 2)), value.float()), extras

    def evaluate(self, obs, actions):
        """Scores the chunk sample() recorded in the model's space where obs has it, else
        `actions` (the env's units) mapped there."""
        model = obs[MODEL_ACTIONS].to(self.device) if MODEL_ACTIONS in obs \
            else self._model_actions(actions, obs)
        terms, entropy, value = self._score(self._inputs(obs), model)
        g = self.logprob_granularity
        return reduce_units(terms, g), value.float(), reduce_units(entropy, g)

    def enable_gradient_checkpointing(self) -> None:
        """Each transformers model of the policy (vision towers, language model) recomputes
        its layers in the backward pass (transformers' non-reentrant checkpointing)."""
        from transformers import PreTrainedModel
        for module in self.modules():
            if isinstance(module, PreTrainedModel):
                module.activation_checkpointing_enable()

    def imitation_loss(self, obs, actions, real):
        """Negative log-likelihood per action token (cross-entropy) of the real steps."""
        return real_steps_mean(-self.unit_logprobs(obs, actions).float(), real)

    def unit_logprobs(self, obs, actions) -> torch.Tensor:
        """Differentiable log-probs per token (B, H, D), whatever the granularity; their
        sums over D (action) and over H and D (chunk) are the coarser log-probs."""
        return self._score(self._inputs(obs), self._model_actions(actions, obs))[0]

    # ------------------------------------------------------------------ checkpoint folders
    @classmethod
    def to_hf_key(cls, key: str) -> str:
        for ours, theirs in cls.HF_KEY_MAP:
            if key.startswith(ours):
                return theirs + key[len(ours):]
        return key

    @classmethod
    def from_hf_key(cls, key: str) -> str:
        for ours, theirs in cls.HF_KEY_MAP:
            if key.startswith(theirs):
                return ours + key[len(theirs):]
        return key


__all__ = ["SIZES", "SIZE_NAMES", "VLAPolicy", "VisionLanguagePrefix", "PrefixCache",
           "block_mask"]
