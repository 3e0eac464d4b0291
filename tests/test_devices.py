"""The device map (devices.py): every inference and learner rank on a GPU of its own node, no
two learners on one GPU, simulators on a GPU only when their simulator uses one; launcher
bindings kept; and the CPU path (staging buffers, `hpcvla plan`'s device column)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcvla.cli import main as hpcvla_main
from hpcvla.devices import (HostStaging, assign_node, gpu_names, granted_gpus,
                            missing_gpus_problem, plan_devices, visible_gpus)
from hpcvla.topology.plan import INF, LEARN, SIM, PlanError, build_plan
from helpers import ROOT, hpcvla


@st.composite
def layouts(draw):
    """A plan that builds, and a GPU count that has room for its learners."""
    mode = draw(st.sampled_from(["disaggregated", "hybrid", "colocated"]))
    nodes = draw(st.integers(1, 3))
    inf = draw(st.integers(1, 4))
    sims = draw(st.integers(inf, 12))
    learn = 0 if mode == "hybrid" else draw(st.integers(0 if nodes > 1 else 1, 4))
    per_node = {SIM: sims, INF: inf, LEARN: learn}
    learner_nodes = draw(st.integers(0, nodes - 1)) if mode == "disaggregated" else 0
    if mode == "disaggregated" and not learn and not learner_nodes:
        learner_nodes = 1 if nodes > 1 else 0
        per_node[LEARN] = 0 if learner_nodes else 1
    rpn = sum(per_node.values())
    try:
        plan = build_plan(nodes * rpn, rpn, mode, per_node, learner_nodes)
    except PlanError:
        plan = build_plan(nodes * rpn, rpn, "colocated")
    most_learners = max(sum(LEARN in i.roles for i in plan.ranks if i.node == n)
                        for n in range(plan.num_nodes))
    gpus = draw(st.integers(max(1, most_learners), most_learners + 12))
    return plan, gpus, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_every_inference_and_learner_rank_gets_a_gpu_and_learners_never_share(layout):
    plan, gpus, sim_gpu = layout
    devices = plan_devices(plan, gpus, sim_gpu)
    learner_gpus = [(i.node, devices[i.rank]) for i in plan.ranks if LEARN in i.roles]
    assert len(set(learner_gpus)) == len(learner_gpus), "two learners on one GPU"
    for node in range(plan.num_nodes):
        infos = [i for i in plan.ranks if i.node == node]
        compute = [devices[i.rank] for i in infos if INF in i.roles or LEARN in i.roles]
        assert all(d.startswith("cuda:") and int(d[5:]) < gpus for d in compute)
        if len(compute) <= gpus:  # room for everyone: nobody shares
            assert len(set(compute)) == len(compute)
        for info in infos:
            if info.roles == (SIM,):
                assert devices[info.rank].startswith("cuda:") == sim_gpu


def test_two_nodes_of_eight_gpus_disaggregated_and_hybrid(capsys):
    """The acceptance layouts, through `hpcvla plan`: one GPU per inference and learner rank."""
    for mode, per_node in (("disaggregated", ("12", "2", "2")), ("hybrid", ("8", "8", "0"))):
        code = hpcvla_main(["plan", "configs/default.yaml", "--world", "32", "--ranks-per-node",
                            "16", "placement.gpus_per_node=8", f"placement.mode={mode}",
                            f"placement.per_node.simulator={per_node[0]}",
                            f"placement.per_node.inference={per_node[1]}",
                            f"placement.per_node.learner={per_node[2]}"])
        out, err = capsys.readouterr()
        rows = [line.split() for line in out.splitlines()[2:34]]
        assert len(rows) == 32 and rows[-1][0] == "31"
        # laid out either way; hybrid is plan-only: train refuses it, and plan says so
        assert (code, "hybrid is plan-only" in err) == ((0, False) if mode == "disaggregated"
                                                        else (2, True)), err
        gpu_rows = [(r[1], r[6]) for r in rows if "inference" in r[3] or "learner" in r[3]]
        assert len(gpu_rows) == (2 * 4 if mode == "disaggregated" else 2 * 8), (mode, gpu_rows)
        assert len(set(gpu_rows)) == len(gpu_rows), f"{mode}: a GPU serves two ranks"
        assert all(device == "cpu" for r in rows if r[3] == "simulator" for device in [r[6]])


def test_more_learners_than_gpus_names_the_fix():
    with pytest.raises(PlanError, match="placement.gpus_per_node=0"):
        assign_node([(LEARN,)] * 3, [("0", "1")] * 3, sim_gpu=False)


def test_inference_ranks_share_what_learners_leave():
    roles = [(INF,), (SIM,), (INF,), (SIM,), (LEARN,), (LEARN,)]
    got = assign_node(roles, [("0", "1", "2")] * 6, sim_gpu=False)
    assert got[4:] == ["0", "1"] and got[0] == "2" and got[2] in ("0", "1")
    assert got[1] is None and got[3] is None


def test_simulators_that_use_a_gpu_keep_off_the_learners_gpus():
    """8 GPUs, 2 learners, 2 inference ranks and 8 rendering simulators: the simulators share
    the 6 GPUs no learner trains on; with only learners' GPUs to take, they share those."""
    roles = [(SIM,)] * 8 + [(INF,)] * 2 + [(LEARN,)] * 2
    got = assign_node(roles, [tuple("01234567")] * 12, sim_gpu=True)
    assert got[10:] == ["0", "1"] and got[8:10] == ["2", "3"]
    assert got[:8] == ["4", "5", "6", "7", "2", "3", "4", "5"]  # before: 4-7, then 0, 1, ...
    assert assign_node([(SIM,), (LEARN,)], [("0",)] * 2, sim_gpu=True) == ["0", "0"]


