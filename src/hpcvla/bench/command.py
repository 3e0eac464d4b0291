"""`hpcvla bench TARGET`: the benchmarks' command line (its parser and dispatch), kept with
the benchmarks so the top-level command (cli.py) stays a table of commands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpcvla.config import whole_number

# The options each target reads besides --json and --quick; one set for a target that does not
# read it would change nothing, so it is refused before anything runs (_options_problem).
READS = {
    "transport": ("ranks", "ranks_per_node"),
    "modes": ("workload", "gpus", "updates", "sweep", "modes"),  # emulated: + EMULATED_READS
    "learning": ("overrides", "updates", "seeds", "arms", "config", "demos", "demo_noise",
                 "setting", "eval_episodes"),
    "policies": (), "memory": (), "gpu": (),
    "scale": ("chart",), "scale --validate": ("validate", "preset", "updates"),
    "shards": ("workload", "shards"),
    "checkpoint": ("overrides", "updates"),
    "fullsize": ("out", "steps", "updates"),
    "dump": (),
}
EMULATED_READS = ("preset", "max_staleness")  # modes: the emulated workload's stage costs
RECIPE_TARGETS = ("learning", "checkpoint", "fullsize", "memory")  # they run configs/*.yaml


def add_bench_parser(sub) -> None:
    """The `bench` subcommand and its options, on the top-level parser's subparsers."""
    bench = sub.add_parser("bench", help="benchmarks; print a table and write JSON")
    bench.add_argument("target", choices=["transport", "modes", "learning", "policies", "shards",
                                          "gpu", "scale", "memory", "checkpoint", "fullsize",
                                          "dump"],
                       help="what to measure; `learning` and `checkpoint` also take key=value "
                            "overrides for every run (e.g. policy.name=flow)")
    bench.set_defaults(overrides=[])
    bench.add_argument("--json", default=None, help="write the results here")
    bench.add_argument("--out", default="runs/bench-fullsize",
                       help="fullsize: the folder for its logs, runs and pretrained folders")
    bench.add_argument("--steps", default=None,
                       help="fullsize: only these steps, comma-separated (plan, streamer, sync, "
                            "lora, openmpi, sigterm, oft, sft, refuse; default all)")
    bench.add_argument("--ranks", type=whole_number(1), default=None,
                       help="transport: start this many ranks here (default: the current MPI "
                            "world)")
    bench.add_argument("--quick", action="store_true", help="small sizes, one repeat (CI)")
    bench.add_argument("--ranks-per-node", type=whole_number(1), default=4,
                       help="transport: emulated node size for the weight plane (default 4)")
    bench.add_argument("--workload", choices=["emulated", "real", "maniskill", "libero"],
                       default="emulated",
                       help="modes, shards: calibrated stage delays, the real reach "
                            "env/policy/learner, or a real simulator (rendered observations, "
                            "tiny policy)")
    bench.add_argument("--preset", choices=["balanced", "table3"], default="balanced",
                       help="modes --workload emulated, scale --validate: stage costs (see "
                            "hpcvla/scale/presets.py)")
    bench.add_argument("--gpus", type=whole_number(1), default=2,
                       help="modes: accelerator ranks (even, or 1: one GPU shared)")
    bench.add_argument("--updates", type=whole_number(1), default=None,
                       help="modes: updates per mode (default 20); learning: per run (200); "
                            "checkpoint: per run (8); fullsize: per run (20); scale "
                            "--validate: per case (10)")
    bench.add_argument("--seeds", type=whole_number(1), default=3, help="learning: seeds per arm")
    bench.add_argument("--arms", default="modes",
                       choices=["modes", "critic", "flow-noise", "flow-sde", "flow-sde-step",
                                "dsrl", "dsrl-state",
                                "families", "off-policy", "imitation", "prior-data",
                                "scratch", "dsrl-sft", "setting"],
                       help="learning: streamer vs sync-colocated, the critic's own schedule "
                            "(its rate, unclipped, 8 epochs) vs a shared one (the policy's "
                            "rate, clipped, 4 epochs), flow last_step vs chain (and "
                            "random_step vs last_step; random_step's step as RLinf's "
                            "flow-SDE vs learned) from a pretrained checkpoint, DSRL (SAC on the "
                            "noise) vs PPO from it, "
                            "DSRL's actor on the state alone vs on everything, "
                            "the flow vs the tokens head on reach "
                            "(32 px), SAC vs PPO on reach (sync-colocated), or streamer vs "
                            "sync-colocated on ManiSkill PushCube "
                            "from an SFT start, or RLPD vs PPO from an SFT start on PushCube "
                            "from the same 16 demonstrations, or SAC vs PPO from scratch "
                            "there, or DSRL (its actor on the state) vs GRPO from the flow "
                            "policy's SFT on PushCube, or a recipe (--config) with vs "
                            "without --setting's changes "
                            "(hpcvla/bench/learning.py)")
    bench.add_argument("--config", default=None,
                       help="learning --arms imitation, prior-data, scratch, dsrl-sft or "
                            "setting (required with setting): the task recipe its demonstrations, "
                            "SFT and both arms run (default configs/maniskill_pushcube.yaml, "
                            "configs/maniskill_pushcube_sac.yaml for the off-policy sets, "
                            "configs/maniskill_pushcube_flow.yaml for dsrl-sft; e.g. "
                            "configs/maniskill_pushcube_flow.yaml, "
                            "configs/maniskill_pickcube_sac.yaml)")
    bench.add_argument("--demos", type=whole_number(1), default=None,
                       help="learning --arms imitation, prior-data, dsrl-sft or "
                            "setting: scripted-expert demonstrations the SFT start (and "
                            "RLPD) learns from (default 64, 16, 64, and none for setting: "
                            "a fresh policy; the recipe's comment gives its "
                            "count, e.g. 256 for configs/maniskill_pushcube_tokens.yaml)")
    bench.add_argument("--demo-noise", type=float, default=None,
                       help="learning --arms imitation, prior-data, dsrl-sft or "
                            "setting: std of the Gaussian noise on the expert's arm "
                            "actions in those demonstrations (`hpcvla demos --noise`; default "
                            "0.1; 0 for configs/reach_oft_l1.yaml, whose comment says why)")
    bench.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                       help="learning --arms setting: a change the `changed` arm makes to the "
                            "recipe (repeat for several), e.g. "
                            "algorithm.lr_warmup_versions=10; the positional key=value "
                            "overrides go to both arms")
    bench.add_argument("--eval-episodes", type=whole_number(1), default=256,
                       help="learning: hpcvla eval episodes per final checkpoint (fixed states)")
    bench.add_argument("--shards", type=whole_number(1), default=2,
                       help="shards: env shards (worker processes) of one simulator rank")
    bench.add_argument("--sweep", choices=["batching", "envs", "auto"], default=None,
                       help="modes: B_max x T_max grid for the streamer, envs per simulator "
                            "for streamer vs sync-colocated, or each of the two at the layout "
                            "`plan --auto --search-envs` picks for it (the streamer also under "
                            "bounds S+1 and S+2), instead of the ladder")

    bench.add_argument("--modes", default=None,
                       help="modes: only these execution modes, comma-separated (default: all "
                            "five), e.g. sync-colocated,streamer")
    bench.add_argument("--max-staleness", type=whole_number(0), default=2,
                       help="modes --workload emulated: the staleness bound the async modes "
                            "run under (pipeline.max_staleness; the planner uses it whole; "
                            "the other workloads run at the config's, 1)")
    bench.add_argument("--chart", default=None,
                       help="scale: draw the 8 -> 256 GPU prediction here (PNG)")
    bench.add_argument("--validate", action="store_true",
                       help="scale: run emulated layouts for real and compare the model's "
                            "predictions (hpcvla/scale/validate.py)")


