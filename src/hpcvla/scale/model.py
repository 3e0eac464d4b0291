"""A discrete-event scale model of the pipeline (SimPy): predicted env steps/s of a layout.

The model replays the schedules of roles/ (simulator.py, inference.py, learner.py,
colocated.py) with stage *costs* instead of work, so a layout can be scored in a fraction of
a second for any world size:

* Simulator rank: E envs in S shards of e = E / S envs. A shard asks its cell's inference
  rank for a chunk of actions, then steps H primitive steps, which lasts the slowest of its e
  envs' lognormal draws (median `sim_median_s`, log-space spread `sim_sigma`), plus a
  deterministic `sim_fixed_s + sim_per_env_s * e` (a real simulator's compute). The shards of
  a rank are in flight together (one process per env, as LIBERO/ManiSkill on many cores and
  the emulated simulators); `sim_serial=True` makes a rank step its shards one at a time
  (inline shards on one core, the real `reach` env).
* Inference rank (one per cell): the dynamic batcher of roles/batcher.py. A forward pass fires
  when B_max envs wait or the oldest servable request waited T_max (counted from when the
  rank noticed it: requests arriving during a pass are seen after it), takes requests in arrival
  order up to B_max envs and lasts a + b * batch, plus `inf_per_request_s` per request
  (gathering it, assembling its segment: the inference rank's own CPU work). Requests that
  would start a new segment are held while the staleness quota is used up: a producer
  feeding a learner with P producers may start segment number c only while
  c < (v + 1 + max_staleness) * quota, quota = learner batch / P, v the newest weight
  version on its node (hpcvla/schedule.py). A held request's finished segment rides along the
  next pass, which values its bootstrap (b per env), or a pass of its own when none comes.
* Segments of T chunks are streamed to the learner. A learner trains its batch of
  micro_batch x micro_batches segments per version: the streamer starts each micro-batch as
  soon as it has arrived, the other modes wait for the whole batch; epoch 0 then epochs - 1
  replays, each micro-batch costing `learn_fixed_s` + micro_batch x `learn_s_per_segment`
  (the fixed part is what makes tiny micro-batches slow); every optimizer
  step (one per epoch) all-reduces the gradients over the learners (hierarchical ring:
  within each node, then between nodes over one link per node).
* Weight publish: the root broadcasts the new version to one leader per node (large-message
  broadcast: log2(nodes) link latencies + 2 x bytes / bandwidth; Network.weight_sync =
  "sequential" sends every remote inference rank its copy in turn instead), which copies it
  to its node's inference ranks (bytes / local bandwidth, paid by the inference rank between
  two forward passes). Publishing runs in a thread: it delays the weights, not the learner.
* sync-colocated: each rank rolls out (groups x T + 1 forward passes of E envs per version,
  a group's bootstrap pass being the next one's first act, and T steps of its slowest env per
  segment group) until it holds its share of the batch, then all ranks train
  together; a version lasts as long as the slowest rank's rollout plus the training.
* Start: the learners build their engine for `learner_start_s` after the clock starts; the
  cells act on the first version meanwhile (a colocated rank waits for it).

Disaggregated layouts are symmetric per learner, so the model simulates *slices*: up to 8
learners (those with the fewest producers: they set the pace) with their cells, lock-stepped
by the all-reduce that ends each learner's epoch 0, and scales their env steps to all
learners. Not modelled: CPU contention between ranks of a node, stragglers among more than
8 learners, the learner's own weight gathering. The run is simulated from the
start, as a run of `updates` versions measures it (pipeline fill and drain included), or,
with `updates=None`, long enough to report the steady rate.

Outputs (`Prediction`): env steps/s, the busy fraction of each stage (simulate: of the
simulator ranks' time a shard is stepping, averaged over shards; infer, train: of the rank's
time), and the bottleneck: the busiest stage.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import simpy

from hpcvla.schedule import Layout, eligible
from hpcvla.topology.plan import build_plan


@dataclass(frozen=True)
class StageCosts:
    """Seconds (and bytes) a stage costs on one rank; see the module docstring."""
    sim_median_s: float                # one chunk of H steps of one env: lognormal median
    sim_sigma: float                   # log-space spread (0: every step the median)
    inf_a_s: float                     # forward pass: a + b * envs in the batch
    inf_b_s: float
    learn_s_per_segment: float         # forward/backward per segment per epoch
    learn_fixed_s: float = 0.0         # + per micro-batch pass (launches, optimizer step)
    inf_per_request_s: float = 0.0     # inference rank's bookkeeping per shard request served
    sim_fixed_s: float = 0.0           # deterministic part of a shard step: fixed + per env
    sim_per_env_s: float = 0.0
    sim_serial: bool = False           # a simulator rank steps its shards one at a time
    weight_bytes: float = 0.0          # published policy (and all-reduced gradients)
    grad_bytes: float | None = None    # gradients all-reduced per step (default weight_bytes)
    learner_start_s: float = 0.0       # the learners' engine build after the clock starts


@dataclass(frozen=True)
class Network:
    """Links: between nodes (InfiniBand HDR: 200 Gb/s, ~2 us) and within a node."""
    bandwidth_Bps: float = 200e9 / 8
    latency_s: float = 2e-6
    local_bandwidth_Bps: float = 50e9  # host copy to the node's inference ranks / NVLink-ish
    # weight publish: "tree" (hpcvla: a broadcast to node leaders) or "sequential" (the root
    # sends the weights to every remote inference rank in turn, one link's bandwidth)
    weight_sync: str = "tree"

    def broadcast_s(self, nbytes: float, nodes: int, receivers: int = 0) -> float:
        """Seconds until the remote nodes hold a published version; `receivers`: inference
        ranks outside the root's node (the sequential sync's messages)."""
        if nodes <= 1 or nbytes <= 0:
            return 0.0
        if self.weight_sync == "sequential":
            return receivers * (self.latency_s + nbytes / self.bandwidth_Bps)
        return math.ceil(math.log2(nodes)) * self.latency_s + 2 * nbytes / self.bandwidth_Bps

    def allreduce_s(self, nbytes: float, ranks: int, nodes: int) -> float:
        """Hierarchical ring all-reduce of `ranks` ranks over `nodes` nodes: within a node
        over the local links, then between nodes over each node's one link."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        per_node = max(1, ranks // max(1, nodes))
        local = 2 * (per_node - 1) / per_node * nbytes / self.local_bandwidth_Bps
        if nodes <= 1:
            return local
        return local + 2 * (nodes - 1) * (nbytes / nodes / self.bandwidth_Bps + self.latency_s)


