"""Checks of the settings that involve several fields, run by the loader: each problem is
(field, value, what would be valid), reported together before any rank starts. They read the
settings alone; what a config needs of the machine (packages, files, devices) is checked by
preflight.py."""

from __future__ import annotations

import difflib
import math
import re
from typing import Any

from hpcvla.config.families import (ALGORITHMS, EE_DELTA_CONTROL, FAMILIES,
                                    FOLDER_RECIPE_UNSET, SIMULATORS, LOG_STD_BOUNDS,
                                    family, having, readers_of, simulator,
                                    unread_settings)
from hpcvla.config.imitation import dataset_features
from hpcvla.config.learning import ENCODED_FIELDS, noise_obs_fields
from hpcvla.config.schema import PLACEMENT_MODES, ROLES
from hpcvla.schedule import MODE_TRAITS, shards_of, shards_problem


def cross_field_problems(cfg) -> list[tuple[str, Any, str]]:
    """Cross-field problems of `cfg` as (field, value, what would be valid); empty when fine."""
    problems = []
    vla, sim = family(cfg.policy.name).vla, simulator(cfg.env.name)
    per_node = cfg.placement.per_node
    unknown = sorted(set(per_node) - set(ROLES))
    if unknown:
        close = [f"`{c[0]}`" for u in unknown if (c := difflib.get_close_matches(u, ROLES, 1))]
        problems.append(("placement.per_node", per_node,
                         f"keys among {', '.join(ROLES)} (got {', '.join(unknown)}"
                         + (f"; did you mean {', '.join(close)}?)" if close else ")")))
    if not cfg.run.name or cfg.run.name.startswith("-") or "/" in cfg.run.name:
        problems.append(("run.name", cfg.run.name, "a name for the run's directory "
                         "(<name>-<time>): not empty, no '/', not starting with '-', which "
                         "commands take for an option"))
    for role, count in per_node.items():
        if role in ROLES and count < 0:
            problems.append((f"placement.per_node.{role}", count, "a count >= 0"))
    if cfg.learner.backend == "horovod" and vla and cfg.policy.dtype == "bfloat16":  # `auto` is judged on the machine (preflight.py)
        problems.append(("policy.dtype", cfg.policy.dtype, "float32 with "
                         "learner.backend=horovod (no fp32 masters for bf16 weights)"))
    low, high = LOG_STD_BOUNDS
    if not low < cfg.policy.init_log_std < high:
        problems.append(("policy.init_log_std", cfg.policy.init_log_std, f"inside ({low:g}, "
                         f"{high:g}), the bounds of every family's exploration log std (the tokens "
                         "heads' initial spread too)"))
    if 0 < cfg.env.step_timeout_s < 1:  # seconds: a millisecond figure would kill each step
        problems.append(("env.step_timeout_s", cfg.env.step_timeout_s,
                         "0 (no watchdog) or at least 1 (seconds): more than the slowest "
                         "legitimate step, resets included"))
    if 0 < cfg.env.build_timeout_s < 1:
        problems.append(("env.build_timeout_s", cfg.env.build_timeout_s,
                         "0 (no watchdog) or at least 1 (seconds): more than the slowest "
                         "legitimate build of a rank's envs"))
    problems += _held_out_problems(cfg)
    problems += _sft_problems(cfg)
    for name in ("learner_nodes", "learners", "evaluators"):
        value = getattr(cfg.placement, name)
        if value and cfg.placement.mode != "disaggregated":
            problems.append((f"placement.{name}", value,
                             "0 unless placement.mode is disaggregated"))
    if cfg.policy.tokenizer and not cfg.policy.pretrained:
        problems.append(("policy.tokenizer", cfg.policy.tokenizer, "empty without "
                         "policy.pretrained (built-in policies read the env's instruction ids)"))
    for name, unset in FOLDER_RECIPE_UNSET.items():
        value = getattr(cfg.policy, name)
        if value != unset and (not family(cfg.policy.name).relative_actions or
                               not cfg.policy.pretrained):
            problems.append((f"policy.{name}", value, f"{unset if unset != '' else 'empty'} "
                             f"unless policy.name={having(FAMILIES, 'relative_actions')} with "
                             "a published policy.pretrained folder (how its checkpoint was "
                             "trained)"))
    heads = family(cfg.policy.name).action_heads
    if cfg.policy.action_head and cfg.policy.action_head not in heads:
        problems.append(("policy.action_head", cfg.policy.action_head, "empty for policy.name="
                         f"{cfg.policy.name} (one head)" if not heads else " or ".join(heads)))
    if cfg.policy.action_head == "l1" and cfg.policy.sequence != "official":
        problems.append(("policy.sequence", cfg.policy.sequence, "official with "
                         "policy.action_head=l1 (OFT's L1 head reads OFT's own sequence)"))
    if cfg.learner.offload_optimizer and (cfg.learner.zero_stage < 1 or
                                          cfg.learner.backend != "deepspeed"):
        problems.append(("learner.offload_optimizer", True, "false unless learner.backend="
                         "deepspeed with learner.zero_stage >= 1 (ZeRO offloads the optimizer "
                         "state it partitions)"))
    if cfg.learner.gradient_checkpointing and not vla:
        problems.append(("learner.gradient_checkpointing", True, "false for policy.name="
                         f"{cfg.policy.name} (a small network: no transformer layers to "
                         "recompute)"))
    if cfg.policy.flow_noise == "sde" and cfg.policy.logprob_mode != "random_step":
        problems.append(("policy.flow_noise", "sde", "learned unless policy.logprob_mode="
                         "random_step (RLinf's flow-SDE noises one step per chunk)"))
    if cfg.env.wrist_image and "wrist_image" in sim.settings and \
            not family(cfg.policy.name).wrist_camera:  # (reach has none: refused as unread)
        problems.append(("env.wrist_image", True, f"false for policy.name={cfg.policy.name} "
                         "(it reads one camera, `image`: the wrist camera would be rendered "
                         f"every step and read by nothing; a run that rendered one: add "
                         f"env.wrist_image=false, its weights never read it), or policy.name="
                         f"{having(FAMILIES, 'wrist_camera')}"))
    if cfg.policy.lora_rank and not vla:
        problems.append(("policy.lora_rank", cfg.policy.lora_rank, f"0 for policy.name="
                         f"{cfg.policy.name} (a small network: no language model to adapt)"))
    problems += _on_policy_problems(cfg) + _off_policy_problems(cfg) + _noise_obs_problems(cfg)
    shards = shards_problem(cfg.env.envs_per_simulator, shards_of(cfg))  # the mode's shards
    if shards:
        problems.append(shards)
    if not cfg.env.camera and (not sim.state_only or cfg.env.sim_backend != "cpu" or
                               cfg.env.wrist_image or not cfg.env.state or vla):
        problems.append(("env.camera", cfg.env.camera, "true, except for env.name="
                         f"{having(SIMULATORS, 'state_only')} "
                         "with env.sim_backend=cpu, env.state=true, env.wrist_image=false and "
                         "policy.name=default (the state-only setup)"))
    if cfg.eval.protocol not in ("hpcvla", sim.benchmark):
        problems.append(("eval.protocol", cfg.eval.protocol,
                         f"hpcvla for env.name={cfg.env.name}: `{cfg.eval.protocol}` is "
                         "another simulator's benchmark"))
    if cfg.eval.tasks and not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", cfg.eval.tasks):
        problems.append(("eval.tasks", cfg.eval.tasks, "task indices, comma-separated (0,1)"))
    if cfg.env.control_mode != EE_DELTA_CONTROL and not sim.controllers:
        problems.append(("env.control_mode", cfg.env.control_mode,
                         f"{EE_DELTA_CONTROL} for env.name={cfg.env.name}: only "
                         f"{having(SIMULATORS, 'controllers')} has "
                         "a choice of controllers"))
    gripper = family(cfg.policy.name).libero_gripper if sim.gripper_conventions \
        else "closed_high"
    if cfg.env.gripper_action != gripper:
        problems.append(("env.gripper_action", cfg.env.gripper_action, f"{gripper} for "
                         f"policy.name={cfg.policy.name} on env.name={cfg.env.name} (its "
                         "checkpoints' convention: the setting's doc)"))
    if cfg.env.train_states != "sampled" and not sim.benchmark:
        problems.append(("env.train_states", cfg.env.train_states,
                         f"sampled for env.name={cfg.env.name}: only "
                         f"{having(SIMULATORS, 'benchmark')} has a benchmark's "
                         "fixed initial states"))
    if cfg.env.sim_backend == "gpu" and not sim.gpu_simulation:
        gpu = having(SIMULATORS, "gpu_simulation")
        problems.append(("env.sim_backend", cfg.env.sim_backend,
                         f"cpu for env.name={cfg.env.name}: only {gpu} has a GPU simulation "
                         f"(set env.sim_backend=cpu, or env.name={gpu})"))
    return problems


