"""What the two VLA policy families share: size presets, the vision-language prefix, attention
masks, the per-unit log-prob reduction, and Hugging Face-style checkpoint folders.

Both families (policies/flow.py, policies/tokens.py) read an observation as a *prefix* of
tokens: SigLIP patch tokens of the camera image projected to the language model's width
(PaliGemma's layout), then the instruction's token embeddings (id 0 = padding, masked out).
Prefix tokens attend to each other bidirectionally (PaliGemma's prefix-LM); what follows the
prefix (the action expert's tokens, or the action queries) sees the prefix but is not seen
by it. Masks are built here as 4D additive float masks, which transformers uses as given.

Log-probs are computed per *unit* (B, chunk_len, action_dim) and reduced to the configured
granularity (algorithms/granularity.py): `evaluate` returns logprob and entropy of shape
(B,) for "chunk", (B, H) for "action", (B, H, D) for "token"; `act` always returns the chunk
log-prob (B,), the sum of the units, which is what rollouts record.

Checkpoint folders: `save_pretrained(policy, folder)` writes `config.json` (the family, the
observation spec, the constructor arguments with the size resolved into full transformers
configs) and `model.safetensors` (every parameter and buffer of the state dict, renamed by
the family's HF_KEY_MAP, see `to_hf_key`); `load_pretrained(folder)` rebuilds the policy and
loads it exactly. `load_weights(policy, file)` loads a safetensors file into an existing
policy: tensors missing, unexpected or misshaped are named in the error; only the RL heads
(`rl.*`: value head, exploration std) may be missing, they then keep their initial values
(a VLA checkpoint trained by imitation has none).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hpcvla.algorithms.granularity import GRANULARITIES, reduce_units
from hpcvla.policies.base import ActOutput, Policy

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
SIZE_NAMES = ("tiny", "small", "full")


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


class PrefixCache:
    """A minimal stand-in for a transformers `Cache` (the `update` the attention layers call).

    Recording: the prefix forward stores each layer's keys/values. Serving (after
    `freeze()`): a later forward (the action expert) attends to [prefix; its own tokens]
    without the cache growing, so one prefix serves every denoising step. Keys and values
    keep their autograd graph: gradients reach the prefix through them.
    """

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.serving = False

    def update(self, key, value, layer_idx, *args, **kwargs):
        if not self.serving:
            self.keys[layer_idx], self.values[layer_idx] = key, value
            return key, value
        return (torch.cat([self.keys[layer_idx], key], dim=-2),
                torch.cat([self.values[layer_idx], value], dim=-2))

    def freeze(self) -> "PrefixCache":
        self.serving = True
        return self

    def repeat(self, n: int) -> "PrefixCache":
        """Each batch element's keys/values repeated n times (consecutively)."""
        out = PrefixCache().freeze()
        for layer in self.keys:
            out.keys[layer] = self.keys[layer].repeat_interleave(n, dim=0)
            out.values[layer] = self.values[layer].repeat_interleave(n, dim=0)
        return out


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
    [image patches; instruction tokens; extra tokens the caller appends]."""

    def __init__(self, parts: dict[str, dict], text_family: str):
        super().__init__()
        from transformers import (GemmaConfig, GemmaModel, LlamaConfig, LlamaModel,
                                  SiglipVisionConfig, SiglipVisionModel)

        self.vision_config = SiglipVisionConfig(**parts["vision"], vision_use_head=False)
        config_cls, model_cls = {"gemma": (GemmaConfig, GemmaModel),
                                 "llama": (LlamaConfig, LlamaModel)}[text_family]
        self.text_config = config_cls(**parts["text"], pad_token_id=0, bos_token_id=None,
                                      eos_token_id=None)
        self.vision_tower = SiglipVisionModel(self.vision_config)
        self.multi_modal_projector = MultiModalProjector(self.vision_config.hidden_size,
                                                         self.text_config.hidden_size)
        self.language_model = model_cls(self.text_config)
        self.width = self.text_config.hidden_size

    def embed(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix embeddings (B, P, W) and their padding mask (B, P) (True = a real token).
        Every camera (`image`, and `wrist_image` when the env gives one) goes through the
        same vision tower, in one batch; their patch tokens come one camera after another,
        as in π0."""
        cameras = [obs[k] for k in CAMERAS if k in obs]
        image = torch.cat(cameras).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)  # [-1, 1]
        side = self.vision_config.image_size
        if image.shape[-2:] != (side, side):
            image = F.interpolate(image, size=(side, side), mode="bilinear", antialias=True,
                                  align_corners=False)
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
    config_fields = ("size", "logprob_granularity")  # PolicyConfig fields the pipeline passes

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
        device = self.device
        return {k: v.to(device, non_blocking=True) for k, v in obs.items()}

    @property
    def device(self) -> torch.device:
        return self.value_head[0].weight.device  # metadata only: fine on ZeRO-3 shards

    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False) -> ActOutput:
        return self.sample(obs, deterministic)[0]

    def sample(self, obs, deterministic: bool = False) -> tuple[ActOutput, dict]:
        """`act` plus the family's extras (flow's denoising chain in chain mode)."""
        with torch.no_grad():
            actions, terms, value, extras = self._sample(self._inputs(obs), deterministic)
        return ActOutput(actions.float(), terms.sum(dim=(1, 2)), value.float()), extras

    def evaluate(self, obs, actions):
        terms, entropy, value = self._score(self._inputs(obs), actions.to(self.device))
        g = self.logprob_granularity
        return reduce_units(terms, g), value.float(), reduce_units(entropy, g)

    def unit_logprobs(self, obs, actions) -> torch.Tensor:
        """Differentiable log-probs per token (B, H, D), whatever the granularity; their
        sums over D (action) and over H and D (chunk) are the coarser log-probs."""
        return self._score(self._inputs(obs), actions.to(self.device))[0]

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

    def config_json(self) -> dict:
        return {"hpcvla_policy": self.family, "architectures": [type(self).__name__],
                "obs_spec": {k: [list(s), dt] for k, (s, dt) in self.obs_spec.items()},
                "action_dim": self.action_dim, "chunk_len": self.chunk_len,
                "vocab_size": self.vocab_size, "kwargs": self.init_args}