def test_a_launcher_binding_is_kept():
    """srun --gpus-per-task=1: each rank sees only its own GPU, and keeps it."""
    roles = [(INF,), (SIM,), (LEARN,), (LEARN,)]
    assert assign_node(roles, [("5",), (), ("6",), ("7",)], sim_gpu=True) == \
        ["5", None, "6", "7"]
    with pytest.raises(PlanError, match="another learner"):
        assign_node([(LEARN,), (LEARN,)], [("3",), ("3",)], sim_gpu=False)


def test_the_memory_model_names_one_gpu_one_way_per_node():
    """Bound ranks all say cuda:0: told apart by UUID where a name names two GPUs of a node;
    a GPU two ranks see under two indexes is one name; other nodes' names are their own."""
    placed = [("cuda:0", "A"), ("cuda:0", "B"), ("cpu", None), ("cuda:1", "A"),
              ("cuda:0", "C"), ("cuda:1", "D")]
    assert gpu_names(placed, [0, 0, 0, 0, 1, 1]) == {
        0: "cuda:0 (A)", 1: "cuda:0 (B)", 2: "cpu", 3: "cuda:0 (A)", 4: "cuda:0", 5: "cuda:1"}


def test_the_gpu_jobs_refusal_step_is_a_gpus_only(tmp_path):
    """`bench fullsize`'s `refuse` step checks a world's own GPU plan: on CPUs there is none
    to refuse, so --quick leaves it out of its steps and says so when asked for it."""
    from hpcvla.bench import fullsize
    with pytest.raises(RuntimeError, match="refuse needs a GPU"):
        fullsize.refused(tmp_path, fullsize.JOB["tiny"], quick=True)
    line = fullsize.table({"size": "full", "updates": 20, "device": "H200",
                           "refuse": {"wall_s": 31.4, "exit": 2}}).splitlines()[-1]
    assert line == "an overfilled world started directly: refused, exit 2 after 31.4 s"


def test_no_gpus_means_cpu_everywhere():
    plan = build_plan(8, 4, "disaggregated", {SIM: 2, INF: 1, LEARN: 1})
    assert set(plan_devices(plan, 0, sim_gpu=True).values()) == {"cpu"}


def test_asking_for_gpus_a_machine_lacks_is_an_error():
    # on any machine: the suite hides the GPUs from every test outside tests/gpu/ (conftest.py)
    assert visible_gpus(-1) == () and visible_gpus(0) == ()
    with pytest.raises(PlanError, match="placement.gpus_per_node = 2"):
        visible_gpus(2)


