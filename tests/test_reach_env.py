"""The built-in `reach` env: spec conformance, language grounding, determinism, solvability,
episode bookkeeping (auto-reset, truncation), the latency model and argument validation."""

import time

import numpy as np
import pytest

from hpcvla.envs import ReachEnv, StepResult, make_env, oracle_actions
from hpcvla.envs.reach import (COLOUR_NAMES, EFFECTOR_ARM, EFFECTOR_RGB, OBJECT_RADIUS,
                               PALETTE_RGB)


def random_actions(rng, env):
    return rng.uniform(-1, 1, (env.num_envs, env.chunk_len, 2)).astype(np.float32)


def assert_matches_spec(obs, env):
    assert set(obs) == set(env.spec.obs)
    for name, (shape, dtype) in env.spec.obs.items():
        assert obs[name].shape == (env.num_envs, *shape), name
        assert obs[name].dtype == np.dtype(dtype), name


def test_observations_match_spec():
    env = make_env("reach", 5, seed=0, image_size=32, num_objects=4)
    assert env.spec.obs == {"image": ((32, 32, 3), "|u1"), "instruction": ((4,), "<i4"),
                            "state": ((3 * 4 + 4,), "<f4")}
    assert env.spec.action_dim == 2 and env.spec.chunk_len == 4
    assert_matches_spec(env.reset(), env)
    res = env.step(random_actions(np.random.default_rng(0), env))
    assert isinstance(res, StepResult)
    assert_matches_spec(res.obs, env)
    for field, dtype in [("reward", np.float32), ("terminated", bool), ("truncated", bool),
                         ("success", bool), ("episode_return", np.float32),
                         ("episode_length", np.int32)]:
        arr = getattr(res, field)
        assert arr.shape == (5,) and arr.dtype == dtype, field
    no_state = ReachEnv(2, state=False)
    assert set(no_state.spec.obs) == {"image", "instruction"}
    assert_matches_spec(no_state.reset(), no_state)


def test_unknown_env_name_lists_valid_names():
    with pytest.raises(ValueError, match="reach"):
        make_env("nope", 1, seed=0)


def test_instruction_names_target_and_target_pixels_have_its_colour():
    env = ReachEnv(32, seed=3)
    obs = env.reset()
    vocab = env.spec.vocab
    assert vocab[0] == ""
    state = obs["state"]
    for i, (tokens, text) in enumerate(zip(obs["instruction"], env.instructions())):
        words = [vocab[t] for t in tokens]
        assert " ".join(words) == text
        colour = words[2]
        assert colour in COLOUR_NAMES
        # State layout: ee xy, K object xys, target one-hot, target - ee.
        target = int(np.argmax(state[i, 2 + 2 * 3:2 + 3 * 3]))
        assert np.allclose(state[i, -2:], state[i, 2 + 2 * target:4 + 2 * target] - state[i, :2])
        x, y = state[i, 2 + 2 * target: 4 + 2 * target]
        row, col = int(y * 64), int(x * 64)
        assert np.array_equal(obs["image"][i, row, col], PALETTE_RGB[COLOUR_NAMES.index(colour)])
        # The effector is drawn white at its position.
        ex, ey = state[i, :2]
        assert np.array_equal(obs["image"][i, int(ey * 64), int(ex * 64)], [255, 255, 255])


def test_objects_have_distinct_colours():
    env = ReachEnv(16, seed=1, num_objects=6)
    env.reset()
    assert all(len(set(c)) == 6 for c in env._colours)


def rollout(env, seeds, steps=10):
    rng = np.random.default_rng(123)
    out = [env.reset(seeds=seeds)]
    rewards = []
    for _ in range(steps):
        res = env.step(random_actions(rng, env))
        out.append(res.obs)
        rewards.append(res.reward)
    return out, np.stack(rewards)


def test_same_seeds_give_identical_rollouts():
    seeds = np.arange(8) + 100
    obs_a, rew_a = rollout(ReachEnv(8, seed=0, max_episode_chunks=4), seeds)
    obs_b, rew_b = rollout(ReachEnv(8, seed=99, max_episode_chunks=4), seeds)  # spans resets
    np.testing.assert_array_equal(rew_a, rew_b)
    for a, b in zip(obs_a, obs_b):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
    obs_c, _ = rollout(ReachEnv(8, seed=0), seeds + 1)
    assert not np.array_equal(obs_a[0]["image"], obs_c[0]["image"])


