"""GRPO (group-relative advantages, degenerate-group filtering, episodes in (T, N) steps, the
masked decoupled loss), the granularity helpers and the value-clip option."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcvla.algorithms import (decoupled_ppo_loss, episodes_of, expand_like,
                               first_episode_advantages, group_advantages, grpo_loss,
                               per_episode, reduce_units, sum_to, value_loss)
from hpcvla.config import ConfigError, load_config
from hpcvla.envs import make_env
from hpcvla.envs.groups import GroupedRestarts
from hpcvla.preflight import check_pipeline
from hpcvla.topology.plan import plan_from_config
from helpers import ROOT, policy_batch

# ----------------------------------------------------------------------------- GRPO


def test_group_advantages_hand_computed_and_degenerate_groups_filtered():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 2.0, 0.0, 1.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 3, 5, 5, 9, 9, 9])
    out = group_advantages(scores, groups)
    # group 7: mean .5, std .5 -> +-1; groups 3 (all success) and 5 (all fail): filtered;
    # group 9: mean 1, std sqrt(2/3)
    s9 = math.sqrt(2 / 3)
    expected = [1, -1, 1, -1, 0, 0, 0, 0, 0, 1 / s9, -1 / s9, 0]
    torch.testing.assert_close(out.advantages, torch.tensor(expected, dtype=torch.float32))
    assert out.keep.tolist() == [True] * 4 + [False] * 5 + [True] * 3
    assert out.groups == 4 and out.degenerate_groups == 2

    centred = group_advantages(scores, groups, normalize_std=False)
    torch.testing.assert_close(centred.advantages[:4], torch.tensor([0.5, -0.5, 0.5, -0.5]))
    torch.testing.assert_close(centred.advantages[9:], torch.tensor([1.0, -1.0, 0.0]))


def test_invalid_episodes_stay_out_of_their_group():
    scores = torch.tensor([1.0, 0.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1])
    valid = torch.tensor([True, True, True, False])  # e.g. still running at window end
    out = group_advantages(scores, groups, valid=valid)
    # group 1 has one valid episode left: degenerate; the invalid one is never kept
    assert out.keep.tolist() == [True, True, False, False]
    assert out.groups == 2 and out.degenerate_groups == 1
    torch.testing.assert_close(out.advantages, torch.tensor([1.0, -1.0, 0.0, 0.0]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 1.0, 0.5, 3.0])),
                min_size=1, max_size=30),
       st.floats(0.1, 10.0), st.floats(-5.0, 5.0))
def test_group_advantage_properties(members, scale, shift):
    groups = torch.tensor([g for g, _ in members])
    scores = torch.tensor([s for _, s in members], dtype=torch.float64)
    out = group_advantages(scores, groups)
    degenerate = 0
    for g in groups.unique():
        member = groups == g
        adv, keep = out.advantages[member].double(), out.keep[member]
        if scores[member].unique().numel() == 1:  # all equal (incl. a lone episode)
            degenerate += 1
            assert not keep.any() and (adv == 0).all()
        else:  # centred, unit population std
            assert keep.all()
            assert abs(adv.sum().item()) < 1e-4
            assert abs(adv.pow(2).mean().item() - 1.0) < 1e-4
    assert out.degenerate_groups == degenerate and out.groups == groups.unique().numel()
    # invariant to a positive affine change of the scores
    moved = group_advantages(scores * scale + shift, groups)
    torch.testing.assert_close(moved.advantages, out.advantages, atol=1e-4, rtol=1e-4)
    assert torch.equal(moved.keep, out.keep)


def test_episodes_in_chunk_steps():
    dones = torch.tensor([[0, 1],
                          [1, 0],
                          [0, 0],
                          [0, 1]], dtype=torch.bool)
    index, complete = episodes_of(dones)
    # column 0: episode 0 (t 0-1), 1 (t 2-3, unfinished); column 1: 2 (t 0), 3 (t 1-3)
    assert index.tolist() == [[0, 2], [0, 3], [1, 3], [1, 3]]
    assert complete.tolist() == [True, False, True, True]
    success = torch.tensor([[0, 1], [1, 0], [0, 0], [0, 0]], dtype=torch.float32)
    assert per_episode(success, index, 4).tolist() == [1, 0, 1, 0]
    init_ids = torch.tensor([[11, 20], [11, 21], [12, 21], [12, 21]])
    assert per_episode(init_ids, index, 4, reduce="first").tolist() == [11, 12, 20, 21]


def test_first_episode_advantages_score_only_each_columns_first_episode():
    # 4 columns in groups of 2, T = 4. Column 0 succeeds at t=1 then starts a second episode
    # (auto-reset) that also succeeds: only the first counts. Column 1 fails (truncated at
    # t=3). Group 1 (columns 2, 3): both fail -> degenerate.
    done = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 1], [0, 0, 1, 0], [1, 1, 0, 0]]).bool()
    success = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]).bool()
    episodes, index = first_episode_advantages(done, success, group_size=2)
    first = index[0]
    # group 0: scores 1, 0 -> +1, -1 (mean .5, std .5)
    torch.testing.assert_close(episodes.advantages[first], torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert episodes.keep[first].tolist() == [True, True, False, False]
    assert episodes.keep.sum() == 2  # later episodes of columns 0, 2, 3 are not kept
    assert episodes.groups == 2 and episodes.degenerate_groups == 1
    # every step of column 0 after its first episode carries no advantage
    assert episodes.keep[index[:, 0]].tolist() == [True, True, False, False]


def test_grouped_restarts_share_initial_states_and_restart_every_segment():
    env = GroupedRestarts(make_env("reach", 8, seed=3, max_episode_chunks=5), every=5,
                          group_size=4, seed=11)
    image = env.reset()["image"]
    assert all((image[g * 4] == image[g * 4 + i]).all() for g in range(2) for i in range(4))
    assert not (image[0] == image[4]).all()  # the two groups start from different states
    rng = np.random.default_rng(0)
    ended, previous = np.zeros(8, bool), image
    for step in range(1, 11):
        result = env.step(rng.uniform(-1, 1, (8, env.spec.chunk_len, env.spec.action_dim)))
        ended |= result.terminated | result.truncated
        if step % 5 == 0:  # the horizon: every env's first episode of the segment ended ...
            assert ended.all()
            ended[:] = False
            restart = result.obs["image"]  # ... and the next observation is a grouped restart
            assert all((restart[g * 4] == restart[g * 4 + i]).all()
                       for g in range(2) for i in range(4))
            for g in range(2):  # each group's state fresh each segment
                assert not (restart[g * 4] == previous[g * 4]).all(), (step, g)
            previous = restart
    env.close()


def test_an_episode_the_grouped_restart_cuts_short_ends_there():
    """An episode begun after an earlier end in the segment (here the 3-chunk horizon, in a
    5-chunk segment) is cut by the grouped restart: it ends at that step, truncated, with its
    return and length so far, so that nothing reading `done` (a trajectory dump, `hpcvla
    inspect`) joins it to the next segment's grouped episode, which starts elsewhere."""
    env = GroupedRestarts(make_env("reach", 4, seed=3, max_episode_chunks=3), every=5,
                          group_size=2, seed=11)
    env.reset()
    rng = np.random.default_rng(0)
    running, chunks = np.zeros(4, np.float32), np.zeros(4, np.int32)
    for step in range(1, 11):
        result = env.step(rng.uniform(-1, 1, (4, env.spec.chunk_len, env.spec.action_dim)))
        running, chunks = running + result.reward, chunks + 1
        done = result.terminated | result.truncated
        if step % 5 == 3:  # the horizon ended every env's first episode
            assert result.truncated.all() and not result.success.any()
        if step % 5 == 0:  # every env's second episode (2 chunks in) ends with the segment
            assert done.all() and not result.success.any()
            np.testing.assert_allclose(result.episode_return, running, rtol=1e-6)
            assert result.episode_length.tolist() == chunks.tolist() == [2] * 4
        running, chunks = np.where(done, 0.0, running), np.where(done, 0, chunks)
    env.close()


