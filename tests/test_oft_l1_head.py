"""OpenVLA-OFT's own LIBERO recipe: a checkpoint with its L1-regression action head
(`action_head--*.pt`; tests/fixtures/oft/make_l1_head.py, made by OFT's code) through the
public path (`policy.pretrained`, policy.sequence=official, two images and the proprio
token): its deterministic actions are OFT's `predict_action(..., action_head=...)`; RL samples
a Gaussian around them with a learned std and scores what it sampled; the head trains, and
imitates with OFT's own L1 loss; the folder comes back byte for byte from `hpcvla export`.
What OFT's recipe needs is checked before any rank starts."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpcvla.config import ConfigError
from hpcvla.factory import build_policy
from hpcvla.policies.export import save_like
from test_oft_reference import OFFICIAL_PROPRIO, SAMPLES, config, env_obs, reference_io

FIXTURES = Path(__file__).parent / "fixtures" / "oft"
HEAD = "action_head--100_checkpoint.pt"
# The tiny reference model's float32 rounding (test_oft_reference.py: its logits, ~10 in
# size, to 5e-3, as CPUs round them differently): the hidden states at the action positions
# differ from OFT's by up to 3.5e-4 here, the head's actions (~2) by up to 2.4e-5; the same
# relative room as the logits'. On OFT's own hidden states the head is exact.
ACTION_TOL = 1e-3


@pytest.fixture(scope="module")
def io():
    return reference_io()


@pytest.fixture(scope="module")
def l1_folder(tmp_path_factory):
    """A checkpoint folder as OFT's LIBERO fine-tuning leaves it: checkpoint/ + the head."""
    folder = tmp_path_factory.mktemp("l1") / "checkpoint"
    shutil.copytree(FIXTURES / "checkpoint", folder)
    shutil.copy(FIXTURES / HEAD, folder)
    return folder


def test_the_l1_head_acts_as_ofts_predict_action(io, l1_folder):
    reference = load_file(str(FIXTURES / "l1_io.safetensors"))
    for name, row in SAMPLES.items():
        sample = "libero" if name == "libero" else "raw"
        tasks = None if sample == "libero" else [io["meta"]["tasks"][row]]
        obs, spec = env_obs(io, sample, tasks, wrist=True, state=True)
        obs = {k: v[row:row + 1] if k != "instruction" else v for k, v in obs.items()}
        policy = build_policy(config(l1_folder, **OFFICIAL_PROPRIO), spec).eval()
        assert policy.head == "l1"
        ids = io[f"oft_proprio.{name}.input_ids"]
        pixels = io[f"oft_proprio.{name}.pixel_values"]
        with torch.no_grad():  # the head alone, on OFT's own hidden states: exact
            head = policy.l1_actions(reference[f"l1.{name}.action_hidden_states"][None])
        torch.testing.assert_close(head[0], reference[f"l1.{name}.normalized_actions"],
                                   rtol=0, atol=1e-6)
        _, normalized = policy.predict_action_reference({
            "pixel_values": pixels, "input_ids": ids,
            "prompt_mask": torch.ones_like(ids, dtype=torch.bool),
            "state": io[f"oft_proprio.{name}.proprio_normalized"][None].float()})
        torch.testing.assert_close(normalized[0], reference[f"l1.{name}.normalized_actions"],
                                   rtol=0, atol=ACTION_TOL)
        torch.testing.assert_close(policy.processor.actions_out(normalized[0], {}).double(),
                                   reference[f"l1.{name}.actions"], rtol=0, atol=ACTION_TOL)
        acted = policy.act({**obs, "pixel_values": pixels}, deterministic=True).actions
        torch.testing.assert_close(acted[0].double(), reference[f"l1.{name}.actions"], rtol=0,
                                   atol=ACTION_TOL)