def test_constructor_seed_sets_default_rngs():
    a, b = ReachEnv(4, seed=7), ReachEnv(4, seed=7)
    np.testing.assert_array_equal(a.reset()["image"], b.reset()["image"])
    assert not np.array_equal(ReachEnv(4, seed=8).reset()["image"], a.reset()["image"])


def test_init_state_ids_fix_the_initial_state():
    ids = np.array([5, 5, 9, 5])
    a = ReachEnv(4, seed=0).reset(seeds=np.arange(4), init_state_ids=ids)
    b = ReachEnv(4, seed=1).reset(seeds=np.arange(4) + 50, init_state_ids=ids)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
        np.testing.assert_array_equal(a[name][0], a[name][1])  # same id, different env
    assert not np.array_equal(a["image"][0], a["image"][2])


def success_rate(env, policy):
    """Fraction of successes over the first episode of each env."""
    env.reset()
    outcome = np.full(env.num_envs, -1)
    for _ in range(env.spec.max_episode_chunks):
        res = env.step(policy(env))
        done = (res.terminated | res.truncated) & (outcome < 0)
        outcome[done] = res.success[done]
    assert (outcome >= 0).all()  # every env finished one episode within the horizon
    return outcome.mean()


def test_oracle_solves_the_task_and_random_does_not():
    rng = np.random.default_rng(0)
    oracle = success_rate(ReachEnv(64, seed=0), oracle_actions)
    rand = success_rate(ReachEnv(64, seed=0), lambda env: random_actions(rng, env))
    assert oracle >= 0.95
    assert rand <= 0.5 * oracle


def test_oracle_earns_progress_reward_plus_success_bonus():
    env = ReachEnv(16, seed=2)
    env.reset()
    start_dist = env._dist.copy()
    total = np.zeros(16)
    finished = np.zeros(16, bool)
    for _ in range(env.spec.max_episode_chunks):
        res = env.step(oracle_actions(env))
        total += np.where(finished, 0, res.reward)
        np.testing.assert_allclose(res.episode_return[res.terminated & ~finished],
                                   total[res.terminated & ~finished], rtol=1e-5)
        finished |= res.terminated
    assert finished.all()
    # Return = (start distance - final distance) * 10 + 1, with final distance <= radius.
    assert np.all(total >= (start_dist - 0.07) * 10 + 1 - 1e-4)
    assert np.all(total <= start_dist * 10 + 1 + 1e-4)


def test_auto_reset_after_success():
    env = ReachEnv(8, seed=4)
    env.reset()
    for chunk in range(1, env.spec.max_episode_chunks + 1):
        before = env._target_xy().copy()
        res = env.step(oracle_actions(env))
        done = res.terminated
        # Not-done envs report nothing about episodes.
        assert not res.success[~done].any()
        assert (res.episode_return[~done] == 0).all() and (res.episode_length[~done] == 0).all()
        if done.any():
            i = int(np.flatnonzero(done)[0])
            assert res.success[i] and res.episode_length[i] == chunk
            assert res.episode_return[i] > 1.0
            # The returned obs is a fresh episode: effector far from the (new) target.
            ex, ey = res.obs["state"][i, :2]
            target = env._target_xy()[i]
            assert np.hypot(ex - target[0], ey - target[1]) >= 0.25
            assert env._chunks[i] == 0 and not np.array_equal(before[i], target)
            # The next step does not report that episode again.
            res2 = env.step(np.zeros((8, 4, 2), np.float32))
            assert not res2.terminated[i] and res2.episode_length[i] == 0
            return
    pytest.fail("oracle never succeeded")


def test_truncation_at_horizon():
    env = ReachEnv(6, seed=5, max_episode_chunks=3)
    env.reset()
    zeros = np.zeros((6, 4, 2), np.float32)  # standing still never succeeds (clearance 0.25)
    for _ in range(2):
        res = env.step(zeros)
        assert not (res.truncated | res.terminated).any()
        np.testing.assert_array_equal(res.reward, 0)
    first = env._obj.copy()
    res = env.step(zeros)
    assert res.truncated.all() and not res.terminated.any() and not res.success.any()
    np.testing.assert_array_equal(res.episode_length, 3)
    np.testing.assert_array_equal(res.episode_return, 0)
    assert not np.array_equal(env._obj, first)  # auto-reset to new layouts
    assert not env.step(zeros).truncated.any()


