"""sync-colocated: every rank simulates, infers and trains, in lock-step (RLinf's colocated
baseline). Each rank rolls out its own envs with its own acting copy of the policy (loaded with
the learner's weights after every version), until it holds its share of the batch; then all
ranks train it data-parallel; then rollout resumes with the new weights. Nothing overlaps, so no
sample is ever stale.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from hpcvla.emulate import pad
from hpcvla.engines import full_state
from hpcvla.envs.base import check_observation, final_observations, horizon_cut
from hpcvla.process.watchdog import deadline, reminding, step_deadline_s
from hpcvla.roles.learner import learn
from hpcvla.roles.segments import SegmentBuilder, outcome_of, truncation_values
from hpcvla.roles.setup import RoleSetup

if TYPE_CHECKING:
    from hpcvla.config.schema import Config
    from hpcvla.engines import SkipNonfinite
    from hpcvla.envs.base import StepResult, VectorEnv
    from hpcvla.metrics.dump_writer import TrajectoryDump
    from hpcvla.metrics.timeline import Timeline
    from hpcvla.policies.base import Policy
    from hpcvla.roles.segments import SegmentGroup


class VersionUpdate(Protocol):
    """What trains one version from this rank's micro-batches of segment groups:
    `OnPolicyUpdate` (PPO, GRPO) or the off-policy learner's (roles/off_policy.py); it loads
    the new weights into the acting copy and returns them."""

    def __call__(self, micro_batches: list[list[SegmentGroup]], version: int
                 ) -> dict[str, torch.Tensor]: ...

    def counters(self) -> dict[str, int]:
        """What a checkpoint keeps beside the trained env steps, and a resume continues."""
        ...

    def summary(self) -> dict[str, float]:
        """What the rank reports in summary.json."""
        ...

    def close(self) -> None:
        """Collective on the learners: what it holds with other ranks, freed at the end."""
        ...


def run_colocated(setup: RoleSetup, *, update: VersionUpdate, actor: Policy, env: VectorEnv,
                  after_version: Callable[[int, dict[str, torch.Tensor], bool], None],
                  stop: Callable[[], bool], dump: TrajectoryDump | None = None) -> int:
    """Train versions first+1 .. total_updates (fewer if `stop()` says so after a version);
    returns the env steps this rank took. `actor` is this rank's acting copy of the policy,
    holding the learner's weights, refreshed from it by `update` after every version (under
    ZeRO-3 the learner holds shards);
    `after_version(version, weights, last)` runs after every version (a checkpoint when due, the
    held-out evaluation when due: roles/evaluator.py); `dump` (metrics/dump.py), if given,
    gets every segment group."""
    cfg, timeline = setup.cfg, setup.timeline
    emulate_ms, total_updates = setup.emulated_inference_ms, setup.total_updates
    spec = env.spec
    micro, n_micro = cfg.learner.micro_batch, cfg.learner.micro_batches
    builder = SegmentBuilder({**spec.obs, **actor.extra_fields()}, env.num_envs,
                             spec.chunk_len, spec.action_dim,
                             cfg.rollout.segment_len, producer=0, slot=0,
                             metrics=spec.episode_metrics)
    result: StepResult | None = None
    groups: list[SegmentGroup] = []
    with deadline(step_deadline_s(cfg.env)):
        obs, steps = env.reset(), 0
    check_observation(env, obs)
    version = setup.first_version
    while True:
        actions, logprob, value, recorded = _act(actor, obs, env.num_envs, timeline, emulate_ms)
        if result is not None and builder.acted:  # the previous chunk's outcome
            builder.record_outcome(outcome_of(result, spec.episode_metrics),
                                   _truncation_values(cfg, actor, result, timeline))
        if builder.full:
            builder.batch = version  # trained in update `version`: staleness 0
            groups.append(builder.finish(value, obs if cfg.algorithm.off_policy else None))
            if dump:
                with timeline.span("dump"):
                    dump.add_segment(groups[-1])
            if len(groups) * env.num_envs >= micro * n_micro:
                # whole groups per micro-batch: micro_batch is a multiple of the rank's envs
                # (schedule.layout_problems)
                per_micro = len(groups) // n_micro
                def in_version(waited: float, at: int = version + 1) -> str:
                    # its collectives wait for every rank: one stuck (in its rollout, say) is
                    # the one not saying this
                    return (f"hpcvla: rank {setup.rank} (colocated) has been in version {at}'s "
                            f"training, checkpoint and held-out evaluation for {waited:.0f} s "
                            "(waiting for the other ranks, or stuck itself)")
                with reminding(cfg.pipeline.stall_timeout_s, in_version):
                    weights = update([groups[i * per_micro:(i + 1) * per_micro]  # train, then
                                      for i in range(n_micro)], version)  # act with them
                    groups, version = [], version + 1
                    last = version == total_updates or stop()
                    after_version(version, weights, last)  # [dist] a checkpoint when due
                if last:
                    break
                continue
        builder.add_step(recorded, actions, logprob, value, version)
        with timeline.span("simulate"):
            with deadline(step_deadline_s(cfg.env)):  # a step that never returns: loud stop
                result = env.step(actions)
        steps += env.num_envs * spec.chunk_len
        obs = result.obs
    if dump:
        dump.close()
    return steps


def _act(policy: Policy, obs: dict[str, np.ndarray], envs: int, timeline: Timeline,
         emulate_ms: Callable[[int], float] | None
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """The policy's chunk for `obs`: (actions, logprob, value, what to record beside it)."""
    with timeline.span("infer"):
        begin = time.monotonic()
        with torch.no_grad():
            out, extras = policy.sample(policy.obs_to_tensors(obs, policy.device))
        actions, logprob, value = (t.cpu().numpy() for t in out)
        recorded = {**obs, **{k: v.cpu().numpy() for k, v in extras.items()}}
        if emulate_ms:  # the emulated cost is the whole forward pass
            pad(begin, emulate_ms(envs) / 1e3)
    return actions, logprob, value, recorded


