"""Whether the configured policy takes the weights a run is given, before any rank starts:
a published folder (policy.pretrained: its family judges it; another family's folder is
named), a checkpoint it starts from (policy.checkpoint) or resumes (run.resume), against the
names and shapes of a meta-device build, and a published folder against the env's dims.
Each problem is (field, value, what would be valid), as preflight.py reports them."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpcvla.config import ConfigError


def weights_fit_problems(cfg) -> list[tuple[str, Any, str]]:
    """The weights a run resumes (run.resume: exactly) or starts from (policy.checkpoint: its
    RL heads may be absent; policy.pretrained: the folder, before LoRA's adapters) against
    the configured policy's names and shapes, from headers and a meta-device build, as the
    ranks will load them: a checkpoint of another policy config, a folder with tensors the
    policy lacks (another framework's RL heads), an override that changes the policy."""
    from hpcvla.checkpoint.catalog import latest
    asked = [(name, value, latest(value)) for name, value in
             (("run.resume", cfg.run.resume), ("policy.checkpoint", cfg.policy.checkpoint))
             if value]
    asked = [(name, value, path) for name, value, path in asked if path is not None]
    if not asked and not cfg.policy.pretrained:  # none, or file_problems names them
        return []
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    from hpcvla.policies.folders import fit_problem
    spec = env_spec(cfg.env)
    problems, bare = [], None
    if cfg.policy.pretrained:  # loaded before the adapters go on
        bare = build_policy(replace(cfg, policy=replace(cfg.policy, lora_rank=0)), spec,
                            device="meta")
        why = fit_problem(bare, cfg.policy.pretrained)
        problems += [("policy.pretrained", cfg.policy.pretrained, "weights the configured "
                      f"policy takes: {why}")] if why else []
    if asked:  # the build above, unless adapters go on (a full-size one takes seconds):
        policy = bare if bare is not None and not cfg.policy.lora_rank else build_policy(
            cfg, spec, device="meta")
        problems += [(name, value, _written_by(cfg, path) + problem)
                     for name, value, path in asked if (problem := checkpoint_fit_problem(
                         policy, path, name == "policy.checkpoint"))]
    return problems


def _written_by(cfg, checkpoint: Path) -> str:
    """Where a checkpoint that does not fit comes from another policy family than the
    config's, as its run's record says: said first ('' where the families agree)."""
    import yaml

    from hpcvla.checkpoint.catalog import run_and_checkpoint
    from hpcvla.config.loader import last_run_config
    record = last_run_config(run_and_checkpoint(checkpoint)[0])
    try:
        name = (yaml.safe_load(record.read_text()) or {}).get("policy", {}).get("name") \
            if record else None
    except (OSError, yaml.YAMLError, AttributeError):
        return ""
    return (f"a checkpoint of policy.name={cfg.policy.name} (its run trained "
            f"policy.name={name}, this config has {cfg.policy.name}); in detail: "
            if name and name != cfg.policy.name else "")


def checkpoint_fit_problem(policy, checkpoint: Path, heads_may_lack: bool = False) -> str:
    """Whether the checkpoint's weights fit `policy` (a meta-device build), from the file's
    header, as the ranks will load them: exactly, or (`heads_may_lack`, a run's start) with
    RL heads absent; '' if they do."""
    import torch

    from hpcvla.checkpoint.catalog import MODEL
    from hpcvla.checkpoint.store import check_fit
    from hpcvla.policies.folders import rl_only_names, tensor_shapes
    try:
        held = {k: torch.empty(s, device="meta")
                for k, s in tensor_shapes(checkpoint / MODEL).items()}
        check_fit(held, policy.state_dict(), checkpoint / MODEL,
                  rl_only_names(policy) if heads_may_lack else frozenset())
    except ValueError as err:  # an unreadable header, or a CheckpointError of the fit
        return (f"weights the configured policy takes (policy.*, env.* and algorithm.* shape "
                f"it), or an undamaged file (its sha256 is checked as it loads): {err}")
    return ""


def pretrained_problems(policy, env) -> list[tuple[str, Any, str]]:
    """A pretrained folder's weights, its tokenizer and statistics, and (oft) whether the
    configured env and policy run it as it was trained."""
    from hpcvla.policies.folders import (config_json, foreign_layout, is_hpcvla_folder,
                                         own_folder_problems, tensor_shapes)
    from hpcvla.policies.registry import POLICIES
    folder, layout = policy.pretrained, foreign_layout(policy.pretrained)
    if not any((Path(folder) / name).is_file()
               for name in ("model.safetensors", "model.safetensors.index.json")):
        where = Path(folder)
        found = "" if where.is_dir() else "; it is a file" if where.exists() else \
            "; nothing is there"
        if not where.exists() and re.fullmatch(r"\w[\w.-]*/[\w.-]+", str(folder)):
            found += (f" ({folder} looks like a Hugging Face hub id: the ranks read folders, and "
                      "compute nodes often reach no internet; download it once on a login "
                      f"node, `hf download {folder} --local-dir <folder>` (`huggingface-cli "
                      "download` before huggingface_hub 0.34), and give that folder)")
        elif not where.exists() and not where.is_absolute():  # a recipe's, run from elsewhere
            found += f" (a path from the current folder, {Path.cwd()})"
        return [("policy.pretrained", folder, "a folder holding model.safetensors (or a "
                 "sharded model.safetensors.index.json)" + (f", not {layout}" if layout else "")
                 + found)]
    try:  # every weight file's header (a sharded index's every shard), and config.json
        names = tensor_shapes(folder)
        ours = is_hpcvla_folder(folder)
    except (OSError, ValueError) as err:  # e.g. RLinf's adapter beside its base's index
        return [("policy.pretrained", folder, f"a folder whose files can be read: {err}"
                 + (f"; it holds {layout}" if layout else ""))]
    if ours:  # written by save_pretrained (e.g. `hpcvla sft`'s policy/)
        saved = config_json(folder)["hpcvla_policy"]
        if saved != policy.name:
            return [("policy.name", policy.name, f"{saved}: the family {folder} was saved from")]
        problems = own_folder_problems(policy, folder)  # its config.json says all
    elif (other := next((name for name, cls in POLICIES.items() if name != policy.name and
                         cls.published_tensor and any(k.endswith(cls.published_tensor)
                                                      for k in names)), None)):
        return [("policy.name", policy.name, f"{other}: {folder} is a published {other} "
                 f"folder (its tensors say so), which policy.name={other} reads")]
    else:  # a published folder: its family judges it
        problems = POLICIES[policy.name].folder_problems(folder, policy, env)
    return problems or _head_problems(policy)


def check_pretrained(cfg, source: str = "config") -> None:
    """pretrained_problems as a ConfigError, for commands that read policy.pretrained without
    the whole check (`hpcvla plan` sizes the policy from its headers)."""
    problems = pretrained_problems(cfg.policy, cfg.env) if cfg.policy.pretrained else []
    if problems:
        raise ConfigError(problems, source)


def _head_problems(policy) -> list[tuple[str, Any, str]]:
    """policy.action_head against the head the folder holds (a folder's head is its own)."""
    if not policy.action_head:
        return []
    from hpcvla.policies.folders import checkpoint_kwargs
    from hpcvla.policies.registry import POLICIES
    held = checkpoint_kwargs(POLICIES[policy.name], policy.pretrained).get("action_head")
    return [] if held in (None, policy.action_head) else [
        ("policy.action_head", policy.action_head, f"{held} (the head {policy.pretrained} "
         "holds) or empty")]


def pretrained_env_problems(cfg) -> list[tuple[str, Any, str]]:
    """A published π0/π0.5 folder against the configured env's state and action dims
    (processor.dims_problems). Builds the env's probe, so the launching process runs it, not
    the ranks (whose simulators must not load before their device is bound); a rank
    building the policy refuses the same mismatch."""
    if not cfg.policy.pretrained:
        return []
    from hpcvla.policies.folders import is_hpcvla_folder
    if is_hpcvla_folder(cfg.policy.pretrained):
        return []
    from hpcvla.envs import env_spec
    from hpcvla.policies.registry import POLICIES
    return [("env", cfg.env.name, f"an env {cfg.policy.pretrained} fits: {problem}")
            for problem in POLICIES[cfg.policy.name].env_fit_problems(
                cfg.policy, lambda: env_spec(cfg.env))]
