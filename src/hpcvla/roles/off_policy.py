"""The off-policy learner (SAC, algorithm.name=sac or rlpd): every learner keeps its own replay
buffer (algorithms/replay.py) of the transitions that reach it, and the learners take SAC's
gradient steps data-parallel. RLPD adds prior data: every learner samples the transitions of
algorithm.demos too, and each sampled batch is half of those, half online
(replay.symmetric_sample). A node holds one copy of them (transport/node_arrays.py), its
learners each reading a share of the files into it, as `hpcvla sft`'s demonstrations.

What reaches a learner: in sync-colocated mode its own envs' segment groups; in the
disaggregated modes the groups its inference ranks stream through its ring, each micro-batch
as it is taken (roles/learner.run_learner): the ring is the replay stream. Per micro-batch:

    add its segment groups to the buffer                every transition enters it once
    gradient steps: algorithm.utd x the transitions it brought (the same count on every
        learner: each takes the same share of every version), each `learner.micro_batches`
        passes of `algorithm.batch_size` sampled transitions, then the target critics'
        Polyak step; none while any buffer holds fewer than algorithm.learning_starts;
        the first algorithm.critic_warmup of them train the critics alone

and after the version's last one, the new weights are published (to the acting copy, or
through the weight plane: every utd x batch transitions' gradient steps). The staleness
schedule (schedule.py) still paces the producers, as flow control: no transition is dropped
or reweighted for its age, so pipeline.max_staleness may be raised to let acting run ahead.

The transitions that entered the learners' buffers, summed over the learners, are
checkpointed with the version as the counter `replay_transitions`, and a resumed run
continues the count (on any number of learners); the held transitions are not checkpointed:
a resumed learner refills its buffer, training only once it again holds
algorithm.learning_starts of them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from hpcvla.algorithms.off_policy import soft_actor_critic_loss, update_targets
from hpcvla.algorithms.replay import ReplayBuffer, symmetric_sample
from hpcvla.algorithms.sac import target_entropy
from hpcvla.algorithms.transitions import (demonstration_transitions, transition_specs,
                                           transitions_of)
from hpcvla.engines import critic_steps_only
from hpcvla.metrics.episode_metrics import FIELD as METRIC
from hpcvla.roles.colocated import publish
from hpcvla.seeds import replay_rng
from hpcvla.transport.backoff import idle_bcast
from hpcvla.transport.node_arrays import NodeArrays

from mpi4py import MPI

if TYPE_CHECKING:
    from hpcvla.config.schema import Config
    from hpcvla.engines import SkipNonfinite
    from hpcvla.envs.base import EnvSpec
    from hpcvla.policies.base import Policy
    from hpcvla.policies.soft_critics import SoftCritics
    from hpcvla.roles.segments import SegmentGroup
    from hpcvla.roles.setup import RoleSetup


# what Progress counts (the instruction: each episode's task, where a suite has several; the
# env's episode metrics, METRIC + name)
SCORED = ("done", "env_fault", "success", "episode_return", "episode_length", "obs.instruction")


class SoftUpdate:
    """SAC's learner (module docstring): a colocated rank's roles/colocated.VersionUpdate, or
    a learner rank's `train` (roles/learner.run_learner) by `learn`."""

    def __init__(self, setup: RoleSetup, engine: SkipNonfinite, actor: Policy | None,
                 spec: EnvSpec, learners: MPI.Comm, resumed_transitions: int = 0,
                 prior: PriorData | None = None):
        """`actor`: the colocated rank's acting copy (None on a learner rank, which publishes
        through the weight plane); `prior`: RLPD's demonstrations (prior_data, which the
        prologue reads before the transport's threads start)."""
        self.setup, self.engine, self.actor, self.alg = setup, engine, actor, setup.cfg.algorithm
        self.learners, self.resumed = learners, resumed_transitions
        self.obs_names = list(spec.obs)
        # SAC's action: the chunk, or what a steered policy chose it by (its noise)
        self.action_field = cast("SoftCritics", engine.module).soft_action_field
        self.buffer = ReplayBuffer(transition_specs(spec.obs, spec.chunk_len, spec.action_dim),
                                   self.alg.replay_capacity)
        assert (prior is not None) == self.alg.traits.prior_data, self.alg.name
        self.prior: ReplayBuffer | None = prior[0] if prior else None
        self.shared: NodeArrays | None = prior[1] if prior else None  # the node's one copy
        self.target_entropy = target_entropy(spec.action_dim, spec.chunk_len,
                                             self.alg.target_entropy)
        # each rank its own draws: the data-parallel ranks sample different transitions
        self.rng = replay_rng(setup.cfg, setup.rank, resumed_transitions)
        self.dropped = self.gradient_steps = 0

    def __call__(self, micro_batches: list[list[SegmentGroup]], version: int
                 ) -> dict[str, torch.Tensor]:
        """A colocated version: this rank's micro-batches, then publish to the acting copy."""
        self.learn(micro_batches, version)
        self.setup.progress.on_update(version + 1)
        assert self.actor is not None  # a colocated rank's
        return publish(self.engine, self.actor, self.setup.timeline)

    def learn(self, micro_batches: Iterable[list[SegmentGroup]], version: int) -> None:
        """One version's micro-batches (lists of segment groups), each into the buffer and
        trained on as it comes (the learner's iterable yields them as they arrive)."""
        for groups in micro_batches:
            collected = self._add(groups)
            staleness = float(np.mean([version - g["version"][0] for g in groups]))
            self.setup.progress.on_segments({k: np.concatenate([g[k] for g in groups], axis=1)
                                             for k in groups[0] if k in SCORED or
                                             k.startswith(METRIC)}, staleness)
            self._train(collected)

    def _add(self, groups: list[SegmentGroup]) -> int:
        """The groups' transitions into the buffer; returns the env chunk-steps they held."""
        collected = 0
        for group in groups:
            kept, dropped = transitions_of(group, self.obs_names, self.action_field)
            self.buffer.add(kept)
            self.dropped += dropped
            collected += group["reward"].size
        return collected

    def _train(self, collected: int) -> None:
        """algorithm.utd gradient steps per collected transition, once every buffer is ready."""
        # the learners step together, so they start together, once every buffer holds enough
        least_held = self.learners.allreduce(self.buffer.size, op=MPI.MIN)  # [dist]
        ready = least_held >= self.alg.learning_starts
        steps = math.ceil(self.alg.utd * collected) if ready else 0
        stats: dict[str, float] = {}  # the last step's; none while the buffers fill
        with self.setup.timeline.span("train"):
            for _ in range(steps):
                stats = self._gradient_step()
        self.setup.progress.on_micro_batch({**stats, "gradient_steps": steps,
                                            "replay_size": self.buffer.size})

    def _gradient_step(self) -> dict[str, float]:
        """One optimizer step (learner.micro_batches sampled batches), then the targets'."""
        engine, policy = self.engine, self.engine.module
        n = self.alg.batch_size
        warmup = self.gradient_steps < self.alg.critic_warmup
        for _ in range(self.setup.cfg.learner.micro_batches):
            sampled = self.buffer.sample(n, self.rng) if self.prior is None else \
                symmetric_sample(self.buffer, self.prior, n, self.rng)
            batch = {k: torch.as_tensor(v).to(engine.device, non_blocking=True)
                     for k, v in sampled.items()}
            loss, stats = soft_actor_critic_loss(self.alg, policy, batch, self.target_entropy,
                                                 critics_only=warmup)
            engine.backward(loss)
            with critic_steps_only(engine) if warmup else contextlib.nullcontext():
                engine.step()  # the warm-up's leave the actor's Adam state unspent
        update_targets(policy, self.alg.tau)
        self.gradient_steps += 1
        return {**stats, **engine.step_stats(self.alg.max_grad_norm)}

    def counters(self) -> dict[str, int]:
        """The checkpoint's (collective on the learners, as the checkpoint is): every
        transition that entered a buffer of this run and of those it resumed."""
        added = self.learners.allreduce(self.buffer.position)  # [dist]
        return {"replay_transitions": self.resumed + added}

    def summary(self) -> dict[str, float]:
        """This rank's, in this world: the transitions its buffer took, holds and dropped, and
        the entropy its temperature aims at (the metrics' `entropy` is measured against it)."""
        return {"replay_added": self.buffer.position, "replay_size": self.buffer.size,
                "gradient_steps": self.gradient_steps, "transitions_dropped": self.dropped,
                "target_entropy": self.target_entropy,
                **({"prior_transitions": self.prior.size} if self.prior is not None else {})}

    def close(self) -> None:
        """Collective on the learners (a node's, under RLPD): after the last gradient step."""
        if self.shared is not None:
            self.shared.free()  # [dist]
            self.shared.node.Free()  # [dist]