def _truncation_values(cfg: Config, policy: Policy, result: StepResult,
                       timeline: Timeline) -> np.ndarray | None:
    """V where the step's horizon ended episodes, which PPO bootstraps them from; None where
    it ended none or the run does not bootstrap."""
    cut = horizon_cut(result.truncated, result.env_fault)
    if not cfg.algorithm.values_truncations or not cut.any():
        return None
    with timeline.span("infer"):
        final = final_observations(result)
        return truncation_values(policy, cut, {k: v[cut] for k, v in final.items()})


class OnPolicyUpdate:
    """PPO's or GRPO's version: this rank's micro-batches, trained data-parallel with the other
    ranks (roles/learner.learn)."""

    def __init__(self, setup: RoleSetup, engine: SkipNonfinite, actor: Policy):
        self.setup, self.engine, self.actor = setup, engine, actor

    def __call__(self, micro_batches: list[list[SegmentGroup]], version: int
                 ) -> dict[str, torch.Tensor]:
        cfg, timeline, progress = self.setup.cfg, self.setup.timeline, self.setup.progress
        learn(cfg, self.engine, micro_batches, version, timeline, progress, progress.pool)
        progress.on_update(version + 1)
        return publish(self.engine, self.actor, timeline)

    def counters(self) -> dict[str, int]:
        return {}

    def summary(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass  # holds nothing with other ranks


def publish(engine: SkipNonfinite, actor: Policy, timeline: Timeline) -> dict[str, torch.Tensor]:
    """The learner's new weights, loaded into the acting copy; returns them."""
    with timeline.span("publish"):
        weights = full_state(engine)  # [dist] under ZeRO-3
        assert weights is not None  # full_state gathers them unless told not to
        actor.load_arrays(weights)
    return weights
