"""`hpcvla demos`: its options and the command (imitation/recording.py records); `hpcvla plan
--job sft`: an SFT world's memory."""

from __future__ import annotations

import json
import sys


def add_demos_parser(sub, config_args) -> None:
    """The `demos` subcommand on the top-level parser's subparsers; `config_args` adds the
    CONFIG and key=value arguments every config-reading command takes."""
    demos = sub.add_parser("demos", help="record demonstrations of a task's scripted "
                                          "expert (ManiSkill's, reach's) in the dump layout "
                                          "(imitation/recording.py)")
    config_args(demos)
    demos.add_argument("--episodes", type=int, required=True, help="episodes to write")
    demos.add_argument("--out", required=True, help="the HDF5 file to write (must not exist)")
    demos.add_argument("--noise", type=float, default=0.0,
                       help="std of Gaussian noise on the expert's arm actions (default 0)")
    demos.add_argument("--successful-only", action="store_true",
                       help="write only successful episodes, until --episodes of them")
    demos.add_argument("--policy", metavar="RUN_DIR",
                       help="DAgger: this run's policy (its newest checkpoint) acts, and the "
                            "expert labels every observation it reaches")
    demos.add_argument("--deterministic", action="store_true",
                       help="with --policy: the policy's mean action, not a sample")


def demos_command(args) -> int:
    from hpcvla.config import load_config
    from hpcvla.imitation.recording import RecordingError, record, summary_line

    from hpcvla.process import preempt

    cfg = load_config(args.config, args.overrides)
    preempt.install(interactive=True)  # Ctrl-C, SIGTERM: stop after the episode, file whole
    try:
        summary = record(cfg, args.episodes, args.out, args.noise, args.successful_only,
                         args.policy, args.deterministic)
    except RecordingError as err:
        print(f"hpcvla demos: {err}", file=sys.stderr)
        return 2
    print(summary_line(summary), flush=True)
    return 0 if summary["stopped_by"] is None else 128 + summary["stopped_by"]


def plan_sft(cfg, world: int, per_node: int | None, as_json: bool) -> int:
    """`hpcvla plan --job sft`: a world of `world` learners, `per_node` to a node, each on a GPU
    of its own where the nodes have GPUs (this host's, or placement.gpus_per_node's preview):
    every learner's GPU and host figures (memory/sft_eval.sft_memory); exit 2 where they
    overfill a GPU, saying what fits."""
    from hpcvla.envs import env_spec
    from hpcvla.memory.layout import layout_gpus
    from hpcvla.memory.sft_eval import sft_memory

    per_node, gpus = per_node or world, layout_gpus(cfg)
    memory = sft_memory(cfg, [r // per_node for r in range(world)], gpus, env_spec(cfg.env))
    if as_json:
        print(json.dumps({"world": world, "ranks_per_node": per_node, "memory": memory.to_dict()},
                         indent=1))
    else:
        columns = memory.columns()
        print(f"hpcvla sft: {world} learner(s), {per_node} per node, "
              + ("a GPU each" if gpus else "on CPUs")
              + f"; {memory.batch[2]}\n{'rank':>5} {'node':>4}  {'device':<7} "
              + "".join(f"{h:>9}" for h in columns))
        for rank, node in memory.node.items():
            print(f"{rank:>5} {node:>4}  {memory.device[rank]:<7} "
                  + "".join(f"{col.get(rank, '-'):>9}" for col in columns.values()))
        print(memory.summary())
    for name, value, text in memory.problems:
        print(f"hpcvla plan: does not fit: {name} = {value!r}: expected {text}", file=sys.stderr)
    return 2 if memory.problems else 0
