"""Run under MPI on 2 ranks: rank 1 produces real segment groups (the `reach` env, as an
inference rank builds them) into rank 0's trajectory ring; rank 0 damages two published slots
in its own memory (a flipped payload bit, a changed header field), then takes them in through
the learner's own intake (roles/queues.SegmentQueues). The damaged groups must be dropped,
counted and reported, never handed to training, and the intake must then end the run (their
batch could never complete); the others must arrive intact, and the ledger must show exactly
which groups were taken.

    hpcvla launch -n 2 -- tests/faults/integrity_world.py
"""

import numpy as np
from mpi4py import MPI

from hpcvla.envs import make_env
from hpcvla.roles.queues import SegmentQueues
from hpcvla.roles.segments import SegmentBuilder, outcome_of
from hpcvla.transport import records
from hpcvla.transport.ring import TrajectoryRing
from hpcvla.transport.ring_reader import RingDamaged
from hpcvla.transport.slots import SLOT_HEADER

GROUPS, N_ENVS, SLOTS, SLOT_BYTES = 4, 4, 8, 64 * 1024


def segment_groups():
    """The same groups on both ranks (fixed seeds), so the learner can check what it got."""
    env = make_env("reach", N_ENVS, seed=5, image_size=16, chunk_len=2)
    spec, rng = env.spec, np.random.default_rng(5)
    builder = SegmentBuilder(spec.obs, N_ENVS, spec.chunk_len, spec.action_dim, 4,
                             producer=1, slot=0)
    obs, groups = env.reset(), []
    while len(groups) < GROUPS:
        value = rng.normal(size=N_ENVS).astype(np.float32)
        if builder.full:
            groups.append(builder.finish(value))
        actions = rng.uniform(-1, 1, (N_ENVS, spec.chunk_len, spec.action_dim)).astype(
            np.float32)
        builder.add_step(obs, actions, rng.normal(size=N_ENVS).astype(np.float32), value, 0)
        result = env.step(actions)
        builder.record_outcome(outcome_of(result))
        obs = result.obs
    env.close()
    return groups


def main():
    comm = MPI.COMM_WORLD
    reports = []
    # payload checksums on one host too (their default: only across hosts)
    ring = TrajectoryRing(comm, SLOTS, SLOT_BYTES, report=reports.append, checksum="always")
    groups = segment_groups()
    if comm.Get_rank() == 1:
        for group in groups:
            ring.writer.put(records.encode(group), records.schema_of(group), timeout=60)
        ring.writer.close()
    else:
        while ring.reader.occupancy()[0] < GROUPS + 1:  # every group and the close are published
            pass
        slots = ring.reader.slots  # the learner's own window memory
        slots[1, SLOT_HEADER.itemsize + 5000] ^= 0x04                    # group 1: payload bit
        slots[2, SLOT_HEADER.fields["seq"][1]] ^= 0x01                   # group 2: header seq
        stats = {"staleness_hist": {}}
        queues = SegmentQueues(ring.reader, max_staleness=0, stats=stats)
        try:  # the intake takes what is intact, then ends the run: the batch cannot complete
            queues.pump()
            raise AssertionError("the learner's intake went on past damaged slots")
        except RingDamaged as err:
            assert "dropped 2 slot(s)" in str(err) and "lost 2 record(s)" in str(err), err
        assert 1 in ring.reader.stats.closed
        have = queues.available(0)
        assert have == 2 * N_ENVS, have
        trained = queues.take(have, 0)
        for got, want in zip(trained, (groups[0], groups[3])):
            assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k])
                                                     for k in want)
        s = ring.reader.stats
        assert (s.records, s.bad_slots, s.lost_records) == (2, 2, 2), s
        text = "\n".join(reports)
        assert text.count("checksum mismatch") == 2 and "records 1..2 lost" in text, text
        ledger = queues.ledger()  # groups 0 and 3 trained; the 2 damaged ones are the hole
        assert ledger == {"1/0": {"groups": 2, "first": 0, "last": 3, "missing": 2}}, ledger
        print(f"integrity: 2 of {GROUPS} segment groups damaged in the ring: dropped, "
              f"counted (bad_slots {s.bad_slots}, lost_records {s.lost_records}), reported, "
              f"never trained, the run ended; ledger {ledger}", flush=True)
    ring.free()


if __name__ == "__main__":
    main()
