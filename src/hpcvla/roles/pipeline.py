"""The main job on every rank: one shared prologue, this rank's role, tear down, report. The
role loops live in simulator.py, inference.py, learner.py (off_policy.py: SAC/RLPD's),
colocated.py and evaluator.py (held-out evaluation), the set-up around
those that run the policy in policy_ranks.py; what the run writes (checkpoints, dumps,
summary.json) in outputs.py.

The prologue (prologue.py): every rank binds its device (devices.py: inference and learner
ranks a GPU each where there are GPUs); the ranks that run the policy build it there, in one
dtype on every rank (policy.dtype); simulator and spare ranks take the weight manifest from
the weight root, without torch.

Collective set-up happens in one order on every rank: the prologue's broadcasts, then
(`connect`) cell exchange, learner ring, weight plane, each rank skipping what it is not part
of, so no two ranks wait on each other in different collectives; then the weight root
publishes the first version (0, or the one resumed) and one idle barrier starts every rank's
clock: the cells act on that version while the learners build their engine (which the clock
counts in every mode: it is the users' wall time, and the split modes hide part of it).
Shutdown: the learners finish their updates; the weight root stops the weight plane, which
marks every node "finished"; inference ranks answer their shards with a stop flag and close
their ring writers; learners drain their rings until every producer has closed (no producer is
left blocked on a full ring); then everything is freed collectively and rank 0 gathers the
report.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from hpcvla.devices import peak_memory
from hpcvla.envs.base import close_all
from hpcvla.envs.build import env_failures
from hpcvla.metrics import phases
from hpcvla.process import preempt
from hpcvla.process.worker import cpu_seconds
from hpcvla.process.watchdog import reminding, step_deadline_s
from hpcvla.roles.outputs import write_report
from hpcvla.roles.prologue import Links, Rank, connect, prologue, runs_policy, start_clock
from hpcvla.roles.setup import Counters
from hpcvla.roles.simulator import run_simulator
from hpcvla.topology.plan import EVAL, INF, LEARN, SIM

if TYPE_CHECKING:
    from hpcvla.config.schema import Config
    from hpcvla.topology.comms import Communicators
    from hpcvla.topology.plan import RankPlan


def run_pipeline(cfg: Config, plan: RankPlan, comms: Communicators, run_dir: Path) -> Counters:
    """This rank's part of the run: prologue, transport (disaggregated), role, teardown, then
    the report. Returns this rank's summary; rank 0's is the whole run's (summary.json)."""
    rank = comms.world.Get_rank()
    roles = plan.ranks[rank].roles
    with ExitStack() as starting:  # said until every rank's clock starts (start_clock)
        starting.enter_context(reminding(cfg.pipeline.stall_timeout_s, lambda waited: (
            f"hpcvla: rank {rank} ({'+'.join(roles)}) is still starting after {waited:.0f} s "
            f"(its last step done: {phases.last() or 'none'}; a rank whose step lags, or that "
            "says nothing, is the one the others wait for)")))
        me = prologue(cfg, plan, comms, run_dir)
        me.starting = starting.pop_all()
    if runs_policy(roles):
        from hpcvla.roles import policy_ranks  # torch and the engines: only on these ranks
    if plan.mode == "colocated":
        start, stats = policy_ranks.colocated_rank(me)
    else:
        links = connect(me)
        role = _simulator_rank if SIM in roles else policy_ranks.inference_rank \
            if INF in roles else policy_ranks.learner_rank if LEARN in roles \
            else policy_ranks.evaluator_rank if EVAL in roles else _spare_rank
        start, stats = role(me, links)
        with _reminding(me, "its teardown (windows freed together)" if role is not _spare_rank
                        else "its teardown (no role: it waits for the run's end)"):
            for piece in (links.exchange, links.ring):
                if piece is not None:
                    piece.free()  # [dist]
            links.plane.close()  # [dist]
    me.summary.add(stats)
    with _reminding(me, "the run's report (gathered from every rank)"):
        return _epilogue(me, start)


def _reminding(me: Rank, where: str) -> AbstractContextManager[None]:
    """Say every pipeline.stall_timeout_s that this rank still waits in `where` for its peers:
    a peer that hangs there is the one not saying it (no deadline: a learner's last checkpoint
    may rightly hold the others)."""
    role = "+".join(me.plan.ranks[me.rank].roles)
    return reminding(me.cfg.pipeline.stall_timeout_s, lambda waited: (
        f"hpcvla: rank {me.rank} ({role}) has waited {waited:.0f} s in {where} for its peers"))


def _simulator_rank(me: Rank, links: Links) -> tuple[float, Counters]:
    cfg, envs = me.cfg, me.shard_envs  # built in the prologue
    assert links.exchange is not None  # a simulator is in a cell
    start = start_clock(me)
    stats = {"env_steps": run_simulator(envs, links.exchange, me.timeline,
                                        step_deadline_s(cfg.env)),
             "env_failures": env_failures(envs)}
    close_all(envs)
    return start, stats


def _spare_rank(me: Rank, links: Links) -> tuple[float, Counters]:
    """No role (placement.learners): it starts the clock with the others and reports."""
    return start_clock(me), {}


def _epilogue(me: Rank, start: float) -> Counters:
    summary = me.summary
    summary.wall_s = time.monotonic() - start
    summary.cpu_s = cpu_seconds() - me.cpu_at_start
    began = me.timeline.now() - summary.wall_s  # all_ranks_ready on the timeline's clock
    summary.active_s = min(summary.wall_s, max(
        0.0, max((end for _, end in me.timeline.last.values()), default=began) - began))
    summary.preempted = preempt.requested()
    if preempt.requested_at() is not None:
        phases.mark("stop_signal", preempt.requested_at())
    phases.mark("finished")
    summary.phases_s = phases.of_rank(me.timeline)
    summary.peak_memory = peak_memory(me.device)
    summary.busy_s = dict(me.timeline.busy)
    progress = me.progress  # a learner's own episodes (none elsewhere), pooled in the report
    summary.success_rate, summary.mean_return = progress.success_rate, progress.mean_return
    summary.mean_episode_chunks = progress.mean_episode_chunks
    summary.ended_episodes, summary.env_fault_episodes = len(progress.successes), \
        progress.fault_episodes
    summary.task_outcomes = progress.tasks.outcomes() if progress.tasks else None
    summary.episode_metrics = progress.metrics.windows() if progress.metrics else None
    if me.rank == me.plan.weight_root:  # its count is every learner's (Progress.steps)
        summary.trained_env_steps = progress.steps
    me.timeline.close()
    me.progress.close()
    return write_report(me.comms.world, summary, me.cfg, me.run_dir)  # [dist]