def _on_policy_problems(cfg) -> list[tuple[str, Any, str]]:
    """The on-policy algorithms' batches and the critics' warm-ups."""
    problems, alg = [], cfg.algorithm
    traits = alg.traits
    gae = having(ALGORITHMS, "advantage", "gae")
    if traits.advantage == "group" and cfg.rollout.segment_len != cfg.env.max_episode_chunks:
        problems.append(("rollout.segment_len", cfg.rollout.segment_len,
                         f"env.max_episode_chunks ({cfg.env.max_episode_chunks}) for "
                         f"algorithm.name={alg.name}: a segment holds one grouped episode per "
                         "env"))
    if alg.critic_warmup and not traits.off_policy:
        problems.append(("algorithm.critic_warmup", alg.critic_warmup, "0 with algorithm.name="
                         f"{alg.name} (gradient steps of {having(ALGORITHMS, 'off_policy')}; "
                         f"{gae}'s critic warms up by versions: "
                         "algorithm.critic_warmup_versions)"))
    if alg.advantage_norm == "batch" and cfg.pipeline.mode == "streamer":
        problems.append(("algorithm.advantage_norm", "batch", "micro_batch or none with "
                         "pipeline.mode=streamer (it trains each micro-batch as it arrives, "
                         "before the batch is whole), or a mode that waits for it "
                         "(rollout-async, train-async, sync-disaggregated, sync-colocated)"))
    if 0 < alg.dual_clip <= 1:
        problems.append(("algorithm.dual_clip", alg.dual_clip, "0 (off) or above 1: a bound "
                         "at or below 1 x the advantage would take every negative advantage's "
                         "gradient away"))
    if 0 < cfg.policy.center_crop < 0.01:
        problems.append(("policy.center_crop", cfg.policy.center_crop, "0 (the pretrained "
                         "folder's) or an area fraction of at least 0.01"))
    if alg.weight_decay and traits.off_policy:
        problems.append(("algorithm.weight_decay", alg.weight_decay, f"0 with algorithm.name="
                         f"{alg.name} (its temperature, a trained parameter, would decay to 1)"))
    if alg.lr_warmup_versions and traits.off_policy:
        problems.append(("algorithm.lr_warmup_versions", alg.lr_warmup_versions, "0 with "
                         f"algorithm.name={alg.name} ({having(ALGORITHMS, 'off_policy', False)}"
                         "'s: the off-policy learner starts with algorithm.learning_starts and "
                         "critic_warmup)"))
    if alg.critic_warmup_versions and traits.advantage != "gae":
        problems.append(("algorithm.critic_warmup_versions", alg.critic_warmup_versions,
                         f"0 with algorithm.name={alg.name} (only {gae} warms a value critic "
                         f"up by versions; {having(ALGORITHMS, 'advantage', 'group')} trains "
                         "no critic; "
                         f"{having(ALGORITHMS, 'off_policy')} warm theirs up by gradient "
                         "steps: algorithm.critic_warmup)"))
    elif alg.critic_warmup_versions >= cfg.pipeline.total_updates:
        problems.append(("algorithm.critic_warmup_versions", alg.critic_warmup_versions,
                         f"below pipeline.total_updates ({cfg.pipeline.total_updates}): the "
                         "versions after the warm-up are the ones that train the policy"))
    return problems


