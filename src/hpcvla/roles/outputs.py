"""What a training run writes besides its metrics: checkpoints when due, the optional HDF5
trajectory dump of a producer, and at the end `summary.json` with the whole run's busy
fractions in TensorBoard, its start and stop (metrics/phases.py) and every rank's peak memory
beside the memory model's figure (gathered on rank 0). summary.json is the last start's, and
lists every start of a resumed run with its headline figures (`starts`)."""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import yaml

from hpcvla.config.loader import config_to_dict
from hpcvla.files import replace_text
from hpcvla.memory.states import GIB
from hpcvla.metrics import phases, restart_log
from hpcvla.metrics.episode_metrics import figures_in, pooled
from hpcvla.metrics.progress import figure
from hpcvla.metrics.task_success import pooled_rates
from hpcvla.metrics.tensorboard import RunBoard

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

    from hpcvla.config.schema import Config
    from hpcvla.engines import SkipNonfinite
    from hpcvla.envs.base import EnvSpec
    from hpcvla.metrics.dump_writer import TrajectoryDump
    from hpcvla.metrics.progress import Progress
    from hpcvla.metrics.timeline import Timeline
    from hpcvla.policies.base import Policy
    from hpcvla.roles.setup import Counters

    # save(version, full weights (None on the learners that do not hold them), last)
    Save: TypeAlias = Callable[[int, dict[str, torch.Tensor] | None, bool], None]

MEMORY_PLAN = "memory.json"  # the memory model's figures (GPU runs: the weight root, prologue.py)
# the report script of the checkout this package runs from (none where it is installed alone)
REPORT = Path(__file__).resolve().parents[3] / "postprocess" / "report.py"


@dataclass
class RankSummary:
    """One rank's report, an entry of summary.json's `per_rank`: the pipeline fills what
    every rank has; the role adds what it counted (`counters`: env faults, the staleness
    histogram, ring and forward-pass counts, ... by the names the role keeps them under)."""
    rank: int
    role: str
    host: str
    device: str
    dtype: str
    first_version: int
    threads: int = 0  # its torch's (process/threads.py); 0: a rank without the policy
    env_steps: int = 0
    wall_s: float = 0.0
    # from all_ranks_ready to the end of this rank's last timeline span: its work, without
    # what follows it (the dump writer's backlog, the teardown, waiting for the others)
    active_s: float = 0.0
    preempted: bool = False
    # the process's CPU seconds in wall_s (every thread, user and system, and its env workers'
    # and dump writer's, reaped before the report): beside busy_s, what its waits cost
    cpu_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)
    peak_memory: dict[str, int] = field(default_factory=dict)
    busy_s: dict[str, float] = field(default_factory=dict)
    planned_memory: dict[str, int] | None = None  # the memory model's (GPU runs)
    # a learner's learning figures: over its last episodes (`ended_episodes` of them: its
    # rolling window, not every episode that ended; None before one ended), the env-fault
    # episodes it left out; the run's trained env steps on the weight root
    success_rate: float | None = None
    mean_return: float | None = None
    mean_episode_chunks: float | None = None
    ended_episodes: int = 0
    # a learner's windows per task of a multi-task suite ({instruction: [successes,
    # episodes]}: metrics/task_success.py), pooled into summary.json's per_task_success
    task_outcomes: dict[str, list[int]] | None = None
    # a learner's windows of the env's episode metrics ({name: [sum, count]}:
    # metrics/episode_metrics.py), pooled into summary.json's episode_<name>
    episode_metrics: dict[str, list[float]] | None = None
    trained_env_steps: int | None = None
    env_fault_episodes: int | None = None
    counters: Counters = field(default_factory=dict)

    def add(self, counted: Counters) -> None:
        """What a role returned: its env steps, and its counters."""
        counted = dict(counted)
        self.env_steps += counted.pop("env_steps", 0)
        self.counters.update(counted)

    def to_dict(self) -> Counters:
        """As summary.json holds it: the counters beside the fields, a field no one set
        (None) left out."""
        out = {k: v for k, v in asdict(self).items()
               if v is not None and k not in ("counters", "task_outcomes", "episode_metrics")}
        return {**out, **self.counters}


