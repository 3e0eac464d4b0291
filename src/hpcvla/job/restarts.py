"""What jobs/launch.sh asks of a job's runs at each start of its world, and what a restart
inside the allocation loses, recorded with the run: `python -m hpcvla.job.restarts WHAT`.

At a job's start,

    python -m hpcvla.job.restarts job-run JOB_RUN_ROOT {train,sft} CONFIG [OVERRIDES...]

prints the run the command names (run.resume, in the config or its overrides) and the state
of that run, or else of the job's newest, against the end the command runs to (`job_run`: a
complete one is not trained again). Before any start of a job's world,

    python -m hpcvla.job.restarts resumable JOB_RUN_ROOT

prints the run that start continues (`resumable_run`), if there is one (JOB_RUN_ROOT, here and
below: the job's run root, or the run the job names by run.resume=); and with
HPCVLA_AUTOPLAN=COSTS,

    python -m hpcvla.job.restarts auto CONFIG [OVERRIDES...] --world M --ranks-per-node K \
        --costs COSTS [--first-world W --first-layout OVERRIDE ...]

prints the scale model's best layout for the start's nodes (`hpcvla plan --auto`'s) as
overrides, one a line; at a restart, then those that keep the version batch of the job's first
world (W ranks laid out by its overrides) on the learners the layout leaves
(`auto_overrides`).

When a world fails, jobs/launch.sh starts it again on the nodes left (HPCVLA_RESTARTS), from
the newest checkpoint. First

    python -m hpcvla.job.restarts newest-version JOB_RUN_ROOT

prints the policy version of that checkpoint (`newest_version`, -1 when there is none): a
world that fails before its run's first checkpoint, or again before a newer one exists, is not
started again (`checkpoint-every {train,sft} CONFIG [OVERRIDES...]` prints the interval, which
the job checks at its start). Then

    python -m hpcvla.job.restarts fit CONFIG [OVERRIDES...] --world M --ranks-per-node K \
        --from-world W [--command sft]

prints what the restart adds to the run's overrides for its placement to fit the nodes left
(`fitting_overrides`): the same placement rules, with fewer cells, and with fewer learners
where the learners would outnumber the producers left (learner nodes keep their ranks; those
beyond are spare; an `hpcvla sft` world is learners only, any number of them); and, where
fewer learners are left than the failed world of W ranks had, the learner.micro_batches that
keep the version's batch (sft: the sft.micro_batches, and sft.batch_size where needed, that
keep a step's chunks) (`batch_keeping_overrides`: none keeps it, no restart). Last,

    python -m hpcvla.job.restarts record JOB_RUN_ROOT STATUS "DROPPED NODES" "NODES LEFT" RANKS

appends one line to the run's `restarts.jsonl` and prints it: when, the exit status, the
nodes dropped and kept, the policy version it resumes from, and the work lost: the env steps
the learners had trained beyond that checkpoint (from metrics.jsonl), trained again after the
restart from fresh trajectories (those in flight are dropped, none is trained twice); for an
`hpcvla sft` run the steps beyond its checkpoint's, trained again on the same batches (the
checkpoint counts the chunks trained: imitation/sft.py). summary.json carries the list
(`restarts`, read by metrics/restart_log.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from hpcvla.checkpoint.catalog import CheckpointError, by_sft, latest, read_state
from hpcvla.config import (ConfigError, config_argument, last_run_config, load_config,
                           resumed_run_config)
from hpcvla.config.loader import with_overrides
from hpcvla.metrics import restart_log
from hpcvla.files import read_log
from hpcvla.process.last_progress import TAIL_BYTES
from hpcvla.scale.presets import COST_NAMES
from hpcvla.schedule import micro_batches_for
from hpcvla.topology.plan import PlanError, plan_from_config


def newest_run(run_root: Path) -> Path | None:
    """The run directory a restart continues: the newest one under the job's run root, or
    `run_root` itself where it is a run (a job that continues a run it names, run.resume=)."""
    if (Path(run_root) / "config.yaml").is_file():
        return Path(run_root)
    configs = sorted(Path(run_root).glob("*/config.yaml"), key=lambda p: p.stat().st_mtime)
    return configs[-1].parent if configs else None


def resumable_run(run_root: Path) -> Path | None:
    """The run of a job that a (re)start continues: its newest run, if that run's newest
    checkpoint is short of the run's end (pipeline.total_updates; an `hpcvla sft` run's:
    sft.steps)."""
    run = newest_run(run_root)
    point = latest(run) if run is not None else None
    if point is None:
        return None
    cfg = load_config(last_run_config(run), record=True)  # a resume may have moved the end
    total = cfg.sft.steps if by_sft(point) else cfg.pipeline.total_updates
    return run if read_state(point)["version"] < total else None


def stopped_run(run_root: Path) -> Path | None:
    """The job's newest run if its last start was stopped by a signal short of its end
    (summary.json's `preempted`, its newest checkpoint, if any, short of the end: a signal in
    the teardown after the last checkpoint stopped nothing), else None."""
    run = newest_run(run_root)
    if run is None:
        return None
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    short = latest(run) is None or resumable_run(run) is not None
    return run if isinstance(summary, dict) and summary.get("preempted") and short else None


def job_run(cfg, command: str, run_root: Path) -> tuple[str, str]:
    """What a job's command continues, before its first world: the run it names (cfg's
    run.resume; '' for none) and the state, against the end the command runs to (sft.steps,
    pipeline.total_updates), of that run or else of the newest under the job's `run_root`:
    '' (no run), `none` (no checkpoint), `resumable` or `complete`."""
    named = str(cfg.run.resume or "")
    where = Path(named) if named else run_root
    version = newest_version(where)
    end = cfg.sft.steps if command == "sft" else cfg.pipeline.total_updates
    state = "none" if version < 0 else "resumable" if version < end else "complete"
    return named, state if named or newest_run(where) is not None else ""


def newest_version(run_root: Path) -> int:
    """The policy version of the newest checkpoint of the job's run (an `hpcvla sft` run's:
    its step); -1 when there is none."""
    run_dir = newest_run(run_root)
    point = latest(run_dir) if run_dir is not None else None
    return read_state(point)["version"] if point is not None else -1


def record(run_root: Path, status: int, dropped: list[str], nodes: list[str],
           ranks: int) -> dict | None:
    """Append this restart to the run's restarts.jsonl; None when there is no run yet."""
    run_dir = newest_run(run_root)
    if run_dir is None:
        return None
    point = latest(run_dir)
    state = read_state(point) if point is not None else {"version": 0, "counters": {}}
    # what the run counts its work in: train's env steps; `hpcvla sft`'s steps (= version)
    sft = point is not None and by_sft(point)
    work, kept = ("steps", state["version"]) if sft else \
        ("env_steps", state["counters"].get("trained_env_steps", 0))
    trained = kept
    metrics = run_dir / "metrics.jsonl"
    key = "step" if sft else "trained_env_steps"
    for record in reversed(read_log(metrics, TAIL_BYTES) if metrics.exists() else []):
        if isinstance(record, dict) and key in record:  # (a line cut short is none)
            trained = record[key]
            break
    trained = max(trained, kept)  # metrics.jsonl's last line may be older than a checkpoint
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "exit_status": status,
             "dropped_nodes": dropped, "nodes": nodes, "ranks": ranks,
             "resumed_from_version": state["version"], f"trained_{work}": trained,
             f"lost_{work}": max(0, trained - kept)}
    restart_log.append(run_dir, entry)
    return entry


