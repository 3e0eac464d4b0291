"""Every env of a run has its own random stream (seeds.py), in every placement and mode, and
training never starts from an evaluation state (envs/base.py's split)."""

import json

import numpy as np
import pytest

from hpcvla.config import load_config
from hpcvla.envs.base import EVAL_STATE_IDS, STATE_IDS, is_evaluation_state, training_state_ids
from hpcvla.envs.groups import GroupedRestarts
from hpcvla.envs.reach import ReachEnv
from hpcvla.seeds import env_rng, env_seeds, shard_seed, state_rng, write_rng_seeds
from hpcvla.topology.plan import plan_from_config
from helpers import ROOT

LAYOUTS = [  # (config, overrides, world): every placement and pipeline mode
    *[("default.yaml", [f"pipeline.mode={mode}"], 4)
      for mode in ("streamer", "rollout-async", "train-async", "sync-disaggregated")],
    ("default.yaml", ["env.shards=16"], 4),  # one env per shard
    ("colocated.yaml", [], 4),
    ("hybrid.yaml", ["placement.ranks_per_node=4"], 8),
    ("learner_nodes.yaml", ["placement.ranks_per_node=8"], 24),
]


@pytest.mark.parametrize("config,overrides,world", LAYOUTS)
def test_every_env_of_a_run_has_its_own_seed(tmp_path, config, overrides, world):
    cfg = load_config(ROOT / "configs" / config, overrides)
    plan = plan_from_config(cfg.placement, world)
    write_rng_seeds(cfg, plan, tmp_path)
    ranks = json.loads((tmp_path / "rng_seeds.json").read_text())["ranks"]
    shards = [s for r in ranks.values() for s in r.get("env_shards", [])]
    seeds = [e for s in shards for e in s["envs"]]
    sims = sum(1 for r in ranks.values() if "env_shards" in r)
    assert sims > 1 and len(seeds) == sims * cfg.env.envs_per_simulator
    assert len(set(seeds)) == len(seeds)
    assert len({s["seed"] for s in shards}) == len(shards)
    assert all(0 <= s < 2 ** 63 for s in seeds)  # fits an int64 (HDF5 attributes, numpy)


@pytest.mark.mpi
def test_a_resumed_world_draws_new_streams(tmp_path):
    """A world resumed at version V seeds its ranks and envs with V too: before, each env
    replayed its first initial states (and each rank its sampling noise) at every resume.
    Between two worlds of one run every env seed differs; a new run's stay as they were."""
    from helpers import hpcvla, run_train
    _, _, run_dir = run_train(tmp_path, "pipeline.total_updates=2",
                              config="configs/colocated.yaml", ranks=2)
    first = json.loads((run_dir / "rng_seeds.json").read_text())
    out = hpcvla("train", f"run.resume={run_dir}", "--ranks", 2, "pipeline.total_updates=3")
    assert out.returncode == 0, out.stderr[-3000:]
    second = json.loads((run_dir / "rng_seeds.json").read_text())
    assert (first["from_version"], second["from_version"]) == (0, 2)

    def env_seeds_of(seeds):
        return {e for r in seeds["ranks"].values() for s in r["env_shards"] for e in s["envs"]}
    assert not env_seeds_of(first) & env_seeds_of(second)
    assert first["ranks"]["0"]["torch"] != second["ranks"]["0"]["torch"]
    cfg = load_config(run_dir / "config.yaml")
    assert first["ranks"]["1"]["env_shards"][0]["seed"] == shard_seed(cfg, 1, 0)  # a new run's


def test_envs_of_neighbouring_shards_start_apart():
    cfg = load_config(ROOT / "configs/default.yaml", [])
    first = [ReachEnv(2, seed=shard_seed(cfg, rank, shard)).reset()
             for rank, shard in ((1, 0), (1, 1), (2, 0))]
    images = [img.tobytes() for obs in first for img in obs["image"]]
    assert len(set(images)) == len(images) == 6


def test_training_layouts_are_not_evaluation_layouts():
    # reach: an env's own stream is never the stream of an init_state_id; seeding an env with
    # an evaluation id's number still gives other layouts than that id
    evaluation = ReachEnv(8).reset(init_state_ids=np.arange(8))["image"]
    training = ReachEnv(8).reset(seeds=np.arange(8))["image"]
    assert not any(np.array_equal(t, e) for t in training for e in evaluation)
    assert env_rng(3).integers(2 ** 62) != state_rng(3).integers(2 ** 62)


