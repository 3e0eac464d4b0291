"""Pre-flight checks: what a config needs of this machine, before any rank starts.

config/checks.py judges the settings alone; these look further: the installed packages
(Horovod, the simulator), the device the policy's dtype resolves to, the checkpoint a run
resumes, the pretrained folder it loads, and whether the rank plan fits the node's GPUs.
`hpcvla train` runs them in the launching process (in a world someone else started: each
rank its host's, one rank the rest, check_world), `hpcvla eval` before it loads a policy.
Each problem is (field, value, what would be valid), reported together as one ConfigError.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hpcvla.config import ConfigError
from hpcvla.config.families import family
from hpcvla.envs import check_env, env_uses_gpu
from hpcvla.metrics.tensorboard import wandb_problems
from hpcvla.process.mpi_select import launcher_rank
from hpcvla.schedule import config_layout_problems
from hpcvla.topology.plan import PlanError, RankPlan
from hpcvla.weight_checks import (pretrained_env_problems, pretrained_problems,
                                  weights_fit_problems)


def config_problems(cfg, last=("pipeline.total_updates", None)) -> list[tuple[str, Any, str]]:
    """Problems of `cfg` on this machine (packages, devices, files); empty when fine.
    `last`: the setting a resumed checkpoint's version must stay below, and its value
    (None: pipeline.total_updates; `hpcvla sft` counts steps)."""
    return host_problems(cfg) + file_problems(cfg, last)


def host_problems(cfg) -> list[tuple[str, Any, str]]:
    """What each node must see for itself: its GPUs, the Horovod it has installed."""
    from hpcvla.devices import missing_gpus_problem
    problems = []
    missing_gpus = missing_gpus_problem(cfg.placement.gpus_per_node)
    if missing_gpus:
        problems.append(("placement.gpus_per_node", cfg.placement.gpus_per_node, missing_gpus))
    if cfg.learner.backend == "horovod":
        import torch

        from hpcvla.engines.horovod import horovod_available
        from hpcvla.policies.vla import resolve_dtype
        missing = horovod_available(on_gpus=cfg.placement.gpus_per_node != 0 and
                                    torch.cuda.is_available())  # the learners' GPUs
        if missing:
            problems.append(("learner.backend", "horovod", f"deepspeed, or Horovod installed: "
                             f"{missing}"))
        # (bfloat16 itself is refused by config/checks.py; `auto` is bf16 where CUDA is)
        if family(cfg.policy.name).vla and cfg.policy.dtype != "bfloat16" and \
                resolve_dtype(cfg.policy.dtype) != torch.float32:
            problems.append(("policy.dtype", cfg.policy.dtype, "float32 with "
                             "learner.backend=horovod (no fp32 masters for bf16 weights)"))
    return problems


def file_problems(cfg, last=("pipeline.total_updates", None)) -> list[tuple[str, Any, str]]:
    """What the config's files and folders hold, the same from every node of one shared
    file system: the checkpoints it starts from, the pretrained folder, W&B's settings."""
    problems = checkpoint_problems(cfg, last) + wandb_problems(cfg.run)
    if cfg.policy.pretrained:
        problems += pretrained_problems(cfg.policy, cfg.env)
    return problems


def checkpoint_problems(cfg, last=("pipeline.total_updates", None)) -> list[tuple[str, Any, str]]:
    """The checkpoints a run starts from, there and whole: the run resumed (run.resume) and
    the weights it starts at (policy.checkpoint). `last`: as config_problems'."""
    problems = []
    if cfg.run.resume:  # `hpcvla sft` resumes an SFT run, `train` an RL run
        from hpcvla.checkpoint.catalog import resume_problems
        problems += resume_problems(cfg.run.resume, last[0] == "sft.steps", (
            last[0], cfg.pipeline.total_updates if last[1] is None else last[1]))
    if cfg.policy.checkpoint:
        from hpcvla.checkpoint.catalog import CheckpointError, latest, read_state
        path = latest(cfg.policy.checkpoint)
        if path is None:
            problems.append(("policy.checkpoint", cfg.policy.checkpoint, "a run directory "
                             "holding a complete checkpoint (checkpoints/v*/state.json), e.g. "
                             "an `hpcvla sft` run's"))
        else:
            try:
                read_state(path)  # its files whole (their checksums: when the ranks load them)
            except CheckpointError as err:
                problems.append(("policy.checkpoint", cfg.policy.checkpoint,
                                 f"a readable checkpoint: {err}"))
    return problems


def unwritable(folder) -> str:
    """Why nothing can be written in `folder` (made with its parents where missing): the
    nearest part of it that exists is not a folder, or nothing can be made there (tried: a
    temporary folder made and removed); '' if it can be written."""
    folder = Path(folder).resolve()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is not a folder"
    try:
        tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as err:
        return f"nothing can be made in {existing}: {err.strerror}"
    return ""


