"""`hpcvla sft`: supervised fine-tuning of a policy on demonstrations, the imitation start that
RL post-training begins from.

Every rank of the world is a learner: the same engine as `hpcvla train`'s learners (DeepSpeed
ZeRO at `learner.zero_stage`, or Horovod), the same checkpoints (`run.resume` goes on from the
newest), progress line and TensorBoard. The loss is the family's `imitation_loss`
(policies/base.py): behaviour cloning for `default`, flow matching for `flow`, the action
tokens' cross-entropy for `tokens`/`oft` (oft's L1 head: L1 on the normalized actions). The
demonstrations (`sft.demos`, read by demonstrations/) are turned into the observations the
configured env gives and the action chunks it executes, so what is learnt is what the env will
ask for.

    hpcvla sft CONFIG sft.demos=demos.h5 sft.steps=500 --ranks 2
    hpcvla eval <sft run dir>                                     # success of the SFT policy
    hpcvla train CONFIG policy.checkpoint=<sft run dir>           # RL from it

A stop signal (Slurm's, PBS's, `scancel`: process/preempt.py) ends the run after the current
step with a checkpoint; `run.resume` goes on from it. Every step is a line of the run's
metrics.jsonl (time, step, chunks trained, loss, learning rate, held-out loss), written as it
ends: what a failing rank's last words and a restart's record (job/restarts.py) read.

The learning rate follows sft.schedule, a function of the step (`lr_at`: a linear warm-up,
then constant or a cosine down to sft.final_lr), so a resumed run goes on with it. Held-out
demonstrations (sft.val_demos) are never trained on: their loss (`held_out_loss`) after every
sft.val_every steps and the last says how well what was not shown is fit.

On GPUs the learners' memory is planned once they have their devices (`planned_memory`,
memory/sft_eval.sft_memory), before the demonstrations are read and the policy is built: a
batch that overfills them ends the world with the figures and the settings that make it fit.

Sampling: the steps take consecutive chunks of one sequence of per-epoch permutations of all
samples, a pure function of run.seed: the step after c chunks were trained takes chunks c ..
c + G - 1 (G = batch_size x micro_batches x learners), learner r its G / learners of them,
in micro_batches passes (gradient accumulation). Every sample is
trained once per epoch, on one learner, and a resumed run goes on at the exact next chunk
(the checkpoint counts them), on as many learners as it now has.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from hpcvla.checkpoint import catalog, store
from hpcvla.config import ConfigError
from hpcvla.config.imitation import SFT_SETS, dataset_features, demo_paths
from hpcvla.demonstrations import (Demonstrations, read_selection, sample_layout,
                                   select_demonstrations)
from hpcvla.devices import bind_rank_device, peak_memory
from hpcvla.engines import full_state, init_engine
from hpcvla.envs import env_spec
from hpcvla.factory import build_policy
from hpcvla.files import replace_text
from hpcvla.imitation.sft_log import start_log, step_chunks
from hpcvla.job.runtime import claim_run, create_run_dir, leave_together, node_numbers
from hpcvla.memory.layout import LayoutMemory
from hpcvla.memory.sft_eval import hold_demonstrations, sft_memory
from hpcvla.memory.states import size
from hpcvla.metrics import phases, restart_log
from hpcvla.process import deathwatch, heap, preempt
from hpcvla.process.deathwatch import Refused
from hpcvla.process.threads import rank_threads
from hpcvla.process.watchdog import reminding
from hpcvla.roles.outputs import (MEMORY_PLAN, RankSummary, add_planned_memory, memory_table,
                                  phases_line, starts_so_far)
from hpcvla.seeds import seed_rank
from hpcvla.topology.comms import check_scheduler_world
from hpcvla.topology.plan import LEARN
from hpcvla.transport.backoff import idle_barrier, idle_bcast
from hpcvla.transport.node_arrays import NodeArrays

HELD_OUT_SEED = 0x5EED  # torch's RNG during every held-out loss (held_out_loss)
# what summary.json's per_rank keeps of each learner's report (roles/outputs.RankSummary)
PER_RANK = ("rank", "host", "device", "dtype", "phases_s", "peak_memory", "planned_memory")


def engine_config(cfg):
    """The learners' settings for imitation (SFT_SETS): sft.micro_batches passes of
    sft.batch_size chunks per optimizer step, at sft.lr."""
    sections: dict[str, dict] = {}
    for key, source in SFT_SETS.items():
        (section, name), (of, field) = key.split("."), source.split(".")
        sections.setdefault(section, {})[name] = getattr(getattr(cfg, of), field)
    return replace(cfg, **{section: replace(getattr(cfg, section), **values)
                           for section, values in sections.items()})


def batch_indices(samples: int, batch_size: int, trained: int, rank: int,
                  seed: int) -> np.ndarray:
    """Learner `rank`'s sample indices in the step after `trained` chunks (module docstring)."""
    first = trained + rank * batch_size
    positions = np.arange(first, first + batch_size)
    epochs, offsets = np.divmod(positions, samples)
    out = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        order = np.random.default_rng([seed, int(epoch), 0x5F7]).permutation(samples)
        out[epochs == epoch] = order[offsets[epochs == epoch]]
    return out


