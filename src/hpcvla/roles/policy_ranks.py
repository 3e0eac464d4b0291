"""The ranks that run the policy, each around its loop: inference (inference.py), learner
(learner.py), evaluator (evaluator.py), colocated (colocated.py). roles/pipeline.py imports
this module only on such a rank: it brings torch and the engines."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from hpcvla.checkpoint import store
from hpcvla.engines import full_state, init_engine
from hpcvla.envs.build import env_failures, make_envs
from hpcvla.factory import build_policy
from hpcvla.metrics import phases
from hpcvla.process import preempt
from hpcvla.process.watchdog import build_deadline_s, deadline
from hpcvla.roles.colocated import OnPolicyUpdate, VersionUpdate, run_colocated
from hpcvla.roles.evaluator import HeldOutInbox, between_versions, held_out_of, run_evaluator
from hpcvla.roles.inference import InferenceServer, WeightLoader
from hpcvla.roles.learner import learn, run_learner
from hpcvla.roles.outputs import checkpointer, trajectory_dump
from hpcvla.roles.prologue import Links, Rank, start_clock
from hpcvla.roles.queues import SegmentQueues
from hpcvla.roles.setup import Counters
from hpcvla.schedule import producer_quota
from hpcvla.seeds import colocated_seed, shard_seed
from hpcvla.topology.plan import EVAL
from hpcvla.transport.backoff import DATA_POLL_CAP, Backoff, Nag
from hpcvla.transport.ring_reader import RingReader

if TYPE_CHECKING:
    from hpcvla.engines import SkipNonfinite
    from hpcvla.policies.base import Policy
    from hpcvla.roles.off_policy import SoftUpdate


def _policy(me: Rank) -> Policy:
    assert me.policy is not None  # the prologue builds it on every rank that runs it
    return me.policy


def inference_rank(me: Rank, links: Links) -> tuple[float, Counters]:
    cfg, plan, sched, policy = me.cfg, me.plan, links.sched, _policy(me)
    # an inference rank serves a cell and feeds a learner's ring
    assert links.cell is not None and links.exchange is not None and links.ring is not None
    assert links.ring.writer is not None
    start = start_clock(me)
    sims = sorted(plan.cells[links.cell].simulators)  # the exchange's slot order
    dump = trajectory_dump(cfg, me.spec, policy, me.rank, me.run_dir, lambda slot: shard_seed(
        cfg, sims[slot // sched.shards], slot % sched.shards, me.first), me.first, plan.feeds)
    server = InferenceServer(
        me.setup, sched=sched, policy=policy,
        loader=WeightLoader(policy, links.plane, me.manifest), exchange=links.exchange,
        ring=links.ring.writer, quota=producer_quota(cfg, plan, me.rank),
        envs_per_shard=links.per_shard, obs_keys=list(me.spec.obs),
        learner=plan.feeds[me.rank], dump=dump, metrics=me.spec.episode_metrics)
    return start, server.run()


def learner_rank(me: Rank, links: Links) -> tuple[float, Counters]:
    assert links.ring is not None and links.ring.reader is not None  # its feed's root
    cfg, plan, ring, plane = me.cfg, me.plan, links.ring.reader, links.plane
    _load_resumed_weights(me)
    if me.rank == plan.weight_root:  # the first version (0 or the one resumed) before the
        plane.publish(me.first, _policy(me).state_dict())  # engine: the cells act meanwhile
    start = start_clock(me)
    engine = _start_engine(me)
    soft = _soft_update(me, engine) if cfg.algorithm.off_policy else None
    save = checkpointer(cfg, engine, me.comms.learners, me.run_dir, me.progress, me.timeline,
                        soft.counters if soft else dict)

    # the weights go to host memory only where they are published or checkpointed
    wanted = me.rank == plan.weight_root or me.comms.learners.Get_rank() == 0
    # the evaluator's reports (eval.every), logged by the weight root as they come
    inbox = HeldOutInbox(me.comms.world, plan.with_role(EVAL)[0], me.progress,
                         cfg.pipeline.stall_timeout_s) \
        if plan.with_role(EVAL) and me.rank == plan.weight_root else None

    def publish(version: int, last: bool = False) -> None:
        state = full_state(engine, wanted)  # [dist] on the learners under ZeRO-3
        if me.rank == plan.weight_root:
            assert state is not None  # the weight root wants them
            plane.publish(version, state)
        save(version, state, last)
        if inbox:
            inbox.poll()
    stats: Counters = {"staleness_hist": {}}
    queues = SegmentQueues(ring, links.sched.max_staleness, stats, plan.producers_of(me.rank))
    train = soft.learn if soft else partial(learn, cfg, engine, timeline=me.timeline,
                                            progress=me.progress,
                                            learners_sum=me.progress.pool)
    run_learner(me.setup, sched=links.sched, train=train, queues=queues, publish=publish,
                stop=lambda: preempt.agreed(me.comms.learners))  # [dist]
    plane.stop()
    stats["nonfinite_steps_skipped"] = engine.skipped
    stats["trained_groups"] = queues.ledger()
    # unused: what the queues took from the ring for no version, and what came after
    stats["unused_segment_groups"] = queues.leftover() + _drain(
        ring, plan.producers_of(me.rank), me.rank, cfg.pipeline.stall_timeout_s)
    if inbox:
        inbox.wait_last()
    stats["ring"] = {"records": ring.stats.records, "bad_slots": ring.stats.bad_slots,
                     "lost_records": ring.stats.lost_records}
    stats["weight_bytes"] = {"first_version": plane.nbytes,
                             "per_version": plane.bytes_per_version}
    if soft:
        stats.update(soft.summary())
        soft.close()  # [dist]
    return start, stats


def evaluator_rank(me: Rank, links: Links) -> tuple[float, Counters]:
    """Held-out evaluation while training runs (roles/evaluator.py)."""
    policy = _policy(me)
    held_out = held_out_of(me.cfg, me.device, policy)
    start = start_clock(me)
    try:
        return start, run_evaluator(
            me.setup, held_out=held_out, loader=WeightLoader(policy, links.plane, me.manifest),
            plane=links.plane, world=me.comms.world, root=me.plan.weight_root)
    finally:
        held_out.close()


def colocated_rank(me: Rank) -> tuple[float, Counters]:
    cfg, rank = me.cfg, me.rank
    _load_resumed_weights(me)
    # its weights are the engine's (full_state below: ZeRO-3 shards the learner's)
    actor = build_policy(cfg, me.spec, me.device, me.on_gpus, load=False)
    with deadline(build_deadline_s(cfg.env)):  # a build that never returns: loud
        env = make_envs(cfg, cfg.env.envs_per_simulator, colocated_seed(cfg, rank, me.first),
                        first_env=rank * cfg.env.envs_per_simulator,
                        owner=f"rank {rank} (colocated)")
    dump = trajectory_dump(cfg, me.spec, _policy(me), rank, me.run_dir,
                           lambda slot: colocated_seed(cfg, rank, me.first), me.first,
                           me.plan.feeds)
    held_out = held_out_of(cfg, me.device, actor) if cfg.eval.every else None
    start = start_clock(me)  # the engine's build counts, as in the other modes
    engine = _start_engine(me)
    update = _version_update(me, engine, actor)
    save = checkpointer(cfg, engine, me.comms.learners, me.run_dir, me.progress, me.timeline,
                        update.counters)
    actor.load_arrays(full_state(engine))  # [dist] under ZeRO-3
    after_version = save
    if held_out:  # eval.every: between versions, every rank a share, the start's included
        evaluate = between_versions(me.setup, held_out, me.comms.learners)
        evaluate(me.first, False)  # [dist]

        def after_version(version: int, weights: dict[str, torch.Tensor] | None,
                          last: bool) -> None:
            save(version, weights, last)  # [dist]
            evaluate(version, last)  # [dist]
    env_steps = run_colocated(me.setup, update=update, actor=actor, env=env,
                              after_version=after_version,
                              stop=lambda: preempt.agreed(me.comms.learners),  # [dist]
                              dump=dump)
    if held_out:
        held_out.close()
    stats = {"env_steps": env_steps,
             "staleness_hist": {0: me.progress.micro_batches * cfg.learner.micro_batch},
             "nonfinite_steps_skipped": engine.skipped, "env_failures": env_failures([env]),
             **update.summary()}
    update.close()  # [dist]
    env.close()
    return start, stats


def _version_update(me: Rank, engine: SkipNonfinite, actor: Policy) -> VersionUpdate:
    """What trains a colocated version: the on-policy learner's (PPO, GRPO), or SAC's replay."""
    if me.cfg.algorithm.off_policy:
        return _soft_update(me, engine, actor)
    return OnPolicyUpdate(me.setup, engine, actor)


def _soft_update(me: Rank, engine: SkipNonfinite, actor: Policy | None = None) -> SoftUpdate:
    """The off-policy learner (roles/off_policy.py), its buffer position continued from the
    checkpoint resumed; `actor`: the colocated rank's acting copy."""
    from hpcvla.checkpoint.catalog import read_state
    from hpcvla.roles.off_policy import SoftUpdate
    done = read_state(me.resume)["counters"].get("replay_transitions", 0) if me.resume else 0
    return SoftUpdate(me.setup, engine, actor, me.spec, me.comms.learners, done, me.prior)