def checkpointer(cfg: Config, engine: SkipNonfinite, learners: MPI.Comm, run_dir: Path,
                 progress: Progress, timeline: Timeline,
                 counters: Callable[[], dict[str, int]] = dict) -> Save:
    """save(version, full weights, last): a checkpoint when one is due or the run ends
    (collective on the learners), with the trained env steps and what `counters()` adds
    (the off-policy learner's count of transitions that entered its buffers). With
    learner.checkpoint_background it is written in the background (checkpoint/store.py's
    Writer): training waits only for the snapshot, and for the previous checkpoint if that is
    still being written. The last one is complete when save returns."""
    from hpcvla.checkpoint import store  # torch: here, on the learners, not on every rank
    from hpcvla.transport.backoff import idle_bcast
    writer = store.Writer(cfg.learner.checkpoint_background)
    # what every learner trains a version together (catalog.batch_change reads it back)
    batch = learners.Get_size() * cfg.learner.micro_batch * cfg.learner.micro_batches
    every, every_s = cfg.learner.checkpoint_every, cfg.learner.checkpoint_every_s
    saved_at = [time.monotonic()]

    def due(version: int, last: bool) -> bool:
        if every < 0:
            return False
        if last or (every and version % every == 0):
            return True
        if not every_s:
            return False
        late = time.monotonic() - saved_at[0] >= every_s  # the first learner's clock decides
        if learners.Get_size() == 1:
            return late
        return bool(idle_bcast(learners, lambda: late))  # [dist] asleep while it publishes

    def save(version: int, weights: dict[str, torch.Tensor] | None, last: bool) -> None:
        writer.check()  # the last checkpoint's write, if it failed
        if due(version, last):
            with timeline.span("checkpoint"):
                writer.save(run_dir, engine, weights, version,  # [dist] the learners
                            {"trained_env_steps": progress.steps, "version_segments": batch,
                             **counters()}, learners,
                            keep=cfg.learner.checkpoint_keep, wait=last)
            saved_at[0] = time.monotonic()
    return save


def trajectory_dump(cfg: Config, spec: EnvSpec, policy: Policy, rank: int, run_dir: Path,
                    seed_of_slot: Callable[[int], int], start_version: int,
                    producers: Collection[int]) -> TrajectoryDump | None:
    """This producer's HDF5 trajectory dump (metrics/dump.py), or None when not asked for.
    It holds the observations and what the policy records beside them (extra_fields), up to
    its share of run.dump_max_gib among the world's `producers` (dump_share)."""
    if not cfg.run.dump_trajectories:
        return None
    from hpcvla.metrics.dump_writer import TrajectoryDump
    keys = list(spec.obs) + list(policy.extra_fields())
    folder = run_dir / "trajectories"
    return TrajectoryDump(folder / f"rank{rank}.h5", rank, keys,
                          spec.vocab, seed_of_slot, cfg.env.name, spec.chunk_len,
                          yaml.safe_dump(config_to_dict(cfg), sort_keys=False),
                          cfg.run.dump_flush_s, start_version=start_version,
                          in_process=False,  # a writer process: the rank's time is its steps
                          max_bytes=dump_share(cfg.run.dump_max_gib, folder, producers))


def dump_share(max_gib: float, folder: Path, producers: Collection[int]) -> int:
    """Each producer's share of run.dump_max_gib, in bytes (0: no limit): the limit less the
    dumps in `folder` that none of this world's producers writes (an earlier start's on
    other ranks: a restart on fewer nodes, a resume on another layout), over the producers."""
    if not max_gib:
        return 0
    producing = {f"rank{p}" for p in producers}
    others = sum(path.stat().st_size for path in folder.glob("rank*.h5")
                 if path.stem not in producing)
    return max(1, int((max_gib * GIB - others) / len(producers)))


