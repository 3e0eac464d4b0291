"""Learner rank: pull segment groups from the ring, train with DeepSpeed ZeRO (or Horovod,
`learner.backend`) on the learner communicator, publish every new policy version.

Each policy version trains one batch: the segments its producers assigned to it (`quota`
from each; roles/modes.py explains why that bounds staleness), split into
`micro_batches` micro-batches of `micro_batch` segments. The streamer runs forward/backward on
a micro-batch as soon as it is there; the other modes wait for the whole batch first.
"""

from __future__ import annotations

import os
import socket
import time
from collections import defaultdict, deque
from contextlib import contextmanager

import numpy as np
import torch

from hpcvla.emulate import pad
from hpcvla.extensions import clear_stale_build_locks
from hpcvla.roles.nonfinite import SkipNonfinite
from hpcvla.algorithms import (decoupled_ppo_loss, first_episode_advantages, gae, grpo_loss,
                               normalize_advantages, value_loss)
from hpcvla.algorithms.granularity import sum_to
from hpcvla.algorithms.ppo import masked_mean
from hpcvla.policies.base import is_critic
from hpcvla.transport import records
from hpcvla.transport.backoff import DATA_POLL_CAP, Backoff


def init_deepspeed(cfg, policy, learners_comm, device: torch.device | None = None):
    """DeepSpeed on the learner communicator only (initialising torch.distributed on all
    ranks makes ZeRO-3 barrier the whole world): learner 0 picks a port, all join by NCCL
    when the learners are on GPUs, by gloo on CPUs. `device` is this rank's (devices.py):
    DeepSpeed puts the model on GPU LOCAL_RANK, so LOCAL_RANK is that GPU's index, whatever
    the launcher's own variables say. A bf16 policy trains under DeepSpeed's `bf16` section:
    fp32 master weights in the optimizer at every ZeRO stage."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cpu" and torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed moves it to a GPU
    import deepspeed

    rank, size = learners_comm.Get_rank(), learners_comm.Get_size()
    clear_stale_build_locks(rank=rank)  # else a killed op build hangs every later run
    address = None
    if rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            address = (socket.gethostname(), probe.getsockname()[1])
    host, port = learners_comm.bcast(address, root=0)
    local = str(device.index or 0)
    os.environ.update(MASTER_ADDR=host if size > 1 else "127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=local)
    if "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ:  # DeepSpeed asserts the two agree; the
        os.environ["OMPI_COMM_WORLD_LOCAL_RANK"] = local  # device map, not Open MPI, decides
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                               auto_mpi_discovery=False)
    bf16 = any(p.dtype == torch.bfloat16 for p in policy.parameters())
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.learner.micro_batch,
        "gradient_accumulation_steps": cfg.learner.micro_batches,
        "zero_optimization": {"stage": cfg.learner.zero_stage},
        "bf16": {"enabled": bf16},
        "gradient_clipping": cfg.algorithm.max_grad_norm,  # DeepSpeed's default is 1.0
        "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=policy.to(device), optimizer=_adamw(cfg, policy),
                                      config=ds_config)
    return SkipNonfinite(engine, cfg.learner.max_nonfinite_steps)


def init_engine(cfg, policy, learners_comm, device: torch.device | None = None):
    """The learners' data-parallel engine, `learner.backend`: DeepSpeed ZeRO, or Horovod
    (roles/horovod_engine.py) where it is installed; both behind the non-finite guard."""
    if cfg.learner.backend == "horovod":
        from hpcvla.roles.horovod_engine import init_horovod

        device = torch.device("cpu") if device is None else torch.device(device)
        engine = init_horovod(cfg, policy, learners_comm, _adamw(cfg, policy), device)
        return SkipNonfinite(engine, cfg.learner.max_nonfinite_steps)
    return init_deepspeed(cfg, policy, learners_comm, device)


def _adamw(cfg, policy):
    return torch.optim.AdamW(param_groups(policy, cfg.algorithm), eps=1e-5, weight_decay=0.0)


def param_groups(policy, alg) -> list[dict]:
    """The optimizer's groups: the actor (and shared encoders) at `algorithm.lr`, the critic
    (`value_*` modules) at `algorithm.critic_lr`, each named for `actor_frozen`."""
    named = list(policy.named_parameters())
    groups = [{"params": [p for n, p in named if not is_critic(n)], "lr": alg.lr, "name": "actor"},
              {"params": [p for n, p in named if is_critic(n)], "lr": alg.critic_lr or alg.lr,
               "name": "critic"}]
    return [g for g in groups if g["params"]]


def full_state(engine) -> dict[str, torch.Tensor]:
    """Full weights as host tensors in the module's dtype (bf16 stays bf16; ZeRO-3 gathers
    its shards: collective on the learners). On a CPU learner below ZeRO-3 they share the
    parameters' memory: copy them out before the next step."""
    import deepspeed

    module = engine.module
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def policy_loss(cfg, model, batch: dict, proximal=None,
                value_only: bool = False) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The PPO or GRPO loss of a micro-batch of segment groups, stacked along the env axis.
    `model` is the DeepSpeed engine (or a policy): model(obs, actions) = policy.evaluate.
    `value_only`: PPO's value loss alone (the critic's extra passes)."""
    T, N = batch["logprob"].shape
    batch = {k: torch.as_tensor(v).to(model.device, non_blocking=True) for k, v in batch.items()}
    obs = {k[4:]: v.reshape(T * N, *v.shape[2:])
           for k, v in batch.items() if k.startswith("obs.")}
    actions = batch["actions"].reshape(T * N, *batch["actions"].shape[2:])
    logprob, value, entropy = model(obs, actions)
    # logprob/entropy may be finer than chunks (policy.logprob_granularity): (T, N, *units)
    logprob, value, entropy = (x.reshape(T, N, *x.shape[1:]) for x in (logprob, value, entropy))
    behaviour = batch["logprob"]
    # Decoupled PPO (AReaL): clip around the proximal policy (the learner's weights when this
    # version's training began), importance-weight to the behaviour policy that acted.
    proximal = logprob.detach() if proximal is None else proximal
    alg = cfg.algorithm
    # a step whose env failed (env_fault) is no outcome of the policy: masked out everywhere
    faults = batch["env_fault"]
    mask = ~faults
    if alg.name == "grpo":  # critic-free: the value head is not trained
        scores = batch["success" if alg.group_score == "success" else "reward"]
        episodes, index = first_episode_advantages(  # bookkeeping: on the CPU
            batch["done"].cpu(), scores.cpu(), alg.group_size, alg.group_normalize_std,
            faults.cpu())
        pg_loss, stats = grpo_loss(logprob, proximal, behaviour, episodes, index, alg.clip,
                                   alg.max_behaviour_weight)
        v_loss = torch.zeros((), device=logprob.device)
        stats.update(degenerate_groups=episodes.degenerate_groups / max(episodes.groups, 1))
    else:
        old_value = batch["value"]
        advantages, returns = gae(batch["reward"], old_value,
                                  batch["done"],
                                  batch["bootstrap_value"], alg.gamma,
                                  alg.gae_lambda, faults)
        pg_loss, stats = decoupled_ppo_loss(logprob, proximal, behaviour,
                                            normalize_advantages(advantages, mask), alg.clip,
                                            alg.max_behaviour_weight, mask)
        v_loss = value_loss(value, old_value, returns, alg.clip if alg.value_clip else None,
                            mask)
        stats.update(critic_health(old_value[mask], returns[mask]))
        if value_only:
            return alg.value_coef * v_loss, dict(stats, value_loss=float(v_loss.detach())), logprob
    # the bonus is the chunk's entropy at every log-prob granularity (units summed), so one
    # entropy_coef means the same with chunk, action or token ratios
    entropy = masked_mean(sum_to(entropy, 2), mask)
    loss = pg_loss + alg.value_coef * v_loss - alg.entropy_coef * entropy
    stats.update(pg_loss=float(pg_loss.detach()), value_loss=float(v_loss.detach()),
                 entropy=float(entropy.detach()))
    return loss, stats, logprob


def critic_health(values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
    """How well the values the behaviour policy recorded predicted the returns: explained
    variance 1 - Var(R - V) / Var(R) (1 perfect, 0 a constant baseline, < 0 worse than
    one), and both scales."""
    var = float(returns.var()) if returns.numel() > 1 else 0.0
    residual = float((returns - values).var()) if returns.numel() > 1 else 0.0
    return {"explained_variance": 1.0 - residual / var if var > 0 else 0.0,
            "return_mean": float(returns.mean()) if returns.numel() else 0.0,
            "return_std": var ** 0.5, "value_mean": float(values.mean()) if values.numel() else 0.0}


def learn(cfg, engine, micro_batches, version: int, timeline, progress) -> None:
    """One policy version. Epoch 0 trains each micro-batch (a list of segment groups) as the
    iterable yields it, which is what lets the streamer start before the batch is complete;
    further `learner.epochs` replay them against the proximal log-probs of epoch 0.
    DeepSpeed applies an optimizer step after every `micro_batches` forward/backward passes.
    The episodes count when they arrive; the loss statistics logged are the last epoch's
    (in epoch 0 the policy is still the proximal one: clip fraction and KL are 0 there)."""
    seen, last = [], cfg.learner.epochs - 1
    for groups in micro_batches:
        batch = {k: np.concatenate([g[k] for g in groups], axis=1)
                 for k in groups[0] if k not in ("version", "meta", "bootstrap_value")}
        batch["bootstrap_value"] = np.concatenate([g["bootstrap_value"] for g in groups])
        proximal, stats = _train_micro_batch(cfg, engine, batch, timeline)
        staleness = float(np.mean([version - g["version"][0] for g in groups]))
        progress.on_segments(_scored(cfg, batch), staleness)
        if last == 0:
            progress.on_micro_batch(stats)
        seen.append((batch, proximal))
    for epoch in range(1, cfg.learner.epochs):
        for batch, proximal in seen:
            _, stats = _train_micro_batch(cfg, engine, batch, timeline, proximal)
            if epoch == last:
                progress.on_micro_batch(stats)
    if cfg.algorithm.name == "ppo" and cfg.algorithm.critic_epochs:
        with actor_frozen(engine):  # value-only optimizer steps: the critic catches up
            for _ in range(cfg.algorithm.critic_epochs):
                for batch, proximal in seen:
                    _train_micro_batch(cfg, engine, batch, timeline, proximal, value_only=True)


@contextmanager
def actor_frozen(engine):
    """Every optimizer param group but the critic's (init_deepspeed names them) at learning
    rate 0: steps inside move the critic only."""
    groups = engine.optimizer.param_groups
    saved = [g["lr"] for g in groups]
    for g in groups:
        if g.get("name") != "critic":
            g["lr"] = 0.0
    try:
        yield
    finally:
        for g, lr in zip(groups, saved):
            g["lr"] = lr


def _scored(cfg, batch: dict) -> dict:
    """The episodes that count in the success metrics: under GRPO only each column's first
    (grouped) episode; later ones are cut short by the next restart (envs/groups.py)."""
    if cfg.algorithm.name != "grpo":
        return batch
    return dict(batch, done=batch["done"] & (np.cumsum(batch["done"], axis=0) == 1))


def _train_micro_batch(cfg, engine, batch: dict, timeline, proximal=None, value_only=False):
    with timeline.span("train"):
        begin = time.monotonic()
        loss, stats, logprob = policy_loss(cfg, engine, batch, proximal, value_only)
        engine.backward(loss)
        engine.step()
        if cfg.emulate.learner_ms_per_micro_batch:  # the emulated cost is the whole pass
            pad(begin, cfg.emulate.learner_ms_per_micro_batch / 1e3)
    return logprob.detach() if proximal is None else proximal, stats


class SegmentQueues:
    """Segment groups from the ring, bucketed by the learner batch their producer assigned
    at segment start (roles/modes.py): batch b is trained at version b, which is what bounds
    staleness even when segments arrive out of start order."""

    def __init__(self, ring, max_staleness: int, stats: dict, producers=()):
        self.ring, self.max_staleness, self.stats = ring, max_staleness, stats
        self.producers = tuple(producers)  # world ranks feeding this ring, for stall reports
        self.buckets: dict[int, deque] = defaultdict(deque)
        self.trained: dict[tuple[int, int], set] = defaultdict(set)  # (producer, slot) -> groups

    def ledger(self) -> dict:
        """Per producer/slot: groups trained and their index range. A slot's groups go to
        batches in order, so a complete run trains 0..last of each, every one once:
        `missing` counts the holes."""
        return {f"{p}/{s}": {"groups": len(g), "first": min(g), "last": max(g),
                             "missing": max(g) + 1 - min(g) - len(g)}
                for (p, s), g in sorted(self.trained.items())}

    def pump(self) -> None:
        for rec in self.ring.poll():
            group = records.decode(rec.data)  # copies out of the ring slot
            self.buckets[int(group["meta"][4])].append(group)
        self.ring.release()

    def available(self, batch: int) -> int:
        return sum(int(g["meta"][3]) for g in self.buckets[batch])

    def take(self, segments: int, batch: int) -> list[dict]:
        groups, got, bucket = [], 0, self.buckets[batch]
        while got < segments:
            group = bucket.popleft()
            n = int(group["meta"][3])
            staleness = batch - int(group["version"][0])
            if staleness > self.max_staleness:  # the quota makes this impossible: a bug
                raise RuntimeError(f"segment of policy version {int(group['version'][0])} "
                                   f"in batch {batch}: staleness {staleness} exceeds "
                                   f"max_staleness {self.max_staleness}")
            producer, slot, index = (int(x) for x in group["meta"][:3])
            if index in self.trained[producer, slot]:  # the ring delivers exactly once
                raise RuntimeError(f"segment group {index} of producer {producer} slot "
                                   f"{slot} arrived twice; it would be trained twice")
            self.trained[producer, slot].add(index)
            hist = self.stats["staleness_hist"]
            hist[staleness] = hist.get(staleness, 0) + n
            groups.append(group)
            got += n
        if not bucket:
            del self.buckets[batch]
        return groups


def run_learner(cfg, sched, engine, queues: SegmentQueues, publish, first: int,
                total_updates: int, timeline, progress, stop) -> dict:
    """Train policy versions first+1 .. total_updates, publishing each with
    `publish(version, last)`; end early, after a whole version, when `stop()` says so."""
    micro, n_micro = cfg.learner.micro_batch, cfg.learner.micro_batches
    backoff = Backoff(cap=DATA_POLL_CAP)

    def arriving(version):  # micro-batches of this version's batch, as soon as they are here
        need = micro if sched.stream_micro_batches else micro * n_micro
        for _ in range(n_micro):
            with timeline.span("wait_data"):
                queues.pump()
                last, have = time.monotonic(), queues.available(version)
                while have < need:
                    backoff.wait()
                    queues.pump()
                    now_have = queues.available(version)
                    if now_have != have:
                        last, have = time.monotonic(), now_have
                    elif time.monotonic() - last > cfg.pipeline.stall_timeout_s:
                        raise RuntimeError(
                            f"no trajectory for {cfg.pipeline.stall_timeout_s:g} s while "
                            f"training version {version + 1}: have {have} of {need} segments "
                            f"of batch {version} (pipeline.stall_timeout_s). "
                            f"{queues.ring.diagnose(queues.producers)}")
                backoff.reset()
            yield queues.take(micro, version)
            need = micro

    for version in range(first, total_updates):
        learn(cfg, engine, arriving(version), version, timeline, progress)
        last = version + 1 == total_updates or stop()
        with timeline.span("publish"):
            publish(version + 1, last)
        progress.on_update(version + 1)
        if last:
            break
    return queues.stats
