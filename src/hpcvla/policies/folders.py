"""Hugging Face-style checkpoint folders of the VLA policies, in the layouts they are published in.

    save_pretrained(policy, folder)      # config.json + model.safetensors (HF names)
    load_pretrained(folder)              # rebuild from config.json, load exactly (registry.py)
    load_weights(policy, folder_or_file) # load into an existing policy, strictly
    read_tensors(folder_or_file)         # the tensors of a folder, sharded or not
    checkpoint_kwargs(policy_cls, folder)  # what the family reads from the checkpoint

Names: each family maps its module names to the checkpoint names of the model it follows
(`HF_KEY_MAP`, e.g. LeRobot's π0 for the flow family); the RL heads have `rl.*` names. What a
published folder holds besides that, and how it is read:

* Sharded weights: `model.safetensors.index.json` (transformers' `weight_map`) and its shard
  files, read as one dict; a plain `model.safetensors` otherwise.
* Layout variants (`HF_LAYOUT` of the family): a `root` every key of the reference layout
  starts with, which some writers leave out (openpi's converted PyTorch π0 files have no
  `model.` prefix): added back when no key has it. `tied` pairs (target, source) whose target
  the writer may have dropped because the model ties it to the source (π0's hub files keep
  PaliGemma's `lm_head` and drop the tied `embed_tokens`): the target is then taken from the
  source. When both are there the target is kept and the source, which this model has no
  module for, dropped: a fine-tune may have trained them apart (LeRobot saves both, and its
  training moves only `embed_tokens`, the one π0 computes with; its reload reads that one).
  `unused`: tensors of the reference this model does not have by design (the action
  expert's `lm_head`), dropped.

Everything else is strict: a tensor missing, unexpected or misshaped is named in the error,
except the RL heads (`rl.*`), which a checkpoint trained by imitation does not have; they keep
their initial values.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

RL_HEAD_PREFIX = "rl."  # checkpoint names of the RL-only tensors (may be absent)
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


_CONVERT_JAX = ("convert it with openpi's `examples/convert_jax_model_to_pytorch.py "
                "--checkpoint_dir <it> --config_name <its openpi config, e.g. pi0_libero> "
                "--output_path <new folder>`, copy its assets/ (norm_stats.json) into the new "
                "folder, and set policy.pretrained=<new folder>")
# The references' other layouts: the files that mark them (globs, first match wins), what
# they are, and the step that makes the weights folder this project reads of them.
FOREIGN_LAYOUTS = (
    (("adapter_config.json",), "a LoRA/PEFT adapter without its base weights (LeRobot's "
     "use_peft, a PEFT save)", "merge it into its base model (peft's PeftModel."
     "from_pretrained(base, <it>).merge_and_unload(), then save_pretrained) and point "
     "policy.pretrained at the merged folder"),
    (("lora_adapter/adapter_config.json",), "OpenVLA-OFT's run folder of a LoRA fine-tune "
     "not merged during training", "merge lora_adapter/ into the base with OFT's "
     "vla-scripts/merge_lora_weights_and_save.py and point policy.pretrained at the result"),
    (("pretrained_model/config.json",), "LeRobot's checkpoint folder",
     "point policy.pretrained at its pretrained_model/"),
    (("*.distcp", "pytorch_model_fsdp_0/*.distcp"), "LeRobot's sharded (DCP) checkpoint",
     "write its model.safetensors with `lerobot-convert-dcp`"),
    (("full_weights.pt", "model_state_dict/full_weights.pt",
      "actor/model_state_dict/full_weights.pt"), "RLinf's raw checkpoint", "`python -m "
     "rlinf.utils.ckpt_convertor.fsdp_convertor.convert_pt_to_hf` writes its Hugging Face "
     "folder"),
    (("pytorch_model.bin", "pytorch_model-*.bin"), "pickled PyTorch weights", "save them as "
     "safetensors (transformers' save_pretrained(<folder>, safe_serialization=True))"),
    (("params/_METADATA", "_CHECKPOINT_METADATA", "_METADATA"), "an openpi JAX (orbax) "
     "checkpoint", _CONVERT_JAX),
    (("*/params/_METADATA",), "openpi's folder of JAX (orbax) step checkpoints",
     "choose a step's folder and " + _CONVERT_JAX),
)


def foreign_layout(folder) -> str | None:
    """What a folder holding none of this project's weight layouts holds instead, and how to
    make one of it (FOREIGN_LAYOUTS); None when no reference's layout is recognised."""
    folder = Path(folder)
    return next((f"{what}: {fix}" for globs, what, fix in FOREIGN_LAYOUTS
                 if any(next(folder.glob(pattern), None) for pattern in globs)), None)


