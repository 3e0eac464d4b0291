"""The job scripts in jobs/ submitted for real: a Slurm from the Debian packages
(tests/local_slurm.py; `make install` installs them), Slurm scripts through sbatch, PBS
scripts through Slurm's PBS layer (qsub, #PBS directives, PBS_* variables, a node file).
Single-node jobs run on a one-node Slurm; the multi-node scripts on a Slurm of 3 nodes that
are separate hosts (network namespaces, TCP between them: tests/multihost/hosts.py).
Nothing is skipped: without Slurm these tests fail and say how to install it. They are the
`cluster` tier: `pytest -m "not cluster"` (and `make test-fast`) leaves them out."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from local_slurm import TERMINAL, LocalSlurm
from helpers import (OPENMPI5, ROOT, hpcvla, plant_orphan_segment, rank_pids, reach_demos,
                     removed_by_name, sft_worlds)

# A local Slurm (its daemons, munge, network-namespace nodes): root and `make install-cluster`.
pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.cluster]

SCRIPTS = sorted([ROOT / "jobs" / "launch.sh", *(ROOT / "jobs" / "lib").glob("*.sh"),
                  *(ROOT / "jobs" / "slurm").glob("*.sbatch"),
                  *(ROOT / "jobs" / "pbs").glob("*.pbs")])
VENV = Path(sys.executable).parent.parent  # the environment the job scripts activate


@pytest.fixture(scope="module")
def slurm1():
    with LocalSlurm() as cluster:
        yield cluster


@pytest.fixture
def slurm(slurm1):
    """One node, shared by the tests of this file (a cluster's start and stop took seconds a
    test), each given it with no job left and the node idle."""
    yield slurm1
    slurm1.clear()


@pytest.fixture(scope="module")
def slurm3():
    """Nodes h0, h1, h2: each its own host (network namespace, address, host name) with 12
    fabric ports, as a GPU node's several adapters: its ranks' UCX addresses are then too long
    for Slurm's PMI-2 server (src/hpcvla/process/mpi_select.py), and MPICH must start them
    itself; and 2 GPUs that Slurm schedules (no device behind them)."""
    with LocalSlurm(nodes=3, fabric_ports=12, gpus=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    """The SFT jobs' demonstrations (read only), recorded once: no check counts episodes."""
    return reach_demos(tmp_path_factory.mktemp("demos") / "demos.h5", 6)


def job_env(tmp_path, **extra) -> dict:
    # `hpcvla doctor` before a job runs in the demo and PBS eval jobs' tests (~4 s a job here)
    return {"HPCVLA_VENV": str(VENV), "HPCVLA_RUNS": str(tmp_path / "runs"),
            "HPCVLA_DOCTOR": "0", **extra}


def finished(slurm, job, log: Path, timeout=600) -> str:
    """Wait for the job; assert it completed with exit code 0; its log."""
    info = slurm.wait(job, timeout)
    text = log.read_text() if log.exists() else "(no log)"
    story = "\n".join(line[:300] for line in text.splitlines() if line.startswith("launch.sh "))
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), \
        f"{info['JobState']} {info['ExitCode']}\nlaunch.sh said:\n{story}\n...\n{text[-4000:]}"
    return text


def the_run(runs: Path) -> Path:
    (job_runs,) = runs.iterdir()       # <job name>-<job id>
    (run_dir,) = [p for p in job_runs.iterdir() if not p.name.startswith(".")]  # <run>-<time>
    return run_dir


def test_job_scripts_pass_bash_n_and_shellcheck():
    assert len(SCRIPTS) == 14, SCRIPTS
    assert shutil.which("shellcheck"), "shellcheck missing: run `make install-cluster`"
    for script in SCRIPTS:
        out = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        # (bash -n says some parse errors, a newline inside [[ ]], and still exits 0)
        assert out.returncode == 0 and not out.stderr, f"{script}: {out.stderr}"
    # launch.sh's pieces (jobs/lib) are checked as it sources them (-x), with its variables
    out = subprocess.run(["shellcheck", "-x", "--severity=style",
                          *[s for s in SCRIPTS if s.parent.name != "lib"]],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_a_dead_node_in_the_middle_leaves_the_others_in_the_restart():
    """After a failed world every node is asked to clean up at once (clean_nodes), under
    launch.sh's `set -euo pipefail`: a node that does not answer is left out of the restart,
    and the nodes after it are not (the background group's failure had ended it before its
    status was written: the restart ran on the nodes before the dead one alone)."""
    script = f"""set -euo pipefail
        SCHEDULER=none PYTHON=python
        source {ROOT}/jobs/lib/world.sh
        on_node() {{
            [[ $1 == b ]] && {{ echo "srun: error: b is down" >&2; return 1; }}
            echo "removed 1 segment on $1"
        }}
        HOSTS=(a b c d)
        mapfile -t answered < <(clean_nodes)
        echo "answered: ${{answered[*]}}"
    """
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "answered: a c d\n", out
    assert out.stderr.split("\n")[:3] == [f"removed 1 segment on {h}" for h in "acd"], out


def test_a_command_over_ssh_is_read_by_bash_whatever_the_login_shell(tmp_path):
    """Under PBS without TM (Torque, HPCVLA_PBS_TM=0) on_node reaches another node by ssh,
    whose remote side hands its command line to the user's login shell: the command,
    quoted by printf %q ($'..' for a tab), is read by bash there, not by that shell (here a
    POSIX sh, dash, as ssh would run it)."""
    ssh = tmp_path / "ssh"  # ssh's remote side: the arguments joined, to the login shell
    ssh.write_text('#!/bin/sh\nwhile [ "$1" = -o ]; do shift 2; done\nshift\n'
                   'exec dash -c "$*"\n')
    ssh.chmod(0o755)
    script = f"""set -euo pipefail
        SCHEDULER=pbs PYTHON=python HPCVLA_PBS_TM=0
        source {ROOT}/jobs/lib/world.sh
        on_node node2 "$(printf '%q ' printf '[%s]' $'a\\tb' 'c d')"
    """
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert out.returncode == 0 and out.stdout == "[a\tb][c d]", out


def test_the_other_nodes_checked_are_those_but_this_one():
    """The batch script's node ran the whole doctor: the other nodes' checks go to the rest of
    HOSTS, whichever place this node has there (Slurm's first node in its own order need not
    be `scontrol show hostnames`' first); HOSTS after the first where none is this one."""
    def checked(me: str, hosts: str) -> str:
        script = f"""set -euo pipefail
            SCHEDULER=none PYTHON=python EARLY=""
            say() {{ echo "say: $*"; }}
            source {ROOT}/jobs/lib/world.sh
            hostname() {{ echo {me}; }}
            on_node() {{ echo "ok   /dev/shm"; }}
            HOSTS=({hosts})
            until_signalled check_other_nodes doctor --node-only  # as launch.sh runs it
        """
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out
        return out.stdout.strip()
    said = "say: checked nodes {} (hpcvla doctor --node-only)".format
    assert checked("b", "a b c") == said("a c")
    assert checked("a", "a b.cluster c") == said("b.cluster c")
    assert checked("b", "a.cluster b.cluster") == said("a.cluster")  # names with a domain
    assert checked("z", "a b c") == said("b c")  # this node under another name


def test_a_node_whose_checks_fail_through_pbs_tm_fails_the_job_without_its_lines(tmp_path):
    """PBS's pbs_tmrsh returns the exit status of what it started on a node, none of its
    output (openpbs' pbs_tmrsh.c: tm_spawn, tm_obit): a node whose `hpcvla doctor
    --node-only` failed (exit 1) left no FAIL line to read, and was taken for a node that
    could not be checked; the world started on it. Here pbs_tmrsh is a stand-in that does as
    TM does: the command runs, its output goes elsewhere, its status comes back."""
    tmrsh, doctor = tmp_path / "pbs_tmrsh", tmp_path / "doctor"
    tmrsh.write_text('#!/bin/sh\nshift\n"$@" > /dev/null 2>&1\n')
    doctor.write_text('#!/bin/sh\necho "FAIL /dev/shm: 1.0 MiB free"\nexit 1\n')
    for path in (tmrsh, doctor):
        path.chmod(0o755)
    script = f"""set -euo pipefail
        SCHEDULER=pbs PYTHON=python EARLY="" LIB={ROOT}/jobs/lib
        say() {{ echo "say: $*"; }}
        source {ROOT}/jobs/lib/world.sh
        hostname() {{ echo n0; }}
        HOSTS=(n0 n1)
        status=0
        until_signalled check_other_nodes {doctor} --node-only || status=$?
        echo "status $status"
    """
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert out.stdout.splitlines()[-1] == "status 1", out
    assert "say: n1: its checks failed (hpcvla doctor's exit 1); their lines did not come " \
        "back (PBS's pbs_tmrsh returns a node's exit status, not its output)" in out.stdout, out
    assert "say: node(s) n1 lack what the job needs (above)" in out.stdout, out


def test_open_mpi_under_pbs_warns_of_a_repository_path_with_a_blank(tmp_path):
    """Under PBS, Open MPI's mpirun starts the other nodes' daemons through jobs/lib/tmrsh as
    its rsh agent, which an Open MPI without TM support splits at blanks ("ssh -x"): from a
    repository at `/home/u/my work/hpcvla` it ran `/home/u/my`, a failure that named
    neither. Said before the world (one with TM never runs the agent: not refused); MPICH's
    Hydra takes the path whole."""
    script = f"""set -euo pipefail
        SCHEDULER=pbs PYTHON=python EARLY="" LIB={ROOT}/jobs/lib
        say() {{ echo "say: $*"; }}
        in_a_world() {{ true; }}
        source {ROOT}/jobs/lib/world.sh
        PBS_RSH="/home/u/my work/hpcvla/jobs/lib/tmrsh" HOSTS=(n0 n1) NP=4 PER_NODE=2
        HOSTFILE={tmp_path}/hosts HPCVLA_MPIEXEC=mpirun HPCVLA_MPI_FLAVOUR=$1
        set_launch train
        echo "${{LAUNCH[*]}}"
    """
    said = {mpi: subprocess.run(["bash", "-c", script, "bash", mpi], capture_output=True,
                                text=True, timeout=60) for mpi in ("openmpi", "mpich")}
    assert said["openmpi"].returncode == 0 and "say: warning: the repository's path holds a " \
        "blank (/home/u/my work/hpcvla/jobs/lib/tmrsh): an Open MPI without TM support " \
        "splits" in said["openmpi"].stdout, said
    assert "--mca plm_rsh_agent /home/u/my work" in said["openmpi"].stdout, said
    assert said["mpich"].returncode == 0 and "mpirun -n 4 -f" in said["mpich"].stdout, said
    assert "warning" not in said["mpich"].stdout, said


def test_a_node_reads_the_command_line_as_it_was_quoted():
    """on_node's command is quoted by printf %q, which writes a tab or a newline as $'..':
    the node's shell must be bash (dash, Debian's sh, took it for a `$` and the letters)."""
    script = f"""set -euo pipefail
        SCHEDULER=none PYTHON=python EARLY=""
        source {ROOT}/jobs/lib/world.sh
        on_node a "$(printf '%q ' printf '<%s>' $'a\tb' $'c\nd' "it's")"
    """
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "<a\tb><c\nd><it's>", out


@pytest.mark.parametrize("scheduler", ["none", "pbs"])
def test_a_command_on_this_node_has_the_limit_every_node_has(scheduler):
    """HPCVLA_NODE_CHECK_S bounds a node's cleanup and checks: this node's too, under PBS and
    with no scheduler (a command that hung there held the job script with no end)."""
    script = f"""set -uo pipefail
        SCHEDULER={scheduler} PYTHON=python EARLY=""
        source {ROOT}/jobs/lib/world.sh
        on_node localhost "sleep 30" 1
        echo "status $?"
    """
    began = time.monotonic()
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout == "status 124\n" and time.monotonic() - began < 10, out


def test_slurm_demo_job_trains_and_dumps_trajectories(slurm, tmp_path):
    log = tmp_path / "demo.out"
    job = slurm.sbatch(ROOT / "jobs/slurm/demo.sbatch", "configs/default.yaml",
                       "pipeline.total_updates=3", "run.dump_trajectories=true",
                       options=["--output", log], env=job_env(tmp_path, HPCVLA_DOCTOR="1"),
                       cwd=ROOT)
    text = finished(slurm, job, log)
    assert "ok   mpi         mpich:" in text and "ok   disk" in text  # the doctor, first
    assert "ok   memory      4 rank(s), 4 per node, 0 GPU(s) each: fits" in text  # the job's
    assert "scheduler slurm" in text and "/mpiexec -n 4 -f" in text  # MPICH: Hydra
    assert "4 rank(s) on 1 node(s)" in text and "[hpcvla] update 3/3" in text
    run_dir = the_run(tmp_path / "runs")
    assert run_dir.parent.name == f"hpcvla-demo-{job}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ranks"] == 4 and sum(summary["staleness_hist"].values()) == 3 * 32
    with h5py.File(run_dir / "trajectories" / "rank0.h5", "r") as dump:
        assert dump.attrs["complete"] and len(dump["data"]) > 0


