"""The `hpcvla` command: RL post-training of vision-language-action policies as one MPI job.

    hpcvla train [CONFIG] [key=value ...] [--ranks N] the main job (--ranks: start N ranks here)
    hpcvla sft [CONFIG] sft.demos=F [key=value ...] [--ranks N]
                                                      supervised fine-tuning on demonstrations
    hpcvla plan [CONFIG] [key=value ...] --world N [--ranks-per-node M] [--job sft] [--json]
    hpcvla plan --auto CONFIG --world N [--ranks-per-node M] [--costs C] [--json]
                                                      best layout by the scale model
    hpcvla config [CONFIG] [key=value ...] [--doc [SECTION|KEY]]
                                                      the resolved config, or settings' docs
    hpcvla doctor [CONFIG] [key=value ...] [--job sft] [--world N [--ranks-per-node M]]
                  [--json]                            what the job needs, here?
    hpcvla doctor --job eval [--world N ...] -- RUN_DIR [eval's flags] [key=value ...]
    hpcvla eval RUN_DIR|CHECKPOINT [key=value ...] [--all] [--ranks N]
                                                      success rate of a run's checkpoints
    hpcvla bench TARGET [options]                     transport, modes, learning, policies,
                                                      shards, gpu, fullsize, scale, memory,
                                                      checkpoint; a table and JSON
    hpcvla launch -n N [--timeout S] -- PROGRAM ...   any hpcvla subcommand or script on N ranks
    hpcvla inspect FILE|RUN_DIR ... [--json] [--verify] [--video K]
                                                      summarise HDF5 trajectory dumps
    hpcvla demos CONFIG [key=value ...] --episodes N --out FILE [--noise S] [--successful-only]
                 [--policy RUN_DIR [--deterministic]]
                                                      record a scripted expert's demonstrations
                                                      (--policy: a run's policy acts, DAgger)
    hpcvla export RUN_DIR|CHECKPOINT FOLDER [--format F]
                                                      a checkpoint as a policy folder

Config errors, impossible layouts and what the config needs of this machine are reported
here, in the launching process, before any MPI rank starts. Only `train`, `sft` and `eval`
without --ranks inside srun/mpirun (`sft` alone: a world of one) initialise MPI.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import yaml

from hpcvla.bench.command import add_bench_parser, bench_command
from hpcvla.config import (ConfigError, config_argument, config_source, load_config,
                           resumed_run_config, seconds, whole_number)
from hpcvla.config.checks import as_read
from hpcvla.config.loader import config_to_dict, settings_doc
from hpcvla.config.schema import MPI_FLAVOURS
from hpcvla.doctor import add_doctor_parser, doctor_command
from hpcvla.eval_command import add_eval_parser, eval_command
from hpcvla.imitation.command import add_demos_parser, demos_command, plan_sft
from hpcvla.metrics.command import add_inspect_parser, inspect_command
from hpcvla.process.deathwatch import WORLD_COMMANDS
from hpcvla.process.mpi_select import LaunchError, check_not_nested, launcher_rank
from hpcvla.process.refusal import refused
from hpcvla.scale.presets import COST_NAMES
from hpcvla.topology.plan import PlanError, plan_from_config


def _config_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("config", nargs=None if required else "?",
                        help="YAML config file (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. learner.zero_stage=3")
    parser.set_defaults(config_optional=not required)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcvla", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    # no abbreviated flags: `--rank 4` started a 4-rank world as `--ranks 4`
    sub = parser.add_subparsers(dest="command", required=True, parser_class=functools.partial(
        argparse.ArgumentParser, allow_abbrev=False))

    train = sub.add_parser("train", help="run the main job (no config: the built-in default, "
                                         "or with run.resume=DIR the resumed run's own config)",
                           description="Train a policy with RL: one MPI world of simulator, "
                           "inference and learner ranks (docs/commands.md).")
    _config_args(train, required=False)
    train.add_argument("--ranks", type=whole_number(1), default=None,
                       help="start this many ranks on this machine (default: under "
                            "srun/mpirun the launcher's world, otherwise launch.ranks, 4)")

    sft = sub.add_parser("sft", help="supervised fine-tuning on demonstrations (sft.demos): "
                                     "the imitation start RL post-trains")
    _config_args(sft, required=False)
    sft.add_argument("--ranks", type=whole_number(1), default=None,
                     help="start this many learner ranks on this machine (default: the "
                          "current MPI world, as under srun/mpirun; alone: one rank)")

    plan = sub.add_parser("plan", help="print the rank map of a config, or why it cannot work")
    _config_args(plan, required=False)
    plan.add_argument("--world", type=whole_number(1), required=True, help="MPI world size")
    plan.add_argument("--ranks-per-node", type=whole_number(1), default=None,
                      help="ranks per real node (default: --world); placement.ranks_per_node, "
                      "if set, emulates smaller nodes inside them, as in train")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--job", choices=("train", "sft"), default="train",
                      help="its command (sft: every rank a learner, a GPU each)")
    plan.add_argument("--auto", action="store_true",
                      help="search per-node role counts, shards, B_max/T_max and "
                           "micro-batching with the scale model (hpcvla/scale/) and print the "
                           "best layout as overrides, its predicted env steps/s and bottleneck")
    plan.add_argument("--search-envs", action="store_true",
                      help="--auto: also pick env.envs_per_simulator (the fewest within 2 %% "
                           "of the best throughput)")
    plan.add_argument("--costs", default="config",
                      choices=COST_NAMES,
                      help="--auto: stage costs: the config's emulated delays or, without, "
                           "the reach env probed here (config); an emulated preset; or "
                           "RL-VLA³'s pi0 on LIBERO")

    config = sub.add_parser("config", help="print the resolved config or the settings' docs")
    _config_args(config, required=False)
    config.add_argument("--doc", nargs="?", const="", metavar="SECTION|KEY",
                        help="document every setting, or a section's (`--doc learner`) or one")
    config.add_argument("--job", choices=("train", "sft"), default="train", help="check the "
                        "overrides as this command does (sft refuses those it sets itself and "
                        "train's own; train, the sft section)")

    add_doctor_parser(sub, _config_args)

    add_bench_parser(sub)

    add_demos_parser(sub, _config_args)

    add_inspect_parser(sub)

    add_eval_parser(sub)

    export = sub.add_parser("export", help="a run's newest checkpoint as a policy folder")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, or one of its "
                                                           "checkpoints/v*/ to export that one")
    export.add_argument("out", metavar="FOLDER", help="the folder to write")
    export.add_argument("--format", choices=("auto", "published", "hpcvla"), default="auto",
                        help="published: the layout of the run's policy.pretrained folder, for "
                             "its own tools (LeRobot, openpi, OFT); hpcvla: RL heads kept; "
                             "auto (default): published for a run from a published folder")

    launch = sub.add_parser("launch", help="run a program on N ranks of this machine")
    launch.add_argument("-n", type=int, required=True, help="number of ranks")
    launch.add_argument("--timeout", type=seconds, default=None, help="kill the world after S s")
    launch.add_argument("--mpiexec", default="auto", help="mpiexec to use (default: auto)")
    launch.add_argument("--mpi", default="auto", choices=MPI_FLAVOURS,
                        help="MPI to run under (default: the launcher beside this Python)")
    launch.add_argument("program", nargs=argparse.REMAINDER,
                        help="an hpcvla subcommand or a .py script, with its arguments")
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    # Overrides may come after options (`train cfg.yaml --ranks 4 run.seed=1`): argparse leaves
    # those as extras; anything else left over is an error.
    args, extra = parser.parse_known_args(argv)
    stray = [item for item in extra if "=" not in item or item.startswith("-")]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}" + (
            " (`doctor --job eval` takes eval's after `--`)" if getattr(args, "job", "") ==
            "eval" else ""))
    if extra:
        args.overrides += extra
    return args


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = _parse(parser, argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: eval's ranks get it
    if args.command == "doctor" and args.job == "eval":  # its arguments are `hpcvla eval`'s
        args.evaluation = _parse(parser, ["eval", *filter(None, [args.config]),
                                          *args.overrides])
    if getattr(args, "config_optional", False):  # `hpcvla train a.b=1`: the built-in defaults
        args.config, args.overrides = config_argument(args.config, args.overrides)
    try:
        if launcher_rank() is None or args.command not in WORLD_COMMANDS:
            return COMMANDS[args.command](args)
        from hpcvla.job.runtime import or_abort_the_world

        def start() -> int:  # a rank of a world: what it refuses, the world hears
            check_not_nested(args.ranks)  # --ranks inside srun/mpirun's world
            return COMMANDS[args.command](args)
        return or_abort_the_world(args.command, start)
    except (ConfigError, PlanError, LaunchError) as err:
        return refused(args.command, err)


def cmd_train(args) -> int:
    if args.config is None:  # resuming without a config: the run's own (load_config's rule),
        args.config = resumed_run_config(args.overrides)  # named for the ranks' command line
    cfg = load_config(args.config, args.overrides, job="train")
    source = config_source(args.config, args.overrides)
    from hpcvla import preflight  # packages, files and devices this config needs
    if args.ranks is None and launcher_rank() is None:  # a bare process: start the world
        args.ranks = cfg.launch.ranks
    if args.ranks is None:  # we are a rank of a world someone else started
        from hpcvla.job.runtime import run_ranks, train_main
        preflight.check_host(cfg, source)  # its node, on each rank; the rest: one rank, for all
        return run_ranks(cfg, train_main, lambda c, p: preflight.check_world(c, p, source),
                         "train")
    plan = plan_from_config(cfg.placement, args.ranks)
    checked = preflight.check_launch(cfg, plan, source)  # refused here, before any rank starts
    from hpcvla.job.launch import run_local_world
    config = [args.config] if args.config else []
    return run_local_world(args.ranks, ["train", *config, *args.overrides], cfg, checked)


def cmd_sft(args) -> int:
    if args.config is None:  # as train's: the resumed run's own, else the built-in defaults
        args.config = resumed_run_config(args.overrides)
    cfg = load_config(args.config, args.overrides, job="sft")
    source = config_source(args.config, args.overrides)
    from hpcvla import preflight  # the settings, this machine, the demonstrations vs the env
    preflight.check_host(cfg, source)  # its node, on each rank of a world
    preflight.check_sft(cfg, source, args.ranks)
    if args.ranks is None:  # a rank of a world someone started, or a world of one
        from hpcvla.imitation.sft import run_sft
        return run_sft(cfg)
    from hpcvla.job.launch import run_local_world
    config = [args.config] if args.config else []
    return run_local_world(args.ranks, ["sft", *config, *args.overrides], cfg)


def cmd_plan(args) -> int:
    from hpcvla.envs import check_env, env_spec
    cfg = load_config(args.config, args.overrides, job=args.job)
    check_env(cfg)  # the env's own settings and the folder's: the spec and sizes need them
    from hpcvla.preflight import checkpoint_problems
    from hpcvla.weight_checks import check_pretrained
    check_pretrained(cfg, config_source(args.config, args.overrides))
    # the checkpoints the job would start from: refused by the job, so by its plan
    if problems := checkpoint_problems(cfg, ("sft.steps", cfg.sft.steps) if args.job == "sft"
                                       else ("pipeline.total_updates", None)):
        raise ConfigError(problems, config_source(args.config, args.overrides))
    if not args.auto and (args.search_envs or args.costs != "config"):
        raise PlanError("--search-envs and --costs choose how --auto searches: add --auto")
    if args.job == "sft" and args.auto:
        raise PlanError("--auto lays out train's roles; an sft world is learners only: drop it")
    if args.job == "sft":  # every rank a learner, a GPU each
        return plan_sft(cfg, args.world, args.ranks_per_node, args.json)
    if args.auto:  # the scale model's best layout (hpcvla/scale/autoplan.py)
        from hpcvla.scale.autoplan import print_auto_plan
        return print_auto_plan(cfg, args.world, args.ranks_per_node, args.costs, args.json,
                               args.search_envs)
    plan = plan_from_config(cfg.placement, args.world, args.ranks_per_node)
    from hpcvla.memory.layout import layout_devices, plan_memory
    from hpcvla.schedule import config_layout_problems
    devices = layout_devices(cfg, plan)  # this host's GPUs, unless previewing others
    memory = plan_memory(cfg, plan, devices, env_spec(cfg.env))
    refused = config_layout_problems(cfg, plan)  # what `train` would refuse on this plan
    said = [f"hpcvla plan: {why}: {name} = {value!r}: expected {text}"
            for why, problems in (("does not fit", memory.problems),
                                  ("train refuses it", refused))
            for name, value, text in problems]
    for line in said:  # before the map: a reader of its head sees them
        print(line, file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({**plan.to_dict(), "devices": {str(r): d for r, d in devices.items()},
                          "memory": memory.to_dict(), "refused": said}, indent=1))
    else:
        print(plan.table(devices, memory.columns()))
        print(memory.summary())
    return 2 if said else 0


def cmd_config(args) -> int:
    if args.doc is not None:  # the settings' docs; given a config, its values there too
        if args.doc.endswith((".yaml", ".yml")):  # `--doc CONFIG`: a config, every setting
            args.config, args.doc = args.doc, ""
        elif "=" in args.doc:  # `--doc key=value`: an override
            args.overrides, args.doc = [args.doc, *args.overrides], ""
        given = args.config or args.overrides
        print(settings_doc(as_read(load_config(args.config, args.overrides)) if given else None,
                           args.doc), end="")
        return 0
    cfg = load_config(args.config, args.overrides, job=args.job)
    print(yaml.safe_dump(config_to_dict(as_read(cfg)), sort_keys=False), end="")
    return 0


def cmd_launch(args) -> int:
    from hpcvla.job.launch import run_world
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if program[:1] == ["hpcvla"]:  # `-- hpcvla eval RUN`, as the command is typed alone
        program = program[1:]
    return run_world(args.n, program, args.mpiexec, args.timeout, args.mpi)


def cmd_export(args) -> int:
    from hpcvla.checkpoint.catalog import CheckpointError, path_problem, run_and_checkpoint
    from hpcvla.evaluate import run_config
    from hpcvla.export import export_policy
    if problem := path_problem(Path(args.run_dir)):
        return refused("export", problem)
    run_dir, chosen = run_and_checkpoint(Path(args.run_dir))
    try:
        cfg = load_config(run_config(run_dir), record=True)
        print(export_policy(cfg, run_dir, Path(args.out), args.format, chosen)["summary"])
    except (ConfigError, CheckpointError, ValueError) as err:
        print(f"hpcvla export: {err}", file=sys.stderr)
        return 2
    return 0


COMMANDS = {"train": cmd_train, "sft": cmd_sft, "bench": bench_command, "plan": cmd_plan,
            "config": cmd_config, "doctor": doctor_command, "launch": cmd_launch,
            "inspect": inspect_command, "eval": eval_command, "demos": demos_command,
            "export": cmd_export}