def test_rl_samples_around_the_head_scores_what_it_sampled_and_trains_it(io, l1_folder):
    obs, spec = env_obs(io, wrist=True, state=True)
    policy = build_policy(config(l1_folder, **OFFICIAL_PROPRIO), spec)
    fresh = {k for k in policy.state_dict() if policy.to_hf_key(k).startswith("rl.")}
    assert "log_std" in fresh  # an RL head: absent from OFT's folders, fresh
    torch.manual_seed(0)
    sampled = policy.act(obs)
    mean = policy.act(obs, deterministic=True).actions
    assert (sampled.actions - mean).abs().max() > 1e-3
    logprob, value, entropy = policy.evaluate(obs, sampled.actions)
    torch.testing.assert_close(logprob, sampled.logprob, rtol=0, atol=1e-4)
    assert torch.isfinite(value).all() and torch.isfinite(entropy).all()
    (logprob.mean() + value.pow(2).mean()).backward()
    graded = {n for n, p in policy.named_parameters() if p.grad is not None}
    assert "log_std" in graded and any(n.startswith("action_head.") for n in graded)
    # imitation (`hpcvla sft`): OFT's own fine-tuning loss, L1 on the normalized actions
    real = torch.ones(sampled.actions.shape[:2], dtype=torch.bool)
    real[1, 4:] = False  # past the episode's end
    with torch.no_grad():
        mean = policy.processor.actions_in(policy.act(obs, deterministic=True).actions, obs)
        target = policy.processor.actions_in(sampled.actions, obs)
        expected = torch.cat([(mean - target)[0].abs().flatten(),
                              (mean - target)[1, :4].abs().flatten()]).mean()
        torch.testing.assert_close(policy.imitation_loss(obs, sampled.actions, real), expected,
                                   rtol=1e-5, atol=1e-6)


def test_an_l1_checkpoint_comes_back_byte_for_byte(io, l1_folder, tmp_path):
    obs, spec = env_obs(io, wrist=True, state=True)
    policy = build_policy(config(l1_folder, **OFFICIAL_PROPRIO), spec)
    written = save_like(policy, l1_folder, tmp_path / "out")
    assert written["other_files"] == sorted([HEAD, "proprio_projector--100_checkpoint.pt"])
    assert written["rl_heads_left_out"] == 6  # the value head's 5 tensors and log_std
    for file in l1_folder.iterdir():
        assert (tmp_path / "out" / file.name).read_bytes() == file.read_bytes(), file.name
    with torch.no_grad():  # a trained head is written as the policy holds it, in OFT's keys
        for name, tensor in policy.named_parameters():
            if name.startswith("action_head."):
                tensor.add_(0.01 * torch.randn_like(tensor))
    save_like(policy, l1_folder, tmp_path / "trained")
    source = torch.load(l1_folder / HEAD, weights_only=True)
    head = torch.load(tmp_path / "trained" / HEAD, weights_only=True)
    state = policy.state_dict()
    assert head.keys() == source.keys()
    for key, value in head.items():
        ours = state["action_head." + key.removeprefix("module.")]
        assert value.dtype == source[key].dtype and torch.equal(value, ours.to(value.dtype))
        assert not torch.equal(value, source[key]), key