def _files(path) -> tuple[list[Path], dict | None]:
    """The safetensors files of a checkpoint, and its index's weight_map when sharded."""
    path = Path(path)
    if path.is_file():
        return [path], None
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text()).get("weight_map")
        except (ValueError, AttributeError) as err:  # not JSON, or not a JSON object
            raise ValueError(f"{path / INDEX}: not a valid index ({err})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path / INDEX}: no `weight_map` (tensor name -> shard file)")
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise ValueError(f"{path / INDEX} names shard {shard}, which is missing")
        return [path / shard for shard in sorted(set(weight_map.values()))], weight_map
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS], None
    raise ValueError(f"{path}: neither {WEIGHTS} nor {INDEX} (a checkpoint folder holds one)")


def read_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint: a safetensors file, or a folder holding
    `model.safetensors` or a sharded `model.safetensors.index.json`."""
    from safetensors.torch import load_file

    files, weight_map = _files(path)
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    missing = sorted(set(weight_map or ()) - set(tensors))
    if missing:
        raise ValueError(f"{Path(path) / INDEX}: {len(missing)} tensor(s) of the weight_map "
                         f"are in no shard, e.g. {missing[0]}")
    return tensors


def tensor_shapes(path) -> dict[str, tuple]:
    """Names and shapes of a checkpoint's tensors (file or folder), from the files' headers
    only; a header that cannot be read raises ValueError naming its file."""
    from safetensors import SafetensorError, safe_open

    shapes = {}
    for file in _files(path)[0]:
        try:
            with safe_open(str(file), "pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        except SafetensorError as err:
            raise ValueError(f"{file}: not a readable safetensors file ({err})") from None
    return shapes


def config_json(folder) -> dict:
    """A folder's config.json, {} where it has none; ValueError naming the file where it is
    not a JSON object (a syntax error, bytes that are not UTF-8, a list or a number)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object (it holds a {type(config).__name__})")
    return config


def is_hpcvla_folder(folder) -> bool:
    """Whether `folder` was written by hpcvla (save_pretrained), not published by a reference."""
    return "hpcvla_policy" in config_json(folder)


# How a folder hpcvla wrote was trained to see its inputs: a config must not say otherwise
# (it may leave it to the folder: 0, factory.FOLDERS_OR)
FIXED_BY_FOLDER = ("center_crop",)


def own_folder_problems(policy_cfg, folder) -> list[tuple[str, object, str]]:
    """What the config says of a folder hpcvla wrote that it cannot act on (a recipe setting,
    FOLDER_RECIPE_UNSET: such a folder reads the env's fields as they are; FIXED_BY_FOLDER
    against its config.json's kwargs), as config problems."""
    from hpcvla.config.families import FOLDER_RECIPE_UNSET
    saved = config_json(folder).get("kwargs", {})
    problems: list[tuple[str, object, str]] = [
        (f"policy.{name}", getattr(policy_cfg, name), f"{unset} for a folder hpcvla wrote "
         "(its config.json says how it acts)") for name, unset in FOLDER_RECIPE_UNSET.items()
        if getattr(policy_cfg, name) != unset]
    return problems + [(f"policy.{name}", getattr(policy_cfg, name), f"{saved[name]!r}, what "
                        f"{folder} was trained with") for name in FIXED_BY_FOLDER
                       if name in saved and getattr(policy_cfg, name) not in (0, saved[name])]


def checkpoint_kwargs(policy_cls, path) -> dict:
    """The constructor arguments a family reads from a checkpoint (`checkpoint_kwargs`, e.g.
    π0's variant, padded action and state dims and horizon), from the files' headers only."""
    if policy_cls.folder_kwargs is not None:  # a family that reads its reference's folder
        return policy_cls.folder_kwargs(path)
    if policy_cls.checkpoint_kwargs is None:
        return {}
    shapes = from_layout(tensor_shapes(path), {"root": policy_cls.HF_LAYOUT.get("root", "")})
    return policy_cls.checkpoint_kwargs(shapes, config_json(path))


