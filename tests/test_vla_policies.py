"""The VLA policy families (flow matching, action tokens): interface, log-probs against
independent computations, granularities, gradients and freezing, checkpoint folders, PPO on a
fixed batch, and short real DeepSpeed ZeRO-3 runs of each."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributions import Categorical, Normal

from hpcvla.algorithms import decoupled_ppo_loss, gae, normalize_advantages, value_loss
from hpcvla.policies import (POLICIES, ActOutput, Policy, load_pretrained, make_policy,
                             save_pretrained)
from hpcvla.policies.tokens import BINS, bin_centres, bins_of
from hpcvla.policies.folders import load_weights
from hpcvla.policies.registry import count_preset_parameters
from helpers import ROOT, hpcvla, run_train

VOCAB, ACTION_DIM, CHUNK = 12, 3, 4
SPEC = {"image": ((32, 32, 3), "|u1"), "instruction": ((5,), "<i4"), "state": ((7,), "<f4")}
SPEC_NO_STATE = {k: v for k, v in SPEC.items() if k != "state"}
FAMILIES = {  # id -> (registry name, constructor kwargs)
    "flow": ("flow", {}),
    "flow-chain": ("flow", {"logprob_mode": "chain"}),
    "flow-random": ("flow", {"logprob_mode": "random_step"}),
    "tokens": ("tokens", {}),
}


def make_obs(spec, batch, seed=0):
    rng = np.random.default_rng(seed)
    obs = {"image": rng.integers(0, 256, (batch, *spec["image"][0]), dtype=np.uint8),
           "instruction": rng.integers(1, VOCAB, (batch, *spec["instruction"][0]))
           .astype(np.int32)}
    obs["instruction"][:, 3:] = 0  # padding tail
    obs["instruction"][0] = 0  # a fully padded instruction still works
    if "state" in spec:
        obs["state"] = rng.standard_normal((batch, *spec["state"][0])).astype(np.float32)
    return Policy.obs_to_tensors(obs, "cpu")


def make(family="flow", spec=SPEC, seed=0, **kwargs):
    name, base = FAMILIES[family]
    torch.manual_seed(seed)
    return make_policy(name, spec, ACTION_DIM, CHUNK, VOCAB, **{**base, **kwargs})


def sample(policy, obs, deterministic=False):
    """act's output, and obs extended with the extras evaluate needs (flow's chain)."""
    out, extras = policy.sample(obs, deterministic)
    return out, {**obs, **extras}


@pytest.mark.parametrize("spec", [SPEC, SPEC_NO_STATE], ids=["state", "no_state"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_act_shapes_and_evaluate_recomputes_its_logprob(family, spec):
    policy = make(family, spec)
    assert isinstance(policy, POLICIES[FAMILIES[family][0]])
    obs = make_obs(spec, 6)
    out, scored = sample(policy, obs)
    assert isinstance(out, ActOutput)
    assert out.actions.shape == (6, CHUNK, ACTION_DIM)
    assert out.logprob.shape == (6,) and out.value.shape == (6,)
    for t in out:
        assert t.dtype == torch.float32 and not t.requires_grad and torch.isfinite(t).all()
    logprob, value, entropy = policy.evaluate(scored, out.actions)
    assert logprob.requires_grad and entropy.shape == (6,)
    torch.testing.assert_close(logprob.detach(), out.logprob, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(value.detach(), out.value, atol=1e-5, rtol=1e-5)
    # a different chunk scores differently (random_step: what its noisy step drew, recorded)
    other = {**scored, **{k: v.flip(0) for k, v in scored.items() if k == "flow_step_taken"}}
    assert not torch.allclose(policy.evaluate(other, out.actions.flip(0))[0], logprob)


@pytest.mark.parametrize("family", ["flow", "tokens"])
def test_the_wrist_camera_joins_the_prefix(family):
    spec = {**SPEC, "wrist_image": ((32, 32, 3), "|u1")}
    policy = make(family, spec)
    obs = make_obs(spec, 4)
    obs["wrist_image"] = torch.as_tensor(np.random.default_rng(1).integers(
        0, 256, (4, 32, 32, 3), dtype=np.uint8))
    embeds, _ = policy.prefix.embed(obs)
    one_camera, _ = policy.prefix.embed({k: v for k, v in obs.items() if k != "wrist_image"})
    assert embeds.shape[1] == one_camera.shape[1] + (32 // 16) ** 2  # + the wrist's patches
    out, scored = sample(policy, obs, deterministic=True)
    torch.testing.assert_close(policy.evaluate(scored, out.actions)[0].detach(), out.logprob,
                               atol=1e-4, rtol=1e-5)
    moved = sample(policy, {**obs, "wrist_image": obs["wrist_image"].flip(1)},
                   deterministic=True)[0]
    assert not torch.allclose(moved.actions, out.actions)  # what the wrist sees matters


def test_flow_last_step_logprob_is_gaussian_around_the_deterministic_chunk():
    """Independent computation: in last_step mode the deterministic chunk is the mean of
    the noisy last step, so log p(a) = sum log N(a; det, sigma^2) with torch.distributions."""
    policy = make("flow", denoise_steps=3)
    with torch.no_grad():
        policy.log_std.copy_(torch.linspace(-1.5, 0.3, CHUNK * ACTION_DIM).view(CHUNK, -1))
    obs = make_obs(SPEC, 5)
    mean = policy.act(obs, deterministic=True).actions
    out = policy.act(obs)
    assert not torch.allclose(out.actions, mean)
    ref = Normal(mean, policy.log_std.detach().exp()).log_prob(out.actions).sum(dim=(1, 2))
    torch.testing.assert_close(out.logprob, ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(policy.evaluate(obs, out.actions)[0].detach(), ref,
                               atol=1e-4, rtol=1e-5)


def test_flow_chain_logprob_matches_stepwise_gaussians():
    """Independent computation of the chain log-prob: K sequential expert passes (evaluate
    uses one batched pass) and a Normal per transition with std sigma / sqrt(K)."""
    K = 3
    policy = make("flow-chain", denoise_steps=K)
    obs = make_obs(SPEC, 4)
    out, scored = sample(policy, obs)
    start, taken = scored["flow_chain_start"], scored["flow_chain_taken"]
    assert start.shape == (4, CHUNK, ACTION_DIM) and taken.shape == (4, K, CHUNK, ACTION_DIM)
    torch.testing.assert_close(taken[:, -1], out.actions)  # x_K's: the chunk acted
    states = torch.cat([start[:, None], taken], dim=1)  # unpadded: every entry executed
    std = policy.log_std.detach().exp() / K ** 0.5
    ref = torch.zeros(4)
    with torch.no_grad():
        cache, pad, _ = policy._encode(obs)
        for k in range(K):
            t = torch.full((4,), 1.0 - k / K)
            velocity, _ = policy._velocity(cache, pad, obs["state"], states[:, k], t)
            ref += Normal(states[:, k] - velocity / K, std).log_prob(states[:, k + 1]).sum((1, 2))
    torch.testing.assert_close(out.logprob, ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(policy.evaluate(scored, out.actions)[0].detach(), ref,
                               atol=1e-4, rtol=1e-5)
    with pytest.raises(KeyError, match="flow_chain_start"):
        policy.evaluate(obs, out.actions)


def rlinf_flow_sde_step(x, v, t, K, noise_level):
    """RLinf's flow-SDE transition from x at time t (openpi_action_model's
    sample_mean_var_val, noise_method flow_sde, as its code writes it): the denoised and the
    noise end points' predictions weighted, the step's std from the time grid."""
    grid = torch.cat([torch.linspace(1, 1 / K, K), torch.zeros(1)])
    denominator = torch.where(grid == 1, grid[1], grid)
    sigmas = noise_level * torch.sqrt(grid / (1 - denominator))[:-1]
    index = torch.round((1 - t) * K).long()
    sigma, delta = sigmas[index].view(-1, 1, 1), 1.0 / K
    t = t.view(-1, 1, 1)
    x0_pred, x1_pred = x - v * t, x + v * (1 - t)
    mean = x0_pred * (1 - (t - delta)) + x1_pred * (t - delta - sigma ** 2 * delta / (2 * t))
    return mean, math.sqrt(delta) * sigma


@pytest.mark.parametrize("noise", ["learned", "sde"])
def test_flow_random_step_scores_the_one_noisy_transition_it_recorded(noise):
    """random_step (RLinf's flow-SDE): from x_0 ~ N(0, I), each sample's one noisy step is
    drawn uniformly; its start x_k, time t_k and noisy executed entries are recorded, the
    other steps are the ODE's. Checked independently: the log-prob is the Normal of that one
    transition (flow_noise learned: std sigma around the Euler step from one expert pass at
    x_k, t_k; sde: RLinf's own step, rlinf_flow_sde_step), evaluate gives it, and the ODE
    from x_{k+1} reproduces the executed chunk; padded dims stay noise-free."""
    K, B = 3, 48
    dims = {"horizon": 6, "action_dim": 5, "state_dim": 9}
    policy = make("flow-random", denoise_steps=K, model_dims=dims, flow_noise=noise,
                  noise_level=0.7)
    assert policy.log_std.requires_grad == (noise == "learned")  # sde: the times' std
    with torch.no_grad():
        policy.log_std.copy_(torch.linspace(-1.5, 0.3, CHUNK * ACTION_DIM).view(CHUNK, -1))
    obs = make_obs(SPEC, B)
    torch.manual_seed(1)
    out, scored = sample(policy, obs)
    x, t, taken = scored["flow_step_x"], scored["flow_step_t"], scored["flow_step_taken"]
    assert x.shape == (B, 6, 5) and t.shape == (B, 1) and taken.shape == (B, CHUNK, ACTION_DIM)
    steps = torch.round((1 - t[:, 0]) * K).long()
    assert sorted(set(steps.tolist())) == list(range(K))  # every step drawn in the batch
    torch.testing.assert_close(t[:, 0], 1 - steps / K)
    state = torch.nn.functional.pad(obs["state"], (0, 2))
    with torch.no_grad():
        cache, pad, _ = policy._encode(obs)
        velocity = policy._velocity(cache, pad, state, x, t[:, 0])[0]
        mean = x - velocity / K
        if noise == "learned":
            centre, std = mean[:, :CHUNK, :ACTION_DIM], policy.log_std.exp()
        else:
            sde_mean, std = rlinf_flow_sde_step(x, velocity, t[:, 0], K, 0.7)
            centre = sde_mean[:, :CHUNK, :ACTION_DIM]
        ref = Normal(centre, std).log_prob(taken)
        # and what was drawn is that Normal's: standardised, N(0, 1), unrelated to the noise
        # end x_1 the velocity points back to (the drift correction's direction)
        z = ((taken - centre) / std).flatten()
        x1 = (x + (1 - t[:, 0, None, None]) * velocity)[:, :CHUNK, :ACTION_DIM].flatten()
        assert abs(float(z.mean())) < 0.15 and abs(float(z.std()) - 1) < 0.1, z.std()
        assert abs(float(torch.corrcoef(torch.stack([z, x1]))[0, 1])) < 0.15
        assert (taken - mean[:, :CHUNK, :ACTION_DIM]).abs().min() > 0  # noisy there
        nxt = mean.clone()
        nxt[:, :CHUNK, :ACTION_DIM] = taken
        for k in range(1, K):  # the deterministic rest of each sample's chain
            later = steps < k
            v = policy._velocity(cache, pad, state, nxt, torch.full((B,), 1 - k / K))[0]
            nxt = torch.where(later[:, None, None], nxt - v / K, nxt)
    torch.testing.assert_close(out.logprob, ref.sum((1, 2)), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.actions, nxt[:, :CHUNK, :ACTION_DIM], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(policy.evaluate(scored, out.actions)[0].detach(),
                               ref.sum((1, 2)), atol=1e-4, rtol=1e-5)
    with pytest.raises(KeyError, match="flow_step_x"):
        policy.evaluate(obs, out.actions)


def test_flow_deterministic_acting_starts_where_its_mode_explores_from():
    """From x_0 = 0 the deterministic chunk is the same in every mode; by default (auto) a
    mode acts from where it explores: last_step from 0, chain and random_step from drawn
    noise (measured from 0 they would be a policy RL never trained)."""
    obs = make_obs(SPEC, 3)
    a = make("flow").act(obs, deterministic=True).actions
    assert make("flow").action_mode(True) == "deterministic"
    for mode in ("flow-chain", "flow-random"):  # same seed, same weights
        torch.testing.assert_close(
            a, make(mode, denoise_from="zero").act(obs, deterministic=True).actions)
        policy = make(mode)
        assert policy.action_mode(True) == "noise-free flow from N(0, I)"
        torch.manual_seed(1)
        drawn = policy.act(obs, deterministic=True).actions
        assert not torch.allclose(a, drawn)
        torch.manual_seed(1)
        torch.testing.assert_close(drawn, policy.act(obs, deterministic=True).actions)
    # from a config, as training's held-out evaluation and `hpcvla eval` build it
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    for mode, start in (("last_step", "deterministic"), ("chain", "noise-free flow from N(0, I)"),
                        ("random_step", "noise-free flow from N(0, I)")):
        cfg = load_config(ROOT / "configs/reach_flow.yaml", [f"policy.logprob_mode={mode}"])
        assert cfg.policy.denoise_from == "auto"
        assert build_policy(cfg, env_spec(cfg.env)).action_mode(True) == start, mode


def test_tokens_logprob_is_a_sum_of_categoricals_over_bins():
    policy = make("tokens")
    obs = make_obs(SPEC, 5)
    out = policy.act(obs)
    centres = bin_centres()
    assert torch.isin(out.actions, centres).all()  # every value is a bin centre...
    torch.testing.assert_close(centres[bins_of(out.actions)], out.actions)  # ...recovered
    assert centres[0] == -1 + 1 / BINS and bins_of(torch.tensor([-5.0, 5.0])).tolist() == [0, 255]
    with torch.no_grad():
        logits, _ = policy._logits_and_value(obs)
    ref = Categorical(logits=logits).log_prob(bins_of(out.actions)).sum((1, 2))
    torch.testing.assert_close(out.logprob, ref, atol=1e-4, rtol=1e-5)
    det = policy.act(obs, deterministic=True).actions
    torch.testing.assert_close(det, centres[logits.argmax(-1)])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_granularities_agree(family):
    obs = make_obs(SPEC, 5)
    chunk = make(family)
    out, scored = sample(chunk, obs)
    terms = chunk.unit_logprobs(scored, out.actions).detach()
    assert terms.shape == (5, CHUNK, ACTION_DIM)
    results = {}
    for g in ("chunk", "action", "token"):
        policy = make(family, logprob_granularity=g)
        policy.load_state_dict(chunk.state_dict())
        results[g] = [x.detach() for x in policy.evaluate(scored, out.actions)]
    (lc, vc, ec), (la, va, ea), (lt, vt, et) = (results[g] for g in ("chunk", "action", "token"))
    assert lc.shape == (5,) and la.shape == (5, CHUNK) and lt.shape == (5, CHUNK, ACTION_DIM)
    torch.testing.assert_close(lt, terms)
    torch.testing.assert_close(la, lt.sum(-1))
    torch.testing.assert_close(lc, la.sum(-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lc, out.logprob, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ec, et.sum((1, 2)), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ea, et.sum(-1))
    torch.testing.assert_close(vc, vt)


@pytest.mark.parametrize("family", ["flow", "flow-chain", "flow-random", "tokens"])
def test_gradients_reach_every_trainable_parameter(family):
    policy = make(family)
    obs = make_obs(SPEC, 6)
    out, scored = sample(policy, obs)
    logprob, value, entropy = policy.evaluate(scored, out.actions)
    (-logprob.mean() + value.pow(2).mean() - 0.01 * entropy.mean()).backward()
    for name, p in policy.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_train_expert_only_freezes_the_prefix():
    policy = make("flow", train_expert_only=True)
    obs = make_obs(SPEC, 6)
    out = policy.act(obs)
    logprob, value, _ = policy.evaluate(obs, out.actions)
    (-logprob.mean() + value.pow(2).mean()).backward()
    prefix = dict(policy.prefix.named_parameters())
    assert prefix and all(not p.requires_grad and p.grad is None for p in prefix.values())
    trainable = {n: p for n, p in policy.named_parameters() if not n.startswith("prefix.")}
    assert any(n.startswith("gemma_expert.") for n in trainable)
    for name, p in trainable.items():
        assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("family", ["flow", "tokens"])
def test_bfloat16_runs_and_scores_in_float32(family):
    policy = make(family, dtype="bfloat16")
    assert next(policy.parameters()).dtype == torch.bfloat16
    obs = make_obs(SPEC, 4)
    out = policy.act(obs)
    assert out.actions.dtype == out.logprob.dtype == torch.float32
    logprob, value, _ = policy.evaluate(obs, out.actions)
    assert logprob.dtype == torch.float32 and torch.isfinite(logprob).all()
    torch.testing.assert_close(logprob.detach(), out.logprob, atol=0.5, rtol=0.05)


def test_size_presets_and_their_checks():
    counts = {(name, size): count_preset_parameters(name, size, SPEC, ACTION_DIM, CHUNK, VOCAB)
              for name in ("flow", "tokens") for size in ("tiny", "full")}
    assert 1e5 < counts["flow", "tiny"] < 2e6 and 1e5 < counts["tokens", "tiny"] < 2e6
    assert 3.0e9 < counts["flow", "full"] < 3.5e9  # π0: PaliGemma-3B + 300M expert
    assert 6.8e9 < counts["tokens", "full"] < 7.4e9  # Llama-2-7B + SigLIP so400m
    with pytest.raises(ValueError, match="presets: tiny, small, full"):
        make("flow", size="huge")
    with pytest.raises(ValueError, match="logprob_granularity"):
        make("tokens", logprob_granularity="word")
    with pytest.raises(ValueError, match="flow policy needs observation .image."):
        make_policy("flow", {"state": ((3,), "<f4")}, ACTION_DIM, CHUNK, VOCAB)


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("family", ["flow", "tokens"])
def test_hf_folder_round_trip_is_exact(tmp_path, family):
    policy = make(family, logprob_granularity="action")
    with torch.no_grad():  # weights unlike any fresh init
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    folder = save_pretrained(policy, tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    assert config["hpcvla_policy"] == family and config["kwargs"]["logprob_granularity"] == "action"
    keys = set(load_file(str(folder / "model.safetensors")))
    if family == "flow":  # LeRobot π0 names
        assert "model.paligemma_with_expert.gemma_expert.model.layers.0.self_attn.q_proj.weight" \
            in keys
        assert "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model." \
            "embeddings.patch_embedding.weight" in keys and "model.action_in_proj.weight" in keys
    else:  # OpenVLA names for the language model
        assert "language_model.model.layers.0.self_attn.q_proj.weight" in keys
    assert "rl.value_head.0.weight" in keys

    loaded = load_pretrained(folder)
    assert type(loaded) is type(policy)
    ours, theirs = policy.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]), k
    obs = make_obs(SPEC, 3)
    torch.testing.assert_close(policy.act(obs, deterministic=True), loaded.act(obs, True),
                               rtol=0, atol=0)
    save_pretrained(loaded, tmp_path / "again")  # and back: the same tensors, names, config
    again = load_file(str(tmp_path / "again/model.safetensors"))
    first = load_file(str(folder / "model.safetensors"))
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    assert json.loads((tmp_path / "again/config.json").read_text()) == config


def test_loading_names_missing_and_misshaped_tensors(tmp_path):
    policy = make("flow")
    folder = save_pretrained(policy, tmp_path / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    expert_q = "model.paligemma_with_expert.gemma_expert.model.layers.1.self_attn.q_proj.weight"
    broken = dict(tensors)
    del broken[expert_q]
    broken["model.action_out_proj.weight"] = torch.zeros(5, 5)
    broken["model.extra.weight"] = torch.zeros(1)
    save_file(broken, folder / "model.safetensors")
    with pytest.raises(ValueError) as err:
        load_pretrained(folder)
    message = str(err.value)
    assert f"missing {expert_q}" in message
    assert "misshaped model.action_out_proj.weight: file (5, 5), model (3, 32)" in message
    assert "unexpected model.extra.weight" in message

    # a VLA checkpoint without the RL heads loads; the heads keep their initial values
    vla_only = {k: v for k, v in tensors.items() if not k.startswith("rl.")}
    save_file(vla_only, tmp_path / "vla.safetensors")
    fresh = make("flow", seed=1)
    head = fresh.value_head[0].weight.detach().clone()
    assert set(load_weights(fresh, tmp_path / "vla.safetensors")) == \
        {"log_std", "value_head.0.weight", "value_head.0.bias", "value_head.2.weight",
         "value_head.2.bias"}
    assert torch.equal(fresh.value_head[0].weight, head)
    assert torch.equal(fresh.action_out_proj.weight, policy.action_out_proj.weight)


PALI = "model.paligemma_with_expert.paligemma."
EMBED, LM_HEAD = PALI + "model.language_model.embed_tokens.weight", PALI + "lm_head.weight"


def test_published_pi0_layouts_load(tmp_path):
    """π0 folders as they are published: hub files keep lm_head and drop the tied
    embed_tokens (and carry the expert's unused lm_head); openpi's converted files have no
    `model.` prefix; big ones are sharded with an index. Each loads exactly."""
    policy = make("flow")
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    tensors = load_file(str(save_pretrained(policy, tmp_path / "ours") / "model.safetensors"))
    hub = {k: v for k, v in tensors.items() if k != EMBED}
    hub[LM_HEAD] = tensors[EMBED].clone()
    hub["model.paligemma_with_expert.gemma_expert.lm_head.weight"] = torch.zeros(3, 32)
    openpi = {k.removeprefix("model."): v for k, v in tensors.items()}
    names = sorted(tensors)
    folders = {"hub": {"model.safetensors": hub}, "openpi": {"model.safetensors": openpi},
               "sharded": {"model-00001-of-00002.safetensors": {k: tensors[k] for k in names[::2]},
                           "model-00002-of-00002.safetensors": {k: tensors[k] for k in names[1::2]}}}
    for layout, files in folders.items():
        (tmp_path / layout).mkdir()
        for name, content in files.items():
            save_file(content, tmp_path / layout / name)
        if layout == "sharded":
            weight_map = {k: name for name, part in files.items() for k in part}
            (tmp_path / layout / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map}))
        fresh = make("flow", seed=1)
        assert load_weights(fresh, tmp_path / layout) == [], layout
        for k, v in policy.state_dict().items():
            assert torch.equal(fresh.state_dict()[k], v), (layout, k)


def test_a_fine_tune_that_untied_lm_head_loads_the_embedding_pi0_computes_with(tmp_path):
    """LeRobot saves embed_tokens and lm_head apart and its training moves only embed_tokens
    (π0 never decodes tokens): the loader keeps embed_tokens, whichever order they come in."""
    policy = make("flow")
    tensors = load_file(str(save_pretrained(policy, tmp_path / "ours") / "model.safetensors"))
    untied = dict(tensors, **{LM_HEAD: tensors[EMBED] + 1})
    save_file(untied, tmp_path / "untied.safetensors")
    fresh = make("flow", seed=1)
    assert load_weights(fresh, tmp_path / "untied.safetensors") == []
    assert torch.equal(fresh.prefix.language_model.embed_tokens.weight, tensors[EMBED])


def test_published_layouts_that_do_not_fit_are_named(tmp_path):
    policy = make("flow")
    tensors = load_file(str(save_pretrained(policy, tmp_path / "ours") / "model.safetensors"))
    padded = dict(tensors, **{"model.action_in_proj.weight": torch.zeros(32, 32)})
    save_file(padded, tmp_path / "padded.safetensors")  # π0 pads actions to 32 dims
    with pytest.raises(ValueError, match=r"misshaped model.action_in_proj.weight: file \(32, 32\)"):
        load_weights(make("flow"), tmp_path / "padded.safetensors")
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {EMBED: "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="names shard model-00001-of-00002.safetensors, which "
                                         "is missing"):
        load_weights(make("flow"), tmp_path / "shards")
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        load_weights(make("flow"), tmp_path)


# ----------------------------------------------------------------------------- learning


@pytest.mark.slow
@pytest.mark.parametrize("family,granularity", [("flow", "chunk"), ("flow-chain", "token"),
                                                ("tokens", "chunk"), ("tokens", "token")])
def test_ppo_steps_on_a_fixed_batch_lower_the_loss(family, granularity):
    policy = make(family, logprob_granularity=granularity)
    obs = make_obs(SPEC, 16, seed=2)
    out, scored = sample(policy, obs)
    reward = -(out.actions - 0.3).pow(2).sum((1, 2))  # prefer chunks near 0.3
    adv, ret = gae(reward[None], out.value[None], torch.ones(1, 16, dtype=torch.bool),
                   torch.zeros(16), gamma=0.99, lam=0.95)
    adv, ret = normalize_advantages(adv[0]), ret[0]
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-3)

    def loss_fn():
        logprob, value, _ = policy.evaluate(scored, out.actions)
        proximal = policy.unit_logprobs(scored, out.actions).detach() if granularity == "token" \
            else out.logprob
        pg, _ = decoupled_ppo_loss(logprob, proximal, out.logprob, adv)
        return pg + 0.5 * value_loss(value, out.value, ret)

    losses = []
    for _ in range(6):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert loss_fn().item() < losses[0] - 0.05, losses


# ----------------------------------------------------------------------------- DeepSpeed


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["policy.name=flow", "policy.variant=pi05", "policy.train_expert_only=true",
     "policy.logprob_granularity=action", "learner.gradient_checkpointing=true"],
    ["policy.name=tokens", "policy.logprob_granularity=token"],
    ["policy.name=oft", "learner.gradient_checkpointing=true", "policy.lora_rank=4"],
], ids=["pi05-checkpointing", "tokens", "oft-checkpointing-lora"])
def test_zero3_training_of_each_family(tmp_path, overrides):
    """Every rank learns (colocated), ZeRO-3 shards parameters over the 2 learners: the
    learner's engine(obs, actions) gathers them in forward hooks; weights reach the actors.
    With gradient checkpointing the recomputed layers gather their shards again; with LoRA
    only the adapters and heads have optimizer state. The log-probs each family records as it
    acts are what its learner recomputes before the first update (behaviour weight 1)."""
    from safetensors import safe_open

    from hpcvla.checkpoint import catalog, store
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    overrides = [*overrides, "learner.zero_stage=3", "pipeline.total_updates=2"]
    out, summary, run_dir = run_train(tmp_path, *overrides, config="configs/colocated.yaml",
                                      ranks=2)
    assert "[hpcvla] update 2/2" in out.stdout
    assert summary["staleness_hist"] == {"0": 2 * 2 * 32}
    assert summary["env_steps"] > 0 and summary["success_rate"] is not None
    # every version's acting weights are the ones its learner then scores: behaviour weight 1
    # at update 2 as at 1 (an actor left at version 0 would act with what update 1 changed)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in records if "behaviour_weight_max" in r]
    assert sorted(r["update"] for r in scored) == [1, 1, 2, 2] and all(
        abs(r[f"behaviour_weight_{s}"] - 1) < 1e-3 for r in scored for s in ("max", "mean")), scored
    cfg = load_config(ROOT / "configs/colocated.yaml", overrides)
    start = build_policy(cfg, env_spec(cfg.env))
    trainable = {name for name, p in start.named_parameters() if p.requires_grad}
    path = catalog.latest(run_dir)
    # the optimizer holds the trainable parameters' state (LoRA: adapters and heads), shared
    # by the learners at ZeRO-3 (a 1-element bias on one), and nothing of the frozen ones
    held = []
    for learner in (0, 1):
        with safe_open(str(path / f"optimizer.rank{learner}.safetensors"), "pt") as f:
            held.append({k.rsplit("/", 1)[0] for k in f.keys() if k.endswith("/master")})
    assert held[0] | held[1] == trainable and held[0] and held[1], (len(held[0]), len(held[1]))
    trained, initial = store.load_weights(path), start.state_dict()
    moved = {k for k in trained if not torch.equal(trained[k], initial[k])}
    assert moved and moved <= trainable, sorted(moved - trainable)[:5]


@pytest.mark.mpi
@pytest.mark.slow
def test_a_frozen_prefix_crosses_the_weight_plane_once(tmp_path):
    """π0's usual RL set-up (prefix frozen, ZeRO-3): versions after the first carry only the
    trainable tensors, and inference acts with each new one."""
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    overrides = ["policy.name=flow", "policy.train_expert_only=true"]
    out, summary, _ = run_train(tmp_path, *overrides, "learner.zero_stage=3",
                                "pipeline.total_updates=3", "pipeline.mode=streamer")
    assert "[hpcvla] update 3/3" in out.stdout and "frozen parameters cross once" in out.stdout
    policy = build_policy(load_config(ROOT / "configs/default.yaml", overrides),
                          env_spec(load_config(ROOT / "configs/default.yaml").env))
    frozen = sum(p.nbytes for p in policy.parameters() if not p.requires_grad)
    (learner,) = [r for r in summary["per_rank"] if r["role"] == "learner"]
    sent = learner["weight_bytes"]
    assert frozen > 0 and sent["per_version"] <= sent["first_version"] - frozen
    assert [r["weight_swaps"] for r in summary["per_rank"] if r["role"] == "inference"][0] >= 1


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.bench
def test_policies_benchmark_quick(tmp_path):
    """CI's short run of `hpcvla bench policies`: counts for every preset, times for tiny."""
    out = hpcvla("bench", "policies", "--quick", "--json", tmp_path / "p.json", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "p.json").read_text())["policies"]
    assert set(rows) == {f"{f}/{s}" for f in ("flow", "tokens") for s in ("tiny", "small", "full")}
    for family in ("flow", "tokens"):
        assert rows[f"{family}/tiny"]["act_ms"] > 0 and rows[f"{family}/tiny"]["train_step_ms"] > 0
        assert rows[f"{family}/tiny"]["parameters"] < rows[f"{family}/small"]["parameters"] \
            < rows[f"{family}/full"]["parameters"]
    by_mode = rows["flow/tiny"]["train_step_ms_by_mode"]
    assert set(by_mode) == {"last_step", "chain", "random_step"} and min(by_mode.values()) > 0


@pytest.mark.parametrize("family", ["flow", "tokens", "oft"])
def test_every_size_the_config_offers_is_a_preset_of_each_vla_family(family):
    """Each choice of policy.size builds (counted on the meta device), each larger than the
    one before: a size the config accepts cannot fail only once the ranks have started."""
    from dataclasses import fields
    from hpcvla.config.policy import PolicyConfig
    from hpcvla.policies.registry import count_preset_parameters
    (size,) = [f for f in fields(PolicyConfig) if f.name == "size"]
    counts = [count_preset_parameters(family, choice, SPEC, ACTION_DIM, CHUNK, VOCAB)
              for choice in size.metadata["choices"]]
    assert counts == sorted(set(counts)), counts


def test_runs_start_from_a_pretrained_folder(tmp_path):
    from hpcvla.config import ConfigError, load_config
    from hpcvla.preflight import check_config
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    cfg = load_config(ROOT / "configs/reach_flow.yaml")
    spec = env_spec(cfg.env)
    trained = build_policy(cfg, spec)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))  # weights no random init gives
    save_pretrained(trained, tmp_path / "weights")
    cfg = load_config(ROOT / "configs/reach_flow.yaml", [f"policy.pretrained={tmp_path}/weights"])
    loaded = build_policy(cfg, spec)  # what every rank of such a run starts from
    for (name, a), b in zip(trained.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match="policy.pretrained = .*a folder holding model"):
        check_config(load_config(ROOT / "configs/reach_flow.yaml", [f"policy.pretrained={tmp_path}"]))
    # a folder of another family is refused before any rank starts, naming the family
    with pytest.raises(ConfigError, match="policy.name = 'default': expected flow: the family"):
        check_config(load_config(ROOT / "configs/default.yaml",
                                 [f"policy.pretrained={tmp_path}/weights"]))