def test_an_episode_the_grouped_restart_cuts_has_no_episode_metric():
    """An env's episode metric (EnvSpec.episode_metrics) of an episode the grouped restart
    cuts short is not known (the env never ended it): NaN, which the training's means leave
    out (metrics/episode_metrics.py), not the 0 of an episode that never had it; the episodes
    the env ended keep theirs."""
    import dataclasses

    from hpcvla.envs import ReachEnv

    class Measured(ReachEnv):  # reach, reporting each ended episode's length as a metric
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.spec = dataclasses.replace(self.spec, episode_metrics=("chunks",))

        def step(self, actions):
            result = super().step(actions)
            return result._replace(metrics={"chunks": result.episode_length.astype(np.float32)})
    env = GroupedRestarts(Measured(4, seed=3, max_episode_chunks=3), every=5, group_size=2,
                          seed=11)
    env.reset()
    for step in range(1, 6):
        result = env.step(np.zeros((4, env.spec.chunk_len, env.spec.action_dim)))
        if step == 3:  # the horizon ended every env's first episode: the env's own figure
            assert result.metrics["chunks"].tolist() == [3.0] * 4
    assert np.isnan(result.metrics["chunks"]).all()  # step 5: every second episode cut
    env.close()


def test_an_unknown_episode_metric_is_no_nonfinite_data_to_the_learner(capsys):
    """The NaN of an episode metric the grouped restart cut (above) reaches no loss: the
    learner's check of recorded fields does not take it for NaN data that skips optimizer
    steps (it does a NaN reward)."""
    from helpers import reach_segments

    from hpcvla.roles import learner
    groups, _ = reach_segments(1)
    group = groups[0]
    group["metric.grasped"] = np.full(group["done"].shape, np.nan, np.float32)
    learner._SAID_NONFINITE.clear()
    learner._say_nonfinite([group])
    assert capsys.readouterr().err == ""
    group["reward"][0, 0] = np.nan
    learner._say_nonfinite([group])
    assert "the trajectories' `reward` holds NaN or Inf" in capsys.readouterr().err
    learner._SAID_NONFINITE.clear()


