"""Published π0/π0.5 folders through the public path: `policy.pretrained=<folder>` and
`policy.tokenizer=<folder>` build the policy as every rank does (roles/pipeline.build_policy),
and from LeRobot's raw observation (camera images, raw state, task string as the env's
instruction ids) the prompt, the normalized state and the unnormalized action chunk are
LeRobot 0.6.1's own (tests/fixtures/pi0, made by its code). Sizes, variant and padded dims come
from the checkpoint; what a folder lacks is refused before any rank starts, by name."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hpcvla.config import ConfigError, load_config
from hpcvla.preflight import check_config
from hpcvla.envs import env_spec
from hpcvla.envs.base import EnvSpec
from hpcvla.text import tokenize, vocab_of
from hpcvla.factory import build_policy
from helpers import hpcvla, libero_fixture_observation, run_train

FIXTURES = Path(__file__).parent / "fixtures" / "pi0"
TOKENIZER = FIXTURES / "tokenizer"
EXECUTED, STEPS = 5, 10  # LeRobot's n_action_steps and denoising steps in the fixtures


def config(folder, tokenizer=TOKENIZER, **extra):
    if Path(folder).name == "openpi":  # its recipe, which openpi's folders do not record:
        # the fixtures' references act absolutely, π0.5 with the state in its prompt
        extra = {"policy.delta_action_dims": 0, **extra}
        if Path(folder).parent.name == "pi05":
            extra = {"policy.pi05_state": "prompt", **extra}
    overrides = [f"policy.pretrained={folder}", f"policy.tokenizer={tokenizer}",
                 f"policy.denoise_steps={STEPS}", "policy.dtype=float32",
                 *(f"{k}={v}" for k, v in extra.items())]
    return check_config(load_config("configs/reach_flow.yaml", overrides))


def raw_observation(io, tasks):
    """LeRobot's raw batch as env fields: HWC images on the 0-255 scale (not square: the
    prefix resizes with padding), the raw 8-d state, the tasks as the env's instruction ids."""
    vocab = vocab_of(tasks)
    length = 24  # words
    obs = {"image": io["raw.observation.images.base_0_rgb"].permute(0, 2, 3, 1) * 255,
           "wrist_image": io["raw.observation.images.left_wrist_0_rgb"].permute(0, 2, 3, 1) * 255,
           "state": io["raw.observation.state"],
           "instruction": torch.from_numpy(
               np.stack([tokenize(t, vocab, length) for t in tasks]))}
    spec = EnvSpec(obs={"image": ((24, 40, 3), "|u1"), "wrist_image": ((24, 40, 3), "|u1"),
                        "state": ((8,), "<f4"), "instruction": ((length,), "<i4")},
                   action_dim=7, chunk_len=EXECUTED, max_episode_chunks=8, vocab=vocab)
    return obs, spec


def fixture(family):
    io = load_file(str(FIXTURES / family / "io.safetensors"))
    with safe_open(str(FIXTURES / family / "io.safetensors"), "pt") as f:
        tasks = json.loads(f.metadata()["fixture"])["tasks"]
    return io, tasks



def test_a_pretrained_build_leaves_the_backbones_init_to_the_folder(monkeypatch):
    """The transformers backbones (SigLIP, Gemma, the expert) skip their random init when a
    folder will overwrite them (π0's 3.2 B parameters take minutes on a node's CPU); the RL
    heads the folder lacks are still drawn from run.seed, the same on every rank."""
    from transformers import PreTrainedModel
    inits = []
    init_weights = PreTrainedModel.init_weights
    monkeypatch.setattr(PreTrainedModel, "init_weights",
                        lambda model: inits.append(type(model).__name__) or init_weights(model))
    io, tasks = fixture("pi0")
    _, spec = raw_observation(io, tasks)
    builds = [build_policy(config(FIXTURES / "pi0" / "lerobot"), spec) for _ in range(2)]
    assert inits == []
    first, second = (b.state_dict() for b in builds)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert torch.isfinite(first["value_head.0.weight"]).all()
    build_policy(load_config("configs/reach_flow.yaml", ["policy.size=tiny"]), spec)
    assert sorted(inits) == ["GemmaModel", "GemmaModel", "SiglipVisionModel"]

@pytest.mark.parametrize("family", ["pi0", "pi05"])
@pytest.mark.parametrize("layout", ["lerobot", "lerobot_sharded", "openpi"])
def test_raw_observation_to_the_reference_action_chunk(family, layout):
    io, tasks = fixture(family)
    obs, spec = raw_observation(io, tasks)
    policy = build_policy(config(FIXTURES / family / layout), spec)
    assert policy.variant == family and policy.model_action_dim == 32
    model = policy.processor.inputs(obs)
    torch.testing.assert_close(model["state"], io["pre.observation.state"], rtol=0, atol=1e-5)
    reference = io["pre.observation.language.tokens"] * io["pre.observation.language.attention_mask"]
    same = [0, 1]  # the samples whose prompt is LeRobot's
    if layout == "openpi" and family == "pi0":  # openpi cleans the task (`_` -> space)
        same = [0]
        text = policy.processor.tokenizer.decode(model["instruction"][1], skip_special_tokens=True)
        assert text == tasks[1].replace("_", " ") + "\n"
    assert torch.equal(model["instruction"][same], reference[same])
    actions = policy.act(obs, deterministic=True).actions  # no exploration noise: x_0 = 0
    torch.testing.assert_close(actions[same],
                               io["sample_zero.actions_unnormalized"][same, :EXECUTED],
                               rtol=0, atol=1e-5)
    # scoring maps the env's actions back to the model's space: the same log-prob
    sampled = policy.act(obs)
    logprob = policy.evaluate(obs, sampled.actions)[0]
    torch.testing.assert_close(logprob, sampled.logprob, rtol=0, atol=1e-3)


@pytest.mark.parametrize("family,layout", [("pi0", "lerobot"), ("pi05", "lerobot"),
                                           ("pi05", "openpi")])
