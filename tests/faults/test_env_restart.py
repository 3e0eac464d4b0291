"""Simulator faults under `env.isolation=process` (envs/isolated.py): a step that never
returns (`env.hang_at_step`) and a simulator process killed outright (`env.crash_at_step`,
SIGKILL as a segfault or the OOM killer) cost the shard's worker and its current episodes,
not the job: the worker is restarted within `env.step_timeout_s` (+ its start-up), the
fault is logged with the rank and env ids and counted in the summary, and the run finishes
with every update, every segment group sent trained exactly once or drained unused. A fault
that always recurs stops the rank after `env.max_restarts` within `env.restart_window_s`; a
rare one is forgotten after it."""

import json
import time

import h5py
import numpy as np
import pytest

from hpcvla.envs import make_env
from hpcvla.envs.base import RestartBudget, close_all
from hpcvla.envs.isolated import EnvWorkerFailed, IsolatedEnv
from helpers import Clock, hpcvla

REACH = dict(image_size=16, chunk_len=2, max_episode_chunks=5)


def actions(rng, env):
    return rng.uniform(-1, 1, (env.num_envs, env.spec.chunk_len, env.spec.action_dim))


def test_isolated_env_steps_exactly_like_the_inline_one():
    kwargs = {**REACH, "keep_final_obs": True}  # the horizon's last observations, too
    inline = make_env("reach", 4, seed=3, **kwargs)
    isolated = IsolatedEnv("reach", 4, 3, kwargs, timeout_s=30, max_restarts=0)
    try:
        assert isolated.spec == inline.spec
        a, b = inline.reset(), isolated.reset()
        assert all(np.array_equal(a[k], b[k]) for k in a)
        rng = np.random.default_rng(0)
        for _ in range(12):  # across episode ends (auto-reset after 5 chunks)
            act = actions(rng, inline)
            x, y = inline.step(act), isolated.step(act)
            for field in x._fields:
                want, got = getattr(x, field), getattr(y, field)
                if field in ("obs", "final_obs") and want is not None:
                    assert field == "obs" or x.truncated.any()
                    assert all(np.array_equal(want[k], got[k]) for k in want)
                else:
                    assert np.array_equal(want, got), field
        assert isolated.instructions() == inline.instructions()
        assert isolated.failures == [] and isolated.restarts == 0
    finally:
        inline.close()
        isolated.close()
    assert isolated._proc.poll() is not None  # the worker is gone after close


def test_close_all_ends_every_worker_with_status_0_and_its_cpu_is_the_ranks():
    """The shards of a rank are told to close together; each worker closes its env and ends
    (status 0: not killed by the rank's wait running out). Once closed, the workers' CPU
    (their start and steps, while the rank waited) counts in the rank's (summary's cpu_s)."""
    from hpcvla.process.worker import cpu_seconds
    before, own = cpu_seconds(), time.process_time()
    envs = [IsolatedEnv("reach", 2, seed, REACH, timeout_s=30, max_restarts=0,
                        first_env=2 * seed) for seed in range(2)]
    for env in envs:
        env.reset()
    close_all(envs)
    assert [env._proc.returncode for env in envs] == [0, 0]
    workers = (cpu_seconds() - before) - (time.process_time() - own)
    assert workers > 0.2, workers  # two Python starts importing numpy, at the least


@pytest.mark.parametrize("fault,why", [
    ("hang_at_step", "step did not return within 2 s"),
    ("crash_at_step", "step: the worker died (killed by SIGKILL)")])