def test_the_step_before_a_grouped_restart_resets_nothing_itself():
    """The restart resets every env; the step before it ends its episodes without the inner
    env's auto-reset (a second reset of the same env: a large part of a LIBERO chunk's
    cost). Inline and in a worker process (env.isolation=process) alike."""
    from hpcvla.envs.isolated import IsolatedEnv
    from hpcvla.envs.reach import ReachEnv

    class Counted(ReachEnv):
        resets = 0

        def _reset_env(self, i, rng):
            Counted.resets += 1
            super()._reset_env(i, rng)

    env = GroupedRestarts(Counted(4, seed=3, max_episode_chunks=3), every=3, group_size=2,
                          seed=11)
    env.reset()
    rng = np.random.default_rng(0)
    for step in range(1, 7):
        before = Counted.resets
        result = env.step(rng.uniform(-1, 1, (4, env.spec.chunk_len, env.spec.action_dim)))
        ended = int((result.terminated | result.truncated).sum())
        if step % 3:  # an episode ending mid-segment auto-resets, once
            assert Counted.resets - before == ended and not env.env.holding_resets
        else:  # the horizon ended every episode still running: one reset each, the restart's
            assert ended and Counted.resets - before == 4
    kwargs = {"image_size": 16, "max_episode_chunks": 2}
    inline = make_env("reach", 4, 5, **kwargs)
    isolated = IsolatedEnv("reach", 4, 5, kwargs, timeout_s=30, max_restarts=0)
    try:
        for one in (inline, isolated):
            one.reset()
            one.hold_resets(True)
        chunk = rng.uniform(-1, 1, (2, 4, inline.spec.chunk_len, inline.spec.action_dim))
        for x, y in zip(*[[one.step(c) for c in chunk] for one in (inline, isolated)]):
            assert all(np.array_equal(x.obs[k], y.obs[k]) for k in x.obs)
        assert x.truncated.any()  # held: the truncated envs observe where they ended
        np.testing.assert_allclose(x.obs["state"][x.truncated][:, :2],
                                   inline._ee[x.truncated], rtol=1e-6)
    finally:
        inline.close()
        isolated.close()


