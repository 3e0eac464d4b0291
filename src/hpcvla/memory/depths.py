"""A full-size policy's memory from shallow copies of it: the same policy with two or three
layers per transformers stack, measured phase by phase and extrapolated to the configured
depths (footprint.shallow_footprint). π0's 63 layers took ~10 s to run whole on fake tensors;
its three copies take half a second on meta tensors.

Why this is exact. The layers of a stack are one module repeated on the same shapes, so what
runs inside layer k, or between stacks, is the same at every depth but for what the earlier
layers left alive (saved activations, the prefix cache): a fixed number of bytes per layer.
Within one *phase* of a run the bytes alive are therefore an affine function of the stacks'
depths plus what the phase itself allocates, and so is the phase's peak. The run's peak is
not: it is the largest phase's, and which phase is largest changes with depth (π0's
micro-batch without checkpointing: Gemma's backward in the copies, the action expert's at
full depth, where its four passes' saved activations have grown; extrapolating the copies'
peaks alone falls 3-5 % short). So each phase's peak is measured apart, in a base copy and in
one a layer deeper for each group of stacks that share a depth (π0: SigLIP's 27; Gemma's and
its expert's 18), extrapolated alone, and the largest taken at the configured depths.
Parameters and weights are affine in the depths as they are.

Phases, named alike at every depth: inside a stack's first layer and inside its last layer
(the n-th time each runs), after its last layer, before any; forward or backward. The first
layer differs from the rest (its input is the embeddings), so a stack must run two layers at
least; a middle layer peaks between the first and the last (affine in its index) and needs
no phase of its own. Not so under an imitation loss that leaves part of a stack's last layer
unused (flow matching reads the prefix's keys and values, not its last hidden state): its
last layer differs too, and with gradient checkpointing a middle layer's backward peaks
above both ends. There the copies run three layers at least (MIDDLES_BASE) and a middle
layer's phases are named by the second and the second-to-last layer, each affine in the
depth. Forward ops are placed by hooks on the layers; a backward op by the
forward phase that made the autograd node it runs in (torch numbers nodes as it makes them),
which also places a checkpointed layer's recompute. tests/test_memory.py checks the figures
equal the whole policy's."""

from __future__ import annotations

import copy
from bisect import bisect_right
from collections import Counter

import torch

BASE = 2  # layers per stack in the shallowest copy
MIDDLES_BASE = 3  # ... where the middle layers have phases of their own (an imitation loss)


def depth_stacks(size) -> list[dict]:
    """The transformers configs in a policy's resolved size that have a depth
    (`num_hidden_layers`): flow's vision/text/expert, tokens' vision/text, oft's
    dino/siglip/llm."""
    out = []
    for value in (size or {}).values():
        if isinstance(value, dict):
            out += [value] if "num_hidden_layers" in value else depth_stacks(value)
    return out


def variants(size, base_depth: int) -> tuple[list[dict], list[int], dict[int, int]]:
    """The sizes of the shallow copies to measure: the base (every stack at `base_depth`
    layers, or at its own depth where that is less), then one per group of stacks sharing a
    depth, that group a layer deeper. Also the groups made deeper (their depths, in the
    copies' order) and every group's base."""
    groups = sorted({s["num_hidden_layers"] for s in depth_stacks(size)})
    base = {depth: min(depth, base_depth) for depth in groups}
    varied = [depth for depth in groups if depth > base[depth]]

    def copy_at(deeper):
        out = copy.deepcopy(size)
        for stack in depth_stacks(out):
            depth = stack["num_hidden_layers"]
            stack["num_hidden_layers"] = base[depth] + (depth == deeper)
        return out
    return [copy_at(None)] + [copy_at(depth) for depth in varied], varied, base


def at_depths(values: list[int], varied: list[int], base: dict[int, int]) -> int:
    """A figure affine in the depths, at the configured depths, from its values in the base
    copy (values[0]) and in the copies a layer deeper in one group (`varied`'s order)."""
    return values[0] + sum((value - values[0]) * (depth - base[depth])
                           for value, depth in zip(values[1:], varied))


