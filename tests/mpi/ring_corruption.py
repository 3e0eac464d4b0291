"""Run under MPI on 2 ranks: rank 1 writes good records and, by hand following the documented
slot layout, a corrupted, a torn and a stale slot. Rank 0 must deliver only the good records,
count the bad slots and the lost sequence numbers, and report each. A close that arrives
after the last record ends the consumer's wait (get returns no records).

    mpiexec -n 2 python -m mpi4py tests/mpi/ring_corruption.py
"""

import zlib

import numpy as np
from mpi4py import MPI

from hpcvla.transport.ring import TrajectoryRing
from hpcvla.transport.ring_reader import RingDamaged
from hpcvla.transport.slots import MASK, SLOT_HEADER, checksum64

SLOTS, SLOT_BYTES = 4, 4096


def slot_checksum(header: np.ndarray, payload: np.ndarray) -> int:
    """The checksum word of a slot holding `header` (a SLOT_HEADER item) and `payload`
    (slots.py's formula)."""
    return (checksum64(payload) + zlib.crc32(header.view(np.uint8)[8:56])) & MASK


def publish_by_hand(ring, seq, payload, damage):
    """The producer protocol of ring.py (its lane's next fragment), with one step damaged."""
    win, f = ring.win, ring.writer._fragment
    assert f < SLOTS  # fresh slots: no need to wait for the consumer here
    disp = ring.slot_disp(ring.writer.lane, f)
    header = np.zeros(1, SLOT_HEADER)
    h = header[0]
    h["fragment"], h["producer"], h["seq"], h["part"], h["nparts"] = f, 1, seq, 0, 1
    h["length"] = h["record_length"] = payload.nbytes
    h["checksum"] = slot_checksum(header, payload)
    sent = payload.copy()
    if damage == "flipped":
        sent[100] ^= 0x10
    if damage == "torn":
        sent = sent[: payload.nbytes // 2]  # only half the payload lands before publishing
    if damage != "stale":  # stale: the slot keeps an older header and payload
        win.Put(header.view(np.uint8)[8:], 0, (disp + 8, 56, MPI.BYTE))
        win.Put(sent, 0, (disp + 64, sent.nbytes, MPI.BYTE))
    win.Flush(0)
    win.Put([np.array([f + 1], np.int64), MPI.INT64_T], 0, (disp, 1, MPI.INT64_T))
    win.Flush(0)
    ring.writer._fragment = f + 1


def main():
    comm = MPI.COMM_WORLD
    reports = []
    ring = TrajectoryRing(comm, SLOTS, SLOT_BYTES, report=reports.append, checksum="always")
    payload = np.arange(2000, dtype=np.uint16).view(np.uint8)[:3000].copy()
    if comm.Get_rank() == 1:
        ring.writer.put(payload)                        # seq 0: good
        for seq, damage in ((1, "flipped"), (2, "torn"), (3, "stale")):
            publish_by_hand(ring, seq, payload, damage)
        ring.writer._seq = 4
        comm.Barrier()                           # consumer drains, freeing the slots
        ring.writer.put(payload)                        # seq 4: good
        comm.Barrier()                           # consumer has seq 4
        ring.writer.close()                             # a close alone ends the consumer's get
    else:
        delivered = []
        while ring.reader.occupancy()[0] < SLOTS:
            pass
        delivered += [(r.seq, np.array_equal(r.data, payload)) for r in ring.reader.poll()]
        comm.Barrier()
        while len(delivered) < 2:
            delivered += [(r.seq, np.array_equal(r.data, payload))
                          for r in ring.reader.get(timeout=30)]
        comm.Barrier()
        assert ring.reader.get(timeout=30) == [] and 1 in ring.reader.stats.closed
        s = ring.reader.stats
        assert delivered == [(0, True), (4, True)], delivered
        assert (s.bad_slots, s.lost_records, s.records) == (3, 3, 2), s
        text = "\n".join(reports)
        assert text.count("checksum mismatch") == 2 and "stale or torn" in text, text
        assert "records 1..3 lost" in text, text
        try:  # what a learner's queues call after each poll: the run ends there
            ring.reader.check_intact()
            raise AssertionError("check_intact passed a damaged ring")
        except RingDamaged as err:
            assert "dropped 3 slot(s)" in str(err) and "lost 3 record(s)" in str(err), err
        print("ring: flipped, torn and stale slots detected, reported, never delivered",
              flush=True)
    ring.free()
    assert ring.win == MPI.WIN_NULL


if __name__ == "__main__":
    main()