def fitted_placement(placement, world: int, ranks_per_node: int):
    """`placement` made to fit `world` ranks in nodes of `ranks_per_node`: itself when it fits
    as it is; with placement.learners=P when only the learners outnumbering the P producers
    stand in the way. Raises the plan's PlanError when neither fits."""
    try:
        plan_from_config(placement, world, ranks_per_node)
        return placement
    except PlanError as err:
        if placement.mode != "disaggregated":
            raise
        reason = err
    try:  # as many learners as there are producers, if that is what is missing
        cells = len(plan_from_config(dataclasses.replace(placement, learners=1), world,
                                     ranks_per_node).cells)
        fitted = dataclasses.replace(placement, learners=cells)
        plan_from_config(fitted, world, ranks_per_node)
    except PlanError:
        raise reason from None
    return fitted


def fitting_overrides(placement, world: int, ranks_per_node: int) -> list[str]:
    """fitted_placement as overrides: none, or `placement.learners=P`."""
    fitted = fitted_placement(placement, world, ranks_per_node)
    return [] if fitted == placement else [f"placement.learners={fitted.learners}"]


def batch_keeping_overrides(cfg, from_world: int, world: int, ranks_per_node: int,
                            command: str = "train") -> list[str]:
    """`learner.micro_batches=K` where the restart's fitted placement leaves fewer learners
    than the failed world of `from_world` ranks had: each learner trains micro_batch x
    micro_batches segments a version, so the version's batch would shrink with them (a
    different experiment: the same learning rate on fewer samples). K keeps it, and with it
    every producer's share; under sac/rlpd, where K is also each gradient step's passes, so
    does algorithm.utd x (learners left / before): the gradient steps a version and their
    batch stay. Raises PlanError where no whole K does. An `hpcvla sft` world: sft_keeping."""
    if command == "sft":
        return sft_keeping(cfg.sft, from_world, world)
    placement = fitted_placement(cfg.placement, world, ranks_per_node)
    before = len(plan_from_config(cfg.placement, from_world, ranks_per_node).learners)
    after = len(plan_from_config(placement, world, ranks_per_node).learners)
    learner = cfg.learner
    return learner_keeping(cfg, before * learner.micro_batch * learner.micro_batches, before,
                           after, from_world)