PriorData = tuple[ReplayBuffer, NodeArrays]


def prior_data(cfg: Config, spec: EnvSpec, learners: MPI.Comm) -> PriorData:
    """Collective on `learners`: algorithm.demos as a buffer of transitions (checked before
    launch: preflight.prior_data_problems), exactly as large as they are, held once per node:
    its first learner scans the files' headers, each reads a share of the demonstrations into
    the node's copy. The buffer, and that copy to free after the last sample."""
    from hpcvla.config.imitation import demo_paths
    from hpcvla.demonstrations import read_selection, select_demonstrations

    node = cast(MPI.Intracomm,  # [dist] this host's learners
                learners.Split_type(MPI.COMM_TYPE_SHARED, key=learners.Get_rank()))
    selection = idle_bcast(node, lambda: select_demonstrations(  # [dist]
        demo_paths(cfg.algorithm), spec, cfg.algorithm.demos_per_task or None, outcomes=True))
    mine = read_selection(selection, spec, outcomes=True, part=(node.Get_rank(),
                                                                node.Get_size()))
    kept, _ = demonstration_transitions(mine.obs, mine.actions,  # no outcomes: an empty share
                                        mine.outcomes or {}, mine.episode)
    specs = transition_specs(spec.obs, spec.chunk_len, spec.action_dim)
    shared = NodeArrays.gathered(node, kept, specs)  # [dist]
    held = len(shared.arrays["reward"])
    if not held:  # on every learner alike: the same files
        raise ValueError(f"algorithm.demos = {cfg.algorithm.demos!r}: no transition in them "
                         "(each episode a single chunk the horizon cut?); expected "
                         "demonstrations of more than one chunk, or that end in success")
    return ReplayBuffer(specs, held, shared.arrays), shared


__all__ = ["SoftUpdate"]
