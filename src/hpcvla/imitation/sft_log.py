"""`hpcvla sft`'s record of its run on rank 0: the start said (the config written, what a
resume changes) and a line a step (metrics.jsonl, TensorBoard, the progress line)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from hpcvla.checkpoint import catalog
from hpcvla.config.learning import states_stage
from hpcvla.files import open_log
from hpcvla.job.runtime import record_run_start
from hpcvla.metrics.tensorboard import RunBoard


def step_chunks(sft, learners: int) -> int:
    """The chunks `learners` train together in a step."""
    return sft.batch_size * sft.micro_batches * learners


def start_log(cfg, run_dir: Path, resumed: tuple, learners: int) -> RunLog:
    """Rank 0: the run's config written (what a resume changed, said), a resume's layout said
    (`resumed`: the checkpoint and its state, or None, None); the run's RunLog."""
    point, state = resumed
    record_run_start(cfg, run_dir, "hpcvla sft")
    if state:  # on another learner count each step trains another number of chunks
        sft = cfg.sft
        print(f"[hpcvla sft] resuming from {point} (step {state['version']}; "
              f"{catalog.layout_change(state, learners, states_stage(cfg.learner))}; "
              f"{step_chunks(sft, learners)} chunks a step)", flush=True)
        changed = catalog.batch_change(state, learners, sft.batch_size, sft.micro_batches,
                                       "sft")
        if changed:
            print(f"[hpcvla sft] {changed}", flush=True)
    return RunLog(cfg, run_dir, state["version"] if state else 0 if cfg.run.resume else None)


class RunLog:
    """Rank 0's record of the run as it goes: a metrics.jsonl line a step (whole as it ends:
    a failing rank's last words and a restart's record read it), TensorBoard's scalars, and
    the progress line every pipeline.progress_every_s, at a held-out loss and at the end."""

    def __init__(self, cfg, run_dir: Path, resumed_at: int | None = None):
        """`resumed_at`: the step a resumed start goes on from (metrics/tensorboard.RunBoard)."""
        self.cfg, self.printed_at = cfg, -math.inf
        self.board = RunBoard(run_dir, cfg.run, asdict(cfg), resumed_at)
        self.metrics = open_log(run_dir / "metrics.jsonl", buffering=1)

    def step(self, history: dict[str, list], val: float | None, counts: tuple,
             elapsed: float) -> None:
        """After a step. `counts`: the first step of this world, the steps done, the chunks
        trained, the samples and the learners; `elapsed`: seconds since this world's first."""
        first, done, trained, samples, learners = counts
        sft, loss, lr = self.cfg.sft, history["losses"][-1], history["lrs"][-1]
        scalars = {"loss": loss, "lr": lr, **({"val_loss": val} if val is not None else {})}
        self.board.scalars(scalars, done, group="sft")
        self.metrics.write(json.dumps({"time": round(elapsed, 3), "step": done,
                                       "trained_chunks": trained, "from_step": first,
                                       **scalars}) + "\n")
        if elapsed - self.printed_at < self.cfg.pipeline.progress_every_s and \
                done < sft.steps and val is None:
            return
        self.printed_at = elapsed
        rate = (done - first) * step_chunks(sft, learners) / max(elapsed, 1e-9)
        eta = (sft.steps - done) * step_chunks(sft, learners) / max(rate, 1e-9)
        print(f"[hpcvla sft] step {done}/{sft.steps} | loss {loss:.4f} | "
              + (f"held-out {val:.4f} | " if val is not None else "") +
              f"lr {lr:.2e} | {rate:.0f} chunks/s | epoch {trained / samples:.1f} | "
              f"eta {eta:.0f} s", flush=True)

    def close(self) -> None:
        self.board.close()
        self.metrics.close()