def test_grouped_restarts_draw_training_ids_only():
    env = GroupedRestarts(ReachEnv(8), every=2, group_size=4, seed=shard_seed(
        load_config(ROOT / "configs/reach_grpo.yaml", []), 1, 0))
    ids = np.concatenate([env.grouped_ids() for _ in range(500)])
    assert not any(is_evaluation_state(int(i)) for i in ids)
    assert ids.min() >= EVAL_STATE_IDS and ids.max() < STATE_IDS
    assert (ids.reshape(-1, 4) == ids[::4, None]).all()  # one id per group
    assert env.evaluation_states(128)[0].max() < EVAL_STATE_IDS


def test_random_start_ids_are_training_ids():
    # the id a ManiSkill (CPU and GPU: its reset seed) or LIBERO env (its placement's seed)
    # draws for a random start; tests/test_sims.py checks the real simulators
    rngs = [env_rng(s) for s in env_seeds(shard_seed(load_config(None, []), 1, 0), 16)]
    draws = [training_state_ids(rng) for rng in rngs for _ in range(200)]
    assert min(draws) >= EVAL_STATE_IDS and max(draws) < STATE_IDS


def test_eval_says_which_split_it_measured():
    from hpcvla.evaluate import evaluate
    result = evaluate(load_config(None, []), None, episodes=6, envs=3)
    assert result["split"] == "evaluation" and result["init_state_ids"] == [0, 5]
    assert result["episodes"] == 6 and "initial state" in result["states"]


def test_building_the_policy_leaves_the_ranks_streams_as_they_were(monkeypatch):
    """Every rank builds the same initial weights from run.seed after seeding its own streams
    (seeds.seed_rank): the build must not reseed the CUDA generators, or every GPU rank would
    sample the same noise (tests/gpu checks the draws themselves)."""
    import torch

    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    from hpcvla.seeds import seed_rank
    cuda_reseeds = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", cuda_reseeds.append)
    cfg = load_config(None, [])
    seed_rank(cfg, 3)
    assert len(cuda_reseeds) == 1  # the rank's own seed reaches CUDA
    cpu = torch.random.get_rng_state()
    build_policy(cfg, env_spec(cfg.env))
    assert cuda_reseeds[1:] == [] and torch.equal(torch.random.get_rng_state(), cpu)


def test_held_out_and_replay_streams_are_never_a_ranks_global_streams():
    """A held-out batch from state `first` sampled with training rank `first`'s torch seed
    (SeedSequence of (run.seed, first), the same first word); the replay draws' entropy was a
    fresh rank's (numpy ignores trailing zeros): both tagged apart now."""
    from hpcvla.config import load_config
    from hpcvla.seeds import held_out_seed, rank_seeds, replay_rng
    cfg = load_config(None, ["run.seed=5"])
    ranks = {rank_seeds(cfg, r)["torch"] for r in range(64)} | \
        {rank_seeds(cfg, r)["numpy"] for r in range(64)}
    assert not ranks & {held_out_seed(5, first) for first in range(0, 64 * 8, 8)}
    for rank in range(4):
        replay = replay_rng(cfg, rank, 0).bit_generator.seed_seq.generate_state(4)
        own = np.random.SeedSequence([5, rank]).generate_state(4)  # rank_seeds' entropy
        assert not np.array_equal(replay, own)
        assert replay_rng(cfg, rank, 0).integers(2**62) != \
            replay_rng(cfg, rank, 10).integers(2**62)  # a resumed learner draws afresh


def test_a_simulators_shards_run_the_seeds_rng_seeds_json_records():
    """roles/simulator.build_shards, where the envs are made: each shard of each simulator
    rank runs with the seed rng_seeds.json records for it (seeds.shard_seed), and their
    first layouts all differ (one seed for every shard would replay a rank's episodes)."""
    from hpcvla.roles.simulator import build_shards
    cfg = load_config(ROOT / "configs/default.yaml", ["env.image_size=16"])
    images = []
    for rank in (0, 1):
        for shard, env in enumerate(build_shards(cfg, 2, rank)):
            assert env.seed == shard_seed(cfg, rank, shard, 0), (rank, shard)
            images += [image.tobytes() for image in env.reset()["image"]]
    assert len(set(images)) == len(images) == 2 * cfg.env.envs_per_simulator
