"""`hpcvla eval RUN_DIR|CHECKPOINT`: the command line (its parser) and what it runs: a run's
checkpoints (or its untrained policy) on fixed initial states, in this process, or by the
ranks of a world (evaluate.py evaluates; this decides what and where, and refuses first)."""

from __future__ import annotations

import json
from pathlib import Path

from hpcvla.config import ConfigError, load_config, whole_number
from hpcvla.config.evaluation import OWN_PROTOCOL
from hpcvla.process.mpi_select import launcher_rank
from hpcvla.process.refusal import refused

# the exit status of an evaluation that gave no verdict on a policy: each of its episodes was
# ended by an env fault (said in its lines); a crash is 1, a refusal 2
NO_VERDICT = 3


def add_eval_parser(sub) -> None:
    evaluate = sub.add_parser("eval", help="success rate of a run's newest checkpoint (or "
                                           "of its untrained policy) on fixed initial states")
    evaluate.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, or one of its "
                                                             "checkpoints/v*/ to evaluate that one")
    evaluate.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                          help="settings changed for the evaluation, e.g. env.suite_task=-1 "
                               "(every task of the suite) for a policy trained on one task")
    evaluate.add_argument("--episodes", type=int, default=128, help="episodes (default 128)")
    evaluate.add_argument("--envs", type=int, default=32,
                          help="envs stepped together (default 32, at most --episodes)")
    evaluate.add_argument("--untrained", action="store_true",
                          help="the policy as the run's config initialises it (with --all "
                               "or a checkpoint's path: first, as version 0, and each "
                               "checkpoint against it, episode by episode)")
    actions = evaluate.add_mutually_exclusive_group()
    actions.add_argument("--deterministic", action="store_true",
                         help="act with each policy's deterministic action (the Gaussian's "
                              "mean, the top token, the flow from x_0 = 0 or from N(0, I) "
                              "noise, where policy.logprob_mode explores from: "
                              "policy.denoise_from; noise is openpi's sampler) instead of "
                              "sampling as training does; ManiSkill's PPO baseline, OFT and "
                              "openpi evaluate this way. The default under a simulator's "
                              "benchmark protocol (eval.protocol=libero)")
    actions.add_argument("--sampled", action="store_true",
                         help="sample actions as training does: the default under "
                              "eval.protocol=hpcvla")
    evaluate.add_argument("--all", action="store_true",
                          help="every checkpoint the run kept, oldest first: a learning curve "
                               "on fixed initial states (keep more: learner.checkpoint_keep)")
    evaluate.add_argument("--json", action="store_true", help="output a JSON line per policy")
    evaluate.add_argument("--video", type=int, default=0, metavar="K",
                          help="also write the first K episodes of every task as MP4 (the "
                               "camera each chunk was chosen from, captioned) to "
                               "RUN_DIR/videos/ (default 0: none)")
    evaluate.add_argument("--ranks", type=whole_number(1), default=None,
                          help="start this many evaluator ranks on this machine, the states "
                               "shared among them (default: one process, or the ranks of the "
                               "srun/mpirun world this runs in)")


def eval_command(args) -> int:
    """`hpcvla eval`: refused before any rank starts where it cannot run; else the policies
    evaluated here, or by the ranks of the world it starts (--ranks) or runs in."""
    from hpcvla.checkpoint import catalog
    from hpcvla.evaluate import (describe, eval_config, eval_problem, evaluate_policies,
                                 run_config, weights_problem, write_curve)
    if problem := catalog.path_problem(Path(args.run_dir)):
        return refused("eval", problem)
    run_dir, chosen = catalog.run_and_checkpoint(Path(args.run_dir))
    if chosen and args.all:
        return refused("eval", f"--all evaluates every checkpoint of a run: give {run_dir}, "
                        "not one of its checkpoints")
    try:
        from hpcvla import preflight
        cfg = eval_config(run_dir, args.overrides, args.untrained)
        source = str(run_config(run_dir))  # the settings the run last ran with
        preflight.check_host(cfg, source)  # its node, each rank
        preflight.check_config(cfg, source)
        preflight.check_env(cfg)  # the simulator, its task or suite
    except ConfigError as err:
        return refused("eval", err)
    trained = load_config(source, record=True)
    # a benchmark's protocol acts as its scripts do (OFT's and openpi's: no sampling)
    deterministic = args.deterministic or (not args.sampled and
                                           cfg.eval.protocol != OWN_PROTOCOL)
    problem = eval_problem(cfg, trained, args.episodes, args.envs, args.video,  # ranks here
                           args.ranks or (None if launcher_rank() is not None else 1))
    if problem:
        return refused("eval", problem)
    policies = [None] if args.untrained else []  # None: the untrained policy
    if chosen:  # the one named
        kept = [chosen]
    else:  # every one (--all) or the newest; none for --untrained alone
        kept = catalog.complete(run_dir) if args.all or not args.untrained else []
    policies += kept if args.all else kept[-1:]  # every one, or the newest
    if not kept and (args.all or not args.untrained):
        return refused("eval", f"{run_dir}: no complete checkpoint "
                        f"(checkpoints/v*/state.json): {catalog.NONE_WRITTEN}")
    try:  # each checkpoint's state and files, and its weights, before any rank starts
        for path in kept:
            catalog.read_state(path)
        problem = None if preflight.checked_by_launcher(cfg) else weights_problem(
            cfg, trained, [p for p in policies if p], args.untrained, bool(args.overrides))
    except catalog.CheckpointError as err:
        problem = str(err)
    if problem:
        return refused("eval", problem)
    if args.ranks is not None:  # start the world here; its ranks come back to this function
        from hpcvla.job.launch import run_local_world, without_ranks
        return run_local_world(args.ranks, without_ranks(args.argv), cfg, {
            preflight.LAUNCH_CHECKED: preflight.launch_checked(cfg, None)})

    def report(world) -> int:
        curve = evaluate_policies(cfg, run_dir, policies, args.episodes, args.envs,
                                  deterministic, world, args.video)
        if world is None or world.Get_rank() == 0:
            print("\n".join(json.dumps(r) if args.json else describe(r) for r in curve))
            if args.all:  # kept with the run: postprocess/report.py draws it with training's
                write_curve(cfg, run_dir, curve)
        # every rank holds the whole curve: the world's ranks exit alike
        return NO_VERDICT if any(not result["episodes"] for result in curve) else 0
    if launcher_rank() is None:  # one process; a damaged checkpoint is said, not traced
        try:
            return report(None)
        except catalog.CheckpointError as err:
            return refused("eval", err)
    from mpi4py import MPI

    from hpcvla.job.runtime import run_guarded
    from hpcvla.topology.comms import check_scheduler_world
    if cfg.launch.check_scheduler:  # N 1-rank worlds would each evaluate every state
        check_scheduler_world(MPI.COMM_WORLD.Get_size())
    return run_guarded(MPI.COMM_WORLD, "evaluator", lambda: report(MPI.COMM_WORLD), "eval")
