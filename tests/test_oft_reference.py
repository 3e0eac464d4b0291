"""The `oft` policy against OpenVLA-OFT's and RLinf's own outputs (tests/fixtures/oft, made by
their code): the published folder goes through the public path (`policy.name=oft`,
`policy.pretrained=<folder>`, roles/pipeline.build_policy), from the env's raw observation
(camera image, raw state, task as the env's instruction ids).

Tolerances: the vision features, values, pixels, prompts, state and actions agree to
<= 1e-5 (1e-6 for pixels and state). In float32 the action logits (magnitude ~10) agree to
LOGIT_TOL only: the tiny reference model is ill-conditioned (its q/k projections are drawn 5x
larger so that its attention is sharp), and float32 rounding alone moves its logits by
~1e-3 (the reference's own float32 and float64 runs differ by 1.2e-3, summary.json
`self_checks`; ours differ from the reference's float32 by up to 2.2e-3 on an AMD EPYC, whose
BLAS kernels sum in another order). So logits, log-probs and entropies are also checked in
float64, against the reference's float64 rerun of the same weights (`f64.*`), to 1e-5.
"""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hpcvla.config import ConfigError, load_config
from hpcvla.preflight import check_config
from hpcvla.envs.base import EnvSpec
from hpcvla.text import tokenize, vocab_of
from hpcvla.policies import OFTPolicy
from hpcvla.policies.folders import read_tensors
from hpcvla.policies.oft_checkpoint import (UNUSED, from_published, load_value_head,
                                            read_statistics, to_published)
from hpcvla.policies.oft_processor import PROMPT
from hpcvla.policies.oft_vision import center_crop, pixel_values
from hpcvla.factory import build_policy

FIXTURES = Path(__file__).parent / "fixtures" / "oft"
CHECKPOINT = FIXTURES / "checkpoint"
LOGIT_TOL = 5e-3  # float32 rounding of an ill-conditioned tiny model: module docstring
SAMPLES = {"s0": 0, "s1": 1, "libero": 0}
# OFT's own recipe: its proprio token and second image, read in its own sequence
OFFICIAL_PROPRIO = {"env.state": "true", "env.wrist_image": "true", "policy.sequence": "official"}


def reference_io():
    """The references' inputs and outputs, and their metadata as `meta`."""
    tensors = load_file(str(FIXTURES / "io.safetensors"))
    with safe_open(str(FIXTURES / "io.safetensors"), "pt") as f:
        tensors["meta"] = json.loads(f.metadata()["fixture"])
    return tensors


@pytest.fixture(scope="module")
def io():
    return reference_io()


def config(folder=CHECKPOINT, **extra):
    overrides = ["policy.name=oft", f"policy.pretrained={folder}", "policy.dtype=float32",
                 "policy.unnorm_key=libero_spatial_no_noops", "policy.max_prompt_length=40",
                 "env.state=false",  # RLinf's recipe; OFT's proprio needs its own sequence
                 "policy.logprob_granularity=chunk",
                 *(f"{k}={v}" for k, v in extra.items())]
    # a LIBERO config: OFT's own recipe reads the wrist camera and the state, which reach has not
    return check_config(load_config("configs/libero_oft.yaml", overrides))


def env_obs(io, sample="raw", tasks=None, wrist=False, state=False):
    """The env's fields for the fixture's raw batch (`raw`) or the LIBERO one (`libero`)."""
    tasks = tasks or (io["meta"]["tasks"] if sample == "raw" else [io["meta"]["libero_task"]])
    vocab, length = vocab_of(tasks), 24
    obs = {"image": io[f"{sample}.raw.full_image" if sample == "libero" else "raw.full_image"],
           "instruction": torch.from_numpy(np.stack([tokenize(t, vocab, length) for t in tasks]))}
    if wrist:
        obs["wrist_image"] = io["libero.raw.wrist_image" if sample == "libero" else "raw.wrist_image"]
    if state:
        obs["state"] = io["libero.raw.state" if sample == "libero" else "raw.state"]
    spec = EnvSpec(obs={k: (tuple(v.shape[1:]), "|u1" if v.dtype == torch.uint8 else "<f4")
                        for k, v in obs.items()},
                   action_dim=7, chunk_len=8, max_episode_chunks=8, vocab=vocab)
    return obs, spec


