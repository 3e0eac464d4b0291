"""Run under MPI on 2 ranks: transfers larger than one MPI call may move (2^31 bytes), as a
full-size π0's weight versions are (6.5 GB).

* Weight plane: rank 0 is the weight root on a node of its own, rank 1 the leader of another
  node (each rank's node communicator is COMM_SELF), so every byte crosses the control
  communicator. Version 1 is whole (2^31 + 25 KiB), version 2 the trainable places only
  (2^31 + 8 KiB around a frozen tensor, packed by the root); both must arrive bit-exact, the
  frozen tensor as in version 1.
* Trajectory ring: rank 1 puts one record of 2^31 + 4 KiB into rank 0's ring, a slot that
  holds it whole (one fragment: its payload goes in pieces); it must arrive bit-exact.

Memory: about 8.7 GB per rank (the weight window's two halves and the packed buffer, or the
root's two buffers, its packed one and the tensors).

    mpiexec -n 2 python -m mpi4py tests/mpi/large_transfers.py
"""

import json
import time
import zlib

import numpy as np
import torch
from mpi4py import MPI

from hpcvla.transport.ring import TrajectoryRing
from hpcvla.transport.slots import SLOT_HEADER
from hpcvla.transport.manifest import Manifest
from hpcvla.transport.weights import WeightPlane

N_A, N_FROZEN, N_B = (1 << 28) + 17, 4099, (1 << 29) + 4096
MANIFEST = Manifest((("a", "int32", (N_A,)), ("frozen", "float32", (N_FROZEN,)),
                     ("b", "int16", (N_B,))), frozenset({"frozen"}))


def randomize(tensors: dict, version: int) -> dict:
    """Random bytes in every tensor, a stream per version: each place and version differs."""
    generator = torch.Generator().manual_seed(version)
    for value in tensors.values():
        random_bytes(value.view(torch.uint8).view(-1), generator)
    return tensors


def random_bytes(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`out` (uint8) filled with random bytes: 8 at a time (a byte at a time takes ~5 s per
    GB on a core, 8 at a time ~1), the tail that does not fill 8 one at a time."""
    whole = out.numel() // 8 * 8
    out[:whole].view(torch.int64).random_(-2**63, 2**63 - 1, generator=generator)
    out[whole:].random_(generator=generator)
    return out


def digests(tensors: dict) -> dict[str, int]:
    """crc32 of each tensor's bytes: what the root sent against what the leader holds,
    without a second copy of GBs on either side."""
    return {name: zlib.crc32(value.view(torch.uint8).numpy()) for name, value in tensors.items()}


def wait_sent(plane) -> None:
    while not plane.sent():  # asleep, as a learner computes: the plane's thread sends
        time.sleep(0.01)


def main():
    """Prints, on rank 1, what each side checked: the sizes moved, the tensors of each
    version whose crc32 matched the root's (of MANIFEST's `tensors`), the ring record's bytes
    whose crc32 matched; a mismatch fails the rank instead."""
    world = MPI.COMM_WORLD
    assert world.Get_size() == 2, "run on 2 ranks"
    report = weight_versions(world)
    report.update(ring_record(world))
    merged = {k: v for part in world.gather(report, root=1) or () for k, v in part.items()}
    if world.Get_rank() == 1:
        print(json.dumps({"library": MPI.Get_library_version().split("\n")[0],
                          "tensors": len(MANIFEST.entries), **merged}), flush=True)


def weight_versions(world) -> dict:
    rank = world.Get_rank()
    plane = WeightPlane(world, MPI.COMM_SELF, rank == 1, MANIFEST)
    report: dict = {"whole_bytes": plane.nbytes, "trainable_bytes": plane.bytes_per_version}
    assert min(report.values()) > 1 << 31, report
    if rank == 0:
        tensors = randomize({n: torch.empty(s, dtype=getattr(torch, d))
                             for n, d, s in MANIFEST.entries}, 1)
        for version in (1, 2):
            if version == 2:  # the frozen tensor changes too: it must not cross again
                randomize(tensors, 2)
            sent = digests(tensors)
            t0 = time.monotonic()
            plane.publish(version, tensors)
            wait_sent(plane)
            report[f"version_{version}_s"] = round(time.monotonic() - t0, 2)
            world.bcast(sent, root=0)
            world.Barrier()  # the leader has checked this version
        plane.stop()
    else:
        out, frozen = np.empty(MANIFEST.nbytes, np.uint8), {}
        for version in (1, 2):
            sent = world.bcast(None, root=0)
            first = version == 1
            if first:  # what the frozen tensor must stay
                frozen = {n: sent[n] for n in MANIFEST.frozen}
            plane.wait_for(version, timeout=300)
            assert plane.read_into(out, trainable_only=not first) == version
            held = digests(MANIFEST.views(out))
            assert held == {**sent, **frozen}, (version, held, sent, frozen)
            report[f"version_{version}_tensors_matched"] = sum(
                held[name] == {**sent, **frozen}[name] for name in held)
            world.Barrier()
        del out
    plane.close()
    return report


def ring_record(world) -> dict:
    """One record of 2^31 + 4 KiB from rank 1 into rank 0's ring; what rank 0 checked."""
    n = (1 << 31) + 4096
    ring = TrajectoryRing(world, 1, -(-(n + SLOT_HEADER.itemsize) // 64) * 64)
    if world.Get_rank() == 1:
        record = random_bytes(torch.empty(n, dtype=torch.uint8),
                              torch.Generator().manual_seed(3)).numpy()
        world.bcast(zlib.crc32(record), root=1)
        ring.writer.put(record)
        ring.writer.close()
        del record
    else:
        sent = world.bcast(None, root=1)
        (got,) = ring.reader.get(timeout=300)
        assert got.data.nbytes == n and zlib.crc32(got.data) == sent, "the record differs"
        matched = got.data.nbytes if zlib.crc32(got.data) == sent else 0
        ring.reader.get(timeout=300)  # the producer's close
        ring.reader.release()
    ring.free()
    return {"ring_record_bytes": n, "ring_bytes_matched": matched} if world.Get_rank() == 0 \
        else {}


if __name__ == "__main__":
    main()
