"""OpenVLA-OFT's published ("prismatic" HF) checkpoint folder, read into the `oft` policy.

What the folder holds (tests/fixtures/oft/README.md has the full description):

* `config.json` (model_type "openvla"): `image_sizes`, `text_config` with only the Llama
  fields that differ from LlamaConfig's defaults. It names the full-size timm ids whatever the
  towers' sizes, so the vision sizes come from the tensors (heads: oft_vision.VISION_HEADS).
* `model.safetensors.index.json` + shards (bf16; upcast to the policy's dtype on load), timm
  names under `vision_backbone.{featurizer,fused_featurizer}.`, `projector.fc{1,2,3}.`,
  `language_model.model.` and the untied `language_model.lm_head.weight`.
* `dataset_statistics.json` (action/proprio q01, q99, mask per dataset key), the components
  `*proprio_projector*checkpoint*.pt` and (OFT's LIBERO recipe) the L1 head's
  `action_head--*checkpoint*.pt` (DDP state dicts: `module.` stripped; RLinf's shards hold
  them too), the tokenizer (`load_tokenizer`) and `preprocessor_config.json` (not read).

timm -> transformers: the fused `attn.qkv` is split into q/k/v (and fused back); LayerScale
`ls{1,2}.scale_factor` (OFT's name for timm's gamma) is `layer_scale{1,2}.lambda1`; DINOv2's
`pos_embed` covers the patches only (timm's no_embed_class), HF's position table has a cls row
first: it is zero on load, and folded into the cls token when writing back. SigLIP's
`attn_pool.*` (the MAP head, 13 tensors) exists in the checkpoint but OFT never runs it (it
reads an intermediate block): documented as unused and dropped. Everything else is strict:
missing, unexpected and misshaped tensors are named, in the checkpoint's names. The RL value
head is optional (`value_head.mlp.{0,2,4}.*`, RLinf's names; fresh when absent).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from hpcvla.policies.folders import read_tensors, tensor_shapes

DINO, SIGLIP = "vision_backbone.featurizer.", "vision_backbone.fused_featurizer."
UNUSED = (SIGLIP + "attn_pool.",)  # SigLIP's MAP head: in timm's model, never run by OFT
STATISTICS, CONFIG = "dataset_statistics.json", "config.json"

# (our name, published name); {i} a block index, {p} weight|bias
_PAIRS = [
    (DINO + "embeddings.patch_embeddings.projection.{p}", DINO + "patch_embed.proj.{p}"),
    (DINO + "embeddings.register_tokens", DINO + "reg_token"),
    (DINO + "encoder.layer.{i}.norm1.{p}", DINO + "blocks.{i}.norm1.{p}"),
    (DINO + "encoder.layer.{i}.attention.o_proj.{p}", DINO + "blocks.{i}.attn.proj.{p}"),
    (DINO + "encoder.layer.{i}.layer_scale1.lambda1", DINO + "blocks.{i}.ls1.scale_factor"),
    (DINO + "encoder.layer.{i}.layer_scale2.lambda1", DINO + "blocks.{i}.ls2.scale_factor"),
    (DINO + "encoder.layer.{i}.norm2.{p}", DINO + "blocks.{i}.norm2.{p}"),
    (DINO + "encoder.layer.{i}.mlp.fc1.{p}", DINO + "blocks.{i}.mlp.fc1.{p}"),
    (DINO + "encoder.layer.{i}.mlp.fc2.{p}", DINO + "blocks.{i}.mlp.fc2.{p}"),
    (DINO + "layernorm.{p}", DINO + "norm.{p}"),
    (SIGLIP + "embeddings.patch_embedding.{p}", SIGLIP + "patch_embed.proj.{p}"),
    (SIGLIP + "encoder.layers.{i}.layer_norm1.{p}", SIGLIP + "blocks.{i}.norm1.{p}"),
    (SIGLIP + "encoder.layers.{i}.self_attn.out_proj.{p}", SIGLIP + "blocks.{i}.attn.proj.{p}"),
    (SIGLIP + "encoder.layers.{i}.layer_norm2.{p}", SIGLIP + "blocks.{i}.norm2.{p}"),
    (SIGLIP + "encoder.layers.{i}.mlp.fc1.{p}", SIGLIP + "blocks.{i}.mlp.fc1.{p}"),
    (SIGLIP + "encoder.layers.{i}.mlp.fc2.{p}", SIGLIP + "blocks.{i}.mlp.fc2.{p}"),
    (SIGLIP + "post_layernorm.{p}", SIGLIP + "norm.{p}"),
    ("projector.fc{i}.{p}", "projector.fc{i}.{p}"),
    ("language_model.{rest}", "language_model.model.{rest}"),
    ("lm_head.weight", "language_model.lm_head.weight"),
    ("value_head.{i}.{p}", "value_head.mlp.{i}.{p}"),  # RLinf's value head (optional)
]
# fused qkv (published) <-> q/k/v (ours)
_QKV = [(DINO + "encoder.layer.{i}.attention.{x}_proj.{p}", DINO + "blocks.{i}.attn.qkv.{p}"),
        (SIGLIP + "encoder.layers.{i}.self_attn.{x}_proj.{p}", SIGLIP + "blocks.{i}.attn.qkv.{p}")]
_GROUPS = {"i": r"(?P<i>\d+)", "p": r"(?P<p>weight|bias)", "rest": r"(?P<rest>.+)",
           "x": r"(?P<x>[qkv])"}


def _regex(template: str) -> re.Pattern:
    return re.compile(re.sub(r"\\\{(\w+)\\\}", lambda m: _GROUPS[m.group(1)],
                             re.escape(template)) + "$")


_OURS = [(_regex(o), p) for o, p in _PAIRS]
_THEIRS = [(_regex(p), o) for o, p in _PAIRS]
_QKV_OURS = [(_regex(o), p) for o, p in _QKV]
_QKV_THEIRS = [(_regex(p), o) for o, p in _QKV]
_SPECIAL = {DINO + "embeddings.cls_token", DINO + "embeddings.position_embeddings",
            SIGLIP + "embeddings.position_embedding.weight"}


def _rename(key: str, rules, **fill) -> str | None:
    for pattern, template in rules:
        match = pattern.match(key)
        if match:
            return template.format(**match.groupdict(), **fill)
    return None


def to_published(state: dict) -> dict:
    """Our tensors -> the published layout's (meta tensors give just names and shapes). The
    proprio projector and the L1 action head are not in it (their own .pt files), nor the
    L1 head's exploration std (an RL head)."""
    out = {}
    for key, value in state.items():
        if key.startswith(OWN_FILES) or key == "log_std" or key in _SPECIAL:
            continue
        qkv = _rename(key, _QKV_OURS)
        if qkv is not None:
            if ".q_proj." in key:
                out[qkv] = torch.cat([state[key.replace(".q_proj.", f".{x}_proj.")]
                                      for x in "qkv"])
            continue
        name = _rename(key, _OURS)
        if name is None:
            raise ValueError(f"no published name for the oft policy's tensor {key}")
        out[name] = value
    pos = state[DINO + "embeddings.position_embeddings"]
    out[DINO + "pos_embed"] = pos[:, 1:]  # timm's no_embed_class: patches only
    out[DINO + "cls_token"] = state[DINO + "embeddings.cls_token"] + pos[:, :1]
    out[SIGLIP + "pos_embed"] = state[SIGLIP + "embeddings.position_embedding.weight"][None]
    return out