def _sft_problems(cfg) -> list[tuple[str, Any, str]]:
    """`hpcvla sft`'s learning-rate schedule."""
    problems, sft = [], cfg.sft
    if sft.warmup_steps >= sft.steps:
        problems.append(("sft.warmup_steps", sft.warmup_steps, f"below sft.steps ({sft.steps}):"
                         " the run would end before its learning rate reached sft.lr"))
    if sft.final_lr and sft.schedule != "cosine":
        problems.append(("sft.final_lr", sft.final_lr, "0 unless sft.schedule=cosine (the "
                         "cosine's end; a constant schedule stays at sft.lr)"))
    elif sft.final_lr > sft.lr:
        problems.append(("sft.final_lr", sft.final_lr, f"at most sft.lr ({sft.lr}): the "
                         "cosine decays to it"))
    try:
        dataset_features(sft)
    except ValueError as err:
        problems.append(("sft.features", sft.features, str(err)))
    if sft.val_every and not sft.val_demos:
        problems.append(("sft.val_every", sft.val_every, "0 without sft.val_demos (the "
                         "held-out files whose loss it measures)"))
    return problems


def _noise_obs_problems(cfg) -> list[tuple[str, Any, str]]:
    """algorithm.noise_obs: DSRL's (the flow family under sac), and fields an env may have
    (preflight.noise_obs_problems checks them against the configured env's)."""
    alg, fields = cfg.algorithm, noise_obs_fields(cfg.algorithm)
    if not fields:
        return []
    if not (family(cfg.policy.name).noise_actor and alg.traits.steers_noise):
        return [("algorithm.noise_obs", alg.noise_obs, "empty unless policy.name="
                 f"{having(FAMILIES, 'noise_actor')} with algorithm.name="
                 f"{having(ALGORITHMS, 'steers_noise')} (the fields DSRL's noise actor reads)")]
    if set(fields) - set(ENCODED_FIELDS) or len(set(fields)) < len(fields):
        return [("algorithm.noise_obs", alg.noise_obs, "distinct fields among "
                 f"{', '.join(ENCODED_FIELDS)}, comma-separated (empty: those of them the "
                 "env has)")]
    return []