def learner_keeping(cfg, segments: int, before: int, after: int, from_world: int) -> list[str]:
    """batch_keeping_overrides' for `after` learners of `cfg` where `before` trained a
    version's `segments` (in a world of `from_world` ranks)."""
    micro_batch, micro_batches = cfg.learner.micro_batch, cfg.learner.micro_batches
    if after * micro_batch * micro_batches == segments:
        return []
    keep = micro_batches_for(segments, after, micro_batch)
    if keep is None:
        raise PlanError(f"{after} learner(s) left of {before}: a version's batch ({segments} "
                        f"segments) is no whole number of learner.micro_batch {micro_batch} "
                        f"micro-batches on each; continue the run on an allocation of "
                        f"{from_world} ranks (run.resume=)")
    kept = [f"learner.micro_batches={keep}"]
    if cfg.algorithm.off_policy and after != before:  # micro_batches are also each gradient
        # step's passes there: the steps a version (utd x a learner's collected steps, L/L'
        # more each) stay too
        kept.append(f"algorithm.utd={cfg.algorithm.utd * after / before:g}")
    return kept


def auto_overrides(config, overrides: list[str], cfg, args) -> list[str]:
    """The `auto` command's: the scale model's best layout for `args.world` ranks; at a
    restart (`args.first_world`), then the learner.micro_batch (kept_micro_batch) and
    micro_batches (and SAC's utd) with which it trains the version batch of the job's first
    world, laid out by `args.first_layout`: a world re-planned on the nodes left keeps the
    run's batch as a fitted restart does (batch_keeping_overrides)."""
    from hpcvla.scale.autoplan import best_overrides  # imports the scale model
    best = best_overrides(cfg, args.world, args.ranks_per_node, args.costs)
    if not args.first_world:
        return best
    first = load_config(config, [*overrides, *args.first_layout])
    now = load_config(config, [*overrides, *best])
    before = len(plan_from_config(first.placement, args.first_world,
                                  args.ranks_per_node).learners)
    after = len(plan_from_config(now.placement, args.world, args.ranks_per_node).learners)
    segments = before * first.learner.micro_batch * first.learner.micro_batches
    micro_batch = kept_micro_batch(first, now, segments, after)
    split = [] if micro_batch == now.learner.micro_batch else \
        [f"learner.micro_batch={micro_batch}"]
    return best + split + learner_keeping(with_overrides(now, split), segments, before, after,
                                          args.first_world)


def kept_micro_batch(first, now, segments: int, after: int) -> int:
    """The learner.micro_batch of a restart's auto-planned layout (`now`) that trains the
    first world's version batch (`segments`) on its `after` learners in whole micro-batches:
    the first world's under sac/rlpd (a micro-batch is also a gradient step's pass there:
    their size stays), else the layout's, or the largest smaller one that divides a learner's
    share (the micro-batches take a learner no more memory than the layout's would)."""
    if now.algorithm.off_policy:
        return first.learner.micro_batch
    share, rest = divmod(segments, after)
    return next((size for size in range(now.learner.micro_batch, 0, -1)
                 if not rest and share % size == 0), now.learner.micro_batch)