@pytest.fixture(scope="module")
def rl(io):
    """RLinf's setting: 1 image, no proprio, its value head, per-token log-probs."""
    obs, spec = env_obs(io)
    policy = build_policy(config(**{"policy.logprob_granularity": "token"}), spec)
    load_value_head(policy, FIXTURES / "rlinf_value_head.safetensors")
    return policy.eval(), obs


def test_prompts_and_pixels_are_the_references(io, rl):
    policy, obs = rl
    inputs = policy.processor.inputs(obs)
    assert torch.equal(inputs["input_ids"], io["rlinf.input_ids"])
    assert torch.equal(inputs["prompt_mask"], io["rlinf.attention_mask"])
    pixels = pixel_values([obs["image"]], policy.vision_backbone.image_size)
    torch.testing.assert_close(pixels, io["rlinf.pixel_values"], rtol=0, atol=1e-6)
    tasks = io["meta"]["tasks"] + [io["meta"]["libero_task"]]
    for name, task in zip(SAMPLES, tasks):  # OFT's prompt: the same text, unpadded
        ids = policy.processor.tokenizer.encode(PROMPT.format(task=task.lower()))
        assert ids == io[f"oft.{name}.input_ids"][0].tolist()


def test_vision_features_are_the_references(io, rl):
    policy = rl[0]
    with torch.no_grad():
        for name, pixels in (("vision", io["oft.s0.pixel_values"]),
                             ("vision_2img", io["oft_proprio.s0.pixel_values"])):
            features = policy.vision_backbone(pixels)
            torch.testing.assert_close(features, io[f"{name}.s0.features"], rtol=0, atol=1e-5)
            torch.testing.assert_close(policy.projector(features), io[f"{name}.s0.projected"],
                                       rtol=0, atol=1e-5)