def test_what_says_gpus_were_given():
    assert granted_gpus({"SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": "0,1"}) == \
        "SLURM_GPUS_ON_NODE=8"
    assert granted_gpus({"CUDA_VISIBLE_DEVICES": "0"}) == "CUDA_VISIBLE_DEVICES=0"
    assert granted_gpus({"SLURM_JOB_GPUS": "2,3"}) == "SLURM_JOB_GPUS=2,3"
    for hidden in ({}, {"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "-1"},
                   {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, {"SLURM_GPUS_ON_NODE": "0"}):
        assert granted_gpus(hidden) is None, hidden
    # torch sees no GPU on this machine: detecting would mean the CPU, choosing it is fine
    assert "SLURM_GPUS_ON_NODE=8" in missing_gpus_problem(-1, {"SLURM_GPUS_ON_NODE": "8"})
    assert missing_gpus_problem(0, {"SLURM_GPUS_ON_NODE": "8"}) is None
    assert missing_gpus_problem(-1, {"CUDA_VISIBLE_DEVICES": ""}) is None
    assert missing_gpus_problem(2, {}).startswith("at most the 0 GPU(s) torch sees on this node")


def test_gpus_a_slurm_job_was_not_given_are_not_taken(monkeypatch):
    """Without Slurm's device cgroups a job that overrides the CUDA_VISIBLE_DEVICES Slurm set
    sees every GPU of the node: given 2 of 8, it would detect (and train on) other jobs'.
    Refused, naming the grant; fine where the job was given them all, where each task sees
    its own, where Slurm says nothing of GPUs (a site that does not schedule them hands out
    whole GPU nodes), outside a Slurm job, and with placement.gpus_per_node set."""
    import hpcvla.devices as devices
    monkeypatch.setattr(devices, "torch_gpu_count", lambda: 8)
    job = {"SLURM_JOB_ID": "7"}
    said = missing_gpus_problem(-1, {**job, "SLURM_GPUS_ON_NODE": "2",
                                     "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    assert said.startswith("GPUs this job was given: torch sees 8 on this node, but this Slurm "
                           "job was given 2 (SLURM_GPUS_ON_NODE='2'") and \
        "placement.gpus_per_node=2" in said, said
    assert "was given 3" in missing_gpus_problem(-1, {**job, "SLURM_JOB_GPUS": "0,1,5"})
    for fine in ({**job, "SLURM_GPUS_ON_NODE": "8"}, {**job, "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7"},
                 {**job, "SLURM_GPUS_ON_NODE": "8", "SLURM_STEP_GPUS": "3"}, job, {}):
        assert missing_gpus_problem(-1, fine) is None, fine
    assert missing_gpus_problem(2, {**job, "SLURM_GPUS_ON_NODE": "2"}) is None
    monkeypatch.setattr(devices, "torch_gpu_count", lambda: 1)  # --gpus-per-task: its own
    assert missing_gpus_problem(-1, {**job, "SLURM_GPUS_ON_NODE": "8"}) is None


def test_gpus_granted_but_hidden_by_the_users_cuda_visible_devices_are_named(monkeypatch):
    """A CUDA torch that sees none of the GPUs Slurm gave: a user's `export
    CUDA_VISIBLE_DEVICES=` (or another node's ids) is why, not the build (the message said to
    reinstall torch); with a CPU-only build the build is why."""
    import torch
    granted = {"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": ""}
    assert "CPU-only build" in missing_gpus_problem(-1, granted)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    said = missing_gpus_problem(-1, granted)
    assert "(SLURM_GPUS_ON_NODE=4) but CUDA_VISIBLE_DEVICES='' hides them" in said, said
    assert "unset it" in said and "placement.gpus_per_node=0" in said
    for given in ({"SLURM_GPUS_ON_NODE": "4"},  # Slurm sets the variable itself
                  {"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}):
        said = missing_gpus_problem(-1, given)
        assert "Install a torch that matches the node's driver" in said, said


def test_the_gpu_check_of_a_node_without_gpus_imports_no_torch():
    """The launcher runs missing_gpus_problem before any rank starts: on a node without GPUs
    it imports no torch (~2 s of CPU a call; the refusal above imported it every time)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import sys\n"
                          "from hpcvla.devices import missing_gpus_problem\n"
                          "assert missing_gpus_problem(-1, {'SLURM_JOB_ID': '7'}) is None\n"
                          "print('torch' in sys.modules)"], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_a_gpu_node_a_job_was_given_no_gpus_of_is_refused_unless_hidden(monkeypatch):
    """A Slurm or PBS job that asked for no GPU on an NVIDIA node (device cgroups hide them):
    the driver's device files are there, torch sees none, nothing was granted. Detecting
    would run every rank on the CPU: refused, naming the request and the choice; hiding them
    (CUDA_VISIBLE_DEVICES=, what the suite does), choosing the CPU, or no batch job (a
    workstation with a CPU-only torch) is fine."""
    import hpcvla.devices as devices
    job = {"SLURM_JOB_ID": "7"}
    assert missing_gpus_problem(-1, job) is None  # this machine: no device files
    nvidia = Path("/dev/nvidia0")
    real_glob = Path.glob
    monkeypatch.setattr(devices, "_gpu_device_files", lambda: True)  # torch still sees none
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter([nvidia])
                        if pattern == "nvidia[0-9]*" else real_glob(self, pattern))
    for scheduler in (job, {"PBS_JOBID": "7.pbs"}):
        said = missing_gpus_problem(-1, scheduler)
        assert "node with NVIDIA GPUs but was given none" in said and "torch " in said
        assert "--gpus-per-node=N" in said and "placement.gpus_per_node=0" in said
    assert missing_gpus_problem(0, job) is None
    assert missing_gpus_problem(-1, {}) is None  # no batch job: a workstation's CPU torch
    for hidden in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        for value in ("", "-1", "NoDevFiles"):
            assert missing_gpus_problem(-1, {**job, hidden: value}) is None
    assert "SLURM_GPUS_ON_NODE=8" in missing_gpus_problem(-1, {"SLURM_GPUS_ON_NODE": "8"})


@pytest.mark.mpi  # the CLI, refusing before it would start a world
def test_a_gpu_node_whose_gpus_torch_cannot_see_is_refused_before_any_rank():
    # A GPU list that names no device, so torch sees none on a GPU host too (on this CPU
    # machine `SLURM_GPUS_ON_NODE=8 CUDA_VISIBLE_DEVICES=0,1 hpcvla train` is the same case).
    nothing = "GPU-00000000-0000-0000-0000-000000000000"
    out = hpcvla("train", "configs/default.yaml", "pipeline.total_updates=1",
                 env={"SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": nothing})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "placement.gpus_per_node" in out.stderr and "SLURM_GPUS_ON_NODE=8" in out.stderr
    assert "sees none" in out.stderr and "gpus_per_node=0" in out.stderr
    assert "run directory" not in out.stdout  # no rank started
    # more GPUs asked for than torch sees here: refused too, and `hpcvla doctor` says so
    out = hpcvla("train", "configs/default.yaml", "placement.gpus_per_node=1")
    assert out.returncode == 2 and "run directory" not in out.stdout, out.stdout[-2000:]
    assert "placement.gpus_per_node = 1: expected at most the 0 GPU(s) torch sees on this " \
        "node" in out.stderr, out.stderr[-2000:]
    out = hpcvla("doctor", "configs/default.yaml", "placement.gpus_per_node=1")
    assert out.returncode != 0 and "at most the 0 GPU(s)" in out.stdout + out.stderr, out.stdout


def test_host_staging_on_cpu_is_a_plain_concatenation():
    staging = HostStaging(torch.device("cpu"))
    parts = [np.arange(6, dtype=np.uint8).reshape(2, 3), np.ones((1, 3), np.uint8)]
    out = staging.gather("image", parts)
    assert np.array_equal(out, np.concatenate(parts))
    tensors = staging.to_device({"image": out})
    assert tensors["image"].device.type == "cpu"
    assert tensors["image"].data_ptr() == out.ctypes.data  # no copy on the CPU


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.bench
def test_the_gpu_check_runs_its_cpu_side_and_says_why_it_skipped_the_rest(tmp_path):
    """`hpcvla bench gpu --quick` on a machine without CUDA: the CPU side of every step (the
    tiny presets timed, a 4-rank reach run) and a reason for each GPU step. ~30-40 s: the
    whole command as a GPU node runs it, a training world included."""
    out = hpcvla("bench", "gpu", "--quick", "--json", tmp_path / "gpu.json", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["gpus"] == 0 and set(result["devices"].values()) == {"cpu"}
    assert result["presets"]["flow/tiny"]["train_step_ms"] > 0
    assert "no CUDA" in result["presets"]["flow/full"]["skipped"]
    assert result["flow_inference"]["cpu"]["act_ms"] > 0
    assert "no CUDA" in result["flow_inference"]["gpu"]["skipped"]
    assert set(result["reach_training"]["ranks"].values()) >= {"learner cpu float32"}
    assert "no CUDA" in result["maniskill_gpu_sim"]["skipped"]
    assert "no CUDA" in result["memory_model"]["skipped"]
    assert "no CUDA" in result["modes_real"]["skipped"]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.bench
def test_the_gpu_validation_job_runs_dry_on_the_cpu(tmp_path):
    """jobs/validate_gpu.sh at the tiny sizes on the CPU (HPCVLA_VALIDATE_QUICK=1): every
    kind of step of `hpcvla bench fullsize` (the pretrained folders, the timed plan, a training
    run stopped by SIGTERM, OFT with LoRA run to its end, `hpcvla sft` with LoRA on recorded
    demonstrations), the logs in OUT, the results in fullsize.json. The streamer, sync, LoRA
    and Open MPI steps are the stopped run without the signal or with other overrides, each
    mode tested elsewhere: left out to keep the suite's time."""
    import os
    import subprocess
    env = {**os.environ, "HPCVLA_VALIDATE_QUICK": "1", "HPCVLA_VALIDATE_UPDATES": "1",
           "HPCVLA_VALIDATE_STEPS": "plan,sigterm,oft,sft"}
    out = subprocess.run([ROOT / "jobs/validate_gpu.sh", tmp_path], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert {"validate.log", "doctor.log", "fullsize.log", "inventory.log", "fullsize.json",
            "runs.tgz"} <= {p.name for p in tmp_path.iterdir()}
    results = json.loads((tmp_path / "fullsize.json").read_text())
    assert results["size"] == "tiny" and results["pi0_folder"]["parameters"] > 0
    assert results["plan"]["wall_s"] > 0 and results["plan"]["memory"]["host_by_rank"]
    for step in ("sigterm", "oft"):
        run = results[step]
        assert run["phases_s"]["first_version_trained"] > run["phases_s"]["all_ranks_ready"]
        assert run["env_steps_per_s"] > 0
        assert all(r["peak"]["host_rss"] > 0 for r in run["ranks"]), run["ranks"]
    # learner.checkpoint_every=-1: the runs measured write no checkpoint; the stopped one does
    assert not list((tmp_path / "work" / "oft").glob("*/checkpoints/v*"))
    stop = results["sigterm"]
    assert 0 <= stop["signal_to_checkpoint_s"] < stop["signal_to_exit_s"] < 60, stop
    assert stop["checkpoint_bytes"] > 0  # measured, then removed (45 GB at full size)
    log = (tmp_path / "fullsize.log").read_text()
    assert "SIGTERM to checkpoint" in log and "[fullsize] oft: {" in log
    sft = results["sft"]
    assert sft["steps_per_s"] > 0 and sft["phases_s"]["first_step"] > 0, sft
    assert sft["ranks"][0]["peak"]["host_rss"] > 0 and "sft (LoRA, 8 chunks a step)" in log
    assert not list((tmp_path / "work" / "sft").glob("*/checkpoints"))  # measured, removed


def test_mujoco_renders_on_the_ranks_gpu_as_egl_numbers_it():
    from hpcvla.envs.egl import choose_egl_device, egl_cuda_ordinals, egl_device
    # EGL's order is its own; devices CUDA cannot see have no ordinal
    assert egl_device([1, 0], 0) == 1
    assert egl_device([None, None, 0, None], 0) == 2
    with pytest.raises(RuntimeError, match="MUJOCO_GL=osmesa"):
        egl_device([None], 0)
    # set only where EGL renders and the user chose no device
    for environ in ({"MUJOCO_GL": "osmesa"}, {"MUJOCO_EGL_DEVICE_ID": "1"}):
        before = dict(environ)
        choose_egl_device(3, environ)
        assert environ == before
    assert isinstance(egl_cuda_ordinals(), list)  # this machine's EGL, if any: no CUDA here
    assert all(o is None for o in egl_cuda_ordinals())
    # where EGL renders and nobody chose: this machine's EGL has no CUDA device, so a rank
    # bound to one fails loudly, naming the way out, rather than rendering elsewhere
    environ: dict[str, str] = {}
    with pytest.raises(RuntimeError, match="MUJOCO_GL=osmesa"):
        choose_egl_device(0, environ)
    assert environ == {}


def test_learner_zero_publishes_the_address_its_peers_route_to(monkeypatch):
    """DeepSpeed's rendezvous address: the source address of the route to a learner on
    another host (a hostname may resolve to 127.0.1.1 or a management network), the
    hostname when every learner shares it or a peer's name does not resolve, and
    HPCVLA_LEARNER_ADDR above all."""
    from hpcvla.engines.zero import rendezvous_host
    monkeypatch.delenv("HPCVLA_LEARNER_ADDR", raising=False)
    assert rendezvous_host("node0", []) == "node0"
    assert rendezvous_host("node0", ["node0", "node0"]) == "node0"
    assert rendezvous_host("node0", ["node0", "127.0.0.1"]) == "127.0.0.1"
    assert rendezvous_host("node0", ["no-such-host.invalid"]) == "node0"
    monkeypatch.setenv("HPCVLA_LEARNER_ADDR", "10.0.0.7")
    assert rendezvous_host("node0", ["127.0.0.1"]) == "10.0.0.7"


ZERO_STEP = """
import sys
from mpi4py import MPI
from hpcvla.config import load_config
from hpcvla.engines.zero import deepspeed_engine
from hpcvla.envs import env_spec
from hpcvla.factory import build_policy
cfg = load_config("configs/default.yaml", ["learner.zero_stage=2", "learner.micro_batches=1"])
engine = deepspeed_engine(cfg, build_policy(cfg, env_spec(cfg.env), "cpu"), MPI.COMM_SELF)
before = [p.detach().clone() for p in engine.module.parameters()]
engine.backward(sum(p.sum() for p in engine.module.parameters()))
engine.step()
moved = sum(not p.equal(b) for p, b in zip(engine.module.parameters(), before))
print(moved, len(before), sys.modules["deepspeed.runtime.zero.muon.original_muon"].__doc__,
      flush=True)
import torch.distributed
torch.distributed.destroy_process_group()  # gloo's threads end before the process does
"""


@pytest.mark.slow  # a DeepSpeed engine in a fresh process: ~10 s
def test_a_zero_learner_starts_without_compiling_anything(tmp_path):
    """engines/zero: the engine starts, steps every parameter at ZeRO-2 (whose gradient copies
    ask about Muon too), Muon's compiled kernels are never imported (their stand-in is), and
    DeepSpeed builds no op into an empty extensions folder (its shared-memory op, a minute
    of a fresh machine's first run, serves only inference)."""
    import os
    import subprocess
    import sys
    extensions = tmp_path / "torch_extensions"
    out = subprocess.run([sys.executable, "-c", ZERO_STEP], cwd=ROOT, capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)})
    assert out.returncode == 0, out.stderr[-3000:]
    moved, total, muon = out.stdout.splitlines()[-1].split(" ", 2)
    assert moved == total and int(total) > 0, out.stdout[-2000:]
    assert muon.startswith("hpcvla: Muon's names alone"), out.stdout[-2000:]
    built = list(extensions.rglob("*")) if extensions.exists() else []
    assert not built and "built successfully" not in out.stdout, (built, out.stdout[-2000:])


def test_only_ranks_that_compute_on_their_gpu_open_a_cuda_context():
    """A LIBERO simulator rank renders through EGL and needs no CUDA context; a simulator
    that shares its rank with inference, or ManiSkill's (SAPIEN renders through CUDA), does."""
    from hpcvla.devices import renders_only
    assert renders_only((SIM,), "libero")
    assert not renders_only((SIM, INF), "libero")
    assert not renders_only((SIM,), "maniskill")
    assert not renders_only((INF,), "libero") and not renders_only((LEARN,), "libero")