def run_root_problems(cfg) -> list[tuple[str, Any, str]]:
    """run.root, where a training run makes its directory, written to (`unwritable`).
    `hpcvla train` and `sft` only: evaluating or planning a run writes nothing there."""
    why = unwritable(cfg.run.root)
    return [("run.root", cfg.run.root, f"a folder a run directory can be made in ({why})")] \
        if why else []


def noise_obs_problems(cfg) -> list[tuple[str, Any, str]]:
    """algorithm.noise_obs against the configured env's observations (the launching process
    probes the env, as for pretrained_env_problems; a rank building the noise actor refuses
    the same fields)."""
    from hpcvla.config.learning import noise_obs_fields
    fields = noise_obs_fields(cfg.algorithm)
    if not fields:
        return []
    from hpcvla.envs import env_spec
    observed = env_spec(cfg.env).obs
    missing = [f for f in fields if f not in observed]
    return [("algorithm.noise_obs", cfg.algorithm.noise_obs, f"fields among the env's "
             f"observations ({', '.join(observed)}): {', '.join(missing)} not among them")
            ] if missing else []


def prior_data_problems(cfg) -> list[tuple[str, Any, str]]:
    """algorithm.name=rlpd: its demonstrations against the env's observations and actions,
    each chunk's reward and episode end recorded (demonstrations/)."""
    if not cfg.algorithm.traits.prior_data:
        return []
    from hpcvla.config.imitation import demo_paths
    from hpcvla.demonstrations import demonstration_problems
    from hpcvla.envs import env_spec

    return [(f"algorithm.demos: {where}", value, fix) for where, value, fix in
            demonstration_problems(demo_paths(cfg.algorithm), env_spec(cfg.env),
                                   cfg.algorithm.demos_per_task or None, outcomes=True)]


def check_sft(cfg, source: str = "config", learners: int | None = None) -> None:
    """`hpcvla sft`'s checks: the config's (check_config), where it writes (run_root_problems),
    the weights it resumes or starts from (weights_fit_problems), its demonstrations against
    the configured env's spec and this host's memory, and where it starts its world of
    `learners` here, their GPUs' memory (memory/sft_eval.sft_memory), before any rank starts."""
    from hpcvla.config.imitation import dataset_features, demo_paths
    from hpcvla.demonstrations import demonstration_files, demonstration_problems
    from hpcvla.envs import env_spec
    from hpcvla.memory.host import host_bytes
    from hpcvla.memory.layout import layout_gpus
    from hpcvla.transport.windows import shared_memory_room
    from hpcvla.memory.sft_eval import sft_memory

    check_config(cfg, source, ("sft.steps", cfg.sft.steps))
    problems = run_root_problems(cfg) + weights_fit_problems(cfg)
    if problems:
        raise ConfigError(problems, source)
    if family(cfg.policy.name).noise_actor and cfg.algorithm.traits.steers_noise:
        name = cfg.algorithm.name
        raise ConfigError([("algorithm.name", name, "ppo for `hpcvla sft` of the flow family "
                            f"(with {name} its weights are frozen under DSRL's noise actor, "
                            "which imitation does not train); then DSRL from that run: `hpcvla "
                            f"train CONFIG algorithm.name={name} policy.checkpoint=<sft run>`")],
                          source)
    paths = demo_paths(cfg.sft)
    if not paths:
        raise ConfigError([("sft.demos", cfg.sft.demos, "one or more HDF5 demonstration files "
                            "or LeRobot dataset folders, comma-separated (e.g. written by "
                            "`hpcvla demos`)")], source)
    spec, features = env_spec(cfg.env), dataset_features(cfg.sft)
    problems = demonstration_problems(paths, spec, cfg.sft.per_task or None,
                                      successful_only=cfg.sft.successful_only, features=features,
                                      host_memory=host_bytes(), shm=shared_memory_room())
    if problems:
        raise ConfigError(problems, f"{source}: sft.demos")
    held_out = demo_paths(cfg.sft, "val_demos")
    problems = demonstration_problems(held_out, spec, features=features) if held_out else []
    if problems:
        raise ConfigError(problems, f"{source}: sft.val_demos")
    trained = {p.resolve() for p in demonstration_files(paths)}
    both = [str(p) for p in demonstration_files(held_out) if p.resolve() in trained]
    if both:
        raise ConfigError([("sft.val_demos", cfg.sft.val_demos, "files sft.demos does not "
                            f"name too: {', '.join(both)} are trained on, and a held-out loss "
                            "on them measures nothing held out")], source)
    gpus = layout_gpus(cfg) if learners else 0
    problems = sft_memory(cfg, [0] * learners, gpus, spec, shared=0).problems if gpus else []
    if problems:
        raise ConfigError(problems, "memory plan of the sft learners")


