"""`hpcvla bench transport`: each transport mechanism against the raw MPI/memory operation it
is built on, measured side by side in the same run (ratios, not absolute numbers, are what
carry over between machines).

* ring: records of 64 KiB and 1 MiB from 1 and 7 producers into rank 0's TrajectoryRing,
  against the same bytes as raw `Put`+`Flush` into a window on rank 0 (no slots, no checks)
  of the same size (16 records per producer), with the ring's default checks (payload
  checksums only across hosts), and once more for 1 producer with `checksum="always"`
  (`ring_*_1p_checked`: what payload checksums cost on one host); 64 KiB records also
  handed over 4 at a time with `put_many`, packed 4 to a slot (`ring_64KiB_*_packed4`);
  when the world spans hosts, also from one producer on another host (`ring_*_remote_1p`):
  the ring's progress thread against a raw target that sits in a barrier (driving progress);
* exchange: observations a simulator writes into its ObsActionExchange slot (one copy, as an
  env rendering in place) and the inference rank then reads in place (zero copy), with the
  request/response flags and 2 shards pipelined, against one plain memcpy of the same bytes:
  the ratio is what the signalling and waiting cost on top of the copy (0.92 here before the
  exchange rang doorbells, 0.77-0.81 with them: a ring costs each side a syscall, about 45 us
  a round trip on this VM when both ranks are awake; `wake` is what the rings buy);
* wake: a simulator asking for actions that the inference rank answers after 20 ms (a VLA's
  forward pass on a GPU), with the exchange's doorbells against without (the flags polled at
  DATA_POLL_CAP): the simulator's CPU seconds per answer (`wake_cpu_ratio`: what its waiting
  costs with bells over without) and how long after the answer it notices
  (`wake_bells_late_us`, `wake_polled_late_us`);
* weights: a ~100 MB WeightPlane publish until every rank holds a copy (the root's one copy
  into its node's store, one broadcast per other node's leader into that node's store, each
  other rank's copy out of it; the root holds the source, as Bcast's root does), against one
  raw `Bcast` of the same buffer to every rank; then the same with 90 % of the bytes a frozen
  prefix (`weights_frozen90_ratio`, no target: the plane sends the other 10 % after the
  first version, the Bcast all of it);

Each pair runs `repeats` (5) times alternating; the median time is reported. With 3, on the
2-core machine here, the weights pair went over its target on noise alone about one run in
twelve (twice 12 runs: 0.81-1.34 and 0.85-1.25, medians 0.92 and 0.99); with 5: 0.82-1.18.
"""

from __future__ import annotations

import json
import socket
import statistics
import time

import numpy as np
from mpi4py import MPI

from hpcvla.topology.comms import build_communicators
from hpcvla.topology.plan import build_plan
from hpcvla.transport.backoff import idle_barrier, wait_until
from hpcvla.transport.exchange import ObsActionExchange
from hpcvla.transport.ring import TrajectoryRing
from hpcvla.transport.manifest import Manifest
from hpcvla.transport.weights import WeightPlane

KiB, MiB = 1 << 10, 1 << 20
# 64 KiB records are small enough to batch: their targets are for put_many
# of 4 at a time (`*_packed4`); one put per record is reported beside them
TARGETS = {"ring_1MiB_ratio": ">= 0.70", "ring_1MiB_7p_ratio": ">= 0.70",
           "ring_64KiB_1p_packed4_ratio": ">= 0.40", "ring_64KiB_7p_packed4_ratio": ">= 0.40",
           "exchange_ratio": ">= 0.70", "weights_ratio": "<= 1.3", "wake_cpu_ratio": "<= 0.5"}


def _timed(comm, fn) -> float:
    comm.Barrier()  # [dist]
    start = MPI.Wtime()
    fn()
    comm.Barrier()  # [dist]
    return MPI.Wtime() - start


def _participants(world, count):
    """The communicator of the first `count` ranks (or of the world ranks listed in `count`);
    the others get COMM_NULL and wait for them in a sleeping barrier, so they do not spin on
    the cores the measured ranks need."""
    chosen = range(count) if isinstance(count, int) else count
    color = 0 if world.Get_rank() in chosen else MPI.UNDEFINED
    comm = world.Split(color, world.Get_rank())  # [dist]
    if comm == MPI.COMM_NULL:
        idle_barrier(world, cap=5e-3)  # [dist]
    return comm


def _done(world, comm):
    comm.Free()  # [dist]
    idle_barrier(world, cap=5e-3)  # [dist]


