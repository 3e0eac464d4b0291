"""Checks of the config that involve several fields (`Config.check`, run by the loader):
each problem is (field, value, what would be valid), reported together before any rank starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcvla.config.schema import ROLES

def cross_field_problems(cfg) -> list[tuple[str, Any, str]]:
    """Cross-field problems of `cfg` as (field, value, what would be valid); empty when fine."""
    problems = []
    per_node = cfg.placement.per_node
    unknown = sorted(set(per_node) - set(ROLES))
    if unknown:
        problems.append(("placement.per_node", per_node,
                         f"keys among {', '.join(ROLES)} (got {', '.join(unknown)})"))
    for role, count in per_node.items():
        if role in ROLES and count < 0:
            problems.append((f"placement.per_node.{role}", count, "a count >= 0"))
    if cfg.learner.backend == "horovod":
        import torch

        from hpcvla.policies.vla import resolve_dtype
        from hpcvla.roles.horovod_engine import horovod_available
        missing = horovod_available()
        if missing:
            problems.append(("learner.backend", "horovod", f"deepspeed, or Horovod installed: "
                             f"{missing}"))
        if cfg.policy.name != "default" and resolve_dtype(cfg.policy.dtype) != torch.float32:
            problems.append(("policy.dtype", cfg.policy.dtype, "float32 with "
                             "learner.backend=horovod (no fp32 masters for bf16 weights)"))
    if cfg.placement.learner_nodes and cfg.placement.mode != "disaggregated":
        problems.append(("placement.learner_nodes", cfg.placement.learner_nodes,
                         "0 unless placement.mode is disaggregated"))
    if cfg.run.resume:
        from hpcvla.checkpoint import CheckpointError, latest, read_state
        path = latest(cfg.run.resume)
        try:
            version = read_state(path)["version"] if path else None
        except CheckpointError as err:
            problems.append(("run.resume", cfg.run.resume, f"a readable checkpoint: {err}"))
            version = -1
        if version is None:
            problems.append(("run.resume", cfg.run.resume, "a run directory holding a "
                             "complete checkpoint (checkpoints/v*/state.json)"))
        elif version >= cfg.pipeline.total_updates:
            problems.append(("pipeline.total_updates", cfg.pipeline.total_updates,
                             f"more than the resumed checkpoint's version {version}"))
    if cfg.policy.pretrained:
        if cfg.policy.name == "default":
            problems.append(("policy.pretrained", cfg.policy.pretrained,
                             "empty for policy.name=default (only flow/tokens/oft load folders)"))
        elif not any((Path(cfg.policy.pretrained) / name).is_file()
                     for name in ("model.safetensors", "model.safetensors.index.json")):
            problems.append(("policy.pretrained", cfg.policy.pretrained,
                             "a folder holding model.safetensors (or a sharded "
                             "model.safetensors.index.json)"))
        elif cfg.policy.name == "oft":  # OFT's folder: config, statistics, tokenizer
            from hpcvla.policies.oft_checkpoint import check_folder
            from hpcvla.policies.processor import is_hpcvla_folder
            if not is_hpcvla_folder(cfg.policy.pretrained):
                problems += check_folder(cfg.policy.pretrained, cfg.policy.tokenizer,
                                         cfg.policy.unnorm_key)
        else:  # a published folder: its tokenizer and normalization statistics
            from hpcvla.policies.processor import check_folder
            problems += check_folder(cfg.policy.pretrained, cfg.policy.tokenizer)
    elif cfg.policy.tokenizer:
        problems.append(("policy.tokenizer", cfg.policy.tokenizer, "empty without "
                         "policy.pretrained (built-in policies read the env's instruction ids)"))
    if cfg.algorithm.name == "grpo" and \
            cfg.rollout.segment_len != cfg.env.max_episode_chunks:
        problems.append(("rollout.segment_len", cfg.rollout.segment_len,
                         f"env.max_episode_chunks ({cfg.env.max_episode_chunks}) for "
                         "algorithm.name=grpo: a segment holds one grouped episode per env"))
    if cfg.env.envs_per_simulator % cfg.env.shards:
        problems.append(("env.shards", cfg.env.shards,
                         f"a divisor of env.envs_per_simulator ({cfg.env.envs_per_simulator})"))
    if cfg.env.sim_backend == "gpu" and cfg.env.name != "maniskill":
        problems.append(("env.sim_backend", cfg.env.sim_backend,
                         f"cpu for env.name={cfg.env.name}: only maniskill has a GPU "
                         "simulation (set env.sim_backend=cpu, or env.name=maniskill)"))
    return problems
