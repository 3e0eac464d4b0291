"""TensorBoard event files of a run, written by the standard writer
(`torch.utils.tensorboard.SummaryWriter`, the `tensorboard` package), so that
`tensorboard --logdir runs/` on a login node shows every run under `runs/` live.

One writer per run directory, on the rank that owns the learning progress (the weight root)
and in `hpcvla eval --all`. The x axis is trained env steps (all learners), as Sample Factory
and CleanRL plot it, so runs with different batch sizes line up. Tags are grouped by what they
measure: `train/*` (loss statistics of each micro-batch's last epoch), `rollout/*` (episodes
inside trained segments), `perf/*` (throughput, staleness, busy fractions), `eval/*`.
"""

from __future__ import annotations

from pathlib import Path

SUBDIR = "tensorboard"
GROUPS = {"success_rate": "rollout", "mean_return": "rollout"}  # the rest of a record: train/*


class RunBoard:
    """Scalars of one run into `<run_dir>/tensorboard/` (nothing when disabled)."""

    def __init__(self, run_dir, enabled: bool = True):
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / SUBDIR))

    def scalars(self, values: dict, step: int, group: str | None = None) -> None:
        """`values` name -> number at `step`; each under `group/` (or its GROUPS entry,
        default `train`)."""
        if self.writer is None:
            return
        for name, value in values.items():
            tag = name if "/" in name else f"{group or GROUPS.get(name, 'train')}/{name}"
            self.writer.add_scalar(tag, float(value), global_step=int(step))

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def read_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a run's event files, tag -> [(step, value)] (for tests and
    scripts; TensorBoard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(Path(run_dir) / SUBDIR), size_guidance={"scalars": 0})
    board.Reload()
    return {tag: [(e.step, e.value) for e in board.Scalars(tag)]
            for tag in board.Tags()["scalars"]}


__all__ = ["RunBoard", "read_scalars", "SUBDIR"]