def lr_at(sft, step: int) -> float:
    """The learning rate of step `step` (0-based): sft.warmup_steps rising to sft.lr, then
    sft.lr (constant) or a half cosine from it down to sft.final_lr at the last step."""
    if step < sft.warmup_steps:
        return sft.lr * (step + 1) / (sft.warmup_steps + 1)
    if sft.schedule == "constant":
        return sft.lr
    done = (step - sft.warmup_steps) / max(1, sft.steps - 1 - sft.warmup_steps)
    return sft.final_lr + (sft.lr - sft.final_lr) * (1 + math.cos(math.pi * min(1.0, done))) / 2


def sft_main(cfg, world) -> None:
    """Every rank: read the demonstrations, fine-tune, checkpoint."""
    phases.mark("imports")
    rank, learners = world.Get_rank(), world.Get_size()
    with _still_in(cfg, rank, "its start-up"):  # its collectives wait for every learner
        if cfg.launch.check_scheduler:
            check_scheduler_world(learners)
        node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)  # [dist] this host's learners
        phases.mark("communicators")
        torch.set_num_threads(rank_threads(node.Get_size()))  # its share of the node
        seed_rank(cfg, rank)
        device = bind_rank_device(cfg, [(LEARN,)] * learners, world)  # [dist] a GPU each where any
        spec = idle_bcast(world, lambda: env_spec(cfg.env))  # [dist] rank 0 builds an env
        memory = planned_memory(cfg, world, device, spec)  # [dist] GPUs it overfills: refused
        if not cfg.run.resume:
            cfg.run.name = f"{cfg.run.name}-sft"
        run_dir = create_run_dir(cfg, world)
        claim_run(world, run_dir)  # [dist] no rank reads or writes the run before its lock is held
        if rank == 0:
            deathwatch.register_run_dir(run_dir)  # a failing rank's last words read its metrics
        idle_barrier(world)  # [dist] (registered before any rank can fail in its work)
        features = dataset_features(cfg.sft)  # a LeRobot dataset's, where sft.features names them
        # the action steps supervised from each observation: the policy's own (a meta build)
        horizon = build_policy(cfg, spec, device="meta").imitation_horizon
        demos, shared = _read_on_node(node, spec, horizon, lambda: select_demonstrations(
            demo_paths(cfg.sft), spec, cfg.sft.per_task or None, cfg.sft.successful_only,
            features=features))
        val_paths = demo_paths(cfg.sft, "val_demos")
        held_out, shared_val = _read_on_node(node, spec, horizon, lambda: select_demonstrations(
            val_paths, spec, features=features)) if val_paths else (None, None)
        phases.mark("demonstrations_read")
        if rank == 0 and memory is not None:  # beside each learner's measured peak at the end
            hold_demonstrations(memory, sum(a.nbytes for a in filter(None, (shared, shared_val))))
            (run_dir / MEMORY_PLAN).write_text(json.dumps(memory.to_dict(), indent=1))
        samples = len(demos.actions)
        # learner 0 alone reads the weights: the engine starts every learner from its parameters
        policy = build_policy(cfg, spec, device, device.type == "cuda", load=rank == 0)
        phases.mark("policy_built")
        # rank 0's newest checkpoint, holding the run's lock: every learner resumes from the same
        resume = idle_bcast(world, lambda: catalog.latest(run_dir)) \
            if cfg.run.resume else None  # [dist]
        if resume is not None and rank == 0:
            policy.load_arrays(store.load_weights(resume, policy.state_dict()))
        engine = init_engine(engine_config(cfg), policy, world, device)  # [dist]
        state = store.load_optimizer(resume, engine, world) if resume else None  # [dist]
        phases.mark("engine_ready")
        first, trained = (state["version"], state["counters"][catalog.SFT_COUNTER]) if state \
            else (0, 0)
        log = None
        if rank == 0:
            log = start_log(cfg, run_dir, (resume, state), learners)
            print(f"[hpcvla sft] {samples} chunks from {len(demos.task)} demonstrations "
                  f"({demos.source}; {size(shared.nbytes)}, one copy per node); "
                  f"{learners} learner(s) on {device}; steps {first}..{cfg.sft.steps}; "
                  f"run directory: {run_dir}", flush=True)
        writer = store.Writer(cfg.learner.checkpoint_background)
    history, done, trained = _train(cfg, engine, demos, held_out, first, trained, world, log,
                                    run_dir, writer)
    with _still_in(cfg, rank, "its last checkpoint and report"):
        _finish(cfg, engine, run_dir, world, history, done, trained, len(demos.task), samples,
                writer)
    if log is not None:
        log.close()
    for arrays in filter(None, (shared, shared_val)):
        arrays.free()  # [dist]
    node.Free()  # [dist]
    leave_together(world, cfg.pipeline.stall_timeout_s)  # [dist]


