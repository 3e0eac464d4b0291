"""What a restart inside the allocation records (hpcvla.job.restarts, called by jobs/launch.sh):
the version it resumes from and the env steps trained since that checkpoint, read from a
metrics.jsonl whose last line the dying world may have left half-written. The restart itself
runs in tests/test_slurm.py. And how it fits the run to the nodes left: fewer cells, and fewer
learners (the rest spare) where the learners would outnumber the producers left."""

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from hpcvla.job import restarts
from hpcvla.checkpoint import catalog
from hpcvla.config import load_config
from hpcvla.metrics import restart_log
from hpcvla.topology.plan import PlanError
from helpers import ROOT, fake_checkpoint, hpcvla


def test_a_restart_records_what_it_resumes_from_and_what_it_lost(tmp_path, capsys):
    run = tmp_path / "default-1"
    fake_checkpoint(catalog.checkpoint_dir(run, 2), counters={"trained_env_steps": 2048})
    (run / "config.yaml").write_text("run: {name: default}\n")
    (run / "metrics.jsonl").write_text(
        json.dumps({"update": 3, "trained_env_steps": 3072}) + '\n{"update": 3, "trained_en')
    assert restarts.newest_version(tmp_path) == 2
    restarts._main(["newest-version", str(tmp_path)])  # as jobs/launch.sh asks it
    assert capsys.readouterr().out == "2\n"
    entry = restarts.record(tmp_path, 255, ["h2"], ["h0", "h1"], 6)
    assert entry["resumed_from_version"] == 2 and entry["lost_env_steps"] == 1024
    assert entry["dropped_nodes"] == ["h2"] and entry["nodes"] == ["h0", "h1"]
    assert restart_log.recorded(run) == [entry]


def test_an_sft_runs_restart_records_the_steps_it_lost(tmp_path):
    """An `hpcvla sft` run counts its work in steps (its checkpoints' version) and writes one
    metrics.jsonl line a step; its interval is sft.checkpoint_every."""
    run = tmp_path / "default-sft-1"
    fake_checkpoint(catalog.checkpoint_dir(run, 40), version=40,
                    counters={catalog.SFT_COUNTER: 640, "sft_samples": 16})
    (run / "config.yaml").write_text("run: {name: default}\nsft: {steps: 100}\n")
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 47, "trained_chunks": 752}) + '\n{"step": 48, "trai')
    entry = restarts.record(tmp_path, 137, [], ["h0"], 2)
    assert entry["resumed_from_version"] == 40 and entry["trained_steps"] == 47
    assert entry["lost_steps"] == 7 and "lost_env_steps" not in entry
    assert restarts.resumable_run(tmp_path) == run  # 40 of sft.steps' 100


def test_a_resumed_runs_end_is_the_one_it_last_ran_with(tmp_path, capsys):
    """A run started for 20 versions and resumed for 400 is still resumable at version 215
    (restarts and requeues continue it), and a restart's record never counts fewer env steps
    than its checkpoint holds (metrics.jsonl's last line may be older than the checkpoint)."""
    run = tmp_path / "default-1"
    fake_checkpoint(catalog.checkpoint_dir(run, 215), version=215,
                    counters={"trained_env_steps": 440320})
    (run / "config.yaml").write_text("pipeline: {total_updates: 20}\n")
    (run / "config.resume-20261205-100000.yaml").write_text("pipeline: {total_updates: 400}\n")
    (run / "metrics.jsonl").write_text(json.dumps({"update": 213, "trained_env_steps": 438272}))
    assert restarts.resumable_run(tmp_path) == run
    entry = restarts.record(tmp_path, 137, [], ["h0"], 2)
    assert entry["trained_env_steps"] == 440320 and entry["lost_env_steps"] == 0
    (catalog.checkpoint_dir(run, 215) / "state.json").write_text("{garbled")
    with pytest.raises(SystemExit, match="hpcvla.job.restarts resumable: "):
        restarts._main(["resumable", str(tmp_path)])  # said, not a traceback