def test_actions_are_clipped_and_effector_stays_on_table():
    env = ReachEnv(4, seed=6, max_delta=0.05)
    env.reset()
    ee = env._ee.copy()
    env.step(np.full((4, 4, 2), 100.0, np.float32))
    expected = np.minimum(ee + 4 * 0.05, 1.0)
    moved = ~(env._chunks == 0)  # skip envs that happened to succeed and reset
    np.testing.assert_allclose(env._ee[moved], expected[moved])
    for _ in range(10):
        env.step(np.full((4, 4, 2), -1.0, np.float32))
    assert (env._ee >= 0).all() and (env._ee <= 1).all()


def test_latency_model():
    env = ReachEnv(4, latency_median_ms=5.0, latency_sigma=0.0)
    for _ in range(3):
        t0 = time.perf_counter()
        env.step(np.zeros((4, 4, 2), np.float32))
        assert time.perf_counter() - t0 >= 0.005
        assert env.last_latency_s == pytest.approx(0.005)
    noisy = ReachEnv(64, latency_median_ms=1.0, latency_sigma=0.5)
    noisy.step(np.zeros((64, 4, 2), np.float32))
    assert noisy.last_latency_s > 0.001  # max of 64 lognormal draws exceeds the median
    off = ReachEnv(4)
    off.step(np.zeros((4, 4, 2), np.float32))
    assert off.last_latency_s == 0.0  # nothing drawn, nothing slept


def test_latency_does_not_change_env_randomness():
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(1)
    a = ReachEnv(4, seed=3, max_episode_chunks=2)
    b = ReachEnv(4, seed=3, max_episode_chunks=2, latency_median_ms=0.1)
    for _ in range(5):
        ra, rb = a.step(random_actions(rng_a, a)), b.step(random_actions(rng_b, b))
        np.testing.assert_array_equal(ra.obs["image"], rb.obs["image"])


@pytest.mark.parametrize("kwargs", [
    {"num_envs": 0}, {"image_size": 4}, {"num_objects": 0}, {"num_objects": 7},
    {"chunk_len": 0}, {"max_episode_chunks": 0}, {"max_delta": 0.0},
    {"success_radius": -1.0}, {"progress_scale": float("nan")}, {"latency_median_ms": -1.0},
    {"latency_sigma": -0.1},
])
def test_bad_arguments_name_the_argument(kwargs):
    args = {"num_envs": 2, **kwargs}
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ReachEnv(**args)


def test_bad_step_and_reset_shapes():
    env = ReachEnv(3)
    with pytest.raises(ValueError, match="actions"):
        env.step(np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="seeds"):
        env.reset(seeds=np.arange(2))
    with pytest.raises(ValueError, match="init_state_ids"):
        env.reset(init_state_ids=np.arange(4))


def test_a_shards_observations_round_trip_through_its_exchange_slot():
    """The slot layout a simulator shard and its inference rank share (roles/simulator.py)
    holds a batch of the env's observations, byte for byte as through shared memory."""
    from hpcvla.roles.simulator import slot_dtypes
    env = ReachEnv(5, image_size=16)
    obs_dt, action_dt = slot_dtypes(env.spec, env.num_envs)
    buf = np.zeros((), dtype=obs_dt)
    obs = env.reset()
    for name, arr in obs.items():
        buf[name] = arr
    again = np.frombuffer(buf.tobytes(), dtype=obs_dt)[0]
    for name, arr in obs.items():
        np.testing.assert_array_equal(again[name], arr)
    assert action_dt["actions"].shape == (5, env.spec.chunk_len, env.spec.action_dim)


def test_latency_can_be_reported_instead_of_slept():
    import time as _time

    from hpcvla.envs.reach import ReachEnv
    env = ReachEnv(4, seed=1, latency_median_ms=200.0, latency_sigma=0.0, latency_sleep=False)
    env.reset()
    start = _time.monotonic()
    env.step(np.zeros((4, env.spec.chunk_len, 2), np.float32))
    assert _time.monotonic() - start < 0.1  # not slept...
    assert env.last_latency_s == pytest.approx(0.2)  # ...but reported for the caller to hold