RL_HEAD_PREFIX = "rl."  # checkpoint names of the RL-only tensors (may be absent)


def save_pretrained(policy: VLAPolicy, folder) -> Path:
    """Write `config.json` + `model.safetensors` (HF names); returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {policy.to_hf_key(k): v.detach().cpu().contiguous()
               for k, v in policy.state_dict().items()}
    save_file(tensors, folder / "model.safetensors",
              metadata={"format": "pt", "hpcvla_policy": policy.family})
    (folder / "config.json").write_text(json.dumps(policy.config_json(), indent=1))
    return folder


def load_weights(policy: VLAPolicy, file) -> list[str]:
    """Load a safetensors file (HF names) into `policy`, exactly. Raises naming every
    missing, unexpected or misshaped tensor; returns the RL-head names that were absent
    (kept at their initial values)."""
    from safetensors.torch import load_file

    loaded = {policy.from_hf_key(k): v for k, v in load_file(str(file)).items()}
    state = policy.state_dict()
    missing = [k for k in state if k not in loaded]
    fresh = [k for k in missing if policy.to_hf_key(k).startswith(RL_HEAD_PREFIX)]
    problems = [f"missing {policy.to_hf_key(k)} {tuple(state[k].shape)}"
                for k in missing if k not in fresh]
    problems += [f"unexpected {policy.to_hf_key(k)}" for k in loaded if k not in state]
    problems += [f"misshaped {policy.to_hf_key(k)}: file {tuple(v.shape)}, model "
                 f"{tuple(state[k].shape)}" for k, v in loaded.items()
                 if k in state and v.shape != state[k].shape]
    if problems:
        raise ValueError(f"{file}: {len(problems)} tensor(s) do not fit the "
                         f"{policy.family} policy: " + "; ".join(problems))
    with torch.no_grad():
        for k, v in loaded.items():
            state[k].copy_(v)
    return fresh


def load_pretrained(folder, **overrides) -> VLAPolicy:
    """Rebuild the policy `config.json` describes and load `model.safetensors` into it.
    `overrides` replace constructor arguments (e.g. logprob_granularity, train_expert_only)."""
    from hpcvla.policies import POLICIES

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    name = config.get("hpcvla_policy")
    if name not in POLICIES:
        raise ValueError(f"{folder / 'config.json'}: hpcvla_policy {name!r} is not one of "
                         f"{sorted(POLICIES)}")
    obs_spec = {k: (tuple(s), dt) for k, (s, dt) in config["obs_spec"].items()}
    policy = POLICIES[name](obs_spec, config["action_dim"], config["chunk_len"],
                            config["vocab_size"], **{**config["kwargs"], **overrides})
    load_weights(policy, folder / "model.safetensors")
    return policy


def count_preset_parameters(name: str, size: str, obs_spec: dict, action_dim: int,
                            chunk_len: int, vocab_size: int) -> int:
    """Parameters of a preset, counted on the meta device (no memory is allocated)."""
    from hpcvla.policies import POLICIES

    with torch.device("meta"):
        policy = POLICIES[name](obs_spec, action_dim, chunk_len, vocab_size, size=size,
                                dtype="float32")
    return sum(p.numel() for p in policy.parameters())


__all__ = ["SIZES", "SIZE_NAMES", "VLAPolicy", "VisionLanguagePrefix", "PrefixCache",
           "block_mask", "save_pretrained", "load_pretrained", "load_weights",
           "count_preset_parameters"]
