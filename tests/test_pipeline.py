"""The asynchronous pipeline: every mode end to end with DeepSpeed learners, the batcher's
decisions, the staleness bound under a slow learner, and env-step accounting."""

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from hpcvla.checkpoint import catalog
from hpcvla.config import ConfigError, load_config
from hpcvla.envs import env_spec
from hpcvla.memory.layout import ring_slots
from hpcvla.preflight import check_config, check_pipeline
from hpcvla.roles.batcher import DynamicBatcher
from hpcvla.schedule import schedule_of
from hpcvla.topology.plan import plan_from_config
from helpers import ROOT, Clock, hpcvla, progress_version, run_train


def test_batcher_fires_on_batch_max():
    clock = Clock()
    b = DynamicBatcher(batch_max=16, wait_max=0.010, clock=clock)
    b.add(3, 8)
    assert b.fire_reason() is None
    b.add(1, 8)
    assert b.fire_reason() == "batch_max"
    b.add(2, 8)
    # taken in arrival order, at most B_max envs, served in slot order
    assert b.take() == [1, 3] and b.waiting_envs() == 8


def test_batcher_fires_on_wait_max_and_respects_eligibility():
    clock = Clock()
    b = DynamicBatcher(batch_max=64, wait_max=0.010, clock=clock)
    b.add(0, 8)
    clock.now = 0.004
    b.add(5, 8)
    assert b.fire_reason() is None and b.time_to_deadline() == pytest.approx(0.006)
    clock.now = 0.0101
    assert b.fire_reason() == "wait_max"
    assert b.fire_reason(eligible={5}) is None  # the old request is held back (quota)
    clock.now = 0.0141
    assert b.fire_reason(eligible={5}) == "wait_max"
    assert b.take(eligible={5}) == [5] and b.take() == [0]


def test_synchronous_batcher_waits_for_everybody():
    b = DynamicBatcher(batch_max=32, wait_max=float("inf"), clock=Clock())
    b.add(0, 16)
    assert b.fire_reason() is None
    b.add(1, 16)
    assert b.fire_reason() == "batch_max" and b.take() == [0, 1]


def test_modes_are_schedules_of_the_same_knobs():
    cfg = load_config(ROOT / "configs/default.yaml", ["rollout.batch_max=8",
                                                      "pipeline.max_staleness=2",
                                                      "rollout.wait_max_ms=7"])
    ladder = []
    for mode in ("sync-disaggregated", "train-async", "rollout-async", "streamer"):
        cfg.pipeline.mode = mode
        ladder.append(schedule_of(cfg, envs_per_cell=32))
    assert [s.max_staleness for s in ladder] == [0, 2, 2, 2]
    assert [s.shards for s in ladder] == [1, 1, 2, 2]
    assert [s.batch_max for s in ladder] == [32, 32, 8, 8]
    assert [s.wait_max_s for s in ladder] == [math.inf, math.inf, 0.007, 0.007]
    assert [s.stream_micro_batches for s in ladder] == [False, False, False, True]


def test_pipeline_sizes_checked_before_ranks_start():
    cfg = load_config(ROOT / "configs/default.yaml", ["learner.micro_batch=12"])
    with pytest.raises(ConfigError, match="learner.micro_batch = 12: expected a multiple of"):
        check_pipeline(cfg, plan_from_config(cfg.placement, 4))
    cfg = load_config(ROOT / "configs/default.yaml", ["pipeline.mode=sync-colocated"])
    with pytest.raises(ConfigError, match="placement.mode = 'disaggregated'"):
        check_pipeline(cfg, plan_from_config(cfg.placement, 4))


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync-disaggregated", "train-async", "rollout-async",
                                  "streamer"])