def extrapolate(runs: list[dict], varied: list[int], base: dict[int, int]) -> int | None:
    """The largest phase at the configured depths, from each copy's peaks by phase (at_depths'
    order); None where the copies do not have the same phases."""
    if any(run.keys() != runs[0].keys() for run in runs):
        return None
    return max(at_depths([run[phase] for run in runs], varied, base) for phase in runs[0])


class Phases:
    """The phase of each op of a run of `policy` (`current()`), by hooks on every layer of its
    transformers stacks (ModuleLists of transformers' GradientCheckpointingLayer). A forward
    phase is ("start",) or (stack, layer index, n-th entry, "in" | "after"); a backward one is
    ("backward", *the forward phase). `middles`: name a middle layer's phases (MIDDLES_BASE)."""

    def __init__(self, policy, middles: bool = False):
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.middles = middles
        self.label: tuple = ("start",)
        self.entered: Counter = Counter()
        self.numbers, self.labels = [0], [self.label]  # forward phases by first node number
        self.forward_end = None  # the number of the first node made after the forward
        self.layers: dict[str, int] = {}  # stack -> its layers
        self.ran: dict[str, int] = {}  # stack -> the layers it ran
        self.handles = []
        for name, module in policy.named_modules():
            if isinstance(module, torch.nn.ModuleList) and len(module) and \
                    all(isinstance(m, GradientCheckpointingLayer) for m in module):
                self.layers[name] = len(module)
                for k, layer in enumerate(module):
                    self.handles += [
                        layer.register_forward_pre_hook(lambda *_, at=(name, k): self._enter(at)),
                        layer.register_forward_hook(lambda *_, at=(name, k): self._leave(at))]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def current(self) -> tuple:
        """Forward: the layer running or the last one left. Backward: the forward phase that
        made the node running (a node made after the forward, AccumulateGrad: the phase
        before)."""
        node = torch._C._current_autograd_node()
        if node is not None:
            if self.forward_end is None:  # the backward begins
                self.forward_end = torch.autograd._get_sequence_nr()
            if node._sequence_nr() < self.forward_end:
                made = self.labels[bisect_right(self.numbers, node._sequence_nr()) - 1]
                self.label = ("backward", *made)
        return self.label

    def shortfall(self) -> int:
        """The most layers a stack has but never ran (OFT's vision towers skip their last)."""
        return max((n - self.ran.get(stack, 0) for stack, n in self.layers.items()), default=0)

    def named(self, peaks: dict[tuple, int]) -> dict[tuple, int]:
        """Peaks by phase -> by names that mean the same at every depth: inside a stack's
        first and last layer it runs and after its last (after another layer, in the gap to
        the next, is that layer's phase); middle layers are left out, or with `middles` named
        by the second and the second-to-last."""
        out: dict[tuple, int] = {}
        for phase, peak in peaks.items():
            names = [phase]
            if len(phase) > 3:
                *direction, stack, k, n, where = phase
                last = self.ran[stack] - 1
                ends = [("first", 0), ("last", last)] + \
                    [("second", 1), ("second to last", last - 1)] * self.middles
                names = [(*direction, stack, "after", n)] if where == "after" and k == last \
                    else [(*direction, stack, role, n) for role, index in ends if k == index]
            for name in names:
                out[name] = max(out.get(name, 0), peak)
        return out

    def _enter(self, at) -> None:
        if torch._C._current_autograd_node() is None:  # not a recompute in backward
            stack, k = at
            self.ran[stack] = max(self.ran.get(stack, 0), k + 1)
            self._mark((*at, self.entered[at], "in"))
            self.entered[at] += 1

    def _leave(self, at) -> None:
        if torch._C._current_autograd_node() is None:
            self._mark((*at, self.entered[at] - 1, "after"))

    def _mark(self, label) -> None:
        self.label = label
        self.numbers.append(torch.autograd._get_sequence_nr())  # the next node's number
        self.labels.append(label)