def test_a_reward_choice_reach_would_not_make_is_refused(tmp_path):
    """env.reward picks ManiSkill's reward; reach has one of its own, so `dense` there would do
    nothing: refused before any rank starts, naming the field; so is every real simulator's
    setting without env.name (forgotten), typed or from a config file: not a reach run."""
    from hpcvla.config import ConfigError, load_config
    from hpcvla.envs import check_env
    from helpers import ROOT
    check_env(load_config(ROOT / "configs/default.yaml"))  # the default: accepted
    with pytest.raises(ConfigError, match=r"env.reward = 'dense': expected none: env.name=reach "
                                          r"does not read it \(maniskill, libero do\)"):
        load_config(ROOT / "configs/default.yaml", ["env.reward=dense"])
    for setting, value in (("suite", "libero_10"), ("task", "PushCube-v1"),
                           ("wrist_image", "true"), ("reward", "dense")):
        config = tmp_path / f"{setting}.yaml"
        config.write_text(f"env: {{{setting}: {value}}}\n")
        with pytest.raises(ConfigError, match=rf"env.{setting} = .*: expected none: env.name="
                                              r"reach does not read it \((maniskill|libero).*"
                                              r"drop it, or set env.name"):
            load_config(config)


def _drawn_anew(env: ReachEnv) -> np.ndarray:
    """Every env's image painted from nothing: the table, the objects in index order, the
    effector (what the env's cached scene must equal)."""
    n, ht = env.num_envs, env._half_thick
    img = np.broadcast_to(env._background, (n, env.image_size, env.image_size, 3)).copy()

    def disc(dx, dy):
        return dx * dx + dy * dy <= OBJECT_RADIUS ** 2

    def cross(dx, dy):
        dx, dy = np.abs(dx), np.abs(dy)
        return ((dy <= ht) & (dx <= EFFECTOR_ARM)) | ((dx <= ht) & (dy <= EFFECTOR_ARM))

    for k in range(env.num_objects):
        env._paint(img, env._obj[:, k], OBJECT_RADIUS, disc, PALETTE_RGB[env._colours[:, k]])
    env._paint(img, env._ee, EFFECTOR_ARM, cross, np.broadcast_to(EFFECTOR_RGB, (n, 3)))
    return img


@pytest.mark.parametrize("num_envs,image_size,num_objects", [(8, 32, 3), (5, 64, 4)])
def test_the_cached_scene_is_the_scene_drawn_anew(num_envs, image_size, num_objects):
    """The table and objects are drawn once per layout and only the effector each step: the
    images equal ones painted from nothing, through auto-resets (some envs at a time), held
    resets and explicit ones from fixed initial states."""
    env = ReachEnv(num_envs=num_envs, seed=3, image_size=image_size, num_objects=num_objects,
                   max_episode_chunks=6)
    rng = np.random.default_rng(0)
    assert np.array_equal(env.reset()["image"], _drawn_anew(env))
    for t in range(120):
        env.hold_resets(40 <= t < 60)
        result = env.step(rng.uniform(-1, 1, (num_envs, env.spec.chunk_len, 2)))
        assert np.array_equal(result.obs["image"], _drawn_anew(env)), t
        if t % 37 == 0:
            obs = env.reset(init_state_ids=rng.integers(0, 1000, num_envs))
            assert np.array_equal(obs["image"], _drawn_anew(env)), t


def test_without_its_progress_reward_reach_pays_the_success_alone():
    """env.progress_reward=false: a sparse reward (1 on success, 0 otherwise), as LIBERO's,
    where reach's own pays the distance gained each step beside it."""
    from hpcvla.config import ConfigError, load_config
    from hpcvla.envs.reach import ReachEnv
    sparse = load_config(None, ["env.progress_reward=false"]).env
    env = ReachEnv(16, seed=0, **ReachEnv.config_kwargs(sparse))
    dense = ReachEnv(16, seed=0, **ReachEnv.config_kwargs(load_config(None).env))
    env.reset(), dense.reset()
    rng = np.random.default_rng(0)
    successes = 0
    for _ in range(60):
        actions = rng.uniform(-1, 1, (16, env.spec.chunk_len, 2)).astype(np.float32)
        result, shaped = env.step(actions), dense.step(actions)
        np.testing.assert_array_equal(result.reward, result.success.astype(np.float32))
        np.testing.assert_array_equal(result.success, shaped.success)  # the same episodes
        successes += int(result.success.sum())
    assert successes > 0 and (shaped.reward != shaped.success).any()
    with pytest.raises(ConfigError, match="env.progress_reward"):
        load_config(None, ["env.name=maniskill", "env.progress_reward=false"])