def test_mode_runs_end_to_end_with_deepspeed(tmp_path, mode):
    settings = [f"pipeline.mode={mode}", "pipeline.total_updates=4", "learner.zero_stage=2",
                "learner.epochs=8",  # replay epochs: see the end
                "algorithm.bootstrap_truncated=true",
                *(["algorithm.critic_epochs=1", "learner.ring_slot_kib=16",  # a version:
                   "run.dump_trajectories=true"]  # more slots than the 32 least (ring_slots)
                  if mode == "streamer" else [])]
    out, summary, run_dir = run_train(tmp_path / "run", *settings)
    assert summary["mode"] == mode and summary["env_steps"] > 0
    assert "[hpcvla] update 4/4" in out.stdout
    cfg = load_config(run_dir / "config.yaml")  # resolved as given, and the plan beside it
    assert cfg == load_config(ROOT / "configs/default.yaml",
                              [f"run.root={tmp_path / 'run'}", *settings])
    assert json.loads((run_dir / "plan.json").read_text())["world_size"] == 4
    assert "weight root rank 3" in out.stdout
    slots = ring_slots(cfg, env_spec(cfg.env), 1)
    assert (slots > 32) == (mode == "streamer")
    assert f"trajectory ring: {slots} slots of {cfg.learner.ring_slot_kib} KiB a learner, " \
        "lanes of" in out.stdout
    inference = [r for r in summary["per_rank"] if r["role"] == "inference"]
    sims = [r for r in summary["per_rank"] if r["role"] == "simulator"]
    # every env step counted once: what simulators stepped is what inference answered
    chunk = load_config(run_dir / "config.yaml").env.chunk_len
    assert sum(r["env_steps"] for r in sims) == summary["env_steps"] == \
        sum(r["batch_envs"] for r in inference) * chunk
    trained = sum(summary["staleness_hist"].values())
    assert trained == 4 * 32  # updates x learner batch, each segment once
    # the episodes reach's horizon ended were valued, to bootstrap them
    assert sum(r["truncations_valued"] for r in inference) > 0
    if mode == "streamer":  # ... each the value of its own env's row, no other episode one
        ends = []
        for path in (run_dir / "trajectories").glob("rank*.h5"):
            with h5py.File(path) as f:
                ends += [(bool(d["truncated"][-1]), d.attrs["truncation_value"])
                         for d in f["data"].values()]
        assert {cut for cut, _ in ends} == {True, False}
        assert all(v != 0 for cut, v in ends if cut) and all(v == 0 for cut, v in ends
                                                             if not cut)
    if mode == "sync-disaggregated":
        assert set(summary["staleness_hist"]) == {"0"}
        # one cell, every env in every batch: run again, the same weights and metrics
        # (docs/learning.md, "What a seed fixes")
        _, _, again = run_train(tmp_path / "again", *settings)
        model = "checkpoints/v000004/model.safetensors"
        assert (run_dir / model).read_bytes() == (again / model).read_bytes()
        assert metrics_but_time(run_dir) == metrics_but_time(again)
    assert (run_dir / "timeline.rank0.jsonl").exists() and (run_dir / "metrics.jsonl").exists()
    # the loss statistics are the last epoch's: the policy has moved from the proximal one
    records = metric_records(run_dir)
    assert len(records) == 4 * 2  # updates x micro-batches
    assert any(r["clip_fraction"] > 0 for r in records) and all(r["approx_kl"] > 0
                                                                 for r in records)
    assert all(-10 < r["explained_variance"] <= 1 and r["return_std"] > 0 for r in records)


@pytest.mark.mpi
@pytest.mark.slow
def test_sync_colocated_runs_with_deepspeed_on_every_rank(tmp_path):
    settings = ["pipeline.total_updates=3", "learner.zero_stage=3", "run.dump_trajectories=true",
                "algorithm.bootstrap_truncated=true",
                "algorithm.advantage_norm=batch"]  # its statistics: a sum over the 4 learners
    out, summary, run_dir = run_train(tmp_path / "run", *settings,
                                      config="configs/colocated.yaml", ranks=4)
    assert summary["mode"] == "sync-colocated" and summary["ranks"] == 4
    assert summary["staleness_hist"] == {"0": 4 * 3 * 32}
    assert summary["env_steps"] == sum(r["env_steps"] for r in summary["per_rank"])
    # every rank explores with its own noise: with one shared stream the Gaussian policy's
    # behaviour log-probs (a function of the noise alone) repeat across ranks step for step
    seeds = json.loads((run_dir / "rng_seeds.json").read_text())["ranks"]
    assert len({s["torch"] for s in seeds.values()}) == len(seeds) == 4
    logprobs = dumped_logprobs(run_dir)
    shared = set(logprobs[0].tolist()) & set(logprobs[1].tolist())
    assert len(shared) < 0.01 * len(logprobs[0]), len(shared)
    # an episode the horizon ended carries the value PPO bootstrapped it from; no other does
    with h5py.File(run_dir / "trajectories" / "rank0.h5") as f:
        ends = [(bool(d["truncated"][-1]), d.attrs["truncation_value"])
                for d in f["data"].values()]
    assert all(v != 0 for cut, v in ends if cut) and all(v == 0 for cut, v in ends if not cut)
    assert {cut for cut, _ in ends} == {True, False}
    # lock-step on every rank, the run is a function of run.seed: run again, the same bytes
    # (docs/learning.md, "What a seed fixes")
    _, _, again = run_train(tmp_path / "again", *settings, config="configs/colocated.yaml",
                            ranks=4)
    model = "checkpoints/v000003/model.safetensors"
    assert (run_dir / model).read_bytes() == (again / model).read_bytes()
    assert all(np.array_equal(*pair) for pair in zip(logprobs, dumped_logprobs(again)))
    assert metrics_but_time(run_dir) == metrics_but_time(again)


