"""What the pipeline's prologue (roles/prologue.py) gives every role loop: one small typed
object instead of the same half-dozen positional arguments in every entry point."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from hpcvla.metrics.progress import Progress
from hpcvla.metrics.timeline import Timeline

if TYPE_CHECKING:
    from hpcvla.config.schema import Config

# What a role counts, by name, as summary.json holds it (RankSummary.add): numbers, and lists
# and dicts of them, a different shape per counter
Counters: TypeAlias = dict[str, Any]


@dataclass(frozen=True)
class RoleSetup:
    cfg: Config
    rank: int  # world rank
    run_dir: Path
    timeline: Timeline  # this rank's busy spans
    progress: Progress  # the learning progress; it writes on the weight root only
    first_version: int  # the policy version training starts from: 0, or the one resumed

    @property
    def total_updates(self) -> int:
        return self.cfg.pipeline.total_updates

    @property
    def emulated_inference_ms(self) -> Callable[[int], float] | None:
        """The emulated forward-pass time of a batch of n envs (emulate.inference_ms +
        n x emulate.inference_ms_per_env), or None where nothing is emulated."""
        a, b = self.cfg.emulate.inference_ms, self.cfg.emulate.inference_ms_per_env
        return (lambda envs: a + b * envs) if (a or b) else None
