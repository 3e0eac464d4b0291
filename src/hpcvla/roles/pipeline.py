"""The main job on every rank: one shared prologue, this rank's role, tear down, report. The
role loops live in simulator.py, inference.py, learner.py and colocated.py; what the run writes
(checkpoints, dumps, summary.json) in outputs.py.

The prologue (`_prologue`): every rank binds its device (devices.py: inference and learner
ranks a GPU each where there are GPUs) and builds the policy there, in one dtype on every rank
(policy.dtype); simulator ranks build it on the meta device, for the weight manifest only.

Collective set-up happens in one order on every rank: the prologue's broadcasts, then
(`_links`) cell exchange, learner ring, weight plane, each rank skipping what it is not part
of, so no two ranks wait on each other in different collectives; then the learners' engine,
then one idle barrier that starts every rank's clock. Shutdown: the learners finish their
updates; the weight root stops the weight plane, which marks every node "finished"; inference
ranks answer their shards with a stop flag and close their ring writers; learners drain their
rings until every producer has closed (no producer is left blocked on a full ring); then
everything is freed collectively and rank 0 gathers the report.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from mpi4py import MPI

from hpcvla.checkpoint import store
from hpcvla.devices import bind_rank_device, peak_memory
from hpcvla.engines import full_state, init_engine
from hpcvla.envs import env_spec
from hpcvla.factory import build_policy, env_failures, make_envs
from hpcvla.memory.layout import plan_memory
from hpcvla.metrics import phases
from hpcvla.metrics.progress import Progress
from hpcvla.metrics.tensorboard import RunBoard
from hpcvla.metrics.timeline import Timeline
from hpcvla.process import preempt
from hpcvla.process.watchdog import step_deadline_s
from hpcvla.roles.colocated import run_colocated
from hpcvla.roles.evaluator import HeldOutInbox, between_versions, held_out_of, run_evaluator
from hpcvla.roles.inference import InferenceServer, WeightLoader
from hpcvla.roles.learner import run_learner
from hpcvla.roles.outputs import (MEMORY_PLAN, RankSummary, checkpointer, trajectory_dump,
                                  write_report)
from hpcvla.roles.queues import SegmentQueues
from hpcvla.roles.setup import Counters, RoleSetup
from hpcvla.roles.simulator import run_simulator, slot_dtypes
from hpcvla.schedule import Schedule, envs_of_cell, producer_quota, schedule_of
from hpcvla.seeds import colocated_seed, seed_rank, shard_seed, write_rng_seeds
from hpcvla.topology.plan import EVAL, INF, LEARN, SIM, SPARE
from hpcvla.transport.backoff import DATA_POLL_CAP, Backoff, idle_barrier
from hpcvla.transport.exchange import ObsActionExchange
from hpcvla.transport.ring import TrajectoryRing
from hpcvla.transport.ring_reader import RingReader
from hpcvla.transport.weights import Manifest, WeightPlane

if TYPE_CHECKING:
    from hpcvla.config.schema import Config
    from hpcvla.engines import SkipNonfinite
    from hpcvla.envs.base import EnvSpec
    from hpcvla.policies.base import Policy
    from hpcvla.topology.comms import Communicators
    from hpcvla.topology.plan import RankPlan


@dataclass
class _Rank:
    """What the prologue set up on this rank, for its role."""
    cfg: Config
    plan: RankPlan
    comms: Communicators
    run_dir: Path
    rank: int
    spec: EnvSpec
    policy: Policy
    device: torch.device
    on_gpus: bool
    timeline: Timeline
    progress: Progress
    resume: Path | None  # the checkpoint resumed from
    first: int  # the policy version training starts from
    summary: RankSummary

    @property
    def setup(self) -> RoleSetup:
        """What the role loops are given."""
        return RoleSetup(self.cfg, self.rank, self.run_dir, self.timeline, self.progress,
                         self.first)


class _Links(NamedTuple):
    """A disaggregated rank's transport: the cell's exchange, the learner's ring (None where
    the rank is in neither) and the weight plane."""
    sched: Schedule
    cell: int | None
    per_shard: int
    exchange: ObsActionExchange | None
    ring: TrajectoryRing | None
    plane: WeightPlane
    manifest: Manifest


def run_pipeline(cfg: Config, plan: RankPlan, comms: Communicators, run_dir: Path) -> Counters:
    """This rank's part of the run: prologue, transport (disaggregated), role, teardown, then
    the report. Returns this rank's summary; rank 0's is the whole run's (summary.json)."""
    me = _prologue(cfg, plan, comms, run_dir)
    if plan.mode == "colocated":
        start, stats = _colocated_rank(me)
    else:
        links = _links(me)
        roles = plan.ranks[me.rank].roles
        role = _simulator_rank if SIM in roles else _inference_rank if INF in roles \
            else _learner_rank if LEARN in roles else _evaluator_rank if EVAL in roles \
            else _spare_rank
        start, stats = role(me, links)
        for piece in (links.exchange, links.ring):
            if piece is not None:
                piece.free()  # [dist]
        links.plane.close()  # [dist]
    me.summary.add(stats)
    return _epilogue(me, start)