def test_a_step_without_an_outcome_field_is_named():
    """An env (a researcher's new simulator) whose StepResult leaves an outcome field None,
    as `chunk_steps`' default allows: the simulator rank names the field, not numpy."""
    from hpcvla.roles.segments import outcome_of
    env = ReachEnv(2, seed=0)
    env.reset()
    result = env.step(np.zeros((2, env.spec.chunk_len, env.spec.action_dim), np.float32))
    assert set(outcome_of(result)) >= {"chunk_steps", "reward"}
    with pytest.raises(ValueError, match="StepResult lacks chunk_steps: every env gives"):
        outcome_of(result._replace(chunk_steps=None))


def test_an_observation_unlike_the_spec_is_named_before_the_first_step():
    """A new simulator's observation of another dtype than its spec declares (a float image in
    [0, 1] where the slot is uint8) would be cast into the shared slot silently: the simulator
    rank stops on its first one, naming the env, the field and both layouts."""
    from hpcvla.envs.base import check_observation
    env = ReachEnv(2, seed=0)
    obs = env.reset()
    check_observation(env, obs)  # as declared: nothing to say
    floats = dict(obs, image=obs["image"].astype(np.float32) / 255)
    with pytest.raises(ValueError, match=r"ReachEnv's observation is not what its spec "
                                         r"declares \(image float32 .*, declared uint8"):
        check_observation(env, floats)
    with pytest.raises(ValueError, match="instruction missing"):
        check_observation(env, {k: v for k, v in obs.items() if k != "instruction"})


def test_an_observation_field_no_policy_reads_is_refused():
    """A new simulator's third camera or differently named state would be carried through the
    ring and read by no policy: its spec is refused naming the fields the policies read; the
    small network's encoders refuse the wrist camera they do not read."""
    from hpcvla.envs.base import EnvSpec
    from hpcvla.policies.default import DefaultPolicy
    spec = ReachEnv(2, seed=0).spec
    with pytest.raises(ValueError, match=r"EnvSpec.obs: head_camera is no observation field "
                                         r"the policies read \(image, wrist_image, "
                                         r"instruction, state\)"):
        EnvSpec(**{**spec.__dict__, "obs": {**spec.obs, "head_camera": spec.obs["image"]}})
    wrist = {**spec.obs, "wrist_image": spec.obs["image"]}
    with pytest.raises(ValueError, match="read image, instruction, state, not wrist_image"):
        DefaultPolicy(wrist, spec.action_dim, spec.chunk_len, len(spec.vocab))


def test_a_simulators_benchmark_protocol_is_its_class_methods(monkeypatch):
    """A benchmark's evaluation protocol (its fixed states, step limit, what the report says)
    is the simulator class's answer (VectorEnv.protocol_episodes, benchmark_protocol): the
    evaluation asks the class, whatever the simulator; nothing in roles/ names one."""
    import copy

    from hpcvla.config import load_config
    from hpcvla.envs import registry
    from hpcvla.evaluate import describe, evaluate
    from hpcvla.roles.heldout import envs_at_once

    class Benchmarked(ReachEnv):
        @classmethod
        def protocol_episodes(cls, env_cfg, eval_cfg):
            return 3

        @classmethod
        def benchmark_protocol(cls, cfg):
            cfg = copy.deepcopy(cfg)
            cfg.env.max_episode_chunks = 2  # its step limit, as the horizon
            return cfg, {"name": "dummy", "steps": 7, "step_limit": 7,
                         "describe": "dummy protocol: 3 fixed states, 7 steps"}, (
                np.array([5, 9, 2]), ["task a", "task a", "task b"])
    monkeypatch.setitem(registry.ENVS, "reach", Benchmarked)
    cfg = load_config(None, ["env.chunk_len=4"])
    cfg.eval.protocol = "dummy"
    assert envs_at_once(cfg, 32, 128) == 3
    result = evaluate(cfg, None, episodes=128, envs=2)
    assert [e["init_state_id"] for e in result["per_episode"]] == [5, 9, 2]
    assert all(e["steps"] <= 7 for e in result["per_episode"])  # cut inside the 2nd chunk
    assert sorted(result["per_task"]) == ["task a", "task b"]
    said = describe({**result, "version": 0, "split": "evaluation", "init_state_ids": [2, 9],
                     "states": "3 states", "ranks": 1, "hosts": ["h"], "device": "cpu"})
    assert "  dummy protocol: 3 fixed states, 7 steps, " in said, said
