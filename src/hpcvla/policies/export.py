"""A trained policy written back in the layout of the published folder it started from, so that
the reference's own loader reads it (LeRobot's `from_pretrained`, openpi's converted PyTorch
files, OpenVLA-OFT's): RL post-training hands the policy back to the tools that deploy it.

    save_like(policy, source, out)   # `hpcvla export RUN_DIR FOLDER` of a run from a folder

What `out` receives:

* every file of `source` that holds no weights, byte for byte: config.json, LeRobot's
  processor pipelines and their normalization statistics, openpi's norm_stats.json, OFT's
  dataset_statistics.json, the tokenizer. They say how observations and actions are
  normalized and prompted, which RL does not change;
* the weight files under the source's names: the same files (a sharded index copied as it is),
  the same tensor names, dtypes and safetensors metadata in each. A tensor is the policy's
  (cast to the file's dtype) where the policy has it under that name, after the layout
  variants the loader undoes (folders.from_layout: a missing root prefix, the kept source of a
  tied pair); else, where the model has none by design (the `unused` tensors, the untrained
  twin of a tied pair a writer kept both of, OFT's SigLIP pooling head), the source's own;
* the family's other weight files (OFT's proprio projector and L1 action head .pt), in the
  source's key format.

The RL heads (value head, critics, exploration std: `rl.*` names) are written only where the
source has places for them (an RLinf OFT checkpoint's value head); the reference's own layouts
have none, and `--format hpcvla` (folders.save_pretrained) keeps them all. A policy tensor that
is neither written nor an RL head means the source does not hold this policy: refused, by
name.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from hpcvla.policies.folders import RL_HEAD_PREFIX, _files, is_hpcvla_folder, rl_only_names


def is_published(folder) -> bool:
    """Whether `folder` is a published model's folder (not one hpcvla wrote)."""
    return Path(folder).is_dir() and not is_hpcvla_folder(folder)


def _source_names(published: dict, source_keys: set, layout: dict) -> dict:
    """The published names (the reference's layout) as the source folder spells them: the
    inverse of folders.from_layout for that folder."""
    root = layout.get("root", "")
    tied = list(layout.get("tied", ()))
    if root and not any(k.startswith(root) for k in source_keys):
        published = {k if k.startswith(RL_HEAD_PREFIX) else k.removeprefix(root): v
                     for k, v in published.items()}
        tied = [(t.removeprefix(root), s.removeprefix(root)) for t, s in tied]
    for target, kept in tied:  # the writer dropped the target and kept its twin
        if target in published and target not in source_keys and kept in source_keys:
            published[kept] = published.pop(target)
    return published


def save_like(policy, source, out, state: dict | None = None) -> dict:
    """Write `policy` (its weights `state`, its own state_dict by default) into `out` in the
    layout of the published folder `source` (module docstring). Returns counts: tensors
    written from the policy, kept from the source, and the RL heads left out."""
    from safetensors import safe_open
    from hpcvla.checkpoint.store import save_file  # the umask's mode, not 0600

    source, out = Path(source).resolve(), Path(out)
    if out.resolve() == source or source in out.resolve().parents:
        raise ValueError(f"{out}: inside the source folder {source}; write elsewhere")
    state = policy.state_dict() if state is None else state
    tensors, other_files = policy.published_tensors(state, source)
    rl_heads = rl_only_names(policy)
    heads, _ = policy.published_tensors(
        {k: v for k, v in state.items() if k not in rl_heads}, source)
    rl_names = set(tensors) - set(heads)
    files, _ = _files(source)
    keys = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            keys[file.name] = list(f.keys())
    source_keys = {k for names in keys.values() for k in names}
    tensors = _source_names(tensors, source_keys, policy.HF_LAYOUT)
    homeless = sorted(k for k in tensors if k not in source_keys and k not in rl_names)
    if homeless:
        raise ValueError(f"{source}: no place for {len(homeless)} of the policy's tensor(s), "
                         f"e.g. {homeless[0]}: it is not the folder this policy was built from")
    out.mkdir(parents=True, exist_ok=True)
    weight_files = {f.name for f in files} | set(other_files)
    for item in sorted(source.rglob("*")):
        relative = item.relative_to(source)
        if item.is_file() and str(relative) not in weight_files:
            (out / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(item, out / relative)
    ours = kept = 0
    for file in files:
        with safe_open(str(file), "pt") as f:
            written = {}
            for name in keys[file.name]:
                theirs = f.get_slice(name)
                if name in tensors:
                    written[name] = tensors[name].detach().to(
                        "cpu", _dtype(theirs.get_dtype())).contiguous()
                    ours += 1
                else:
                    written[name] = f.get_tensor(name)
                    kept += 1
            save_file(written, out / file.name, metadata=f.metadata())
    for name, file_state in other_files.items():
        torch.save(file_state, out / name)
    # the RL-head tensors of the policy, less those the source had places for (RLinf's OFT
    # value head) and the export filled
    left_out = len(rl_heads) - len(rl_names & set(tensors) & source_keys)
    return {"from_policy": ours, "from_source": kept, "rl_heads_left_out": left_out,
            "other_files": sorted(other_files)}


DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}  # safetensors' names


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"a tensor of dtype {name} in the source folder: export writes "
                         f"{', '.join(DTYPES)}; use --format hpcvla")
    return DTYPES[name]


__all__ = ["is_published", "save_like"]