@pytest.mark.mpi
@pytest.mark.slow
def test_flow_policy_in_bf16_through_the_whole_pipeline(tmp_path):
    """policy.dtype=bfloat16 end to end on CPU: the weight plane carries bf16 (no numpy round
    trip), the learner trains under DeepSpeed's bf16 mode with fp32 masters, checkpoints hold
    bf16 weights and the fp32 masters; every rank reports the device and dtype it ran."""
    from safetensors import safe_open

    out, summary, run_dir = run_train(tmp_path, "policy.name=flow", "policy.dtype=bfloat16",
                                      "pipeline.total_updates=2", "learner.zero_stage=1",
                                      "learner.checkpoint_every=1", "pipeline.mode=streamer")
    assert "[hpcvla] update 2/2" in out.stdout
    ranks = summary["per_rank"]
    assert {(r["device"], r["dtype"]) for r in ranks} == {("cpu", "bfloat16")}
    assert [r["weight_swaps"] for r in ranks if r["role"] == "inference"][0] >= 1
    (latest,) = [p for p in (run_dir / "checkpoints").iterdir() if p.name == "v000002"]
    with safe_open(latest / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    with safe_open(latest / "optimizer.rank0.safetensors", "pt") as f:
        masters = [k for k in f.keys() if k.endswith("/master")]
        assert masters and {f.get_slice(k).get_dtype() for k in masters} == {"F32"}


def test_a_padded_long_horizon_checkpoint_runs_the_env_chunk(tmp_path):
    """π0's layout: a horizon of 6 actions of 5 (padded) dims, a state padded to 8; the env
    executes its chunk of actions of its dims. The dims come from the checkpoint; the executed
    part is sampled and scored consistently (the log-prob act records is evaluate's)."""
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec, make_env
    from hpcvla.factory import build_policy
    cfg = load_config(ROOT / "configs/reach_flow.yaml", ["env.image_size=32"])
    spec = env_spec(cfg.env)
    state_dim = spec.obs["state"][0][0]
    dims = {"horizon": 6, "action_dim": 5, "state_dim": state_dim + 3}
    padded = make_policy("flow", spec.obs, spec.action_dim, spec.chunk_len, len(spec.vocab),
                         model_dims=dims)
    assert padded.action_in_proj.weight.shape[1] == 5 and padded.log_std.shape == (4, 2)
    save_pretrained(padded, tmp_path / "padded")
    cfg = load_config(ROOT / "configs/reach_flow.yaml", ["env.image_size=32",
                                                        f"policy.pretrained={tmp_path}/padded"])
    policy = build_policy(cfg, spec)  # what every rank of a run starts from
    assert policy.model_horizon == 6 and policy.model_state_dim == state_dim + 3
    env = make_env("reach", 3, 0, image_size=32)
    obs = Policy.obs_to_tensors(env.reset())
    env.close()
    torch.manual_seed(0)
    out = policy.act(obs)
    assert out.actions.shape == (3, spec.chunk_len, spec.action_dim)
    logprob, _, _ = policy.evaluate(obs, out.actions)
    torch.testing.assert_close(logprob, out.logprob, rtol=1e-5, atol=1e-4)


def test_a_padded_chain_is_noisy_and_scored_on_the_executed_entries_only():
    """Chain mode on π0's padded layout (a horizon of 6 actions of 5 dims, the env's 4 x 3
    executed): noise enters the executed entries alone, the rest of each state is the
    deterministic mean; the path's log-prob given x_0 is exact under other weights too, the
    rest recomputed with them (a definition written here with masks), which scoring the
    recorded rest would miss."""
    K, B = 3, 4
    dims = {"horizon": 6, "action_dim": 5, "state_dim": 9}
    policy = make("flow-chain", denoise_steps=K, model_dims=dims)
    obs = make_obs(SPEC, B)
    out, scored = sample(policy, obs)
    start, taken = scored["flow_chain_start"], scored["flow_chain_taken"]
    assert start.shape == (B, 6, 5) and taken.shape == (B, K, CHUNK, ACTION_DIM)
    assert out.actions.shape == (B, CHUNK, ACTION_DIM)
    executed = torch.zeros(6, 5, dtype=torch.bool)
    executed[:CHUNK, :ACTION_DIM] = True
    std = policy.log_std.detach().exp() / K ** 0.5

    def behaviour_chain():  # x_0 .. x_{K-1} as acting made them: the recorded executed
        state = torch.nn.functional.pad(obs["state"], (0, 2))  # entries, the rest the means
        cache, pad, _ = policy._encode(obs)  # of these (behaviour) weights
        states = [start]
        for k in range(K - 1):
            x = states[-1]
            mean = x - policy._velocity(cache, pad, state, x, torch.full((B,), 1 - k / K))[0] / K
            drawn = torch.nn.functional.pad(taken[:, k], (0, 5 - ACTION_DIM, 0, 6 - CHUNK))
            states.append(torch.where(executed, drawn, mean))
        return torch.stack(states, dim=1)
    with torch.no_grad():
        chain = behaviour_chain()

    def path_logprob(rest_from_weights: bool):
        state = torch.nn.functional.pad(obs["state"], (0, 2))
        cache, pad, _ = policy._encode(obs)
        x, total = chain[:, 0], torch.zeros(B)
        for k in range(K):
            velocity, _ = policy._velocity(cache, pad, state, x, torch.full((B,), 1 - k / K))
            mean = x - velocity / K
            taken = out.actions if k == K - 1 else chain[:, k + 1, :CHUNK, :ACTION_DIM]
            total += Normal(mean[:, :CHUNK, :ACTION_DIM], std).log_prob(taken).sum((1, 2))
            if k < K - 1:
                rest = mean if rest_from_weights else chain[:, k + 1]
                x = torch.where(executed, chain[:, k + 1], rest)
        return total

    def means():  # each recorded state's next mean under the policy's weights
        state = torch.nn.functional.pad(obs["state"], (0, 2))
        cache, pad, _ = policy._encode(obs)
        return [chain[:, k] - policy._velocity(cache, pad, state, chain[:, k],
                                               torch.full((B,), 1 - k / K))[0] / K
                for k in range(K)]

    with torch.no_grad():
        for k, mean in enumerate(means()[:-1]):  # the unexecuted entries moved without noise
            torch.testing.assert_close(torch.where(executed, 0, chain[:, k + 1]),
                                       torch.where(executed, 0, mean))
            assert (chain[:, k + 1] - mean)[:, :CHUNK, :ACTION_DIM].abs().min() > 0
        torch.testing.assert_close(out.logprob, path_logprob(True), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(path_logprob(True), path_logprob(False), atol=1e-5,
                                   rtol=1e-6)  # the recorded rest is the behaviour weights'
        for p in policy.action_in_proj.parameters():
            p.add_(0.05 * torch.randn_like(p))
        exact, recorded_rest = path_logprob(True), path_logprob(False)
    assert (exact - recorded_rest).abs().max() > 1e-3  # the rest matters under new weights
    torch.testing.assert_close(policy.evaluate(scored, out.actions)[0].detach(), exact,
                               atol=1e-4, rtol=1e-5)
    # and so does its gradient: through the rest recomputed, as the definition's
    weights = [p for name, p in policy.named_parameters() if name != "log_std"]

    def gradient(logprob):
        grads = torch.autograd.grad(logprob.sum(), weights, allow_unused=True)
        return torch.cat([torch.zeros(w.numel()) if g is None else g.flatten()
                          for w, g in zip(weights, grads)])
    evaluated = gradient(policy.evaluate(scored, out.actions)[0])
    torch.testing.assert_close(evaluated, gradient(path_logprob(True)), atol=1e-4, rtol=1e-4)
    assert (evaluated - gradient(path_logprob(False))).abs().max() > 1e-3


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "random_step"])
def test_noisy_steps_are_recorded_through_the_pipeline(tmp_path, mode):
    """logprob_mode=chain / random_step end to end: the inference rank records with each step
    what evaluate scores (the denoising chain; the noisy step's start, time and draw) through
    segments, ring and dump, and the learner scores it (the log-prob a step recorded is what
    the learner recomputes before its first update: behaviour weight 1)."""
    import h5py

    out, summary, run_dir = run_train(tmp_path, "policy.name=flow", f"policy.logprob_mode={mode}",
                                      "policy.denoise_steps=3", "pipeline.total_updates=2",
                                      "run.dump_trajectories=true", "pipeline.max_staleness=0",
                                      "pipeline.mode=sync-disaggregated")
    assert "[hpcvla] update 2/2" in out.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = [r for r in records if r.get("update") == 1 and "behaviour_weight_max" in r]
    assert first and all(abs(r["behaviour_weight_max"] - 1) < 1e-3 for r in first), first
    (dump,) = (run_dir / "trajectories").glob("rank*.h5")
    recorded = {"chain": {"flow_chain_start": (4, 2), "flow_chain_taken": (3, 4, 2)},
                "random_step": {"flow_step_x": (4, 2), "flow_step_t": (1,),
                                "flow_step_taken": (4, 2)}}[mode]
    with h5py.File(dump) as f:
        demo = f["data"][sorted(f["data"])[0]]
        for name, shape in recorded.items():
            assert demo[f"obs/{name}"].shape[1:] == shape
            assert np.isfinite(demo[f"obs/{name}"][...]).all()
        if mode == "random_step":  # the noisy step's time: 1, 2/3 or 1/3, each drawn
            times = np.concatenate([f["data"][k]["obs/flow_step_t"][:, 0] for k in f["data"]])
            assert set(np.round(times * 3, 4)) == {1.0, 2.0, 3.0}
