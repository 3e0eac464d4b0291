"""The main job on every rank: build the shared pieces, run this rank's role, tear down,
report. The role loops live in simulator.py, inference.py, learner.py and colocated.py.

Every rank first binds its device (devices.py: inference and learner ranks a GPU each where
there are GPUs) and builds the policy there, in one dtype on every rank (policy.dtype);
simulator ranks build it on the meta device, for the weight manifest only.

Collective set-up happens in one order on every rank (cell exchange, learner ring, weight
plane), each rank skipping what it is not part of, so no two ranks wait on each other in
different collectives. Shutdown: the learners finish their updates; the weight root stops the
weight plane, which marks every node "finished"; inference ranks answer their shards with a
stop flag and close their ring writers; learners drain their rings until every producer has
closed (no producer is left blocked on a full ring); then everything is freed collectively.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import numpy as np
import torch
import yaml
from mpi4py import MPI

from hpcvla import checkpoint, preempt
from hpcvla.config.loader import config_to_dict
from hpcvla.devices import bind_rank_device
from hpcvla.envs import env_spec
from hpcvla.factory import build_policy, env_failures, make_envs
from hpcvla.metrics.progress import Progress
from hpcvla.metrics.tensorboard import RunBoard
from hpcvla.metrics.timeline import Timeline
from hpcvla.roles.colocated import run_colocated
from hpcvla.roles.inference import InferenceServer, WeightLoader
from hpcvla.roles.learner import SegmentQueues, full_state, init_engine, run_learner
from hpcvla.roles.modes import envs_of_cell, producer_quota, schedule_of
from hpcvla.roles.simulator import run_simulator, slot_dtypes
from hpcvla.seeds import colocated_seed, seed_rank, shard_seed, write_rng_seeds
from hpcvla.topology.plan import INF, LEARN, SIM
from hpcvla.transport.backoff import DATA_POLL_CAP, Backoff, idle_barrier
from hpcvla.transport.exchange import ObsActionExchange
from hpcvla.transport.ring import TrajectoryRing
from hpcvla.transport.weights import Manifest, WeightPlane
from hpcvla.watchdog import step_deadline_s


def run_pipeline(cfg, plan, comms, run_dir) -> dict:
    world, rank = comms.world, comms.world.Get_rank()
    roles = plan.ranks[rank].roles
    torch.set_num_threads(1)
    seed_rank(cfg, rank)  # each rank explores with its own noise
    if rank == 0:
        write_rng_seeds(cfg, plan, run_dir)
    device = bind_rank_device(cfg, plan, world)  # inference and learner ranks: a GPU each
    # one rank works the spec out (a real simulator builds an env for it) and tells the rest
    spec = world.bcast(env_spec(cfg.env) if rank == 0 else None, root=0)
    on_gpus = world.allreduce(device.type == "cuda", op=MPI.LOR)
    # a simulator needs only the policy's names, dtypes and shapes (the weight manifest)
    policy = build_policy(cfg, spec, device if roles != (SIM,) else "meta", on_gpus)
    role = "+".join(roles)
    # One time origin for every rank's timeline, so the swimlanes line up (clocks of one
    # node agree; across nodes as far as the nodes' clocks do).
    timeline = Timeline(run_dir / f"timeline.rank{rank}.jsonl", rank, role,
                        t0=world.bcast(time.time(), root=0))
    is_root = rank == plan.weight_root
    progress = Progress(run_dir / "metrics.jsonl", cfg.pipeline.total_updates, spec.chunk_len,
                        cfg.pipeline.progress_every_s, enabled=is_root,
                        learners=len(plan.learners),
                        board=RunBoard(run_dir, cfg.run.tensorboard) if is_root else None)
    resume = checkpoint.latest(run_dir) if cfg.run.resume else None
    first = checkpoint.read_state(resume)["version"] if resume else 0
    summary = {"rank": rank, "role": role, "host": MPI.Get_processor_name(), "env_steps": 0,
               "first_version": first, "device": str(device),
               "dtype": str(next(policy.parameters()).dtype).removeprefix("torch.")}
    if resume and is_root:
        print(f"[hpcvla] resuming from {resume} (policy version {first})", flush=True)

    if plan.mode == "colocated":
        engine = _start_learner(cfg, policy, comms.learners, resume, progress, device)
        save = _checkpointer(cfg, engine, comms.learners, run_dir, progress, timeline)
        env = make_envs(cfg, cfg.env.envs_per_simulator, colocated_seed(cfg, rank),
                        first_env=rank * cfg.env.envs_per_simulator,
                        owner=f"rank {rank} (colocated)")
        dump = _trajectory_dump(cfg, spec, policy, rank, run_dir,
                                lambda slot: colocated_seed(cfg, rank))
        idle_barrier(world)
        start = time.monotonic()
        actor = build_policy(cfg, spec, device, on_gpus)  # ZeRO-3 shards the learner's copy
        summary["env_steps"] = run_colocated(cfg, engine, actor, env, first,
                                             cfg.pipeline.total_updates, timeline, progress,
                                             save, stop=lambda: preempt.agreed(comms.learners),
                                             dump=dump, emulate_ms=_emulated_inference(cfg))
        summary["staleness_hist"] = {0: progress.micro_batches * cfg.learner.micro_batch}
        summary["nonfinite_steps_skipped"] = engine.skipped
        summary["env_failures"] = env_failures([env])
        env.close()
    else:
        start, stats = _run_disaggregated(cfg, plan, comms, spec, policy, timeline, progress,
                                          run_dir, resume, first, device)
        summary.update(stats)
    summary["wall_s"] = time.monotonic() - start
    summary["preempted"] = preempt.requested()
    summary["busy_s"] = dict(timeline.busy)
    if is_root:
        summary.update(success_rate=progress.success_rate, mean_return=progress.mean_return,
                       trained_env_steps=progress.steps,
                       env_fault_episodes=progress.fault_episodes)
    timeline.close()
    progress.close()
    return _report(world, summary, cfg, run_dir)


def _start_learner(cfg, policy, learners, resume, progress, device):
    """This learner's DeepSpeed engine; resuming, the weights are loaded before DeepSpeed
    partitions them and the optimizer partition after."""
    if resume is None:
        return init_engine(cfg, policy, learners, device)
    policy.load_arrays(checkpoint.load_weights(resume, policy.state_dict()))
    engine = init_engine(cfg, policy, learners, device)
    state = checkpoint.load_optimizer(resume, engine, learners)
    progress.resume(state["version"], state["counters"]["trained_env_steps"])
    return engine


def _checkpointer(cfg, engine, learners, run_dir, progress, timeline):
    """save(version, full weights, last): a checkpoint when one is due or the run ends
    (collective on the learners)."""
    def save(version, weights, last):
        every = cfg.learner.checkpoint_every
        if last or (every and version % every == 0):
            with timeline.span("checkpoint"):
                checkpoint.save(run_dir, engine, weights, version,
                                {"trained_env_steps": progress.steps}, learners,
                                keep=cfg.learner.checkpoint_keep)
    return save


def _run_disaggregated(cfg, plan, comms, spec, policy, timeline, progress, run_dir, resume,
                       first, device):
    world, rank = comms.world, comms.world.Get_rank()
    roles = plan.ranks[rank].roles
    cell = plan.ranks[rank].cell
    cell_envs = envs_of_cell(cfg, plan, cell) if cell is not None else 1
    sched = schedule_of(cfg, cell_envs)
    per_shard = cfg.env.envs_per_simulator // sched.shards
    manifest = Manifest.of_policy(policy)  # frozen parameters cross the network once
    obs_dtype, action_dtype = slot_dtypes(spec, per_shard)
    # Collective set-up, same order everywhere: exchange (cell), ring (feed), plane (node).
    exchange = ObsActionExchange(comms.cell, sched.shards, obs_dtype, action_dtype) \
        if comms.cell != MPI.COMM_NULL else None
    ring = TrajectoryRing(comms.feed, cfg.learner.ring_slots, cfg.learner.ring_slot_kib * 1024,
                          progress=cfg.learner.ring_progress, start_progress=False,
                          checksum=cfg.learner.ring_checksum) \
        if comms.feed != MPI.COMM_NULL else None
    plane = WeightPlane(comms.control, comms.node, rank in plan.node_leaders, manifest)
    if rank == plan.weight_root and manifest.frozen:
        print(f"[hpcvla] weights: {plane.bytes_per_version / 1e6:.1f} MB per version, "
              f"{plane.nbytes / 1e6:.1f} MB the first (frozen parameters cross once)",
              flush=True)
    if ring is not None:  # its progress thread only once every window exists (ring.py)
        ring.start_progress()
    stats: dict = {}
    engine = _start_learner(cfg, policy, comms.learners, resume, progress, device) \
        if LEARN in roles else None
    # simulators are built before the clock starts (a real one takes seconds per env)
    envs = [make_envs(cfg, per_shard, shard_seed(cfg, rank, shard), latency_sleep=False,
                      first_env=rank * cfg.env.envs_per_simulator + shard * per_shard,
                      owner=f"rank {rank} (simulator)")
            for shard in range(sched.shards)] if SIM in roles else []
    idle_barrier(world)
    start = time.monotonic()
    if SIM in roles:
        stats["env_steps"] = run_simulator(envs, exchange, timeline, step_deadline_s(cfg.env))
        stats["env_failures"] = env_failures(envs)
        for env in envs:
            env.close()
    elif INF in roles:
        sims = sorted(plan.cells[cell].simulators)  # the exchange's slot order
        dump = _trajectory_dump(cfg, spec, policy, rank, run_dir, lambda slot: shard_seed(
            cfg, sims[slot // sched.shards], slot % sched.shards))
        stats.update(InferenceServer(
            sched, policy, WeightLoader(policy, plane, manifest), exchange, ring,
            producer_quota(cfg, plan, rank), per_shard, list(spec.obs), cfg.rollout.segment_len,
            rank, timeline, _emulated_inference(cfg), first, dump).run())
    elif LEARN in roles:
        save = _checkpointer(cfg, engine, comms.learners, run_dir, progress, timeline)

        def publish(version, last=False):
            state = full_state(engine)  # collective on the learners under ZeRO-3
            if rank == plan.weight_root:
                plane.publish(version, state)
            if version > first:
                save(version, state, last)
        stats = {"staleness_hist": {}}
        queues = SegmentQueues(ring, sched.max_staleness, stats, plan.producers_of(rank))
        publish(first)
        run_learner(cfg, sched, engine, queues, publish, first, cfg.pipeline.total_updates,
                    timeline, progress, stop=lambda: preempt.agreed(comms.learners))
        plane.stop()
        stats["nonfinite_steps_skipped"] = engine.skipped
        stats["trained_groups"] = queues.ledger()
        stats["unused_segments"] = _drain(ring, len(plan.producers_of(rank)))
        stats["ring"] = {"records": ring.stats.records, "bad_slots": ring.stats.bad_slots,
                         "lost_records": ring.stats.lost_records}
        stats["weight_bytes"] = {"first_version": plane.nbytes,
                                 "per_version": plane.bytes_per_version}
    for piece in (exchange, ring):
        if piece is not None:
            piece.free()
    plane.close()
    return start, stats


def _trajectory_dump(cfg, spec, policy, rank, run_dir, seed_of_slot):
    """This producer's HDF5 trajectory dump (metrics/dump.py), or None when not asked for.
    It holds the observations and what the policy records beside them (extra_fields)."""
    if not cfg.run.dump_trajectories:
        return None
    from hpcvla.metrics.dump import TrajectoryDump
    keys = list(spec.obs) + list(policy.extra_fields())
    return TrajectoryDump(run_dir / "trajectories" / f"rank{rank}.h5", rank, keys,
                          spec.vocab, seed_of_slot, cfg.env.name, spec.chunk_len,
                          yaml.safe_dump(config_to_dict(cfg), sort_keys=False),
                          cfg.run.dump_flush_s)


def _emulated_inference(cfg):
    a, b = cfg.emulate.inference_ms, cfg.emulate.inference_ms_per_env
    return (lambda envs: a + b * envs) if (a or b) else None


def _drain(ring, producers: int) -> int:
    """Consume (and count) what producers still send until all of them closed."""
    unused, backoff = 0, Backoff(cap=DATA_POLL_CAP)
    while len(ring.stats.closed) < producers:
        got = ring.poll()
        unused += len(got)
        if not got:
            backoff.wait()
    ring.release()
    return unused


def _report(world, summary: dict, cfg, run_dir) -> dict:
    """Gather every rank's summary on rank 0; write summary.json; print the headline."""
    everyone = world.gather(summary, root=0)
    if world.Get_rank() != 0:
        return summary
    wall = max(s["wall_s"] for s in everyone)
    steps = sum(s["env_steps"] for s in everyone)
    staleness = Counter()
    for s in everyone:
        staleness.update({int(k): v for k, v in s.get("staleness_hist", {}).items()})
    root = next((s for s in everyone if "success_rate" in s), {})
    busy = {}
    for s in everyone:
        for stage, seconds in s["busy_s"].items():
            busy.setdefault(f"{s['role']}:{stage}", []).append(seconds / s["wall_s"])
    result = {
        "mode": cfg.pipeline.mode, "ranks": len(everyone), "wall_s": wall,
        "env_steps": steps, "env_steps_per_s": steps / wall,
        "success_rate": root.get("success_rate"), "mean_return": root.get("mean_return"),
        # trained episodes an env fault ended: not in success_rate, not trained on
        "env_fault_episodes": root.get("env_fault_episodes"),
        "staleness_hist": dict(sorted(staleness.items())),
        "busy_fraction": {k: float(np.mean(v)) for k, v in sorted(busy.items())},
        "per_rank": everyone,
    }
    result["preempted"] = any(s["preempted"] for s in everyone)
    result["bad_slots"] = sum(s["ring"]["bad_slots"] for s in everyone if "ring" in s)
    result["lost_records"] = sum(s["ring"]["lost_records"] for s in everyone if "ring" in s)
    result["env_failures"] = sum(len(s.get("env_failures", [])) for s in everyone)
    (run_dir / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    board = RunBoard(run_dir, cfg.run.tensorboard)  # the whole run's busy fractions, once
    board.scalars({"busy/" + k.replace(":", "/"): v for k, v in result["busy_fraction"].items()},
                  root.get("trained_env_steps", 0))
    board.close()
    if result["preempted"]:
        print(f"[hpcvla] stopped by a signal after a checkpoint; continue with "
              f"`hpcvla train run.resume={run_dir}`", flush=True)
    print(f"[hpcvla] done: {steps} env steps in {wall:.1f} s = {steps / wall:.0f} steps/s | "
          f"success {result['success_rate']} | staleness {result['staleness_hist']}",
          flush=True)
    return result