def test_grpo_settings_checked_before_ranks_start():
    with pytest.raises(ConfigError, match="rollout.segment_len = 8: expected env.max_episode"):
        load_config(ROOT / "configs/default.yaml", ["algorithm.name=grpo"])
    cfg = load_config(ROOT / "configs/reach_grpo.yaml", ["algorithm.group_size=3"])
    with pytest.raises(ConfigError, match="algorithm.group_size = 3: expected a divisor"):
        check_pipeline(cfg, plan_from_config(cfg.placement, 4))


def test_grpo_loss_masks_filtered_episodes():
    dones = torch.tensor([[0, 0], [1, 1], [0, 1]], dtype=torch.bool)
    index, complete = episodes_of(dones)  # ep 0: col 0 t0-1, ep 1: col 0 t2 (open),
    assert index.tolist() == [[0, 2], [0, 2], [1, 3]]  # ep 2: col 1 t0-1, ep 3: col 1 t2
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    groups = torch.tensor([4, 4, 4, 8])  # ep 3 alone: degenerate; ep 1 unfinished
    episodes = group_advantages(scores, groups, valid=complete)
    assert episodes.keep.tolist() == [True, False, True, False]
    torch.testing.assert_close(episodes.advantages, torch.tensor([1.0, 0.0, -1.0, 0.0]))

    proximal = torch.zeros(3, 2)
    logprob = torch.log(torch.tensor([[1.5, 0.5], [1.1, 0.9], [3.0, 3.0]]))
    loss, stats = grpo_loss(logprob, proximal, proximal, episodes, index)
    # kept steps: (0,0) (1,0) with A=+1: min(r, clip(r)) = 1.2, 1.1; (0,1) (1,1) with A=-1:
    # min(-r, -clip(r)) = -0.8, -0.9; the open and the lone episode's steps are left out
    assert loss.item() == pytest.approx(-(1.2 + 1.1 - 0.8 - 0.9) / 4, rel=1e-6)
    assert stats["clip_fraction"] == pytest.approx(2 / 4)


def test_grpo_loss_mean_over_episodes_weighs_a_short_success_as_a_long_failure():
    # one group of 2 columns, T = 4: column 0 succeeds at t = 0 (a 1-step episode, then an
    # auto-reset episode that is not kept), column 1 fails to the limit (4 steps); A = +1, -1
    dones = torch.tensor([[1, 0], [0, 0], [0, 0], [1, 1]], dtype=torch.bool)
    success = torch.tensor([[1, 0], [0, 0], [0, 0], [0, 0]], dtype=torch.bool)
    episodes, index = first_episode_advantages(dones, success, group_size=2)
    proximal = torch.zeros(4, 2, 3)  # 3 units (tokens) per step
    logprob = torch.full((4, 2, 3), math.log(1.1))  # ratio 1.1 everywhere, inside the clip
    by_steps, _ = grpo_loss(logprob, proximal, proximal.sum(-1), episodes, index)
    by_episodes, stats = grpo_loss(logprob, proximal, proximal.sum(-1), episodes, index,
                                   mean_over="episodes")
    # steps: 1 step at +1.1, 4 steps at -1.1, all of 3 units -> -(1.1 - 4.4) / 5
    assert by_steps.item() == pytest.approx(-(1.1 - 4 * 1.1) / 5, rel=1e-6)
    # episodes: each its own mean, then the two averaged -> -(1.1 - 1.1) / 2 = 0
    assert by_episodes.item() == pytest.approx(0.0, abs=1e-6)
    assert stats["clip_fraction"] == 0.0
    # the gradient pushes the success's units up as hard as the failure's down
    logprob.requires_grad_(True)
    grpo_loss(logprob, proximal, proximal.sum(-1), episodes, index,
              mean_over="episodes")[0].backward()
    up, down = -logprob.grad[0, 0].sum(), logprob.grad[:, 1].sum()
    assert up.item() == pytest.approx(down.item(), rel=1e-6) and up.item() > 0
    with pytest.raises(ValueError, match="expected one of .'steps', 'episodes', 'constant'"):
        grpo_loss(logprob, proximal, proximal.sum(-1), episodes, index, mean_over="tokens")
    # constant: the 5 kept steps' sum over all 8 the micro-batch holds
    constant, _ = grpo_loss(logprob.detach(), proximal, proximal.sum(-1), episodes, index,
                            mean_over="constant")
    assert constant.item() == pytest.approx(-(1.1 - 4 * 1.1) / 8, rel=1e-6)


