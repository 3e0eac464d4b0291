"""SAC on the flow family (DSRL, policies/noise_actor.py): the flow policy frozen, a small actor
choosing its sampler's initial noise; SAC's transitions take that noise as their action."""

import numpy as np
import pytest
import torch

from hpcvla.algorithms.off_policy import soft_actor_critic_loss, update_targets
from hpcvla.algorithms.sac import target_entropy
from hpcvla.algorithms.transitions import transitions_of
from hpcvla.config import load_config
from hpcvla.config.loader import ConfigError
from hpcvla.envs import env_spec
from hpcvla.envs.build import make_envs
from hpcvla.factory import build_policy
from helpers import ROOT

STEERED = ["algorithm.name=sac", "env.image_size=32", "policy.hidden=32"]


@pytest.fixture(scope="module")
def steered():
    cfg = load_config(ROOT / "configs/reach_flow.yaml", STEERED)
    spec = env_spec(cfg.env)
    env = make_envs(cfg, 4, seed=0)
    obs = env.reset()
    env.close()
    return cfg, spec, build_policy(cfg, spec), obs


def test_only_the_noise_actor_its_critics_and_the_temperature_train(steered):
    _, _, policy, _ = steered
    trained = {n.split(".")[0] for n, p in policy.named_parameters() if p.requires_grad}
    assert trained == {"noise_encoder", "noise_trunk", "noise_mean", "noise_log_std",
                       "value_q", "sac_log_alpha"}
    assert not policy.value_q_target.q1[0].weight.requires_grad  # moved by Polyak only


def test_dsrl_steers_a_pretrained_flow_folder_with_a_fresh_noise_actor(steered, tmp_path):
    """A flow folder saved without the noise actor (a PPO run's, as a π0 folder lacks it) loads
    into the steered policy: the flow policy's tensors exactly, the noise actor, critics and
    temperature at their initial values; the steered policy's own folder loads back whole."""
    from hpcvla.policies import save_pretrained
    cfg, spec, fresh, _ = steered
    flow_cfg = load_config(ROOT / "configs/reach_flow.yaml", STEERED[1:] + ["run.seed=7"])
    flow_policy = build_policy(flow_cfg, spec)
    folder = save_pretrained(flow_policy, tmp_path / "flow")
    started = build_policy(load_config(ROOT / "configs/reach_flow.yaml",
                                       STEERED + [f"policy.pretrained={folder}"]), spec)
    flow, state = flow_policy.state_dict(), started.state_dict()
    assert all(torch.equal(state[name], value) for name, value in flow.items())
    assert not all(torch.equal(flow[n], fresh.state_dict()[n]) for n in flow)  # seed 7's
    assert {n.split(".")[0] for n in set(state) - set(flow)} == {
        "noise_encoder", "noise_trunk", "noise_mean", "noise_log_std", "value_q",
        "value_q_target", "sac_log_alpha"}
    assert float(state["sac_log_alpha"].exp()) == pytest.approx(
        cfg.algorithm.init_temperature)  # fresh: the config's, targets equal to the critics
    assert all(torch.equal(v, state["value_q." + k]) for k, v in
               started.value_q_target.state_dict().items())
    again = build_policy(load_config(ROOT / "configs/reach_flow.yaml", STEERED + [
        f"policy.pretrained={save_pretrained(started, tmp_path / 'steered')}"]), spec)
    assert all(torch.equal(v, started.state_dict()[k]) for k, v in again.state_dict().items())


def test_the_chunk_is_the_noiseless_sampler_from_the_chosen_noise(steered):
    _, spec, policy, obs = steered
    tensors = policy.obs_to_tensors(obs)
    out, extras = policy.sample(tensors)
    noise = extras["dsrl_noise"]
    assert noise.shape == (4, spec.chunk_len, spec.action_dim)
    assert noise.abs().max() < policy.noise_bound and torch.isfinite(out.logprob).all()
    x0 = torch.zeros(4, policy.model_horizon, policy.model_action_dim)
    x0[:, :spec.chunk_len, :spec.action_dim] = noise
    chunk, *_ = policy._sample(policy._inputs(tensors), True, x0)
    assert torch.allclose(out.actions, chunk)
    again, _ = policy.sample(tensors, deterministic=True)
    assert torch.equal(again.actions, policy.sample(tensors, deterministic=True)[0].actions)
    # the noise is what the samples differ by: another noise, another chunk
    assert not torch.allclose(out.actions, again.actions)