def dumped_logprobs(run_dir) -> list[np.ndarray]:
    """Every rank's dumped behaviour log-probs, its episodes in the file's (name) order."""
    logprobs = []
    for rank in range(4):
        with h5py.File(run_dir / "trajectories" / f"rank{rank}.h5") as f:
            logprobs.append(np.concatenate([d["logprobs"][()] for d in f["data"].values()]))
    return logprobs


def metric_records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def metrics_but_time(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time"} for r in metric_records(run_dir)]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("mode,bound", [("streamer", 2), ("rollout-async", 1)])
def test_staleness_bounded_with_slow_learner(tmp_path, mode, bound):
    """Uneven simulators (long-tail latency) make segments arrive out of start order: the
    bound must still hold, with nothing dropped and no stall. ~30 s: the learner is slowed on
    purpose, so that producers run ahead of it for several versions. Both bounds and both
    dynamic-batcher modes (one schedule.eligible rule serves every bound and mode)."""
    out, summary, _ = run_train(tmp_path, f"pipeline.mode={mode}",
                                f"pipeline.max_staleness={bound}", "pipeline.total_updates=6",
                                "emulate.learner_ms_per_micro_batch=1200",  # x 1 epoch
                                "env.latency_median_ms=20", "env.latency_sigma=0.8")
    hist = {int(k): v for k, v in summary["staleness_hist"].items()}
    assert max(hist) <= bound and hist.get(bound, 0) > 0  # reached, never exceeded
    assert sum(hist.values()) == 6 * 32  # every batch complete
    inference = [r for r in summary["per_rank"] if r["role"] == "inference"]
    assert sum(r["throttled_s"] for r in inference) > 0  # producers were held back
    # ...and the segments they had finished still went out, valued by passes serving others
    assert sum(r["held_valued"] for r in inference) > 0


@pytest.mark.mpi
@pytest.mark.slow
def test_two_nodes_two_learners_zero3_streamer(tmp_path):
    """Two emulated nodes, a cell and a learner on each: ZeRO-3 across the learners, weights
    crossing to each node's leader once, the staleness bound over both feeds."""
    out, summary, _ = run_train(tmp_path, "placement.ranks_per_node=4", "learner.zero_stage=3",
                                "pipeline.total_updates=3", ranks=8)
    learners = [r for r in summary["per_rank"] if r["role"] == "learner"]
    assert len(learners) == 2 and all(r["ring"]["bad_slots"] == 0 for r in learners)
    inference = [r for r in summary["per_rank"] if r["role"] == "inference"]
    assert len(inference) == 2 and all(r["weight_swaps"] >= 1 for r in inference)  # each node
    assert sum(summary["staleness_hist"].values()) == 2 * 3 * 32
    assert max(int(k) for k in summary["staleness_hist"]) <= 1
    assert "FutureWarning" not in out.stderr, out.stderr[-3000:]  # torch's, of ZeRO's gathers
    # the progress line's rolling figures are both learners' episodes, pooled, as summary.json
    from hpcvla.metrics.progress import figure
    last = [line for line in out.stdout.splitlines() if line.startswith("[hpcvla] update 3/3")]
    window = [r["ended_episodes"] for r in learners]
    assert min(window) > 0 and f"success {figure(summary['success_rate'])} (last " \
        f"{sum(window)} eps)" in last[-1], (window, last)
    # the end-of-run line of where each role's time went, summary.json's figures
    (busy,) = [line for line in out.stdout.splitlines() if line.startswith("[hpcvla] busy")]
    roles = dict(part.split(" ", 1) for part in busy.split(": ", 1)[1].split(" | "))
    share = summary["busy_fraction"]
    for role, stage in (("learner", "train"), ("inference", "infer"),
                        ("simulator", "simulate")):
        assert f"{stage} {share[f'{role}:{stage}']:.2f}" in roles[role], busy
        assert roles[role].endswith(f"(cpu {summary['cpu_fraction'][role]:.2f})"), busy


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.bench
def test_modes_benchmark_measures_modes_against_sync_colocated(tmp_path):
    """CI's short run of `hpcvla bench modes`: the baseline and the streamer measured with
    their bounds; no targets. Two worlds (~35 s): every mode trains in its own test above."""
    out = hpcvla("bench", "modes", "--workload", "emulated", "--quick", "--json",
                 tmp_path / "modes.json", "--modes", "sync-colocated,streamer", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "modes.json").read_text())
    assert list(results["modes"]) == ["sync-colocated", "streamer"]
    for mode, r in results["modes"].items():
        assert r["throughput"] > 0 and r["ideal_bound"] > 0, mode
        assert r["efficiency"] == pytest.approx(r["throughput"] / r["ideal_bound"])
        assert any(k.endswith(":simulate") or k.endswith("+learner:simulate")
                   for k in r["busy_fraction"]), r["busy_fraction"]
    modes = results["modes"]
    assert results["speedup_vs_sync_colocated"]["streamer"] == pytest.approx(
        modes["streamer"]["throughput"] / modes["sync-colocated"]["throughput"])


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.bench
def test_shards_benchmark_measures_both_ways_side_by_side(tmp_path):
    """CI's short run of `hpcvla bench shards`: the same worker processes stepped one after
    another and concurrently; the ratio is the ratio of the two measured throughputs."""
    out = hpcvla("bench", "shards", "--workload", "emulated", "--quick", "--json",
                 tmp_path / "shards.json", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads((tmp_path / "shards.json").read_text())
    assert (r["shards"], r["rounds"]) == (2, 4) and "concurrent / sequential" in out.stdout
    assert r["throughput"]["sequential"] > 0 and r["throughput"]["concurrent"] > 0
    assert r["concurrent_over_sequential"] == pytest.approx(
        r["throughput"]["concurrent"] / r["throughput"]["sequential"])


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("config,ranks,extra", [
    ("configs/default.yaml", 4, ["learner.zero_stage=1"])])
def test_resume_continues_from_the_newest_checkpoint(tmp_path, config, ranks, extra):
    """Checkpoints land in the run directory; a resumed run picks up the policy version,
    optimizer and counters, trains exactly the remaining versions, and writes on there.
    Colocated runs resume in test_sigterm_checkpoints_and_the_run_resumes (the default
    stage) and test_resume_on_fewer_learners_at_another_zero_stage (from ZeRO-3)."""
    out, first, run_dir = run_train(tmp_path, "pipeline.total_updates=3",
                                    "learner.checkpoint_every=1", *extra, config=config,
                                    ranks=ranks)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["v000002", "v000003"]
    assert [p.name for p in catalog.complete(run_dir)] == ["v000002", "v000003"]
    for path in catalog.complete(run_dir):  # written in the background while training
        state = catalog.verify(path)  # every file there, its checksum right
        assert state["version"] == int(path.name[1:])
        assert sorted(p.name for p in path.iterdir()) == ["model.safetensors", *(
            f"optimizer.rank{r}.safetensors" for r in range(state["learners"])), "state.json"]
    lines = len((run_dir / "metrics.jsonl").read_text().splitlines())
    # what the run ran with: this checkout's commit, the MPI library, the packages. The
    # resume below finds torch upgraded since (the record rewritten as from an older one)
    (ran,) = map(json.loads, (run_dir / "software.jsonl").read_text().splitlines())
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert ran["hpcvla"]["commit"] == head and ran["mpi"], ran
    torch_version, ran["packages"]["torch"] = ran["packages"]["torch"], "2.0.0"
    (run_dir / "software.jsonl").write_text(json.dumps(ran) + "\n")
    out = hpcvla("train", config, "--ranks", ranks, f"run.resume={run_dir}",
                 "pipeline.total_updates=5", "learner.checkpoint_every=0",
                 "run.dump_trajectories=true", *extra, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resuming from" in out.stdout and "update 5/5" in out.stdout
    assert "[hpcvla] resumed with settings changed since the run last ran: " \
        "run.dump_trajectories: False -> True; pipeline.total_updates: 3 -> 5; " \
        "learner.checkpoint_every: 1 -> 0\n" in out.stdout
    assert "[hpcvla] resumed with other software than the run last ran with: packages.torch: " \
        f"'2.0.0' -> '{torch_version}'\n" in out.stdout
    assert len((run_dir / "software.jsonl").read_text().splitlines()) == 2
    # the resumed start acts with v000003's weights, the weight root having read them: a
    # step it dumped at version 3 scores as recorded under them
    import torch

    from hpcvla.evaluate import checkpoint_weights
    from hpcvla.factory import build_policy
    cfg = load_config(run_dir / "config.yaml")
    policy = build_policy(cfg, env_spec(cfg.env))
    policy.load_arrays(checkpoint_weights(run_dir / "checkpoints" / "v000003")[0])
    with h5py.File(next((run_dir / "trajectories").glob("rank*.h5"))) as f:
        demo = next(f["data"][k] for k in f["data"] if f["data"][k].attrs["policy_version"] == 3)
        obs = {k: torch.from_numpy(demo["obs"][k][:2]) for k in demo["obs"]}
        actions, recorded = torch.from_numpy(demo["actions"][:2]), demo["logprobs"][:2]
    with torch.no_grad():
        np.testing.assert_allclose(policy.evaluate(obs, actions)[0].numpy(), recorded,
                                   rtol=1e-4, atol=1e-4)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["v000003", "v000005"]
    second = json.loads((run_dir / "summary.json").read_text())
    assert {r["first_version"] for r in second["per_rank"]} == {3}
    learners = sum("learner" in r["role"] for r in second["per_rank"])
    assert sum(second["staleness_hist"].values()) == 2 * 32 * learners  # versions 4, 5 once
    records = metric_records(run_dir)
    assert len(records) > lines and records[lines]["trained_env_steps"] > \
        records[lines - 1]["trained_env_steps"]  # counters continue, not restart
    assert list(run_dir.glob("config.resume-*.yaml"))
    # a damaged newest checkpoint: the rank that reads it takes the world down naming the
    # file and the fix, without a traceback (its message says all)
    model = run_dir / "checkpoints" / "v000005" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-100] ^= 0xFF
    model.write_bytes(bytes(data))
    out = hpcvla("train", config, "--ranks", ranks, f"run.resume={run_dir}",
                 "pipeline.total_updates=6", *extra, timeout=400)
    assert out.returncode != 0 and "checksum mismatch" in out.stderr, out.stderr[-3000:]
    assert "move v000005 out of" in out.stderr and "Traceback" not in out.stderr, \
        out.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.slow
def test_resume_on_fewer_learners_at_another_zero_stage(tmp_path):
    """A run of 4 learners at ZeRO-3 goes on with 2 at ZeRO-1, then with 1 at stage 0: the
    optimizer state is re-partitioned (tests/test_checkpoint.py checks it exact), each
    remaining version trained once."""
    small = ["env.image_size=32", "policy.hidden=32"]
    _, _, run_dir = run_train(tmp_path, "pipeline.total_updates=2", "learner.zero_stage=3",
                              *small, config="configs/colocated.yaml", ranks=4)
    for ranks, stage, updates in ((2, 1, 3), (1, 0, 4)):
        out = hpcvla("train", "configs/colocated.yaml", "--ranks", ranks,
                     f"run.resume={run_dir}", f"learner.zero_stage={stage}",
                     f"pipeline.total_updates={updates}", *small, timeout=400)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert f"re-partitioned onto {ranks} at ZeRO-{stage}" in out.stdout, out.stdout
        summary = json.loads((run_dir / "summary.json").read_text())
        assert {r["first_version"] for r in summary["per_rank"]} == {updates - 1}
        assert sum(summary["staleness_hist"].values()) == 32 * ranks  # one version, once


@pytest.mark.mpi
@pytest.mark.slow
def test_checkpoints_by_the_clock_are_written_by_every_learner_alike(tmp_path):
    """learner.checkpoint_every_s: a checkpoint at the first version's end that long after the
    last, the first learner's clock deciding for all (each writes its optimizer ranges): here
    at every version (a millisecond), though learner.checkpoint_every counts none."""
    _, _, run_dir = run_train(tmp_path, "pipeline.total_updates=4", "learner.checkpoint_every=0",
                              "learner.checkpoint_every_s=0.001", "learner.checkpoint_keep=9",
                              "env.image_size=32", "policy.hidden=32",
                              config="configs/colocated.yaml", ranks=2)
    kept = catalog.complete(run_dir)
    assert [p.name for p in kept] == [f"v00000{v}" for v in (1, 2, 3, 4)]
    assert all(catalog.verify(p)["learners"] == 2 for p in kept)


def test_resume_refused_before_ranks_start(tmp_path):
    with pytest.raises(ConfigError, match="run.resume"):
        check_config(load_config(ROOT / "configs/default.yaml", [f"run.resume={tmp_path}"]))


@pytest.mark.mpi
def test_an_inference_rank_held_long_by_the_quota_says_so_and_waits_on(tmp_path):
    """A learner slower than pipeline.stall_timeout_s per version (here 3 s against 1 s):
    its inference rank, every env held by the staleness quota, says so each second, naming
    the learner, and waits on, and the learner says it is still in its version; the run ends
    well. (A learner that hangs is the one not saying so.) ~6 s."""
    out = hpcvla("train", "configs/default.yaml", "--ranks", 4, f"run.root={tmp_path}",
                 "pipeline.total_updates=1", "emulate.learner_ms_per_micro_batch=1500",
                 "pipeline.stall_timeout_s=1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("s since the last new policy version from learner rank 3: the "
                            "staleness quota holds every env") >= 2, out.stderr[-3000:]
    assert out.stderr.count("hpcvla: rank 3 (learner) has been in version 1 for ") >= 2, \
        out.stderr[-3000:]
    # its start-up too (torch's imports alone take longer than 1 s here): every rank says which
    # step it reached, until the clocks start (a stalled load was silent on every rank)
    starting = re.findall(r"hpcvla: rank (\d) \(\w+\) is still starting after \d+ s \(its last "
                          r"step done: (\w+);", out.stderr)
    assert {rank for rank, _ in starting} == {"0", "1", "2", "3"}, out.stderr[-3000:]


@pytest.mark.mpi
def test_a_colocated_rank_long_in_its_version_says_so(tmp_path):
    """sync-colocated: every rank trains each version together, its collectives waiting for
    all; a version longer than pipeline.stall_timeout_s (3 s against 1 s) is said by each rank
    in it, so a rank stuck in its rollout is the one not saying so (none said anything). ~10 s."""
    out = hpcvla("train", "configs/colocated.yaml", "--ranks", 2, f"run.root={tmp_path}",
                 "pipeline.total_updates=1", "emulate.learner_ms_per_micro_batch=1500",
                 "pipeline.stall_timeout_s=1")
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        assert f"hpcvla: rank {rank} (colocated) has been in version 1's training, checkpoint " \
            "and held-out evaluation for " in out.stderr, out.stderr[-3000:]


@pytest.mark.mpi
def test_a_spare_rank_says_it_has_no_role_while_it_waits(tmp_path):
    """A spare rank (placement.learners caps the learners) goes to its teardown at once and
    waits there the whole run: its reminders say it has no role, not that its peers are late
    to a teardown (which named it as one of the ranks waiting on a hung one). ~25 s."""
    out = hpcvla("train", "configs/default.yaml", "--ranks", 5, f"run.root={tmp_path}",
                 "placement.per_node={simulator: 2, inference: 1, learner: 2}",
                 "placement.learners=1", "pipeline.total_updates=2",
                 "emulate.learner_ms_per_micro_batch=1500", "pipeline.stall_timeout_s=1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "hpcvla: rank 4 (spare) has waited 1 s in its teardown (no role: it waits for the " \
        "run's end) for its peers" in out.stderr, out.stderr[-3000:]


def rank_pid(argument: str, rank: int) -> int:
    """The pid of world rank `rank` of the world whose command line holds `argument` (MPICH
    gives each rank its number in PMI_RANK)."""
    for pid in subprocess.run(["pgrep", "-f", argument], capture_output=True,
                              text=True).stdout.split():
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no rank {rank} running with {argument}")


def train_stopping_rank_1(tmp_path, updates: int, stall_s: int, when: str):
    """`hpcvla train` of default.yaml on 4 ranks (rank 1: a simulator), rank 1 stopped
    (SIGSTOP) as the first line holding `when` prints: (the process, rank 1's pid, the lines
    so far)."""
    proc = subprocess.Popen([sys.executable, "-m", "hpcvla", "train", "configs/default.yaml",
                             "--ranks", "4", f"run.root={tmp_path}",
                             f"pipeline.total_updates={updates}",
                             f"pipeline.stall_timeout_s={stall_s}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if when in line:
            pid = rank_pid(f"run.root={tmp_path}", 1)
            os.kill(pid, signal.SIGSTOP)
            return proc, pid, out
    proc.kill()
    raise AssertionError("".join(out)[-3000:])  # the line never came


@pytest.mark.mpi
def test_a_rank_that_hangs_at_the_end_is_the_one_its_peers_do_not_hear_from(tmp_path):
    """A simulator stopped (SIGSTOP) as the last version lands: wherever the others then
    wait for it (the inference rank for its last request, the windows freed together, the
    report, the last barrier), they say so each pipeline.stall_timeout_s, and it says
    nothing; once it goes on, the run ends well. ~6 s."""
    proc, pid, out = train_stopping_rank_1(tmp_path, 5, 1, "update 5/5")
    try:
        time.sleep(2.5)
        os.kill(pid, signal.SIGCONT)
        out.append(proc.communicate(timeout=120)[0])
    finally:
        if proc.poll() is None:  # on failure: let it end
            os.kill(pid, signal.SIGCONT)
        proc.kill()
    text = "".join(out)
    assert proc.returncode == 0, text[-3000:]
    said = [line for line in text.splitlines() if line.startswith("hpcvla: rank ") and (
        "has waited" in line or "has finished and waited" in line or "have not asked" in line)]
    own = [line for line in said if line.startswith("hpcvla: rank 1 ")]
    # stopped inside a wait, it says (once) that the time it was stopped has passed
    assert len(own) <= 1 and len(said) - len(own) >= 2, text[-3000:]


@pytest.mark.mpi
def test_a_simulator_that_hangs_mid_run_is_named_before_the_learner_gives_up(tmp_path):
    """A simulator stopped (SIGSTOP) mid-run, outside any env step (its watchdog sees
    nothing): its inference rank names it at half pipeline.stall_timeout_s, and then the
    learner's stall abort takes the job down. ~6 s."""
    proc, pid, out = train_stopping_rank_1(tmp_path, 2000, 3, "[hpcvla] update ")
    try:
        out.append(proc.communicate(timeout=60)[0])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    text = "".join(out)
    assert proc.returncode != 0, text[-3000:]
    named = text.find("simulator rank(s) [1] have not asked for actions")
    abort = text.find("no trajectory for 3 s")
    assert 0 <= named < abort, text[-3000:]
    assert "[2]" not in text[named - 200:abort], text[-3000:]  # the other simulator asks on


def test_a_process_whose_work_is_done_ignores_stop_signals_through_its_shutdown():
    """preempt.ignore_from_now, where a rank's work ends: SIGTERM is ignored by the kernel
    (SigIgn) from then on, through the interpreter's shutdown, where Python puts back the
    default action of the signals it handles (which killed finished runs: exit 15), but not
    of an ignored one. The signals come every 2 ms until the process is gone. (That window is
    too short for signals to hit deterministically: the kernel's SigIgn mask is the check.)"""
    def child(ignore: bool) -> tuple[int, int, int]:
        code = ("import sys, time; from hpcvla.process import preempt; preempt.install(); "
                + ("preempt.ignore_from_now(); " if ignore else "")
                + "print('ready', flush=True); time.sleep(0.2)")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        status = Path(f"/proc/{proc.pid}/status").read_text()
        ignored = int(next(line.split()[1] for line in status.splitlines()
                           if line.startswith("SigIgn:")), 16)
        sent = 0
        while proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
                sent += 1
            time.sleep(0.002)
        return proc.wait(), ignored >> (signal.SIGTERM - 1) & 1, sent

    returncode, ignored, sent = child(ignore=True)
    assert (returncode, ignored) == (0, 1) and sent > 10, (returncode, ignored, sent)
    assert child(ignore=False)[1] == 0  # the handler's flag, then shutdown's default action


@pytest.mark.mpi
def test_a_stop_signal_after_the_run_is_done_leaves_it_done(tmp_path):
    """A scheduler's SIGTERM as the ranks shut down (here to mpiexec, the moment the final
    line prints): they ignore it from the end of their work on, where Python's shutdown
    would have put back its default action and killed a finished run (exit 15). ~5 s."""
    proc = subprocess.Popen([sys.executable, "-m", "hpcvla", "train", "configs/default.yaml",
                             "--ranks", "4", f"run.root={tmp_path}", "pipeline.total_updates=3"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    out, mpiexec = [], []
    try:
        for line in proc.stdout:
            out.append(line)
            if "[hpcvla] done:" in line:
                mpiexec = [int(p) for p in subprocess.run(
                    ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()]
                for pid in mpiexec:
                    os.kill(pid, signal.SIGTERM)
                break
        out.append(proc.communicate(timeout=120)[0])
    finally:
        proc.kill()
    assert mpiexec and proc.returncode == 0, "".join(out)[-3000:]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("config,ranks,stop,extra", [
    ("configs/default.yaml", 4, signal.SIGTERM, ()),
    ("configs/colocated.yaml", 2, signal.SIGINT, ()),
    # Open MPI's mpirun kills the ranks a second after a SIGTERM: versions of seconds here
    ("configs/colocated.yaml", 2, signal.SIGTERM, ("launch.mpi=openmpi",
                                                   "env.latency_median_ms=100"))])
def test_sigterm_checkpoints_and_the_run_resumes(tmp_path, config, ranks, stop, extra):
    """A scheduler's SIGTERM (here to `hpcvla train`, which hands a stop signal to mpiexec
    and every rank) stops the run after a whole version with a checkpoint, and so does Ctrl-C
    (SIGINT: the launcher says so and exits 130), however long the version takes; resuming
    trains exactly the versions that are left, each batch once."""
    cmd = [sys.executable, "-m", "hpcvla", "train", config, "--ranks", str(ranks),
           f"run.root={tmp_path / 'runs'}", "pipeline.total_updates=1000",
           "pipeline.progress_every_s=0.1", *extra]
    with open(tmp_path / "stderr.txt", "w+") as errors:
        launched = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            head = []
            for line in proc.stdout:  # progress lines; a world that dies ends the loop
                head.append(line)
                if (progress_version(line) or 0) >= 2:
                    signalled = time.time()
                    proc.send_signal(stop)
                    break
            out, _ = proc.communicate(timeout=120)
            out = "".join(head) + out
        finally:
            proc.kill()
        errors.seek(0)
        err = errors.read()
    assert proc.returncode == (130 if stop == signal.SIGINT else 0), out[-2000:] + err[-3000:]
    assert ("Ctrl-C again to kill the world now" in err) == (stop == signal.SIGINT), err
    (run_dir,) = (tmp_path / "runs").iterdir()
    first = json.loads((run_dir / "summary.json").read_text())
    (ckpt,) = (run_dir / "checkpoints").iterdir()
    stopped_at = int(ckpt.name[1:])
    assert first["preempted"] and 2 <= stopped_at < 1000
    assert "feeds  device  notes" in out  # the start-up rank map says where each rank computes
    learners = sum("learner" in r["role"] for r in first["per_rank"])
    per_version = 32 * learners  # micro_batch 16 x micro_batches 2 per learner
    assert sum(first["staleness_hist"].values()) == stopped_at * per_version  # whole versions
    saved = json.loads((ckpt / "state.json").read_text())["counters"]
    assert saved["version_segments"] == per_version  # a resume checks its batch against it
    # the start and the stop, in seconds since `hpcvla train` started (the slowest rank's).
    # The start barrier's end is its first rank's: the slowest rank to mark leaving it may be
    # one the loaded machine put aside while the others acted and built the engine.
    steps = first["phases_s"]
    barrier_left = min(rank["phases_s"]["all_ranks_ready"] for rank in first["per_rank"])
    before = ["imports", "communicators", "policy_built", "transport_ready"]
    before = [s for s in before if s != "transport_ready" or ranks > 2]  # colocated: none
    after = ["engine_ready", "first_version_trained", "stop_signal", "last_checkpoint_written",
             "finished"]
    seconds = [steps[s] for s in before] + [barrier_left] + [steps[s] for s in after]
    assert seconds == sorted(seconds), steps
    # the cell acts on the first version, published before the learner builds its engine;
    # whether the first pass ends before the engine is ready is a race here (the engine,
    # preloaded, builds in 10-40 ms: 1 ms apart on a loaded machine), so not asserted
    assert barrier_left < steps["first_act"] < steps["first_version_trained"], steps
    assert abs(steps["stop_signal"] - (signalled - launched)) < 1.0, (steps, signalled - launched)
    assert "peak memory, GiB" in out and "start and stop, s since launch" in out
    for rank in first["per_rank"]:  # each rank's own steps and peak memory
        assert 0 < rank["phases_s"]["imports"] <= rank["phases_s"]["finished"], rank
        assert ("build_engine" in rank["busy_s"]) == ("learner" in rank["role"]), rank
        assert 50e6 < rank["peak_memory"]["host_rss"] < 8e9, rank

    # the command it printed, as printed (no config: the run's own), and 2 more versions
    printed = re.search(r"continue with `hpcvla (train [^`]*)`", out).group(1).split()
    assert printed == ["train", f"run.resume={run_dir}", "--ranks", str(ranks)], printed
    out = hpcvla(*printed, f"pipeline.total_updates={stopped_at + 2}", timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    second = json.loads((run_dir / "summary.json").read_text())
    assert not second["preempted"] and sum(second["staleness_hist"].values()) == 2 * per_version
    # summary.json is the last start's; both starts' headlines stay in `starts`
    assert [(s["from_version"], s["preempted"], s["env_steps"]) for s in second["starts"]] == [
        (0, True, first["env_steps"]), (stopped_at, False, second["env_steps"])], second["starts"]
    assert f"the whole run, 2 starts: {first['env_steps'] + second['env_steps']} env steps" \
        in out.stdout, out.stdout[-2000:]
    (resumed,) = run_dir.glob("config.resume-*.yaml")
    assert yaml.safe_load(resumed.read_text())["placement"] == \
        yaml.safe_load((run_dir / "config.yaml").read_text())["placement"]


@pytest.mark.mpi
@pytest.mark.slow
def test_sync_batch_smaller_than_the_cell_does_not_stall(tmp_path):
    """A version's batch (32 segments) covers half of a 64-env cell: the synchronous batcher
    serves the half the quota lets through instead of waiting for the held-back half."""
    out, summary, _ = run_train(tmp_path, "pipeline.mode=sync-disaggregated",
                                "env.envs_per_simulator=32", "learner.micro_batch=32",
                                "learner.micro_batches=1", "pipeline.total_updates=3",
                                "env.image_size=32", "policy.hidden=32")
    assert sum(summary["staleness_hist"].values()) == 3 * 32
    assert set(summary["staleness_hist"]) == {"0"}


@pytest.mark.mpi
@pytest.mark.slow
def test_stuck_simulators_stop_the_job_loudly(tmp_path):
    start = time.monotonic()
    out = hpcvla("train", "configs/default.yaml", "--ranks", 4, f"run.root={tmp_path}",
                 "env.latency_median_ms=600000", "pipeline.stall_timeout_s=3", timeout=120)
    assert out.returncode != 0 and time.monotonic() - start < 90
    assert "no trajectory for 3 s" in out.stderr and "(learner)" in out.stderr
    # the cause, named: the producers never tried to write (not a transport problem)
    assert "no producer has tried to write since (stuck upstream" in out.stderr, out.stderr
    assert "producer rank 0: nothing" in out.stderr, out.stderr