def test_a_dim_the_statistics_hold_constant_is_scored_as_sampled(tmp_path, family, layout):
    """A fine-tuned folder whose data never moved one action dim (q01 = q99, std 0: a
    gripper a pushing task never opens) sends the env that constant whatever the model
    sampled, so the env's units cannot be mapped back: the policy records its chunk in the
    model's space and evaluate scores that one, to act's log-prob. (Mapped back, LeRobot's
    MEAN_STD gives 0, QUANTILES -1, openpi's eps a few percent off.)"""
    from hpcvla.policies.vla import MODEL_ACTIONS
    io, tasks = fixture(family)
    obs, spec = raw_observation(io, tasks)
    folder = tmp_path / family / layout  # config() reads the recipe from these names
    shutil.copytree(FIXTURES / family / layout, folder)
    if layout == "lerobot":
        stats_file = folder / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
        stats = load_file(str(stats_file))
        for name in ("action.std", "action.q01", "action.q99"):
            stats[name][6] = 0.0 if name == "action.std" else 0.5
        save_file(stats, str(stats_file))
    else:
        stats_file = next(folder.glob("assets/*/*/norm_stats.json"))
        stats = json.loads(stats_file.read_text())
        actions = stats["norm_stats"]["actions"]
        actions["std"][6], actions["q01"][6], actions["q99"][6] = 0.0, 0.5, 0.5
        stats_file.write_text(json.dumps(stats))
    policy = build_policy(config(folder, **{"policy.init_log_std": -2}), spec)
    assert MODEL_ACTIONS in policy.extra_fields()
    torch.manual_seed(0)
    out, extras = policy.sample(obs)
    constant = 0.5 if family == "pi05" else float(load_file(str(
        FIXTURES / family / layout / "policy_postprocessor_step_0_unnormalizer_processor"
        ".safetensors"))["action.mean"][6])
    torch.testing.assert_close(out.actions[..., 6], torch.full_like(out.actions[..., 6],
                                                                    constant))
    assert extras[MODEL_ACTIONS][..., 6].std() > 0.05  # what was sampled there varies
    logprob = policy.evaluate({**obs, **extras}, out.actions)[0]
    torch.testing.assert_close(logprob, out.logprob, rtol=0, atol=1e-3)


def test_the_learners_loss_scores_the_recorded_model_space_chunk():
    """Through the learner's `policy_loss` on a published folder's batch: the chunk scored is
    the recorded `model_actions` (the env's units, however wrong, change nothing), and a failed
    env's NaN chunk there leaves the loss and its gradient finite."""
    from hpcvla.algorithms.objective import policy_loss
    io, tasks = fixture("pi0")
    obs, spec = raw_observation(io, tasks)
    cfg = config(FIXTURES / "pi0" / "lerobot")
    policy = build_policy(cfg, spec)
    torch.manual_seed(0)
    with torch.no_grad():
        out, extras = policy.sample(obs)
    batch = {f"obs.{k}": v[None] for k, v in {**obs, **extras}.items()}  # T = 1, N = 2
    batch.update(actions=out.actions[None], logprob=out.logprob[None] - 0.1,
                 value=out.value[None], reward=torch.tensor([[1.0, 0.0]]),
                 done=torch.ones(1, 2, dtype=torch.bool),
                 env_fault=torch.zeros(1, 2, dtype=torch.bool),
                 success=torch.tensor([[True, False]]), bootstrap_value=torch.zeros(2))

    def weight_of(b):  # the smallest behaviour weight: the scored log-prob's, less act's
        policy.zero_grad()
        loss, stats, _ = policy_loss(cfg.algorithm, policy, b)
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all()
                                            for p in policy.parameters() if p.grad is not None)
        return stats["behaviour_weight_min"]
    assert weight_of(batch) == pytest.approx(math.exp(0.1), rel=1e-3)  # scored as sampled
    assert weight_of(dict(batch, actions=batch["actions"] + 5.0)) == \
        pytest.approx(math.exp(0.1), rel=1e-3)
    assert weight_of(dict(batch, **{"obs.model_actions": batch["obs.model_actions"] + 0.5})) \
        < 0.5
    chunk = batch["obs.model_actions"].clone()
    chunk[0, 1] = float("nan")  # a failed env's diverged sample: out of the loss, finite
    assert weight_of(dict(batch, env_fault=torch.tensor([[False, True]]),
                          **{"obs.model_actions": chunk})) == pytest.approx(math.exp(0.1),
                                                                            rel=1e-3)


def test_policy_denoise_from_noise_acts_from_a_drawn_start_in_the_envs_units():
    """policy.denoise_from=noise (openpi's sampler: tests/test_pi0_reference.py) through the
    public path: the chunk is the one from the start noise drawn from the caller's stream,
    unnormalized as the zero start's is."""
    io, tasks = fixture("pi0")
    obs, spec = raw_observation(io, tasks)
    policy = build_policy(config(FIXTURES / "pi0" / "lerobot", **{"policy.denoise_from":
                                                                  "noise"}), spec)
    torch.manual_seed(0)
    actions = policy.act(obs, deterministic=True).actions
    torch.manual_seed(0)
    drawn = torch.randn(2, policy.model_horizon, policy.model_action_dim)
    with torch.no_grad():
        model = policy._sample(policy.processor.inputs(obs), True, x0=drawn)[0]
    torch.testing.assert_close(actions, policy.processor.actions_out(model, obs), rtol=0,
                               atol=1e-6)
    assert not torch.allclose(actions, io["sample_zero.actions_unnormalized"][:, :EXECUTED],
                              atol=1e-3)