def _prologue(cfg: Config, plan: RankPlan, comms: Communicators, run_dir: Path) -> _Rank:
    world, rank = comms.world, comms.world.Get_rank()
    roles = plan.ranks[rank].roles
    torch.set_num_threads(1)
    seed_rank(cfg, rank)  # each rank explores with its own noise
    if rank == 0:
        write_rng_seeds(cfg, plan, run_dir)
    device = bind_rank_device(cfg, [r.roles for r in plan.ranks], world)  # [dist] a GPU each
    devices = world.allgather(str(device))  # [dist]
    if rank == 0:  # the rank map with where each rank computes: a GPU node on CPU shows here
        print(plan.table(dict(enumerate(devices))), flush=True)
    # one rank works the spec out (a real simulator builds an env for it) and tells the rest
    spec = world.bcast(env_spec(cfg.env) if rank == 0 else None, root=0)  # [dist]
    on_gpus = world.allreduce(device.type == "cuda", op=MPI.LOR)  # [dist]
    # the memory model's figures, beside each rank's peaks at the end; worked out by the weight
    # root on its GPU (a simulator rank 0 asking CUDA for the capacity would open a context)
    if rank == plan.weight_root and device.type == "cuda":
        memory = plan_memory(cfg, plan, dict(enumerate(devices)), spec)
        (run_dir / MEMORY_PLAN).write_text(json.dumps(memory.to_dict(), indent=1))
        phases.mark("memory_planned")
    # a simulator or a spare rank needs only the policy's names, dtypes and shapes (the weight
    # manifest, for the node's weight window)
    policy = build_policy(cfg, spec, "meta" if roles in ((SIM,), (SPARE,)) else device, on_gpus)
    phases.mark("policy_built")
    role = "+".join(roles)
    # One time origin for every rank's timeline, so the swimlanes line up (clocks of one
    # node agree; across nodes as far as the nodes' clocks do).
    timeline = Timeline(run_dir / f"timeline.rank{rank}.jsonl", rank, role,
                        t0=world.bcast(time.time(), root=0))  # [dist]
    is_root = rank == plan.weight_root
    progress = Progress(run_dir / "metrics.jsonl", cfg.pipeline.total_updates, spec.chunk_len,
                        cfg.pipeline.progress_every_s, enabled=is_root,
                        learners=len(plan.learners),
                        board=RunBoard(run_dir, cfg.run, asdict(cfg)) if is_root else None)
    resume = store.latest(run_dir) if cfg.run.resume else None
    saved = store.read_state(resume) if resume else {"version": 0}
    first = saved["version"]
    summary = RankSummary(rank=rank, role=role, host=MPI.Get_processor_name(),
                          device=str(device), first_version=first,
                          dtype=str(next(policy.parameters()).dtype).removeprefix("torch."))
    if resume and is_root:
        stage = cfg.learner.zero_stage if cfg.learner.backend == "deepspeed" else 0
        print(f"[hpcvla] resuming from {resume} (policy version {first}; "
              f"{store.layout_change(saved, len(plan.learners), stage)})", flush=True)
    return _Rank(cfg, plan, comms, run_dir, rank, spec, policy, device, on_gpus, timeline,
                 progress, resume, first, summary)


def _links(me: _Rank) -> _Links:
    """The transport, set up collectively in the same order everywhere: exchange (cell), ring
    (feed), plane (node)."""
    cfg, plan, comms = me.cfg, me.plan, me.comms
    cell = plan.ranks[me.rank].cell
    sched = schedule_of(cfg, envs_of_cell(cfg, plan, cell) if cell is not None else 1)
    per_shard = cfg.env.envs_per_simulator // sched.shards
    manifest = Manifest.of_policy(me.policy)  # frozen parameters cross the network once
    obs_dtype, action_dtype = slot_dtypes(me.spec, per_shard)
    exchange = ObsActionExchange(comms.cell, sched.shards, obs_dtype, action_dtype) \
        if comms.cell != MPI.COMM_NULL else None  # [dist]
    ring = TrajectoryRing(comms.feed, cfg.learner.ring_slots, cfg.learner.ring_slot_kib * 1024,
                          progress=cfg.learner.ring_progress, start_progress=False,
                          checksum=cfg.learner.ring_checksum) \
        if comms.feed != MPI.COMM_NULL else None  # [dist]
    plane = WeightPlane(comms.control, comms.node, me.rank in plan.node_leaders,  # [dist]
                        manifest)
    if me.rank == plan.weight_root and manifest.frozen:
        print(f"[hpcvla] weights: {plane.bytes_per_version / 1e6:.1f} MB per version, "
              f"{plane.nbytes / 1e6:.1f} MB the first (frozen parameters cross once)",
              flush=True)
    if ring is not None:  # its progress thread only once every window exists (ring.py)
        ring.start_progress()
    phases.mark("transport_ready")
    return _Links(sched, cell, per_shard, exchange, ring, plane, manifest)