def _options_problem(args) -> str:
    """The options set on the command line that `args.target` does not read, named; '' if
    none."""
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    defaults = vars(parser.parse_args(["bench", args.target]))  # every option at its default
    reads = {"target", "json", "quick", *READS[f"{args.target} --validate" if
                                               args.target == "scale" and args.validate
                                               else args.target]}
    if args.target == "modes" and args.workload == "emulated":
        reads.update(EMULATED_READS)
    unread = [name for name, default in defaults.items()
              if name not in reads and getattr(args, name) != default]
    if not unread:
        return ""
    named = ["key=value overrides" if name == "overrides" else "--" + name.replace("_", "-")
             for name in unread]
    target = args.target + (f" --workload {args.workload}" if args.target == "modes" else
                            " --validate" if args.target == "scale" and args.validate else "")
    return (f"{', '.join(named)}: not read by `hpcvla bench {target}`, so it would change "
            "nothing (`hpcvla bench --help` says which target reads which option)")


def _modes_problem(args) -> str:
    """What `bench modes` cannot run, named; '' if nothing."""
    from hpcvla.schedule import MODES
    unknown = sorted(set(args.modes.split(",") if args.modes else ()) - set(MODES))
    if unknown:
        return f"--modes {','.join(unknown)}: no such mode (the modes: {','.join(MODES)})"
    if args.gpus > 1 and args.gpus % 2:
        return (f"--gpus {args.gpus}: an even number (half inference, half learners), or 1 "
                "(one GPU shared)")
    if args.sweep == "auto" and args.workload != "emulated":
        return "--sweep auto: the emulated workload only (the planner takes its stage costs " \
            "from the preset)"
    return ""