@pytest.mark.parametrize("granularity", ["action", "token"])
def test_episodes_weigh_the_same_when_a_chunk_stops_inside(granularity):
    """group_loss_mean=episodes at a finer granularity, where the actions a chunk never ran are
    out (executed_units): a success after 1 of 4 actions (A = +1) and a failure over 2 whole
    chunks (A = -1), fresh data: they weigh the same, the loss 0 (each unit weighs 1 / the
    units its episode ran, not 1 / its chunks: the success weighed 1/4 of the failure)."""
    from hpcvla.algorithms.granularity import executed_units
    done = torch.tensor([[True, False], [False, True]])
    episodes, index = first_episode_advantages(done, torch.tensor([[True, False],
                                                                  [False, False]]), 2)
    units = (2, 2, 4) + ((3,) if granularity == "token" else ())
    ran = executed_units(torch.tensor([[1, 4], [4, 4]]), torch.zeros(units))
    for mean_over, loss in (("episodes", 0.0), ("steps", -(1 - 8) / 9)):
        got = grpo_loss(torch.zeros(units), torch.zeros(units), torch.zeros(2, 2), episodes,
                        index, mean_over=mean_over, units=ran)[0]
        assert got.item() == pytest.approx(loss, abs=1e-6), mean_over


def test_grpo_loss_constant_mean_of_micro_batches_is_the_whole_batchs():
    """Two micro-batches of one group each (T = 4): a success at t = 0 beside a failure to
    the limit (5 kept steps), and a degenerate group (both fail: none kept). The learners
    average their micro-batches' losses: under `constant` that is the loss of the two as one
    batch, what a streamed batch cannot get from the per-micro-batch means."""
    def batch(dones, success):
        episodes, index = first_episode_advantages(torch.tensor(dones, dtype=torch.bool),
                                                   torch.tensor(success, dtype=torch.bool),
                                                   group_size=2)
        return episodes, index, torch.tensor(dones).shape

    def loss(dones, success, mean_over):
        episodes, index, shape = batch(dones, success)
        logprob = torch.full(shape, math.log(1.1))
        proximal = torch.zeros(shape)
        return grpo_loss(logprob, proximal, proximal, episodes, index,
                         mean_over=mean_over)[0].item()

    mixed = ([[1, 0], [0, 0], [0, 0], [1, 1]], [[1, 0], [0, 0], [0, 0], [0, 0]])
    degenerate = ([[0, 0], [0, 0], [0, 0], [1, 1]], [[0, 0]] * 4)
    whole = tuple([a + b for a, b in zip(x, y)] for x, y in zip(mixed, degenerate))
    for mean_over in ("constant", "steps"):
        parts = (loss(*mixed, mean_over) + loss(*degenerate, mean_over)) / 2
        together = loss(*whole, mean_over)
        if mean_over == "constant":
            assert parts == pytest.approx(together, rel=1e-6)
            assert together == pytest.approx(-(1.1 - 4 * 1.1) / 16, rel=1e-6)
        else:  # a mean per micro-batch: the degenerate one halves the batch's
            assert parts == pytest.approx(together / 2, rel=1e-6)


@pytest.mark.parametrize("mean_over, pg_loss", [("steps", 0.6), ("episodes", 0.0),
                                                ("constant", 0.375)])
def test_the_setting_reaches_the_learners_loss(mean_over, pg_loss):
    """Through the learner's `policy_loss` on fresh data (ratio and weight 1): a group whose
    success ends at its first step and whose failure runs all 4, A = +1 / -1."""
    from hpcvla.algorithms.objective import policy_loss
    cfg, policy, _, _, batch = _success_and_failure_group(
        [f"algorithm.group_loss_mean={mean_over}"])
    _, stats, _ = policy_loss(cfg.algorithm, policy, batch)
    assert stats["pg_loss"] == pytest.approx(pg_loss, abs=1e-4)


