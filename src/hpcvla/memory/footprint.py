"""What a policy's architecture costs in memory, measured without the memory: the policy is
built on the meta device, and a learner's micro-batch and an inference rank's batch run
through the real code on tensors without storage while `LiveBytes` counts the bytes of every
tensor storage alive. So the figures follow the code as it is (the attention kernel's saved
tensors, the prefix cache, the denoising loop), at full size on a laptop.

A VLA policy runs as shallow copies of itself, two or three layers per transformers stack, on
meta tensors that take the CPU's paths (cpu_meta.py), and its figures are extrapolated to its
depths phase by phase (depths.py), to the byte: full-size π0 in half a second, where running
it whole on CPU fake tensors (torch's FakeTensorMode, what the figures were validated with)
took ~10 s. Any other policy, or one whose copies do not line up, still runs whole on fake
tensors. docs/memory.md."""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from hpcvla.factory import build_policy, constructor_kwargs, published_folder
from hpcvla.memory import depths
from hpcvla.memory.cpu_meta import CpuKernels, cpu_attention, tensors_in
from hpcvla.memory.states import fields_bytes
from hpcvla.policies.lora import add_lora
from hpcvla.policies.registry import make_policy


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive, and their peak, counting every storage an op
    creates from when it is made until it is freed (a weak reference's callback). Storages
    made before the mode, e.g. the parameters, count once `adopt`ed. With `phases`
    (depths.Phases) set, also the peak of each phase (`peaks`). `kernels`: what runs each op
    (cpu_meta.CpuKernels, on meta tensors: then only meta tensors count, not cpu_attention's
    CPU stand-ins); default: the op as dispatched."""

    def __init__(self, kernels: CpuKernels | None = None):
        super().__init__()
        self._alive: dict[int, weakref.ref] = {}  # id(storage) -> a weak reference to it
        self.now = self.peak = 0
        self.kernels = kernels
        self.phases, self.phase, self.peaks = None, None, {}

    def adopt(self, tensors) -> None:
        for tensor in tensors:
            self._count(tensor)

    def reset_peak(self) -> None:
        self.peak = self.now

    def _count(self, tensor: torch.Tensor) -> None:
        if self.kernels is not None and not tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._alive:
            return
        size = storage.nbytes()
        self._alive[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))
        self.now += size
        self.peak = max(self.peak, self.now)
        if self.phases is not None:
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.now)

    def _free(self, key: int, size: int) -> None:
        del self._alive[key]
        self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.phases is not None:
            self.phase = self.phases.current()
        kwargs = kwargs or {}
        out = func(*args, **kwargs) if self.kernels is None else self.kernels(func, args, kwargs)
        if isinstance(out, torch.Tensor):  # most ops: one tensor
            self._count(out)
        else:
            for tensor in tensors_in(out):
                self._count(tensor)
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
    recorded_bytes: int = 0  # what acting records beside each observation (extra_fields)


def observation_batch(spec, extra: dict, n: int) -> dict[str, torch.Tensor]:
    """`n` observations of the env `spec` (zeros; the policy's extra fields too)."""
    obs = {k: torch.zeros((n, *shape), dtype=torch.from_numpy(np.zeros(0, dt)).dtype)
           for k, (shape, dt) in spec.obs.items()}
    obs.update({k: torch.zeros((n, *shape)) for k, (shape, _) in extra.items()})
    return obs


def policy_footprint(cfg, spec, train_obs: int, act_obs: int, on_gpus: bool,
                     imitation: bool = False) -> Footprint:
    """The configured policy's Footprint (built as the ranks build it, in the dtype that
    `on_gpus` gives `policy.dtype=auto`) for a learner micro-batch of `train_obs` and an
    inference batch of `act_obs` observations. `imitation`: the micro-batch trains the
    family's imitation loss (`hpcvla sft`), else the RL loss's `evaluate`."""
    with _collector_paused():
        try:
            found = shallow_footprint(cfg, spec, train_obs, act_obs, on_gpus, imitation)
        except NotImplementedError:  # an op without a meta kernel: fake tensors may run it
            found = None
        return found or whole_footprint(cfg, spec, train_obs, act_obs, on_gpus, imitation)


@contextmanager
def _unchecked_distributions():
    """torch.distributions' argument checks off for the while: they read values, which
    tensors without storage do not have."""
    validate = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(validate)


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for the while: a measurement makes many
    short-lived objects (and the first one imports transformers), and each full pass of the
    collector goes over every object torch and transformers hold (~0.15 s each; 0.3 s of π0's
    `hpcvla plan`). The runs' tensors are freed by reference counts, which LiveBytes follows,
    not by the collector."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def whole_footprint(cfg, spec, train_obs: int, act_obs: int, on_gpus: bool,
                    imitation: bool = False) -> Footprint:
    """policy_footprint by running the whole policy on CPU fake tensors."""
    meta = build_policy(cfg, spec, device="meta", on_gpus=on_gpus)
    if cfg.learner.gradient_checkpointing:  # as engines.init_engine sets the learner's copy
        meta.enable_gradient_checkpointing()
    params, trainable, dtype_bytes, largest = parameter_counts(meta)
    train, act, weights = _fake_run(meta, spec, train_obs, act_obs, imitation)
    return Footprint(params=params, trainable=trainable, weight_bytes=weights,
                     dtype_bytes=dtype_bytes, largest_layer=largest, train_obs=train_obs,
                     train_bytes=train, act_obs=act_obs, act_bytes=act,
                     recorded_bytes=fields_bytes(meta.extra_fields()))


def shallow_footprint(cfg, spec, train_obs: int, act_obs: int, on_gpus: bool,
                      imitation: bool = False) -> Footprint | None:
    """policy_footprint from the policy's shallow copies (depths.py) on meta tensors; None for
    a policy without transformers stacks, or where the copies' phases do not line up."""
    kwargs = constructor_kwargs(cfg, on_gpus)
    size = resolved_size(cfg.policy.name, kwargs.get("size"), spec)
    if not depths.depth_stacks(size):
        return None

    kernels = CpuKernels()  # one for every copy: what it remembers serves them all
    recorded = []  # the extra fields depend on the model's dims and sampler, not its depth

    def measure(shallow) -> Shallow:
        policy = _build_meta(cfg, spec, {**kwargs, "size": shallow})
        recorded.append(fields_bytes(policy.extra_fields()))
        return _meta_run(policy, spec, train_obs, act_obs, kernels, imitation)

    layers = depths.MIDDLES_BASE if imitation else depths.BASE  # depths.py says why
    sizes, varied, base = depths.variants(size, layers)
    runs = [measure(sizes[0])]
    if runs[0].stacks < len(depths.depth_stacks(size)):  # a stack Phases cannot see
        return None
    if runs[0].shortfall:  # a stack skips layers (OFT's towers): it must still run as many
        sizes, varied, base = depths.variants(size, layers + runs[0].shortfall)
        runs = [measure(sizes[0])]
    runs += [measure(shallow) for shallow in sizes[1:]]
    train, act = (depths.extrapolate([getattr(run, part) for run in runs], varied, base)
                  for part in ("train", "act"))
    if train is None or act is None:
        return None
    params, trainable, weights = (
        depths.at_depths([getattr(run, field) for run in runs], varied, base)
        for field in ("params", "trainable", "weight_bytes"))
    return Footprint(params=params, trainable=trainable, weight_bytes=weights,
                     dtype_bytes=runs[0].dtype_bytes, largest_layer=runs[0].largest_layer,
                     train_obs=train_obs, train_bytes=train, act_obs=act_obs, act_bytes=act,
                     recorded_bytes=recorded[0])


@dataclass
class Shallow:
    """A shallow copy's figures (_meta_run): its peaks by phase (depths.Phases.named)."""

    params: int
    trainable: int
    dtype_bytes: int
    largest_layer: int
    weight_bytes: int
    train: dict  # phase -> peak of a micro-batch's forward + backward above the weights
    act: dict  # phase -> peak of `act` above the weights
    stacks: int  # transformers stacks seen (depths.Phases)
    shortfall: int  # the most layers a stack has but did not run


def _build_meta(cfg, spec, kwargs):
    """The configured policy on the meta device with constructor arguments `kwargs`
    (factory.build_policy's meta branch, for a shallow copy's size), as the learner sets it."""
    with torch.device("meta"):
        policy = make_policy(cfg.policy.name, spec.obs, spec.action_dim, spec.chunk_len,
                             len(spec.vocab), **kwargs)
        if cfg.policy.lora_rank:
            add_lora(policy, cfg.policy.lora_rank, cfg.policy.lora_alpha)
    if cfg.learner.gradient_checkpointing:  # as engines.init_engine sets the learner's copy
        policy.enable_gradient_checkpointing()
    policy.published = published_folder(cfg)  # what it records beside each step
    return policy


def resolved_size(name: str, size, spec) -> dict | None:
    """A VLA policy's size as the configs its constructor resolves a preset name to (the
    env's image size and vocabulary); None for a policy without one."""
    from hpcvla.policies.registry import POLICIES
    if size is None or isinstance(size, dict):
        return size
    return POLICIES[name].resolved_size(size, spec.obs, len(spec.vocab))


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


def _learn(policy, spec, n: int, imitation: bool = False) -> None:
    """One micro-batch of `n` observations forward and backward: through the RL loss's
    `evaluate`, or with `imitation` the family's imitation loss on chunks of real steps."""
    obs = observation_batch(spec, policy.extra_fields(), n)
    actions = torch.zeros((n, spec.chunk_len, spec.action_dim))
    if imitation:  # the steps `hpcvla sft` supervises from each observation
        steps = policy.imitation_horizon
        loss = policy.imitation_loss(obs, torch.zeros((n, steps, spec.action_dim)),
                                     torch.ones((n, steps), dtype=bool))
    else:
        outputs = policy.evaluate(obs, actions)  # alive through the backward
        loss = step_loss(outputs)
    if loss.requires_grad:  # a steered flow policy (DSRL) trains none of what this runs:
        loss.backward()     # its learner steps only the small noise actor (an over-count)


def _act(policy, spec, n: int) -> None:
    with torch.no_grad():
        policy.act(observation_batch(spec, policy.extra_fields(), n))


def _fake_run(meta, spec, train_obs: int, act_obs: int,
              imitation: bool) -> tuple[int, int, int]:
    """(peak of a micro-batch's forward + backward, peak of `act`, weights), bytes."""
    with FakeTensorMode(allow_non_fake_inputs=True), _unchecked_distributions():
        policy = meta.to_empty(device="cpu")
        drop_gradients(policy)
        live = LiveBytes()
        with live:
            live.adopt([*policy.parameters(), *policy.buffers()])
            weights = live.now
            _learn(policy, spec, train_obs, imitation)
            train = live.peak - weights
            live.reset_peak()
            base = live.now
            _act(policy, spec, act_obs)
            act = live.peak - base
    return train, act, weights


def _meta_run(policy, spec, train_obs: int, act_obs: int, kernels: CpuKernels,
              imitation: bool) -> Shallow:
    """A meta-device policy's figures, run on meta tensors that take the CPU's paths
    (`kernels`)."""
    counts = parameter_counts(policy)
    drop_gradients(policy)
    live = LiveBytes(kernels)
    peaks, shortfall, stacks = [], 0, 0
    with torch.device("meta"), cpu_attention(), _unchecked_distributions(), live:  # on meta
        live.adopt([*policy.parameters(), *policy.buffers()])
        weights = live.now
        for run in (lambda: _learn(policy, spec, train_obs, imitation),
                    lambda: _act(policy, spec, act_obs)):
            before = live.now
            phases = live.phases = depths.Phases(policy, middles=imitation)
            live.peaks = {}
            try:
                run()
            finally:
                phases.close()
                live.phases = None
            peaks.append({name: peak - before for name, peak in phases.named(live.peaks).items()})
            shortfall, stacks = max(shortfall, phases.shortfall()), len(phases.layers)
    return Shallow(*counts, weights, *peaks, stacks, shortfall)