def from_layout(tensors: dict[str, torch.Tensor], layout: dict) -> dict:
    """`tensors` in the reference layout (`HF_LAYOUT`, module docstring): root prefix added
    back, tied tensors filled in, unused ones dropped."""
    root = layout.get("root", "")
    if root and tensors and not any(k.startswith(root) for k in tensors):
        tensors = {k if k.startswith(RL_HEAD_PREFIX) else root + k: v
                   for k, v in tensors.items()}
    tensors = dict(tensors)
    for target, source in layout.get("tied", ()):
        if source in tensors:
            tensors.setdefault(target, tensors[source])
            del tensors[source]
    for name in layout.get("unused", ()):
        tensors.pop(name, None)
    return tensors


def rl_only_names(policy) -> set[str]:
    """The policy's RL-only tensors (`rl.*` checkpoint names: value heads, DSRL's noise actor,
    critics and temperature), which a checkpoint may lack: they keep their initial values."""
    return {k for k in policy.state_dict() if policy.to_hf_key(k).startswith(RL_HEAD_PREFIX)}


def load_weights(policy, path) -> list[str]:
    """Load a checkpoint (file or folder, module docstring) into `policy`, exactly. Raises
    naming every missing, unexpected or misshaped tensor; returns the RL-head names that were
    absent (kept at their initial values). A family whose published folders need more than
    renaming (`load_published`, e.g. oft's timm towers) reads them itself."""
    if policy.load_published is not None and Path(path).is_dir() and not \
            is_hpcvla_folder(path):
        return policy.load_published(path)
    loaded = _as_model(policy, read_tensors(path))
    problems, fresh = _fit(policy, loaded)
    if problems:
        raise ValueError(f"{path}: {len(problems)} tensor(s) do not fit the "
                         f"{policy.family} policy: " + "; ".join(problems))
    state = policy.state_dict()
    with torch.no_grad():
        for k, v in loaded.items():
            state[k].copy_(v)
    return fresh


def fit_problem(policy, path) -> str:
    """What load_weights would refuse of the checkpoint `path` for `policy` (a meta-device
    build will do), from the files' headers only; '' if it fits (or the family reads its
    published folders itself)."""
    if policy.load_published is not None and Path(path).is_dir() and not \
            is_hpcvla_folder(path):
        return ""
    held = {k: torch.empty(s, device="meta") for k, s in tensor_shapes(path).items()}
    problems = _fit(policy, _as_model(policy, held))[0]
    hint = " (tensors it has no module for, such as another framework's RL heads, e.g. " \
        "RLinf's value_head and noise_head: save the folder without them)" \
        if any(p.startswith("unexpected") for p in problems) else ""
    return f"{len(problems)} tensor(s) do not fit the {policy.family} policy: " + \
        "; ".join(problems) + hint if problems else ""


def _as_model(policy, tensors: dict) -> dict:
    """A checkpoint's tensors under `policy`'s module names (its layout and key map)."""
    return {policy.from_hf_key(k): v for k, v in from_layout(tensors, policy.HF_LAYOUT).items()}


def _fit(policy, loaded: dict) -> tuple[list[str], list[str]]:
    """`loaded` against `policy`'s state: the problems (tensors missing, unexpected or
    misshaped, by checkpoint name) and the RL-head names it lacks (kept fresh)."""
    state = policy.state_dict()
    missing = [k for k in state if k not in loaded]
    rl_only = rl_only_names(policy)
    fresh = [k for k in missing if k in rl_only]
    problems = [f"missing {policy.to_hf_key(k)} {tuple(state[k].shape)}"
                for k in missing if k not in fresh]
    problems += [f"unexpected {policy.to_hf_key(k)}" for k in loaded if k not in state]
    problems += [f"misshaped {policy.to_hf_key(k)}: file {tuple(v.shape)}, model "
                 f"{tuple(state[k].shape)}" for k, v in loaded.items()
                 if k in state and v.shape != state[k].shape]
    return problems, fresh


def save_pretrained(policy, folder, state: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (HF names) of `policy`, with the weights
    `state` (its own state_dict by default; the gathered full state of a ZeRO-3 learner,
    whose parameters are shards); returns the folder."""
    from hpcvla.checkpoint.store import save_file  # the umask's mode, not 0600

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = policy.state_dict() if state is None else state
    tensors = {policy.to_hf_key(k): v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt", "hpcvla_policy": policy.family})
    (folder / "config.json").write_text(json.dumps(policy.config_json(), indent=1))
    return folder


__all__ = ["RL_HEAD_PREFIX", "read_tensors", "tensor_shapes", "is_hpcvla_folder",
           "checkpoint_kwargs", "from_layout", "rl_only_names", "load_weights",
           "save_pretrained"]