def _load_resumed_weights(me: Rank) -> None:
    """Resuming, the checkpoint's weights into the weight root's policy: before its first
    version is published and before the engine partitions them (the engine starts every
    other learner from the root's, as the prologue's build does)."""
    if me.resume is not None and me.rank == me.plan.weight_root:
        policy = _policy(me)
        policy.load_arrays(store.load_weights(me.resume, policy.state_dict()))


def _start_engine(me: Rank) -> SkipNonfinite:
    """This learner's engine (engines/: DeepSpeed or Horovod) over its policy, which holds the
    weights resumed (_load_resumed_weights); resuming, the optimizer partition after."""
    cfg, learners = me.cfg, me.comms.learners
    with me.timeline.span("build_engine"):  # on the clock: the timeline shows the cells act
        engine = init_engine(cfg, _policy(me), learners, torch.device(me.device))  # [dist]
        if me.resume is not None:
            state = store.load_optimizer(me.resume, engine, learners)  # [dist]
            me.progress.resume(state["version"], state["counters"]["trained_env_steps"])
    phases.mark("engine_ready")
    return engine


def _drain(ring: RingReader, producers: tuple[int, ...], rank: int, patience_s: float) -> int:
    """Consume (and count) what `producers` (world ranks) still send until all of them
    closed; a producer that does not is named each `patience_s` (pipeline.stall_timeout_s)."""
    unused, backoff, nag = 0, Backoff(cap=DATA_POLL_CAP), Nag(patience_s)
    while len(ring.stats.closed) < len(producers):
        got = ring.poll()
        ring.check_intact()  # a dropped close would leave this loop waiting for ever
        unused += len(got)
        if not got:
            backoff.wait()
        nag.check(lambda waited: f"hpcvla: rank {rank} (learner), after its last version, has "
                  f"waited {waited:.0f} s for producer rank(s) "
                  f"{sorted(set(producers) - ring.stats.closed)} to close their ring lanes "
                  "(they close once their simulators have stopped)")
    ring.release()
    return unused