def _off_policy_problems(cfg) -> list[tuple[str, Any, str]]:
    """The off-policy algorithms: what their learner (roles/off_policy.py) runs with."""
    alg = cfg.algorithm
    rule, prior = alg.traits, having(ALGORITHMS, "prior_data")
    if not rule.off_policy:
        return [("algorithm.demos", alg.demos, f"empty unless algorithm.name={prior} (prior "
                 "data of the off-policy learner)")] if alg.demos else []
    problems = []
    if rule.prior_data != bool(alg.demos):
        problems.append(("algorithm.demos", alg.demos, "demonstration files with "
                         f"algorithm.name={prior} (its prior data), and empty otherwise"))
    traits = family(cfg.policy.name)
    if not traits.soft_critics and not (traits.noise_actor and rule.steers_noise):
        problems.append(("policy.name", cfg.policy.name, f"{having(FAMILIES, 'soft_critics')}"
                         f" with algorithm.name={alg.name} (the family with SAC's critics and "
                         f"squashed actor), or {having(FAMILIES, 'noise_actor')} with "
                         f"algorithm.name={having(ALGORITHMS, 'steers_noise')} (DSRL: "
                         "demonstrations record actions, not the noise prior data would "
                         "need)"))
    if traits.noise_actor and cfg.policy.lora_rank:
        problems.append(("policy.lora_rank", cfg.policy.lora_rank, "0 with algorithm.name="
                         f"{alg.name} on the flow family: DSRL trains the noise actor only, the "
                         "flow policy and any adapter stay frozen"))
    if cfg.learner.zero_stage == 3:
        problems.append(("learner.zero_stage", 3, "0, 1 or 2 with algorithm.name="
                         f"{alg.name} (its losses call the critics outside the engine's "
                         "forward)"))
    half_width = alg.noise_bound if traits.noise_actor else 1.0  # the squashed actor's box
    if alg.target_entropy >= math.log(2 * half_width):
        problems.append(("algorithm.target_entropy", alg.target_entropy, f"< "
                         f"{math.log(2 * half_width):.3f}, the entropy per dimension of the "
                         f"uniform over the actor's box (-{half_width:g}, {half_width:g}): "
                         "no squashed actor reaches it, and the temperature would grow "
                         "without end (SAC's -1; DSRL's 0)"))
    if alg.utd <= 0:
        problems.append(("algorithm.utd", alg.utd, "> 0 gradient steps per env step with "
                         f"algorithm.name={alg.name} (0 would never train)"))
    if alg.learning_starts > alg.replay_capacity:
        problems.append(("algorithm.learning_starts", alg.learning_starts,
                         f"at most algorithm.replay_capacity ({alg.replay_capacity}): the "
                         "buffer would never hold enough to start"))
    return problems