def write_report(world: MPI.Comm, summary: RankSummary, cfg: Config,
                 run_dir: Path) -> Counters:
    """Gather every rank's summary on rank 0; write summary.json; print the headline.
    Returns the run's summary on rank 0, this rank's own elsewhere."""
    everyone: list[RankSummary] | None = world.gather(summary, root=0)  # [dist]
    if world.Get_rank() != 0:
        return summary.to_dict()
    assert everyone is not None  # the root's gather
    wall = max(s.wall_s for s in everyone)
    active = max(s.active_s for s in everyone) or wall  # the run's working window
    steps = sum(s.env_steps for s in everyone)
    staleness: Counter[int] = Counter()
    for s in everyone:
        staleness.update({int(k): v for k, v in s.counters.get("staleness_hist", {}).items()})
    root = next((s for s in everyone if s.trained_env_steps is not None), None)
    learners = [s for s in everyone if s.ended_episodes]  # every learner's window, pooled
    busy: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for s in everyone:
        for stage, seconds in s.busy_s.items():
            busy.setdefault(f"{s.role}:{stage}", []).append(seconds / active)
        cpu.setdefault(s.role, []).append(s.cpu_s / s.wall_s if s.wall_s else 0.0)
    rings = [s.counters["ring"] for s in everyone if "ring" in s.counters]
    add_planned_memory(everyone, run_dir / MEMORY_PLAN)
    result = {
        "mode": cfg.pipeline.mode, "ranks": len(everyone), "wall_s": wall,
        "active_s": active, "env_steps": steps, "env_steps_per_s": steps / active,
        "success_rate": _pooled([(s.success_rate, s.ended_episodes) for s in learners]),
        "mean_return": _pooled([(s.mean_return, s.ended_episodes) for s in learners]),
        "mean_episode_chunks": _pooled([(s.mean_episode_chunks, s.ended_episodes)
                                        for s in learners]),
        **({"per_task_success": pooled_rates(tasks)} if (tasks := [
            s.task_outcomes for s in everyone if s.task_outcomes]) else {}),
        **pooled([s.episode_metrics for s in everyone if s.episode_metrics]),
        # trained episodes an env fault ended: not in success_rate, not trained on
        "env_fault_episodes": sum(s.env_fault_episodes or 0 for s in everyone),
        "staleness_hist": dict(sorted(staleness.items())),
        "busy_fraction": {k: float(np.mean(v)) for k, v in sorted(busy.items())},
        # cores each role's rank kept busy, on average: its waits included
        "cpu_fraction": {k: float(np.mean(v)) for k, v in sorted(cpu.items())},
        "per_rank": [s.to_dict() for s in everyone],
        "preempted": any(s.preempted for s in everyone),
        "bad_slots": sum(r["bad_slots"] for r in rings),
        "lost_records": sum(r["lost_records"] for r in rings),
        "env_failures": sum(len(s.counters.get("env_failures", [])) for s in everyone),
        "restarts": restart_log.recorded(run_dir),  # inside the allocation (jobs/launch.sh)
        "phases_s": phases.slowest([s.phases_s for s in everyone]),
    }
    result["starts"] = starts_so_far(cfg, run_dir / "summary.json", _headline(result))
    replace_text(run_dir / "summary.json", json.dumps(result, indent=1, default=str))
    board = RunBoard(run_dir, cfg.run)  # the whole run's busy fractions, once
    board.scalars({"busy/" + k.replace(":", "/"): v for k, v in result["busy_fraction"].items()},
                  (root and root.trained_env_steps) or 0)
    board.close()
    if result["preempted"] and cfg.learner.checkpoint_every < 0:
        print("[hpcvla] stopped by a signal; no checkpoint (learner.checkpoint_every=-1)")
    elif result["preempted"]:
        print(f"[hpcvla] stopped by a signal after a checkpoint; continue with "
              f"`hpcvla train run.resume={run_dir} --ranks {len(everyone)}` (it loads the "
              "run's own config; under srun/mpiexec start the same ranks with run.resume=)",
              flush=True)
    print(phases_line("[hpcvla]", result["phases_s"]))
    if len(result["starts"]) > 1:
        starts = result["starts"]
        print(f"[hpcvla] the whole run, {len(starts)} starts: "
              f"{sum(s['env_steps'] for s in starts)} env steps in "
              f"{sum(s['wall_s'] for s in starts):.1f} s (summary.json's `starts`)")
    print(memory_table(everyone), flush=True)
    print(busy_line(result["busy_fraction"], result["cpu_fraction"]))
    window = sum(s.ended_episodes for s in learners)
    if "per_task_success" in result:  # in the suite's order
        print("[hpcvla] success per task (the learners' last episodes of each): " + " ".join(
            figure(t["success_rate"]) for t in result["per_task_success"].values())
            + " (summary.json's per_task_success; TensorBoard's train_task/)")
    lags = ", ".join(f"{lag}: {n}" for lag, n in result["staleness_hist"].items())
    print(f"[hpcvla] done: {steps} env steps in {active:.1f} s = "
          f"{result['env_steps_per_s']:.0f} env steps/s | success "
          f"{figure(result['success_rate'])} (the learners' last {window} episodes) | "
          + "".join(f"{name} {figure(value)} | " for name, value in figures_in(result).items()) +
          f"trained segments by staleness {{{lags}}}\n[hpcvla] run directory: {run_dir}"
          + ("" if result["preempted"] else f" (next: {next_steps(run_dir)})"), flush=True)
    return result


def next_steps(run_dir: Path) -> str:
    """What to run on a finished run: its evaluation, and its report's tables and charts."""
    run = shlex.quote(str(run_dir))
    report = f"; its report: {shlex.quote(sys.executable)} {shlex.quote(str(REPORT))} {run} " \
        f"--out {run}/report" if REPORT.is_file() else ""
    return f"hpcvla eval {run}{report}"


