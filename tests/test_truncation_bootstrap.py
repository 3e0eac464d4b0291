"""PPO's bootstrap of the episodes a time limit ends (algorithm.bootstrap_truncated): the envs
give the observation such an episode ended at (StepResult.final_obs), the simulator's slot
carries it, GAE adds gamma times its value to the step's target."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcvla.algorithms.ppo import gae
from hpcvla.envs.base import horizon_cut
from hpcvla.envs.reach import ReachEnv


def test_gae_bootstraps_a_truncated_step_from_its_final_value():
    """Step 1 ends by the horizon with V(final observation) 0.8; step 3 ends by success.
    The truncated step's target is r + gamma * 0.8; nothing crosses either end."""
    rewards = torch.tensor([1.0, 0.5, 0.0, 2.0])
    values = torch.tensor([0.3, 0.4, 0.9, 0.1])
    dones = torch.tensor([False, True, False, True])
    final = torch.tensor([0.0, 0.8, 0.0, 0.0])
    g, lam = 0.9, 0.8
    adv, ret = gae(rewards, values, dones, torch.tensor(0.7), g, lam, None, final)
    d1 = 0.5 + g * 0.8 - 0.4
    d0 = 1.0 + g * 0.4 - 0.3
    d3 = 2.0 - 0.1
    d2 = 0.0 + g * 0.1 - 0.9
    expected = torch.tensor([d0 + g * lam * d1, d1, d2 + g * lam * d3, d3])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values)
    unbootstrapped, _ = gae(rewards, values, dones, torch.tensor(0.7), g, lam)
    assert unbootstrapped[1].item() == pytest.approx(0.5 - 0.4)  # the time limit as a failure


def _random_chunks(env, rng):
    return rng.uniform(-1, 1, (env.num_envs, env.spec.chunk_len, 2)).astype(np.float32)


def test_reach_gives_the_observation_its_horizon_ended_at():
    """The same envs with a horizon of 2 and of 3 chunks, the same actions: where the first
    truncates at chunk 2, its final observation is the second's observation then."""
    short, longer = ReachEnv(16, seed=5, image_size=16, max_episode_chunks=2), \
        ReachEnv(16, seed=5, image_size=16, max_episode_chunks=3)
    short.reset(), longer.reset()
    short.keep_final_obs = True
    rng = np.random.default_rng(0)
    first = _random_chunks(short, rng)
    a, b = short.step(first), longer.step(first)
    assert a.final_obs is None and not a.truncated.any()
    second = _random_chunks(short, rng)
    a, b = short.step(second), longer.step(second)
    cut = horizon_cut(a.truncated, a.env_fault) & ~(b.terminated | b.truncated) & ~a.terminated
    assert cut.sum() >= 8, cut  # most envs do not reach their target in two chunks
    for key in a.obs:
        np.testing.assert_array_equal(a.final_obs[key][cut], b.obs[key][cut])
        assert not np.array_equal(a.obs[key][cut], a.final_obs[key][cut]) or key == "instruction"
    # an env not asked to keep them (every run but PPO's bootstrap) renders nothing more
    b = longer.step(_random_chunks(short, rng))  # its third chunk: its horizon
    assert horizon_cut(b.truncated, b.env_fault).any() and b.final_obs is None


def test_the_slot_carries_the_final_observations_and_refuses_an_env_without_them():
    """A simulator shard's slot with room for final observations (roles/simulator.py) holds
    the horizon-ended episodes' rows as the env gave them; an env that ends episodes at the
    horizon without them stops the rank, naming what is missing."""
    from hpcvla.roles.segments import FINAL
    from hpcvla.roles.simulator import _write, slot_dtypes
    env = ReachEnv(4, seed=3, image_size=16, max_episode_chunks=1)
    env.keep_final_obs = True
    obs_dt, _ = slot_dtypes(env.spec, env.num_envs, final_obs=True)
    assert slot_dtypes(env.spec, env.num_envs)[0].itemsize < obs_dt.itemsize
    slot = np.zeros((), dtype=obs_dt)
    env.reset()
    result = env.step(np.zeros((4, env.spec.chunk_len, 2), np.float32))
    assert horizon_cut(result.truncated, result.env_fault).all()
    _write(slot, result.obs, result, 8)
    for key, value in result.final_obs.items():
        np.testing.assert_array_equal(slot[FINAL + key], value)
    with pytest.raises(RuntimeError, match="final_obs"):
        _write(slot, result.obs, result._replace(final_obs=None), 8)


@pytest.mark.parametrize("family,kwargs", [
    ("default", {}), ("flow", {}), ("flow", {"variant": "pi05"}),
    ("flow", {"logprob_mode": "chain", "denoise_steps": 4}),
    ("flow", {"logprob_mode": "random_step", "denoise_steps": 4}), ("tokens", {})])
def test_a_policys_value_is_the_one_acting_gives(family, kwargs):
    """`Policy.value` (what truncations are valued by) is `act`'s value; flow's skips the
    denoising passes the value head does not read."""
    from hpcvla.policies import Policy, make_policy
    env = ReachEnv(6, seed=1, image_size=32)
    obs = Policy.obs_to_tensors(env.reset(), "cpu")
    torch.manual_seed(0)
    policy = make_policy(family, env.spec.obs, 2, env.spec.chunk_len, len(env.spec.vocab),
                         **kwargs)
    torch.testing.assert_close(policy.value(obs), policy.act(obs, deterministic=True).value)
    torch.testing.assert_close(policy.value(obs), policy.act(obs).value)
