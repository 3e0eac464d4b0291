"""What every rank of a training world sets up before its role (roles/pipeline.py), in one
order on every rank: the device, the env spec, the policy, the weight manifest, the resumed
version (`prologue`); then the transport (`connect`): cell exchange, learner ring, weight
plane, each rank skipping what it is not part of, so no two ranks wait on each other in
different collectives.

Only the ranks that run the policy (inference, learner, evaluator, colocated) build it and
import torch. A simulator or a spare rank holds the node's weight window and needs only the
manifest (names, dtypes and shapes), which the weight root broadcasts: such a rank starts
without torch (~2 s of CPU and ~0.2 GB of memory per process). A simulator rank builds its
envs meanwhile (a real simulator takes seconds per env), not after the transport. The env's
spec, which the policy needs, comes from the first simulator's first env, sent point to point
as soon as it is built: the other simulators build theirs without waiting for it, and no rank
builds an env only to learn the spec (`spec_source`).

A rank that is ready early waits in sleeping barriers (transport/backoff.py): a blocking MPI
call would busy-poll and take the CPU from the ranks still building when ranks outnumber
cores.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from mpi4py import MPI

from hpcvla.checkpoint import catalog
from hpcvla.config import ConfigError
from hpcvla.config.learning import states_stage
from hpcvla.devices import gpu_identity, gpu_names, rank_device
from hpcvla.envs import env_spec, spec_needs_a_simulator
from hpcvla.envs.base import close_all
from hpcvla.memory.layout import plan_memory, ring_slots
from hpcvla.memory.states import fields_bytes
from hpcvla.metrics import phases
from hpcvla.metrics.progress import Progress
from hpcvla.metrics.tensorboard import RunBoard
from hpcvla.metrics.timeline import Timeline
from hpcvla.process.deathwatch import Refused
from hpcvla.process.threads import rank_threads
from hpcvla.process.worker import cpu_seconds
from hpcvla.roles.outputs import MEMORY_PLAN, RankSummary
from hpcvla.roles.setup import RoleSetup
from hpcvla.roles.simulator import build_shards, slot_dtypes
from hpcvla.schedule import Schedule, envs_of_cell, schedule_of
from hpcvla.seeds import seed_rank, write_rng_seeds
from hpcvla.topology.plan import LEARN, SIM, SPARE
from hpcvla.transport.backoff import idle_barrier, idle_bcast, idle_recv, summed, wait_request
from hpcvla.transport.exchange import ObsActionExchange
from hpcvla.transport.ring import TrajectoryRing
from hpcvla.transport.manifest import Manifest
from hpcvla.transport.weights import WeightPlane

if TYPE_CHECKING:
    from hpcvla.config.schema import Config
    from hpcvla.envs.base import EnvSpec, VectorEnv
    from hpcvla.policies.base import Policy
    from hpcvla.roles.off_policy import PriorData
    from hpcvla.topology.comms import Communicators
    from hpcvla.topology.plan import RankPlan


SPEC_TAG = 7  # the env spec, sent point to point by the simulator whose env it is
VERDICT_TAG = 8  # the weight root's memory plan verdict, point to point to every rank


@dataclass
class Rank:
    """What the prologue set up on this rank, for its role."""
    cfg: Config
    plan: RankPlan
    comms: Communicators
    run_dir: Path
    rank: int
    spec: EnvSpec
    policy: Policy | None  # None on a rank that does not run it (simulator, spare)
    manifest: Manifest  # the policy's tensors, as the weight plane moves them
    device: str  # "cpu" or "cuda:i"
    on_gpus: bool
    timeline: Timeline
    progress: Progress
    resume: Path | None  # the checkpoint resumed from
    first: int  # the policy version training starts from
    summary: RankSummary
    shard_envs: list[VectorEnv]  # a disaggregated simulator rank's envs, one per shard
    prior: PriorData | None  # an RLPD learner's demonstrations (roles/off_policy.py)
    cpu_at_start: float = 0.0  # the process's CPU clock when the ranks' clocks started
    starting: ExitStack | None = None  # its start-up's reminder (pipeline.py), until then

    @property
    def setup(self) -> RoleSetup:
        """What the role loops are given."""
        return RoleSetup(self.cfg, self.rank, self.run_dir, self.timeline, self.progress,
                         self.first)


class Links(NamedTuple):
    """A disaggregated rank's transport: the cell's exchange, the learner's ring (None where
    the rank is in neither) and the weight plane."""
    sched: Schedule
    cell: int | None
    per_shard: int
    exchange: ObsActionExchange | None
    ring: TrajectoryRing | None
    plane: WeightPlane


def resume_point(run_dir: Path) -> tuple[Path | None, dict[str, Any]]:
    """The run's newest checkpoint and its state (read_state: its files whole), or None and
    version 0 where it has none."""
    path = catalog.latest(run_dir)
    return path, (catalog.read_state(path) if path else {"version": 0})


def runs_policy(roles: tuple[str, ...]) -> bool:
    """Whether a rank with these roles builds the policy (and imports torch)."""
    return roles not in ((SIM,), (SPARE,))


def prologue(cfg: Config, plan: RankPlan, comms: Communicators, run_dir: Path) -> Rank:
    world, rank = comms.world, comms.world.Get_rank()
    roles = plan.ranks[rank].roles
    # the newest checkpoint and its state as rank 0 reads them, holding the run's lock
    # (train_main): every rank resumes from the same one, whatever another world wrote or its
    # node's listing shows, and the shared file system serves one reader of its files' headers,
    # not every rank (600 ranks x the files of 128 learners: ~77,000 opens at once)
    resume: Path | None = None
    saved: dict[str, Any] = {"version": 0}
    if cfg.run.resume:
        resume, saved = idle_bcast(world, lambda: resume_point(run_dir))  # [dist]
    first = saved["version"]  # a resumed world's streams are new ones (seeds.py)
    seed_rank(cfg, rank, with_torch=runs_policy(roles), start=first)  # each its own noise
    # The policy ranks have just imported torch (seconds); the others wait here asleep, not
    # in rank_device's blocking collectives, which spin and take the cores they need.
    idle_barrier(world)  # [dist]
    if rank == 0:
        write_rng_seeds(cfg, plan, run_dir, first)
    device = rank_device(cfg, [r.roles for r in plan.ranks], world)  # [dist] a GPU each
    placed = world.allgather((device, gpu_identity(device)))  # [dist]
    devices = [d for d, _ in placed]
    if rank == 0:  # the rank map with where each rank computes: a GPU node on CPU shows here
        print(plan.table(dict(enumerate(devices))), flush=True)
    on_gpus = any(d.startswith("cuda") for d in devices)
    if LEARN in roles:  # the engine's imports, while the env spec's simulator builds its env
        import torch

        from hpcvla import engines
        engines.preload(cfg, torch.device(device))
    source, builds_envs = spec_source(cfg, plan), SIM in roles and plan.mode != "colocated"
    spec = None  # a simulator told by another (`spec_source`) learns it after its build
    if source is None:
        spec = idle_bcast(world, lambda: env_spec(cfg.env))  # [dist] rank 0 works it out
    elif not builds_envs:  # the policy needs it; the simulators build their envs meanwhile
        spec = idle_recv(world, source, SPEC_TAG)  # [dist]
    # the memory model's figures, beside each rank's peaks at the end; worked out by the weight
    # root on its GPU (a simulator rank 0 asking CUDA for the capacity would open a context)
    overfilled: list[tuple[str, object, str]] = []
    if rank == plan.weight_root and device.startswith("cuda"):  # (the root learns the spec)
        overfilled = world_memory(cfg, plan, placed, spec, run_dir)
    told = tell_verdict(world, plan, overfilled)  # [dist]
    # A rank that builds no envs hears the verdict before it builds the policy (a GPU the
    # policy overfills would fail in the build); a simulator, once its envs are built (the
    # weight root may be waiting for its env spec).
    policy, manifest, dtype, threads = None, None, None, 0
    if runs_policy(roles) and not builds_envs:
        refuse_overfilled(world, plan, overfilled, [], told)  # [dist]
    if runs_policy(roles):
        policy, manifest, dtype, threads = rank_policy(
            cfg, spec, device, on_gpus, comms.node.Get_size(), rank == plan.weight_root)
    shard_envs: list[VectorEnv] = []
    if builds_envs:  # (colocated: its loop builds them)
        shard_envs, spec_told = simulator_envs(cfg, plan, world, source, first)
        spec = spec or spec_told
        phases.mark("envs_built")
    if builds_envs or not runs_policy(roles):
        refuse_overfilled(world, plan, overfilled, shard_envs, told)  # [dist]
    assert spec is not None
    for request in told:  # the weight root's, done as every rank hears them
        wait_request(request, "the memory verdict's sends")  # [dist]
    idle_barrier(world)  # [dist] every policy and every simulator's envs built
    # the weight root's manifest for the ranks that build no policy (its dtype, for the report)
    root_manifest, root_dtype = world.bcast((manifest, dtype), root=plan.weight_root)  # [dist]
    phases.mark("policy_built")
    role = "+".join(roles)
    timeline, progress = rank_records(cfg, plan, comms, run_dir, spec, role,  # [dist]
                                      resume, saved)
    summary = RankSummary(rank=rank, role=role, host=MPI.Get_processor_name(), device=device,
                          first_version=first, dtype=dtype or root_dtype, threads=threads)
    if resume and rank == plan.weight_root:
        print(f"[hpcvla] resuming from {resume} (policy version {first}; "
              f"{catalog.layout_change(saved, len(plan.learners), states_stage(cfg.learner))})",
              flush=True)
        changed = catalog.batch_change(saved, len(plan.learners), cfg.learner.micro_batch,
                                       cfg.learner.micro_batches)
        if changed:
            print(f"[hpcvla] warning: {changed}", flush=True)
    prior = None
    if LEARN in roles and cfg.algorithm.traits.prior_data:  # its node window before connect
        from hpcvla.roles.off_policy import prior_data  # starts the transport's threads

        prior = prior_data(cfg, spec, comms.learners)  # [dist]
    return Rank(cfg, plan, comms, run_dir, rank, spec, policy, manifest or root_manifest,
                device, on_gpus, timeline, progress, resume, first, summary, shard_envs, prior)


def rank_policy(cfg: Config, spec: EnvSpec | None, device: str, on_gpus: bool, node_ranks: int,
                load: bool) -> tuple[Policy, Manifest, str, int]:
    """A policy rank's policy on `device` at its share of its node's `node_ranks` cores'
    threads; its manifest, dtype and threads. `load`: the weight root (learner 0) alone reads
    the folder or checkpoint: the engines start every learner from learner 0's parameters
    (DeepSpeed's broadcast of the module, Horovod's broadcast_parameters), the weight plane
    every other rank that acts."""
    import torch  # only where the policy runs

    from hpcvla.factory import build_policy
    torch.set_num_threads(rank_threads(node_ranks))
    policy = build_policy(cfg, spec, device, on_gpus, load=load)
    manifest = Manifest.of_policy(policy)  # frozen parameters cross the network once
    return policy, manifest, str(next(policy.parameters()).dtype).removeprefix("torch."), \
        torch.get_num_threads()


def rank_records(cfg: Config, plan: RankPlan, comms: Communicators, run_dir: Path,
                 spec: EnvSpec, role: str, resume: Path | None,
                 saved: dict[str, Any]) -> tuple[Timeline, Progress]:
    """A rank's timeline, on one time origin for every rank's, so the swimlanes line up
    (clocks of one node agree; across nodes as far as the nodes' clocks do), and its
    progress: enabled on the weight root (metrics.jsonl, TensorBoard, W&B), pooled over the
    learners. Collective on the world."""
    rank = comms.world.Get_rank()
    timeline = Timeline(run_dir / f"timeline.rank{rank}.jsonl", rank, role,
                        t0=comms.world.bcast(time.time(), root=0),  # [dist]
                        keep_s=cfg.run.timeline_s)
    is_root = rank == plan.weight_root
    # a resume that found no checkpoint goes on from 0: what an earlier start logged goes
    resumed_at = int(saved["counters"]["trained_env_steps"]) if resume else \
        0 if cfg.run.resume else None
    progress = Progress(run_dir / "metrics.jsonl", cfg.pipeline.total_updates, spec.chunk_len,
                        cfg.pipeline.progress_every_s, enabled=is_root,
                        learners=len(plan.learners),
                        board=RunBoard(run_dir, cfg.run, asdict(cfg), resumed_at)
                        if is_root else None, t0=timeline.t0,
                        evaluated=is_root and cfg.eval.every > 0, spec=spec)
    if rank in plan.learners and len(plan.learners) > 1:  # the figures shown: every learner's
        progress.pool = partial(summed, comms.learners)
    if is_root and (cfg.run.tensorboard or cfg.run.wandb != "disabled"):
        phases.mark("logging_ready")  # TensorBoard's and W&B's start (W&B's takes seconds)
    return timeline, progress


def world_memory(cfg: Config, plan: RankPlan, placed: list[tuple[str, str | None]],
                 spec: EnvSpec | None, run_dir: Path) -> list[tuple[str, object, str]]:
    """The weight root's, on its GPU: the memory model's figures for the world's ranks on
    their GPUs (`placed`: every rank's device and gpu_identity), into memory.json; the
    problems of the GPUs they overfill (refuse_overfilled)."""
    memory = plan_memory(cfg, plan, gpu_names(placed, [i.node for i in plan.ranks]), spec)
    (run_dir / MEMORY_PLAN).write_text(json.dumps(memory.to_dict(), indent=1))
    phases.mark("memory_planned")
    return memory.problems


def tell_verdict(world: MPI.Comm, plan: RankPlan,
                 problems: list[tuple[str, object, str]]) -> list[MPI.Request]:
    """The weight root: its memory plan's `problems` (world_memory's; none off GPUs) sent to
    every other rank, which reads them at its own point (refuse_overfilled); the sends."""
    if world.Get_rank() != plan.weight_root:
        return []
    return [world.isend(problems, dest=r, tag=VERDICT_TAG)  # [dist]
            for r in range(world.Get_size()) if r != plan.weight_root]


def refuse_overfilled(world: MPI.Comm, plan: RankPlan, problems: list[tuple[str, object, str]],
                      envs: list[VectorEnv], told: list[MPI.Request]) -> None:
    """Every rank, on the weight root's `problems` (tell_verdict; `told`: the root's sends):
    where the world's GPUs are overfilled, close this rank's envs and end the world with the
    figures and what would fit (Refused). A world `hpcvla train --ranks` or jobs/launch.sh
    started was refused before it started; one srun or mpirun started directly is refused
    here, where each rank knows its GPU (by UUID: ranks bound to a GPU each all say cuda:0)."""
    if world.Get_rank() != plan.weight_root:
        problems = idle_recv(world, plan.weight_root, VERDICT_TAG)  # [dist]
    if not problems:
        return
    close_all(envs)
    for request in told:
        wait_request(request, "the memory verdict's sends")  # [dist]
    # Ranks hear it at their own points, seconds apart (simulators after their envs): none
    # ends before all have, so the rank that says why (rank 0, job/runtime.py) is still there.
    idle_barrier(world)  # [dist]
    raise Refused(ConfigError(problems, "memory plan of the training world's GPUs"))


def simulator_envs(cfg: Config, plan: RankPlan, world: MPI.Comm, source: int | None,
                   start: int = 0) -> tuple[list[VectorEnv], EnvSpec | None]:
    """A simulator rank's envs (of a world started at policy version `start`); and the env
    spec where a simulator tells it (`spec_source`): the source sends its first env's to
    every other rank as soon as that env is built, the other simulators receive it once
    theirs are."""
    rank = world.Get_rank()
    sends: list[MPI.Request] = []

    def tell(env: VectorEnv) -> None:  # [dist]
        sends.extend(world.isend(env.spec, dest=r, tag=SPEC_TAG)
                     for r in range(world.Get_size()) if r != rank)
    envs = build_shards(cfg, rank_schedule(cfg, plan, rank).shards, rank,
                        first_built=tell if rank == source else None, start=start)
    for request in sends:
        wait_request(request, "the env spec's sends")  # [dist]
    if source is None:
        return envs, None
    return envs, envs[0].spec if rank == source else idle_recv(world, source, SPEC_TAG)


def spec_source(cfg: Config, plan: RankPlan) -> int | None:
    """The rank whose first env tells every rank the env's spec: the first simulator, where
    simulators build their envs in the prologue and only a built env knows the spec (a
    ManiSkill env takes seconds; no rank builds one just to look). None where rank 0 works it
    out alone: a spec the settings give (LIBERO's), or a colocated world (its loops build the
    envs, after the policy)."""
    if plan.mode == "colocated" or not spec_needs_a_simulator(cfg.env):
        return None
    return next((r.rank for r in plan.ranks if r.roles == (SIM,)), None)


def rank_schedule(cfg: Config, plan: RankPlan, rank: int) -> Schedule:
    """The shards and segments of the cell `rank` is in (of one env, outside any cell)."""
    cell = plan.ranks[rank].cell
    return schedule_of(cfg, envs_of_cell(cfg, plan, cell) if cell is not None else 1)


def connect(me: Rank) -> Links:
    """The transport, set up collectively in the same order everywhere: exchange (cell), ring
    (feed), plane (node)."""
    cfg, plan, comms = me.cfg, me.plan, me.comms
    cell = plan.ranks[me.rank].cell
    sched = rank_schedule(cfg, plan, me.rank)
    per_shard = cfg.env.envs_per_simulator // sched.shards
    obs_dtype, action_dtype = slot_dtypes(me.spec, per_shard,
                                          cfg.algorithm.values_truncations)
    exchange = ObsActionExchange(comms.cell, sched.shards, obs_dtype, action_dtype) \
        if comms.cell != MPI.COMM_NULL else None  # [dist]
    ring = None
    if comms.feed != MPI.COMM_NULL:
        producers = max(1, comms.feed.Get_size() - 1)
        assert me.policy is not None  # a feed's ranks learn or act: each has built the policy
        slots = ring_slots(cfg, me.spec, producers,  # the same on every rank of the feed
                           fields_bytes(me.policy.extra_fields()))
        ring = TrajectoryRing(comms.feed, slots, cfg.learner.ring_slot_kib * 1024,  # [dist]
                              progress=cfg.learner.ring_progress, start_progress=False,
                              checksum=cfg.learner.ring_checksum)
        if me.rank == plan.learners[0]:
            print(f"[hpcvla] trajectory ring: {slots} slots of {cfg.learner.ring_slot_kib} "
                  f"KiB a learner, lanes of {slots // producers} for its {producers} "
                  "producer(s)", flush=True)
    plane = WeightPlane(comms.control, comms.node, me.rank in plan.node_leaders,  # [dist]
                        me.manifest, who=plan.who(me.rank, MPI.Get_processor_name()))
    if me.rank == plan.weight_root and me.manifest.frozen:
        print(f"[hpcvla] weights: {plane.bytes_per_version / 1e6:.1f} MB per version, "
              f"{plane.nbytes / 1e6:.1f} MB the first (frozen parameters cross once)",
              flush=True)
    if ring is not None:  # its progress thread only once every window exists (ring.py)
        ring.start_progress()
    phases.mark("transport_ready")
    return Links(sched, cell, per_shard, exchange, ring, plane)


def start_clock(me: Rank) -> float:
    """Every rank set up (a real simulator takes seconds per env): the clocks start together."""
    idle_barrier(me.comms.world)  # [dist]
    phases.mark("all_ranks_ready")
    if me.starting is not None:
        me.starting.close()
    me.cpu_at_start = cpu_seconds()
    return time.monotonic()