def published_files(state: dict, source) -> tuple[dict, dict]:
    """`state` as the published folder `source` holds it (policies/export.py): the tensors of
    its safetensors files, and its proprio projector and action head files (where it has
    them and the state the module) in each file's key format (DDP's `module.` prefix or
    not) and dtype."""
    files = {}
    for prefix, find in COMPONENTS.items():
        file = find(source)
        ours = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        if file is None or not ours:
            continue
        theirs = torch.load(file, map_location="cpu", weights_only=True)
        ddp = "module." if all(k.startswith("module.") for k in theirs) else ""
        dtype = next(iter(theirs.values())).dtype
        files[file.name] = {ddp + k: v.detach().to("cpu", dtype) for k, v in ours.items()}
    return to_published(state), files


def from_published(tensors: dict) -> dict:
    """Published tensors (names checked by `load_published`) -> our names."""
    out = {}
    for key, value in tensors.items():
        if key == DINO + "pos_embed":
            out[DINO + "embeddings.position_embeddings"] = torch.cat(
                [value.new_zeros(1, 1, value.shape[-1]), value], dim=1)
        elif key == DINO + "cls_token":
            out[DINO + "embeddings.cls_token"] = value
        elif key == SIGLIP + "pos_embed":
            out[SIGLIP + "embeddings.position_embedding.weight"] = value[0]
        elif _rename(key, _QKV_THEIRS, x="q") is not None:
            for x, part in zip("qkv", value.chunk(3)):
                out[_rename(key, _QKV_THEIRS, x=x)] = part
        else:
            out[_rename(key, _THEIRS)] = value
    return out


def read_config(folder) -> dict:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise ValueError(f"{folder}: {CONFIG} is missing (OFT writes it beside the weights)")
    return json.loads(path.read_text())