def test_a_hung_or_killed_worker_is_restarted_and_its_episodes_end_truncated(fault, why,
                                                                              capfd):
    env = IsolatedEnv("reach", 3, 0, dict(REACH, **{fault: 3}), timeout_s=2, max_restarts=2,
                      first_env=6, owner="rank 5 (simulator)")
    try:
        env.reset()
        rng = np.random.default_rng(1)
        for _ in range(2):
            assert not env.step(actions(rng, env)).truncated.any()
        old_worker = env._proc.pid
        begin = time.monotonic()
        result = env.step(actions(rng, env))  # the faulty step
        took = time.monotonic() - begin
        assert result.truncated.all() and not result.success.any()
        assert result.env_fault.all() and not result.terminated.any()
        assert result.episode_length.tolist() == [2, 2, 2]  # two chunks done before the fault
        assert env._proc.pid != old_worker and env.restarts == 1
        assert len(env.failures) == 1 and why in env.failures[0][1], env.failures
        err = capfd.readouterr().err
        assert "rank 5 (simulator), reach envs 6-8: " + why in err, err
        assert "restarting the worker (1/2)" in err and "worker restarted in" in err, err
        for _ in range(6):  # the new worker runs on (injected faults fire once)
            result = env.step(actions(rng, env))
        assert env.restarts == 1
        print(f"{fault}: shard back {took:.1f} s after the faulty step began")
    finally:
        env.close()


@pytest.mark.slow
def test_a_hung_shard_does_not_hold_up_the_other_shards_of_its_rank():
    """The simulator loop starts every ready shard before collecting any (step_async /
    step_wait): while one shard's worker hangs, the others step on and give results equal to
    plain `step`s of their own inline twin."""
    hung = IsolatedEnv("reach", 2, 0, dict(REACH, hang_at_step=2), timeout_s=6,
                       max_restarts=1, owner="rank 1 (simulator)")
    other = IsolatedEnv("reach", 2, 1, REACH, timeout_s=4, max_restarts=0, first_env=2)
    twin = make_env("reach", 2, seed=1, **REACH)
    try:
        hung.reset()
        first, want = other.reset(), twin.reset()
        assert all(np.array_equal(first[k], want[k]) for k in want)
        rng = np.random.default_rng(2)
        hung.step(actions(rng, hung))
        hung.step_async(actions(rng, hung))  # this step never returns
        for _ in range(5):  # meanwhile the other shard steps, and steps right
            act = actions(rng, other)
            other.step_async(act)
            got, want = other.step_wait(), twin.step(act)
            assert np.array_equal(got.reward, want.reward)
            assert all(np.array_equal(got.obs[k], want.obs[k]) for k in want.obs)
        assert not hung.step_ready()  # still hanging, not yet overdue
        result = hung.step_wait()  # collected at its deadline: restarted, episodes truncated
        assert result.truncated.all() and hung.restarts == 1
        assert other.failures == [] and other.restarts == 0
    finally:
        for env in (hung, other, twin):
            env.close()


def test_a_fault_that_recurs_gives_up_after_max_restarts():
    env = IsolatedEnv("reach", 2, 0, REACH, timeout_s=5, max_restarts=1, first_env=0,
                      owner="rank 1 (simulator)")
    try:
        env.reset()
        env._proc.kill()  # killed twice: once restarted, then given up
        env.step(np.zeros((2, 2, 2)))
        env._proc.kill()
        with pytest.raises(EnvWorkerFailed, match=r"rank 1 \(simulator\), reach envs 0-1: "
                           r"step: the worker died .*env.max_restarts=1"):
            env.step(np.zeros((2, 2, 2)))
    finally:
        env.close()


def test_restarts_further_apart_than_the_window_never_add_up():
    """max_restarts=1 per hour: a second fault an hour later, after steps that worked, is
    restarted (a run of days meets rare faults every few hours), a third at once gives up
    naming both settings."""
    clock, zero = Clock(), np.zeros((2, 2, 2))
    env = IsolatedEnv("reach", 2, 0, REACH, timeout_s=5, max_restarts=1, first_env=0,
                      owner="rank 1 (simulator)", restart_window_s=3600)
    env.budget.clock = clock
    try:
        env.reset()
        env._proc.kill()
        env.step(zero)
        assert not env.step(zero).env_fault.any()  # back at work
        clock.now = 3600.5
        env._proc.kill()
        env.step(zero)
        assert env.restarts == 2 and not env.step(zero).env_fault.any()
        env._proc.kill()
        with pytest.raises(EnvWorkerFailed, match=r"restarted 1 times in the last 3600 s "
                           r"\(env.max_restarts=1, env.restart_window_s=3600\)"):
            env.step(zero)
    finally:
        env.close()