def _held_out_problems(cfg) -> list[tuple[str, Any, str]]:
    """Held-out evaluation during training (eval.every): where it runs and what it films."""
    ev, problems = cfg.eval, []
    disaggregated = cfg.placement.mode == "disaggregated"
    if ev.every and disaggregated and not cfg.placement.evaluators:
        problems.append(("placement.evaluators", 0, "1 with eval.every > 0 in a disaggregated "
                         "mode (a rank set aside evaluates: the last learner rank of the "
                         "rollout nodes becomes it, so give placement.per_node.learner one "
                         "more rank), or eval.every=0"))
    if cfg.placement.evaluators and not ev.every:
        problems.append(("placement.evaluators", cfg.placement.evaluators,
                         "0 unless eval.every > 0 (an evaluator rank with nothing to do)"))
    if ev.video_every and (not ev.every or ev.video_every % ev.every):
        problems.append(("eval.video_every", ev.video_every,
                         f"a multiple of eval.every ({ev.every}; > 0), or 0"))
    if ev.video_every and not cfg.env.camera:
        problems.append(("eval.video_every", ev.video_every, "0 with env.camera=false (no "
                         "camera to film)"))
    return problems


# Settings read only under some values of another (`chooser`): setting -> (chooser, readers).
# The others are judged above, or read by every choice; policy.*, env.* and algorithm.* by
# their tables' `settings` (config/families.py).
READ_ONLY_UNDER: dict[str, tuple[str, tuple[str | bool, ...]]] = {
    "learner.epochs": ("algorithm.name", tuple(
        n for n, t in ALGORITHMS.items() if not t.off_policy)),
    **{f"run.{k}": ("run.dump_trajectories", (True,)) for k in ("dump_max_gib", "dump_flush_s")},
    "pipeline.max_staleness": ("pipeline.mode", tuple(
        m for m, t in MODE_TRAITS.items() if t.bounded_staleness)),
    **{f"rollout.{k}": ("pipeline.mode", tuple(
        m for m, t in MODE_TRAITS.items() if t.dynamic_batcher))
       for k in ("batch_max", "wait_max_ms")},
    "placement.per_node": ("placement.mode", tuple(m for m in PLACEMENT_MODES
                                                   if m != "colocated")),
}
# what the choices that do not read a setting run at: typed, it says what runs (on-policy
# synchronous modes are max_staleness 0)
IMPLIED = {"pipeline.max_staleness": 0}
# the held-out evaluation's own settings, read by training's only (eval.every > 0): `hpcvla
# eval` has flags for them (evaluate.EVAL_FLAGS); eval.video_every is judged above
HELD_OUT_ONLY = ("eval.episodes", "eval.envs", "eval.deterministic")