def _success_and_failure_group(overrides=()):
    """GRPO on default.yaml and a fresh 4-step batch of 2 envs (ratio and weight 1): column 0
    succeeds at its first step (its restarted episode is in no group), column 1 fails at the
    end. Returns the config, the policy, its observations and act output, the batch."""
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    cfg = load_config(ROOT / "configs/default.yaml", [
        "algorithm.name=grpo", "algorithm.group_size=2", "env.max_episode_chunks=8",
        *overrides])
    spec = env_spec(cfg.env)
    policy = build_policy(cfg, spec)
    T, N = 4, 2
    obs, _ = policy_batch(spec, T * N)
    with torch.no_grad():
        out = policy.act(obs)
    batch = {f"obs.{k}": v.numpy().reshape(T, N, *v.shape[1:]) for k, v in obs.items()}
    done = np.zeros((T, N), bool)
    done[0, 0] = done[-1, 1] = True
    batch.update(actions=out.actions.numpy().reshape(T, N, *out.actions.shape[1:]),
                 logprob=out.logprob.numpy().reshape(T, N), done=done, success=done.copy(),
                 env_fault=np.zeros((T, N), bool))
    batch["success"][-1, 1] = False
    return cfg, policy, obs, out, batch


def test_the_entropy_bonus_covers_the_steps_the_policy_gradient_keeps():
    """GRPO's entropy term is averaged over the steps of kept episodes only: column 0's
    first episode ends at step 0, and its restarted episode (steps 1-3) is in no group."""
    from hpcvla.algorithms.objective import policy_loss
    cfg, policy, obs, out, batch = _success_and_failure_group()
    T, N = batch["done"].shape
    scale = torch.arange(1.0, T * N + 1)  # this policy's entropy is the same at every step

    def model(obs, actions):  # the policy, its entropy made to differ step by step
        logprob, value, entropy = policy.evaluate(obs, actions)
        return logprob, value, entropy * scale.reshape(-1, *[1] * (entropy.dim() - 1))
    model.device = policy.device
    _, stats, _ = policy_loss(cfg.algorithm, model, batch)
    with torch.no_grad():
        per_step = model(obs, out.actions)[2].reshape(T, N, -1).sum(-1)
    kept = torch.cat([per_step[:1, 0], per_step[:, 1]])
    assert stats["entropy"] == pytest.approx(kept.mean().item(), rel=1e-5)
    assert stats["entropy"] != pytest.approx(per_step.mean().item(), rel=1e-5)


# ----------------------------------------------------------------------------- granularity


def test_reduce_expand_and_sum():
    terms = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    assert reduce_units(terms, "token") is terms
    torch.testing.assert_close(reduce_units(terms, "action"), terms.sum(-1))
    torch.testing.assert_close(reduce_units(terms, "chunk"), terms.sum((1, 2)))
    with pytest.raises(ValueError, match="chunk, action, token"):
        reduce_units(terms, "episode")
    adv = torch.tensor([1.0, -2.0])
    assert expand_like(adv, terms)[1].eq(-2.0).all()
    assert torch.equal(sum_to(terms, 1), terms.sum((1, 2))) and sum_to(adv, 1) is adv
    with pytest.raises(ValueError, match="leading part"):
        expand_like(torch.zeros(3), terms)


def test_decoupled_loss_per_token_with_chunk_behaviour_hand_computed():
    # one chunk of 2 tokens; per-token ratios 1.5 (clipped to 1.2) and 0.9; A = 2
    proximal = torch.tensor([[-1.0, -2.0]])
    logprob = proximal + torch.log(torch.tensor([[1.5, 0.9]]))
    behaviour = torch.tensor([-3.5])  # chunk weight exp(-3 - (-3.5)) = e^0.5
    loss, stats = decoupled_ppo_loss(logprob, proximal, behaviour, torch.tensor([2.0]),
                                     clip=0.2, max_behaviour_weight=2.0)
    w = math.exp(0.5)
    assert loss.item() == pytest.approx(-w * (1.2 * 2 + 0.9 * 2) / 2, rel=1e-6)
    assert stats["behaviour_weight_max"] == pytest.approx(w, rel=1e-6)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    # a per-chunk loss of the same numbers: the ratio is the product 1.35, clipped to 1.2
    chunk_loss, _ = decoupled_ppo_loss(logprob.sum(-1), proximal.sum(-1), behaviour,
                                       torch.tensor([2.0]), clip=0.2)
    assert chunk_loss.item() == pytest.approx(-w * 1.2 * 2, rel=1e-6)