def _target_problem(args) -> str:
    """What the target's own options cannot run, named; '' if nothing: refused before any
    run starts (a full-size folder is built for minutes, a learning arm trains for hours)."""
    if args.target == "modes":
        return _modes_problem(args)
    if args.target == "fullsize":
        from hpcvla.bench.fullsize import STEPS
        unknown = [name for name in (args.steps.split(",") if args.steps else ()) if name
                   not in STEPS]
        return f"--steps {','.join(unknown)}: no such step (the steps: {','.join(STEPS)})" \
            if unknown else ""
    return _learning_problem(args) if args.target == "learning" else ""


def _learning_problem(args) -> str:
    """What `bench learning`'s arm options cannot run, named; '' if nothing."""
    from hpcvla.bench.learning import RECIPE_ARMS
    demo_args = args.demos is not None or args.demo_noise is not None
    recipes = [*RECIPE_ARMS, "setting"]
    if args.arms not in recipes and (args.config or demo_args):
        return (f"--config, --demos and --demo-noise set a task recipe, which --arms "
                f"{args.arms} does not take: add --arms {', '.join(recipes)}")
    if (args.arms == "setting") != bool(args.setting):
        return ("--setting KEY=VALUE and --arms setting go together (a recipe with the "
                "settings changed against it as it is)")
    if args.arms == "setting" and not args.config:
        return "--arms setting needs --config: the recipe both arms run"
    if args.arms == "scratch" and demo_args:
        return "--demos and --demo-noise with --arms scratch: its arms start without " \
            "demonstrations"
    if args.demo_noise is not None and args.demo_noise < 0:
        return f"--demo-noise must be >= 0, got {args.demo_noise}"
    return ""


def _outputs_problem(args) -> str:
    """What of --json, --chart and fullsize's --out cannot be written, named; '' if all can,
    the files' folders made: a benchmark writes its results at its end, after minutes or
    hours (fullsize makes its --out as it starts)."""
    from hpcvla.preflight import unwritable
    folders = {"out": args.out} if args.target == "fullsize" else {}
    for flag in ("json", "chart"):
        if path := getattr(args, flag):
            if Path(path).is_dir():
                return f"--{flag} {path}: a folder; name the file to write"
            folders[flag] = str(Path(path).parent)
    for flag, folder in folders.items():
        if why := unwritable(folder):
            return f"--{flag} {getattr(args, flag)}: cannot be written there ({why})"
    for flag, folder in folders.items():
        if flag != "out":  # (fullsize makes its --out)
            Path(folder).mkdir(parents=True, exist_ok=True)
    return ""


