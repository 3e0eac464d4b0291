"""Run under MPI: the learner root publishes versions 1..N (content a function of the version,
random pauses, bursts that coalesce), then stops; every inference rank reads until its node
says finished. Each read must be bit-exact for the version it reports, versions must never go
backwards, and the last version must be there once finished.

With --frozen, two tensors are frozen: the root still changes them in every version, and
every read must show them as in version 1 (the only one that carries them), the others as in
the version read; readers read whole once, then only the trainable places.

With --max-message=B every broadcast goes in pieces of at most B bytes (transport/pieces.py;
the real limit, 1 GiB, needs versions of GBs: large_transfers.py).

With --mismatch the node leaders hold a manifest that names one tensor differently: a
leader's thread fails at the first version and must take the world down, naming itself.

    mpiexec -n 8 python -m mpi4py tests/mpi/weights_exact.py CONFIG N [--frozen]
        [--max-message=B] [--mismatch] [key=value ...]
"""

import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from hpcvla.config import load_config
from hpcvla.job.runtime import run_ranks
from hpcvla.transport.pieces import MAX_MESSAGE
from hpcvla.transport.manifest import Manifest
from hpcvla.transport.weights import WeightPlane

MANIFEST = Manifest((("encoder.w", "float32", (300, 257)), ("head.b", "float64", (33,)),
                     ("steps", "int64", ()), ("mask", "bool", (5, 7)),
                     ("expert.w", "bfloat16", (17, 9))))  # numpy has no bf16: bits kept
FROZEN = Manifest(MANIFEST.entries, frozenset({"encoder.w", "mask"}))


def weights_of(version):
    rng = np.random.default_rng(version)
    return {"encoder.w": torch.from_numpy(rng.standard_normal((300, 257), dtype=np.float32)),
            "head.b": torch.from_numpy(rng.standard_normal(33)), "steps": torch.tensor(version),
            "mask": torch.from_numpy(rng.random((5, 7)) > 0.5),
            "expert.w": torch.from_numpy(rng.standard_normal((17, 9))).to(torch.bfloat16)}


def expected(manifest, version, name):
    return weights_of(1 if name in manifest.frozen else version)[name]


def main(cfg, plan, comms):
    rank, n_versions = comms.world.Get_rank(), int(sys.argv[2])
    manifest = FROZEN if "--frozen" in sys.argv else MANIFEST
    limit = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--max-message=")),
                 MAX_MESSAGE)
    if "--mismatch" in sys.argv and rank in plan.node_leaders:
        manifest = Manifest((("encoder.v", *MANIFEST.entries[0][1:]), *MANIFEST.entries[1:]))
    plane = WeightPlane(comms.control, comms.node, rank in plan.node_leaders, manifest, limit,
                        who=plan.who(rank, MPI.Get_processor_name()))
    rng = np.random.default_rng(rank)
    if rank == plan.weight_root:
        for version in range(1, n_versions + 1):
            plane.publish(version, weights_of(version))
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.02)
        plane.stop()  # everything published reaches the nodes before they see "finished"
    seen = []
    if "inference" in plan.ranks[rank].roles:
        out = np.empty(MANIFEST.nbytes, np.uint8)
        finished = False
        while not finished:
            finished = plane.finished()  # checked before the read: that read is the last
            version = plane.read_into(out, trainable_only=bool(seen))
            if version >= 0:
                assert not seen or version >= seen[-1], f"version went back: {seen[-1]}->{version}"
                for name, value in manifest.views(out).items():
                    assert torch.equal(value, expected(manifest, version, name)), (version, name)
                seen.append(version)
                assert plane.latest_version() >= version
            time.sleep(rng.random() * 0.005)
        assert seen[-1] == n_versions, f"finished before the last version: {seen[-1]}"
    plane.close()
    assert plane.win == MPI.WIN_NULL
    counts = comms.world.gather(len(set(seen)), root=0)
    if rank == 0:
        print(f"weights exact on every read; distinct versions read per rank: {counts}",
              flush=True)


if __name__ == "__main__":
    sys.exit(run_ranks(load_config(sys.argv[1], [a for a in sys.argv[3:]
                                                 if not a.startswith("--")]), main))