@pytest.mark.parametrize("mode", ["chain", "random_step"])
@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_noisy_steps_on_a_published_folder_score_what_they_sampled(family, mode):
    """policy.logprob_mode=chain / random_step on the fixture's padded layout (a horizon of 10
    actions of 32 dims, 5 x 7 executed): what evaluate needs is recorded (chain: its start in
    the model's space and every step's executed draw; random_step: its noisy step's start
    and draw), the executed chunk comes out in the env's units, and evaluate maps it back and scores it to act's
    log-prob (the behaviour weight of a version-0 step is 1)."""
    io, tasks = fixture(family)
    obs, spec = raw_observation(io, tasks)
    policy = build_policy(config(FIXTURES / family / "lerobot", **{
        "policy.logprob_mode": mode, "policy.denoise_steps": 3}), spec)
    torch.manual_seed(0)
    out, extras = policy.sample(obs)
    recorded = {"chain": {"flow_chain_start": (2, 10, 32),
                          "flow_chain_taken": (2, 3, EXECUTED, 7)},
                "random_step": {"flow_step_x": (2, 10, 32), "flow_step_t": (2, 1),
                                "flow_step_taken": (2, EXECUTED, 7)}}[mode]
    recorded["model_actions"] = (2, EXECUTED, 7)  # the executed chunk, as sampled
    assert {k: tuple(v.shape) for k, v in extras.items()} == recorded
    assert out.actions.shape == (2, EXECUTED, 7)
    logprob = policy.evaluate({**obs, **extras}, out.actions)[0]
    torch.testing.assert_close(logprob, out.logprob, rtol=0, atol=1e-3)
    assert torch.isfinite(logprob).all()


def test_sft_supervises_the_checkpoints_whole_action_horizon():
    """openpi and LeRobot fine-tune π0 on every step of its action horizon (10 here), not
    just the chunk the env executes (5): hpcvla sft reads that many demonstrated actions per
    observation (policy.imitation_horizon) and the flow-matching loss covers them all."""
    io, tasks = fixture("pi0")
    obs, spec = raw_observation(io, tasks)
    policy = build_policy(config(FIXTURES / "pi0" / "lerobot"), spec)
    assert (policy.imitation_horizon, policy.chunk_len) == (10, EXECUTED)
    actions = torch.rand(2, 10, 7) * 2 - 1
    real = torch.ones(2, 10, dtype=torch.bool)

    def loss(acts, mask):
        torch.manual_seed(0)  # the same noise and time
        with torch.no_grad():
            return float(policy.imitation_loss(obs, acts, mask))
    later = actions.clone()
    later[:, EXECUTED:] += 0.5  # the steps after the executed chunk
    assert loss(later, real) != pytest.approx(loss(actions, real), rel=1e-3)


def test_a_pi05_folder_lerobot_0_4_wrote_pads_its_prompts_state_once_told():
    """LeRobot 0.4.0-0.4.4 zero-padded π0.5's normalized state to max_state_dim (32) before
    discretizing it into the prompt; 0.5.0 stopped and writes the same files. A folder from
    before 0.5.1 (no relative_actions_processor step) is refused until policy.pi05_state says
    which; `prompt_padded` gives the tokens LeRobot 0.4.4's own preprocessor gave
    (pi05/lerobot04, make_lerobot04.py), `prompt` LeRobot 0.6.1's; a 0.5.1+ folder and an
    openpi one refuse `prompt_padded`."""
    folder = FIXTURES / "pi05" / "lerobot04"
    reference = load_file(str(folder / "reference.safetensors"))
    io, tasks = fixture("pi05")
    obs, spec = raw_observation(io, tasks)
    with pytest.raises(ConfigError, match=r"policy.pi05_state = 'folder': expected "
                                          r"prompt_padded if LeRobot 0.4 wrote"):
        config(folder)
    padded = build_policy(config(folder, **{"policy.pi05_state": "prompt_padded"}), spec)
    model = padded.processor.inputs(obs)
    torch.testing.assert_close(model["state"], reference["state"], rtol=0, atol=1e-5)
    assert torch.equal(model["instruction"], reference["tokens"] * reference["attention_mask"])
    unpadded = build_policy(config(folder, **{"policy.pi05_state": "prompt"}), spec)
    assert torch.equal(unpadded.processor.inputs(obs)["instruction"],
                       io["pre.observation.language.tokens"] *
                       io["pre.observation.language.attention_mask"])
    for recent, said in ((FIXTURES / "pi05" / "lerobot", "folder: LeRobot 0.5.1 or later"),
                         (FIXTURES / "pi05" / "openpi", "prompt or none")):
        with pytest.raises(ConfigError, match=rf"'prompt_padded': expected {said}"):
            config(recent, **{"policy.pi05_state": "prompt_padded"})


def test_a_lerobot_folder_whose_first_camera_is_a_wrist_sees_the_wrist_first(tmp_path):
    """LeRobot feeds a folder's cameras in its config.json `input_features` order. The
    reference chunk was made with base_0_rgb first; with the wrist camera listed first, the
    same chunk comes from an env whose wrist camera sees what base_0_rgb saw and whose
    third-person camera what the wrist saw (the model's tokens in the same order)."""
    io, tasks = fixture("pi0")
    obs, spec = raw_observation(io, tasks)
    folder = tmp_path / "lerobot"
    shutil.copytree(FIXTURES / "pi0" / "lerobot", folder)
    written = json.loads((folder / "config.json").read_text())
    features = written["input_features"]
    wrist = "observation.images.left_wrist_0_rgb"
    written["input_features"] = {wrist: features[wrist],
                                 **{k: v for k, v in features.items() if k != wrist}}
    (folder / "config.json").write_text(json.dumps(written))
    policy = build_policy(config(folder), spec)
    swapped = dict(obs, image=obs["wrist_image"], wrist_image=obs["image"])
    torch.testing.assert_close(policy.act(swapped, deterministic=True).actions,
                               io["sample_zero.actions_unnormalized"][:, :EXECUTED],
                               rtol=0, atol=1e-5)
    assert not build_policy(config(FIXTURES / "pi0" / "lerobot"), spec).processor.wrist_first