def folder_dims(folder) -> dict:
    """The architecture's sizes (oft.SIZES' format) from the tensors and config.json."""
    shapes, config = tensor_shapes(folder), read_config(folder)

    def shape(key):
        if key not in shapes:
            raise ValueError(f"{folder}: tensor {key} is missing (an OpenVLA-OFT checkpoint "
                             "has it)")
        return shapes[key]

    def depth(prefix):
        return 1 + max((int(m.group(1)) for k in shapes
                        for m in [re.match(re.escape(prefix) + r"blocks\.(\d+)\.", k)] if m),
                       default=-1)

    patch = shape(DINO + "patch_embed.proj.weight")[-1]
    side = int(round(shape(DINO + "pos_embed")[1] ** 0.5)) * patch
    sizes = config.get("image_sizes") or [side]
    if any(s != side for s in sizes):
        raise ValueError(f"{folder}: config.json image_sizes {sizes}, but the position "
                         f"tables are for {side} px")
    text = config.get("text_config", {})
    heads = text.get("num_attention_heads", 32)  # LlamaConfig's defaults (Llama-2 7B)
    embed = shape("language_model.model.embed_tokens.weight")
    if embed[1] % heads:
        unset = "" if "num_attention_heads" in text else ", unset: Llama-2 7B's"
        raise ValueError(f"{folder}: config.json's text_config.num_attention_heads ({heads}"
                         f"{unset}) does not divide the language model's width ({embed[1]})")
    return {
        "image_size": side, "patch_size": patch,
        "dino": dict(hidden_size=shape(DINO + "cls_token")[-1], num_hidden_layers=depth(DINO),
                     intermediate_size=shape(DINO + "blocks.0.mlp.fc1.weight")[0]),
        "siglip": dict(hidden_size=shape(SIGLIP + "pos_embed")[-1],
                       num_hidden_layers=depth(SIGLIP),
                       intermediate_size=shape(SIGLIP + "blocks.0.mlp.fc1.weight")[0]),
        "llm": dict(hidden_size=embed[1], vocab_size=embed[0],
                    intermediate_size=shape("language_model.model.layers.0.mlp.gate_proj.weight")[0],
                    num_hidden_layers=1 + max(int(k.split(".")[3]) for k in shapes
                                              if k.startswith("language_model.model.layers.")),
                    num_attention_heads=heads,
                    num_key_value_heads=text.get("num_key_value_heads", heads),
                    rms_norm_eps=text.get("rms_norm_eps", 1e-6),
                    rope_theta=text.get("rope_theta", 10000.0),
                    max_position_embeddings=text.get("max_position_embeddings", 2048)),
    }


def _component_file(folder, name: str) -> Path | None:
    found = sorted(p for p in Path(folder).glob("*.pt")
                   if name in p.name and "checkpoint" in p.name)
    if len(found) > 1:
        raise ValueError(f"{folder}: {len(found)} {name} files {[p.name for p in found]}; "
                         "OFT reads one")
    return found[0] if found else None


def proprio_file(folder) -> Path | None:
    """OFT's proprio projector checkpoint (`*proprio_projector*checkpoint*.pt`), if any."""
    return _component_file(folder, "proprio_projector")


def proprio_dim(folder) -> int:
    """The state width OFT's proprio projector reads (its fc1's input), 0 without one."""
    file = proprio_file(folder)
    weights = {} if file is None else torch.load(file, map_location="cpu", weights_only=True)
    return next((int(v.shape[1]) for k, v in weights.items() if k.endswith("fc1.weight")), 0)


def head_file(folder) -> Path | None:
    """OFT's L1-regression action head checkpoint (`action_head--*checkpoint*.pt`), if any
    (a diffusion head comes with a noisy_action_projector file: recipe_problems)."""
    return _component_file(folder, "action_head--")


# the modules OFT keeps in .pt files of their own: our name prefix -> its file in a folder
COMPONENTS = {"proprio_projector.": proprio_file, "action_head.": head_file}
OWN_FILES = tuple(COMPONENTS)


def read_statistics(folder, unnorm_key: str = "") -> tuple[str, dict]:
    """`dataset_statistics.json`'s entry for `unnorm_key` (may be empty when it holds one)."""
    path = Path(folder) / STATISTICS
    if not path.is_file():
        raise ValueError(f"{folder}: {STATISTICS} is missing (OFT's fine-tuning writes it "
                         "beside the weights; it holds the action and proprio statistics)")
    stats = json.loads(path.read_text())
    if not unnorm_key:
        if len(stats) != 1:
            raise ValueError(f"{path} holds {sorted(stats)}: set policy.unnorm_key to one")
        unnorm_key = next(iter(stats))
    if unnorm_key not in stats and unnorm_key + "_no_noops" in stats:
        unnorm_key += "_no_noops"  # as OFT's and RLinf's evaluation scripts append it
    if unnorm_key not in stats:
        raise ValueError(f"{path}: no statistics for unnorm_key {unnorm_key!r}; it has "
                         f"{sorted(stats)}")
    entry = stats[unnorm_key]
    if "action" not in entry:
        raise ValueError(f"{path}: {unnorm_key} has no action statistics")
    return unnorm_key, entry