def test_a_restart_budget_counts_within_its_sliding_window():
    clock = Clock()
    budget = RestartBudget(2, 10.0, clock)
    assert budget.spend()
    budget.worked()  # (steps between: the window alone counts here)
    clock.now = 5.0
    assert budget.spend() and not budget.spend()
    budget.worked()
    clock.now = 9.9
    assert not budget.spend()  # both still within 10 s
    clock.now = 10.0
    assert budget.spend()  # the first left the window, not the second
    budget.worked()
    assert not budget.spend()
    lifelong = RestartBudget(1, 0.0, clock)
    assert lifelong.spend()
    lifelong.worked()
    clock.now = 1e9
    assert not lifelong.spend() and lifelong.spent() == (
        "1 times already (env.max_restarts=1, env.restart_window_s=0)")


def test_restarts_in_a_row_without_a_step_give_up_however_slow():
    """A fault at every try (a rebuild that always hangs, cut at env.build_timeout_s, half an
    hour) never made 6 in an hour: restarted for the rest of the allocation. In a row, with
    no step between, max_restarts is all it gets; a step that worked forgives them."""
    clock = Clock()
    budget = RestartBudget(2, 3600.0, clock)
    for tries in range(2):
        clock.now += 1800.0  # each try cut at its deadline: two an hour, under the window's 2
        assert budget.spend()
    clock.now += 1800.0
    assert not budget.spend()
    assert budget.spent() == "2 times in a row without a step between (env.max_restarts=2)"
    budget.worked()  # the worker got back to work: a later fault is another
    clock.now += 1800.0
    assert budget.spend()


def test_a_worker_that_outlives_sigkill_is_left_behind_said(capfd, monkeypatch):
    """A worker in uninterruptible sleep (a hung GPU driver or file system read) does not die
    on SIGKILL, and the rank stopping it waited for it for good: the wait is bounded and said.
    (No process can be put in that state here: the real worker's wait answers as one would.)"""
    import subprocess

    from hpcvla.envs import isolated
    monkeypatch.setattr(isolated, "KILLED_WAIT_S", 0.2)
    env = IsolatedEnv("reach", 2, 0, REACH, timeout_s=30, max_restarts=0, first_env=4)
    proc, wait = env._proc, env._proc.wait

    def in_d_state(timeout=None):
        raise subprocess.TimeoutExpired(proc.args, timeout)
    proc.wait = in_d_state
    started = time.monotonic()
    try:
        env._stop()
    finally:
        proc.wait = wait
    assert time.monotonic() - started < 5
    assert f"env worker pid {proc.pid} (envs 4..) did not die 0.2 s after SIGKILL " \
        "(uninterruptible?); left behind" in capfd.readouterr().err
    assert proc.wait(timeout=10) == -9  # here it did die: reaped


def test_an_env_that_cannot_be_built_fails_at_start_naming_the_error():
    with pytest.raises(EnvWorkerFailed, match="init raised ValueError.*image_size"):
        IsolatedEnv("reach", 2, 0, dict(REACH, image_size=4), timeout_s=30, max_restarts=3)


