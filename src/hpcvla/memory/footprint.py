"""What a policy's architecture costs in memory, measured without the memory: the policy is
built on the meta device, its tensors become fake ones (torch's FakeTensorMode: shapes, dtypes
and devices, no storage, no arithmetic), and a learner's micro-batch and an inference rank's
batch run through the real code while `LiveBytes` counts the bytes of every tensor storage
alive. So the figures follow the code as it is (the attention kernel's saved tensors, the
prefix cache, the denoising loop), at full size on a laptop, in seconds. docs/memory.md."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from hpcvla.factory import build_policy


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive, and their peak, counting every storage an op
    creates from when it is made until it is freed (a weak reference's callback). Storages
    made before the mode, e.g. the parameters, count once `adopt`ed."""

    def __init__(self):
        super().__init__()
        self._sizes = WeakIdKeyDictionary()
        self._refs: list[weakref.ref] = []
        self.now = self.peak = 0

    def adopt(self, tensors) -> None:
        for tensor in tensors:
            self._count(tensor)

    def reset_peak(self) -> None:
        self.peak = self.now

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[storage] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        self._refs.append(weakref.ref(storage, lambda _, size=size: self._free(size)))

    def _free(self, size: int) -> None:
        self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._count(item)
        return out


@dataclass(frozen=True)
class Footprint:
    """One policy's memory figures (bytes unless said)."""

    params: int  # parameters (elements), shared ones once
    trainable: int  # of which the learner trains (requires_grad)
    weight_bytes: int  # parameters and buffers, in the policy's dtypes
    dtype_bytes: int  # bytes per element of the trained parameters (2: bf16/fp16, 4: fp32)
    largest_layer: int  # elements of the largest module's own parameters (ZeRO-3 gathers it)
    train_obs: int  # observations in one learner micro-batch
    train_bytes: int  # peak of its forward + backward above the weights, gradients excluded
    act_obs: int  # observations in one inference batch
    act_bytes: int  # peak of `act` on it above the weights


def observation_batch(spec, extra: dict, n: int) -> dict[str, torch.Tensor]:
    """`n` observations of the env `spec` (zeros; the policy's extra fields too)."""
    obs = {k: torch.zeros((n, *shape), dtype=torch.from_numpy(np.zeros(0, dt)).dtype)
           for k, (shape, dt) in spec.obs.items()}
    obs.update({k: torch.zeros((n, *shape)) for k, (shape, _) in extra.items()})
    return obs


def policy_footprint(cfg, spec, train_obs: int, act_obs: int, on_gpus: bool) -> Footprint:
    """The configured policy's Footprint (built as the ranks build it, in the dtype that
    `on_gpus` gives `policy.dtype=auto`) for a learner micro-batch of `train_obs` and an
    inference batch of `act_obs` observations."""
    meta = build_policy(cfg, spec, device="meta", on_gpus=on_gpus)
    if cfg.learner.gradient_checkpointing:  # as engines.init_engine sets the learner's copy
        meta.enable_gradient_checkpointing()
    params, trainable, dtype_bytes, largest = parameter_counts(meta)
    validate = torch.distributions.Distribution._validate_args  # checks read values: off
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        train, act, weights = _fake_run(meta, spec, train_obs, act_obs)
    finally:
        torch.distributions.Distribution.set_default_validate_args(validate)
    return Footprint(params=params, trainable=trainable, weight_bytes=weights,
                     dtype_bytes=dtype_bytes, largest_layer=largest, train_obs=train_obs,
                     train_bytes=train, act_obs=act_obs, act_bytes=act)


def parameter_counts(policy) -> tuple[int, int, int, int]:
    """(parameters, trainable ones, bytes per trainable element, the largest module's own
    parameters) of a policy, shared parameters once (a meta-device policy will do)."""
    params = list({id(p): p for p in policy.parameters()}.values())
    trained = [p for p in params if p.requires_grad]
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in policy.modules())
    return (sum(p.numel() for p in params), sum(p.numel() for p in trained),
            trained[0].element_size() if trained else 4, largest)


def step_loss(outputs) -> torch.Tensor:
    """The scalar a measured micro-batch backpropagates, from every output (log-probs, values,
    entropies) of a policy's `evaluate` or of an engine: the model and what checks it run the
    same."""
    logprob, value, entropy = outputs
    return logprob.float().mean() + value.float().mean() + entropy.float().mean()


def drop_gradients(policy) -> None:
    """Free each trained parameter's gradient as it lands: a learner's gradients are its
    engine's, modelled apart (states.py)."""
    for p in policy.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))


def _fake_run(meta, spec, train_obs: int, act_obs: int) -> tuple[int, int, int]:
    """(peak of a micro-batch's forward + backward, peak of `act`, weights), bytes."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        policy = meta.to_empty(device="cpu")
        drop_gradients(policy)
        live = LiveBytes()
        with live:
            live.adopt([*policy.parameters(), *policy.buffers()])
            weights = live.now
            obs = observation_batch(spec, policy.extra_fields(), train_obs)
            actions = torch.zeros((train_obs, spec.chunk_len, spec.action_dim))
            outputs = policy.evaluate(obs, actions)
            step_loss(outputs).backward()
            train = live.peak - weights
            del obs, actions, outputs
            live.reset_peak()
            base = live.now
            with torch.no_grad():
                obs = observation_batch(spec, policy.extra_fields(), act_obs)
                policy.act(obs)
            act = live.peak - base
    return train, act, weights
