"""Seeds: every rank's RNG streams and every env's, a pure function of run.seed and where the
stream is used, so that ranks and envs explore independently and a run can be replayed.

The policy's initial weights come from run.seed alone (factory.build_policy, on a
forked RNG: identical on every rank); each rank's global torch and numpy streams (action
sampling) come from numpy's SeedSequence of (run.seed, rank). Envs:

* an env shard's seed is the SeedSequence of (run.seed, rank, shard); a colocated rank's
  envs are shard 0 of that rank (`colocated_seed`);
* each env of a shard has its own seed, the SeedSequence of (shard seed, env index)
  (`env_seeds`), and draws its random episode starts from `env_rng(env seed)`.

The parts are hashed together, never added: with sums (seed + rank + shard + env) the
envs of neighbouring shards and ranks would land on the same numbers and replay the same
episodes. Seeds are 63-bit (they fit an int64: HDF5 attributes, numpy arrays). Two
distinct tuples give distinct SeedSequence entropy, so distinct streams; the seeds
themselves are then distinct but for a 63-bit hash collision (tests/test_seeds.py checks
every layout's). `rng_seeds.json` in the run directory lists every rank's and env's seed.
A world resumed at policy version V adds V to every part list above (`_resumed`): its streams
are new ones, not the first world's again.

Stream tags keep streams of different uses apart even where their numbers meet: the
entropy of `env_rng` (env seed, _ENV_RNG) never equals that of `state_rng` (id,
_STATE_RNG), the initial state an init_state_id names, so a training env's random starts
are never an evaluation state's stream (envs/base.py: the evaluation split); a held-out
batch's sampling (`held_out_seed`) and a learner's replay draws (`replay_rng`) are never a
rank's global streams.
"""

from __future__ import annotations

import json

import numpy as np

from hpcvla.schedule import shards_of
from hpcvla.topology.plan import SIM

_SHARD, _ENV, _RESTART, _RESUMED = 0x5A4D, 0xE4F, 0x4E57, 0x2E5  # what a seed is for
_ENV_RNG, _STATE_RNG = 0x51_0E, 0x5EAC4  # entropy tags of the env streams (module docstring)
_HELD_OUT, _REPLAY = 0x4E1D, 0x4E9A  # a held-out batch's sampling, a learner's replay draws


def _seed(*parts: int) -> int:
    """A 63-bit seed from numpy's SeedSequence of `parts`."""
    word = np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0]
    return int(word >> np.uint64(1))


def rank_seeds(cfg, rank: int, start: int = 0) -> dict[str, int]:
    """The seeds of `rank`'s torch and numpy global streams: independent across ranks and
    runs (numpy's SeedSequence of (run.seed, rank[, start])), a pure function of them.
    `start`: the policy version a resumed world starts from, so that it draws afresh."""
    torch_seed, numpy_seed = np.random.SeedSequence(
        [cfg.run.seed, rank, *_resumed(start)]).generate_state(2)
    return {"torch": int(torch_seed), "numpy": int(numpy_seed)}


def _resumed(start: int) -> list[int]:
    """The seed parts a world resumed at policy version `start` adds (none for a new run):
    its streams are new ones, not the first world's again (each env's first initial states,
    the ranks' sampling noise)."""
    return [start, _RESUMED] if start else []


def seed_rank(cfg, rank: int, with_torch: bool = True, start: int = 0) -> None:
    """Seed this rank's numpy and (`with_torch`: a rank that runs the policy) torch streams."""
    seeds = rank_seeds(cfg, rank, start)
    if with_torch:
        import torch  # here: the envs import this module, and env workers import no torch
        torch.manual_seed(seeds["torch"])  # the policy's action sampling
    np.random.seed(seeds["numpy"])


def shard_seed(cfg, rank: int, shard: int, start: int = 0) -> int:
    """Seed of env shard `shard` of simulator rank `rank` (its envs derive theirs from it),
    in a world started at policy version `start` (rank_seeds)."""
    return _seed(cfg.run.seed, rank, shard, *_resumed(start), _SHARD)


def colocated_seed(cfg, rank: int, start: int = 0) -> int:
    """Seed of a colocated rank's envs: it simulates one shard, shard 0 of its rank."""
    return shard_seed(cfg, rank, 0, start)


def env_seeds(shard_seed: int, num_envs: int) -> list[int]:
    """The seed of each env of a shard: SeedSequence of (shard seed, env index)."""
    return [_seed(shard_seed, i, _ENV) for i in range(num_envs)]


def env_rng(env_seed: int) -> np.random.Generator:
    """An env's own stream: its random episode starts (every env implementation's)."""
    return np.random.default_rng([int(env_seed), _ENV_RNG])


def state_rng(init_state_id: int) -> np.random.Generator:
    """The stream an init_state_id names (same id, same initial state, whatever the env)."""
    return np.random.default_rng([int(init_state_id), _STATE_RNG])


def held_out_seed(seed: int, first: int) -> int:
    """The torch seed of a held-out evaluation batch whose first state is number `first` (of
    run.seed `seed`): tagged, so never a training rank's stream (rank_seeds of rank `first`
    would otherwise be the same number)."""
    return _seed(seed, first, _HELD_OUT)


def replay_rng(cfg, rank: int, resumed_transitions: int) -> np.random.Generator:
    """An off-policy learner's replay draws: its own stream per rank, new after a resume
    (the transitions it continues from), tagged apart from the rank's global streams."""
    return np.random.default_rng([cfg.run.seed, rank, resumed_transitions, _REPLAY])


def restart_seed(shard_seed: int, restarts: int) -> int:
    """Seed of a shard's worker after its `restarts`-th restart (envs/isolated.py): a fresh
    one, so the new worker does not replay the shard's first episodes."""
    return _seed(shard_seed, restarts, _RESTART)


def write_rng_seeds(cfg, plan, run_dir, start: int = 0) -> None:
    """rng_seeds.json in the run directory: every rank's RNG seeds, its env shards' seeds
    and each of their envs' seeds (of the world started at policy version `start`)."""
    ranks = {}
    for r, placed in enumerate(plan.ranks):
        entry = rank_seeds(cfg, r, start)
        if plan.mode == "colocated":
            shards = [colocated_seed(cfg, r, start)]
        elif SIM in placed.roles:
            shards = [shard_seed(cfg, r, s, start) for s in range(shards_of(cfg))]
        else:
            shards = []
        if shards:
            per_shard = cfg.env.envs_per_simulator // len(shards)
            entry["env_shards"] = [{"seed": s, "envs": env_seeds(s, per_shard)}
                                   for s in shards]
        ranks[str(r)] = entry
    (run_dir / "rng_seeds.json").write_text(json.dumps(
        {"run.seed": cfg.run.seed, "from_version": start, "ranks": ranks}, indent=1))