def _median_pair(comm, a, b, repeats):
    a(), b()  # warm-up: first-touch page faults and connection set-up are not measured
    times_a, times_b = [], []
    for _ in range(repeats):
        times_a.append(_timed(comm, a))
        times_b.append(_timed(comm, b))
    return statistics.median(times_a), statistics.median(times_b)


def bench_ring(world, record_bytes, producers, total_bytes, repeats, members=None,
               checksum="auto", packed=1):
    """(ring GB/s, raw Put+Flush GB/s) for `producers` ranks writing to rank 0: world ranks
    1..producers, or the world ranks `members` (rank 0 first). With `packed` > 1, producers
    hand the ring that many records at a time (`put_many`), into slots that hold as many."""
    comm = _participants(world, members or producers + 1)
    if comm == MPI.COMM_NULL:
        return None
    rank = comm.Get_rank()
    per_producer = max(4, total_bytes // record_bytes // producers) // packed * packed
    n_slots = 16
    # the same memory as the raw window: 16 records per producer (+ headers, packing tables)
    ring = TrajectoryRing(comm, n_slots // packed * producers,  # [dist]
                          packed * record_bytes + 128, checksum=checksum)
    raw_bytes = n_slots * record_bytes * producers if rank == 0 else 0
    raw = MPI.Win.Allocate(raw_bytes, 1, comm=comm)  # [dist]
    raw.Lock_all(MPI.MODE_NOCHECK)
    payload = np.random.default_rng(rank).integers(0, 255, record_bytes, dtype=np.uint8)

    def ring_run():
        if rank == 0:
            received = 0
            while received < per_producer * producers:
                received += len(ring.reader.get(timeout=120))
            ring.reader.release()
        elif packed > 1:
            for _ in range(per_producer // packed):
                ring.writer.put_many([(payload, 0)] * packed)
        else:
            for _ in range(per_producer):
                ring.writer.put(payload)

    def raw_run():
        if rank:
            base = (rank - 1) * n_slots * record_bytes
            for i in range(per_producer):
                raw.Put(payload, 0, (base + (i % n_slots) * record_bytes, record_bytes,
                                     MPI.BYTE))
                raw.Flush(0)

    t_ring, t_raw = _median_pair(comm, ring_run, raw_run, repeats)
    raw.Unlock_all()
    raw.Free()  # [dist]
    ring.free()  # [dist]
    _done(world, comm)
    moved = per_producer * producers * record_bytes / 1e9
    return moved / t_ring, moved / t_raw


def bench_exchange(world, obs_bytes, iterations, repeats):
    """(exchange GB/s, memcpy GB/s): ranks 0 (inference) and 1 (simulator) of one node."""
    rank = world.Get_rank()
    comm = _participants(world, 2)
    if comm == MPI.COMM_NULL:
        return None
    obs_dtype = np.dtype([("pixels", "u1", (obs_bytes,))])
    act_dtype = np.dtype([("chunk", "<f4", (64, 7))])
    shards = 2
    ex = ObsActionExchange(comm, shards, obs_dtype, act_dtype)  # [dist]
    source = np.random.default_rng(0).integers(0, 255, obs_bytes, dtype=np.uint8)
    batch = np.empty(obs_bytes, np.uint8)

    def exchange_run():
        if rank == 1:  # simulator: write in place (as an env renders), submit; shards overlap
            for i in range(iterations):
                shard = i % shards
                if i >= shards:
                    ex.actions(shard, timeout=60)
                pixels = ex.obs(shard)["pixels"]
                np.copyto(pixels, source)
                pixels[:8].view(np.int64)[0] = i  # stamp: the server checks the order
                ex.submit(shard)
            for shard in range(shards):
                ex.actions(shard, timeout=60)
        else:  # inference: a zero-copy view of each observation (what the model reads)
            served = 0
            while served < iterations:
                for slot in ex.wait_pending(timeout=60):
                    stamp = int(ex.request_obs(slot)["pixels"][:8].view(np.int64)[0])
                    assert stamp % shards == slot, (stamp, slot)
                    ex.respond(slot)
                    served += 1

    def memcpy_run():
        if rank == 1:
            for _ in range(iterations):
                np.copyto(batch, source)

    t_ex, t_copy = _median_pair(comm, exchange_run, memcpy_run, repeats)
    ex.free()  # [dist]
    _done(world, comm)
    moved = iterations * obs_bytes / 1e9
    return moved / t_ex, moved / t_copy


def bench_wake(world, work_s, answers, repeats):
    """{bells, polled: (simulator CPU s per answer, s between the answer and its noticing)}:
    ranks 0 (inference, answering after `work_s` asleep) and 1 (simulator) of one node."""
    comm = _participants(world, 2)
    if comm == MPI.COMM_NULL:
        return None
    one = np.dtype([("at", "<f8")])  # the answer's time: when it was given
    exchanges = {bells: ObsActionExchange(comm, 1, one, one, bells=bells)  # [dist]
                 for bells in (True, False)}
    measured: dict[bool, list[tuple[float, float]]] = {True: [], False: []}

    def run(bells):
        ex = exchanges[bells]
        if comm.Get_rank() == 1:
            cpu, late = time.process_time(), 0.0
            for _ in range(answers):
                ex.submit(0)
                answered_at = float(ex.actions(0, timeout=60)["at"])
                late += time.perf_counter() - answered_at  # one clock: one node's
            measured[bells].append(((time.process_time() - cpu) / answers, late / answers))
        else:
            for _ in range(answers):
                slot, = ex.wait_pending(timeout=60)
                time.sleep(work_s)
                ex.request_actions(slot)["at"] = time.perf_counter()
                ex.respond(slot)

    _median_pair(comm, lambda: run(True), lambda: run(False), repeats)
    for ex in exchanges.values():
        ex.free()  # [dist]
    medians = {("bells" if bells else "polled"): tuple(map(statistics.median, zip(*runs[1:])))
               for bells, runs in measured.items()} if comm.Get_rank() == 1 else None
    medians = comm.bcast(medians, root=1)  # [dist] (the warm-up's left out)
    _done(world, comm)
    return medians


def bench_weights(world, nbytes, ranks_per_node, repeats, frozen=0.0):
    """(publish s, raw Bcast s) for `nbytes` of weights reaching every rank; with `frozen`,
    that fraction of them is a frozen prefix (sent with the first version only), and the
    Bcast still moves all of them, as a plane that knew nothing frozen would."""
    plan = build_plan(world.Get_size(), ranks_per_node, "colocated")
    comms = build_communicators(plan, world)  # [dist]
    cut = int(nbytes * frozen) // 64 * 64
    manifest = Manifest((("prefix", "uint8", (cut,)), ("expert", "uint8", (nbytes - cut,))),
                        frozenset({"prefix"} if frozen else ()))
    plane = WeightPlane(comms.control, comms.node,  # [dist]
                        world.Get_rank() in plan.node_leaders, manifest)
    weights = np.random.default_rng(1).integers(0, 255, manifest.nbytes, dtype=np.uint8)
    tensors = manifest.views(weights)
    out = np.empty(manifest.nbytes, np.uint8)
    version = [0]

    def publish_run():
        version[0] += 1
        if world.Get_rank() == plan.weight_root:  # the source holds them, as Bcast's root
            plane.publish(version[0], tensors)
            # wait as a learner computes (asleep), not in the spinning Barrier: it would
            # contend for MPI with the thread that sends
            wait_until(plane.sent, "the weights to be sent", 120, cap=5e-4)
            return
        plane.wait_for(version[0], timeout=120)
        assert plane.read_into(out, trainable_only=version[0] > 1) >= version[0]

    def bcast_run():
        world.Bcast(out if world.Get_rank() else weights, root=0)  # [dist]

    t_publish, t_bcast = _median_pair(world, publish_run, bcast_run, repeats)
    plane.close()  # [dist]
    comms.free()  # [dist]
    return t_publish, t_bcast


def run(world=MPI.COMM_WORLD, quick=False, ranks_per_node=4, json_path=None) -> dict:
    rank, size = world.Get_rank(), world.Get_size()
    if size < 2:
        raise SystemExit("hpcvla bench transport needs at least 2 ranks (8 for 7 producers)")
    repeats = 1 if quick else 5
    hosts = world.allgather(MPI.Get_processor_name())  # [dist]
    remote = next((r for r, h in enumerate(hosts) if h != hosts[0]), None)
    results: dict = {"world_size": size, "host": socket.gethostname(), "quick": quick,
                     "hosts": len(set(hosts)),
                     "mpi": MPI.Get_library_version().splitlines()[0].strip(),
                     "repeats": repeats, "targets": TARGETS, "time": time.time()}
    rows = []

    def ring_pair(key, row, *args, **kwargs):  # collective; rank 0 records the pair
        res = bench_ring(world, *args, repeats, **kwargs)
        if rank == 0:
            results[f"{key}_GBps"], results[f"{key}_raw_GBps"] = res
            results[f"{key}_ratio"] = res[0] / res[1]
            rows.append((row, *res))

    total = (16 if quick else 256) * MiB
    for record_bytes, label in ((64 * KiB, "64KiB"), (MiB, "1MiB")):
        for producers in sorted({1, min(7, size - 1)}):
            ring_pair(f"ring_{label}_{producers}p", f"ring {label} x {producers} producer(s)",
                      record_bytes, producers, total)
            if record_bytes < MiB:  # small records, 4 per put_many and per slot
                ring_pair(f"ring_{label}_{producers}p_packed4", "  ... put_many, 4 per slot",
                          record_bytes, producers, total, packed=4)
        # payloads checksummed on one host too (learner.ring_checksum=always): the price
        ring_pair(f"ring_{label}_1p_checked", "  ... checksum always", record_bytes, 1, total,
                  checksum="always")
        if remote is not None:  # one producer on another host: the network path
            ring_pair(f"ring_{label}_remote_1p", f"ring {label} x 1 producer on "
                      f"{hosts[remote]}", record_bytes, 1, (8 if quick else 64) * MiB,
                      members=[0, remote])
    ex = bench_exchange(world, 4 * MiB, 50 if quick else 400, repeats)
    if rank == 0:
        results["exchange_GBps"], results["exchange_memcpy_GBps"] = ex
        results["exchange_ratio"] = ex[0] / ex[1]
        rows.append(("exchange 4 MiB obs vs memcpy", *ex))
    wake = bench_wake(world, 20e-3, 10 if quick else 100, repeats)
    if rank == 0:
        for kind, (cpu, late) in wake.items():
            results[f"wake_{kind}_cpu_us"], results[f"wake_{kind}_late_us"] = \
                cpu * 1e6, late * 1e6
        results["wake_cpu_ratio"] = wake["bells"][0] / wake["polled"][0]
    rpn = hosts.count(hosts[0]) if remote is not None else \
        ranks_per_node if size % ranks_per_node == 0 else size  # real hosts: their size
    weights_bytes = (16 if quick else 100) * 1000 * 1000
    t_pub, t_bcast = bench_weights(world, weights_bytes, rpn, repeats)
    t_frozen, t_whole = bench_weights(world, weights_bytes, rpn, repeats, frozen=0.9)
    if rank == 0:
        results["weights_bytes"] = weights_bytes
        results["weights_publish_s"], results["weights_bcast_s"] = t_pub, t_bcast
        results["weights_ratio"] = t_pub / t_bcast
        results["weights_frozen90_publish_s"], results["weights_frozen90_ratio"] = \
            t_frozen, t_frozen / t_whole  # 90 % frozen: 1/10 of the bytes cross after v1
        # headline ratios the targets refer to: 1 MiB, single producer
        results["ring_1MiB_ratio"] = results["ring_1MiB_1p_ratio"]
        results["targets_met"] = {
            key: (results[key] >= float(goal[3:]) if goal.startswith(">=")
                  else results[key] <= float(goal[3:]))
            for key, goal in TARGETS.items() if key in results}
        print(f"{'pair':<36} {'mechanism':>12} {'baseline':>12} {'ratio':>7}")
        for name, mine, base in rows:
            print(f"{name:<36} {mine:>9.2f} GB/s {base:>9.2f} GB/s {mine / base:>7.2f}")
        print(f"{'weights publish vs Bcast (s)':<36} {t_pub:>12.4f} {t_bcast:>12.4f} "
              f"{t_pub / t_bcast:>7.2f}")
        print(f"{'  90 % frozen vs Bcast of all (s)':<36} {t_frozen:>12.4f} {t_whole:>12.4f} "
              f"{t_frozen / t_whole:>7.2f}")
        print(f"{'wake: simulator CPU us per answer':<36} {results['wake_bells_cpu_us']:>9.1f} "
              f"bell {results['wake_polled_cpu_us']:>7.1f} poll {results['wake_cpu_ratio']:>7.2f}")
        print(f"{'  noticed, us after the answer':<36} {results['wake_bells_late_us']:>9.1f} "
              f"bell {results['wake_polled_late_us']:>7.1f} poll")
        print(f"targets met: {results['targets_met']}")
        if json_path:
            with open(json_path, "w") as handle:
                json.dump(results, handle, indent=1)
    return results