def check_config(cfg, source: str = "config", last=("pipeline.total_updates", None)):
    """`cfg` if config_problems finds nothing, else they raise as one ConfigError (`source`:
    the config file, as the loader names it)."""
    problems = config_problems(cfg, last)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def check_host(cfg, source: str) -> None:
    """host_problems on a rank of a world (`train`, `sft`, `eval` under srun/mpirun), as one
    ConfigError: a node's own problem is found by its ranks alone, and the world hears which
    ranks and hosts found it at its first collective (job/runtime.agreed_start), where the
    other nodes' ranks would otherwise wait for them. Nothing in a process alone: its
    command's own checks say them."""
    if launcher_rank() is None:
        return
    problems = host_problems(cfg)
    if problems:
        raise ConfigError(problems, source)


def pipeline_problems(cfg, plan: RankPlan) -> list[tuple[str, Any, str]]:
    """The layout rules (schedule.layout_problems) and the device map on `plan`."""
    problems = config_layout_problems(cfg, plan)
    if cfg.placement.gpus_per_node > 0:  # a GPU count given: the device map must work
        from hpcvla.devices import plan_devices
        try:
            plan_devices(plan, cfg.placement.gpus_per_node, env_uses_gpu(cfg.env))
        except PlanError as err:
            problems.append(("placement.gpus_per_node", cfg.placement.gpus_per_node, str(err)))
    return problems


def check_pipeline(cfg, plan: RankPlan) -> None:
    """Refuse, as one ConfigError, a pipeline `plan` cannot run; then check that the
    simulator is installed and can run the task (envs.check_env)."""
    problems = pipeline_problems(cfg, plan)
    if problems:
        raise ConfigError(problems, "pipeline configuration")
    check_env(cfg)


def check_world(cfg, plan: RankPlan, source: str) -> None:
    """What a world someone else started (srun, mpiexec) checks before its roles begin,
    besides each rank's host_problems: file_problems, run_root_problems, weights_fit_problems
    and check_pipeline. One rank runs it for
    all (job/runtime.py): the pretrained folder's check alone imports torch and a tokenizer,
    seconds that simulator ranks, which need neither, would spend on every rank. Nothing to
    do in a world `hpcvla train` started after check_launch passed for the same config and
    plan on this host (`launch_checked`): it checked all of this, and more."""
    if checked_by_launcher(cfg, plan):
        return
    problems = file_problems(cfg) + run_root_problems(cfg)
    problems = problems or weights_fit_problems(cfg)  # its files readable first
    if problems:
        raise ConfigError(problems, source)
    check_pipeline(cfg, plan)


LAUNCH_CHECKED = "HPCVLA_LAUNCH_CHECKED"  # what check_launch passed, for the world it starts


def checked_by_launcher(cfg, plan: RankPlan | None = None) -> bool:
    """Whether the process that started this world checked `cfg` (and `plan`) on this host."""
    return os.environ.get(LAUNCH_CHECKED) == launch_checked(cfg, plan)


def launch_checked(cfg, plan: RankPlan | None) -> str:
    """This host, `cfg` and `plan`, as one token: check_launch passed for them here. A
    simulator's or a pretrained folder's check takes its rank seconds (importing ManiSkill,
    LIBERO or a tokenizer) while every other rank waits; a different host, config or plan
    (a world spanning nodes the launching process did not plan for) checks again."""
    digest = hashlib.sha256(repr((asdict(cfg), plan)).encode()).hexdigest()[:20]
    return f"{socket.gethostname()}:{digest}"


def check_launch(cfg, plan: RankPlan, source: str = "config") -> dict[str, str]:
    """What the launching process checks before it starts any rank: check_config, where the
    run writes (run_root_problems), check_pipeline, a published folder, the weights it resumes
    or starts from, prior data and the noise actor's fields against the env
    (pretrained_env_problems, weights_fit_problems, prior_data_problems, noise_obs_problems),
    and whether the layout fits its GPUs' memory (memory_problems). Returns the environment
    that tells the world this process starts what passed here (LAUNCH_CHECKED)."""
    check_config(cfg, source)
    problems = run_root_problems(cfg)
    if problems:
        raise ConfigError(problems, source)
    check_pipeline(cfg, plan)
    problems = pretrained_env_problems(cfg)
    if problems:
        raise ConfigError(problems, "policy.pretrained")
    problems = weights_fit_problems(cfg)
    if problems:
        raise ConfigError(problems, source)
    problems = prior_data_problems(cfg)
    if problems:
        raise ConfigError(problems, "algorithm.demos")
    problems = noise_obs_problems(cfg)
    if problems:
        raise ConfigError(problems, "algorithm.noise_obs")
    from hpcvla.memory.layout import memory_problems
    problems = memory_problems(cfg, plan)
    if problems:
        raise ConfigError(problems, "memory plan (hpcvla plan shows it)")
    return {LAUNCH_CHECKED: launch_checked(cfg, plan)}