def first_update(slurm, job, log: Path, timeout=300) -> str:
    """Wait until the job's log shows a training update; the log."""
    deadline = time.monotonic() + timeout
    while "[hpcvla] update" not in (text := log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, text or "no log"
        assert slurm.job(job)["JobState"] in ("PENDING", "RUNNING"), text
        time.sleep(0.5)
    return text


def rank_cards(slurm, job, log: Path, folder: Path, ranks: int, timeout=300) -> list[dict]:
    """The cards (deathwatch: rank, roles, host, pid) of a job's `ranks` ranks, once every
    rank has registered: what a rank was started with is there from its start (its exec-time
    environment in /proc), with no training needed to read it."""
    deadline = time.monotonic() + timeout
    while len(paths := list(folder.glob(".ranks/rank*.json"))) < ranks:
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        assert slurm.job(job)["JobState"] in ("PENDING", "RUNNING"), \
            log.read_text() if log.exists() else "no log"
        time.sleep(0.2)
    return [json.loads(p.read_text()) for p in paths]


def where_ranks_run(slurm, job_runs: Path) -> dict:
    """rank -> (roles, host name, emulated host whose network namespace holds the process),
    from the cards the running ranks leave for launch.sh (deathwatch) and /proc."""
    ranks = {}
    for card in map(json.loads, map(Path.read_text, job_runs.glob(".ranks/rank*.json"))):
        netns = subprocess.run(["ip", "netns", "identify", str(card["pid"])],
                               capture_output=True, text=True).stdout.strip()
        host = next((h for h in slurm.hosts.names if slurm.hosts.ns(h) == netns), netns)
        ranks[card["rank"]] = (card["roles"], card["host"], host)
    return ranks


def assert_learner_node_layout(ranks: dict, text: str) -> None:
    """6 ranks, 2 per host: cells on h0 and h1, the 2 learners alone on h2."""
    assert sorted(ranks) == list(range(6)), ranks
    hosts = {rank: host for rank, (_, host, _) in ranks.items()}
    assert all(host == netns for _, host, netns in ranks.values()), ranks  # really there
    assert [hosts[r] for r in range(6)] == ["h0", "h0", "h1", "h1", "h2", "h2"], ranks
    assert {hosts[r] for r, (roles, _, _) in ranks.items() if roles == "learner"} == {"h2"}
    assert {roles for roles, host, _ in ranks.values() if host == "h2"} == {"learner"}, ranks
    # MPI itself saw 3 nodes of 2 ranks (no placement.ranks_per_node: real nodes)
    assert "6 ranks on 3 node(s) of 2; 2 cell(s), 2 learner(s)" in text, text[-3000:]


def test_slurm_multinode_job_on_three_hosts_requeues_and_resumes(slurm3, tmp_path):
    """jobs/slurm/multinode.sbatch on 3 nodes that are separate hosts, 2 ranks each: two
    rollout nodes (a cell each) and a node of 2 ZeRO learners, every trajectory crossing the
    network. At the time-limit warning (`--signal=B:USR1@...`: USR1 to the batch shell) the
    ranks checkpoint, the job requeues itself, and its next start continues to the end."""
    updates, log = 12, tmp_path / "multinode.out"
    job = slurm3.sbatch(ROOT / "jobs/slurm/multinode.sbatch", "configs/learner_nodes.yaml",
                        "placement.per_node.simulator=1", "placement.per_node.inference=1",
                        f"pipeline.total_updates={updates}", "pipeline.progress_every_s=0.1",
                        options=["--output", log, "--ntasks-per-node=2", "--cpus-per-task=1"],
                        env=job_env(tmp_path, HPCVLA_DOCTOR="1"), cwd=ROOT)
    first_update(slurm3, job, log)
    ranks = where_ranks_run(slurm3, tmp_path / "runs" / f"hpcvla-multinode-{job}")
    slurm3.signal_batch_shell(job, signal.SIGUSR1)
    text = finished(slurm3, job, log)
    assert_learner_node_layout(ranks, text)
    assert "6 rank(s) on 3 node(s) (h0 h1 h2), 2 per node" in text
    # every node checked, each start: h0 wholly, h1 and h2 for what each has of its own
    assert text.count("checked nodes h1 h2 (hpcvla doctor --node-only)") == 2, text[-3000:]
    assert "FAIL" not in text and "could not check node" not in text, text[-3000:]
    assert "/mpiexec -n 6 -f" in text  # Hydra, not srun
    assert "pmi2:" not in text  # no complaint from Slurm's PMI-2 server
    assert slurm3.job(job)["Restarts"] == "1"
    first, second = text.split("requeueing job", 1)
    assert "received SIGUSR1: sending SIGTERM to the ranks" in first
    assert f"[hpcvla] update {updates}/{updates}" not in first  # stopped before the end
    run_dir = the_run(tmp_path / "runs")
    assert f"continuing {run_dir} from its newest checkpoint" in second
    assert "[hpcvla] resuming from" in second and f"[hpcvla] update {updates}/{updates}" in second
    summary = json.loads((run_dir / "summary.json").read_text())
    learners = [r for r in summary["per_rank"] if r["role"] == "learner"]
    assert len(learners) == 2 and 0 < learners[0]["first_version"] < updates
    resumed = updates - learners[0]["first_version"]
    assert sum(summary["staleness_hist"].values()) == resumed * 2 * 32
    assert (run_dir / "checkpoints" / f"v{updates:06d}" / "state.json").exists()


# The multinode script's own layout: 2 rollout nodes of 2 cells and a learner node of 4
# ZeRO-1 learners. The learner node is lost; h1 becomes the learner node: its 2 producers feed
# 2 learners, its other 2 ranks are spare. (A node of mixed roles lost is the same restart
# path: the layout is planned anew for the nodes left, tests/test_restarts.py.)
NODE_FAILURE = (["configs/learner_nodes.yaml",
                 "placement.per_node={simulator: 2, inference: 2, learner: 0}",
                 "env.envs_per_simulator=4", "learner.micro_batch=8"], 4, "h2",
                "8 ranks on 2 node(s) of 4; 2 cell(s), 2 learner(s), 2 spare, "
                "inference:learner = 2:2")


def test_a_node_failure_restarts_the_job_on_the_nodes_left(slurm3, tmp_path):
    """jobs/slurm/multinode.sbatch (--no-kill, HPCVLA_RESTARTS) on 3 nodes; every process of
    one node (slurmd included) is killed after a checkpoint. The job goes on inside its
    allocation on the 2 nodes left, with fewer learners (the optimizer state re-partitioned),
    each training more micro-batches (a version's batch kept), from the newest checkpoint,
    and finishes; the log and summary.json name the dropped node,
    the new layout and the work lost; no batch is trained twice."""
    args, per_node, dead, layout = NODE_FAILURE
    updates, log = 12, tmp_path / "restart.out"
    job = slurm3.sbatch(ROOT / "jobs/slurm/multinode.sbatch", *args,
                        f"pipeline.total_updates={updates}", "learner.checkpoint_every=2",
                        "pipeline.progress_every_s=0.1",
                        options=["--output", log, f"--ntasks-per-node={per_node}",
                                 "--cpus-per-task=1"],
                        # the world's launcher waits for the dead node: ended 5 s after
                        # its ranks here died (the default 30 s is for real clusters)
                        env=job_env(tmp_path, HPCVLA_RESTARTS="1", HPCVLA_END_GRACE_S="5",
                                    HPCVLA_NODE_CHECK_S="30"),
                        cwd=ROOT)
    first_update(slurm3, job, log)
    runs = tmp_path / "runs" / f"hpcvla-multinode-{job}"
    deadline = time.monotonic() + 300
    # a whole checkpoint: renamed from its .partial folder, which holds a state.json too
    while not [p for p in runs.glob("*/checkpoints/v*/state.json")
               if not p.parent.name.endswith(".partial")]:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    slurm3.fail_node(dead)
    failed = time.monotonic()
    try:
        while "[hpcvla] update" not in log.read_text().partition("[hpcvla] resuming from")[2]:
            assert time.monotonic() < deadline + 300, log.read_text()[-4000:]
            assert slurm3.job(job)["JobState"] == "RUNNING", log.read_text()[-4000:]
            time.sleep(0.2)
        print(f"from the node failure to the first update after the restart: "
              f"{time.monotonic() - failed:.1f} s")
        # the node comes back (the job ends only once its slurmd says the dead step is gone)
        slurm3.restore_node(dead, wait=False)
        text = finished(slurm3, job, log)
        print(f"the job ended {time.monotonic() - failed:.1f} s after the node failure")
    finally:  # the nodes as the module's other tests expect them
        if f"slurmd-{dead}" not in slurm3.procs:
            slurm3.restore_node(dead, wait=False)
        slurm3.cancel(job)
        slurm3.wait_idle()
    left = [h for h in ("h0", "h1", "h2") if h != dead]
    assert f"dropped node(s): {dead}; {2 * per_node} rank(s) on 2 node(s) ({' '.join(left)})" \
        in text, text[-4000:]
    second = text.split("restart 1/1", 1)[1]
    assert layout in second, second[-4000:]
    assert "written by 4 learners at ZeRO-1, re-partitioned onto 2 at ZeRO-1" \
        in second, second[-4000:]
    assert f"[hpcvla] update {updates}/{updates}" in second
    run_dir = the_run(tmp_path / "runs")
    summary = json.loads((run_dir / "summary.json").read_text())
    (restart,) = summary["restarts"]
    print(restart)
    assert restart["dropped_nodes"] == [dead] and restart["nodes"] == left
    roles = [r["role"] for r in summary["per_rank"]]
    assert roles.count("learner") == 2 and roles.count("spare") == 2 * per_node - 6
    learners = [r for r in summary["per_rank"] if r["role"] == "learner"]
    resumed = restart["resumed_from_version"]
    assert {r["first_version"] for r in learners} == {resumed} and resumed >= 2
    # the version's batch kept: 4 learners' 2 micro-batches of 8 on 2 learners, 4 each, every
    # version once
    assert "fewer producers or learners on the nodes left: placement.learners=2 " \
        "learner.micro_batches=4" in text, text[-4000:]
    assert sum(summary["staleness_hist"].values()) == (updates - resumed) * 2 * 32


def test_an_sft_job_restarts_on_the_nodes_left_at_the_exact_next_chunk(slurm3, tmp_path,
                                                                       demos):
    """jobs/slurm/sft.sbatch on 3 hosts, a learner each (one node-shared copy of the
    demonstrations per host); every process of h2 killed after a checkpoint: the job goes on
    inside its allocation with the 2 learners of h0 and h1 from that checkpoint, at the exact
    next chunk, each now in 3 passes of 4 chunks a step instead of 2, so a step keeps its 24
    chunks, and finishes."""
    steps = 300
    log, dead = tmp_path / "sft-restart.out", "h2"
    job = slurm3.sbatch(ROOT / "jobs/slurm/sft.sbatch", "configs/default.yaml",
                        f"sft.demos={demos}", f"sft.steps={steps}", "sft.batch_size=4",
                        "sft.micro_batches=2", "sft.checkpoint_every=50",
                        "pipeline.progress_every_s=0.1",
                        options=["--output", log, "--nodes=3", "--ntasks-per-node=1"],
                        env=job_env(tmp_path, HPCVLA_END_GRACE_S="5",
                                    HPCVLA_NODE_CHECK_S="30"), cwd=ROOT)
    runs = tmp_path / "runs" / f"hpcvla-sft-{job}"
    deadline = time.monotonic() + 300
    while not [p for p in runs.glob("*/checkpoints/v*/state.json")
               if not p.parent.name.endswith(".partial")]:
        assert time.monotonic() < deadline and slurm3.job(job)["JobState"] in (
            "PENDING", "RUNNING"), log.read_text() if log.exists() else "no log"
        time.sleep(0.2)
    slurm3.fail_node(dead)
    try:
        while "[hpcvla sft] step" not in log.read_text().partition("restart 1/")[2]:
            assert time.monotonic() < deadline + 300, log.read_text()[-4000:]
            assert slurm3.job(job)["JobState"] == "RUNNING", log.read_text()[-4000:]
            time.sleep(0.2)
        slurm3.restore_node(dead, wait=False)
        text = finished(slurm3, job, log)
    finally:
        if f"slurmd-{dead}" not in slurm3.procs:
            slurm3.restore_node(dead, wait=False)
        slurm3.cancel(job)
        slurm3.wait_idle()
    assert f"dropped node(s): {dead}; 2 rank(s) on 2 node(s) (h0 h1), from SFT step " \
        in text, text[-4000:]
    assert "fewer producers or learners on the nodes left: sft.micro_batches=3" in text
    assert "written by 3 learners at ZeRO-1, re-partitioned onto 2 at ZeRO-1; 24 chunks a " \
        "step)" in text.partition("restart 1/")[2], text[-4000:]
    run_dir = the_run(tmp_path / "runs")
    summary = json.loads((run_dir / "summary.json").read_text())
    (restart,) = summary["restarts"]
    resumed = restart["resumed_from_version"]
    assert summary["steps"] == steps and summary["learners"] == 2 and resumed % 50 == 0
    assert restart["dropped_nodes"] == [dead] and restart["nodes"] == ["h0", "h1"]
    first, again = sft_worlds(run_dir, resumed)
    assert [r["step"] for r in again] == list(range(resumed + 1, steps + 1))
    assert all(r["trained_chunks"] == r["step"] * 24 for r in first + again)


def visible_gpus(pid: int) -> str | None:
    """A running process's CUDA_VISIBLE_DEVICES."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((e.decode().partition("=")[2] for e in environ
                 if e.startswith(b"CUDA_VISIBLE_DEVICES=")), None)


def test_a_gpus_per_task_job_gives_hydras_ranks_their_nodes_gpus(slurm3, tmp_path):
    """`--gpus-per-task=1` under MPICH's mpiexec: Hydra's proxy is one Slurm task per node,
    so a step that names no GPUs gets the job's per-task request, one task's GPU, for all of
    the node's ranks (Slurm 22.05 here). Its step asks for the node's GPUs; the device map
    then gives each rank its own."""
    log, job = tmp_path / "gpus-per-task.out", None
    try:
        job = slurm3.sbatch(ROOT / "jobs/slurm/multinode.sbatch", "configs/colocated.yaml",
                            "placement.gpus_per_node=0", "pipeline.total_updates=100000",
                            options=["--output", log, "--nodes=2", "--nodelist=h0,h1",
                                     "--ntasks-per-node=2", "--cpus-per-task=1",
                                     "--gpus-per-task=1"],
                            env=job_env(tmp_path, HPCVLA_MPI="mpich"), cwd=ROOT)
        cards = rank_cards(slurm3, job, log, tmp_path / "runs" / f"hpcvla-multinode-{job}", 4)
        seen = {card["rank"]: (card["host"], visible_gpus(card["pid"])) for card in cards}
    finally:
        if job:
            slurm3.cancel(job)
        slurm3.wait_idle()
    assert seen == {r: ("h0" if r < 2 else "h1", "0,1") for r in range(4)}, \
        (seen, log.read_text()[-3000:])


@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_each_nodes_ranks_see_the_gpus_slurm_gave_that_node(slurm3, tmp_path, mpi, scheduler):
    """A job of part of 2 nodes' GPUs (another job holds h1's first): Slurm gives h0 GPU 0 and
    h1 GPU 1, and each node's ranks see their own node's (CUDA_VISIBLE_DEVICES), not the batch
    node's: under MPICH's mpiexec, which passes its environment to every rank, and Open MPI's
    mpirun. Also as a PBS job started through PBS's TM (`pbs_tmrsh`), whose tasks get their
    node's GPUs as PBS's cgroup hook gives them (the PBS layer on this Slurm: a step's).
    The ranks compute on the CPU (placement.gpus_per_node=0): these GPUs are names."""
    hold = tmp_path / "hold.sh"
    hold.write_text("#!/bin/bash\nsleep 300\n")
    holder = slurm3.sbatch(hold, options=["--nodelist=h1", "--nodes=1", "--gpus-per-node=1",
                                          "--output", tmp_path / "hold.out"])
    # a PBS job names no nodes: h2's GPUs held too leave it h0 and h1
    holders = [holder] + ([slurm3.sbatch(hold, options=[
        "--nodelist=h2", "--nodes=1", "--gpus-per-node=2", "--output", tmp_path / "hold2.out"])]
        if scheduler == "pbs" else [])
    log, job = tmp_path / "gpus.out", None
    try:
        for held in holders:
            slurm3.wait(held, 60, states=("RUNNING",))
        if scheduler == "pbs":
            job = slurm3.qsub(ROOT / "jobs/pbs/multinode.pbs", cwd=ROOT, env=job_env(
                tmp_path, HPCVLA_MPI=mpi, SBATCH_GPUS_PER_NODE="1", CONFIG="configs/default.yaml",
                OVERRIDES="placement.gpus_per_node=0 pipeline.total_updates=100000",
                PATH=f"{slurm3.tm_bin}:{slurm3.env['PATH']}"), options=[
                "-V", "-o", log, "-j", "oe", "-l", "select=2:ncpus=4:mpiprocs=4"])
        else:
            job = slurm3.sbatch(ROOT / "jobs/slurm/multinode.sbatch", "configs/default.yaml",
                                "placement.gpus_per_node=0", "pipeline.total_updates=100000",
                                options=["--output", log, "--nodes=2", "--nodelist=h0,h1",
                                         "--ntasks-per-node=4", "--cpus-per-task=1",
                                         "--gpus-per-node=1"],
                                env=job_env(tmp_path, HPCVLA_MPI=mpi, HPCVLA_LAUNCHER="mpiexec"),
                                cwd=ROOT)
        cards = rank_cards(slurm3, job, log, tmp_path / "runs" / f"hpcvla-multinode-{job}", 8)
        seen = {card["rank"]: (card["host"], visible_gpus(card["pid"])) for card in cards}
    finally:
        for started in filter(None, (*holders, job)):
            slurm3.cancel(started)
        slurm3.wait_idle()
    assert seen == {r: ("h0", "0") if r < 4 else ("h1", "1") for r in range(8)}, \
        (seen, log.read_text()[-3000:])


def test_pbs_demo_job_through_qsub(slurm, tmp_path):
    log = tmp_path / "demo-pbs.out"
    env = job_env(tmp_path, CONFIG="configs/default.yaml",
                  OVERRIDES="pipeline.total_updates=2 learner.zero_stage=2")
    job = slurm.qsub(ROOT / "jobs/pbs/demo.pbs", options=["-V", "-o", log, "-j", "oe"],
                     env=env, cwd=ROOT)
    text = finished(slurm, job, log)
    # launch.sh took the PBS road: ranks from PBS_NODEFILE, started by mpiexec
    assert "scheduler pbs" in text and "/mpiexec -n 4 -f" in text, text[-3000:]
    run_dir = the_run(tmp_path / "runs")
    assert run_dir.parent.name == f"hpcvla-demo-{job}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ranks"] == 4 and sum(summary["staleness_hist"].values()) == 2 * 32


def test_pbs_sft_job_through_qsub(slurm, tmp_path, demos):
    """jobs/pbs/sft.pbs: the config and overrides from the environment, a learner on each of
    the job's MPI processes (PBS_NODEFILE), one world."""
    log = tmp_path / "sft-pbs.out"
    env = job_env(tmp_path, CONFIG="configs/default.yaml",
                  OVERRIDES=f"sft.demos={demos} sft.steps=4 sft.batch_size=8")
    job = slurm.qsub(ROOT / "jobs/pbs/sft.pbs", options=["-V", "-o", log, "-j", "oe"],
                     env=env, cwd=ROOT)
    text = finished(slurm, job, log)
    assert "scheduler pbs" in text and "/mpiexec -n 2 -f" in text, text[-3000:]
    summary = json.loads((the_run(tmp_path / "runs") / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["learners"] == 2


@pytest.mark.parametrize("start,mpi", [("ssh", "mpich"), ("tm", "mpich"), ("tm", "openmpi"),
                                       ("tm", "openmpi5")])
def test_pbs_multinode_job_through_qsub_on_three_hosts(slurm3, tmp_path, start, mpi):
    """jobs/pbs/multinode.pbs on 3 hosts: launch.sh's mpiexec (Hydra; Open MPI's mpirun)
    starts its processes on the other nodes, from PBS_NODEFILE, through the nodes' ssh, or
    through PBS's own `pbs_tmrsh` (TM) where the job finds one: then the ranks on the other
    nodes are the job's processes there (its resource manager's: here Slurm under the PBS
    layer lists them), not an ssh session's. `openmpi5`: Open MPI 5 as a loaded module puts
    it first on PATH (`make install`'s, beside the venv), Debian's 4.1 otherwise."""
    log, updates = tmp_path / "multinode-pbs.out", 20
    five = OPENMPI5.parent
    first = f"{five}:" if mpi == "openmpi5" else ""
    env = job_env(tmp_path, OVERRIDES="placement.per_node.simulator=1 "
                  f"placement.per_node.inference=1 pipeline.total_updates={updates} "
                  "pipeline.progress_every_s=0.1", HPCVLA_MPI=mpi.removesuffix("5"),
                  HPCVLA_DOCTOR="1",
                  **({"PATH": f"{slurm3.tm_bin}:{first}{slurm3.env['PATH']}"}
                     if start == "tm" else {}))
    job = slurm3.qsub(ROOT / "jobs/pbs/multinode.pbs", env=env, cwd=ROOT, options=[
        "-V", "-o", log, "-j", "oe", "-l", "select=3:ncpus=2:mpiprocs=2"])
    job_runs = tmp_path / "runs" / f"hpcvla-multinode-{job}"
    cards = rank_cards(slurm3, job, log, job_runs, 6)  # where they run, read as they start
    ranks = where_ranks_run(slurm3, job_runs)
    # the job's processes on each other node, as its resource manager knows them (none: it
    # says the job "does not exist on node")
    pids = {int(line.split()[0]) for host in ("h1", "h2") for line in slurm3._run(
        ["scontrol", "listpids", job], check=False, host=host).stdout.splitlines()[1:]
        if line.strip()}
    text = finished(slurm3, job, log)
    assert "scheduler pbs" in text and "6 rank(s) on 3 node(s) (h0 h1 h2)" in text
    assert (f"MPI: openmpi ({five / 'mpirun'})" in text) == (mpi == "openmpi5"), text[:1500]
    # the other nodes checked through the same start, in the job's folder (a relative config)
    # with its variables (ssh and TM give a login's)
    assert "checked nodes h1 h2 (hpcvla doctor --node-only)" in text, text[-3000:]
    assert_learner_node_layout(ranks, text)
    summary = json.loads((the_run(tmp_path / "runs") / "summary.json").read_text())
    assert sum(summary["staleness_hist"].values()) == updates * 2 * 32
    remote = {c["pid"] for c in cards if c["host"] != "h0"}
    assert len(remote) == 4
    if start == "tm":
        # pbs_tmrsh through jobs/lib/tmrsh: TM runs no shell to read the launchers' quoting
        tmrsh = ROOT / "jobs/lib/tmrsh"
        assert (f"--mca plm_rsh_agent {tmrsh}" if "openmpi" in mpi else
                f"-launcher rsh -launcher-exec {tmrsh}") in text, text[-3000:]
        assert remote <= pids, (remote, pids)
    else:
        assert "-launcher" not in text and not remote & pids, (remote, pids)


def test_eval_job_shares_the_states_among_ranks_on_three_hosts(slurm3, tmp_path):
    """jobs/slurm/eval.sbatch on 3 hosts, 2 ranks each: every host evaluates its share of the
    states, and each episode's outcome is the one a single process gives."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    out = hpcvla("config", "configs/default.yaml")
    (run_dir / "config.yaml").write_text(out.stdout)
    log, args = tmp_path / "eval.out", [run_dir, "--untrained", "--deterministic", "--json",
                                        "--episodes", "24", "--envs", "2"]
    job = slurm3.sbatch(ROOT / "jobs/slurm/eval.sbatch", *args, env=job_env(tmp_path),
                        options=["--output", log, "--nodes=3", "--ntasks-per-node=2"], cwd=ROOT)
    text = finished(slurm3, job, log)
    assert "6 rank(s) on 3 node(s) (h0 h1 h2)" in text, text[-3000:]
    (line,) = [line for line in text.splitlines() if line.startswith("{")]
    shared = json.loads(line)
    assert shared["ranks"] == 6 and len(shared["hosts"]) == 3, shared
    out = hpcvla("eval", *args)
    assert out.returncode == 0, out.stderr[-3000:]
    alone = json.loads(out.stdout.splitlines()[-1])
    def outcomes(result):  # each state's episode: which state, its end, its return
        return [(e["init_state_id"], e["success"], e["steps"]) for e in result["per_episode"]]

    assert outcomes(shared) == outcomes(alone)
    # the returns: float32 sums, whose last bits may differ
    assert [e["return"] for e in shared["per_episode"]] == \
        pytest.approx([e["return"] for e in alone["per_episode"]], rel=1e-4, abs=1e-6)
    assert shared["success_rate"] == alone["success_rate"]


def test_pbs_eval_job_through_qsub(slurm, tmp_path):
    """jobs/pbs/eval.pbs: the run directory, flags and overrides from the environment, the
    states shared among the job's 4 ranks."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(hpcvla("config", "configs/default.yaml").stdout)
    log = tmp_path / "eval-pbs.out"
    env = job_env(tmp_path, RUN=str(run_dir), OVERRIDES="env.max_episode_chunks=4",
                  FLAGS="--untrained --deterministic --json --episodes 8 --envs 2",
                  HPCVLA_DOCTOR="1")
    job = slurm.qsub(ROOT / "jobs/pbs/eval.pbs", options=["-V", "-o", log, "-j", "oe"],
                     env=env, cwd=ROOT)
    text = finished(slurm, job, log)
    assert "scheduler pbs" in text and "4 rank(s) on 1 node(s)" in text, text[-3000:]
    # the node checked first, for this evaluation: 4 ranks of 2 envs each
    assert "ok   memory      4 rank(s), 4 per node, 0 GPU(s) each: fits" in text, text[-3000:]
    (line,) = [line for line in text.splitlines() if line.startswith("{")]
    result = json.loads(line)
    assert result["ranks"] == 4 and result["actions"] == "deterministic", result
    assert [e["init_state_id"] for e in result["per_episode"]] == list(range(8))
    from hpcvla.config import load_config
    chunk = load_config(ROOT / "configs/default.yaml").env.chunk_len  # the override: 4 chunks
    assert max(e["steps"] for e in result["per_episode"]) == 4 * chunk, result["per_episode"]


def test_an_eval_job_on_a_node_that_lacks_what_it_needs_fails_before_any_rank_starts(
        slurm3, tmp_path):
    """jobs/slurm/eval.sbatch runs `hpcvla doctor --job eval` on its first node with the job's
    world and eval's own arguments (after `--`), as train and sft jobs do: a node whose GPUs
    the job was granted but torch cannot see (slurm3's have no device behind them) fails the
    job in seconds, the failed check and its fix in the log, and no rank starts."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(hpcvla("config", "configs/default.yaml").stdout)
    log = tmp_path / "eval-doctor.out"
    start = time.monotonic()
    job = slurm3.sbatch(ROOT / "jobs/slurm/eval.sbatch", run_dir, "--untrained", "--envs", "2",
                        env=job_env(tmp_path, HPCVLA_DOCTOR="1"), cwd=ROOT, options=[
                            "--output", log, "--nodes=1", "--ntasks-per-node=2",
                            "--gpus-per-node=2"])
    info = slurm3.wait(job, 300)
    took, text = time.monotonic() - start, log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), text[-3000:]
    assert f"doctor --job eval --world 2 --ranks-per-node 2 -- {run_dir} --untrained --envs 2" \
        in text and "FAIL gpus        torch sees 0 GPU(s); granted: SLURM_GPUS_ON_NODE=2" \
        in text, text[-3000:]
    assert "lacks what the job needs, or the job's settings are refused (hpcvla doctor, " \
        "above)" in text and took < 60, took
    # no world: none failed, and no rank refused the GPUs for itself
    assert "the world" not in text and "hpcvla eval:" not in text, text[-3000:]


def test_bench_job_runs_the_benchmark_in_a_world_of_its_own(slurm, tmp_path):
    """`bench modes` inside a 1-task job starts a 4-rank world of its own (the streamer: every
    mode's bench run, against sync-colocated's, is tests/test_pipeline.py's)."""
    log, result = tmp_path / "bench.out", tmp_path / "bench.json"
    job = slurm.sbatch(ROOT / "jobs/slurm/bench.sbatch", "--workload", "real", "--updates",
                       "1", "--modes", "streamer", options=["--output", log],
                       cwd=ROOT, env=job_env(tmp_path, HPCVLA_BENCH_JSON=str(result)))
    finished(slurm, job, log, timeout=900)
    modes = json.loads(result.read_text())["modes"]
    assert list(modes) == ["streamer"] and modes["streamer"]["ranks"] == 4
    assert modes["streamer"]["throughput"] > 0
    # ... and postprocess/ turns it into the benchmark table and chart
    out = subprocess.run([sys.executable, ROOT / "postprocess/report.py", "--bench", result,
                          "--out", tmp_path / "report"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "report" / "report.md").read_text()
    streamer = modes["streamer"]
    assert f"| streamer | streamer | {streamer['ranks']} | {streamer['throughput']:.0f} | " \
           f"{streamer['ideal_bound']:.0f} | {streamer['efficiency']:.2f} |" in md
    assert (tmp_path / "report" / "bench.png").exists()


def test_pbs_bench_job_reaches_the_benchmark(slurm, tmp_path):
    """The PBS bench script through qsub, up to the command it would run (the benchmark
    itself runs in the Slurm job above: the same command)."""
    log = tmp_path / "bench-pbs.out"
    env = job_env(tmp_path, BENCH_ARGS="--workload real --updates 2", HPCVLA_DRY_RUN="1")
    job = slurm.qsub(ROOT / "jobs/pbs/bench.pbs", options=["-V", "-o", log, "-j", "oe"],
                     env=env, cwd=ROOT)
    text = finished(slurm, job, log)
    assert "scheduler pbs" in text and "1 rank(s) on 1 node(s)" in text
    assert f"-m hpcvla bench modes --json bench-{job}.json --workload real --updates 2" in text


@pytest.mark.parametrize("start", ["ssh", "tm"])
def test_a_pbs_gpu_job_whose_ranks_ssh_starts_is_warned(tmp_path, start):
    """Under PBS the ranks ssh starts on the job's other nodes are outside its cgroup: they
    see every GPU of their node. jobs/launch.sh says so where the job has GPUs and finds no
    pbs_tmrsh, not where TM starts them nor where the job has no GPU (dry runs: the command
    it would start; `pbs_tmrsh` here a stand-in that is never run)."""
    nodes = tmp_path / "nodes"
    nodes.write_text("h0\nh0\nh1\nh1\n")
    path = os.environ["PATH"]
    if start == "tm":
        tm = tmp_path / "bin" / "pbs_tmrsh"
        tm.parent.mkdir()
        tm.write_text("#!/bin/sh\nexit 1\n")
        tm.chmod(0o755)
        path = f"{tm.parent}:{path}"

    def dry_run(gpus: str) -> str:
        env = {**os.environ, "PATH": path, "PBS_JOBID": "9.pbs", "PBS_NODEFILE": str(nodes),
               "PBS_O_WORKDIR": str(ROOT), "CUDA_VISIBLE_DEVICES": gpus, "HPCVLA_DRY_RUN": "1",
               "HPCVLA_MPI": "mpich"}
        out = subprocess.run([ROOT / "jobs/launch.sh", "train", "configs/default.yaml"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "4 rank(s) on 2 node(s)" in out.stderr, out.stderr
        return out.stderr

    text = dry_run("0")
    assert ("they see every GPU of their node" in text) == (start == "ssh"), text
    assert ("-launcher-exec" in text) == (start == "tm"), text
    assert "they see every GPU" not in dry_run("")


def test_a_pbs_jobs_overrides_split_as_a_command_line(tmp_path):
    """PBS passes a script no arguments: OVERRIDES is split as a command line would be (a
    quoted value with blanks is one word, newlines separate; it was split at every blank and
    cut at the first newline). Unclosed quotes end the job, named."""
    (tmp_path / "nodes").write_text("h0\nh0\n")
    env = {**os.environ, "PBS_JOBID": "9.pbs", "PBS_NODEFILE": str(tmp_path / "nodes"),
           "PBS_O_WORKDIR": str(ROOT), "HPCVLA_DRY_RUN": "1", "HPCVLA_MPI": "mpich",
           "HPCVLA_RUNS": str(tmp_path),
           "OVERRIDES": "'placement.per_node={simulator: 1, inference: 1, learner: 0}'\n"
                        "pipeline.total_updates=5"}
    out = subprocess.run(["bash", ROOT / "jobs/pbs/demo.pbs"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (r" hpcvla train configs/default.yaml placement.per_node=\{simulator:\ 1\,\ "
            r"inference:\ 1\,\ learner:\ 0\} pipeline.total_updates=5 "
            f"run.root={tmp_path / 'hpcvla-demo-9'}") in out.stderr, out.stderr
    out = subprocess.run(["bash", ROOT / "jobs/pbs/demo.pbs"], cwd=ROOT, capture_output=True,
                         env={**env, "OVERRIDES": "'run.name=a b"}, text=True, timeout=60)
    assert out.returncode == 2 and "error: OVERRIDES='run.name=a b: its quotes do not close" \
        in out.stderr, out.stderr


@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
def test_an_array_jobs_task_trains_the_seed_of_its_index(tmp_path, scheduler):
    """The tasks of an array job (sbatch --array, qsub -J) ran the config's one seed each:
    each now runs run.seed=<its index>, unless its command names run.seed; with
    HPCVLA_SWEEP, each adds its line of the sweep file. Dry runs of the demo scripts
    (Slurm's host list from a stand-in `scontrol`)."""
    (tmp_path / "nodes").write_text("h0\nh0\n")
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text("#!/bin/sh\necho h0\n")  # `scontrol show hostnames LIST`
    scontrol.chmod(0o755)
    env = {**os.environ, "HPCVLA_DRY_RUN": "1", "HPCVLA_MPI": "mpich", "HPCVLA_DOCTOR": "0",
           "HPCVLA_RUNS": str(tmp_path / "runs")}
    if scheduler == "slurm":
        env.update(PATH=f"{scontrol.parent}:{os.environ['PATH']}", SLURM_JOB_ID="12",
                   SLURM_JOB_NAME="hpcvla-demo", SLURM_JOB_NODELIST="h0", SLURM_NTASKS="2",
                   SLURM_SUBMIT_DIR=str(ROOT), SLURM_ARRAY_JOB_ID="10",
                   SLURM_ARRAY_TASK_ID="2")
        script, root = ["bash", ROOT / "jobs/slurm/demo.sbatch"], "hpcvla-demo-12"
    else:
        env.update(PBS_JOBID="10[2].pbs", PBS_ARRAY_INDEX="2", PBS_NODEFILE=str(tmp_path /
                   "nodes"), PBS_O_WORKDIR=str(ROOT))
        script, root = ["bash", ROOT / "jobs/pbs/demo.pbs"], r"hpcvla-demo-10\[2\]"

    def dry_run(*overrides) -> str:
        extra = {"OVERRIDES": " ".join(overrides)} if scheduler == "pbs" else {}
        out = subprocess.run([*script, *(["configs/default.yaml", *overrides]
                                         if scheduler == "slurm" else [])],
                             cwd=ROOT, env={**env, **extra}, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stderr
    said = dry_run()
    assert "array task 2: its own seed, run.seed=2" in said, said
    assert f" hpcvla train configs/default.yaml run.seed=2 run.root={tmp_path}/runs/{root}" \
        in said, said
    said = dry_run("run.seed=7")
    assert "array task 2: its command names run.seed, which every task of the array runs " \
        "alike" in said and "run.seed=2" not in said, said
    assert " hpcvla train configs/default.yaml run.seed=7 run.root=" in said, said
    said = dry_run(f"run.resume={tmp_path / 'earlier'}")  # a run continued keeps its seed
    assert "array task" not in said and "run.seed=" not in said, said
    # a sweep: task K adds the overrides of the file's line K (the lines that hold any; here
    # saved on Windows)
    sweep = tmp_path / "sweep.txt"
    sweep.write_bytes(b"# lr x clip\r\nalgorithm.lr=1e-4\r\n\r\nalgorithm.lr=3e-4 "
                      b"'placement.per_node={simulator: 1, inference: 1}'\r\n"
                      b"algorithm.lr=3e-4 run.seed=11\r\n")
    env["HPCVLA_SWEEP"] = str(sweep)
    index = "SLURM_ARRAY_TASK_ID" if scheduler == "slurm" else "PBS_ARRAY_INDEX"
    env.update({index: "1", "PBS_JOBID": "10[1].pbs"})
    said = dry_run()
    assert (r" hpcvla train configs/default.yaml algorithm.lr=3e-4 placement.per_node=\{"
            r"simulator:\ 1\,\ inference:\ 1\} run.seed=1 run.root=") in said, said
    env.update({index: "2", "PBS_JOBID": "10[2].pbs"})
    said = dry_run()
    assert "HPCVLA_SWEEP line 2: algorithm.lr=3e-4 run.seed=11" in said and \
        " train configs/default.yaml algorithm.lr=3e-4 run.seed=11 run.root=" in said, said
    env.update({index: "3", "PBS_JOBID": "10[3].pbs"})
    out = subprocess.run([*script, *(["configs/default.yaml"] if scheduler == "slurm" else [])],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"array task 3: HPCVLA_SWEEP={sweep} has 3 line(s) of " \
        "overrides (tasks 0-2): submit --array=0-2" in out.stderr, out.stderr


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_ranks_ask_for_the_cpus_of_the_jobs_smallest_node(tmp_path, mpi):
    """A whole-node job of a mixed partition (128 and 64 CPUs), 8 tasks a node, no
    --cpus-per-task: each rank runs 8 threads (the smaller node's share: the batch node's
    128 / 8 oversubscribed the other twice), and the step asks for what each node has: under
    srun (Open MPI) 8 CPUs a rank (without it a step's task gets one CPU, to which a site that
    binds tasks to cores pins all 8 threads), Hydra's proxy step 64 a node (the batch node's
    128 fails on the other: "More processors requested than permitted"). Dry runs."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho h0\necho h1\n")  # `scontrol show hostnames LIST`
    scontrol.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "HPCVLA_DRY_RUN": "1",
           "HPCVLA_DOCTOR": "0", "HPCVLA_MPI": mpi, "SLURM_JOB_ID": "12",
           "SLURM_JOB_NODELIST": "h[0-1]", "SLURM_NTASKS": "16", "SLURM_TASKS_PER_NODE": "8(x2)",
           "SLURM_CPUS_ON_NODE": "128", "SLURM_JOB_CPUS_PER_NODE": "128,64"}
    env.pop("SLURM_CPUS_PER_TASK", None)
    out = subprocess.run([ROOT / "jobs/launch.sh", "train", "configs/default.yaml"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "16 rank(s) on 2 node(s) (h0 h1), 8 per node, 8 thread(s) per rank" in out.stderr
    if mpi == "openmpi":
        assert "running: srun --mpi=pmix " in out.stderr and " --cpus-per-task=8 " in \
            out.stderr, out.stderr
    else:
        assert "HYDRA_LAUNCHER_EXTRA_ARGS=--cpus-per-task=64 " in out.stderr, out.stderr
    assert "locked memory: " in out.stderr  # (raised to the hard limit; across nodes: why)


def test_a_job_without_the_mpi_it_asks_for_says_why():
    """The MPI selection's reason reaches the job log, before the job's own line about it."""
    env = {**os.environ, "HPCVLA_MPI": "nosuch"}
    out = subprocess.run([ROOT / "jobs/launch.sh", "train", "configs/default.yaml"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        "launch.sh: error: --mpi 'nosuch': one of auto, mpich, openmpi",
        "launch.sh: error: no MPI to start the ranks with (HPCVLA_MPI=nosuch: the reason above)"]


def test_a_first_node_check_that_hangs_fails_the_job_within_its_limit(tmp_path):
    """The first node's `hpcvla doctor` runs within HPCVLA_NODE_DOCTOR_S, as the other
    nodes' checks do: one that hangs (a renderer's driver, a file system) fails the job
    saying so, not a job that waits for ever before its first world. Here a limit of 1 s,
    which the doctor's imports alone outlast."""
    env = {**os.environ, "HPCVLA_DOCTOR": "1", "HPCVLA_NODE_DOCTOR_S": "1"}
    for name in [k for k in env if k.startswith(("SLURM_", "PBS_"))]:
        del env[name]
    start = time.monotonic()
    out = subprocess.run([ROOT / "jobs/launch.sh", "train", "configs/default.yaml",
                          f"run.root={tmp_path}"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and time.monotonic() - start < 30, out.stderr[-2000:]
    assert "hpcvla doctor did not finish on this node" in out.stderr and \
        "within 1 s (HPCVLA_NODE_DOCTOR_S)" in out.stderr, out.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # no world started, no run made


def test_time_limit_warning_checkpoints_requeues_and_resumes(slurm, tmp_path):
    """What `#SBATCH --signal=B:USR1@60` does before the time limit: the batch shell gets
    SIGUSR1, the ranks get SIGTERM and stop with a checkpoint, the job requeues itself, and
    its next start continues the same run from that checkpoint to the end. With srun
    starting the ranks, the requeued job's step ids are the first start's again: before its
    world it removes the MPICH segments no process maps (one planted here, as a killed
    rank's), which its ranks would otherwise join. (Under Hydra, whose step ids are its own:
    the 3-host requeue test and the no-progress one.)"""
    log = tmp_path / "requeue.out"
    job = slurm.sbatch(ROOT / "jobs/slurm/demo.sbatch", "configs/default.yaml",
                       "pipeline.total_updates=30", "pipeline.progress_every_s=0.1",
                       options=["--output", log], cwd=ROOT,
                       env=job_env(tmp_path, HPCVLA_LAUNCHER="srun"))
    first_update(slurm, job, log)
    left = plant_orphan_segment(f"requeue_test_{job}")
    slurm.signal_batch_shell(job, signal.SIGUSR1)
    text = finished(slurm, job, log, timeout=600)
    assert slurm.job(job)["Restarts"] == "1"
    first, second = text.split("requeueing job", 1)
    assert "srun --mpi=pmi2" in text, text[-3000:]
    # the planted one by name: the line may count others the first start's ranks left
    assert removed_by_name(left, second), "\n".join(
        line for line in text.splitlines() if "launch.sh" in line or "removed" in line)
    assert "received SIGUSR1: sending SIGTERM to the ranks" in first
    assert "[hpcvla] update 30/30" not in first  # stopped before the end
    run_dir = the_run(tmp_path / "runs")
    assert f"continuing {run_dir} from its newest checkpoint" in second
    assert "[hpcvla] resuming from" in second and "[hpcvla] update 30/30" in second
    summary = json.loads((run_dir / "summary.json").read_text())
    (learner,) = [r for r in summary["per_rank"] if r["role"] == "learner"]
    assert 0 < learner["first_version"] < 30
    assert (run_dir / "checkpoints" / "v000030" / "state.json").exists()


def test_a_time_limit_warning_before_any_progress_is_not_requeued_again(slurm, tmp_path):
    """A requeued start whose time-limit warning comes before a checkpoint past the one it
    began from (here while it checks its node, before any rank starts: a time limit shorter
    than a start) is not requeued again: each next start would end the same way, for ever.
    The job ends as stopped (USR1: 138), saying what to change and how to continue."""
    log = tmp_path / "no-progress.out"
    job = slurm.sbatch(ROOT / "jobs/slurm/demo.sbatch", "configs/default.yaml",
                       "pipeline.total_updates=30", "pipeline.progress_every_s=0.1",
                       options=["--output", log], cwd=ROOT,
                       env=job_env(tmp_path, HPCVLA_DOCTOR="1"))
    first_update(slurm, job, log)
    slurm.signal_batch_shell(job, signal.SIGUSR1)  # progress: from no checkpoint to one
    deadline = time.monotonic() + 300
    while "checking this node" not in (log.read_text().split("requeueing job", 1) + [""])[1]:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(0.5)  # the requeued start's node check under way
    slurm.signal_batch_shell(job, signal.SIGUSR1)
    info = slurm.wait(job, 300)
    text = log.read_text()
    assert (info["Restarts"], info["ExitCode"]) == ("1", f"{128 + signal.SIGUSR1}:0"), \
        f"{info}\n{text[-3000:]}"
    second = text.split("requeueing job", 1)[1]
    run_dir = the_run(tmp_path / "runs")
    version = max(int(p.name[1:]) for p in (run_dir / "checkpoints").iterdir())
    assert f"no checkpoint past policy version {version} in this job" in second, second[-3000:]
    assert f"continue the run in a new job with run.resume={run_dir}" in second
    assert "requeueing job" not in second


def test_an_sft_job_trains_every_task_requeues_at_the_time_limit_and_resumes(slurm, tmp_path,
                                                                             demos):
    """jobs/slurm/sft.sbatch: `hpcvla sft` with a learner on each of the job's tasks, one
    world; the time-limit warning stops it after a step with a checkpoint, the job requeues
    itself, and its next start goes on from that step to sft.steps."""
    log = tmp_path / "sft.out"
    job = slurm.sbatch(ROOT / "jobs/slurm/sft.sbatch", "configs/default.yaml",
                       f"sft.demos={demos}", "sft.steps=800", "sft.batch_size=8",
                       "pipeline.progress_every_s=0.1", options=["--output", log], cwd=ROOT,
                       env=job_env(tmp_path))
    deadline = time.monotonic() + 300
    while "[hpcvla sft] step " not in (text := log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and slurm.job(job)["JobState"] in (
            "PENDING", "RUNNING"), text or "no log"
        time.sleep(0.5)
    slurm.signal_batch_shell(job, signal.SIGUSR1)
    text = finished(slurm, job, log, timeout=600)
    assert slurm.job(job)["Restarts"] == "1", text[-3000:]
    first, second = text.split("requeueing job", 1)
    assert "2 learner(s)" in first and "[hpcvla sft] step 800/800" not in first
    run_dir = the_run(tmp_path / "runs")
    assert run_dir.name.startswith("default-sft-")
    assert f"continuing {run_dir} from its newest checkpoint" in second, second[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 800 and summary["learners"] == 2 and not summary["preempted"]
    steps = sorted(int(p.name[1:]) for p in (run_dir / "checkpoints").iterdir())
    assert steps[-1] == 800 and len(steps) >= 1, steps


@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
def test_a_rank_killed_in_a_job_ends_it_and_is_named(slurm, tmp_path, scheduler):
    """Hydra's mpiexec under either scheduler; the dead world's MPICH segments are removed on
    its node (srun --overlap there; under PBS the job's own node runs the cleanup itself)."""
    log = tmp_path / "killed.out"
    if scheduler == "slurm":
        job = slurm.sbatch(ROOT / "jobs/slurm/demo.sbatch", "configs/default.yaml",
                           "pipeline.total_updates=100000", options=["--output", log],
                           env=job_env(tmp_path), cwd=ROOT)
    else:
        job = slurm.qsub(ROOT / "jobs/pbs/demo.pbs", options=["-V", "-o", log, "-j", "oe"],
                         env=job_env(tmp_path, OVERRIDES="pipeline.total_updates=100000"),
                         cwd=ROOT)
    deadline = time.monotonic() + 300
    while not any(m.stat().st_size for m in (tmp_path / "runs").glob("*/*/metrics.jsonl")) \
            or not rank_pids(tmp_path).get(1):  # trains, rank 1 is there
        ended = slurm.job(job)["JobState"] in TERMINAL  # (before its ranks: a broken script)
        assert time.monotonic() < deadline and not ended, \
            log.read_text() if log.exists() else "no log"
        time.sleep(0.5)
    pid = rank_pids(tmp_path)[1]  # a simulator in the default layout
    planted = plant_orphan_segment(f"killed_rank_test_{job}")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    info = slurm.wait(job, 120)
    took = time.monotonic() - killed
    text = log.read_text()
    assert info["JobState"] == "FAILED" and took < 30, (info["JobState"], took, text[-3000:])
    assert "BAD TERMINATION" in text and "Killed (signal 9)" in text  # Hydra: how it died
    assert "rank 1: simulator on node 0 (host" in text and f"pid {pid})" in text  # the cards:
    assert "last progress: policy version" in text  # which rank was what; how far it got
    assert not rank_pids(tmp_path), "ranks left running"
    assert f"scheduler {scheduler}" in text and removed_by_name(planted, text), text[-3000:]


@pytest.mark.parametrize("mpi,launcher", [("openmpi", "srun"), ("openmpi5", "srun"),
                                          ("openmpi5", "mpiexec")])
def test_open_mpi_jobs_start_their_ranks_by_srun_pmix_or_mpirun(slurm3, tmp_path, mpi, launcher):
    """Open MPI's start in a Slurm job (mpi_select: `srun --mpi=pmix`, Slurm's PMIx server
    wiring the ranks up, no mpirun): jobs/slurm/multinode.sbatch on 3 hosts, 2 rollout nodes
    and a learner node, under Debian's Open MPI 4.1 and under Open MPI 5 as a loaded module
    (`make install`'s, first on PATH), every trajectory crossing the network. Open MPI 5's
    own mpirun (HPCVLA_LAUNCHER=mpiexec: PRRTE's daemons started by srun) runs it too;
    4.1's mpirun in a Slurm job: test_each_nodes_ranks_see_the_gpus_slurm_gave_that_node."""
    log, updates = tmp_path / "ompi-start.out", 6
    five = OPENMPI5.parent
    env = job_env(tmp_path, HPCVLA_MPI="openmpi", HPCVLA_LAUNCHER=launcher,
                  **({"PATH": f"{five}:{slurm3.env['PATH']}"} if mpi == "openmpi5" else {}))
    job = slurm3.sbatch(ROOT / "jobs/slurm/multinode.sbatch", "configs/learner_nodes.yaml",
                        "placement.per_node.simulator=1", "placement.per_node.inference=1",
                        f"pipeline.total_updates={updates}",
                        options=["--output", log, "--ntasks-per-node=2", "--cpus-per-task=1"],
                        env=env, cwd=ROOT)
    text = finished(slurm3, job, log)
    started = "running: srun --mpi=pmix --kill-on-bad-exit=1 --ntasks=6" if launcher == "srun" \
        else f"{five / 'mpirun'} -n 6 --hostfile "
    assert started in text, text[:2000]
    assert (f"MPI: openmpi ({five / 'mpirun'})" in text) == (mpi == "openmpi5"), text[:2000]
    assert f"[hpcvla] update {updates}/{updates}" in text, text[-3000:]
    summary = json.loads((the_run(tmp_path / "runs") / "summary.json").read_text())
    assert {r["host"] for r in summary["per_rank"]} == {"h0", "h1", "h2"}, summary["per_rank"]
    assert sum(summary["staleness_hist"].values()) == updates * 2 * 32


def test_a_launcher_that_exits_0_for_a_world_that_never_ran_fails_the_job(tmp_path):
    """Nodes without their TmpFS (a fault): Slurm's PMIx plugin fails every task's launch
    (it cannot make its per-step directory), and srun exits 0 though no rank ran.
    jobs/launch.sh does not take that for a finished run: this host's ranks left no card and
    no done mark (deathwatch.unfinished), so the job fails, saying so."""
    log = tmp_path / "never-ran.out"
    with LocalSlurm(nodes=3, no_tmpfs=True) as cluster:
        job = cluster.sbatch(ROOT / "jobs/slurm/multinode.sbatch", "configs/learner_nodes.yaml",
                             "placement.per_node.simulator=1", "placement.per_node.inference=1",
                             "pipeline.total_updates=6",
                             options=["--output", log, "--ntasks-per-node=2",
                                      "--cpus-per-task=1"],
                             env=job_env(tmp_path, HPCVLA_MPI="openmpi"), cwd=ROOT)
        info = cluster.wait(job, 300)
    text = log.read_text()
    assert "srun --mpi=pmix" in text and "[hpcvla] update" not in text, text[-3000:]
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), text[-3000:]
    assert "the launcher exited 0, but the world did not run to its end: no rank of the " \
        "world registered on this host (h0)" in text, text[-3000:]


def test_a_node_other_than_the_first_that_lacks_what_the_job_needs_fails_it_at_once(tmp_path):
    """jobs/launch.sh checks the job's first node wholly, then its others for what each has of
    its own (`hpcvla doctor --node-only`, all at once): h1's /dev/shm of 1 MiB cannot hold its
    ranks' windows, and the job fails in seconds naming h1, its check and the fix, before any
    rank starts (its ranks would fail or hang mapping their windows)."""
    log = tmp_path / "small-shm.out"
    with LocalSlurm(nodes=2, shm_mib={"h1": 1}) as cluster:
        start = time.monotonic()
        job = cluster.sbatch(ROOT / "jobs/slurm/demo.sbatch", "configs/colocated.yaml",
                             options=["--output", log, "--nodes=2", "--ntasks-per-node=2"],
                             env=job_env(tmp_path, HPCVLA_DOCTOR="1"), cwd=ROOT)
        info = cluster.wait(job, 300)
        took, text = time.monotonic() - start, log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), text[-3000:]
    assert "ok   /dev/shm" in text and "and then nodes h1: the same with --node-only" in text
    (shm,) = [line for line in text.splitlines() if line.startswith("h1: FAIL /dev/shm")]
    assert "1.0 MiB free, a node's windows need >=" in shm, text[-3000:]
    assert "h1:                  fix: a larger /dev/shm" in text, text[-3000:]
    assert "h1: ok   renderer" in text and "h1: ok   mpi" not in text  # what a node has alone
    assert "node(s) h1 lack what the job needs (above)" in text, text[-3000:]
    assert "not every node of the job has what it needs" in text and took < 90, took
    assert "[hpcvla]" not in text, text[-3000:]  # no rank started


STARTED_AGAIN = "the world failed while starting, before any rank registered: starting it " \
    "again (1/2)"


def kill_rank_1_as_it_starts(slurm, job: str, log: Path, tmp_path: Path) -> None:
    """Stop the job's rank 1 as soon as it exists (no rank can then pass its first collective,
    so none registers), check that no rank left a card, and kill it."""
    deadline, looked = time.monotonic() + 300, time.monotonic()
    while not (pid := rank_pids(tmp_path).get(1)):  # a rank registers ~0.5 s after its start
        if time.monotonic() - looked > 2:  # (scontrol takes longer than a look at /proc)
            assert time.monotonic() < deadline and slurm.job(job)["JobState"] not in TERMINAL, \
                log.read_text() if log.exists() else "no log"
            looked = time.monotonic()
        time.sleep(0.01)
    os.kill(pid, signal.SIGSTOP)
    cards = list((tmp_path / "runs").glob("*/.ranks/rank*.json"))
    os.kill(pid, signal.SIGKILL)
    assert not cards, f"a rank registered before rank 1 was stopped: {cards}"


def test_a_world_that_died_while_starting_is_started_again(slurm, tmp_path):
    """A rank that dies before any rank registered (as Open MPI's ranks can in MPI_Init,
    open-mpi/ompi#12495): jobs/launch.sh starts the world once more on the same nodes, and
    the job runs to its end in one run directory. Rank 1 is stopped as soon as it exists
    (the others then cannot pass their first collective, so none registers), then killed."""
    log = tmp_path / "retried.out"
    job = slurm.sbatch(ROOT / "jobs/slurm/demo.sbatch", "configs/default.yaml",
                       "pipeline.total_updates=3", options=["--output", log],
                       env=job_env(tmp_path), cwd=ROOT)
    kill_rank_1_as_it_starts(slurm, job, log, tmp_path)
    text = finished(slurm, job, log)
    first, second = text.split(STARTED_AGAIN, 1)
    assert "its ranks (0 registered)" in first and "[hpcvla] update" not in first, first[-3000:]
    assert "[hpcvla] update 3/3" in second, second[-3000:]
    summary = json.loads((the_run(tmp_path / "runs") / "summary.json").read_text())
    assert summary["ranks"] == 4 and sum(summary["staleness_hist"].values()) == 3 * 32


def test_an_eval_job_whose_world_died_while_starting_is_started_again(slurm, tmp_path):
    """jobs/slurm/eval.sbatch, as the training job above: its ranks leave their cards in the
    job's folder (HPCVLA_JOB_RUNS/.ranks), so a world whose rank 1 died before any rank
    registered is started again and prints its result; the folder goes with the job."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(hpcvla("config", "configs/default.yaml").stdout)
    log = tmp_path / "eval-again.out"
    job = slurm.sbatch(ROOT / "jobs/slurm/eval.sbatch", run_dir, "--untrained", "--json",
                       "--episodes", "8", "--envs", "2", env=job_env(tmp_path),
                       options=["--output", log], cwd=ROOT)
    kill_rank_1_as_it_starts(slurm, job, log, tmp_path)
    text = finished(slurm, job, log)
    first, second = text.split(STARTED_AGAIN, 1)
    assert "its ranks (0 registered)" in first and "\n{" not in first, first[-3000:]
    (line,) = [line for line in second.splitlines() if line.startswith("{")]
    result = json.loads(line)
    assert result["ranks"] == 4 and len(result["per_episode"]) == 8, result
    assert not list((tmp_path / "runs").iterdir()), "the job's folder was left behind"


def test_a_signal_during_the_node_checks_ends_them_at_once(tmp_path):
    """bash runs a trap only once a foreground command returns: a stop signal (a cancel, the
    time limit's warning) during the other nodes' checks (up to HPCVLA_NODE_DOCTOR_S) waited
    for them. Now they run under until_signalled: the signal ends them and what they started
    (a node's srun or ssh) within a second, and the job goes on as one stopped."""
    marker = f"{os.getpid()}{time.monotonic_ns() % 100000}"
    script = f"""set -euo pipefail
        SCHEDULER=none PYTHON=python EARLY=""
        say() {{ echo "say: $*" >&2; }}
        source {ROOT}/jobs/lib/world.sh
        trap 'EARLY=USR1' USR1
        on_node() {{ sleep 30.{marker}; }}  # a node whose check hangs
        HOSTS=(a b c)
        code=0
        until_signalled check_other_nodes doctor --node-only || code=$?
        echo "returned $code EARLY=$EARLY"
    """
    start = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ,
                                                                    "TMPDIR": str(tmp_path)})
    time.sleep(1.5)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=20)
    took = time.monotonic() - start
    assert out == "returned 1 EARLY=USR1\n" and took < 5, (out, err, took)
    assert "say: received SIGUSR1: ending the checks (check_other_nodes doctor --node-only" \
        " ...), which would hold it" in err, err
    left = subprocess.run(["pgrep", "-f", f"sleep 30.{marker}"], capture_output=True, text=True)
    assert left.stdout == "", left.stdout  # the nodes' commands ended with it
    assert list(tmp_path.iterdir()) == []  # and its answers' folder removed
    ran = subprocess.run(["bash", "-c", f"""set -euo pipefail
        SCHEDULER=none EARLY=""; say() {{ :; }}; source {ROOT}/jobs/lib/world.sh
        code=0; until_signalled bash -c 'exit 3' || code=$?; echo "$code"
        EARLY=TERM; code=0; until_signalled sleep 20.{marker} || code=$?; echo "$code"
        """], capture_output=True, text=True, timeout=20)
    # without a signal: the command's own status; after one already: not started
    assert ran.stdout == "3\n1\n", ran
    # a command that ignores SIGTERM (a hung srun): SIGKILL 5 s later
    stubborn = subprocess.Popen(["bash", "-c", f"""set -euo pipefail
        SCHEDULER=none EARLY=""; say() {{ :; }}; source {ROOT}/jobs/lib/world.sh
        trap 'EARLY=TERM' TERM
        code=0; until_signalled bash -c "trap '' TERM; sleep 40.{marker}" || code=$?
        echo "$code" """], stdout=subprocess.PIPE, text=True)
    time.sleep(1.5)
    start = time.monotonic()
    stubborn.send_signal(signal.SIGTERM)
    out, _ = stubborn.communicate(timeout=20)
    assert out == "1\n" and time.monotonic() - start < 9, out
    left = subprocess.run(["pgrep", "-f", f"sleep [24]0.{marker}"], capture_output=True,
                          text=True)
    assert left.stdout == "", left.stdout
    # an srun under the check's subshell, which takes a second to end its step after SIGTERM:
    # it has that second (the grace is the whole tree's, not the subshell's)
    graceful = tmp_path / "graceful"
    step = subprocess.Popen(["bash", "-c", f"""set -euo pipefail
        SCHEDULER=none EARLY=""; say() {{ :; }}; source {ROOT}/jobs/lib/world.sh
        trap 'EARLY=TERM' TERM
        srun_like() {{ bash -c 'trap "sleep 1; echo ended > {graceful}; exit 0" TERM
                                sleep 50.{marker} & wait'; }}
        check() {{ srun_like & wait; }}
        until_signalled check || echo "stopped" """], stdout=subprocess.PIPE, text=True)
    time.sleep(1.5)
    step.send_signal(signal.SIGTERM)
    out, _ = step.communicate(timeout=20)
    assert out == "stopped\n" and graceful.read_text() == "ended\n", out