def test_value_loss_without_clipping():
    value = torch.tensor([1.0, 0.0, 2.0])
    old = torch.tensor([0.5, 0.1, 2.0])
    ret = torch.tensor([2.0, 1.0, 2.5])
    assert value_loss(value, old, ret, clip=None).item() == pytest.approx(0.5 * 2.25 / 3)
    # clipped to old +- 0.2: (0.7, 0.0, 2.0); the larger squared error of each: 1.69, 1, 0.25
    assert value_loss(value, old, ret, clip=0.2).item() == pytest.approx(0.5 * 2.94 / 3)


def test_an_episode_a_fault_ended_is_not_in_its_group():
    # columns 0-2 form one group; column 2's episode was ended by an env fault at t=1: it
    # is neither a failure in the group's statistics nor trained (keep False)
    done = torch.tensor([[0, 0, 0], [1, 1, 1]]).bool()
    success = torch.tensor([[0, 0, 0], [1, 0, 0]]).bool()
    faults = torch.tensor([[0, 0, 0], [0, 0, 1]]).bool()
    episodes, index = first_episode_advantages(done, success, group_size=3, faults=faults)
    torch.testing.assert_close(episodes.advantages[index[0]], torch.tensor([1.0, -1.0, 0.0]))
    assert episodes.keep[index[0]].tolist() == [True, True, False]
    unmasked, _ = first_episode_advantages(done, success, group_size=3)  # as a failure
    assert unmasked.keep[index[0]].tolist() == [True, True, True]


def test_a_new_grouped_algorithm_is_a_row_of_the_traits_table(monkeypatch):
    """A critic-free, grouped variant (RLOO and the like) is its loss and a row in
    config/families.ALGORITHMS: every rule GRPO's name used to pick (one grouped episode per
    segment, grouped restarts, group advantages and an untrained value head, the settings it
    reads, no value-critic warm-up) comes from the row, none falls back to PPO's."""
    import dataclasses

    from hpcvla.algorithms.objective import advantages_of, policy_loss
    from hpcvla.config.checks import cross_field_problems, unread_setting_problems
    from hpcvla.config.families import ALGORITHMS
    from hpcvla.envs.build import make_envs
    monkeypatch.setitem(ALGORITHMS, "rloo", dataclasses.replace(ALGORITHMS["grpo"]))
    cfg, policy, _, _, batch = _success_and_failure_group()
    cfg.algorithm.name = "rloo"
    advantages = advantages_of(cfg.algorithm, batch, policy.device)
    assert advantages.episodes is not None and advantages.advantages is None
    _, stats, _ = policy_loss(cfg.algorithm, policy, batch)
    assert stats["value_loss"] == 0 and "degenerate_groups" in stats, stats
    cfg.rollout.segment_len, cfg.algorithm.critic_warmup_versions = 4, 1
    problems = {field: fix for field, _, fix in cross_field_problems(cfg)}
    assert "for algorithm.name=rloo: a segment holds one grouped episode" in \
        problems["rollout.segment_len"]
    assert "only ppo warms a value critic" in problems["algorithm.critic_warmup_versions"]
    cfg.algorithm.gae_lambda, cfg.algorithm.group_size = 0.9, 4  # as typed
    refused = unread_setting_problems(cfg, ["algorithm.gae_lambda=0.9", "algorithm.group_size=4"])
    assert [(f, fix) for f, _, fix in refused] == [("algorithm.gae_lambda", "none: algorithm."
                                                    "name=rloo does not read it (ppo does); drop "
                                                    "it, or set algorithm.name")]
    cfg.rollout.segment_len = cfg.env.max_episode_chunks
    envs = make_envs(cfg, 4, seed=0)
    assert isinstance(envs, GroupedRestarts)
    envs.close()
    # an advantage the on-policy learner has no code for is named, not trained as GAE
    monkeypatch.setitem(ALGORITHMS, "rloo", dataclasses.replace(ALGORITHMS["grpo"],
                                                                advantage="leave_one_out"))
    with pytest.raises(ValueError, match="algorithm.name=rloo: its advantage 'leave_one_out'"):
        advantages_of(cfg.algorithm, batch, policy.device)
