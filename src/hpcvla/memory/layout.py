"""A layout's memory: every GPU's bytes (the ranks on it, states.py) and every node's host
bytes, and the problems of a layout that does not fit, each naming the rank, the figure and
the settings that would make it fit. `hpcvla plan` prints the figures; the launcher refuses
what does not fit (preflight.check_launch). docs/memory.md."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hpcvla.config.families import family
from hpcvla.config.learning import states_stage
from hpcvla.memory.host import host_bytes
from hpcvla.memory.simulators import simulator_bytes
from hpcvla.memory.states import (GIB, checkpoint_bytes, inference_bytes, learner_bytes,
                                  offloaded_bytes, size)
from hpcvla.schedule import shards_of
from hpcvla.transport.windows import shared_memory_room
from hpcvla.topology.plan import EVAL, INF, LEARN, SIM

PRIOR = "RLPD prior data (one copy per node)"  # a node's host part, held by its first learner


@dataclass
class LayoutMemory:
    gpu: dict[int, dict[str, int]]  # rank -> part -> bytes on its GPU (GPU ranks only)
    host: dict[int, dict[str, int]]  # rank -> part -> bytes of host memory at its peak
    device: dict[int, str]  # rank -> "cuda:i" | "cpu"
    node: dict[int, int]  # rank -> node
    capacity_gib: float  # one GPU's memory (0: unknown)
    dtype_bytes: int  # of the trained parameters
    # what sizes a learner's forward/backward: (its setting, the value, what it means)
    batch: tuple[str, int, str] = ("", 0, "")
    # what sizes an acting rank's batch: (its setting, the value, what makes it fit)
    acting: tuple[str, int, str] = ("", 0, "")
    problems: list[tuple[str, object, str]] = field(default_factory=list)

    def per_gpu(self) -> dict[tuple[int, str], tuple[list[int], dict[str, int]]]:
        """(node, device) -> the ranks on that GPU and their parts added up."""
        out: dict[tuple[int, str], tuple[list[int], dict[str, int]]] = {}
        for rank, parts in self.gpu.items():
            ranks, total = out.setdefault((self.node[rank], self.device[rank]), ([], {}))
            ranks.append(rank)
            for name, nbytes in parts.items():
                add(total, name, nbytes)
        return out

    def per_node_host(self) -> dict[int, dict[str, int]]:
        """node -> part -> host bytes of its ranks added up (every node, even an empty one)."""
        out: dict[int, dict[str, int]] = {n: {} for n in sorted(set(self.node.values()))}
        for rank, parts in self.host.items():
            for name, nbytes in parts.items():
                add(out[self.node[rank]], name, nbytes)
        return out

    def columns(self) -> dict[str, dict[int, str]]:
        """The plan table's columns: each GPU rank's peak and each rank's host peak, GiB
        (`-` where nothing is modelled: a simulator of ManiSkill's GPU simulation)."""
        def gib(by_rank):
            return {r: f"{sum(parts.values()) / GIB:.1f}" for r, parts in by_rank.items()
                    if parts}
        return ({"GPU GiB": gib(self.gpu)} if self.gpu else {}) | {"host GiB": gib(self.host)}

    def summary(self) -> str:
        """Lines under the plan table: each GPU's total against its capacity, the largest
        parts of the busiest GPU, and every node's host memory."""
        capacity = f"{self.capacity_gib:g} GiB" if self.capacity_gib else "unknown"
        lines = [f"memory (hpcvla/memory/; GPU capacity {capacity}):"]
        gpus = self.per_gpu()
        if gpus:
            (node, device), (ranks, parts) = max(gpus.items(),
                                                 key=lambda kv: sum(kv[1][1].values()))
            lines.append(f"  busiest GPU: node {node} {device} (rank(s) "
                         f"{', '.join(map(str, ranks))}) {size(sum(parts.values()))} = "
                         + " + ".join(f"{k} {size(v)}" for k, v in parts.items() if v))
        for node, parts in self.per_node_host().items():
            lines.append(f"  node {node} host memory {size(sum(parts.values()))} = "
                         + " + ".join(f"{k} {size(v)}" for k, v in parts.items()))
        if self.host:  # docs/memory.md: what the model counts
            lines.append("  (host figures are a lower bound: each process's interpreter and "
                         "libraries are not counted, ~0.3-0.5 GiB a rank that imports torch)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"gpu_capacity_gib": self.capacity_gib,
                "gpu": {str(r): parts for r, parts in self.gpu.items()},
                "host": {str(n): parts for n, parts in self.per_node_host().items()},
                "host_by_rank": {str(r): parts for r, parts in self.host.items()},
                "problems": [f"{k} = {v!r}: expected {text}" for k, v, text in self.problems]}


def plan_memory(cfg, plan, devices: dict[int, str], spec, footprint=None) -> LayoutMemory:
    """The memory of `plan` as configured: the policy's footprint at the learner's micro-batch
    (learner.micro_batch segments of rollout.segment_len observations) and at the largest
    cell's batch (every env it serves), on `devices` (devices.plan_devices). `footprint`:
    a stand-in for footprint.policy_footprint (`plan --auto` passes one that remembers each
    batch's)."""
    if footprint is None:
        from hpcvla.memory.footprint import policy_footprint as footprint
    on_gpus = any(d.startswith("cuda") for d in devices.values())
    envs = max((len(c.simulators) for c in plan.cells), default=1) * cfg.env.envs_per_simulator
    fp = footprint(cfg, spec, cfg.learner.micro_batch * cfg.rollout.segment_len, envs, on_gpus)
    replay, prior = replay_bytes(cfg.algorithm, spec)
    memory = layout_memory(cfg, plan, devices, fp, gpu_capacity_gib(cfg.placement), replay,
                           prior, spec)
    if replay:
        memory.problems += replay_problems(cfg, memory, replay, host_bytes(),
                                           shared_memory_room())
    return memory


def layout_devices(cfg, plan) -> dict[int, str]:
    """Every rank's device (devices.plan_devices) on nodes of placement.gpus_per_node GPUs,
    or, where it is -1, of as many as this host's torch sees."""
    from hpcvla.devices import plan_devices
    from hpcvla.envs import env_uses_gpu
    return plan_devices(plan, layout_gpus(cfg), env_uses_gpu(cfg.env))


def layout_gpus(cfg) -> int:
    """GPUs per node: placement.gpus_per_node, or where it is -1 as many as torch sees here."""
    from hpcvla.devices import visible_gpus
    gpus = cfg.placement.gpus_per_node
    return gpus if gpus >= 0 else len(visible_gpus())


def memory_problems(cfg, plan) -> list[tuple[str, object, str]]:
    """The GPUs the layout overfills, where it puts ranks on GPUs (preflight.check_launch
    refuses them before any rank starts), and the nodes whose replay buffers (the off-policy
    algorithms, sac and rlpd) would not fit their host memory."""
    from hpcvla.envs import env_spec

    devices = layout_devices(cfg, plan)
    if not any(d.startswith("cuda") for d in devices.values()) and \
            not cfg.algorithm.off_policy:
        return []
    return plan_memory(cfg, plan, devices, env_spec(cfg.env)).problems


STEP_SCALARS = 64  # bytes a segment records a step beside its observation and actions


def segments_bytes(cfg, spec, recorded: int = 0) -> int:
    """What the segments of a version take (its quota: learner.micro_batch x micro_batches
    segments of rollout.segment_len steps): per step an observation and its chunk of actions
    (demonstrations.sample_bytes), what the policy records beside it (`recorded`: its
    extra_fields' bytes, flow's denoising chain) and the step's scalars (log-prob, value,
    reward, flags: STEP_SCALARS; the env's episode metrics, a float each); an off-policy
    segment also its next observation."""
    from hpcvla.demonstrations import sample_bytes
    step = sample_bytes(spec) + recorded + STEP_SCALARS + 4 * len(spec.episode_metrics)
    segments = cfg.learner.micro_batch * cfg.learner.micro_batches
    following = sample_bytes(spec) if cfg.algorithm.off_policy else 0
    return segments * (cfg.rollout.segment_len * step + following)


def version_bytes(cfg, spec, recorded: int = 0) -> int:
    """What an on-policy learner holds of a version until it ends (roles/learner.learn keeps
    every micro-batch for its later epochs): its segments (segments_bytes). Off-policy
    learners: their replay."""
    if cfg.algorithm.off_policy or spec is None:
        return 0
    return segments_bytes(cfg, spec, recorded)


MIN_RING_SLOTS = 32


def ring_slots(cfg, spec, producers: int, recorded: int = 0) -> int:
    """The slots of a learner's trajectory ring fed by `producers`: learner.ring_slots, or
    where it is 0 enough for each producer's lane to hold that producer's share of
    max_staleness versions' segments (at least one; segments_bytes, with `recorded` bytes a
    step of the policy's extra fields; each record's last slot counted whole), at least
    MIN_RING_SLOTS: a producer runs ahead while the learner trains, where a short lane would
    stop it, and the rollout with it, for most of every version."""
    if cfg.learner.ring_slots or spec is None:
        return cfg.learner.ring_slots or MIN_RING_SLOTS
    from hpcvla.transport.slots import SLOT_HEADER
    capacity = cfg.learner.ring_slot_kib * 1024 - SLOT_HEADER.itemsize
    versions = max(1, cfg.pipeline.max_staleness)
    share = -(-versions * segments_bytes(cfg, spec, recorded) // producers)
    per_record = max(1, cfg.env.envs_per_simulator // shards_of(cfg))
    records = -(-versions * cfg.learner.micro_batch * cfg.learner.micro_batches //
                (per_record * producers))
    return max(MIN_RING_SLOTS, producers * (-(-share // capacity) + records))


def ring_bytes(cfg, spec, producers: int, recorded: int = 0) -> int:
    """A learner's trajectory ring (ring_slots of learner.ring_slot_kib)."""
    return ring_slots(cfg, spec, producers, recorded) * cfg.learner.ring_slot_kib * 1024


def replay_bytes(alg, spec) -> tuple[int, int]:
    """One off-policy learner's replay buffer (algorithms/replay.py), and under RLPD its
    node's one copy of the prior data (as many transitions as algorithm.demos have chunk
    rows, at most; roles/off_policy.prior_data); 0, 0 for the on-policy learners."""
    if not alg.off_policy:
        return 0, 0
    from hpcvla.algorithms.replay import ReplayBuffer
    from hpcvla.algorithms.transitions import transition_specs
    specs = transition_specs(spec.obs, spec.chunk_len, spec.action_dim)
    prior = 0
    if alg.traits.prior_data:
        from hpcvla.config.imitation import demo_paths
        from hpcvla.demonstrations import demonstration_rows
        prior = demonstration_rows(demo_paths(alg), spec, alg.demos_per_task or None)
    return ReplayBuffer.nbytes_of(specs, alg.replay_capacity), \
        ReplayBuffer.nbytes_of(specs, prior)


def replay_problems(cfg, memory: LayoutMemory, per_learner: int, capacity: int,
                    shm_free: int | None) -> list[tuple[str, object, str]]:
    """A node whose learners' replay buffers (`per_learner` bytes each) and RLPD prior data
    alone would not fit in its host memory (`capacity` bytes), or whose prior data would not
    fit in /dev/shm's room beside MPI's own (`shm_free` bytes: windows.shared_memory_room;
    None: unknown) where its one copy lives."""
    out = []
    for node, parts in memory.per_node_host().items():
        replay, prior = parts.get("replay buffers", 0), parts.get(PRIOR, 0)
        if replay + prior > capacity:
            out.append(("algorithm.replay_capacity", cfg.algorithm.replay_capacity,
                        f"fewer transitions: node {node}'s learners' replay buffers take "
                        f"{size(replay)}, and {size(prior)} of prior data one copy, more "
                        f"than its {size(capacity)} of host memory (this machine's; "
                        f"{size(per_learner)} per learner, "
                        f"{per_learner / cfg.algorithm.replay_capacity / 1024:.1f} KiB per "
                        "transition of its capacity)"))
        if prior and shm_free is not None and prior > shm_free:
            out.append(("algorithm.demos_per_task", cfg.algorithm.demos_per_task,
                        f"fewer demonstrations: node {node}'s one copy of the prior data "
                        f"takes {size(prior)}, more than the {size(max(shm_free, 0))} free in "
                        "/dev/shm (this machine's) beside MPI's own, where MPI keeps it"))
    return out


def gpu_capacity_gib(placement) -> float:
    """placement.gpu_memory_gb, else the first GPU torch sees here, else 0 (unknown)."""
    if placement.gpu_memory_gb > 0:
        return placement.gpu_memory_gb
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GIB
    return 0.0


def layout_memory(cfg, plan, devices: dict[int, str], fp, capacity_gib: float,
                  replay: int = 0, prior: int = 0, spec=None) -> LayoutMemory:
    """Figures for `plan` with `devices` (devices.plan_devices) and the policy's Footprint `fp`
    (footprint.policy_footprint at the config's micro-batch and inference batch); `replay`:
    each learner's replay buffer, `prior` each node's one copy of RLPD's prior data, held by
    its first learner (replay_bytes); the env's `spec` sizes what a learner holds of a
    version (version_bytes) and its ring (ring_slots)."""
    version = version_bytes(cfg, spec, fp.recorded_bytes)
    learners = len(plan.learners)
    # where parameters are frozen, versions after the first cross packed (transport/weights.py):
    # every node leader but the root (it packs into its staging buffers) receives them into a
    # buffer of the trainable bytes
    packed = fp.trainable * fp.dtype_bytes if fp.trainable < fp.params else 0
    gpu, host = {}, {info.rank: {} for info in plan.ranks}
    node = {info.rank: info.node for info in plan.ranks}
    simulated = simulator_bytes(cfg.env, shards_of(cfg))  # every simulator rank's envs alike
    for info in plan.ranks:
        on_gpu = devices.get(info.rank, "cpu").startswith("cuda")
        parts: dict[str, int] = {}
        if LEARN in info.roles:
            parts = learner_bytes(fp, states_stage(cfg.learner), learners, on_gpu,
                                  cfg.learner.offload_optimizer)
            if cfg.learner.offload_optimizer:
                host[info.rank].update(offloaded_bytes(fp, states_stage(cfg.learner),
                                                       learners))
        if INF in info.roles or EVAL in info.roles:  # colocated: the same weights; the larger
            # of the two batches (an evaluator's counted at the inference batch)
            alone = inference_bytes(fp, on_gpu)
            parts = {k: max(parts.get(k, 0), v) for k, v in alone.items()} | \
                {k: v for k, v in parts.items() if k not in alone}
        if parts and on_gpu:
            gpu[info.rank] = parts
        if INF in info.roles or LEARN in info.roles or EVAL in info.roles:
            add(host[info.rank], "policy builds", build_bytes(fp))
            if not on_gpu:
                add(host[info.rank], "cpu ranks' working memory", sum(parts.values()))
        if SIM in info.roles and simulated:
            add(host[info.rank], "simulator envs", simulated)
        if EVAL in info.roles:  # its own batch of eval.envs, in its process
            held_out = simulator_bytes(replace(cfg.env, envs_per_simulator=cfg.eval.envs), 1)
            if held_out:
                add(host[info.rank], "held-out envs", held_out)
        if LEARN in info.roles:
            add(host[info.rank], "trajectory rings",
                ring_bytes(cfg, spec, max(1, len(plan.producers_of(info.rank))),
                           fp.recorded_bytes))
            add(host[info.rank], "checkpoint snapshot", checkpoint_bytes(
                fp, states_stage(cfg.learner), learners, info.rank == plan.learners[0]))
            if replay:
                add(host[info.rank], "replay buffers", replay)
            if version:
                add(host[info.rank], "a version's segments", version)
            if prior and not any(PRIOR in host[r] for r in host if node[r] == info.node):
                add(host[info.rank], PRIOR, prior)
        if info.rank == plan.weight_root:
            add(host[info.rank], "weight root staging", 2 * fp.weight_bytes)
    for leader in plan.node_leaders:  # the leader allocates the window, and receives
        add(host[leader], "node weight window",
            2 * fp.weight_bytes + (0 if leader == plan.weight_root else packed))
    out = LayoutMemory(gpu=gpu, host=host, device=devices, node=node, capacity_gib=capacity_gib,
                       dtype_bytes=fp.dtype_bytes, batch=learner_batch(cfg), acting=(
                           "env.envs_per_simulator", cfg.env.envs_per_simulator,
                           "fewer envs per inference rank (env.envs_per_simulator, or fewer "
                           "simulators per cell in placement.per_node)"))
    out.problems = fit_problems(cfg, out)
    return out


def learner_batch(cfg) -> tuple[str, int, str]:
    """What sizes an RL learner's forward/backward (LayoutMemory.batch)."""
    obs = cfg.learner.micro_batch * cfg.rollout.segment_len
    return ("learner.micro_batch", cfg.learner.micro_batch,
            f"{cfg.learner.micro_batch} segments x rollout.segment_len "
            f"{cfg.rollout.segment_len} = {obs} observations per forward/backward")


def build_bytes(fp) -> int:
    """Host memory of one rank building the policy: its transformers models are built in the
    policy's dtype on the CPU (its small heads in float32, then cast), then moved to a GPU
    parameter by parameter (full-size π0 in bf16: 6.75 GB resident for its 6.48 GB)."""
    return fp.weight_bytes


def add(parts: dict[str, int], name: str, nbytes: int) -> None:
    parts[name] = parts.get(name, 0) + nbytes


def fit_problems(cfg, memory: LayoutMemory) -> list[tuple[str, object, str]]:
    """One problem per GPU the layout overfills, (the setting to change, its value, what
    fits): its ranks, the figure, the largest parts and the settings that shrink them."""
    if memory.capacity_gib <= 0:
        return []
    out = []
    for (node, device), (ranks, parts) in memory.per_gpu().items():
        total = sum(parts.values())
        if total <= memory.capacity_gib * GIB:
            continue
        biggest = ", ".join(f"{k} {size(v)}" for k, v in
                            sorted(parts.items(), key=lambda kv: -kv[1])[:3])
        learns = "gradients" in parts  # a learner's (its moments may be offloaded)
        field, value = (memory.batch if learns else memory.acting)[:2]
        out.append((field, value, f"a layout that fits: rank(s) {', '.join(map(str, ranks))} "
                    f"on node {node} {device} need {size(total)} > placement.gpu_memory_gb = "
                    f"{memory.capacity_gib:g} (largest: {biggest}). {knobs(cfg, learns, memory)}"))
    return out


def knobs(cfg, learns: bool, memory: LayoutMemory) -> str:
    """The settings that shrink what a GPU's ranks hold, largest lever first: the batch, then
    the memory levers the config's rules take (memory/levers.py), one ZeRO stage up."""
    if not learns:
        return f"Fit it with {memory.acting[2]}."
    from hpcvla.memory.levers import memory_levers, override
    setting, _, meaning = memory.batch
    out, stages = [f"a smaller {setting} ({meaning})"], 0
    for lever in memory_levers(cfg):
        if lever.field == "learner.zero_stage" and stages or \
                lever.field == "policy.dtype" and memory.dtype_bytes != 4:
            continue  # the next stage only; bf16 where the weights are not already
        stages += lever.field == "learner.zero_stage"
        out.append(f"{override(lever.field, lever.value)} ({lever.why})")
    return "Fit it with " + "; or ".join(out) + "."
