"""Held-out evaluation during training (eval.every): the newest weights on the env's
evaluation states (roles/heldout.py) every `eval.every` versions and at the last one, so the
learning curve a user watches is the held-out one, not the training episodes'.

Disaggregated modes: the evaluator rank (placement.evaluators) reads its node's weight copy
as an inference rank does. When a version at or past the next multiple of eval.every is there
it loads the newest, evaluates it with its own env batch and policy, and sends the report to
the weight root: one small message on COMM_WORLD (tag HELD_OUT_TAG) per evaluation. The root
takes in whatever has arrived each time it publishes a version (`HeldOutInbox`) and, after
the last version, waits for the evaluator's last report. Training never waits for an
evaluation: a slow evaluator evaluates fewer versions (the newest there when it was free),
each report naming its version. A stop signal ends the evaluation in progress at its next
batch and starts none (the last version's neither): the job's lead time is for the checkpoint.

Colocated (`between_versions`): after each due version every rank runs its share of the
batches with its acting copy of the policy, gathered on rank 0; training waits for it. A stop
signal, agreed on by every rank before each round of batches, ends it there alike.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Required, TypedDict

from hpcvla.process import preempt
from hpcvla.roles.heldout import EvaluationStopped, HeldOut
from hpcvla.roles.setup import RoleSetup
from hpcvla.transport.backoff import Backoff, idle_recv

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

    from hpcvla.config.schema import Config
    from hpcvla.metrics.progress import Progress
    from hpcvla.policies.base import Policy
    from hpcvla.roles.inference import WeightLoader
    from hpcvla.transport.weights import WeightPlane

HELD_OUT_TAG = 7201  # the evaluator's reports to the weight root, on COMM_WORLD


class HeldOutMessage(TypedDict, total=False):
    """What the evaluator sends the weight root: a report, or only that it is done."""
    version: int
    report: dict[str, object]  # HeldOut.report, without per_episode
    video: str | None
    last: Required[bool]


def held_out_of(cfg: Config, device: torch.device | str, policy: Policy | None = None
                ) -> HeldOut:
    """The held-out states and env batch eval.* configures (one filmed episode per task where
    eval.video_every asks)."""
    return HeldOut(cfg, cfg.eval.episodes, cfg.eval.envs, cfg.run.seed, device, policy,
                   video=1 if cfg.eval.video_every else 0)


def video_dir(cfg: Config, run_dir: Path, version: int, previous: int | None) -> Path | None:
    """Where the episodes of `version` are filmed, if its evaluation films any: the first
    evaluation, and each that passed a multiple of eval.video_every since the `previous` one
    (an evaluator that skipped the multiple itself films the next version it evaluates)."""
    every = cfg.eval.video_every
    films = every and (previous is None or version // every > previous // every)
    return run_dir / "videos" / f"v{version:06d}-heldout" if films else None


def run_evaluator(setup: RoleSetup, *, held_out: HeldOut, loader: WeightLoader,
                  plane: WeightPlane, world: MPI.Comm, root: int) -> dict[str, list[int]]:
    """The evaluator rank's loop (module docstring) until the weight plane finishes, from the
    run's first policy version (the curve's first point where it is a multiple of
    eval.every); returns what it evaluated. `loader` is its WeightLoader (roles/inference.py),
    `root` the weight root's world rank."""
    cfg, run_dir, timeline, first = setup.cfg, setup.run_dir, setup.timeline, \
        setup.first_version
    every, deterministic = cfg.eval.every, cfg.eval.deterministic
    evaluated: list[int] = []
    backoff = Backoff(cap=0.05)
    next_due = -(-first // every) * every

    def evaluate_newest(last: bool) -> bool:
        """The newest version's evaluation, sent to the root; False, nothing sent, where a
        stop signal cut it short (the job's lead time is its checkpoint's, not this)."""
        loader.refresh()
        version = loader.version
        films = video_dir(cfg, run_dir, version, evaluated[-1] if evaluated else None)
        try:
            with timeline.span("evaluate"):
                episodes, videos = held_out.run(deterministic, video_dir=films,
                                                stop=preempt.requested)
        except EvaluationStopped:
            return False
        report = held_out.report(episodes, deterministic)
        del report["per_episode"]  # the root logs the figures: the message stays small
        world.send({"version": version, "report": report,
                    "video": videos[0] if videos else None, "last": last},
                   dest=root, tag=HELD_OUT_TAG)  # [dist]
        evaluated.append(version)
        return True

    while not plane.finished():  # after a stop, no new evaluation: the plane's end waited for
        if plane.latest_version() >= next_due and not preempt.requested():
            if evaluate_newest(last=False):
                next_due = (evaluated[-1] // every + 1) * every
            backoff.reset()
        else:
            backoff.wait()
    final = plane.latest_version()
    if final in evaluated or final <= first or preempt.requested() or \
            not evaluate_newest(last=True):
        world.send({"last": True}, dest=root, tag=HELD_OUT_TAG)  # [dist]
    return {"held_out_versions": evaluated}


class HeldOutInbox:
    """The weight root's side: the evaluator's reports into the run's progress."""

    def __init__(self, world: MPI.Comm, evaluator: int, progress: Progress, patience_s: float):
        self.world, self.evaluator, self.progress = world, evaluator, progress
        self.patience_s = patience_s  # pipeline.stall_timeout_s: how often a long wait is said

    def poll(self) -> bool:
        """Log every report that has arrived; True once the last one is in."""
        while self.world.iprobe(source=self.evaluator, tag=HELD_OUT_TAG):  # [dist]
            if self._take(self.world.recv(source=self.evaluator, tag=HELD_OUT_TAG)):  # [dist]
                return True
        return False

    def wait_last(self) -> None:
        """After the last version: the evaluator's remaining reports, its last included."""
        if not self.poll():
            print("[hpcvla] waiting for the held-out evaluation of the last version",
                  flush=True)
            remind = (self.patience_s, lambda waited: (
                f"hpcvla: rank {self.world.Get_rank()} (learner) has waited {waited:.0f} s for "
                f"evaluator rank {self.evaluator}'s last held-out evaluation (one may take that"
                " long; an evaluator that hangs says nothing)"))
            while not self._take(idle_recv(self.world, self.evaluator, HELD_OUT_TAG,  # [dist]
                                           remind=remind)):
                pass

    def _take(self, message: HeldOutMessage) -> bool:
        if "report" in message:
            self.progress.on_held_out(message["version"], message["report"], message["video"])
        return message["last"]


def between_versions(setup: RoleSetup, held_out: HeldOut,
                     comm: MPI.Comm) -> Callable[[int, bool], None]:
    """Colocated: `after(version, last)` evaluates every multiple of eval.every and the last
    version (not one a stop signal made last: the lead time is the checkpoint's), every rank
    of `comm` (the learners: all ranks) a share of the batches, logged on its rank 0."""
    cfg, run_dir, timeline, progress = setup.cfg, setup.run_dir, setup.timeline, \
        setup.progress
    deterministic, every = cfg.eval.deterministic, cfg.eval.every
    evaluated: list[int] = []

    def after(version: int, last: bool) -> None:
        stopped = last and version < cfg.pipeline.total_updates  # agreed on by every rank
        if stopped or not (version % every == 0 or last):
            return
        films = video_dir(cfg, run_dir, version, evaluated[-1] if evaluated else None)
        try:
            with timeline.span("evaluate"):  # a stop, agreed on by all, ends it between rounds
                episodes, videos = held_out.run(deterministic, comm.Get_rank(),
                                                comm.Get_size(), films,
                                                stop=lambda: preempt.agreed(comm))  # [dist]
                parts = comm.gather((episodes, videos), root=0)  # [dist]
        except EvaluationStopped:
            return
        evaluated.append(version)
        if comm.Get_rank() == 0:
            assert parts is not None  # the root's gather
            filmed = sorted(v for _, vs in parts for v in vs)
            progress.on_held_out(version, held_out.report(
                [e for es, _ in parts for e in es], deterministic),
                filmed[0] if filmed else None)
    return after


__all__ = ["HeldOutInbox", "between_versions", "held_out_of", "run_evaluator"]