def bench_command(args) -> int:
    """Run the benchmark `args.target` names."""
    problem = _options_problem(args)
    if args.target in RECIPE_TARGETS and not Path("configs").is_dir():
        problem = (f"its workloads are the repository's recipes (configs/*.yaml): run it from "
                   f"the repository's root, not {Path.cwd()}")
    problem = problem or _target_problem(args) or _outputs_problem(args)  # (folders made last)
    if problem:
        print(f"hpcvla bench {args.target}: {problem}", file=sys.stderr)
        return 2
    if args.target == "policies":  # one process: parameter counts and step times
        from hpcvla.bench import policies
        policies.run(quick=args.quick, json_path=args.json)
        return 0
    if args.target == "memory":  # one process per measured learner
        from hpcvla.bench import memory
        memory.run(quick=args.quick, json_path=args.json)
        return 0
    if args.target == "dump":  # one process and its dump writers
        from hpcvla.bench import dump
        dump.run(quick=args.quick, json_path=args.json)
        return 0
    if args.target == "gpu":  # one process; starts the training worlds itself
        from hpcvla.bench import gpu
        gpu.run(quick=args.quick, json_path=args.json)
        return 0
    if args.target == "modes":  # starts one world per mode itself
        from hpcvla.bench import modes
        modes.run(args.workload, args.preset, args.gpus, updates=5 if args.quick else
                  args.updates or 20, json_path=args.json, sweep=args.sweep,
                  staleness=args.max_staleness,
                  only=args.modes.split(",") if args.modes else None)
        return 0
    if args.target == "scale":  # the scale model; --validate starts one world per case
        if args.validate:
            from hpcvla.scale import validate
            validate.run(args.preset, updates=5 if args.quick else args.updates or 10,
                         json_path=args.json)
        else:
            from hpcvla.scale import predict
            predict.run(json_path=args.json, chart_path=args.chart)
        return 0
    if args.target == "shards":  # one process and its env workers
        from hpcvla.bench import shards
        shards.run(args.workload, args.shards, rounds=4 if args.quick else 20,
                   json_path=args.json)
        return 0
    if args.target == "fullsize":  # starts one world per run itself
        from hpcvla.bench import fullsize
        steps = args.steps.split(",") if args.steps else None  # None: every step
        return fullsize.run(args.out, quick=args.quick, json_path=args.json,
                            updates=args.updates or (2 if args.quick else 20), steps=steps)
    if args.target == "checkpoint":  # starts one world per run itself
        from hpcvla.bench import checkpoint
        checkpoint.run(updates=3 if args.quick else args.updates or 8,
                       repeats=1 if args.quick else 2, overrides=args.overrides,
                       json_path=args.json)
        return 0
    if args.target == "learning":  # starts one world per run itself
        from hpcvla.bench import learning
        from hpcvla.config import ConfigError
        try:
            learning.run(seeds=2 if args.quick else args.seeds,
                         updates=3 if args.quick else args.updates or 200,
                         json_path=args.json, overrides=args.overrides, arms=args.arms,
                         config=args.config, demos=args.demos, demo_noise=args.demo_noise,
                         eval_episodes=32 if args.quick else args.eval_episodes,
                         settings=args.setting)
        except ConfigError as err:  # an arm's settings: all loaded before any arm trains
            print(f"hpcvla bench learning: {err}", file=sys.stderr)
            return 2
        return 0
    if args.ranks is not None:  # start the world here, then run this command inside it
        from hpcvla.job.launch import run_world
        inner = ["bench", args.target, "--ranks-per-node", str(args.ranks_per_node)]
        inner += (["--json", args.json] if args.json else []) + (["--quick"] if args.quick else [])
        return run_world(args.ranks, inner)
    from hpcvla.bench import transport
    transport.run(quick=args.quick, ranks_per_node=args.ranks_per_node, json_path=args.json)
    return 0