@pytest.mark.parametrize("layout,steps", [("lerobot", 0), ("openpi", 0), ("lerobot", 6)])
def test_the_sampler_steps_are_the_folders_unless_the_config_sets_them(layout, steps):
    """LeRobot records num_inference_steps in config.json; openpi samples with 10 and does not
    record it; policy.denoise_steps > 0 is the user's choice and wins."""
    io, tasks = fixture("pi0")
    _, spec = raw_observation(io, tasks)
    policy = build_policy(config(FIXTURES / "pi0" / layout, **{"policy.denoise_steps": steps}),
                          spec)
    assert policy.denoise_steps == (steps or STEPS)


def test_sizes_come_from_the_checkpoint():
    """Whatever policy.size a config file says (typed with a folder it is refused: test_config)."""
    io, tasks = fixture("pi0")
    _, spec = raw_observation(io, tasks)
    cfg = config(FIXTURES / "pi0" / "lerobot_tied")
    cfg.policy.size = "full"  # as a config file may set it
    policy = build_policy(cfg, spec)
    summary = json.loads((FIXTURES / "pi0" / "summary.json").read_text())["tiny_dims"]
    assert policy.prefix.vision_config.hidden_size == summary["vision"]["hidden_size"]
    assert policy.prefix.text_config.hidden_size == summary["vlm"]["width"]
    assert policy.expert_config.intermediate_size == summary["expert"]["mlp_dim"]
    assert policy.prefix.text_config.vocab_size == summary["vocab_size"]


@pytest.mark.parametrize("base,tokens,rows,fits", [
    (257152, 257153, 257152, True),   # PaliGemma's tokenizer (`<image>` added), LeRobot's π0
    (257152, 257153, 257216, True),   # Hugging Face's PaliGemma pads its embedding
    (320, 320, 320, True),            # the fixtures
    (32000, 32001, 257152, False),    # OFT's Llama tokenizer for π0
    (257152, 257153, 32064, False)])  # PaliGemma's for a Llama embedding
def test_a_tokenizer_fits_its_embedding_up_to_added_tokens_and_padding(base, tokens, rows,
                                                                        fits):
    from hpcvla.policies.processor import _vocabulary_fits
    tokenizer = type("Tokenizer", (), {"vocab_size": base, "__len__": lambda self: tokens})()
    assert _vocabulary_fits(tokenizer, rows) is fits


def test_missing_tokenizer_or_statistics_are_refused_by_name(tmp_path):
    folder = FIXTURES / "pi0" / "lerobot"
    with pytest.raises(ConfigError) as err:
        config(folder, tokenizer="")
    assert "policy.tokenizer" in str(err.value) and "paligemma" in str(err.value)
    with pytest.raises(ConfigError) as err:
        config(folder, tokenizer=tmp_path)
    assert "policy.tokenizer" in str(err.value) and "tokenizer.json" in str(err.value)
    # another model's tokenizer (OFT's Llama, its folder asking to run custom code): every
    # prompt would be encoded with ids of another vocabulary
    with pytest.raises(ConfigError) as err:
        config(folder, tokenizer=Path(__file__).parent / "fixtures" / "oft" / "checkpoint")
    assert "policy.tokenizer" in str(err.value) and "has 32001 tokens, the checkpoint's " \
        "embedding 320" in str(err.value), str(err.value)
    oft = Path(__file__).parent / "fixtures" / "oft" / "checkpoint"  # another family's folder
    with pytest.raises(ConfigError) as err:  # (a KeyError's text of a missing tensor said it)
        config(oft)
    assert f"policy.name = 'flow': expected oft: {oft} is a published oft folder" in \
        str(err.value), str(err.value)
    bare = tmp_path / "bare"
    shutil.copytree(FIXTURES / "pi0" / "openpi", bare)
    shutil.rmtree(bare / "assets")
    with pytest.raises(ConfigError) as err:
        config(bare)
    assert "policy.pretrained" in str(err.value) and "norm_stats.json" in str(err.value)
    lerobot = tmp_path / "lerobot"
    shutil.copytree(folder, lerobot)
    for lost in ("policy_postprocessor.json", "policy_preprocessor.json"):
        (lerobot / lost).rename(lerobot / f"{lost}.away")  # either one: still LeRobot's,
        with pytest.raises(ConfigError) as err:  # not an openpi folder's norm_stats.json
            config(lerobot)
        assert f"{lost} is missing" in str(err.value) and "norm_stats" not in str(err.value)
        (lerobot / f"{lost}.away").rename(lerobot / lost)
    # LeRobot before 0.4 kept the statistics as buffers in the weights (the names its
    # migrate_policy_normalization reads): that command is named
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(folder / "config.json", old)
    tensors = load_file(str(folder / "model.safetensors"))
    for buffer, dims in (("normalize_inputs.buffer_observation_state", 8),
                         ("normalize_targets.buffer_action", 7),
                         ("unnormalize_outputs.buffer_action", 7)):
        tensors.update({f"{buffer}.mean": torch.zeros(dims), f"{buffer}.std": torch.ones(dims)})
    save_file(tensors, str(old / "model.safetensors"))
    with pytest.raises(ConfigError) as err:
        config(old)
    assert "policy.pretrained" in str(err.value) and \
        "lerobot.processor.migrate_policy_normalization" in str(err.value)
    # openpi's JAX checkpoints (orbax params/, as openpi's training writes them): its
    # converter is named
    jax = tmp_path / "jax"
    (jax / "params").mkdir(parents=True)
    for marker in ("_CHECKPOINT_METADATA", "params/_METADATA", "params/manifest.ocdbt"):
        (jax / marker).write_text("{}")
    shutil.copytree(FIXTURES / "pi0" / "openpi" / "assets", jax / "assets")
    for pointed in (jax, jax / "params"):
        with pytest.raises(ConfigError) as err:
            config(pointed)
        assert "policy.pretrained" in str(err.value) and \
            "convert_jax_model_to_pytorch.py" in str(err.value)