def test_a_run_a_signal_reached_after_its_last_checkpoint_was_not_stopped(tmp_path):
    """summary.json's `preempted` from a signal in the teardown, after the run's last
    checkpoint: the run is complete, not stopped short (the job's exit status stays 0), and a
    job that names the run (run.resume=) asks about it by its own directory."""
    run = tmp_path / "default-1"
    (run / "config.yaml").parent.mkdir()
    (run / "config.yaml").write_text("pipeline: {total_updates: 20}\n")
    (run / "summary.json").write_text(json.dumps({"preempted": True}))
    assert restarts.stopped_run(tmp_path) == run  # stopped before any checkpoint: short too
    fake_checkpoint(catalog.checkpoint_dir(run, 12), version=12)
    assert restarts.stopped_run(tmp_path) == run == restarts.stopped_run(run)
    fake_checkpoint(catalog.checkpoint_dir(run, 20), version=20)
    assert restarts.stopped_run(tmp_path) is None and restarts.newest_version(run) == 20


def test_a_jobs_run_is_the_one_it_names_wherever_it_names_it(tmp_path, capsys):
    """job-run: the run a command names by run.resume, in its config file as on its command
    line, with that run's state against the end the command runs to (an extended run is
    resumable), else the newest under the job's run root; `null` names none."""
    run = tmp_path / "old" / "default-1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("pipeline: {total_updates: 20}\n")
    fake_checkpoint(catalog.checkpoint_dir(run, 20), version=20)
    named = tmp_path / "named.yaml"
    named.write_text(f"run: {{resume: {run}}}\npipeline: {{total_updates: 20}}\n")
    root = tmp_path / "job"
    assert restarts.job_run(load_config(named), "train", root) == (str(run), "complete")
    assert restarts.job_run(load_config(named, ["pipeline.total_updates=40"]), "train",
                            root) == (str(run), "resumable")
    restarts._main(["job-run", str(root), "train", f"run.resume={run}"])  # the run's config
    assert capsys.readouterr().out == f"{run}\ncomplete\n"
    assert restarts.job_run(load_config(named, ["run.resume=null"]), "train", root) == ("", "")
    root.mkdir()  # the job's own run, started and without a checkpoint yet
    (root / "default-2").mkdir()
    (root / "default-2" / "config.yaml").write_text("run: {name: default}\n")
    assert restarts.job_run(load_config(None, []), "train", root) == ("", "none")