def unread_setting_problems(cfg, overrides, file_settings: dict[str, Any] | None = None
                            ) -> list[tuple[str, Any, str]]:
    """Settings the chosen policy family, simulator, algorithm or pipeline mode does not read
    (unread_settings_of), typed on the command line (`overrides`: `policy.size=full` on the
    default policy, `algorithm.group_size=4` under PPO) or set by the config file
    (`file_settings`, by dotted name: a user's YAML with `group_size` under PPO): refused, not
    silently ignored, where they change a default. A file's settings are judged by the file's
    own choices: a command line that re-points a recipe (`configs/reach_flow.yaml
    policy.name=oft`) leaves the file's settings for the other choice as a recipe's, unread.
    Nor is `policy.size` read where a pretrained folder sets the sizes (FamilyTraits.
    folder_sizes): `configs/libero_pi0.yaml policy.size=full` would plan its fixture's sizes."""
    # a mapping setting's one key (placement.per_node.learner=2) is that setting typed
    typed = [".".join(item.partition("=")[0].split(".")[:2]) for item in overrides]
    unread = unread_settings_of(cfg)
    problems = []
    if "policy.size" in typed and cfg.policy.pretrained and family(
            cfg.policy.name).folder_sizes:
        problems.append(("policy.size", cfg.policy.size, "none: the folder policy.pretrained="
                         f"{cfg.policy.pretrained} sets the sizes; to build at this size "
                         "without it: policy.pretrained= policy.tokenizer="))
        unread.pop("policy.size", None)  # said once
    filed = file_settings or {}
    # a file's own: its chooser holds the file's value (or, the file leaving it, the default)
    judged = [key for key in filed if key in unread and _value_of(cfg, unread[key][0]) ==
              filed.get(unread[key][0], _default_of(unread[key][0]))]
    for key in dict.fromkeys(key for key in [*typed, *judged] if key in unread):
        chooser, readers = unread[key]
        value = _value_of(cfg, key)
        if value in (_default_of(key), IMPLIED.get(key)):  # said, but changing
            continue  # nothing (a bench's settings for every arm)
        chosen = f"{chooser}={_value_of(cfg, chooser)}"
        problems.append((key, value, f"none: {chosen} does not read it ({', '.join(readers)} "
                         f"do{'es' if len(readers) == 1 else ''}); drop it, or set "
                         f"{chooser}"))
    return problems


def unread_settings_of(cfg) -> dict[str, tuple[str, list[str]]]:
    """The settings `cfg`'s choices do not read, by dotted name: (the chooser that decides,
    the values of it that would read it). A family's, simulator's or algorithm's own settings
    (FamilyTraits/SimulatorTraits/AlgorithmTraits.settings), those a switch or mode reads
    (READ_ONLY_UNDER), and the held-out evaluation's (HELD_OUT_ONLY)."""
    unread = {}
    for section, table in (("policy", FAMILIES), ("env", SIMULATORS),
                           ("algorithm", ALGORITHMS)):
        for name in unread_settings(table, _value_of(cfg, f"{section}.name")):
            unread[f"{section}.{name}"] = (f"{section}.name", readers_of(table, name))
    for key, (chooser, readers) in READ_ONLY_UNDER.items():
        if _value_of(cfg, chooser) not in readers:  # a switch's readers: `run.dump_traj..=true`
            unread[key] = (chooser, [r if isinstance(r, str) else f"{chooser}={str(r).lower()}"
                                     for r in readers])
    if not cfg.eval.every:
        unread.update({key: ("eval.every", ["eval.every > 0"]) for key in HELD_OUT_ONLY})
    return unread


def as_read(cfg):
    """`cfg` with the settings its choices do not read (unread_settings_of) at their
    defaults, as `hpcvla config` prints it: a config file that loads back under the file
    check (a re-pointed recipe's other settings were not read)."""
    import dataclasses
    changes: dict[str, dict] = {}
    for key in unread_settings_of(cfg):
        section, _, name = key.partition(".")
        changes.setdefault(section, {})[name] = _default_of(key)
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                    **values)
                                       for section, values in changes.items()})


def _value_of(cfg, key: str):
    """The value of the setting `key` ("section.name") in `cfg`."""
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


def _default_of(key: str):
    """The default of the setting `key` ("section.name")."""
    from hpcvla.config.schema import Config
    return _value_of(Config(), key)