@pytest.mark.parametrize("layout", ["lerobot", "openpi"])
def test_env_dims_other_than_the_checkpoints_are_refused_naming_which(layout):
    """The folders were trained on a 7-d action and an 8-d state (LeRobot's config.json
    features; openpi's statistics): the model pads either to 32, so a smaller env would run
    silently on dims that mean something else."""
    io, tasks = fixture("pi0")
    _, spec = raw_observation(io, tasks)
    cfg = config(FIXTURES / "pi0" / layout)
    fewer_actions = EnvSpec(**{**spec.__dict__, "action_dim": 6})
    with pytest.raises(ValueError, match="acts in 7 dims, the env takes 6-d actions"):
        build_policy(cfg, fewer_actions)
    more_state = EnvSpec(**{**spec.__dict__, "obs": {**spec.obs, "state": ((9,), "<f4")}})
    with pytest.raises(ValueError, match="reads a 8-d state, the env gives a 9-d one"):
        build_policy(cfg, more_state)


@pytest.mark.parametrize("variant", ["finetuned", "relative", "steps6"])
def test_folders_as_users_fine_tune_them_act_as_lerobot_does(variant):
    """LeRobot-made folders (tests/fixtures/pi0/make_variants.py): one LeRobot training step
    (embed_tokens and lm_head saved untied), relative actions (the gripper kept absolute by
    LeRobot's default exclude_joints), a 6-step sampler. Through `policy.pretrained` with
    the folder's own sampler, the deterministic chunk is LeRobot's, in env units; scoring
    maps the env's actions back (the same log-prob)."""
    io, tasks = fixture("pi0")
    obs, spec = raw_observation(io, tasks)
    folder = FIXTURES / "variants" / variant
    policy = build_policy(config(folder, **{"policy.denoise_steps": 0}), spec)
    assert policy.denoise_steps == (6 if variant == "steps6" else STEPS)
    reference = load_file(str(FIXTURES / "variants" / "io.safetensors"))
    torch.testing.assert_close(obs["state"], reference["raw.observation.state"])
    actions = policy.act(obs, deterministic=True).actions
    torch.testing.assert_close(actions, reference[f"{variant}.actions"][:, :EXECUTED],
                               rtol=0, atol=1e-5)
    sampled = policy.act(obs)
    torch.testing.assert_close(policy.evaluate(obs, sampled.actions)[0], sampled.logprob,
                               rtol=0, atol=1e-3)
    if variant == "relative":  # taken as absolute, the chunk is off by the state
        absolute = build_policy(config(folder, **{"policy.delta_action_dims": 0}), spec)
        off = absolute.act(obs, deterministic=True).actions - actions
        torch.testing.assert_close(off[..., :6], -obs["state"][:, None, :6].expand_as(off[..., :6]),
                                   rtol=0, atol=1e-5)
        assert off[..., 6].abs().max() < 1e-5  # the gripper is absolute


def test_openpi_delta_actions_are_relative_to_the_state_in_their_first_dims():
    """openpi's extra_delta_transform (not recorded in its folders) as policy.delta_action_dims:
    openpi's AbsoluteActions adds the raw state to the first N unnormalized action dims of
    every step of the chunk; scoring takes it off again (the same log-prob)."""
    io, tasks = fixture("pi0")
    obs, spec = raw_observation(io, tasks)
    folder = FIXTURES / "pi0" / "openpi"
    absolute = build_policy(config(folder), spec).act(obs, deterministic=True).actions
    policy = build_policy(config(folder, **{"policy.delta_action_dims": 6}), spec)
    relative = policy.act(obs, deterministic=True).actions
    expected = absolute.clone()
    expected[..., :6] += obs["state"][:, None, :6]
    torch.testing.assert_close(relative, expected, rtol=0, atol=1e-5)
    sampled = policy.act(obs)
    torch.testing.assert_close(policy.evaluate(obs, sampled.actions)[0], sampled.logprob,
                               rtol=0, atol=1e-3)
    with pytest.raises(ConfigError, match="policy.delta_action_dims"):
        check_config(load_config("configs/reach_flow.yaml", ["policy.delta_action_dims=6"]))


def test_a_libero_env_the_checkpoint_does_not_fit_is_refused_before_any_rank():
    """configs/libero_pi0.yaml with LIBERO's 9-d quaternion state: the launcher refuses it,
    naming the env and the state format the checkpoint needs."""
    from hpcvla.weight_checks import pretrained_env_problems
    cfg = load_config("configs/libero_pi0.yaml", ["env.state_format=quaternion"])
    [(field, value, why)] = pretrained_env_problems(cfg)
    assert (field, value) == ("env", "libero")
    assert "reads a 8-d state, the env gives a 9-d one" in why and "axis_angle" in why
    # (the config as it is passes: test_libero_training_starts_from_the_checkpoint launches it)


def test_a_siglip_width_the_loader_cannot_read_is_refused_before_any_rank(tmp_path):
    folder = tmp_path / "lerobot"
    shutil.copytree(FIXTURES / "pi0" / "lerobot", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    patch = "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model." \
        "embeddings.patch_embedding.weight"
    tensors[patch] = torch.zeros(40, 3, 8, 8)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ConfigError) as err:
        config(folder)
    assert "policy.pretrained" in str(err.value) and "SigLIP tower is 40 wide" in str(err.value)


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_libero_first_action_is_the_references(family):
    """The first action for LIBERO's observation (libero_spatial task 0, fixed state 0, as
    the env renders it: tests/fixtures/pi0/export_libero_obs.py) is the unnormalized chunk
    LeRobot computed for it, through configs/libero_<family>.yaml's policy."""
    cfg = load_config(f"configs/libero_{family}.yaml", ["policy.dtype=float32"])
    spec = env_spec(cfg.env)
    obs, exported = libero_fixture_observation(cfg)
    np.testing.assert_allclose(obs["state"], exported["state"], atol=1e-5)
    for camera in ("image", "wrist_image"):  # OpenGL drivers may differ in a few pixels
        assert (obs[camera] != exported[camera]).mean() < 0.02
    exported["instruction"] = obs["instruction"]
    policy = build_policy(cfg, spec)
    actions = policy.act({k: torch.from_numpy(v) for k, v in exported.items()},
                         deterministic=True).actions
    io = load_file(str(FIXTURES / family / "io.safetensors"))
    assert cfg.env.chunk_len == EXECUTED
    torch.testing.assert_close(actions, io["libero.actions_unnormalized"][:, :EXECUTED],
                               rtol=0, atol=1e-5)


