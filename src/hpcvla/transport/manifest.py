"""The flat layout of a policy's weights that the weight plane (weights.py) moves: which
tensor sits where, in what dtype and shape, and which never change after the first version."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hpcvla.transport.records import aligned

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Manifest:
    """Names, dtypes (torch's names: float32, bfloat16, ...) and shapes of the tensors in a
    flat weight buffer, in order, each at a 64-byte aligned offset. Torch, not numpy, reads
    and writes it: numpy has no bfloat16, the dtype GPU policies train and act in, and a
    GPU tensor copies to and from the host buffer directly. Its layout (offsets, sizes) needs
    no torch: a simulator rank holds a node's weight window without importing it."""
    entries: tuple[tuple[str, str, tuple[int, ...]], ...]
    frozen: frozenset[str] = frozenset()  # names training never changes: sent with version 1 only

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor | np.ndarray],
           frozen: Iterable[str] = ()) -> "Manifest":
        import torch
        return cls(tuple((name, str(torch.as_tensor(t).dtype).removeprefix("torch."),
                          tuple(t.shape)) for name, t in tensors.items()), frozenset(frozen))

    @classmethod
    def of_policy(cls, policy: torch.nn.Module) -> "Manifest":
        """The policy's state dict, its parameters that do not require a gradient frozen."""
        frozen = {name for name, p in policy.named_parameters(remove_duplicate=False)
                  if not p.requires_grad}
        return cls.of(policy.state_dict(), frozen)

    @property
    def trainable(self) -> list[str]:
        return [name for name, _, _ in self.entries if name not in self.frozen]

    def regions(self, names: Iterable[str] | None = None) -> list[tuple[int, int]]:
        """(offset, bytes) of the named tensors (all by default) in the flat layout, adjacent
        ones merged: laid one after another, they are the packed layout (`views(...,
        packed=True)`)."""
        wanted = None if names is None else set(names)
        out: list[list[int]] = []
        for name, _, _, off, n in self.layout():
            if wanted is not None and name not in wanted:
                continue
            if out and out[-1][0] + out[-1][1] == off:
                out[-1][1] = off + n - out[-1][0]
            elif n:
                out.append([off, n])
        return [(offset, n) for offset, n in out]

    def layout(self) -> list[tuple[str, str, tuple[int, ...], int, int]]:
        """(name, dtype, shape, offset, bytes) of every tensor, in order."""
        out: list[tuple[str, str, tuple[int, ...], int, int]] = []
        offset = 0
        for name, dtype, shape in self.entries:
            n = _itemsize(dtype) * math.prod(shape)
            out.append((name, dtype, shape, offset, n))
            offset += aligned(n)
        return out

    @property
    def nbytes(self) -> int:
        return sum(aligned(_itemsize(dt) * math.prod(shape)) for _, dt, shape in self.entries)

    @property
    def hash(self) -> int:
        return zlib.crc32(repr((self.entries, sorted(self.frozen))).encode())

    def views(self, flat: np.ndarray, names: Iterable[str] | None = None,
              packed: bool = False) -> dict[str, torch.Tensor]:
        """Tensors viewing `flat` (uint8), by name (all by default): at their places in the
        flat layout (`flat` at least nbytes long), or `packed`: the named ones one after
        another, no padding between them (the regions' bytes, laid end to end: exactly the
        named tensors' bytes cross the network; the host copies tolerate any alignment)."""
        import torch
        wanted = None if names is None else set(names)
        out, at = {}, 0
        for name, dtype, shape, off, n in self.layout():
            if wanted is None or name in wanted:
                start = at if packed else off
                out[name] = torch.from_numpy(flat[start:start + n]).view(
                    getattr(torch, dtype)).reshape(shape)
                at += n
        return out

    def flatten(self, tensors: Mapping[str, torch.Tensor | np.ndarray],
                out: np.ndarray | None = None, names: Iterable[str] | None = None,
                packed: bool = False) -> np.ndarray:
        """Copy `tensors` (on any device; numpy arrays too; those named, all by default) into
        their places in a flat host buffer, or packed (`views`)."""
        import torch
        out = np.zeros(self.nbytes, np.uint8) if out is None else out
        with torch.no_grad():
            for name, view in self.views(out, names, packed).items():
                view.copy_(torch.as_tensor(tensors[name]))
        return out


def _itemsize(dtype: str) -> int:
    """Bytes per element of torch's dtype `dtype`: numpy's figure where numpy has the dtype,
    2 for bfloat16, torch's for the rest (float8 and the like)."""
    if dtype == "bfloat16":
        return 2
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        import torch
        itemsize: int = getattr(torch, dtype).itemsize
        return itemsize