def _still_in(cfg, rank: int, where: str) -> AbstractContextManager[None]:
    """Say every pipeline.stall_timeout_s that this learner is still in `where`, and its last
    step done: its collectives wait for every learner, so one that hangs says nothing."""
    return reminding(cfg.pipeline.stall_timeout_s, lambda waited: (
        f"hpcvla sft: rank {rank} has been in {where} for {waited:.0f} s (its last step done: "
        f"{phases.last() or 'none'}; waiting for the other learners, or stuck itself)"))


def planned_memory(cfg, world, device, spec) -> LayoutMemory | None:
    """The memory model's figures for this world's learners on their GPUs
    (memory/sft_eval.sft_memory), worked out by rank 0, on every rank; None on CPUs. Where
    they overfill the GPUs, every rank raises Refused: the world ends with the figures and
    the settings that make it fit, before the demonstrations are read and the policy built
    (their copy, which only host memory holds, is added once read: sft_main). (`hpcvla sft
    --ranks N` checked its world before starting it: preflight.check_sft.)"""
    if device.type != "cuda":  # every learner's alike (devices.rank_device)
        return None
    nodes = node_numbers(world.allgather(MPI.Get_processor_name()))  # [dist]
    gpus = max(map(nodes.count, nodes))  # each learner's own (as many as a node's learners)
    memory = idle_bcast(world, lambda: sft_memory(cfg, nodes, gpus, spec, shared=0))  # [dist]
    if memory.problems:
        raise Refused(ConfigError(memory.problems, "memory plan of the sft learners"))
    return memory


def _read_on_node(node, spec, horizon: int, select) -> tuple[Demonstrations, NodeArrays]:
    """The demonstrations `select()` selects, `horizon` actions a sample, held once per host
    in node-shared memory (transport/node_arrays.py): the first rank of `node` (a host's
    learners) scans the files' headers (one pass over a shared file system per host), each
    rank reads its share of the demonstrations into the shared copy, and all read the whole;
    the window, to free after the last read."""
    selection = idle_bcast(node, select)  # [dist] a DemonstrationError ends the world
    mine = read_selection(selection, spec, part=(node.Get_rank(), node.Get_size()),
                          horizon=horizon)
    shared = NodeArrays.gathered(node, mine.arrays(), sample_layout(spec, horizon))  # [dist]
    return Demonstrations.from_arrays(shared.arrays, mine.task, mine.source), shared


