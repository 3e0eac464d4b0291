"""The flow family against LeRobot 0.6.1's own π0 and π0.5: tiny random checkpoints LeRobot
built and saved (tests/fixtures/pi0/make_fixtures.py says how to rebuild them), in the layouts
they are published in, load strictly; with LeRobot's model inputs, our velocity field and our
Euler sampler from LeRobot's noise give LeRobot's outputs.

The same from raw observations through `policy.pretrained=...` (tokenizer, prompt,
normalization, resize-with-pad): tests/test_pi0_pretrained.py.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpcvla.policies.flow import FlowPolicy
from hpcvla.policies.folders import checkpoint_kwargs, load_weights

FIXTURES = Path(__file__).parent / "fixtures" / "pi0"
OBS = {"image": ((32, 32, 3), "|u1"), "wrist_image": ((32, 32, 3), "|u1"),
       "state": ((8,), "<f4"), "instruction": ((48,), "<i4")}
PROMPT = {"pi0": 48, "pi05": 200}  # token slots: π0.5's prompt holds the discretized state
ACTION_DIM, EXECUTED, STEPS = 7, 5, 10  # LeRobot: action 7-d, n_action_steps 5, 10 steps


def pi0(layout: str, family: str = "pi0", **kwargs) -> FlowPolicy:
    folder = FIXTURES / family / layout
    obs = dict(OBS, instruction=((PROMPT[family],), "<i4"))
    policy = FlowPolicy(obs, ACTION_DIM, EXECUTED, 320, dtype="float32", **kwargs,
                        **checkpoint_kwargs(FlowPolicy, folder))  # sizes from the tensors
    assert policy.variant == family
    assert policy.denoise_steps == STEPS  # the folder's sampler (LeRobot's config, openpi's 10)
    fresh = load_weights(policy, folder)
    assert sorted(fresh) == ["log_std", "value_head.0.bias", "value_head.0.weight",
                             "value_head.2.bias", "value_head.2.weight"]  # RL heads only
    return policy


def model_inputs(io):
    """LeRobot's model inputs as our observation fields: its two present cameras (the third
    is masked out), its token ids (0 = padding), its normalized state (unpadded)."""
    images = io["model.images"]
    assert io["model.img_masks"][:2].all() and not io["model.img_masks"][2].any()
    hwc = [((images[i] + 1) * 127.5).permute(0, 2, 3, 1) for i in (0, 1)]
    state = io["model.state"][:, :8] if "model.state" in io else torch.zeros(2, 8)  # π0.5:
    return {"image": hwc[0], "wrist_image": hwc[1], "state": state,  # in the prompt
            "instruction": io["model.lang_tokens"] * io["model.lang_masks"]}


@pytest.mark.parametrize("family", ["pi0", "pi05"])
@pytest.mark.parametrize("layout", ["lerobot", "lerobot_tied", "lerobot_sharded", "openpi"])
def test_published_layouts_load_with_the_checkpoints_dims(layout, family):
    policy = pi0(layout, family)
    assert (policy.model_horizon, policy.model_action_dim) == (10, 32)  # π0's horizon, padding
    assert policy.model_state_dim == (32 if family == "pi0" else 8)  # π0.5: no state_proj
    reference = load_file(str(FIXTURES / family / "lerobot" / "model.safetensors"))
    ours = policy.state_dict()
    assert torch.equal(ours["action_in_proj.weight"], reference["model.action_in_proj.weight"])


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_velocity_and_sampled_chunk_match_lerobot(family):
    policy = pi0("lerobot_tied", family).eval()
    io = load_file(str(FIXTURES / family / "io.safetensors"))
    obs = policy._inputs(model_inputs(io))
    with torch.no_grad():
        cache, pad, _ = policy._encode(obs)
        state = policy._padded_state(obs)
        v, _ = policy._velocity(cache, pad, state, io["velocity.x_t"], io["velocity.t"])
        torch.testing.assert_close(v, io["velocity.v"], rtol=0, atol=1e-5)
        x = io["noise"]  # LeRobot's Euler sampler from t = 1 (noise) to 0
        for t in policy._times(x.shape[0], x.device):
            x = x - policy._velocity(cache, pad, state, x, t)[0] / STEPS
    torch.testing.assert_close(x, io["sample.actions_model"], rtol=0, atol=1e-5)


def euler(policy, obs, x):
    """LeRobot's sampler from the noise `x`: K Euler steps from t = 1 to 0, nothing added."""
    with torch.no_grad():
        cache, pad, _ = policy._encode(obs)
        state = policy._padded_state(obs)
        for t in policy._times(x.shape[0], x.device):
            x = x - policy._velocity(cache, pad, state, x, t)[0] / STEPS
    return x


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_deterministic_acting_from_noise_is_the_references_sampler(family):
    """policy.denoise_from=noise: acting without exploration noise integrates from
    x_0 ~ N(0, I) drawn from the caller's stream, with nothing added: the chunk is the Euler
    sampler's from that very draw (which the test above holds to LeRobot's), not the zero
    start's; the exploration std plays no part; evaluations say which sampler acted."""
    policy = pi0("lerobot_tied", family, denoise_from="noise").eval()
    obs = policy._inputs(model_inputs(load_file(str(FIXTURES / family / "io.safetensors"))))
    chunks = []
    for seed, log_std in ((5, -2.0), (5, 1.0), (6, -2.0)):
        with torch.no_grad():
            policy.log_std.fill_(log_std)
        torch.manual_seed(seed)
        chunks.append(policy.act(obs, deterministic=True).actions)
    torch.manual_seed(5)
    drawn = euler(policy, obs, torch.randn(2, policy.model_horizon, policy.model_action_dim))
    torch.testing.assert_close(chunks[0], drawn[:, :EXECUTED, :ACTION_DIM], rtol=0, atol=1e-6)
    assert torch.equal(chunks[0], chunks[1])  # nothing but the start is random
    assert not torch.allclose(chunks[0], chunks[2], atol=1e-3)  # a new draw, a new chunk
    zero = euler(policy, obs, torch.zeros(2, policy.model_horizon, policy.model_action_dim))
    assert not torch.allclose(chunks[0], zero[:, :EXECUTED, :ACTION_DIM], atol=1e-3)
    assert policy.action_mode(True) == "noise-free flow from N(0, I)"
    assert policy.action_mode(False) == "sampled"
    start = pi0("lerobot_tied", family).eval()  # the default: the prior's mode, x_0 = 0
    start.load_state_dict(policy.state_dict())
    torch.testing.assert_close(start.act(obs, deterministic=True).actions,
                               zero[:, :EXECUTED, :ACTION_DIM], rtol=0, atol=1e-6)
    assert start.action_mode(True) == "deterministic"