def test_a_workers_build_has_its_own_deadline():
    """env.build_timeout_s, not env.step_timeout_s, bounds a worker's build (a build reads
    assets a step does not): a build past its deadline fails naming that setting, and a step
    deadline shorter than the build leaves the build alone and bounds the calls after it."""
    with pytest.raises(EnvWorkerFailed, match=r"init did not return within 0.001 s "
                                              r"\(env.build_timeout_s\)"):
        IsolatedEnv("reach", 2, 0, REACH, timeout_s=30, max_restarts=0, build_timeout_s=1e-3)
    started = time.monotonic()  # the worker's start and build: ~0.3 s, a reset ~1 ms
    env = IsolatedEnv("reach", 2, 0, dict(REACH, hang_at_step=1), timeout_s=0.1,
                      max_restarts=0, build_timeout_s=30)
    assert time.monotonic() - started > 0.1  # longer than a step may take
    try:
        env.reset()
        with pytest.raises(EnvWorkerFailed, match=r"step did not return within 0.1 s "
                                                  r"\(env.step_timeout_s\)"):
            env.step(np.zeros((2, 2, 2)))
    finally:
        env.close()


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("config,ranks,fault", [  # each fault once; in both layouts
    ("configs/default.yaml", 4, "env.hang_at_step=8"),
    ("configs/colocated.yaml", 2, "env.crash_at_step=8")])
