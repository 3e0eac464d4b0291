"""`hpcvla eval` as an MPI job: the evaluation states shared among ranks give the outcomes one
process gives, episode by episode."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from hpcvla.evaluate import checkpoint_weights
from hpcvla.policies import load_pretrained
from helpers import ROOT, fake_checkpoint, hpcvla, run_train, without_launcher


def _run_dir(tmp_path, config: str, *overrides: str):
    """A run directory that holds only its config: `hpcvla eval --untrained` evaluates the
    policy that config initialises, as on a run that has not trained yet."""
    out = hpcvla("config", ROOT / "configs" / config, *overrides)
    assert out.returncode == 0, out.stderr[-2000:]
    (tmp_path / "config.yaml").write_text(out.stdout)
    return tmp_path


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """configs/default.yaml's run directory with one checkpoint, the policy's initial
    weights as version 2, for the tests that only read it."""
    from safetensors.torch import save_file

    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    run_dir = _run_dir(tmp_path_factory.mktemp("default_run"), "default.yaml")
    checkpoint = fake_checkpoint(run_dir / "checkpoints" / "v000002")
    cfg = load_config(run_dir / "config.yaml")
    save_file(build_policy(cfg, env_spec(cfg.env)).state_dict(),
              checkpoint / "model.safetensors")
    return run_dir


def _eval(run_dir, *args, timeout=300) -> dict:
    out = hpcvla("eval", run_dir, "--untrained", "--json", *args, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.mpi
@pytest.mark.slow  # 11-18 s each: a world of 2-4 ranks and the same episodes in one process
@pytest.mark.parametrize("config,overrides,ranks,actions", [
    # reach: 6 batches of 4 on 4 ranks (two ranks run two), sampled actions: each batch
    # samples from a generator seeded by (seed, batch), whichever rank runs it
    ("default.yaml", (), 4, ()),
    # a real simulator, the dense reward (a return per episode to compare), 3 batches on 2 ranks,
    # the mean actions
    ("maniskill_pushcube.yaml", ("env.camera=false", "env.reward=dense",
                                 "env.max_episode_chunks=3", "rollout.segment_len=3"), 2,
     ("--deterministic",)),
])
def test_eval_on_n_ranks_gives_each_episode_the_outcome_of_one_process(
        tmp_path, config, overrides, ranks, actions):
    run_dir = _run_dir(tmp_path, config, *overrides)
    episodes, envs = (24, 4) if config == "default.yaml" else (6, 2)
    size = ("--episodes", episodes, "--envs", envs)
    alone = _eval(run_dir, *size, *actions)
    shared = _eval(run_dir, *size, *actions, "--ranks", ranks)
    assert (alone["ranks"], shared["ranks"]) == (1, ranks)
    assert [e["init_state_id"] for e in shared["per_episode"]] == list(range(episodes))
    # the same outcome of every episode; its return to float32 rounding (one process uses
    # two BLAS threads, four ranks on two cores one each: sums in another order)
    assert [{**e, "return": pytest.approx(e["return"], rel=1e-5, abs=1e-6)}
            for e in alone["per_episode"]] == shared["per_episode"]
    assert len({round(e["return"], 3) for e in alone["per_episode"]}) > 1  # they differ
    for key in ("success_rate", "episodes", "per_task", "init_state_ids"):
        assert shared[key] == alone[key], key


@pytest.mark.mpi
def test_an_eval_worlds_ranks_evaluate_rank_0s_choice_of_policies(tmp_path):
    """Each rank lists the run's checkpoints; of a run still training they may list
    different ones (rank 1 one more here): before rank 0's list was every rank's, such ranks
    evaluated different policies under rank 0's label, or, one more, waited in its gather."""
    run_dir = _run_dir(tmp_path, "default.yaml")
    out = hpcvla("launch", "-n", 2, "--timeout", 60, "--", ROOT / "tests" / "mpi" /
                 "eval_choice.py", run_dir)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [[0], [0]]


@pytest.mark.mpi
@pytest.mark.parametrize("flags,named", [
    (("--episodes", 10 ** 9), "--episodes"), (("--envs", 0), "--envs"),
    (("--ranks", 0), "--ranks"),
    (("--deterministic", "--sampled"), "argument --sampled: not allowed with argument "
                                       "--deterministic")])
