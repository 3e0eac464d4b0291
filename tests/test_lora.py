"""LoRA (policy.lora_rank, policies/lora.py): the pretrained weights frozen and the adapters
and heads trained, for every VLA family; merging folds the adapters in (same actions, plain
names, a folder that loads without LoRA); a real run where only adapters and heads cross the
weight plane per version, that resumes, and that `hpcvla export` merges. OFT with LoRA under
ZeRO-3: tests/test_vla_policies.py."""

from __future__ import annotations

import pytest
import torch

from hpcvla.checkpoint import catalog
from hpcvla.config import ConfigError, load_config
from hpcvla.envs import env_spec
from hpcvla.factory import build_policy
from hpcvla.policies.lora import adapter_parameters, merge_lora
from helpers import ROOT, VLA_CASES, hpcvla, policy_batch, run_train

FAMILIES = ["pi0", "pi05", "tokens", pytest.param("oft", marks=pytest.mark.slow)]  # OFT: ~9 s


def lora_policy(case, *extra):
    config, overrides = VLA_CASES[case]
    cfg = load_config(config, [*overrides, "policy.lora_rank=4", *extra])
    spec = env_spec(cfg.env)
    return cfg, spec, build_policy(cfg, spec)


@pytest.mark.parametrize("case", FAMILIES)
def test_lora_trains_adapters_and_heads_and_freezes_the_pretrained_weights(case):
    from transformers import PreTrainedModel
    cfg, spec, policy = lora_policy(case)
    assert adapter_parameters(policy) > 0
    for module in policy.modules():
        if isinstance(module, PreTrainedModel):
            trained = [n for n, p in module.named_parameters() if p.requires_grad]
            assert all("lora_" in n for n in trained), trained
    heads = [n for n, p in policy.named_parameters() if p.requires_grad and "lora_" not in n]
    assert any(n.startswith("value_head") for n in heads), heads
    obs, actions = policy_batch(spec)
    logprob, value, entropy = policy.evaluate(obs, actions)
    (logprob.mean() + value.pow(2).mean()).backward()
    graded = {n for n, p in policy.named_parameters() if p.grad is not None}
    assert graded == {n for n, p in policy.named_parameters() if p.requires_grad}
    # a second build is the same (every rank draws the same adapters)
    again = build_policy(cfg, spec)
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(),
                                                 again.state_dict().values()))


@pytest.mark.parametrize("case", ["pi0", pytest.param("oft", marks=pytest.mark.slow)])
def test_merging_folds_the_adapters_into_a_policy_without_lora(case):
    """Merged, each projection is W + (lora_alpha / lora_rank) B A (here 8 / 4), and the
    policy acts as it did with its adapters."""
    cfg, spec, policy = lora_policy(case, "policy.lora_alpha=8")
    with torch.no_grad():  # trained adapters: B is no longer zero
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    layer = next(k.removesuffix(".lora_A.default.weight") for k in state
                 if k.endswith("q_proj.lora_A.default.weight"))
    obs, actions = policy_batch(spec)
    with torch.no_grad():
        before = policy.evaluate(obs, actions)[0]
        assert merge_lora(policy) > 0
        after = policy.evaluate(obs, actions)[0]
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(policy.state_dict()[f"{layer}.weight"], (
        state[f"{layer}.base_layer.weight"] + 8 / 4 * state[f"{layer}.lora_B.default.weight"]
        @ state[f"{layer}.lora_A.default.weight"]), rtol=1e-5, atol=1e-6)
    plain = build_policy(load_config(*VLA_CASES[case]), spec)
    assert list(plain.state_dict()) == list(policy.state_dict())
    plain.load_arrays(policy.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(plain.evaluate(obs, actions)[0], before, rtol=1e-4,
                                   atol=1e-4)


def test_the_default_policy_refuses_lora():
    with pytest.raises(ConfigError, match="policy.lora_rank"):
        load_config("configs/default.yaml", ["policy.lora_rank=8"])


@pytest.mark.mpi
@pytest.mark.slow
def test_only_adapters_and_heads_cross_the_weight_plane_and_the_run_resumes(tmp_path):
    """π0-style flow with LoRA on a streamer run, ZeRO-3: after the first version each one
    carries exactly the trainable tensors' bytes (printed and in summary.json); the run
    resumes from its checkpoint with the adapters."""
    overrides = ["policy.name=flow", "policy.lora_rank=4", "learner.zero_stage=3"]
    out, summary, run_dir = run_train(tmp_path, *overrides, "pipeline.total_updates=2",
                                      "learner.checkpoint_every=1")
    cfg = load_config(ROOT / "configs/default.yaml", overrides)
    policy = build_policy(cfg, env_spec(cfg.env))
    trainable = sum(p.nbytes for p in policy.parameters() if p.requires_grad)
    (learner,) = [r for r in summary["per_rank"] if r["role"] == "learner"]
    assert learner["weight_bytes"]["per_version"] == trainable
    assert learner["weight_bytes"]["first_version"] > 5 * trainable
    assert f"{trainable / 1e6:.1f} MB per version" in out.stdout
    def adam_steps() -> set[float]:  # of the newest checkpoint, over the adapters and heads
        state = catalog.read_state(catalog.latest(run_dir))
        return {s for entry in state["optimizer"] for s in entry["steps"].values()}
    (per_update,) = adam_steps()
    out = hpcvla("train", "configs/default.yaml", "--ranks", 4, f"run.resume={run_dir}",
                 "pipeline.total_updates=3", *overrides, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resuming from" in out.stdout and "update 3/3" in out.stdout
    assert adam_steps() == {per_update * 3 / 2}  # the adapters' Adam state went on
    # exported: the adapters merged into a folder that loads without LoRA and acts the same
    out = hpcvla("export", run_dir, tmp_path / "merged")
    assert out.returncode == 0 and "policy version 3" in out.stdout, out.stdout + out.stderr
    assert "LoRA layers merged" in out.stdout
    from hpcvla.evaluate import checkpoint_weights
    from hpcvla.policies import load_pretrained
    policy.load_arrays(checkpoint_weights(run_dir)[0])
    merged = load_pretrained(tmp_path / "merged")
    assert adapter_parameters(merged) == 0
    obs, actions = policy_batch(env_spec(cfg.env))
    with torch.no_grad():
        torch.testing.assert_close(merged.evaluate(obs, actions)[0],
                                   policy.evaluate(obs, actions)[0], rtol=1e-4, atol=1e-4)