@pytest.mark.mpi  # the job script, no world
def test_a_job_naming_a_complete_run_ends_at_once_saying_so(tmp_path):
    """A job (jobs/launch.sh) that names a run already at the end it runs to (a requeued
    continuation job, or a forgotten pipeline.total_updates) exits 0 before any world,
    saying how to train on; before, the world refused it (exit 2)."""
    run = tmp_path / "default-1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("pipeline: {total_updates: 20}\n")
    fake_checkpoint(catalog.checkpoint_dir(run, 20), version=20)
    env = {**os.environ, "HPCVLA_RANKS": "2", "HPCVLA_JOB_RUNS": str(tmp_path / "job"),
           "HPCVLA_DOCTOR": "0"}
    out = subprocess.run([ROOT / "jobs/launch.sh", "train", f"run.resume={run}"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"the job's run ({run}) has its checkpoint at the end this command runs to" in \
        out.stderr and "raise pipeline.total_updates with run.resume=" in out.stderr
    assert "running:" not in out.stderr


@pytest.mark.mpi
def test_a_job_starts_a_world_again_and_restarts_it_within_bounds(tmp_path):
    """jobs/launch.sh's loop of starts (outside a scheduler: the same loop). A world every
    rank of which refuses (exit 2: here an MPI below MPI_THREAD_MULTIPLE) is not started
    again: its verdict would be the same, nor restarted where its run could be (nor recorded
    in that run: another job's, if the verdict was its lock). One that dies before any rank
    registered (here
    mpi4py given no MPI library) is started again HPCVLA_START_RETRIES (2) times, then the
    job ends saying so. A run's world that fails with a checkpoint to continue from (here
    every start's learner finds a damaged optimizer file in it) is restarted from it once,
    and no more: it failed again before a newer checkpoint. ~30 s."""
    env = {**os.environ, "HPCVLA_RANKS": "2", "HPCVLA_DOCTOR": "0",
           "HPCVLA_JOB_RUNS": str(tmp_path / "job")}
    command = [ROOT / "jobs/launch.sh", "train", "configs/colocated.yaml"]

    def job(**extra) -> str:
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180,
                             env={**env, **extra})
        assert out.returncode != 0, out.stderr[-3000:]
        return out.stderr
    said = job(MPI4PY_RC_THREAD_LEVEL="funneled")
    assert said.count("running:") == 1 and "starting it again" not in said, said[-3000:]
    said = job(MPI4PY_LIBMPI=str(tmp_path / "libmpi.so.12"))
    for line in ("before any rank registered: starting it again (1/2)",
                 "before any rank registered: starting it again (2/2)",
                 "before any rank registered, 3 time(s) in a row: not starting it again "
                 "(HPCVLA_START_RETRIES=2; the ranks' first error is above)"):
        assert said.count(line) == 1, (line, said[-3000:])
    assert said.count("running:") == 3 and "restart 1/" not in said, said[-3000:]
    run = tmp_path / "job" / "colocated-1"  # a run the job continues, from a checkpoint
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("pipeline: {total_updates: 20}\n")
    fake_checkpoint(catalog.checkpoint_dir(run, 2), version=2)  # weights that do not fit
    said = job(HPCVLA_RESTARTS="3")  # refused, not failed
    assert said.count("running:") == 1 and "restart 1/" not in said and "the world refused " \
        "to run (exit status 2: its ranks' message is above): the job ends" in said, \
        said[-3000:]
    assert not (run / "restarts.jsonl").exists()
    # a world that fails (a learner's optimizer file damaged: read by the ranks, not refused)
    out = hpcvla("train", "configs/colocated.yaml", f"run.root={tmp_path / 'real'}",
                 "pipeline.total_updates=2", "learner.checkpoint_every=1")
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (tmp_path / "real").iterdir()
    shutil.rmtree(catalog.checkpoint_dir(run, 2))  # the run short of its end, at version 1
    optimizer = catalog.checkpoint_dir(run, 1) / "optimizer.rank0.safetensors"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    optimizer.write_bytes(bytes(data))
    said = job(HPCVLA_RESTARTS="3", HPCVLA_JOB_RUNS=str(tmp_path / "real"))
    assert said.count("restart 1/3: dropped node(s): none") == 1 and "restart 2/3" not in \
        said, said[-3000:]
    assert "the world failed again before a checkpoint newer than policy version 1: not " \
        "restarting" in said, said[-3000:]


def test_the_interval_a_restart_needs_is_the_commands_own(capsys):
    for command, interval in (("train", "3"), ("sft", "5")):
        restarts._main(["checkpoint-every", command, "learner.checkpoint_every=3",
                        "sft.checkpoint_every=5"])
        assert capsys.readouterr().out.strip() == interval
    for clock, interval in (("600", "600s"), ("0", "0")):  # train's by the clock, if not by
        restarts._main(["checkpoint-every", "train", "learner.checkpoint_every=0",  # versions
                        f"learner.checkpoint_every_s={clock}"])
        assert capsys.readouterr().out.strip() == interval


def test_no_run_yet_records_nothing(tmp_path):
    assert restarts.newest_version(tmp_path) == -1
    assert restarts.record(tmp_path, 9, [], ["h0"], 4) is None


def test_a_restart_fits_the_placement_to_the_nodes_left():
    nodes_of = {"placement.per_node={simulator: 2, inference: 2, learner: 0}": 4}
    learner_nodes = load_config(ROOT / "configs/learner_nodes.yaml", list(nodes_of)).placement
    assert restarts.fitting_overrides(learner_nodes, 12, 4) == []  # 2 rollout nodes, 4 cells
    # a rollout node lost: 2 cells cannot feed the learner node's 4 ranks; 2 of them learn
    assert restarts.fitting_overrides(learner_nodes, 8, 4) == ["placement.learners=2"]
    with pytest.raises(PlanError, match="leaves no rollout node"):  # the last node left
        restarts.fitting_overrides(learner_nodes, 4, 4)
    per_node = load_config(ROOT / "configs/default.yaml", ["placement.per_node.simulator=1"])
    assert restarts.fitting_overrides(per_node.placement, 6, 3) == []  # a cell, a learner each


def test_a_restart_on_fewer_learners_keeps_the_versions_batch():
    """Each learner trains micro_batch x micro_batches segments a version: a restart that
    leaves fewer learners gives each more micro-batches (the same samples a version, the same
    experiment), or none where no whole number keeps the batch."""
    nodes_of = ["placement.per_node={simulator: 2, inference: 2, learner: 0}"]
    cfg = load_config(ROOT / "configs/learner_nodes.yaml", nodes_of)
    assert restarts.fitting_overrides(cfg.placement, 8, 4) == ["placement.learners=2"]
    kept = restarts.batch_keeping_overrides(cfg, 12, 8, 4)  # 4 learners -> 2
    assert kept == [f"learner.micro_batches={2 * cfg.learner.micro_batches}"]
    assert restarts.batch_keeping_overrides(cfg, 12, 12, 4) == []  # nothing lost
    colocated = load_config(ROOT / "configs/colocated.yaml", ["learner.micro_batches=3"])
    assert restarts.batch_keeping_overrides(colocated, 4, 2, 1) == [
        "learner.micro_batches=6"]  # every rank learns: 4 -> 2
    sac = load_config(ROOT / "configs/colocated.yaml", ["algorithm.name=sac",
                                                        "learner.micro_batches=1"])
    assert restarts.batch_keeping_overrides(sac, 4, 2, 1) == [
        "learner.micro_batches=2", f"algorithm.utd={sac.algorithm.utd / 2:g}"]  # steps kept
    with pytest.raises(PlanError, match=r"2 learner\(s\) left of 3: .* continue the run on an "
                                        r"allocation of 3 ranks"):
        restarts.batch_keeping_overrides(colocated, 3, 2, 1)  # 9 micro-batches on 2


def test_an_sft_restart_on_fewer_learners_keeps_a_steps_chunks():
    """An `hpcvla sft` world is learners only: 3 -> 2 learners of sft.batch_size chunks a
    pass, 2 passes each -> 3 each (jobs/launch.sh's call); at 1 pass of 8, 2 passes of 6 (no
    more a pass than before); refused where the chunks do not split evenly (32 over 3)."""
    fit = [sys.executable, "-m", "hpcvla.job.restarts", "fit", ROOT / "configs/default.yaml",
           "sft.micro_batches=2", "--world=2", "--ranks-per-node=1", "--from-world=3",
           "--command=sft"]
    out = subprocess.run(fit, capture_output=True, text=True)
    assert (out.returncode, out.stdout.split()) == (0, ["sft.micro_batches=3"]), out.stderr
    cfg = load_config(ROOT / "configs/default.yaml", ["sft.batch_size=8"])
    assert restarts.batch_keeping_overrides(cfg, 4, 2, 1, "sft") == ["sft.micro_batches=2"]
    assert restarts.batch_keeping_overrides(cfg, 3, 2, 1, "sft") == [
        "sft.micro_batches=2", "sft.batch_size=6"]
    with pytest.raises(PlanError, match=r"3 learner\(s\) left of 4: a step's 32 chunks \(4 x "
                       r"sft.batch_size 8 x micro_batches 1\) do not split .* allocation of 4"):
        restarts.batch_keeping_overrides(cfg, 4, 3, 1, "sft")


def test_the_fit_command_prints_the_overrides_or_why_nothing_fits():
    """What jobs/launch.sh calls."""
    fit = [sys.executable, "-m", "hpcvla.job.restarts", "fit", ROOT / "configs/learner_nodes.yaml",
           "placement.per_node={simulator: 2, inference: 2, learner: 0}", "--ranks-per-node=4"]
    out = subprocess.run([*fit, "--world=8"], capture_output=True, text=True)
    assert (out.returncode, out.stdout.strip()) == (0, "placement.learners=2"), out.stderr
    micro_batches = load_config(ROOT / "configs/learner_nodes.yaml").learner.micro_batches
    out = subprocess.run([*fit, "--world=8", "--from-world=12"], capture_output=True, text=True)
    assert out.stdout.split() == ["placement.learners=2",
                                  f"learner.micro_batches={2 * micro_batches}"], out.stderr
    out = subprocess.run([*fit, "--world=4"], capture_output=True, text=True)
    assert out.returncode == 1 and "leaves no rollout node" in out.stderr


@pytest.mark.mpi  # the CLI and the job script, no world
@pytest.mark.slow  # plan --auto twice, side by side on one core each: ~16 s
def test_an_auto_planned_job_lays_out_each_start_with_the_scale_model(tmp_path):
    """HPCVLA_AUTOPLAN=COSTS: jobs/launch.sh appends `hpcvla plan --auto`'s best layout for
    the job's ranks (here a dry run: the command it would start), learners beside the cells
    even for a learner_nodes config; a restart calls the same set_command on the nodes left.
    (RL-VLA³'s measured costs: the search is deterministic, a probe here would not be.)"""
    reference = subprocess.Popen(
        [sys.executable, "-m", "hpcvla", "plan", "configs/learner_nodes.yaml", "--auto",
         "--json", "--world=8", "--ranks-per-node=8", "--costs=pi0-libero"], cwd=ROOT,
        stdout=subprocess.PIPE, text=True)
    env = {**os.environ, "HPCVLA_DRY_RUN": "1", "HPCVLA_AUTOPLAN": "pi0-libero",
           "HPCVLA_RANKS": "8", "HPCVLA_JOB_RUNS": str(tmp_path)}
    out = subprocess.run([ROOT / "jobs/launch.sh", "train", "configs/learner_nodes.yaml"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    planned = reference.communicate(timeout=120)[0]
    assert out.returncode == 0 and reference.returncode == 0, out.stderr
    best = json.loads(planned)["best"]["overrides"]
    (command,) = [line for line in out.stderr.splitlines() if "running:" in line]
    words = shlex.split(command.partition("running: ")[2])  # logged as a shell takes it back
    assert words[-len(best):] == best and "placement.learner_nodes=0" in best, command
    # the node's check, first, of the job as it runs: the auto plan's layout
    (doctor,) = [line for line in out.stderr.splitlines() if "checking this node:" in line]
    words = shlex.split(doctor.partition("checking this node: ")[2])
    assert "doctor --job train --world 8 --ranks-per-node 8 -- configs/learner_nodes.yaml" in \
        " ".join(words) and words[-len(best):] == best, doctor


@pytest.mark.slow  # two auto plans: ~20 s
def test_an_auto_planned_restart_keeps_the_first_worlds_version_batch(capsys):
    """HPCVLA_AUTOPLAN re-plans a restart's world on the nodes left: the layout then trains the
    version batch of the job's first world (its learners x micro_batch x micro_batches, the
    scale model's micro_batch for the new layout), as a fitted restart keeps it."""
    from hpcvla.scale.autoplan import best_overrides
    from hpcvla.topology.plan import plan_from_config
    config = "configs/learner_nodes.yaml"
    first = best_overrides(load_config(ROOT / config), 16, 4, "pi0-libero")
    restarts._main(["auto", config, "--world", "8", "--ranks-per-node", "4", "--costs",
                    "pi0-libero", "--first-world", "16",
                    *(f"--first-layout={override}" for override in first)])
    restarted = capsys.readouterr().out.split("\n")[:-1]

    def version_batch(overrides, world):
        cfg = load_config(ROOT / config, overrides)
        learners = len(plan_from_config(cfg.placement, world, 4).learners)
        return learners, learners * cfg.learner.micro_batch * cfg.learner.micro_batches
    (before, batch), (after, kept) = version_batch(first, 16), version_batch(restarted, 8)
    assert after < before and kept == batch, (first, restarted)
    assert restarted[-1].startswith("learner.micro_batches=")  # after the layout's own


def test_an_auto_planned_restart_splits_the_kept_batch_into_whole_micro_batches():
    """Where the new layout's learner.micro_batch does not divide a learner's share of the
    first world's version batch, the largest smaller one that does (no more memory a pass);
    under SAC the first world's micro_batch stays (a micro-batch is a gradient step's pass),
    with the gradient steps a version (utd x learners left / before); a share that is no whole
    number of segments ends the restart, naming the run's allocation."""
    from hpcvla.topology.plan import PlanError
    first = load_config(ROOT / "configs/default.yaml", ["learner.micro_batch=4",
                                                         "learner.micro_batches=3"])
    now = load_config(ROOT / "configs/default.yaml", ["learner.micro_batch=4"])
    segments = 4 * 4 * 3  # 4 learners of 4 x 3 segments
    assert restarts.kept_micro_batch(first, now, segments, 2) == 4  # 24 each: 4 x 6
    assert restarts.kept_micro_batch(first, now, segments, 8) == 3  # 6 each: 3 x 2, not 4
    assert restarts.learner_keeping(load_config(ROOT / "configs/default.yaml", [
        "learner.micro_batch=3", "learner.micro_batches=4"]), segments, 4, 8, 16) == [
            "learner.micro_batches=2"]
    sac = ["algorithm.name=sac", "algorithm.utd=2"]
    first_sac = load_config(ROOT / "configs/default.yaml", [*sac, "learner.micro_batch=4"])
    now_sac = load_config(ROOT / "configs/default.yaml", [*sac, "learner.micro_batch=8"])
    assert restarts.kept_micro_batch(first_sac, now_sac, 4 * 4 * 2, 2) == 4
    assert restarts.learner_keeping(first_sac, 4 * 4 * 2, 4, 2, 16) == [
        "learner.micro_batches=4", "algorithm.utd=1"]
    with pytest.raises(PlanError, match="2 learner.s. left of 3: a version's batch .9 segments"
                                        ".* allocation of 12 ranks"):
        restarts.learner_keeping(now, 9, 3, 2, 12)


def test_a_job_of_overrides_only_can_restart(capsys):
    """`jobs/launch.sh train a.b=1 ...` (the built-in defaults, no config file): what a restart
    asks takes the overrides as train does, not the first one as a file."""
    from hpcvla.cli import main
    restarts._main(["checkpoint-every", "train", "learner.checkpoint_every=3", "run.seed=2"])
    assert capsys.readouterr().out.strip() == "3"
    restarts._main(["fit", "run.seed=2", "--world", "8", "--ranks-per-node", "4"])
    assert capsys.readouterr().out.strip() == ""  # the defaults fit nodes of 4 as they are
    assert main(["plan", "run.seed=2", "--world", "8", "--ranks-per-node", "4"]) == 0


def test_a_switch_count_or_launcher_the_job_would_misread_stops_it_before_it_starts():
    """jobs/launch.sh's switches mean on only as 1: HPCVLA_DRY_RUN=true would start the real
    job, HPCVLA_DOCTOR=yes skip the checks; thread and rank counts below 1, and a launcher
    that is neither srun nor mpiexec (any other meant mpiexec), are refused, named; an
    unknown HPCVLA_AUTOPLAN cost set is named beside plan's own choices."""
    refused = {"HPCVLA_DRY_RUN": ("true", "set 1 (on) or 0 (off)"),
               "HPCVLA_DOCTOR": ("yes", "set 1 (on) or 0 (off)"),
               "HPCVLA_THREADS": ("0", "is not a count: set a whole number (1 or more)"),
               "HPCVLA_RANKS": ("four", "is not a count: set a whole number (1 or more)"),
               "HPCVLA_LAUNCHER": ("srunn", "set srun or mpiexec"),
               "HPCVLA_AUTOPLAN": ("fast", "no auto plan for 4 rank(s) on 1 node(s)")}
    for name, (value, said) in refused.items():
        env = {**os.environ, "HPCVLA_DRY_RUN": "1", name: value}
        out = subprocess.run([ROOT / "jobs/launch.sh", "train", "configs/default.yaml"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and f"{name}={value}" in out.stderr \
            and said in out.stderr and "running:" not in out.stderr, (name, out.stderr)
    assert "invalid choice: 'fast' (choose from 'config', 'balanced'" in out.stderr
    out = subprocess.run([ROOT / "jobs/launch.sh", "trian", "configs/default.yaml"], cwd=ROOT,
                         env={**os.environ, "HPCVLA_DRY_RUN": "1"}, capture_output=True,
                         text=True, timeout=60)  # a command hpcvla does not have
    assert out.returncode == 2 and "trian: hpcvla does not run it (hpcvla: error: argument " \
        "command: invalid choice: 'trian'" in out.stderr, out.stderr
    # a dry run of settings the ranks would refuse fails as the job would (it exited 0)
    out = subprocess.run([ROOT / "jobs/launch.sh", "train", "configs/default.yaml",
                          "learner.epoch=3"], cwd=ROOT, env={**os.environ, "HPCVLA_DRY_RUN": "1"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "did you mean `epochs`?" in out.stderr \
        and "the job's settings are refused" in out.stderr, out.stderr
    out = subprocess.run([ROOT / "jobs/launch.sh", "sft", "configs/default.yaml",  # sft's own
                          "algorithm.lr=1e-4"], cwd=ROOT, env={**os.environ, "HPCVLA_DRY_RUN": "1"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "hpcvla sft sets it from sft.lr" in out.stderr, out.stderr


def test_a_restart_count_that_is_not_a_number_stops_the_job_before_it_starts():
    """jobs/launch.sh's counts (HPCVLA_RESTARTS, HPCVLA_START_RETRIES, HPCVLA_END_GRACE_S),
    read by bash arithmetic, which takes a word for a variable name (0): refused, named."""
    for name in ("HPCVLA_START_RETRIES", "HPCVLA_NODE_CHECK_S"):
        env = {**os.environ, "HPCVLA_DRY_RUN": "1", name: "once"}
        out = subprocess.run([ROOT / "jobs/launch.sh", "train", "configs/default.yaml"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and f"{name}=once is not a count: set a whole " \
            "number (0 or more), or unset it for its default" in out.stderr, out.stderr
        assert "running:" not in out.stderr
    # `hpcvla train/sft/eval --ranks` read the same variable (job/launch.py), before any rank
    from hpcvla.job.launch import LaunchError, start_retries
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HPCVLA_START_RETRIES", "once")
        with pytest.raises(LaunchError, match="HPCVLA_START_RETRIES=once is not a count"):
            start_retries(["train", "configs/default.yaml"])
        assert start_retries(["my_script.py"]) == 0  # a script's ranks leave no cards
        patch.setenv("HPCVLA_START_RETRIES", "2")
        assert start_retries(["eval", "runs/x"]) == 2
        patch.setenv("HPCVLA_START_RETRIES", "")  # as jobs/launch.sh reads it: the default
        assert start_retries(["sft", "configs/default.yaml"]) == 2


def test_a_launch_script_rewritten_while_it_runs_ends_as_it_began(tmp_path):
    """jobs/launch.sh rewritten in place while its job runs (an editor, `cp` over it: the same
    file, new text) ends as it began. Bash reads a script as it runs it; launch.sh is one
    compound command, read whole before any of it runs, not read on from its old offset."""
    shutil.copytree(ROOT / "jobs", tmp_path / "jobs")
    script, err = tmp_path / "jobs" / "launch.sh", tmp_path / "err"
    with err.open("w") as stderr:
        run = subprocess.Popen([script, "plan", "configs/default.yaml", "--world", "4"],
                               cwd=ROOT, env={**os.environ, "HPCVLA_ROOT": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=stderr, text=True)
        deadline = time.monotonic() + 60
        while "running:" not in err.read_text():  # the command (`hpcvla plan`, ~3 s) runs
            assert time.monotonic() < deadline and run.poll() is None, err.read_text()
            time.sleep(0.05)
        script.write_text("# " + "a longer header " * 20 + "\n" + script.read_text())
        out, _ = run.communicate(timeout=120)
    said = err.read_text()
    assert run.returncode == 0 and said.count("running:") == 1, said
    assert "error" not in said and "node 0 host memory" in out, said