def fine_image(side=256):
    """make_crop_fixture.fine_image (integer arithmetic; the fixture holds its digest)."""
    y, x = np.mgrid[0:side, 0:side].astype(np.int64)
    r = 78 + ((x // 2 + y // 2) % 2) * 120 - 60 + 100 * x // (side - 1)
    g = ((x - side // 2) ** 2 + (y - side // 2) ** 2) // 4 % 256
    b = 40 + 150 * y // (side - 1) + 60 * (x % 7 == 3)
    return np.stack([r, g, b], -1).astype(np.uint8)


def test_centre_crop_is_ofts():
    """OFT's center_crop_image (crop_io.npz, made by OFT's openvla_utils with tensorflow) to
    the uint8 level on the images it crops; the whole path (hpcvla's bicubic resize, then the
    crop) against OFT's without its JPEG round trip: within the resize kernels' difference
    (measured: mean 1.28 / 2.94 levels, max 18 / 23; uncropped: mean 7.2 / 44)."""
    def chw(image):  # (H, W, 3) uint8 -> (1, 3, H, W) float, as pixel_values holds it
        return torch.from_numpy(np.asarray(image)).permute(2, 0, 1)[None].float()

    ref = np.load(FIXTURES / "crop_io.npz")
    assert hashlib.sha256(fine_image().tobytes()).hexdigest() == str(ref["fine256/input_sha256"])
    for name, image, mean in (("libero", ref["libero/input"], 1.5), ("fine256", fine_image(), 3.5)):
        for source in ("resized", "resized_nojpeg"):
            cropped = ref[f"{name}/{source.replace('resized', 'cropped')}"]
            assert torch.equal(center_crop(chw(ref[f"{name}/{source}"]), 0.9), chw(cropped))
        for crop, far in ((0.9, False), (1.0, True)):
            siglip = pixel_values([torch.from_numpy(image)[None]], 224, crop)[:, 3:]
            ours = (siglip * 0.5 + 0.5) * 255  # SigLIP's normalization undone
            assert (ours - ours.round()).abs().max() < 1e-4
            error = (ours.round() - chw(ref[f"{name}/cropped_nojpeg"])).abs().mean()
            assert (error > 5) if far else (error < mean), (name, crop, error)


def test_centre_crop_is_a_setting_the_policy_reads(io, tmp_path):
    """policy.center_crop reaches the policy (and the folder it saves) through the config and
    crops what it sees from the env's images; areas outside (0, 1] are refused by name."""
    obs, spec = env_obs(io)  # random init (no folder: fast); the crop is the same with one
    policy = build_policy(config("", **{"policy.center_crop": 0.9}), spec).eval()
    assert policy.center_crop == 0.9 and policy.init_args["center_crop"] == 0.9
    with torch.no_grad():
        pixels = pixel_values([obs["image"]], policy.vision_backbone.image_size, 0.9)
        torch.testing.assert_close(policy._prefix(obs), policy.projector(
            policy.vision_backbone(pixels)), rtol=0, atol=0)
    for bad in ("-0.1", "1.5"):
        with pytest.raises(ConfigError, match="policy.center_crop"):
            config("", **{"policy.center_crop": bad})
    assert build_policy(config(""), spec).center_crop == 1.0  # no folder, none set: no crop
    # a folder it saves (an `hpcvla sft` policy/) was trained on the crop: the config leaves
    # it to the folder (0) or says the same; one that reads it without the crop is refused
    from hpcvla.policies import save_pretrained
    saved = save_pretrained(policy, tmp_path / "policy")
    config(saved, **{"policy.center_crop": 0.9})
    assert build_policy(config(saved), spec).center_crop == 0.9
    with pytest.raises(ConfigError, match="policy.center_crop = 1.0: expected 0.9, what"):
        config(saved, **{"policy.center_crop": 1})


def test_rlinf_logits_values_and_greedy_actions(io, rl):
    policy, obs = rl
    with torch.no_grad():
        logits, values = policy.action_logits(policy._inputs(obs))
    torch.testing.assert_close(logits, io["rlinf.action_logits"], rtol=0, atol=LOGIT_TOL)
    torch.testing.assert_close(values, io["rlinf.train.values"], rtol=0, atol=1e-5)
    tokens = 31744 + logits.argmax(dim=-1)
    assert torch.equal(tokens.view(2, 8, 7), io["rlinf.greedy.action_tokens"])
    out = policy.act(obs, deterministic=True)
    torch.testing.assert_close(out.actions.double(), io["rlinf.greedy.actions"], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.value, io["rlinf.train.values"].mean(dim=1), rtol=0, atol=1e-5)


def reference_terms(io, run, tokens, temperature):
    """RLinf's token log-probs; where the token is 31744 or 31745 (both bin 254) the policy
    scores the value, i.e. both tokens' probability: computed from the reference logits."""
    logp = torch.log_softmax(io["rlinf.action_logits"] / temperature, dim=-1)
    merged = torch.logaddexp(logp[..., 0], logp[..., 1])
    flat = tokens.reshape(2, -1)
    return torch.where(flat <= 31745, merged, io[f"rlinf.{run}.logprobs"]).view(2, 8, 7)


@pytest.mark.parametrize("run,tokens", [("train", "greedy"), ("train_sample", "sample")])
def test_rlinf_logprobs_entropy_and_values_of_given_tokens(io, rl, run, tokens):
    policy, obs = rl
    actions = io[f"rlinf.{tokens}.actions"].float()  # the env's units
    logprob, value, entropy = policy.evaluate(obs, actions)
    expected = reference_terms(io, run, io[f"rlinf.{tokens}.action_tokens"], 1.6)
    torch.testing.assert_close(logprob, expected, rtol=0, atol=LOGIT_TOL)
    torch.testing.assert_close(entropy, io[f"rlinf.{run}.entropy"].view(2, 8, 7), rtol=0,
                               atol=LOGIT_TOL)
    torch.testing.assert_close(value, io[f"rlinf.{run}.values"].mean(dim=1), rtol=0, atol=1e-5)


def test_greedy_rollout_logprobs_at_temperature_one(io):
    obs, spec = env_obs(io)
    policy = build_policy(config(**{"policy.temperature": 1.0,
                                    "policy.logprob_granularity": "token"}), spec)
    logprob = policy.evaluate(obs, io["rlinf.greedy.actions"].float())[0]
    tokens = io["rlinf.greedy.action_tokens"]
    assert not (tokens <= 31745).any()  # pure token log-probs here
    torch.testing.assert_close(logprob, io["rlinf.greedy.prev_logprobs"].view(2, 8, 7), rtol=0,
                               atol=LOGIT_TOL)
    sampled = policy.act(obs)  # scoring recovers what sampling recorded
    torch.testing.assert_close(policy.evaluate(obs, sampled.actions)[0].sum(dim=(1, 2)),
                               sampled.logprob, rtol=0, atol=1e-5)


def test_sft_cross_entropy_is_of_the_logits_as_they_are(io):
    """`hpcvla sft` of the token head: OFT's fine-tuning loss, the cross-entropy of the
    logits at temperature 1 (finetune.py), whatever policy.temperature acting uses (1.6,
    RLinf's): the mean of the reference's log-probs at temperature 1, negated."""
    obs, spec = env_obs(io)
    actions = io["rlinf.greedy.actions"].float()
    real = torch.ones(actions.shape[:2], dtype=torch.bool)
    expected = -io["rlinf.greedy.prev_logprobs"].mean()  # temperature 1, no merged bins
    for temperature in (1.6, 1.0):
        policy = build_policy(config(**{"policy.temperature": temperature}), spec)
        torch.testing.assert_close(policy.imitation_loss(obs, actions, real), expected,
                                   rtol=0, atol=LOGIT_TOL)


def without_proprio(folder: Path) -> Path:
    """The fixture checkpoint as one fine-tuned without the proprio token (no projector file:
    with one, OFT's sequence must read the state, oft_recipe.recipe_problems)."""
    for file in CHECKPOINT.iterdir():
        if "proprio_projector" not in file.name:
            (folder / file.name).symlink_to(file)
    return folder


def test_rlinfs_layout_with_the_proprio_projector_in_the_shards_loads(io, tmp_path):
    """RLinf's saves keep `proprio_projector.*` in the model's shards and write its file
    beside them: read from the file, the same weights as OFT's layout (were: refused as
    unexpected tensors); in the shards without the file: refused, saying so."""
    from safetensors.torch import save_file
    (tmp_path / "rlinf").mkdir()
    folder = without_proprio(tmp_path / "rlinf")
    projector = torch.load(next(CHECKPOINT.glob("proprio_projector--*.pt")), weights_only=True)
    embedded = {"proprio_projector." + k.removeprefix("module."): v.contiguous()
                for k, v in projector.items()}
    save_file(embedded, str(folder / "proprio.safetensors"))
    index = json.loads((CHECKPOINT / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "proprio.safetensors" for k in embedded})
    (folder / "model.safetensors.index.json").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    obs, spec = env_obs(io, "raw", wrist=True, state=True)
    with pytest.raises(ValueError, match=r"proprio_projector\.\* in the shards without the "
                                         "proprio projector"):
        build_policy(config(folder, **{"policy.sequence": "official"}), spec)
    (folder / "proprio_projector--100_checkpoint.pt").symlink_to(
        next(CHECKPOINT.glob("proprio_projector--*.pt")))
    weights = [build_policy(config(f, **OFFICIAL_PROPRIO), spec).state_dict()
               for f in (CHECKPOINT, folder)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize("proprio", [False, True], ids=["oft", "oft_proprio"])
def test_oft_predict_action_is_the_references(io, proprio, tmp_path):
    """OFT's inference sequence (STOP token, no padding, argmax over the whole vocabulary) on
    OFT's own (PIL-resized) pixel values; proprio: 2 images and the state token. Through the
    public path with policy.sequence=official (the env's observation, the prompt padded as
    in a batch), the deterministic chunk is predict_action's; RLinf's sequence acts otherwise."""
    run = "oft_proprio" if proprio else "oft"
    folder = CHECKPOINT if proprio else without_proprio(tmp_path)
    for name, row in SAMPLES.items():
        sample = "libero" if name == "libero" else "raw"
        tasks = None if sample == "libero" else [io["meta"]["tasks"][row]]
        obs, spec = env_obs(io, sample, tasks, wrist=proprio, state=proprio)
        obs = {k: v[row:row + 1] if k != "instruction" else v for k, v in obs.items()}
        official = {**(OFFICIAL_PROPRIO if proprio else {}), "policy.sequence": "official"}
        policy = build_policy(config(folder, **official), spec).eval()
        assert policy.use_proprio == proprio
        model = policy.processor.inputs(obs)
        ids = io[f"{run}.{name}.input_ids"]
        assert torch.equal(model["input_ids"][:, -ids.shape[1] + 1:], ids[:, 1:])
        reference = {"pixel_values": io[f"{run}.{name}.pixel_values"], "input_ids": ids,
                     "prompt_mask": torch.ones_like(ids, dtype=torch.bool)}
        if proprio:
            torch.testing.assert_close(model["state"][0].double(),
                                       io[f"{run}.{name}.proprio_normalized"], rtol=0, atol=1e-6)
            reference["state"] = io[f"{run}.{name}.proprio_normalized"][None].float()
        logits, actions = policy.predict_action_reference(reference)
        torch.testing.assert_close(logits[0, :, 31744:32000], io[f"{run}.{name}.action_logits"],
                                   rtol=0, atol=LOGIT_TOL)
        assert torch.equal(logits[0].argmax(dim=-1).view(8, 7),
                           io[f"{run}.{name}.action_token_ids"])
        torch.testing.assert_close(policy.processor.actions_out(actions[0], {}).double(),
                                   io[f"{run}.{name}.actions"], rtol=0, atol=1e-5)
        acted = policy.act({**obs, "pixel_values": reference["pixel_values"]},
                           deterministic=True).actions
        torch.testing.assert_close(acted[0].double(), io[f"{run}.{name}.actions"],
                                   rtol=0, atol=1e-5)
    if not proprio:
        rlinf = build_policy(config(), spec).eval()
        assert (rlinf.act({**obs, "pixel_values": reference["pixel_values"]},
                          deterministic=True).actions - acted).abs().max() > 0.1


def test_logits_logprobs_and_values_in_float64_to_1e5(io):
    """The same public path with the policy in float64, against the references' float64
    reruns: RLinf's logits, values, log-probs and entropies of given tokens, and OFT's
    `predict_action` logits (one image; two images and the proprio token). The policy hands
    its outputs over in float32 (what the pipeline records); 1e-5 is far above that rounding."""
    obs, spec = env_obs(io)
    policy = build_policy(config(**{"policy.logprob_granularity": "token"}), spec)
    load_value_head(policy, FIXTURES / "rlinf_value_head.safetensors")
    policy = policy.double().eval()
    with torch.no_grad():
        torch.testing.assert_close(policy.vision_backbone(io["oft.s0.pixel_values"].double()),
                                   io["f64.vision.s0.features"], rtol=0, atol=1e-5, check_dtype=False)
        logits, values = policy.action_logits(policy._inputs(obs))
        torch.testing.assert_close(logits, io["f64.rlinf.action_logits"], rtol=0, atol=1e-5, check_dtype=False)
        torch.testing.assert_close(values, io["f64.rlinf.train.values"], rtol=0, atol=1e-5, check_dtype=False)
        for run, tokens in (("train", "greedy"), ("train_sample", "sample")):
            logprob, _, entropy = policy.evaluate(obs, io[f"rlinf.{tokens}.actions"].float())
            logp = torch.log_softmax(io["f64.rlinf.action_logits"] / 1.6, dim=-1)
            flat = io[f"rlinf.{tokens}.action_tokens"].reshape(2, -1)
            expected = torch.where(flat <= 31745, torch.logaddexp(logp[..., 0], logp[..., 1]),
                                   io[f"f64.rlinf.{run}.logprobs"]).view(2, 8, 7)
            torch.testing.assert_close(logprob, expected, rtol=0, atol=1e-5, check_dtype=False)
            torch.testing.assert_close(entropy, io[f"f64.rlinf.{run}.entropy"].view(2, 8, 7),
                                       rtol=0, atol=1e-5, check_dtype=False)
        for run in ("oft", "oft_proprio"):
            proprio = run == "oft_proprio"  # 2 images and the state token
            spec = env_obs(io, wrist=proprio, state=proprio)[1]
            oft = build_policy(config(**(OFFICIAL_PROPRIO if proprio else {})),
                               spec).double().eval()
            for name in SAMPLES:
                ids = io[f"{run}.{name}.input_ids"]
                reference = {"pixel_values": io[f"{run}.{name}.pixel_values"].double(),
                             "input_ids": ids, "prompt_mask": torch.ones_like(ids, dtype=torch.bool)}
                if proprio:  # OFT rounds the normalized state to float32 first
                    reference["state"] = io[f"{run}.{name}.proprio_normalized"][None].float().double()
                logits = oft.predict_action_reference(reference)[0]
                torch.testing.assert_close(logits[0, :, 31744:32000],
                                           io[f"f64.{run}.{name}.action_logits"], rtol=0,
                                           atol=1e-5, check_dtype=False)
                torch.testing.assert_close(torch.logsumexp(logits[0].double(), dim=-1),
                                           io[f"f64.{run}.{name}.logsumexp_full"], rtol=0,
                                           atol=1e-5)


def test_bfloat16_action_logits_are_the_exact_product_of_its_weights(io):
    """In bf16 a trained, peaked head's action logits (20-30) would be rounded 0.06-0.125
    apart, and inference's and training's kernels round them differently (a per-token
    mismatch summed over 56 tokens into every behaviour weight): they are computed in float32
    from the bf16 hidden states and weights, the 256 action rows only."""
    from hpcvla.policies.oft import ACTION_ROWS
    obs, spec = env_obs(io)
    policy = build_policy(config(**{"policy.dtype": "bfloat16"}), spec).eval()
    with torch.no_grad():
        policy.lm_head.weight[ACTION_ROWS] *= 3  # a peaked head: logits up to ~30
    seen = []
    policy.lm_head.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    with torch.no_grad():
        logits = policy.action_logits(policy._inputs(obs))[0]
    reference = seen[0].double() @ policy.lm_head.weight[ACTION_ROWS].double().T
    assert logits.dtype == torch.float32 and 16 < reference.abs().max() < 64
    torch.testing.assert_close(logits.double(), reference, rtol=1e-5, atol=1e-4)


def _remove_tensor(folder, name: str) -> None:
    """A sharded checkpoint folder without tensor `name`: its shard and index rewritten."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"].pop(name)
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_tensor_statistics_or_key_are_named(tmp_path, io):
    _, spec = env_obs(io)
    folder = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, folder)
    gone = "vision_backbone.featurizer.blocks.0.ls1.scale_factor"
    _remove_tensor(folder, gone)
    with pytest.raises(ValueError, match=f"missing {gone}"):
        build_policy(config(folder), spec)
    (folder / "dataset_statistics.json").unlink()
    with pytest.raises(ConfigError) as err:
        config(folder)
    assert "policy.pretrained" in str(err.value) and "dataset_statistics.json" in str(err.value)
    shutil.copy(CHECKPOINT / "dataset_statistics.json", folder)
    # the sizes the ranks build it at, read before any starts: a tensor they come from, and
    # config.json's attention heads against the width (they raised in the launching process)
    settings = json.loads((folder / "config.json").read_text())
    width = settings["text_config"].get("hidden_size", 4096)
    settings["text_config"]["num_attention_heads"] = width + 1
    (folder / "config.json").write_text(json.dumps(settings))
    with pytest.raises(ConfigError) as err:
        config(folder)
    assert f"text_config.num_attention_heads ({width + 1}) does not divide" in str(err.value)
    _remove_tensor(folder, "vision_backbone.featurizer.patch_embed.proj.weight")
    shutil.copy(CHECKPOINT / "config.json", folder)
    with pytest.raises(ConfigError) as err:
        config(folder)
    assert "policy.pretrained" in str(err.value) and "patch_embed.proj.weight is missing" in \
        str(err.value)
    pi0 = Path(__file__).parent / "fixtures" / "pi0" / "pi0" / "lerobot"
    with pytest.raises(ConfigError) as err:
        config(pi0)
    assert f"policy.name = 'oft': expected flow: {pi0} is a published flow folder" in \
        str(err.value), str(err.value)
    with pytest.raises(ConfigError) as err:
        config(**{"policy.unnorm_key": "bridge_orig"})
    assert "policy.unnorm_key" in str(err.value) and "libero_spatial_no_noops" in str(err.value)


def test_recipes_the_oft_policy_does_not_run_are_refused_by_name(tmp_path):
    """OFT's own LIBERO recipe in RLinf's sequence (its L1 action head, `action_head--<step>_
    checkpoint.pt` as OFT's fine-tuning names it; its proprio token), another platform's
    chunk, or another image count than the env's are refused before any rank starts (the
    diffusion head: test_oft_l1_head.py); a dataset key without OFT's `_no_noops` suffix is
    found as OFT's and RLinf's evaluation find it."""
    folder = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, folder)
    config(folder, **{"policy.unnorm_key": "libero_spatial"})  # accepted (check_config raises)
    with pytest.raises(ConfigError) as err:  # OFT's proprio projector in RLinf's sequence
        config(folder, **{"env.state": "true"})
    assert "set policy.sequence=official" in str(err.value)
    torch.save({}, folder / "action_head--100_checkpoint.pt")
    with pytest.raises(ConfigError) as err:
        config(folder)
    assert "action_head--100_checkpoint.pt" in str(err.value) and \
        "set policy.sequence=official" in str(err.value)
    (folder / "action_head--100_checkpoint.pt").unlink()
    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**settings, "num_images_in_input": 2}))
    with pytest.raises(ConfigError) as err:
        config(folder)
    assert "num_images_in_input" in str(err.value) and "env.wrist_image=true" in str(err.value)
    config(folder, **{"env.wrist_image": "true"})  # accepted
    statistics = json.loads((folder / "dataset_statistics.json").read_text())
    statistics["bridge_orig"] = statistics["libero_spatial_no_noops"]
    (folder / "dataset_statistics.json").write_text(json.dumps(statistics))
    # with two keys, OFT's suffix rule (not "the only key") finds the one named
    assert read_statistics(folder, "libero_spatial")[0] == "libero_spatial_no_noops"
    assert read_statistics(folder, "bridge_orig")[0] == "bridge_orig"
    with pytest.raises(ConfigError) as err:
        config(folder, **{"env.wrist_image": "true", "policy.unnorm_key": "bridge_orig"})
    assert "OFT chunk is 5 steps" in str(err.value)
    (folder / "tokenizer.json").write_bytes(b"\xff\xfe garbage")  # what every rank would load
    with pytest.raises(ConfigError) as err:
        config(folder, **{"env.wrist_image": "true"})
    assert "policy.pretrained" in str(err.value) and \
        "a Llama tokenizer transformers can load" in str(err.value)


def test_published_conversion_round_trips_exactly():
    tensors = {k: v for k, v in read_tensors(CHECKPOINT).items() if not k.startswith(UNUSED)}
    back = to_published(from_published(tensors))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_full_size_layout_covers_the_published_checkpoint():
    """The full-size preset, on the meta device: every tensor of a published OpenVLA-OFT
    checkpoint (summary.json's full-size key list + the proprio projector) has its module,
    with its shape; SigLIP's attention-pool head is the only documented unused part."""
    summary = json.loads((FIXTURES / "summary.json").read_text())
    spec = {"image": ((224, 224, 3), "|u1"), "state": ((8,), "<f4"),
            "instruction": ((24,), "<i4")}
    with torch.device("meta"):
        policy = OFTPolicy(spec, 7, 8, 10, size="full", dtype="float32")
    ours = {k: tuple(v.shape) for k, v in to_published(policy.state_dict()).items()
            if not k.startswith("value_head.")}
    published = {k: tuple(v) for k, v in summary["keys_full_size"].items()}
    unused = [k for k in published if k.startswith(UNUSED)]
    missing = [k for k in published if k not in ours and k not in unused]
    assert (len(published), len(unused), missing) == (982, 13, [])
    assert ours == {k: v for k, v in published.items() if k not in unused}
    proprio = {k.removeprefix("proprio_projector."): tuple(v.shape)
               for k, v in policy.state_dict().items() if k.startswith("proprio_projector.")}
    assert proprio == {k.removeprefix("module."): tuple(v) for k, v in
                       summary["keys_full_size_proprio_projector"].items()}
    assert len(ours) + len(proprio) == 973  # loaded: 986 - the 13 unused
    # parameters: the published ones (less the unused) + proprio projector + DINOv2's zero
    # cls position row (HF's table has one, timm's not) + RLinf's value head
    parameters = sum(p.numel() for p in policy.parameters())
    value_head = sum(p.numel() for p in policy.value_head.parameters())
    size = sum(int(np.prod(v)) for k, v in published.items() if k not in unused)
    assert (parameters, value_head) == (7_544_982_384, 2_164_352)
    assert parameters == size + sum(map(np.prod, proprio.values())) + 1024 + value_head


def test_tiny_random_init_acts_learns_and_round_trips(tmp_path):
    """Without a checkpoint (the `tiny` preset, the env's instruction ids as the prompt):
    scoring recovers sampling's log-prob, gradients reach every trainable tensor, and an
    hpcvla folder reloads exactly."""
    from hpcvla.policies import load_pretrained, make_policy, save_pretrained

    spec = {"image": ((32, 32, 3), "|u1"), "state": ((3,), "<f4"), "instruction": ((6,), "<i4")}
    policy = make_policy("oft", spec, 2, 4, 10, dtype="float32")
    obs = {"image": torch.randint(0, 256, (3, 32, 32, 3), dtype=torch.uint8),
           "state": torch.randn(3, 3),
           "instruction": torch.tensor([[4, 2, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [5, 6, 7, 8, 9, 3]])}
    out = policy.act(obs)
    assert out.actions.shape == (3, 4, 2) and out.actions.abs().max() < 1
    logprob, value, entropy = policy.evaluate(obs, out.actions)
    torch.testing.assert_close(logprob, out.logprob, rtol=0, atol=1e-5)
    (logprob.sum() + value.sum() + entropy.sum()).backward()
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert [n for n, p in policy.named_parameters() if p.requires_grad and p.grad is None] == []
    assert any(n.startswith("proprio_projector.") for n in trainable)
    loaded = load_pretrained(save_pretrained(policy, tmp_path / "oft"))
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(),
                                                 loaded.state_dict().values()))