def test_bad_eval_flags_are_refused_before_any_rank_starts(tmp_path, flags, named):
    run_dir = _run_dir(tmp_path, "default.yaml")
    out = hpcvla("eval", run_dir, "--untrained", *flags, timeout=60)
    assert out.returncode == 2 and named in out.stderr, out.stderr[-2000:]
    assert not out.stdout  # nothing ran


@pytest.mark.parametrize("override,untrained,named", [
    ("eval.deterministic=true", True, "eval.deterministic = 'true': expected --deterministic: "
                                      "`hpcvla eval` takes it as a flag"),
    ("eval.episodes=4", True, "eval.episodes = '4': expected --episodes"),
    ("env.envs_per_simulator=4", True, "env.envs_per_simulator = '4': expected --envs"),
    ("algorithm.lr=0.1", True, "algorithm.lr = '0.1': expected a setting `hpcvla eval` reads "
                               "(env.*, policy.*, launch.*, run.seed"),
    ("learner.epochs=2", False, "learner.epochs = '2': expected a setting `hpcvla eval` reads"),
    # one the config's own checks would refuse for another reason: named for what it is
    ("eval.every=3", False, "eval.every = '3': expected a setting `hpcvla eval` reads"),
    ("env.isolation=process", True, "env.isolation = 'process': expected none: a setting of "
                                    "training's simulator ranks"),
    # reach's emulation: evaluation runs it without (the fault was not injected, silently)
    ("env.hang_at_step=6", True, "env.hang_at_step = '6': expected none: training's emulation "
                                 "of its simulator ranks"),
    ("policy.checkpoint=/elsewhere", False, "policy.checkpoint = '/elsewhere': expected "
                                            "--untrained with it"),
    ("policy.hidden=64", True, "the overrides change the run's start (14 weight(s) another "
                               "name or shape than the run's config gives"),
    ("env.chunk_len=2", True, "the overrides change the run's start"),
    ("policy.hidden=64", False, "expected weights the configured policy takes (policy.*, env.* "
                                "and algorithm.* shape it), or an undamaged file"),  # won't load
])
def test_eval_overrides_that_would_not_act_are_refused(default_run, capsys, override,
                                                       untrained, named):
    """An override `hpcvla eval` does not read, one a flag stands for, or one that changes the
    policy's weights (its checkpoints would not load; --untrained: not the run's start) is
    refused before anything is built or run."""
    from hpcvla.cli import main
    flags = ["--untrained"] if untrained else []
    assert main(["eval", str(default_run), *flags, override, "--episodes", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpcvla eval: ") and named in err, err


def test_a_horovod_runs_evaluation_needs_no_horovod(tmp_path):
    """`hpcvla eval` runs no learner: a run trained with learner.backend=horovod is evaluated
    where Horovod is not installed (it was refused, as training would be)."""
    run_dir = _run_dir(tmp_path, "default.yaml", "learner.backend=horovod")
    out = without_launcher("eval", run_dir, "--untrained", "--episodes", 2, "--envs", 2,
                           hide="horovod")
    assert out.returncode == 0 and "over 2 episodes" in out.stdout, out.stdout + out.stderr


def test_eval_overrides_it_reads_act(default_run):
    """Another horizon and seed for the same policy: taken, acted on, and in the result with
    the batch of envs (what fixes the sampled actions' draws)."""
    result = _eval(default_run, "--episodes", 2, "--envs", 2, "env.max_episode_chunks=1",
                   "run.seed=3")
    assert result["protocol"]["steps"] == 1 * 4, result["protocol"]  # chunks of 4 steps
    assert (result["seed"], result["envs"], result["config"]) == (3, 2, "config.yaml")


@pytest.mark.mpi
def test_a_resumed_run_is_evaluated_with_the_settings_it_last_ran_with(tmp_path):
    """config.yaml stays the first start's; a resume's settings (here a shorter horizon) are
    in its config.resume-*.yaml, and the newest is what `hpcvla eval` evaluates with (it
    took config.yaml's 80 steps for a run that last trained at 8). A resume's config names
    the run it resumed (run.resume): eval evaluates, it does not resume (it refused)."""
    run_dir = _run_dir(tmp_path, "default.yaml")
    out = hpcvla("config", ROOT / "configs" / "default.yaml", "env.max_episode_chunks=2",
                 f"run.resume={run_dir}")
    assert out.returncode == 0 and f"resume: {run_dir}" in out.stdout, out.stderr[-2000:]
    (run_dir / "config.resume-20261205-120000.yaml").write_text(out.stdout)
    result = _eval(run_dir, "--episodes", 2, "--envs", 2)
    assert result["protocol"]["steps"] == 2 * 4, result["protocol"]
    assert result["config"] == "config.resume-20261205-120000.yaml"
    out = hpcvla("eval", run_dir, "--untrained", "--episodes", 2, "--envs", 2)
    assert "with the settings of config.resume-20261205-120000.yaml (the run's last start)" \
        in out.stdout, out.stdout + out.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("config,overrides,chunks", [
    ("default.yaml", ("env.max_episode_chunks=4",), 4),
    pytest.param("maniskill_pushcube_flow.yaml", ("env.image_size=32", "env.max_episode_chunks=3",
                 "rollout.segment_len=3"), 3, marks=pytest.mark.slow)])  # ~16 s: ManiSkill
def test_eval_writes_videos_of_the_first_episodes_that_decode_back(tmp_path, config,
                                                                   overrides, chunks):
    """--video 2 on 3 states: two MP4s named by state and outcome, each a frame per chunk
    the episode ran plus its outcome frame, the camera scaled up above a caption, in a folder
    of this evaluation's own: another evaluation's films of the same version (another job's,
    at once: it deleted them) stay as they are."""
    from hpcvla.metrics.video import MIN_SIDE, read_video
    run_dir = _run_dir(tmp_path, config, *overrides)
    other = run_dir / "videos" / "v000000-deterministic-20261206-101010-node7-42" / \
        "all-state0-success.mp4"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"another evaluation's film of the same version")
    result = _eval(run_dir, "--episodes", 3, "--envs", 3, "--video", 2, "--deterministic")
    assert len(result["videos"]) == 2
    (folder,) = {Path(v).parent for v in result["videos"]}
    assert folder != other.parent and sorted(folder.glob("*.mp4")) == \
        sorted(map(Path, result["videos"]))
    assert other.read_bytes() == b"another evaluation's film of the same version"
    assert re.fullmatch(r"v000000-deterministic-\d{8}-\d{6}-.+-\d+", folder.name), folder
    for episode, path in zip(result["per_episode"], result["videos"]):
        outcome = "success" if episode["success"] else "failure"
        assert path.endswith(f"-state{episode['init_state_id']}-{outcome}.mp4"), path
        frames = read_video(path)
        # every chunk to the horizon (untrained: no success), then the outcome frame
        assert len(frames) == chunks + 1 or episode["success"], (len(frames), episode)
        assert frames.shape[2] >= MIN_SIDE and frames.shape[1] > frames.shape[2]  # + caption
        assert frames.shape[1] % 16 == frames.shape[2] % 16 == 0
        assert frames[0].std() > 5  # a picture, not a blank frame


@pytest.mark.mpi
def test_video_needs_a_camera(tmp_path):
    run_dir = _run_dir(tmp_path, "maniskill_pushcube.yaml", "env.camera=false")
    out = hpcvla("eval", run_dir, "--untrained", "--video", 1, timeout=60)
    assert out.returncode == 2 and "env.camera=false" in out.stderr, out.stderr[-2000:]


def test_wilson_interval_matches_the_score_formula():
    from hpcvla.metrics.stats import wilson_interval
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(50, 50) == pytest.approx((0.9287, 1.0), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_paired_difference_matches_agresti_min_and_mcnemars_exact_test():
    from scipy.stats import binomtest

    from hpcvla.metrics.stats import paired_difference
    # 10 episodes: 4 gained, 1 lost, 5 alike; +1/2 to each pair's count: (4.5 - 1.5) / 12
    before = [0, 0, 0, 0, 1, 1, 1, 0, 1, 0]
    after = [1, 1, 1, 1, 0, 1, 1, 0, 1, 0]
    result = paired_difference(before, after)
    half = 1.96 * ((4.5 + 1.5) - 3.0 ** 2 / 12) ** 0.5 / 12
    assert result == {**result, "episodes": 10, "difference": pytest.approx(0.3),
                      "gained": 4, "lost": 1}
    assert result["ci95"] == pytest.approx([0.25 - half, 0.25 + half])
    assert result["mcnemar_p"] == pytest.approx(binomtest(1, 5, 0.5).pvalue) == 0.375
    alike = paired_difference([1, 0] * 50, [1, 0] * 50)  # no discordant episode
    assert (alike["difference"], alike["mcnemar_p"]) == (0.0, 1.0)
    assert alike["ci95"] == pytest.approx([-1.96 / 102, 1.96 / 102])
    with pytest.raises(ValueError, match="one outcome of each policy per episode"):
        paired_difference([1, 0], [1])


def test_each_policy_of_an_evaluation_is_paired_with_the_first_on_their_common_episodes():
    from hpcvla.evaluate import describe, paired_with_first

    def result(version, outcomes, fault=()):
        episodes = [{"task": "t", "init_state_id": i, "success": bool(s), "env_fault": i in fault}
                    for i, s in outcomes]
        return {"version": version, "per_episode": episodes}
    curve = paired_with_first([result(0, [(0, 0), (1, 0), (2, 1), (3, 0)], fault=(3,)),
                               result(5, [(0, 1), (1, 0), (2, 1), (3, 1), (4, 1)])])
    assert "vs_first" not in curve[0]
    # state 3 faulted in the first, state 4 it never ran: 3 pairs, one gained
    assert curve[1]["vs_first"] == {**curve[1]["vs_first"], "version": 0, "episodes": 3,
                                    "gained": 1, "lost": 0}
    shown = describe({**curve[1], "success_rate": 1.0, "success_ci95": [0.5, 1.0],
                      "episodes": 5, "actions": "sampled", "mean_return": 1.0, "env_faults": 0,
                      "init_state_ids": [0, 4], "split": "evaluation", "states": "s",
                      "ranks": 1, "hosts": ["h"], "device": "cpu", "per_task": {"t": {}}})
    assert "against version 0 on the same 3 episodes: +0.333" in shown, shown


def test_the_printed_result_says_what_it_measured_and_what_a_benchmark_would_count():
    """A LIBERO evaluation at the run's own horizon is said not to be LIBERO's benchmark (its
    numbers are not papers'), with its episode length and action mode; env-fault episodes,
    left out, are also counted as failures, as the references' scripts count them."""
    from hpcvla.evaluate import describe
    shown = describe({
        "version": 3, "success_rate": 0.5, "success_ci95": [0.1, 0.9], "episodes": 4,
        "actions": "sampled", "mean_return": 1.0, "env_faults": 1,
        "success_rate_faults_failed": 0.4, "init_state_ids": [0, 4], "split": "evaluation",
        "states": "s", "ranks": 1, "hosts": ["h"], "device": "cpu", "per_task": {"t": {}},
        "protocol": {"name": "hpcvla", "env": "libero", "steps": 480}})
    assert "(1 left out: env faults; counted as failures, as OFT's and openpi's scripts " \
        "count them: 0.400)" in shown, shown
    assert "protocol hpcvla: the config's episode length, 480 env steps, sampled actions; not " \
        "the libero benchmark's protocol, whose numbers papers report (eval.protocol=libero)" \
        in shown, shown
    assert "not held out" not in shown
    shown = describe({
        "version": 3, "success_rate": 0.5, "success_ci95": [0.1, 0.9], "episodes": 4,
        "actions": "sampled", "mean_return": 1.0, "env_faults": 0, "init_state_ids": [0, 4],
        "split": "evaluation", "states": "s", "held_out": False, "ranks": 1, "hosts": ["h"],
        "device": "cpu", "per_task": {}})
    assert "not held out: training started from these states too (env.train_states=" \
        "benchmark, RLinf's)" in shown, shown


@pytest.mark.mpi
def test_an_eval_rank_done_first_says_it_waits_for_the_others(tmp_path):
    """`hpcvla eval --ranks 2` of 3 long episodes one at a time: rank 1 runs one, rank 0 two.
    Rank 1 says, every pipeline.stall_timeout_s (the run's: 1 s), that it is done and waits,
    so that a rank stuck in its batches is the one not saying so (they all waited in
    silence). ~20 s."""
    run_dir = _run_dir(tmp_path, "default.yaml", "pipeline.stall_timeout_s=1")
    out = hpcvla("eval", run_dir, "--untrained", "--deterministic", "--episodes", 3, "--envs", 1,
                 "--ranks", 2, "env.max_episode_chunks=1000", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "hpcvla eval: rank 1, its 1 episode(s) done, has waited 1 s for the other ranks" \
        in out.stderr, out.stdout[-2000:] + out.stderr[-3000:]
    assert "hpcvla eval: rank 0," not in out.stderr


def test_hpcvla_eval_of_no_verdict_exits_3(default_run, monkeypatch, capfd):
    """Every episode ended by an env fault: `hpcvla eval` says so and exits 3 (it exited 0,
    and a script reading its status took the line for a result); a crash is 1, a refusal 2.
    Here every step of reach reports its envs failed."""
    import numpy as np

    from hpcvla.cli import main
    from hpcvla.envs.reach import ReachEnv
    step = ReachEnv.step

    def failing(self, actions):
        result, every = step(self, actions), np.ones(self.num_envs, dtype=bool)
        return result._replace(truncated=every, env_fault=every, terminated=~every,
                               success=~every, episode_length=np.ones(self.num_envs, np.int32))
    monkeypatch.setattr(ReachEnv, "step", failing)
    assert main(["eval", str(default_run), "--untrained", "--episodes", "2", "--envs", "2"]) == 3
    assert "no verdict on the policy: every one of the 2 episodes" in capfd.readouterr().out
    monkeypatch.setattr(ReachEnv, "step", step)
    assert main(["eval", str(default_run), "--untrained", "--episodes", "2", "--envs", "2"]) == 0


def test_an_evaluation_whose_every_episode_faulted_gives_no_verdict(tmp_path, capfd):
    """Every episode an env fault (a simulator that broke): no success rate or return (None,
    not NaN: JSON has none), said so by `hpcvla eval`'s lines, the held-out line and curve,
    the progress line and the benchmark's reader; the faults still counted as failures."""
    from hpcvla.bench.learning import held_out_of
    from hpcvla.config import load_config
    from hpcvla.evaluate import describe
    from hpcvla.metrics.progress import Progress
    from hpcvla.roles.heldout import Episode, HeldOut
    held = HeldOut(load_config(ROOT / "configs/default.yaml"), 2, 2, 0, "cpu")
    try:
        report = held.report([Episode(0, False, 0.0, True, False, 3),
                              Episode(1, False, 0.0, True, False, 5)], True)
    finally:
        held.close()
    json.dumps(report, allow_nan=False)
    assert (report["episodes"], report["env_faults"]) == (0, 2)
    assert report["success_rate"] is None and report["mean_return"] is None
    assert report["success_rate_faults_failed"] == 0.0 and report["success_ci95"] == [0.0, 1.0]
    shown = describe({**report, "version": 4, "ranks": 1, "hosts": ["h"], "device": "cpu"})
    assert "policy version 4: success - (95 % 0.000-1.000) over 0 episodes" in shown, shown
    assert "no verdict on the policy: every one of the 2 episodes ended by an env fault" \
        in shown, shown
    line = Progress(tmp_path / "metrics.jsonl", total_updates=9, chunk_len=4, every_s=0,
                    enabled=True, evaluated=True)
    line.on_update(1)
    line.on_held_out(1, report)
    line.on_update(2)
    line.close()
    out = capfd.readouterr().out.splitlines()
    assert "success - (95 % 0.000-1.000) over 0 episodes" in out[-2], out[-2]
    assert "mean return - (2 left out: env faults)" in out[-2], out[-2]
    assert "| held-out - (v1) | ETA" in out[-1], out[-1]
    records = [json.loads(r) for r in (tmp_path / "metrics.jsonl").open()]
    assert held_out_of(records)["env_steps_to_0.8"] is None


@pytest.mark.mpi
@pytest.mark.slow  # ~30 s: 2 LIBERO episodes of 220 steps with the tiny π0, one per rank
def test_the_libero_protocol_runs_the_suites_tasks_and_states_at_its_step_limit(tmp_path):
    """eval.protocol=libero with the tiny π0 fixture (configs/libero_pi0.yaml): tasks 0 and 1
    of libero_spatial, their first fixed state, task by task; every (failing) episode runs the
    suite's 220 steps; the result names the protocol, and per task its Wilson interval."""
    run_dir = _run_dir(tmp_path, "libero_pi0.yaml")
    result = _eval(run_dir, "--deterministic", "--envs", 1, "--ranks", 2, "eval.protocol=libero",
                   "eval.tasks=0,1", "eval.states_per_task=1", "env.chunk_len=10",
                   timeout=600)  # the fixture's whole chunk: 22 renders an episode, not 44
    protocol = result["protocol"]
    assert protocol == {**protocol, "name": "libero", "suite": "libero_spatial", "tasks": [0, 1],
                        "states_per_task": 1, "step_limit": 220, "steps": 220,
                        "settle_steps": 10}, protocol
    assert [e["init_state_id"] for e in result["per_episode"]] == \
        [0, 50]  # task 0's first fixed state, then task 1's
    assert result["held_out"] is True  # the run trained from sampled placements
    assert [t.split(":")[0] for t in result["per_task"]] == ["task 0", "task 1"]
    for episode in result["per_episode"]:
        assert episode["steps"] == 220 or episode["success"], episode
    for task in result["per_task"].values():  # Wilson's interval of 0 or 1 success in 1
        assert task["episodes"] == 1 and task["success_ci95"] == pytest.approx(
            [0.0, 0.7935] if task["success_rate"] == 0 else [0.2065, 1.0], abs=1e-4)


@pytest.mark.mpi
@pytest.mark.slow  # ~25 s
def test_a_libero_pro_suite_evaluates_a_policy_of_its_base_suite(tmp_path, capsys):
    """LIBERO-PRO's position perturbation of libero_spatial (`_swap`) as env.suite: the tiny π0
    configured for libero_spatial runs its protocol there (the first state of task 0)."""
    run_dir = _run_dir(tmp_path, "libero_pi0.yaml", "env.train_states=benchmark")
    result = _eval(run_dir, "--envs", 1, "env.suite=libero_spatial_swap",
                   "eval.protocol=libero", "eval.tasks=0", "eval.states_per_task=1",
                   "env.chunk_len=10", timeout=600)
    assert result["protocol"]["suite"] == "libero_spatial_swap"
    # a benchmark's protocol acts as its scripts do (greedy, no added noise) unless --sampled;
    # its record says the render size, which the scripts' 256 px differs from here
    assert result["actions"] == "deterministic" and result["protocol"]["image_size"] == 32
    assert "rendered at 32 px (the published scripts: 256)" in result["protocol"]["describe"]
    assert result["held_out"] is False  # the run trained from the fixed states
    from hpcvla.cli import main
    assert main(["eval", str(run_dir), "--untrained", "env.train_states=sampled"]) == 2
    refused = capsys.readouterr().err
    assert "env.train_states = 'sampled': expected none: where the run's training started" \
        in refused, refused[-2000:]
    assert result["protocol"]["step_limit"] == 220  # libero_spatial's
    assert result["episodes"] == 1 and result["env_faults"] == 0
    assert all(e["steps"] == 220 or e["success"] for e in result["per_episode"])


@pytest.mark.mpi
def test_inspect_writes_videos_of_a_dumps_episodes(tmp_path):
    """`hpcvla inspect FILE --video K`: K episodes of a dump (here `hpcvla demos`' on reach) as
    MP4 beside it, a frame per recorded step plus the outcome frame."""
    import h5py

    from hpcvla.metrics.video import read_video
    demos = tmp_path / "reach.h5"
    out = hpcvla("demos", ROOT / "configs/default.yaml", "--episodes", 3, "--out", demos)
    assert out.returncode == 0, out.stderr[-2000:]
    out = hpcvla("inspect", demos, "--video", 2, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    (summary,) = json.loads(out.stdout)
    assert len(summary["videos"]) == 2
    with h5py.File(demos) as f:
        for path, name in zip(summary["videos"], ("demo_0", "demo_1")):
            demo = f["data"][name]
            outcome = "success" if demo.attrs["success"] else "failure"
            assert path == str(tmp_path / "reach-videos" / f"{name}-{outcome}.mp4")
            assert len(read_video(path)) == len(demo["rewards"]) + 1
        image = f["data/demo_0/obs/image"]  # where its first chunk lies in the file
        offset, size = image.id.get_chunk_info(0).byte_offset, image.id.get_chunk_info(0).size
    # read as every dump reader reads: no HDF5 lock (a writer holding one delays nothing), a
    # damaged image named with its file, as `--verify` names it
    import fcntl
    with open(demos, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the dump writer holds it while it appends
        assert hpcvla("inspect", demos, "--video", 1).returncode == 0
    data = bytearray(demos.read_bytes())
    data[offset + size // 2] ^= 0xFF
    demos.write_bytes(bytes(data))
    out = hpcvla("inspect", demos, "--video", 1)
    assert out.returncode == 2 and str(demos) in out.stderr and "Traceback" not in out.stderr, \
        out.stderr[-2000:]


@pytest.mark.mpi
def test_a_built_in_policy_is_refused_an_env_with_other_instruction_words(tmp_path):
    """A built-in policy's instruction embedding is its training env's word vocabulary:
    LIBERO-PRO's reworded libero_spatial (`_lan`) has new words and is refused before any rank
    starts, naming them; the `_swap` suite has the same words and runs (test above)."""
    run_dir = _run_dir(tmp_path, "libero10_flow.yaml", "env.suite=libero_spatial")
    out = hpcvla("eval", run_dir, "--untrained", "env.suite=libero_spatial_lan", timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "another instruction vocabulary" in out.stderr and "lift" in out.stderr, \
        out.stderr[-2000:]
    assert not out.stdout


@pytest.mark.mpi
@pytest.mark.slow
def test_one_checkpoint_of_a_run_is_evaluated_and_exported_by_its_path(tmp_path, capsys):
    """RUN_DIR/checkpoints/v*/ names that checkpoint of its run to `hpcvla eval` and `hpcvla
    export`, as `policy.checkpoint` takes it; the run directory names its newest."""
    from hpcvla.cli import main
    _, _, run = run_train(tmp_path / "runs", "pipeline.total_updates=2",
                          "learner.checkpoint_every=1")
    first = run / "checkpoints" / "v000001"
    size = ("--episodes", 4, "--envs", 4, "--json", "--deterministic")
    out = hpcvla("eval", first, "--untrained", *size, timeout=120)  # that one against its start
    untrained, trained = map(json.loads, out.stdout.strip().splitlines())
    assert (untrained["version"], trained["version"], trained["vs_first"]["version"]) == (0, 1, 0)
    assert trained["vs_first"]["difference"] == \
        trained["success_rate"] - untrained["success_rate"]  # the same 4 states, none faulted
    assert main(["eval", str(first), "--all"]) == 2
    refused = capsys.readouterr()
    assert "--all" in refused.err and not refused.out  # nothing ran
    out = hpcvla("export", first, tmp_path / "export", timeout=120)
    assert out.returncode == 0 and "policy version 1 written" in out.stdout, out.stderr[-2000:]
    exported = load_pretrained(tmp_path / "export").state_dict()  # v1's weights, not v2's
    v1, v2 = checkpoint_weights(first)[0], checkpoint_weights(run)[0]
    assert exported.keys() <= v1.keys() and all(torch.equal(exported[k], v1[k]) for k in exported)
    assert any(not torch.equal(v1[k], v2[k]) for k in exported)
    # the run directory: its newest; of a run whose start has moved since (copied from a
    # cluster): its checkpoints hold every weight and still evaluate; the untrained policy,
    # its start, is refused naming it
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["policy"]["checkpoint"] = str(tmp_path / "moved")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    out = hpcvla("eval", run, *size, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["version"] == 2
    assert main(["eval", str(run), "--untrained", *map(str, size)]) == 2
    assert "policy.checkpoint = " in capsys.readouterr().err


def test_the_ranks_of_an_eval_world_get_its_command_line_less_ranks():
    """`hpcvla eval --ranks N` runs its ranks with the command line it was given, --ranks
    taken out: every flag and override goes with them (a hand-made list of eval's flags
    would drop one added to its parser)."""
    from hpcvla.job.launch import without_ranks
    given = ["eval", "runs/x", "--ranks", "2", "--video", "1", "--deterministic",
             "--ranks=3", "--episodes=8", "eval.protocol=libero"]
    assert without_ranks(given) == ["eval", "runs/x", "--video", "1", "--deterministic",
                                    "--episodes=8", "eval.protocol=libero"]