@pytest.mark.mpi
@pytest.mark.slow
def test_libero_training_starts_from_the_checkpoint(tmp_path):
    """`hpcvla train` on LIBERO from the π0 fixture with its tokenizer and statistics: the
    first actions sent to the simulators are the pretrained policy's (their recorded log-probs
    are its log-probs at version 0), it trains, and `hpcvla export` writes the trained one in
    the folder's layout. (A trained VLA run evaluated on LIBERO: tests/test_oft_training.py;
    the π0 fixture under LIBERO's protocol: tests/test_eval_job.py.)"""
    import h5py

    out, _, run_dir = run_train(
        tmp_path, "pipeline.total_updates=2", "env.max_episode_chunks=2",
        "rollout.segment_len=2", "run.dump_trajectories=true", "pipeline.max_staleness=0",
        "pipeline.mode=sync-disaggregated", config="configs/libero_pi0.yaml")
    assert "[hpcvla] update 2/2" in out.stdout
    cfg = load_config(run_dir / "config.yaml")
    policy = build_policy(cfg, env_spec(cfg.env)).eval()
    assert policy.processor is not None and policy.variant == "pi0"
    dumps = sorted((run_dir / "trajectories").glob("rank*.h5"))
    with h5py.File(dumps[0]) as f:
        demo = f["data"][sorted(f["data"])[0]]
        assert demo.attrs["policy_version"] == 0
        obs = {k: torch.from_numpy(demo["obs"][k][:1]) for k in demo["obs"]}
        actions = torch.from_numpy(demo["actions"][:1])
        recorded = float(demo["logprobs"][0])
    assert obs["state"].shape == (1, 8)  # the axis-angle state π0's statistics expect
    with torch.no_grad():
        logprob = float(policy.evaluate(obs, actions)[0])
    assert abs(logprob - recorded) < 1e-3 * max(1.0, abs(recorded)), (logprob, recorded)
    # exported in the layout it came from (tests/test_export.py: LeRobot reads such folders):
    # the source's files, the trained weights, the RL heads left out
    out = hpcvla("export", run_dir, tmp_path / "exported")
    assert out.returncode == 0 and "the layout of" in out.stdout, out.stdout + out.stderr
    source = Path(cfg.policy.pretrained)
    assert sorted(p.name for p in (tmp_path / "exported").iterdir()) == sorted(
        p.name for p in source.iterdir())
    from hpcvla.evaluate import checkpoint_weights
    from hpcvla.policies.folders import rl_only_names
    # it trains: tensors beyond the RL heads moved, and only trainable ones
    start, trained = policy.state_dict(), checkpoint_weights(run_dir)[0]
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    moved = {k for k in trained if not torch.equal(trained[k], start[k])}
    assert moved - set(rl_only_names(policy)) and moved <= trainable, sorted(moved)[:5]
    policy.load_arrays(trained)
    exported = build_policy(load_config(run_dir / "config.yaml", [
        f"policy.pretrained={tmp_path / 'exported'}"]), env_spec(cfg.env))
    heads = rl_only_names(policy)
    assert heads and all(torch.equal(v, policy.state_dict()[k])
                         for k, v in exported.state_dict().items() if k not in heads)


def test_what_openpi_folders_do_not_record_must_be_said(tmp_path):
    """openpi's folders record neither its extra_delta_transform nor π0.5's
    discrete_state_input, nor (its train_pytorch.py checkpoints) the horizon: each is refused
    before any rank starts, naming the setting and openpi's LIBERO values, never guessed."""
    def refused(folder, **extra):
        with pytest.raises(ConfigError) as err:
            check_config(load_config("configs/reach_flow.yaml", [
                f"policy.pretrained={folder}", f"policy.tokenizer={TOKENIZER}",
                *(f"{k}={v}" for k, v in extra.items())]))
        return str(err.value)
    said = refused(FIXTURES / "pi05" / "openpi")
    assert "policy.delta_action_dims = -1" in said and "6 for openpi's pi0_libero" in said
    assert "policy.pi05_state = 'folder'" in said and "none for openpi's pi05_libero" in said
    said = refused(FIXTURES / "pi0" / "openpi")
    assert "policy.delta_action_dims" in said and "pi05_state" not in said
    # a π0 checkpoint has no state prompt; LeRobot's folders record it all
    assert "policy.pi05_state = 'none'" in refused(FIXTURES / "pi0" / "lerobot",
                                                 **{"policy.pi05_state": "none"})
    config(FIXTURES / "pi05" / "lerobot")
    # openpi's training checkpoints: no config.json, so no horizon (π0's action tokens
    # attend to each other: the env's chunk would change every action)
    trained = tmp_path / "30000"
    shutil.copytree(FIXTURES / "pi05" / "openpi", trained)
    (trained / "config.json").unlink()
    said = refused(trained, **{"policy.delta_action_dims": 0, "policy.pi05_state": "none"})
    assert "policy.pretrained" in said and "action_horizon" in said
    (trained / "config.json").write_text('{"action_horizon": 10}')
    policy = build_policy(config(trained, **{"policy.pi05_state": "none",
                                             "policy.denoise_steps": 0,
                                             "policy.delta_action_dims": 0}),
                          raw_observation(*fixture("pi05"))[1])
    assert (policy.model_horizon, policy.denoise_steps) == (10, 10)  # openpi samples with 10


