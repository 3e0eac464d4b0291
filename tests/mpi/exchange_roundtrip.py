"""Run under MPI: in every cell, simulators submit observations from several shards; the
inference rank answers each request with actions computed from the observation it read in
place. Every answer must match its request, every request answered exactly once.

    mpiexec -n 8 python -m mpi4py tests/mpi/exchange_roundtrip.py CONFIG ROUNDS [key=value ...]
"""

import sys

import numpy as np
from mpi4py import MPI

from hpcvla.config import load_config
from hpcvla.job.runtime import run_ranks
from hpcvla.transport.exchange import ObsActionExchange

ENVS, SHARDS = 4, 3
OBS = np.dtype([("image", "u1", (ENVS, 16, 16, 3)), ("state", "<f4", (ENVS, 5)),
                ("step", "<i8")])
ACT = np.dtype([("chunk", "<f4", (ENVS, 4, 7)), ("step", "<i8")])


def main(cfg, plan, comms):
    rank, rounds = comms.world.Get_rank(), int(sys.argv[2])
    if comms.cell == MPI.COMM_NULL or plan.mode == "colocated":
        return  # learners have no cell; a colocated rank serves itself in-process
    ex = ObsActionExchange(comms.cell, SHARDS, OBS, ACT)
    clients = comms.cell.Get_size() - 1
    if "inference" in plan.ranks[rank].roles:
        answered = 0
        while answered < rounds * SHARDS * clients:
            for slot in ex.wait_pending(timeout=60):
                obs, act = ex.request_obs(slot), ex.request_actions(slot)
                act["chunk"][...] = obs["state"].sum() + obs["image"].mean()
                act["step"] = obs["step"]
                ex.respond(slot)
                answered += 1
        print(f"cell of rank {rank}: answered {answered} requests", flush=True)
    else:
        rng = np.random.default_rng(rank)
        for step in range(rounds):
            for shard in range(SHARDS):  # shards submit, then collect: they overlap
                obs = ex.obs(shard)
                obs["image"][...] = rng.integers(0, 255, obs["image"].shape)
                obs["state"][...] = rng.standard_normal(obs["state"].shape)
                obs["step"] = step * SHARDS + shard
                ex.submit(shard)
            for shard in range(SHARDS):
                act, obs = ex.actions(shard, timeout=60), ex.obs(shard)
                assert act["step"] == step * SHARDS + shard
                expected = np.float32(obs["state"].sum() + obs["image"].mean())
                assert np.all(act["chunk"] == expected), (act["chunk"].ravel()[:3], expected)
    ex.free()
    assert ex.win == MPI.WIN_NULL


if __name__ == "__main__":
    sys.exit(run_ranks(load_config(sys.argv[1], sys.argv[3:]), main))
