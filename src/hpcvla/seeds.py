"""Seeds: every rank's RNG streams and its env shards', a pure function of run.seed and the
rank, so that ranks explore independently and a run can be replayed.

The policy's initial weights come from run.seed alone (factory.build_policy, on a
forked RNG: identical on every rank); each rank's global torch and numpy streams (action
sampling) come from numpy's SeedSequence of (run.seed, rank); each env shard has its own
seed (its envs derive theirs from it). `rng_seeds.json` in the run directory lists them all.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from hpcvla.schedule import shards_of
from hpcvla.topology.plan import SIM


def rank_seeds(cfg, rank: int) -> dict[str, int]:
    """The seeds of `rank`'s torch and numpy global streams: independent across ranks and
    runs (numpy's SeedSequence of (run.seed, rank)), a pure function of both."""
    torch_seed, numpy_seed = np.random.SeedSequence([cfg.run.seed, rank]).generate_state(2)
    return {"torch": int(torch_seed), "numpy": int(numpy_seed)}


def seed_rank(cfg, rank: int) -> None:
    seeds = rank_seeds(cfg, rank)
    torch.manual_seed(seeds["torch"])  # the policy's action sampling
    np.random.seed(seeds["numpy"])


def write_rng_seeds(cfg, plan, run_dir) -> None:
    """rng_seeds.json in the run directory: every rank's RNG seeds and its env shards'."""
    shards = shards_of(cfg)  # per simulator rank, in this mode
    ranks = {}
    for r, placed in enumerate(plan.ranks):
        entry = rank_seeds(cfg, r)
        if plan.mode == "colocated":
            entry["env_shards"] = [colocated_seed(cfg, r)]
        elif SIM in placed.roles:
            entry["env_shards"] = [shard_seed(cfg, r, s) for s in range(shards)]
        ranks[str(r)] = entry
    (run_dir / "rng_seeds.json").write_text(json.dumps(
        {"run.seed": cfg.run.seed, "ranks": ranks}, indent=1))


def shard_seed(cfg, rank: int, shard: int) -> int:
    """Seed of env shard `shard` of simulator rank `rank` (its envs derive theirs from it)."""
    return cfg.run.seed * 10007 + rank * 101 + shard


def colocated_seed(cfg, rank: int) -> int:
    return cfg.run.seed * 10007 + rank