def load_published(policy, folder) -> list[str]:
    """Load an OFT folder into `policy`, strictly; returns the tensors left fresh (its RL heads)."""
    folder = Path(folder)
    tensors = {k: v for k, v in read_tensors(folder).items() if not k.startswith(UNUSED)}
    embedded = [k for k in tensors if k.startswith(OWN_FILES)]  # RLinf's, beside their files
    tensors = {k: v for k, v in tensors.items() if k not in embedded}  # (read from the files)
    state = policy.state_dict()
    meta = {k: torch.empty(v.shape, device="meta") for k, v in state.items()}
    expected = {k: tuple(v.shape) for k, v in to_published(meta).items()}
    optional = [k for k in expected if k.startswith("value_head.")]
    problems = [f"missing {k} {expected[k]}" for k in expected
                if k not in tensors and k not in optional]
    problems += [f"unexpected {k}" for k in tensors if k not in expected]
    problems += [f"misshaped {k}: file {tuple(v.shape)}, model {expected[k]}"
                 for k, v in tensors.items() if k in expected and tuple(v.shape) != expected[k]]
    lacking = {"proprio_projector.": "the proprio projector (*proprio_projector*checkpoint*"
               ".pt) for the env's state", "action_head.": "the L1 head (action_head--*.pt)"}
    for prefix, find in COMPONENTS.items():
        file = find(folder)
        if file is None and any(k.startswith(prefix) for k in embedded):
            problems.append(f"{prefix}* in the shards without {lacking[prefix]} (RLinf writes "
                            "it beside them)")
        if not any(k.startswith(prefix) for k in state):  # the policy has no such module
            continue
        if file is None:
            problems.append(f"missing {lacking[prefix]}")
            continue
        theirs = {k.removeprefix("module."): v for k, v in  # OFT's load_component_state_dict
                  torch.load(file, map_location="cpu", weights_only=True).items()}
        ours = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        problems += [f"{file.name}: missing {k}" for k in ours if k not in theirs]
        problems += [f"{file.name}: unexpected {k}" for k in theirs if k not in ours]
        problems += [f"{file.name}: misshaped {k}: file {tuple(v.shape)}, model "
                     f"{tuple(ours[k].shape)}" for k, v in theirs.items()
                     if k in ours and v.shape != ours[k].shape]
        tensors.update({prefix + k: v for k, v in theirs.items()})
    if problems:
        raise ValueError(f"{folder}: {len(problems)} tensor(s) do not fit the oft policy: "
                         + "; ".join(problems))
    own = {k: tensors.pop(k) for k in list(tensors) if k.startswith(OWN_FILES)}
    loaded = {**from_published(tensors), **own}
    with torch.no_grad():
        for key, value in loaded.items():
            state[key].copy_(value)
    return [k for k in state if k not in loaded]


def load_value_head(policy, file) -> None:
    """RLinf's value head (`value_head.mlp.{0,2,4}.*`, a safetensors file) into `policy`."""
    from safetensors.torch import load_file

    tensors = load_file(str(file))
    state = policy.state_dict()
    ours = {_rename(k, _THEIRS): v for k, v in tensors.items()}
    wanted = {k for k in state if k.startswith("value_head.")}
    if set(ours) != wanted or any(state[k].shape != v.shape for k, v in ours.items()):
        raise ValueError(f"{file}: value head tensors {sorted(tensors)} do not fit "
                         f"{sorted(wanted)} with their shapes")
    with torch.no_grad():
        for key, value in ours.items():
            state[key].copy_(value)


def load_tokenizer(folder):
    """The checkpoint's Llama tokenizer, without running the folder's custom code; one that
    cannot be loaded raises ValueError naming the folder."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "model of type openvla": config.json is not a tokenizer's
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False,
                                             local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers and tokenizers raise many kinds
        raise ValueError(f"{folder}: a Llama tokenizer transformers can load "
                         f"({type(err).__name__}: {err})") from None
    finally:
        logging.set_verbosity(verbosity)


__all__ = ["to_published", "published_files", "from_published", "folder_dims", "load_published",
           "load_value_head", "read_statistics", "proprio_file", "head_file", "proprio_dim",
           "load_tokenizer", "UNUSED"]