def _train(cfg, engine, demos, held_out, first: int, trained: int, world, log, run_dir,
           writer) -> tuple[dict[str, list], int, int]:
    """Steps first .. sft.steps (`trained` chunks before them), or until a stop signal
    (process/preempt.py: all learners stop after the same step); the history (the mean loss
    over the learners of every step, the learning rate the optimizer stepped at, read back
    from it, the held-out loss after every sft.val_every steps and the last), the steps done
    and the chunks trained. `log`: rank 0's RunLog (None on the others). Checkpoints every
    sft.checkpoint_every steps, written by `writer` (in the background unless
    learner.checkpoint_background is false, as `train`'s). A step that takes
    pipeline.stall_timeout_s is said, every time, by each learner still in it: its collectives
    wait for all of them, so a learner that hangs is the one not saying so."""
    rank, learners, sft = world.Get_rank(), world.Get_size(), cfg.sft
    samples, history = len(demos.actions), {"losses": [], "lrs": [], "val_losses": []}
    start, done = time.monotonic(), first
    for step in range(first, sft.steps):
        with reminding(cfg.pipeline.stall_timeout_s, lambda waited, at=step + 1: (
                f"hpcvla sft: rank {rank} has been in step {at} for {waited:.0f} s (waiting "
                "for the other learners, or stuck itself)")):
            index = batch_indices(samples, step_chunks(sft, 1), trained, rank, cfg.run.seed)
            loss = _step(engine, demos, np.split(index, sft.micro_batches), lr_at(sft, step))
            history["losses"].append(world.allreduce(loss, op=MPI.SUM) / learners)  # [dist]
            history["lrs"].append(engine.optimizer.param_groups[0]["lr"])
            done, trained = step + 1, trained + step_chunks(sft, learners)
            val = None
            if held_out is not None and (done == sft.steps or
                                         sft.val_every and done % sft.val_every == 0):
                val = held_out_loss(engine, held_out, sft.batch_size, world)  # [dist]
                history["val_losses"].append([done, val])
            writer.check()  # the last checkpoint's write, if it failed: stop within a step
            if sft.checkpoint_every and done % sft.checkpoint_every == 0 and done < sft.steps:
                _checkpoint(cfg, engine, run_dir, done, trained, world, samples, writer)
            stop = preempt.agreed(world)  # [dist]
        if log is not None:
            log.step(history, val, (first, done, trained, samples, learners),
                     time.monotonic() - start)
        if stop:
            break
    return history, done, trained


def _step(engine, demos, passes: list[np.ndarray], lr: float) -> float:
    """One optimizer step at learning rate `lr`, a forward/backward pass on each `passes`'
    chunks (the engine steps after the last); their mean loss."""
    for group in engine.optimizer.param_groups:  # one rate: engine_config's critic's too
        group["lr"] = lr
    losses = []
    for index in passes:
        obs = {k: torch.from_numpy(v[index]).to(engine.device) for k, v in demos.obs.items()}
        actions = torch.from_numpy(demos.actions[index]).to(engine.device)
        real = torch.from_numpy(~demos.pad[index]).to(engine.device)  # past the episode: none
        loss = engine(obs, actions, real)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    phases.mark("first_step")
    return sum(losses) / len(losses)


def held_out_loss(engine, held_out, batch_size: int, world) -> float:
    """The imitation loss over every real step of the held-out demonstrations, no gradient:
    each learner a share of the chunks, in as many batches as every other (ZeRO-3's forward
    is collective; a learner out of chunks weighs a repeat at 0), each batch's loss (a mean
    over its real steps) weighted by them; torch's RNG at one seed, so the draws of flow
    matching's loss are the same at every validation and they compare."""
    rank, learners, chunks = world.Get_rank(), world.Get_size(), len(held_out.actions)
    mine = np.arange(rank, chunks, learners)
    batches = math.ceil(math.ceil(chunks / learners) / batch_size)
    devices = [engine.device] if engine.device.type == "cuda" else []
    weighted, steps = 0.0, 0
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(HELD_OUT_SEED)
        for b in range(batches):
            index = mine[b * batch_size:(b + 1) * batch_size]
            counted = len(index) > 0
            index = index if counted else np.zeros(1, dtype=np.int64)
            real = ~held_out.pad[index]
            obs = {k: torch.from_numpy(v[index]).to(engine.device)
                   for k, v in held_out.obs.items()}
            loss = engine(obs, torch.from_numpy(held_out.actions[index]).to(engine.device),
                          torch.from_numpy(real).to(engine.device))
            if counted:
                weighted += loss.item() * int(real.sum())
                steps += int(real.sum())
    weighted, steps = world.allreduce(np.array([weighted, steps]), op=MPI.SUM)  # [dist]
    return float(weighted / steps)