def test_a_sac_step_on_recorded_noise_moves_the_actor_and_never_the_flow_policy(steered):
    cfg, spec, policy, obs = steered
    T, n = 3, 4
    tensors = policy.obs_to_tensors(obs)
    _, extras = policy.sample(tensors)
    group = {f"obs.{k}": np.repeat(v[None], T, 0) for k, v in obs.items()}
    group.update({f"next_obs.{k}": v for k, v in obs.items()},
                 actions=np.zeros((T, n, spec.chunk_len, spec.action_dim), np.float32),
                 reward=np.ones((T, n), np.float32), terminated=np.zeros((T, n), bool),
                 truncated=np.zeros((T, n), bool), env_fault=np.zeros((T, n), bool))
    group["obs.dsrl_noise"] = np.repeat(extras["dsrl_noise"].numpy()[None], T, 0)
    kept, dropped = transitions_of(group, list(spec.obs), policy.soft_action_field)
    assert dropped == 0 and np.array_equal(kept["actions"][:n], extras["dsrl_noise"].numpy())
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    batch = {k: torch.as_tensor(v) for k, v in kept.items()}
    loss, stats = soft_actor_critic_loss(cfg.algorithm, policy, batch,
                                         target_entropy(spec.action_dim, spec.chunk_len))
    loss.backward()
    optimizer.step()
    update_targets(policy, 0.5)
    moved = {k.split(".")[0] for k, v in policy.state_dict().items()
             if not torch.equal(v, before[k])}
    assert {"noise_mean", "value_q", "value_q_target", "sac_log_alpha"} <= moved
    assert moved <= {"noise_encoder", "noise_trunk", "noise_mean", "noise_log_std", "value_q",
                     "value_q_target", "sac_log_alpha"}, moved
    assert np.isfinite(stats["critic_loss"])
    # a fresh actor's noise: tanh(N(0, 1)) x bound, whose rms is ~0.63 x bound
    assert 0.3 * policy.noise_bound < stats["action_rms"] < 0.9 * policy.noise_bound, stats


def test_a_noise_actor_of_the_state_alone_never_reads_the_image(steered):
    """algorithm.noise_obs=state: the actor and its critics see the state only (the flow policy
    it steers still reads everything); a field the env lacks is refused by the rank building
    it and, before launch, by the env's probe."""
    cfg, spec, full, obs = steered
    policy = build_policy(load_config(ROOT / "configs/reach_flow.yaml",
                                      STEERED + ["algorithm.noise_obs=state"]), spec)
    assert not hasattr(policy.noise_encoder, "image_encoder")
    assert sum(p.numel() for p in policy.noise_encoder.parameters()) < \
        sum(p.numel() for p in full.noise_encoder.parameters()) / 10
    tensors = policy.obs_to_tensors(obs)
    blind = {**tensors, "image": torch.zeros_like(tensors["image"]),
             "instruction": torch.zeros_like(tensors["instruction"])}
    assert torch.equal(policy.features(tensors), policy.features(blind))
    assert not torch.equal(full.features(tensors), full.features(blind))
    out, extras = policy.sample(tensors)
    assert extras["dsrl_noise"].shape == (4, spec.chunk_len, spec.action_dim)
    no_state = load_config(ROOT / "configs/reach_flow.yaml",
                           STEERED + ["algorithm.noise_obs=state", "env.state=false"])
    with pytest.raises(ValueError, match="algorithm.noise_obs: state not among"):
        build_policy(no_state, env_spec(no_state.env))
    from hpcvla.preflight import noise_obs_problems
    assert noise_obs_problems(no_state) == [("algorithm.noise_obs", "state", "fields among the "
                                             "env's observations (image, instruction): state "
                                             "not among them")]


def test_what_dsrl_cannot_run_is_refused():
    from hpcvla.preflight import check_sft
    with pytest.raises(ConfigError, match="algorithm.name = 'sac'.*policy.checkpoint"):
        check_sft(load_config(ROOT / "configs/reach_flow.yaml",
                              ["algorithm.name=sac", "sft.demos=x.h5"]))  # SFT trains no flow
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/reach_flow.yaml",
                    ["algorithm.name=rlpd", "algorithm.demos=x.h5", "policy.lora_rank=4"])
    assert "policy.name = 'flow'" in str(err.value) and "policy.lora_rank = 4" in str(err.value)
    for overrides, field in ((["algorithm.noise_obs=state"], "empty unless policy.name=flow"),
                             (["algorithm.name=sac", "algorithm.noise_obs=state,depth"],
                              "distinct fields among image, instruction, state"),
                             (["algorithm.name=sac", "algorithm.target_entropy=0.7"],
                              "< 0.693, the entropy per dimension of the uniform")):
        with pytest.raises(ConfigError, match=field):
            load_config(ROOT / "configs/reach_flow.yaml", overrides)
    load_config(ROOT / "configs/reach_flow.yaml",  # the box is wider: (-1.5, 1.5)
                ["algorithm.name=sac", "algorithm.target_entropy=0.7",
                 "algorithm.noise_bound=1.5"])
    for family in ("tokens", "oft"):
        with pytest.raises(ConfigError, match=f"policy.name = '{family}'"):
            load_config(ROOT / "configs/reach_flow.yaml",
                        ["algorithm.name=sac", f"policy.name={family}"])
