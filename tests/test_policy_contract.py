"""What every registered policy family owes the pipeline (docs/extending.md), run over the
registry itself, so that a new family is held to it by being registered: sampling returns
the fields it declares, detached; the learner's score of what it sampled is the log-prob it
acted with (a version-0 step's behaviour weight is 1); a checkpoint folder brings it back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcvla.config.families import FAMILIES
from hpcvla.policies import POLICIES, Policy, load_pretrained, make_policy, save_pretrained

SPEC = {"image": ((32, 32, 3), "|u1"), "instruction": ((5,), "<i4"), "state": ((7,), "<f4")}
VOCAB, ACTION_DIM, CHUNK, BATCH = 12, 3, 4, 3


def build(name: str) -> Policy:
    torch.manual_seed(0)
    sized = {} if "size" not in FAMILIES[name].settings else {"size": "tiny"}
    return make_policy(name, SPEC, ACTION_DIM, CHUNK, VOCAB, **sized)


def observations() -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    return Policy.obs_to_tensors({
        "image": rng.integers(0, 256, (BATCH, 32, 32, 3), dtype=np.uint8),
        "instruction": rng.integers(1, VOCAB, (BATCH, 5)).astype(np.int32),
        "state": rng.standard_normal((BATCH, 7)).astype(np.float32)}, "cpu")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_family_samples_what_it_declares_and_scores_what_it_sampled(name, tmp_path):
    policy, obs = build(name), observations()
    # what the constructor sets for config_json (Policy's declared attributes)
    assert (policy.family, policy.obs_spec, policy.vocab_size) == (name, SPEC, VOCAB)
    assert isinstance(policy.init_args, dict)
    out, extras = policy.sample(obs)
    assert out.actions.shape == (BATCH, CHUNK, ACTION_DIM) and out.logprob.shape == (BATCH,)
    assert all(x.dtype == torch.float32 and not x.requires_grad for x in out)
    declared = policy.extra_fields()
    assert set(extras) == set(declared)
    for key, (shape, dtype) in declared.items():  # what the segments are laid out for
        assert tuple(extras[key].shape) == (BATCH, *shape), key
        assert extras[key].numpy().dtype == np.dtype(dtype), key
    logprob, value, entropy = policy.evaluate({**obs, **extras}, out.actions)
    torch.testing.assert_close(logprob.detach().reshape(BATCH, -1).sum(-1), out.logprob,
                               atol=1e-4, rtol=1e-5)
    assert value.shape == (BATCH,) and torch.isfinite(entropy).all()
    loaded = load_pretrained(save_pretrained(policy, tmp_path / "folder"))
    assert type(loaded) is type(policy)
    torch.testing.assert_close(loaded.act(obs, deterministic=True).actions,
                               policy.act(obs, deterministic=True).actions)


# each family with a learned log std parameter, as it is built with one
WITH_LOG_STD = [("default", {}), ("flow", {}),
                ("oft", {"action_head": "l1", "sequence": "official"})]


@pytest.mark.parametrize("name,settings", WITH_LOG_STD, ids=[n for n, _ in WITH_LOG_STD])
def test_a_log_std_past_its_bound_acts_at_the_bound_and_comes_back_when_asked(name, settings):
    """A log std that an optimizer step carried past LOG_STD_BOUNDS acts with the bound's
    std, and a loss that asks for less spread moves it back (torch.clamp's zero gradient kept
    the flow family's there for good, and OFT's and the default policy's were unbounded);
    one that asks for more spread does not move it further out."""
    from hpcvla.config.families import LOG_STD_BOUNDS
    torch.manual_seed(0)
    sized = {} if "size" not in FAMILIES[name].settings else {"size": "tiny"}
    policy = make_policy(name, SPEC, ACTION_DIM, CHUNK, VOCAB, **sized, **settings)
    assert isinstance(policy.log_std, torch.nn.Parameter), name
    obs, high = observations(), LOG_STD_BOUNDS[1]
    out, extras = policy.sample(obs)
    grads = {}
    for past, sign in ((high + 1.0, 1.0), (high + 1.0, -1.0), (high - 1.0, -1.0)):
        with torch.no_grad():
            policy.log_std.fill_(past)
        policy.zero_grad()
        logprob, _, entropy = policy.evaluate({**obs, **extras}, out.actions)
        (sign * entropy.sum()).backward()  # +: asks for less spread, -: for more
        grads[past, sign] = policy.log_std.grad.clone()
        if past > high:
            at_bound = policy.evaluate({**obs, **extras}, out.actions)[0]
            with torch.no_grad():
                policy.log_std.fill_(high)
            torch.testing.assert_close(at_bound, policy.evaluate({**obs, **extras},
                                                                 out.actions)[0])
    assert (grads[high + 1.0, 1.0] > 0).all(), name  # a descent step lowers it
    assert (grads[high + 1.0, -1.0] == 0).all(), name  # held at the bound
    assert (grads[high - 1.0, -1.0] < 0).all(), name  # inside: the gradient as ever