def _start_clock(me: _Rank) -> float:
    """Every rank set up (a real simulator takes seconds per env): the clocks start together."""
    idle_barrier(me.comms.world)  # [dist]
    phases.mark("all_ranks_ready")
    return time.monotonic()


def _simulator_rank(me: _Rank, links: _Links) -> tuple[float, Counters]:
    cfg, rank, per_shard = me.cfg, me.rank, links.per_shard
    assert links.exchange is not None  # a simulator is in a cell
    envs = [make_envs(cfg, per_shard, shard_seed(cfg, rank, shard), latency_sleep=False,
                      first_env=rank * cfg.env.envs_per_simulator + shard * per_shard,
                      owner=f"rank {rank} (simulator)")
            for shard in range(links.sched.shards)]
    start = _start_clock(me)
    stats = {"env_steps": run_simulator(envs, links.exchange, me.timeline,
                                        step_deadline_s(cfg.env)),
             "env_failures": env_failures(envs)}
    for env in envs:
        env.close()
    return start, stats


def _inference_rank(me: _Rank, links: _Links) -> tuple[float, Counters]:
    cfg, plan, sched = me.cfg, me.plan, links.sched
    # an inference rank serves a cell and feeds a learner's ring
    assert links.cell is not None and links.exchange is not None and links.ring is not None
    assert links.ring.writer is not None
    start = _start_clock(me)
    sims = sorted(plan.cells[links.cell].simulators)  # the exchange's slot order
    dump = trajectory_dump(cfg, me.spec, me.policy, me.rank, me.run_dir, lambda slot: shard_seed(
        cfg, sims[slot // sched.shards], slot % sched.shards))
    server = InferenceServer(
        me.setup, sched=sched, policy=me.policy,
        loader=WeightLoader(me.policy, links.plane, links.manifest), exchange=links.exchange,
        ring=links.ring.writer, quota=producer_quota(cfg, plan, me.rank),
        envs_per_shard=links.per_shard, obs_keys=list(me.spec.obs), dump=dump)
    return start, server.run()


def _learner_rank(me: _Rank, links: _Links) -> tuple[float, Counters]:
    assert links.ring is not None and links.ring.reader is not None  # its feed's root
    cfg, plan, ring, plane = me.cfg, me.plan, links.ring.reader, links.plane
    engine = _start_engine(me)
    start = _start_clock(me)
    save = checkpointer(cfg, engine, me.comms.learners, me.run_dir, me.progress, me.timeline)

    # the weights go to host memory only where they are published or checkpointed
    wanted = me.rank == plan.weight_root or me.comms.learners.Get_rank() == 0
    # the evaluator's reports (eval.every), logged by the weight root as they come
    inbox = HeldOutInbox(me.comms.world, plan.with_role(EVAL)[0], me.progress) \
        if plan.with_role(EVAL) and me.rank == plan.weight_root else None

    def publish(version: int, last: bool = False) -> None:
        state = full_state(engine, wanted)  # [dist] on the learners under ZeRO-3
        if me.rank == plan.weight_root:
            assert state is not None  # the weight root wants them
            plane.publish(version, state)
        if version > me.first:
            save(version, state, last)
        if inbox:
            inbox.poll()
    stats: Counters = {"staleness_hist": {}}
    queues = SegmentQueues(ring, links.sched.max_staleness, stats, plan.producers_of(me.rank))
    publish(me.first)
    run_learner(me.setup, sched=links.sched, engine=engine, queues=queues, publish=publish,
                stop=lambda: preempt.agreed(me.comms.learners))  # [dist]
    plane.stop()
    stats["nonfinite_steps_skipped"] = engine.skipped
    stats["trained_groups"] = queues.ledger()
    stats["unused_segments"] = _drain(ring, len(plan.producers_of(me.rank)))
    if inbox:
        inbox.wait_last()
    stats["ring"] = {"records": ring.stats.records, "bad_slots": ring.stats.bad_slots,
                     "lost_records": ring.stats.lost_records}
    stats["weight_bytes"] = {"first_version": plane.nbytes,
                             "per_version": plane.bytes_per_version}
    return start, stats


def _evaluator_rank(me: _Rank, links: _Links) -> tuple[float, Counters]:
    """Held-out evaluation while training runs (roles/evaluator.py)."""
    held_out = held_out_of(me.cfg, me.device, me.policy)
    start = _start_clock(me)
    try:
        return start, run_evaluator(
            me.setup, held_out=held_out, loader=WeightLoader(me.policy, links.plane,
                                                             links.manifest),
            plane=links.plane, world=me.comms.world, root=me.plan.weight_root)
    finally:
        held_out.close()


def _spare_rank(me: _Rank, links: _Links) -> tuple[float, Counters]:
    """No role (placement.learners): it starts the clock with the others and reports."""
    return _start_clock(me), {}


def _colocated_rank(me: _Rank) -> tuple[float, Counters]:
    cfg, rank = me.cfg, me.rank
    engine = _start_engine(me)
    save = checkpointer(cfg, engine, me.comms.learners, me.run_dir, me.progress, me.timeline)
    env = make_envs(cfg, cfg.env.envs_per_simulator, colocated_seed(cfg, rank),
                    first_env=rank * cfg.env.envs_per_simulator,
                    owner=f"rank {rank} (colocated)")
    dump = trajectory_dump(cfg, me.spec, me.policy, rank, me.run_dir,
                           lambda slot: colocated_seed(cfg, rank))
    actor = build_policy(cfg, me.spec, me.device, me.on_gpus)  # ZeRO-3 shards the learner's
    held_out = held_out_of(cfg, me.device, actor) if cfg.eval.every else None
    start = _start_clock(me)
    actor.load_arrays(full_state(engine))  # [dist] under ZeRO-3
    after_version = save
    if held_out:  # eval.every: between versions, every rank a share, the start's included
        evaluate = between_versions(me.setup, held_out, me.comms.learners)
        evaluate(me.first, False)  # [dist]

        def after_version(version: int, weights: dict[str, torch.Tensor] | None,
                          last: bool) -> None:
            save(version, weights, last)  # [dist]
            evaluate(version, last)  # [dist]
    env_steps = run_colocated(me.setup, engine=engine, actor=actor, env=env,
                              after_version=after_version,
                              stop=lambda: preempt.agreed(me.comms.learners),  # [dist]
                              dump=dump)
    if held_out:
        held_out.close()
    stats = {"env_steps": env_steps,
             "staleness_hist": {0: me.progress.micro_batches * cfg.learner.micro_batch},
             "nonfinite_steps_skipped": engine.skipped, "env_failures": env_failures([env])}
    env.close()
    return start, stats


def _epilogue(me: _Rank, start: float) -> Counters:
    summary = me.summary
    summary.wall_s = time.monotonic() - start
    summary.preempted = preempt.requested()
    if preempt.requested_at() is not None:
        phases.mark("stop_signal", preempt.requested_at())
    phases.mark("finished")
    summary.phases_s = phases.of_rank(me.timeline)
    summary.peak_memory = peak_memory(me.device)
    summary.busy_s = dict(me.timeline.busy)
    if me.rank == me.plan.weight_root:
        progress = me.progress
        summary.success_rate, summary.mean_return = progress.success_rate, progress.mean_return
        summary.trained_env_steps = progress.steps
        summary.env_fault_episodes = progress.fault_episodes
    me.timeline.close()
    me.progress.close()
    return write_report(me.comms.world, summary, me.cfg, me.run_dir)  # [dist]


def _start_engine(me: _Rank) -> SkipNonfinite:
    """This learner's engine (engines/: DeepSpeed or Horovod); resuming, the weights are
    loaded before the engine partitions them and the optimizer partition after."""
    cfg, policy, learners = me.cfg, me.policy, me.comms.learners
    if me.resume is None:
        engine = init_engine(cfg, policy, learners, me.device)  # [dist]
    else:
        policy.load_arrays(store.load_weights(me.resume, policy.state_dict()))
        engine = init_engine(cfg, policy, learners, me.device)  # [dist]
        state = store.load_optimizer(me.resume, engine, learners)  # [dist]
        me.progress.resume(state["version"], state["counters"]["trained_env_steps"])
    phases.mark("engine_ready")
    return engine


def _drain(ring: RingReader, producers: int) -> int:
    """Consume (and count) what producers still send until all of them closed."""
    unused, backoff = 0, Backoff(cap=DATA_POLL_CAP)
    while len(ring.stats.closed) < producers:
        got = ring.poll()
        unused += len(got)
        if not got:
            backoff.wait()
    ring.release()
    return unused
