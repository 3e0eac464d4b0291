"""A bounded replay buffer of transitions in host memory, for an off-policy learner (SAC,
algorithms/sac.py), and RLPD's symmetric sampling of online and demonstration data.

The buffer is a ring of numpy arrays, one per field, laid out from a spec {name: (shape,
dtype)} when it is built: its size in bytes is known before launch (`nbytes_of`), so a planner
can count it against a node's memory, and it never grows. When full, each new transition
overwrites the oldest. Two counts describe it: `size`, the transitions it holds now, and
`position`, every transition ever added: the learner's exactly-once count, which keeps
growing after the ring wraps. Held transitions are not checkpointed (roles/off_policy.py: a
resumed learner refills its buffer).

The held transitions are always the `size` most recent ones, in the slots
(position - size + i) % capacity, i = 0 (oldest) ... size - 1 (newest).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

FieldSpecs = Mapping[str, tuple[tuple[int, ...], DTypeLike]]


class ReplayBuffer:
    """`capacity` transitions of the fields in `specs` ({name: (per-transition shape, numpy
    dtype)}), in host memory, overwritten oldest first once full."""

    def __init__(self, specs: FieldSpecs, capacity: int,
                 held: Mapping[str, np.ndarray] | None = None) -> None:
        """`held`: a full buffer of these `capacity` transitions ({field: (capacity, *shape)}),
        not copied: RLPD's prior data in a node's one shared copy (read-only there)."""
        if capacity <= 0:
            raise ValueError(f"replay capacity {capacity}: expected > 0 transitions")
        if not specs:
            raise ValueError("replay buffer without fields: give at least one")
        self.capacity = int(capacity)
        self.specs = {name: (tuple(shape), np.dtype(dtype))
                      for name, (shape, dtype) in specs.items()}
        self._data = {name: np.zeros((self.capacity, *shape), dtype)
                      for name, (shape, dtype) in self.specs.items()} if held is None else \
            self._checked(held)
        self._position = self._size = 0 if held is None else self.capacity
        if held is not None and len(next(iter(self._data.values()))) != self.capacity:
            raise ValueError(f"replay buffer of {self.capacity} transitions held: its arrays "
                             f"have {len(next(iter(self._data.values())))}")

    @staticmethod
    def nbytes_of(specs: FieldSpecs, capacity: int) -> int:
        """Bytes a buffer of `capacity` transitions of `specs` takes, without building it."""
        return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                   for shape, dtype in specs.values()) * int(capacity)

    @property
    def nbytes(self) -> int:
        return self.nbytes_of(self.specs, self.capacity)

    @property
    def size(self) -> int:
        """Transitions held now (at most capacity)."""
        return self._size

    @property
    def position(self) -> int:
        """Transitions ever added, overwritten ones included."""
        return self._position

    def __len__(self) -> int:
        return self._size

    def add(self, batch: Mapping[str, Any]) -> None:
        """Append the N transitions of `batch` ({field: (N, *shape) array}), every field of
        the specs and no other, each of its spec's shape and dtype. Beyond capacity, the
        oldest are overwritten, so a batch larger than the buffer leaves its newest
        `capacity` transitions."""
        arrays = self._checked(batch)
        n = len(next(iter(arrays.values())))
        kept = min(n, self.capacity)
        slots = self._slots(self._position + n - kept, kept)
        for name, array in arrays.items():
            self._data[name][slots] = array[n - kept:]
        self._position += n
        self._size = min(self._size + n, self.capacity)

    def sample(self, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """`n` transitions drawn uniformly, with replacement, from those held (copies)."""
        if self._size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        if n < 0:
            raise ValueError(f"sample of {n} transitions: expected >= 0")
        slots = self._slots(self._position - self._size, self._size)[
            rng.integers(0, self._size, n)]
        return {name: data[slots] for name, data in self._data.items()}

    def _slots(self, first: int, count: int) -> np.ndarray:
        """The ring slots of `count` consecutive transitions from number `first` on."""
        return (first + np.arange(count, dtype=np.int64)) % self.capacity

    def _checked(self, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The batch's fields as arrays, after checking them against the specs, with a
        ValueError naming the first field that does not match."""
        missing = sorted(set(self.specs) - set(batch))
        extra = sorted(set(batch) - set(self.specs))
        if missing or extra:
            raise ValueError(f"replay batch fields: missing {missing}, unexpected {extra} "
                             f"(the buffer holds {sorted(self.specs)})")
        arrays = {name: np.asarray(batch[name]) for name in self.specs}
        length = None
        for name, array in arrays.items():
            shape, dtype = self.specs[name]
            if array.ndim != len(shape) + 1 or array.shape[1:] != shape:
                expected = "(N" + "".join(f", {d}" for d in shape) + ")"
                raise ValueError(f"replay field {name!r}: shape {array.shape}, expected "
                                 f"{expected}")
            if array.dtype != dtype:
                raise ValueError(f"replay field {name!r}: dtype {array.dtype}, expected "
                                 f"{dtype}")
            if length is not None and len(array) != length:
                raise ValueError(f"replay field {name!r}: {len(array)} transitions, the "
                                 f"fields before it {length}")
            length = len(array)
        return arrays


def symmetric_sample(online: ReplayBuffer, demos: ReplayBuffer, n: int,
                     rng: np.random.Generator) -> dict[str, np.ndarray]:
    """RLPD's symmetric sampling (Ball et al. 2023): half of a batch of `n` from the online
    buffer, half from the demonstrations (the odd one online), concatenated online first.
    Fixed halves keep the demonstrations' weight from fading as the online data grows."""
    for name, buffer in (("online", online), ("demonstration", demos)):
        if buffer.size == 0:
            raise ValueError(f"symmetric sampling: the {name} replay buffer is empty")
    if online.specs != demos.specs:
        raise ValueError(f"symmetric sampling: online fields {online.specs} and "
                         f"demonstration fields {demos.specs} differ")
    if n < 0:
        raise ValueError(f"symmetric sample of {n} transitions: expected >= 0")
    first, second = online.sample(n - n // 2, rng), demos.sample(n // 2, rng)
    return {name: np.concatenate([first[name], second[name]]) for name in online.specs}


__all__ = ["ReplayBuffer", "symmetric_sample"]