def test_pi05_trained_without_the_state_in_its_prompt_reads_openpis_pi0_prompt():
    """openpi's pi05_libero (discrete_state_input=False, policy.pi05_state=none): the prompt
    is the cleaned task and "\\n" (openpi's PaligemmaTokenizer without a state), and the
    state is not needed; with `prompt`, the state's bins are in it."""
    io, tasks = fixture("pi05")
    obs, spec = raw_observation(io, tasks)
    folder = FIXTURES / "pi05" / "openpi"
    decode = lambda policy: [policy.processor.tokenizer.decode(row, skip_special_tokens=True)
                             for row in policy.processor.inputs(obs)["instruction"]]
    task_only = build_policy(config(folder, **{"policy.pi05_state": "none"}), spec)
    assert decode(task_only) == [t.strip().replace("_", " ") + "\n" for t in tasks]
    with_state = decode(build_policy(config(folder), spec))
    assert all(text.startswith("Task: ") and ", State: " in text for text in with_state)
    stateless = EnvSpec(**{**spec.__dict__,
                           "obs": {k: v for k, v in spec.obs.items() if k != "state"}})
    build_policy(config(folder, **{"policy.pi05_state": "none"}), stateless)
    with pytest.raises(ValueError, match="reads a 8-d state, the env gives none"):
        build_policy(config(folder), stateless)


def test_quantile10_normalization_is_quantiles_on_the_10th_and_90th(tmp_path):
    """LeRobot's QUANTILE10 (>= 0.4) is QUANTILES' formula on q10/q90: the π0.5 fixture with
    its q01/q99 written as q10/q90 and the mode renamed acts exactly as the original."""
    io, tasks = fixture("pi05")
    obs, spec = raw_observation(io, tasks)
    source, folder = FIXTURES / "pi05" / "lerobot", tmp_path / "q10"
    shutil.copytree(source, folder)
    for name in ("policy_preprocessor.json", "policy_postprocessor.json"):
        text = (folder / name).read_text()
        assert '"QUANTILES"' in text or name == "policy_postprocessor.json"
        (folder / name).write_text(text.replace('"QUANTILES"', '"QUANTILE10"'))
    for stats in folder.glob("*processor.safetensors"):
        tensors = load_file(str(stats))
        renamed = {k.replace(".q01", ".q10").replace(".q99", ".q90"): v
                   for k, v in tensors.items() if k.endswith((".q01", ".q99"))}
        save_file({k: v for k, v in tensors.items() if not k.endswith((".q01", ".q99", ".q10",
                                                                       ".q90"))} | renamed,
                  str(stats))
    expected = build_policy(config(source), spec).act(obs, deterministic=True).actions
    actions = build_policy(config(folder), spec).act(obs, deterministic=True).actions
    torch.testing.assert_close(actions, expected, rtol=0, atol=0)


@pytest.mark.parametrize("files,named", [
    (["config.json", "adapter_config.json", "adapter_model.safetensors"], "merge_and_unload"),
    (["lora_adapter/adapter_config.json", "dataset_statistics.json"],
     "merge_lora_weights_and_save.py"),
    (["pretrained_model/config.json", "training_state/training_step.json"],
     "its pretrained_model/"),
    (["pytorch_model_fsdp_0/__0_0.distcp"], "lerobot-convert-dcp"),
    (["actor/model_state_dict/full_weights.pt"], "convert_pt_to_hf"),
    (["config.json", "pytorch_model.bin"], "safe_serialization=True"),
    (["5000/params/_METADATA", "5000/_CHECKPOINT_METADATA"], "choose a step's folder"),
    # RLinf's unmerged LoRA: its base's index without the shards, beside the adapter
    (["model.safetensors.index.json", "adapter_config.json"], "merge_and_unload")])
def test_the_references_other_layouts_are_refused_naming_what_converts_them(tmp_path, files,
                                                                            named):
    """Folders the references write that hold no weights this project reads (adapters,
    training checkpoints, DCP shards, pickles, orbax steps): refused before any rank
    starts, naming the reference's own step that makes one."""
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(
            '{"weight_map": {"a": "model-00001-of-00002.safetensors"}}' if "index" in name
            else "{}")
    with pytest.raises(ConfigError) as err:
        config(tmp_path, **{"policy.delta_action_dims": 0})
    assert "policy.pretrained" in str(err.value) and named in str(err.value), str(err.value)


def test_an_openpi_lora_fine_tune_its_converter_wrote_without_adapters_is_refused(tmp_path):
    """openpi's converter writes a LoRA fine-tune's base kernels alone (strict=False) and
    records the variant in config.json: such a folder is the base model's weights, refused
    before any rank starts with how to merge; the same folder with the variants merged runs."""
    lora = tmp_path / "openpi"
    shutil.copytree(FIXTURES / "pi0" / "openpi", lora)
    written = json.loads((lora / "config.json").read_text())
    (lora / "config.json").write_text(json.dumps({**written, "paligemma_variant": "gemma_2b_lora",
                                                  "action_expert_variant": "gemma_300m_lora"}))
    with pytest.raises(ConfigError, match=r"paligemma_variant='gemma_2b_lora', action_expert_var"
                                          r"iant='gemma_300m_lora': an openpi LoRA fine-tune.*"
                                          r"Merge the LoRA weights"):
        config(lora)
    (lora / "config.json").write_text(json.dumps(written))
    config(lora)