def sft_keeping(sft, before: int, after: int) -> list[str]:
    """An `hpcvla sft` world is learners only: a step's chunks (`before` x sft.batch_size x
    micro_batches) shared by the `after` learners left, each in passes of at most
    sft.batch_size chunks (no more memory a pass than before): sft.micro_batches, and
    sft.batch_size where those no longer divide them (3 learners of 8 chunks -> 2 in 2 passes
    of 6). Raises PlanError where the chunks do not split evenly over the learners left."""
    if after == before:
        return []
    chunks = before * sft.batch_size * sft.micro_batches
    share, rest = divmod(chunks, after)
    if rest:
        raise PlanError(f"{after} learner(s) left of {before}: a step's {chunks} chunks ("
                        f"{before} x sft.batch_size {sft.batch_size} x micro_batches "
                        f"{sft.micro_batches}) do not split evenly over them; continue the run "
                        f"on an allocation of {before} ranks (run.resume=)")
    passes = -(-share // sft.batch_size)
    while share % passes:
        passes += 1
    batch = share // passes
    return [f"sft.micro_batches={passes}"] + \
        ([f"sft.batch_size={batch}"] if batch != sft.batch_size else [])


def _main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpcvla.job.restarts")
    sub = parser.add_subparsers(dest="what", required=True)
    rec = sub.add_parser("record", help="append this restart to the run's restarts.jsonl")
    rec.add_argument("run_root", type=Path)
    rec.add_argument("status", type=int)
    rec.add_argument("dropped", help="the nodes dropped, space-separated")
    rec.add_argument("nodes", help="the nodes left, space-separated")
    rec.add_argument("ranks", type=int)
    fit = sub.add_parser("fit", help="the overrides that fit the run to the nodes left")
    fit.add_argument("config", nargs="?", help="YAML config (none: the built-in defaults)")
    fit.add_argument("overrides", nargs="*")
    fit.add_argument("--world", type=int, required=True)
    fit.add_argument("--ranks-per-node", type=int, required=True)
    fit.add_argument("--from-world", type=int, default=0,
                     help="the failed world's ranks: keep its version's batch on fewer learners")
    fit.add_argument("--command", choices=("train", "sft"), default="train",
                     help="the job's command (an sft world is learners only)")
    sub.add_parser("resumable", help="the job's run a start continues, if any").add_argument(
        "run_root", type=Path)
    sub.add_parser("stopped", help="the job's run, if a signal stopped its last start short "
                   "of its end").add_argument("run_root", type=Path)
    auto = sub.add_parser("auto", help="the scale model's best layout for the nodes, as "
                          "overrides, one a line (hpcvla plan --auto's)")
    auto.add_argument("config", nargs="?", help="YAML config (none: the built-in defaults)")
    auto.add_argument("overrides", nargs="*")
    auto.add_argument("--world", type=int, required=True)
    auto.add_argument("--ranks-per-node", type=int, required=True)
    auto.add_argument("--costs", required=True, choices=COST_NAMES,
                      help="as hpcvla plan --auto --costs")
    auto.add_argument("--first-world", type=int, default=0, help="a restart: the job's first "
                      "world's ranks, whose version batch the layout keeps")
    auto.add_argument("--first-layout", action="append", default=[], help="a restart: one of "
                      "the first world's auto-plan overrides (repeated)")
    sub.add_parser("newest-version", help="the policy version of the newest checkpoint of the "
                   "job's run; -1 when there is none").add_argument("run_root", type=Path)
    named = sub.add_parser("job-run", help="the run a job's command names (run.resume), and on "
                           "a line of its own the state of that run or else of the job's newest")
    named.add_argument("run_root", type=Path)
    named.add_argument("command", choices=("train", "sft"))
    named.add_argument("config", nargs="?", help="YAML config (none: the built-in defaults)")
    named.add_argument("overrides", nargs="*")
    every = sub.add_parser("checkpoint-every", help="the run's checkpoint interval (train: "
                           "learner.checkpoint_every, else learner.checkpoint_every_s with "
                           "an `s`; sft: sft.checkpoint_every): 0, and a failed world has "
                           "no checkpoint to restart from")
    every.add_argument("command", choices=("train", "sft"))
    every.add_argument("config", nargs="?", help="YAML config (none: the built-in defaults)")
    every.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.what in ("record", "resumable", "stopped", "newest-version"):  # the job's run
        try:
            if args.what == "record":
                print(json.dumps(record(args.run_root, args.status, args.dropped.split(),
                                        args.nodes.split(), args.ranks)))
            elif args.what in ("resumable", "stopped"):
                run = (resumable_run if args.what == "resumable" else stopped_run)(args.run_root)
                print(run if run is not None else "")
            else:
                print(newest_version(args.run_root))
        except CheckpointError as err:  # launch.sh's `set -e` ends the job saying this
            raise SystemExit(f"hpcvla.job.restarts {args.what}: {err}")
        return
    try:
        config, overrides = config_argument(args.config, args.overrides)
        if config is None:  # `train run.resume=RUN`: the run's own, as hpcvla train reads it
            config = resumed_run_config(overrides)
        cfg = load_config(config, overrides)
        if args.what == "job-run":
            print("\n".join(job_run(cfg, args.command, args.run_root)))
        elif args.what == "checkpoint-every":
            learner = cfg.learner
            print(cfg.sft.checkpoint_every if args.command == "sft" else
                  learner.checkpoint_every or (f"{learner.checkpoint_every_s:g}s"
                                               if learner.checkpoint_every_s else 0))
        elif args.what == "auto":
            print("\n".join(auto_overrides(config, overrides, cfg, args)))
        else:
            fit = [] if args.command == "sft" else fitting_overrides(  # sft: learners only
                cfg.placement, args.world, args.ranks_per_node)
            if args.from_world:
                fit += batch_keeping_overrides(cfg, args.from_world, args.world,
                                               args.ranks_per_node, args.command)
            print(" ".join(fit))
    except (ConfigError, PlanError, CheckpointError) as err:
        raise SystemExit(f"hpcvla.job.restarts {args.what}: {err}")


if __name__ == "__main__":
    _main()