def test_ofts_recipe_is_checked_before_any_rank(l1_folder, tmp_path):
    """The L1 head needs OFT's sequence, the proprio projector the env's state (and its
    width); a diffusion head and FiLM's vision backbone are refused."""
    with pytest.raises(ConfigError, match="L1-regression action head .* policy.sequence="
                                          "official"):
        config(l1_folder, **{**OFFICIAL_PROPRIO, "policy.sequence": "rlinf"})
    # the proprio projector's state against the env's, before any rank starts
    from hpcvla.config import load_config
    from hpcvla.weight_checks import pretrained_env_problems
    overrides = [f"policy.pretrained={l1_folder}", "env.wrist_image=true", "env.state=true",
                 "policy.sequence=official"]
    cfg = load_config("configs/libero_oft.yaml", overrides + ["env.state_format=quaternion"])
    [(field, value, why)] = pretrained_env_problems(cfg)
    assert (field, value) == ("env", "libero") and "reads a 8-d state, the env gives a 9-d" \
        in why and "axis_angle" in why
    cfg = load_config("configs/libero_oft.yaml", overrides + ["env.state_format=axis_angle"])
    assert pretrained_env_problems(cfg) == []
    diffusion = tmp_path / "diffusion"
    shutil.copytree(l1_folder, diffusion)
    (diffusion / "noisy_action_projector--100_checkpoint.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="diffusion action head"):
        config(diffusion, **OFFICIAL_PROPRIO)
    # fine-tuned with the proprio token, run without it (silently wrong actions)
    with pytest.raises(ConfigError, match="proprio projector .* says it was fine-tuned with "
                                          "the proprio token.*env.state=true"):
        config(l1_folder, **{**OFFICIAL_PROPRIO, "env.state": "false"})
    # OFT's fine-tunes on random crops (its run names say image_aug) need its centre crop:
    # the folder's by default, refused where the config says none
    augmented = tmp_path / "openvla-7b+libero_spatial_no_noops+b16--image_aug--100"
    augmented.symlink_to(l1_folder)
    with pytest.raises(ConfigError, match=r"policy.center_crop = 1.0: expected 0.9 \(or 0: "
                                          r"the folder's\): .* random 90 % crops"):
        config(augmented, **OFFICIAL_PROPRIO, **{"policy.center_crop": 1})
    config(augmented, **OFFICIAL_PROPRIO, **{"policy.center_crop": 0.9})
    config(augmented, **OFFICIAL_PROPRIO)
    film = tmp_path / "film"  # OFT's use_film saves the whole vision backbone apart
    shutil.copytree(l1_folder, film)
    (film / "vision_backbone--100_checkpoint.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="FiLM"):
        config(film, **OFFICIAL_PROPRIO)


def test_a_published_l1_folder_sees_ofts_centre_crop_unless_the_config_says(io, l1_folder):
    """OFT's L1 fine-tunes (its LIBERO checkpoints: random crops in training, the centre crop
    in its evaluation) act on the 0.9 crop where policy.center_crop leaves it to the folder;
    a token-head folder (RLinf's) on the whole image; a value the config gives wins."""
    spec = env_obs(io, wrist=True, state=True)[1]
    crops = [build_policy(config(folder, **OFFICIAL_PROPRIO, **crop), spec).center_crop
             for folder, crop in ((l1_folder, {}), (l1_folder, {"policy.center_crop": 1}),
                                  (l1_folder, {"policy.center_crop": 0.8}))]
    assert crops == [0.9, 1.0, 0.8]
    assert build_policy(config(FIXTURES / "checkpoint"), env_obs(io)[1]).center_crop == 1.0


def test_the_head_is_a_setting_without_a_folder_and_the_folders_own_with_one(l1_folder,
                                                                             tmp_path):
    """policy.action_head: a fresh tiny `oft` with OFT's L1 head (configs/reach_oft_l1.yaml);
    a folder's head is its own, and another named is refused before any rank starts, as is
    the L1 head outside OFT's sequence or a head for a family with one."""
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.policies import save_pretrained
    from hpcvla.preflight import check_config
    cfg = load_config("configs/reach_oft_l1.yaml")
    policy = build_policy(cfg, env_spec(cfg.env))
    assert policy.head == "l1" and policy.log_std.detach().eq(-1.6).all()
    saved = save_pretrained(policy, tmp_path / "saved")
    check_config(load_config("configs/reach_oft_l1.yaml", [f"policy.pretrained={saved}"]))
    with pytest.raises(ConfigError, match="policy.action_head.*l1 \\(the head"):
        check_config(load_config("configs/reach_oft_l1.yaml", [
            f"policy.pretrained={saved}", "policy.action_head=tokens"]))
    assert config(l1_folder, **OFFICIAL_PROPRIO, **{"policy.action_head": "l1"})
    with pytest.raises(ConfigError, match="policy.action_head.*l1 \\(the head"):
        config(l1_folder, **OFFICIAL_PROPRIO, **{"policy.action_head": "tokens"})
    with pytest.raises(ConfigError, match="policy.sequence.*official with policy.action_head"):
        load_config("configs/reach_oft_l1.yaml", ["policy.sequence=rlinf"])
    with pytest.raises(ConfigError, match="policy.action_head.*empty for policy.name=flow"):
        load_config("configs/reach_flow.yaml", ["policy.action_head=l1"])