def test_an_openpi_folder_with_several_robots_statistics_reads_the_asset_id_named(tmp_path):
    """openpi's base checkpoints ship assets/<id>/norm_stats.json for each robot of their
    mixture: without policy.asset_id the folder is refused naming its ids and the setting;
    with it the policy normalizes with that robot's statistics; an id the folder lacks, and
    an asset_id for a LeRobot folder (processor files) or a built-in policy, are refused."""
    folder = tmp_path / "openpi"
    shutil.copytree(FIXTURES / "pi0" / "openpi", folder)
    libero = folder / "assets" / "physical-intelligence" / "libero" / "norm_stats.json"
    franka = json.loads(libero.read_text())
    for stats in franka["norm_stats"].values():
        stats["mean"] = [m + 1.0 for m in stats["mean"]]
    (folder / "assets" / "franka").mkdir()
    (folder / "assets" / "franka" / "norm_stats.json").write_text(json.dumps(franka))
    with pytest.raises(ConfigError, match=r"policy.asset_id = '': expected one of \['franka', "
                                          r"'physical-intelligence/libero'\]: .* 2 sets of "
                                          r"normalization statistics.*policy.asset_id=franka"):
        config(folder)
    with pytest.raises(ConfigError, match=r"policy.asset_id = 'droid': expected an asset id of "
                                          r".*no assets/droid/norm_stats.json"):
        config(folder, **{"policy.asset_id": "droid"})
    spec = raw_observation(*fixture("pi0"))[1]
    offsets = {}
    for asset in ("franka", "physical-intelligence/libero"):
        policy = build_policy(config(folder, **{"policy.asset_id": asset}), spec)
        offsets[asset] = policy.processor.action.offset
    torch.testing.assert_close(offsets["franka"], offsets["physical-intelligence/libero"] + 1.0)
    lerobot = r"policy.asset_id = 'franka': expected empty for a LeRobot folder"
    with pytest.raises(ConfigError, match=lerobot):
        config(FIXTURES / "pi0" / "lerobot", **{"policy.asset_id": "franka"})
    with pytest.raises(ConfigError, match=r"policy.asset_id = 'franka': expected empty unless "
                                          r"policy.name=flow"):
        check_config(load_config("configs/default.yaml", ["policy.asset_id=franka"]))


def test_lerobot_folders_of_another_kind_or_before_its_openpi_port_are_refused(tmp_path):
    """A LeRobot policy of another type, and a π0 of LeRobot before 0.4 (its PaliGemma named
    as transformers < 4.52 did; migrating its statistics leaves the names), are refused
    before any rank starts, saying so (were: a bare KeyError)."""
    other = tmp_path / "smolvla"
    shutil.copytree(FIXTURES / "pi0" / "lerobot", other)
    config_json = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config_json, "type": "smolvla"}))
    with pytest.raises(ConfigError, match="type is 'smolvla': a LeRobot policy of another"):
        config(other)
    old = tmp_path / "lerobot03"
    shutil.copytree(FIXTURES / "pi0" / "lerobot", old)
    tensors = load_file(str(old / "model.safetensors"))
    new, before = ".paligemma.model.language_model.", ".paligemma.language_model.model."
    save_file({k.replace(new, before): v for k, v in tensors.items()},
              str(old / "model.safetensors"))
    with pytest.raises(ConfigError, match="transformers < 4.52.*LeRobot before 0.4"):
        config(old)


@pytest.mark.mpi
def test_plan_names_what_is_wrong_with_the_folder(tmp_path):
    """`hpcvla plan` sizes the policy from the folder's headers: a folder it cannot read is
    the same config error as for `train`, not a traceback."""
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    out = hpcvla("plan", "configs/reach_flow.yaml", "--world", 3,
                 f"policy.pretrained={tmp_path}", f"policy.tokenizer={TOKENIZER}")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "policy.pretrained" in out.stderr and "safe_serialization=True" in out.stderr


def test_a_folder_with_tensors_the_policy_lacks_is_refused_before_any_rank(tmp_path):
    """A published folder holding a tensor the policy has no module for (RLinf's π0 after RL
    keeps its value and noise heads) is named from its headers, against a meta-device build,
    by the launching process (was: by every rank, after the start); LoRA's adapters, which go
    on after the folder is loaded, are no mismatch."""
    from hpcvla.weight_checks import weights_fit_problems
    folder = tmp_path / "rlinf"
    shutil.copytree(FIXTURES / "pi0" / "lerobot", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "model.noise_head.mlp.0.weight": torch.zeros(4, 4)},
              str(folder / "model.safetensors"))
    [(field, value, why)] = weights_fit_problems(config(folder))
    assert field == "policy.pretrained" and "unexpected" in why and "noise_head" in why, why
    assert "save the folder without them" in why
    assert weights_fit_problems(config(FIXTURES / "pi0" / "lerobot",
                                       **{"policy.lora_rank": 4})) == []


def test_recipe_settings_for_a_folder_hpcvla_wrote_are_refused(tmp_path):
    """A folder `save_pretrained` wrote (an `hpcvla sft` policy/) reads the env's fields as
    they are: policy.delta_action_dims and policy.pi05_state would be ignored, so they are
    refused (were accepted and ignored)."""
    from hpcvla.envs import env_spec
    from hpcvla.policies import save_pretrained
    cfg = load_config("configs/reach_flow.yaml")
    saved = save_pretrained(build_policy(cfg, env_spec(cfg.env)), tmp_path / "policy")
    check_config(load_config("configs/reach_flow.yaml", [f"policy.pretrained={saved}"]))
    for setting in ("policy.delta_action_dims=6", "policy.pi05_state=none"):
        with pytest.raises(ConfigError, match="for a folder hpcvla wrote"):
            check_config(load_config("configs/reach_flow.yaml",
                                     [f"policy.pretrained={saved}", setting]))


def test_a_rank_that_takes_its_weights_from_the_plane_reads_none(monkeypatch):
    """An inference or evaluator rank of a training world gets every tensor from the weight
    plane's first version (whole): build_policy(load=False) builds the structure (from the
    folder's headers) and the folder's processor without reading its weights (the reads
    counted), 6.5 GB less read per such rank of π0 at start; load=True reads them."""
    from hpcvla.policies import folders
    reads = []
    real = folders.read_tensors
    monkeypatch.setattr(folders, "read_tensors", lambda *a, **k: reads.append(a) or real(*a, **k))
    cfg = config(FIXTURES / "pi0" / "lerobot")
    _, spec = raw_observation(*fixture("pi0"))
    policy = build_policy(cfg, spec, load=False)
    assert reads == [] and policy.processor is not None
    whole = build_policy(cfg, spec)
    assert len(reads) == 1
    assert {k: v.shape for k, v in policy.state_dict().items()} == \
        {k: v.shape for k, v in whole.state_dict().items()}
