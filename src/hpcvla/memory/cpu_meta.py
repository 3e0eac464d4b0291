"""Meta tensors that take the CPU's paths, what footprint.py runs a policy on: the meta device
has shapes, dtypes and strides but no storage and no arithmetic, like the CPU fake tensors
(torch's FakeTensorMode) that tests/test_memory.py checks these figures against, but each op
costs a fraction. Where the meta kernels would differ from the CPU's, these mirror the CPU:

* attention (`cpu_attention`): the meta device takes SDPA's math path, which makes and saves
  the attention weights; the CPU takes its flash kernel where it can.
* a half-precision layer norm keeps its mean and rstd in the input's dtype on the CPU (meta
  and CUDA: float32): `CpuKernels`.

tests/test_memory.py checks the figures equal FakeTensorMode's on CPU fake tensors."""

from __future__ import annotations

import math
from collections import namedtuple
from contextlib import contextmanager

import torch
import torch.nn.functional as F

LAYER_NORM = torch.ops.aten.native_layer_norm.default
FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
Made = namedtuple("Made", "shape stride dtype")  # a new tensor an op made, remembered


class CpuKernels:
    """Runs an op on meta tensors as the CPU would (the module docstring; footprint.LiveBytes
    calls it for every op), remembering each op's results by the metadata of its arguments:
    many of torch's meta kernels are Python (an elementwise op takes ~0.15 ms), and a stack's
    layers repeat the same ops on the same shapes. Only ops that make new storages are
    remembered; views and in-place ops run each time."""

    def __init__(self):
        self.known: dict = {}
        self.uncached: set = set()  # ops seen returning an argument's storage

    def __call__(self, func, args, kwargs):
        key = None
        if func not in self.uncached:
            try:
                key = (func, _metadata(args), _metadata(tuple(kwargs.items())) if kwargs else ())
            except NotMeta:  # e.g. cpu_attention's stand-ins
                pass
            if key in self.known:
                return _make(self.known[key])
        out = func(*args, **kwargs)
        if func is LAYER_NORM and out[1].dtype != args[0].dtype:
            out = (out[0], *(t.to(args[0].dtype) for t in out[1:]))
        if key is not None and all(t.is_meta for t in tensors_in(out)):
            if _fresh(func, (args, kwargs), out):
                self.known[key] = _describe(out)
            else:
                self.uncached.add(func)
        return out


class NotMeta(Exception):
    pass


def _metadata(x):
    """A hashable key of an op's arguments: tensors by shape, strides and dtype."""
    if isinstance(x, torch.Tensor):
        if not x.is_meta:
            raise NotMeta
        return x.shape, x.stride(), x.dtype
    if isinstance(x, (list, tuple)):
        return tuple([_metadata(item) for item in x])
    return x


def tensors_in(x):
    """The tensors of an op's arguments or results (tensors, lists of them, keyword dicts)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            yield from tensors_in(item)
    elif isinstance(x, dict):
        yield from tensors_in(list(x.values()))


def _fresh(func, arguments, out) -> bool:
    """Whether `func` made each tensor of `out` on a new storage of exactly its extent."""
    if func._schema.is_mutable:
        return False
    made = list(tensors_in(out))
    storages = {t.untyped_storage()._cdata for t in made}
    given = {t.untyped_storage()._cdata for t in tensors_in(arguments)}
    return len(storages) == len(made) and not storages & given and all(
        t.storage_offset() == 0 and min(t.shape, default=1) > 0 and
        t.untyped_storage().nbytes() == t.element_size() * (
            1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) for t in made)


def _describe(out):
    if isinstance(out, torch.Tensor):
        return Made(out.shape, out.stride(), out.dtype)
    if isinstance(out, (list, tuple)):
        return type(out)(_describe(item) for item in out)
    return out


def _make(made):
    if isinstance(made, Made):
        return torch.empty_strided(made.shape, made.stride, dtype=made.dtype, device="meta")
    if isinstance(made, (list, tuple)):
        return type(made)(_make(item) for item in made)
    return made


@contextmanager
def cpu_attention():
    """Scaled dot-product attention on meta tensors as the CPU runs it: its flash kernel
    where the CPU's own choice says so (asked with stand-ins of the same shapes, dtypes and
    last strides: one row of memory each), else the math path, which both devices share.
    transformers calls it as `torch.nn.functional.scaled_dot_product_attention`, which this
    replaces for the while (for the process's other threads too): a TorchFunctionMode would
    miss the recompute of a checkpointed layer (`backward`, a torch function itself, runs
    with the function modes popped)."""
    math_path = F.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False):
        choice = torch._fused_sdp_choice(
            _stand_in(query), _stand_in(key), _stand_in(value), _stand_in(attn_mask),
            dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if choice != FLASH:
            return math_path(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                             enable_gqa=enable_gqa)
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as ATen converts it
            like = dict(dtype=query.dtype, device=query.device)
            minus_inf = torch.scalar_tensor(-math.inf, **like)
            attn_mask = torch.where(attn_mask, torch.scalar_tensor(0.0, **like), minus_inf)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = math_path


def _stand_in(t: torch.Tensor | None) -> torch.Tensor | None:
    """A CPU tensor with `t`'s shape, dtype and last stride, on a storage of one row."""
    if t is None:
        return None
    row = torch.empty(max(1, (t.shape[-1] - 1) * t.stride(-1) + 1), dtype=t.dtype, device="cpu")
    return row.as_strided(t.shape, (0,) * (t.dim() - 1) + (t.stride(-1),))