def _checkpoint(cfg, engine, run_dir: Path, step: int, trained: int, world, samples: int,
                writer, wait: bool = False) -> None:
    """A checkpoint after `step` steps and `trained` chunks handed to `writer` (collective on
    the learners; it is complete once `writer.wait()` returns, or this does with `wait`)."""
    weights = full_state(engine)  # [dist] ZeRO-3 gathers its shards
    writer.save(run_dir, engine, weights if world.Get_rank() == 0 else None, step,  # [dist]
                {catalog.SFT_COUNTER: trained, "sft_samples": samples,
                 "step_chunks": step_chunks(cfg.sft, world.Get_size())}, world,
                keep=cfg.learner.checkpoint_keep, wait=wait)


def _finish(cfg, engine, run_dir: Path, world, history: dict[str, list], done: int,
            trained: int, demos: int, samples: int, writer) -> None:
    """The last checkpoint (what `policy.checkpoint` and `hpcvla eval` load, and what
    `run.resume` goes on from after a stop signal), summary.json: with the start and stop
    (metrics/phases.py; the slowest learner's) and every learner's peak memory."""
    _checkpoint(cfg, engine, run_dir, done, trained, world, samples, writer, wait=True)
    phases.mark("last_checkpoint_written")
    if preempt.requested_at() is not None:
        phases.mark("stop_signal", preempt.requested_at())
    phases.mark("finished")
    reports = world.gather(RankSummary(  # [dist]
        rank=world.Get_rank(), role="sft learner", host=MPI.Get_processor_name(),
        device=str(engine.device), dtype=str(next(engine.module.parameters()).dtype),
        first_version=done - len(history["losses"]), phases_s=phases.of_rank(),
        peak_memory=peak_memory(engine.device)), root=0)
    if world.Get_rank() == 0:
        add_planned_memory(reports, run_dir / MEMORY_PLAN)
        summary = {"steps": done, "learners": world.Get_size(), "demonstrations": demos,
                   "samples": samples, "device": str(engine.device), **history,
                   "preempted": done < cfg.sft.steps,
                   "restarts": restart_log.recorded(run_dir),  # inside the allocation
                   "phases_s": phases.slowest([r.phases_s for r in reports]),
                   "per_rank": [{k: v for k, v in asdict(r).items() if k in PER_RANK}
                                for r in reports]}
        summary["starts"] = starts_so_far(cfg, run_dir / "summary.json", {  # a resumed run's
            "from_step": done - len(history["losses"]), "steps": done,
            "learners": world.Get_size(), "preempted": summary["preempted"]})
        print(phases_line("[hpcvla sft]", summary["phases_s"]))
        print(memory_table(reports, "[hpcvla sft]"), flush=True)
        losses = history["losses"]
        replace_text(run_dir / "summary.json", json.dumps(summary, indent=1))
        line = f"[hpcvla sft] done: loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else \
            "[hpcvla sft] done"
        if history["val_losses"]:
            line += f" | held-out {history['val_losses'][-1][1]:.4f}"
        print(line, f"| RL from it: policy.checkpoint={run_dir}", flush=True)
    idle_barrier(world)  # [dist]


def run_sft(cfg) -> int:
    """`hpcvla sft` on every rank of the world: the job, failing loudly (job/runtime.py)."""
    from hpcvla.job.runtime import run_guarded

    preempt.install()  # SIGTERM/SIGUSR1: stop after the current step, with a checkpoint
    heap.keep_freed_buffers()
    return run_guarded(MPI.COMM_WORLD, "sft learner", lambda: sft_main(cfg, MPI.COMM_WORLD),
                       "sft", threads=cfg.learner.backend == "horovod")
