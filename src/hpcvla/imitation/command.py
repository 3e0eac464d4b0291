"""`hpcvla demos`: its options and the command (imitation/recording.py records)."""

from __future__ import annotations

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