def test_training_survives_simulator_faults(tmp_path, config, ranks, fault):
    """The hang stops every shard: the learner hears nothing for longer than
    pipeline.stall_timeout_s, and waits for the restart (roles/learner.data_patience_s)."""
    updates = 4
    out = hpcvla("train", config, "--ranks", ranks, f"run.root={tmp_path}",
                 f"pipeline.total_updates={updates}", "env.isolation=process",
                 "env.step_timeout_s=10", "pipeline.stall_timeout_s=8",
                 "run.dump_trajectories=true", fault, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    sims = [r for r in summary["per_rank"] if "env_failures" in r]
    shards = sum(len({f[0] for f in r["env_failures"]}) for r in sims)
    assert summary["env_failures"] >= 1 and shards >= 1, summary["env_failures"]
    what = "did not return within 10 s" if "hang" in fault else "killed by SIGKILL"
    assert all(what in f[1] for r in sims for f in r["env_failures"]), sims
    assert "restarting the worker (1/5 in 3600 s)" in out.stderr and what in out.stderr
    learner = next(r for r in summary["per_rank"] if "staleness_hist" in r)
    assert sum(learner["staleness_hist"].values()) == updates * 32  # every update, full
    assert ("trained_groups" in learner) == (ranks == 4)  # the ledger: disaggregated only
    if ranks == 4:  # nothing lost, nothing trained twice: an entry per slot (2 sims x 2 shards)
        ledger = learner["trained_groups"]
        assert len(ledger) == 4 and all(e["first"] == 0 and e["missing"] == 0
                                        for e in ledger.values()), ledger
        (inference,) = [r for r in summary["per_rank"] if r["role"] == "inference"]
        trained = sum(e["groups"] for e in ledger.values())
        assert inference["segments_sent"] == (trained + learner["unused_segment_groups"]) * 8
    assert "done:" in out.stdout
    # the episodes the fault ended: truncated by an env fault, not failures of the policy;
    # the learners saw them (masked, roles/learner.py) and left them out of the success rate
    faulted = 0
    for path in (run_dir / "trajectories").glob("rank*.h5"):
        with h5py.File(path) as f:
            for demo in f["data"].values():
                if demo.attrs["env_fault"]:
                    faulted += 1
                    assert demo["truncated"][-1] and demo["env_fault"][-1]
                    assert not demo["terminated"][-1] and not demo.attrs["success"]
    assert faulted and summary["env_fault_episodes"] >= 1, summary["env_fault_episodes"]
    print(f"{config} {fault}: {summary['env_failures']} env faults survived, "
          f"{summary['wall_s']:.0f} s")


def serial_env(dying: set[int], unbuildable: set[int], **kwargs):
    """A SerialVectorEnv (ManiSkill's and LIBERO's vectorizer) of two slots that follow its
    slot interface: those in `dying` raise in every step; those in `unbuildable` cannot be
    built again once built."""
    from hpcvla.envs.base import EnvSpec
    from hpcvla.envs.serial import SerialVectorEnv
    built = set()

    class Slot:
        instruction = "reach the red object"

        def __init__(self, i):
            if i in unbuildable and i in built:
                raise RuntimeError(f"no simulator for env {i}")
            built.add(i)
            self.dies = i in dying

        def reset(self, rng, init_state_id):
            pass

        def step(self, action):
            if self.dies:
                raise RuntimeError("simulator gone")
            return 0.1, False

        def observe(self):
            return {"state": np.ones(2, np.float32)}

        def close(self):
            pass

    spec = EnvSpec(obs={"state": ((2,), "<f4")}, action_dim=2, chunk_len=2,
                   max_episode_chunks=5, vocab=("",))
    return SerialVectorEnv(2, 0, spec, 0, Slot, name="test", **kwargs)


def test_a_slot_that_keeps_failing_or_the_last_one_retired_stops_the_rank():
    """A slot that fails at every step is rebuilt max_rebuilds times (env.max_restarts), then
    the next failure raises naming it; a vector env whose every slot could not be rebuilt
    raises too (a broken simulator must not train on faults)."""
    env = serial_env({1}, set(), first_env=10, max_rebuilds=3)
    for _ in range(3):
        assert env.step(np.zeros((2, 2, 2), np.float32)).env_fault.tolist() == [False, True]
    with pytest.raises(RuntimeError, match=r"test env 11 failed in step: .*simulator gone.*; "
                                           r"rebuilt 3 times in a row without a step "
                                           r"between \(env.max_restarts=3\)"):
        env.step(np.zeros((2, 2, 2), np.float32))
    env = serial_env({0, 1}, {0, 1}, first_env=10)
    with pytest.raises(RuntimeError, match=r"test: every env of envs 10..11 could not be "
                                           r"rebuilt .*nothing is left to train on"):
        env.step(np.zeros((2, 2, 2), np.float32))


def test_a_slot_that_cannot_be_rebuilt_is_retired_and_every_step_of_it_is_a_fault(capfd):
    """Slot 1 dies in a step and cannot be rebuilt. From then on its steps come back
    truncated and flagged env_fault (the learners mask them, success counts skip them),
    never as failed episodes; slot 0 goes on."""
    env = serial_env({1}, {1})
    for _ in range(3):
        result = env.step(np.zeros((2, 2, 2), np.float32))
        assert result.env_fault.tolist() == [False, True]
        assert result.truncated.tolist() == [False, True] and not result.success.any()
        assert result.obs["state"][1].tolist() == [0.0, 0.0]  # a retired slot shows zeros
    assert env.retired == {1} and "could not be rebuilt" in capfd.readouterr().err


def test_a_spec_probe_that_never_returns_ends_its_process_naming_where():
    """Rank 0 builds an env to learn the spec for every rank (a ManiSkill env in a colocated
    world; sft's and eval's checks on every rank before MPI_Init): a build that hangs (an EGL
    deadlock) ends the process past env.build_timeout_s with every stack, not a world waiting
    forever in the spec's broadcast or in MPI_Init."""
    import os
    import subprocess
    import sys
    import time
    script = ("import time\n"
              "from hpcvla import envs\n"
              "from hpcvla.config import load_config\n"
              "from hpcvla.roles import prologue  # noqa\n"
              "envs.probe_spec = lambda env: time.sleep(600)  # a build that never returns\n"
              "envs.env_spec(load_config(None, ['env.build_timeout_s=2']).env)\n")
    begin = time.monotonic()
    # (importing the roles imports mpi4py: not initialised here, so the process ended by the
    # deadline leaves no MPI shared memory behind)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "MPI4PY_RC_INITIALIZE": "false"})
    assert out.returncode != 0 and time.monotonic() - begin < 60, out
    assert "Timeout (0:00:02)!" in out.stderr and "env_spec" in out.stderr, out.stderr