@dataclass
class Prediction:
    env_steps_per_s: float
    busy: dict          # stage -> busy fraction
    bottleneck: str
    wall_s: float       # simulated seconds
    env_steps: float

    def to_dict(self) -> dict:
        return asdict(self)


def predict(layout: Layout, costs: StageCosts, network: Network = Network(),
            updates: int | None = None, seed: int = 0) -> Prediction:
    """Simulate `layout` with `costs`; `updates` versions from the start (as a run measures
    it), or None: the steady rate (versions 3..13 of 14)."""
    if layout.traits.colocated:
        return _colocated(layout, costs, network, updates, seed)
    return _World(layout, costs, network, seed).run(updates)


def _sim_draw(rng, costs: StageCosts, envs: int) -> float:
    """Seconds one shard of `envs` envs takes for a chunk."""
    fixed = costs.sim_fixed_s + costs.sim_per_env_s * envs
    if costs.sim_sigma <= 0 or costs.sim_median_s <= 0:
        return fixed + costs.sim_median_s
    return fixed + float(rng.lognormal(math.log(costs.sim_median_s), costs.sim_sigma,
                                       envs).max())


def _colocated(lay: Layout, costs: StageCosts, net: Network, updates, seed) -> Prediction:
    """Lock-step ranks: version time = slowest rank's rollout + training (+ all-reduce)."""
    rng = np.random.default_rng(seed)
    E, T, H = lay.envs, lay.segment_len, lay.chunk_len
    groups = math.ceil(lay.micro_batch * lay.micro_batches / E)
    infer = costs.inf_a_s + costs.inf_b_s * E + costs.inf_per_request_s
    train = lay.micro_batches * lay.epochs * (costs.learn_fixed_s + lay.micro_batch *
                                                   costs.learn_s_per_segment)
    grad = costs.weight_bytes if costs.grad_bytes is None else costs.grad_bytes
    train += lay.epochs * net.allreduce_s(grad, lay.world, lay.world // lay.ranks_per_node)
    n = updates or 14
    wall, sim_busy, inf_busy = (costs.learner_start_s if updates else 0.0), 0.0, 0.0
    for _ in range(n):
        sims = [sum(_sim_draw(rng, costs, E) for _ in range(groups * T))
                for _ in range(lay.world)]
        rollout = [s + (groups * T + 1) * infer for s in sims]
        wall += max(rollout) + train
        sim_busy += float(np.mean(sims))
        inf_busy += (groups * T + 1) * infer
    steps = n * lay.world * groups * T * E * H
    busy = {"simulate": sim_busy / wall, "infer": inf_busy / wall, "train": n * train / wall}
    return Prediction(steps / wall, busy, max(busy, key=busy.get), wall, steps)


class _Cell:
    """An inference rank, its simulator ranks' shards and its staleness quota."""

    def __init__(self, sl: "_World", learner: "_Learner", n_sims: int, quota: int):
        self.sl, self.env, self.learner = sl, sl.env, learner
        lay = sl.lay
        self.e = lay.envs // sl.shards
        self.quota, self.started, self.version = quota, 0, 0
        self.batch_max = sl.batch_max or n_sims * lay.envs
        self.queue: list[tuple[int, float]] = []      # (shard, arrival)
        self.t = [0] * (n_sims * sl.shards)           # chunk-steps of each shard's segment
        self.batch_of = [0] * len(self.t)             # learner batch of each shard's segment
        self.answer = [None] * len(self.t)
        self.wake = self.env.event()
        self.busy = self.sim_busy = 0.0
        self.steps = 0
        self.pending_version = 0
        self.busy_until = 0.0                          # end of the current forward pass
        self.cores = [simpy.Resource(self.env) for _ in range(n_sims)]  # sim_serial only
        self.env.process(self._serve())
        for shard in range(len(self.t)):
            self.env.process(self._shard(shard))

    def poke(self):
        if not self.wake.triggered:
            self.wake.succeed()

    def _shard(self, shard: int):
        env, sl = self.env, self.sl
        while not sl.done:
            self.answer[shard] = env.event()
            # the inference rank notices a request between forward passes: T_max counts
            # from then (roles/inference.py polls the exchange only in its loop)
            self.queue.append((shard, max(env.now, self.busy_until)))
            self.poke()
            yield self.answer[shard]
            if sl.done:
                return
            dt = _sim_draw(sl.rng, sl.costs, self.e)
            if sl.costs.sim_serial:
                with self.cores[shard // sl.shards].request() as core:
                    yield core
                    yield env.timeout(dt)
            else:
                yield env.timeout(dt)
            self.sim_busy += dt
            self.steps += self.e * sl.lay.chunk_len

    def _eligible(self) -> set:
        T = self.sl.lay.segment_len
        return eligible((s for s, _ in self.queue), lambda s: self.t[s] in (0, T), self.e,
                        self.version, self.sl.max_staleness, self.quota, self.started)

    def _serve(self):
        env, sl, T = self.env, self.sl, self.sl.lay.segment_len
        while not sl.done:
            if self.pending_version > self.version:  # swap weights between passes
                yield env.timeout(sl.local_copy_s)
                self.busy += sl.local_copy_s
                self.version = self.pending_version
            eligible = self._eligible()
            # held at a boundary: the next pass values (and so delivers) the finished segment
            held = [s for s, _ in self.queue if s not in eligible and self.t[s] == T]
            waiting = [(s, t0) for s, t0 in self.queue if s in eligible]
            fire, timeout = False, None
            if waiting:
                if len(self.queue) * self.e >= self.batch_max:
                    fire = True
                else:
                    left = waiting[0][1] + sl.wait_max_s - env.now
                    fire, timeout = left <= 1e-12, left
            if not fire and not (held and not waiting):  # (no pass coming: one of their own)
                self.wake = env.event()
                yield self.wake if timeout is None or math.isinf(timeout) else \
                    self.wake | env.timeout(timeout)
                continue
            batch = []
            for s, _ in waiting if fire else ():
                if batch and (len(batch) + 1) * self.e > self.batch_max:
                    break
                batch.append(s)
            self.queue = [(s, t0) for s, t0 in self.queue if s not in batch]
            c, rows = sl.costs, len(batch) + len(held)
            dt = c.inf_a_s + c.inf_b_s * rows * self.e + c.inf_per_request_s * rows
            self.busy_until = env.now + dt
            yield env.timeout(dt)
            self.busy += dt
            for s in held:
                self.learner.deliver(self.batch_of[s], self.e)
                self.t[s] = 0
            for s in batch:
                if self.t[s] == T:
                    self.learner.deliver(self.batch_of[s], self.e)
                    self.t[s] = 0
                if self.t[s] == 0:
                    self.batch_of[s] = self.started // self.quota
                    self.started += self.e
                self.t[s] += 1
                self.answer[s].succeed()


class _Learner:
    """A learner rank and the cells that feed it (one slice)."""

    def __init__(self, world: "_World", cells, quota: int):
        self.world, self.env = world, world.env
        self.arrived: dict[int, int] = {}
        self.wake = self.env.event()
        self.busy = 0.0
        self.cells = [_Cell(world, self, len(c.simulators), quota) for c in cells]

    def deliver(self, batch: int, segments: int) -> None:
        self.arrived[batch] = self.arrived.get(batch, 0) + segments
        if not self.wake.triggered:
            self.wake.succeed()

    def epoch0(self, version: int):
        """Train this version's micro-batches as their data arrives (epoch 0)."""
        env, lay, w = self.env, self.world.lay, self.world
        per_micro = w.costs.learn_fixed_s + lay.micro_batch * w.costs.learn_s_per_segment
        taken = 0
        for m in range(lay.micro_batches):
            need = lay.micro_batch if lay.traits.streamed or m else w.batch
            while self.arrived.get(version, 0) - taken < need:
                self.wake = env.event()
                yield self.wake
            taken += lay.micro_batch
            yield env.timeout(per_micro)
            self.busy += per_micro


class _World:
    """The learners, their cells and the weight plane (module docstring). Disaggregated
    layouts are symmetric per learner: `slices` learners (the ones with the fewest
    producers) are simulated, lock-stepped by their gradient all-reduce, and their env steps
    scaled to all learners."""

    def __init__(self, lay: Layout, costs: StageCosts, net: Network, seed: int,
                 slices: int = 8):
        self.lay, self.costs, self.net = lay, costs, net
        self.env, self.rng = simpy.Environment(), np.random.default_rng(seed)
        t = lay.traits
        self.shards = lay.effective_shards
        self.batch_max = lay.batch_max if t.dynamic_batcher else 0
        self.wait_max_s = lay.wait_max_s if t.dynamic_batcher else math.inf
        self.max_staleness = lay.max_staleness if t.bounded_staleness else 0
        plan = build_plan(lay.world, lay.ranks_per_node, "disaggregated", lay.per_node)
        self.n_learners, nodes = len(plan.learners), plan.num_nodes
        self.batch = lay.micro_batch * lay.micro_batches
        root_node = plan.ranks[plan.weight_root].node
        remote = sum(1 for c in plan.cells if c.node != root_node)
        self.publish_s = net.broadcast_s(costs.weight_bytes, nodes, remote)
        self.local_copy_s = costs.weight_bytes / net.local_bandwidth_Bps
        grad = costs.weight_bytes if costs.grad_bytes is None else costs.grad_bytes
        learner_nodes = len({plan.ranks[r].node for r in plan.learners})
        self.allreduce_s = net.allreduce_s(grad, self.n_learners, learner_nodes)
        self.done = False
        chosen = sorted(plan.learners, key=lambda r: len(plan.producers_of(r)))[:slices]
        self.learners = []
        for rank in chosen:
            producers = plan.producers_of(rank)
            cells = [c for c in plan.cells if c.inference in producers]
            self.learners.append(_Learner(self, cells, self.batch // len(cells)))
        self.cells = [c for learner in self.learners for c in learner.cells]

    def _publish(self, version: int):
        yield self.env.timeout(self.publish_s)
        for cell in self.cells:
            cell.pending_version = max(cell.pending_version, version)
            cell.poke()

    def _train(self, updates: int, marks: list):
        env, lay = self.env, self.lay
        per_micro = self.costs.learn_fixed_s + lay.micro_batch * self.costs.learn_s_per_segment
        yield env.timeout(self.costs.learner_start_s)  # the cells act meanwhile
        for version in range(updates):
            # epoch 0 ends in an optimizer step: every learner waits for the slowest
            yield simpy.AllOf(env, [env.process(lr.epoch0(version)) for lr in self.learners])
            rest = (lay.epochs - 1) * lay.micro_batches * per_micro + lay.epochs * \
                self.allreduce_s
            yield env.timeout(rest)
            for lr in self.learners:
                lr.busy += rest
            env.process(self._publish(version + 1))
            marks.append((env.now, sum(c.steps for c in self.cells)))
        self.done = True

    def run(self, updates: int | None) -> Prediction:
        marks: list = []
        done = self.env.process(self._train(updates or 14, marks))
        self.env.run(until=done)
        wall = self.env.now
        if updates is None:  # steady rate between versions 3 and 14
            (t0, s0), (t1, s1) = marks[2], marks[-1]
        else:
            (t0, s0), (t1, s1) = (0.0, 0), marks[-1]
        steps = (s1 - s0) * self.n_learners / len(self.learners)
        n_shards = sum(len(c.t) for c in self.cells)
        busy = {"simulate": sum(c.sim_busy for c in self.cells) / n_shards / wall,
                "infer": sum(c.busy for c in self.cells) / len(self.cells) / wall,
                "train": sum(lr.busy for lr in self.learners) / len(self.learners) / wall}
        return Prediction(steps / (t1 - t0), busy, max(busy, key=busy.get), t1 - t0, steps)