@pytest.mark.parametrize("family,tensors", [("pi0", 778), ("pi05", 813)])
def test_full_size_checkpoints_map_tensor_for_tensor(family, tensors):
    """LeRobot's full-size π0/π0.5 (key -> shape lists in summary.json, built on the meta
    device): the sizes read from the shapes are PaliGemma-3B's and the 300M expert's, and
    every tensor has its place (the tied lm_head, the expert's unused one aside)."""
    import json
    shapes = {k: tuple(v) for k, v in json.loads((FIXTURES / family / "summary.json").read_text())
              ["keys_full_size_state_dict"].items()}
    assert len(shapes) == tensors
    kwargs = FlowPolicy.checkpoint_kwargs(shapes, {"chunk_size": 50})
    assert kwargs["size"]["text"]["hidden_size"] == 2048
    assert kwargs["size"]["vision"]["num_attention_heads"] == 16
    with torch.device("meta"):
        policy = FlowPolicy(dict(OBS, image=((224, 224, 3), "|u1")), ACTION_DIM, EXECUTED,
                            257152, dtype="float32", **kwargs)
    ours = {FlowPolicy.to_hf_key(k): tuple(v.shape) for k, v in policy.state_dict().items()
            if not FlowPolicy.to_hf_key(k).startswith("rl.")}
    (embed, lm_head), = FlowPolicy.HF_LAYOUT["tied"]
    dropped = {lm_head, *FlowPolicy.HF_LAYOUT["unused"]}
    assert ours == {k: v for k, v in shapes.items() if k not in dropped}
    assert 3.2e9 < sum(p.numel() for p in policy.parameters()) < 3.4e9