def busy_line(busy: dict[str, float], cpu: dict[str, float]) -> str:
    """Where each role's time went (summary.json's busy_fraction, by role, its stages
    largest first; those under 0.01 left out), and the cores it kept busy: the stage near 1
    is the one that sets the pace."""
    roles: dict[str, list[tuple[str, float]]] = {}
    for key, share in busy.items():
        role, _, stage = key.rpartition(":")
        roles.setdefault(role, []).append((stage, share))
    parts = [f"{role} " + (", ".join(f"{stage} {share:.2f}" for stage, share in sorted(
        stages, key=lambda item: -item[1]) if share >= 0.01) or "-")
             + f" (cpu {cpu.get(role, 0):.2f})" for role, stages in roles.items()]
    return "[hpcvla] busy, share of the active time: " + " | ".join(parts)


def _headline(summary: Counters) -> Counters:
    """A training start's entry of summary.json's `starts`."""
    keys = ("ranks", "wall_s", "env_steps", "env_steps_per_s", "success_rate", "preempted")
    return {"from_version": min(r["first_version"] for r in summary["per_rank"]),
            **{k: summary[k] for k in keys}}


def starts_so_far(cfg: Config, path: Path, this_start: Counters) -> list[Counters]:
    """summary.json's `starts` (train's, sft's): what a resumed run's summary.json, the last
    start's, keeps of every start, oldest first. The earlier ones come from the summary.json
    the last start wrote (a start that failed wrote none: its `restarts` has it); each says
    when it ended (`ended`, UTC: a week of starts on the calendar). One that cannot be read
    (a file cut short before it was written whole: files.replace_text) costs those records,
    said, not the summary of this start."""
    earlier = []
    if cfg.run.resume and path.is_file():
        try:
            earlier = json.loads(path.read_text()).get("starts", [])
        except ValueError as err:
            print(f"hpcvla: {path} cannot be read ({err}): the earlier starts' records in "
                  "it are not carried over", file=sys.stderr, flush=True)
    ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return earlier + [{**this_start, "ended": ended}]


def _pooled(figures: list[tuple[float | None, int]]) -> float | None:
    """The mean over every learner's episodes of figures each the mean of `n` of them; None
    where no episode ended."""
    ended = sum(n for _, n in figures)
    return sum((value or 0.0) * n for value, n in figures) / ended if ended else None


def add_planned_memory(everyone: list[RankSummary], path: Path) -> None:
    """Each rank's figures of the memory model (memory.json, where the run wrote one), bytes,
    beside the peaks it measured."""
    if not path.is_file():
        return
    planned = json.loads(path.read_text())
    for s in everyone:
        rank = str(s.rank)
        s.planned_memory = {"gpu": sum(planned["gpu"].get(rank, {}).values()),
                            "host": sum(planned["host_by_rank"].get(rank, {}).values())}


def phases_line(tag: str, phases_s: dict[str, float]) -> str:
    """The run's start and stop (phases.slowest) as the log shows it."""
    return f"{tag} start and stop, s since launch (slowest rank): " + " | ".join(
        f"{step} {seconds:.1f}" for step, seconds in phases_s.items())


def memory_table(everyone: list[RankSummary], tag: str = "[hpcvla]") -> str:
    """Every rank's peak memory (GiB) as it measured it, and the memory model's figure where
    the run has one (GPU runs); columns nobody has are left out."""
    columns: dict[str, Callable[[RankSummary], int | None]] = {
        "GPU allocated": lambda s: s.peak_memory.get("gpu_allocated"),
        "GPU reserved": lambda s: s.peak_memory.get("gpu_reserved"),
        "GPU planned": lambda s: (s.planned_memory or {}).get("gpu"),
        "host RSS": lambda s: s.peak_memory["host_rss"],
        "host planned": lambda s: (s.planned_memory or {}).get("host")}
    columns = {k: f for k, f in columns.items() if any(f(s) is not None for s in everyone)}
    planned = "; planned: the memory model" if any("planned" in k for k in columns) else ""
    lines = [f"{tag} peak memory, GiB (measured by each rank{planned}):",
             f"{'rank':>4} {'role':<30} {'device':<7} " + " ".join(f"{k:>13}" for k in columns)]
    for s in everyone:
        values = [f(s) for f in columns.values()]
        lines.append(f"{s.rank:>4} {s.role:<30} {s.device:<7} " + " ".join(
            f"{'-' if v is None else f'{v / GIB:.2f}':>13}" for v in values))
    return "\n".join(lines)
