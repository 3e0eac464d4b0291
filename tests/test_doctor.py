"""`hpcvla doctor`: passes on this machine, and a setup broken in one way at a time fails with
that cause named (the check, what it saw, the fix), exit status 1. Broken for real: a /dev/shm
of 1 MiB (a tmpfs mounted over it in a mount namespace of its own), a tokenizer folder that
does not exist, GPUs the scheduler granted that torch cannot see, an EGL with no vendor
library."""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, reach_demos

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # the CLI and a 2-rank world per call: ~5 s each


def doctor(*args, env=None, wrap=()):
    out = subprocess.run([*wrap, sys.executable, "-m", "hpcvla", "doctor", "--json",
                          *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, **(env or {})})
    checks = {c["name"]: c for c in json.loads(out.stdout)} if out.stdout.strip() else {}
    return out, checks


def test_this_machine_passes_every_check():
    """Each config, without a layout (launch.ranks') and with a job's (--world,
    --ranks-per-node: the memory model's plan of it, on this node's CPUs)."""
    for config in ("configs/default.yaml", "configs/libero_spatial.yaml"):
        out, checks = doctor(config)
        assert out.returncode == 0, out.stdout + out.stderr
        assert {"mpi", "/dev/shm", "gpus", "renderer", "config", "disk"} <= set(checks)
        assert all(c["ok"] for c in checks.values()), checks
    assert "starts one world of 2" in checks["mpi"]["found"]
    assert checks["renderer"]["found"] == "EGL (MuJoCo): drew a 16x16 scene"
    out, checks = doctor("configs/default.yaml", "--world", 8, "--ranks-per-node", 4)
    assert out.returncode == 0 and all(c["ok"] for c in checks.values()), checks
    assert checks["memory"]["found"] == "8 rank(s), 4 per node, 0 GPU(s) each: fits"
    # robosuite renders any MUJOCO_GL but osmesa and glx with egl: so does the check (it
    # tried PyOpenGL's platform "EGL" and failed); LIBERO's simulators on a job's node, 2
    # envs each, fit this machine's memory (test_a_node_whose_simulators_outgrow_...)
    out, checks = doctor("configs/libero_spatial.yaml", "--world", 4, "--ranks-per-node", 4,
                         "env.envs_per_simulator=2", env={"MUJOCO_GL": "EGL"})
    assert checks["renderer"]["found"] == "EGL (MuJoCo): drew a 16x16 scene", checks
    assert out.returncode == 0 and checks["host memory"]["ok"], checks


BROKEN = {  # what is broken: (args, environment, the check that fails, words of its report)
    "tokenizer folder missing": (
        ["configs/reach_flow.yaml", f"policy.pretrained={ROOT}/tests/fixtures/pi0/pi0/lerobot",
         "policy.tokenizer=/nonexistent/tokenizer"], {}, "config", "policy.tokenizer"),
    "granted GPUs torch cannot see": (
        ["configs/default.yaml"], {"SLURM_GPUS_ON_NODE": "2"}, "gpus",
        "this node was given GPUs (SLURM_GPUS_ON_NODE=2) but torch"),
    "a setting the env refuses": (  # what train refuses, the doctor fails too
        ["configs/libero_spatial.yaml", "env.suite=libero_99"], {}, "config",
        "env.suite = 'libero_99': expected one of libero_spatial"),
    "no EGL": (["configs/libero_spatial.yaml"],
               {"__EGL_VENDOR_LIBRARY_FILENAMES": "/nonexistent/egl_vendor.json"}, "renderer",
               "EGL (MuJoCo): failed"),
    "GLX without a display": (  # the backend the user chose is the one named, and its needs
        ["configs/libero_spatial.yaml"], {"MUJOCO_GL": "glx", "DISPLAY": ""}, "renderer",
        "glx (MuJoCo, MUJOCO_GL): failed"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_setup_fails_naming_its_cause(case):
    args, env, name, words = BROKEN[case]
    out, checks = doctor(*args, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert [n for n, c in checks.items() if not c["ok"]] == [name], checks
    assert words in checks[name]["found"] + checks[name]["fix"], checks[name]
    assert checks[name]["fix"]


@pytest.mark.cluster  # root: a mount namespace
def test_a_full_dev_shm_fails_naming_it():
    wrap = ["unshare", "--mount", "sh", "-c",
            'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"', "sh"]
    out, checks = doctor("configs/default.yaml", wrap=wrap)
    assert out.returncode == 1, out.stdout + out.stderr
    shm = checks["/dev/shm"]
    assert not shm["ok"] and float(shm["found"].split()[0]) <= 1.0, shm
    assert "larger /dev/shm" in shm["fix"]


def test_the_dev_shm_need_counts_every_learner_of_a_node():
    """Each learner maps its ring in its node's /dev/shm: the colocated world `hpcvla train`
    starts here (launch.ranks 4, every rank a learner) needs four, the default one."""
    from hpcvla.config import load_config
    from hpcvla.doctor import _node_learners, _shared_memory
    ring = ["learner.ring_slot_kib=8192"]
    default = load_config(ROOT / "configs/default.yaml", ring)
    colocated = load_config(ROOT / "configs/colocated.yaml", ring)
    assert (_node_learners(default), _node_learners(colocated)) == (1, 4)
    rings = 4 * 32 * 8 + 64  # MiB, beside no weights: reach's rings at their least, 32 slots
    assert f"need >= {rings:,.1f} MiB" in _shared_memory(colocated, 0).found


def test_the_disk_need_counts_the_states_of_trained_parameters_only():
    """A checkpoint holds the weights and, per trained parameter, its fp32 master and two
    moments: a frozen prefix (train_expert_only) or LoRA has no states for the frozen ones,
    which the doctor charged 12 bytes each of (a π0 LoRA run refused for tens of GB)."""
    from hpcvla.config import load_config
    from hpcvla.doctor import _disk, _policy_size
    needs = {}
    for frozen in (False, True):
        cfg = load_config(ROOT / "configs/reach_flow.yaml",
                          [f"policy.train_expert_only={str(frozen).lower()}"])
        weights, trainable, _ = _policy_size(cfg)
        found = _disk(cfg, weights, trainable).found
        needs[frozen] = float(found.split("need ~")[1].split()[0].replace(",", ""))
        assert trainable < weights / 4 if frozen else trainable == weights / 4  # fp32 here
    assert needs[True] < needs[False]


@pytest.mark.cluster  # root: a mount namespace
def test_an_sft_job_needs_its_demonstrations_copy_in_dev_shm_not_trains_windows(tmp_path):
    """`--job sft` (jobs/launch.sh passes its command): /dev/shm must hold the demonstrations'
    one copy per node, not the weight window and rings `train` maps there. A 80 MiB /dev/shm
    fails train's check (97 MiB) and passes sft's (its copy and MPI's 64 MiB)."""
    demos = reach_demos(tmp_path / "demos.h5", 4)
    wrap = ["unshare", "--mount", "sh", "-c",
            'mount -t tmpfs -o size=80m tmpfs /dev/shm && exec "$@"', "sh"]
    train, checks = doctor("configs/default.yaml", wrap=wrap)  # train reads no sft.*
    assert train.returncode == 1 and not checks["/dev/shm"]["ok"], train.stdout + train.stderr
    assert "a node's windows need >= 97" in checks["/dev/shm"]["found"]
    sft, checks = doctor("configs/default.yaml", f"sft.demos={demos}", "--job", "sft", wrap=wrap)
    assert sft.returncode == 0, sft.stdout + sft.stderr
    assert "the demonstrations' one copy needs >= 64." in checks["/dev/shm"]["found"], checks


@pytest.mark.cluster  # root: a mount namespace
def test_sft_and_the_jobs_doctor_agree_on_a_dev_shm_without_room_beside_mpis_own(tmp_path):
    """`hpcvla sft`'s own check and the doctor every sft job runs first leave MPI's own
    shared memory the same room (windows.MPI_OWN_SHM): a /dev/shm of 63.5 MiB that holds the
    demonstrations but not MPI's 64 MiB beside them passed sft's check and failed the
    job's doctor; both refuse it now."""
    demos = reach_demos(tmp_path / "demos.h5", 4)
    wrap = ["unshare", "--mount", "sh", "-c",
            'mount -t tmpfs -o size=65024k tmpfs /dev/shm && exec "$@"', "sh"]
    out, checks = doctor("configs/default.yaml", f"sft.demos={demos}", "--job", "sft",
                         wrap=wrap)
    assert out.returncode == 1 and not checks["/dev/shm"]["ok"], out.stdout + out.stderr
    sft = subprocess.run([*wrap, sys.executable, "-c",
                          "from hpcvla.config import load_config\n"
                          "from hpcvla.preflight import check_sft\n"
                          f"check_sft(load_config('configs/default.yaml', ['sft.demos={demos}']),"
                          " 'the test')"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert sft.returncode == 1 and "free beside MPI's own 64 MiB" in sft.stderr, sft.stderr


def test_a_jobs_layout_that_overfills_its_gpus_fails_naming_the_setting(tmp_path):
    """--world/--ranks-per-node (jobs/launch.sh passes the job's): the memory model's plan of
    that layout. On this node's CPUs it fits; on GPUs of placement.gpu_memory_gb = 1.4 (a
    preview here, where the gpus check fails too) train's learners need their CUDA context
    and more: refused naming learner.micro_batch and each overfilled GPU; `--job sft`'s
    learners, a GPU each, naming sft.batch_size once."""
    gpus = ["placement.gpus_per_node=4", "placement.gpu_memory_gb=1.4"]  # (without: fits,
    # test_this_machine_passes_every_check)
    out, checks = doctor("configs/default.yaml", *gpus, "--world", 8, "--ranks-per-node", 4)
    assert out.returncode == 1 and not checks["memory"]["ok"], out.stdout + out.stderr
    assert checks["memory"]["found"] == "8 rank(s), 4 per node, 4 GPU(s) each: does not fit"
    fix = checks["memory"]["fix"]
    assert "learner.micro_batch = 16: expected a layout that fits: rank(s) 3 on node 0" in fix
    assert "rank(s) 7 on node 1 cuda:0" in fix
    demos = reach_demos(tmp_path / "demos.h5", 2)
    out, checks = doctor("configs/default.yaml", f"sft.demos={demos}", *gpus, "--job", "sft",
                         "--world", 4, "--ranks-per-node", 2)
    assert out.returncode == 1 and checks["memory"]["found"].endswith(": does not fit")
    assert checks["memory"]["fix"].startswith("sft.batch_size = 64: expected a layout that "
                                              "fits: rank(s) 0 on node 0 cuda:0 need 1.5 GiB")


def test_what_train_refuses_doctor_fails(tmp_path):
    """A run root under a file and a layout rule (micro_batch against the envs per shard)
    that `hpcvla train` refuses before launch: doctor said ok to both; and --world 0."""
    (tmp_path / "afile").touch()
    out, checks = doctor("configs/default.yaml", f"run.root={tmp_path}/afile/runs")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "afile is not a folder" in checks["config"]["fix"], checks["config"]
    out, checks = doctor("configs/default.yaml", "learner.micro_batch=7", "--world", 4)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "learner.micro_batch = 7: expected a multiple of the envs per shard" in \
        checks["layout"]["found"], checks["layout"]
    out = subprocess.run([sys.executable, "-m", "hpcvla", "doctor", "--world", "0"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "--world: '0': give a whole number, 1 or more" in out.stderr


def test_a_node_whose_simulators_outgrow_its_host_memory_fails_naming_them():
    """The host memory the memory model puts on the job's busiest node against this node's:
    24 LIBERO simulator ranks of a 32-rank node, each with more envs than this machine's
    memory holds at 268 MiB an env (memory/simulators.py, measured)."""
    from hpcvla.memory.host import host_bytes
    envs = 2 * (host_bytes() // (2 * 24 * 268 * 2 ** 20) + 1)  # even: env.shards is 2
    node = ["--world", 32, "--ranks-per-node", 32,
            "placement.per_node={simulator: 24, inference: 4, learner: 4}"]
    out, checks = doctor("configs/libero_spatial.yaml", *node, f"env.envs_per_simulator={envs}")
    host = checks["host memory"]
    assert out.returncode == 1 and not host["ok"] and checks["memory"]["ok"], checks
    assert "(simulator envs " in host["found"] and "env.envs_per_simulator" in host["fix"]
    # (2 envs each fit: test_this_machine_passes_every_check)


@pytest.fixture
def memory_cgroup():
    """A memory cgroup of this machine's (v1's memory controller, else v2's), removed after:
    its folder and the file that limits it."""
    import shutil
    from pathlib import Path
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = [line.split(":", 2)[2] for line in lines if "memory" in line.split(":", 2)[1].split(",")]
    if v1:
        folder = Path("/sys/fs/cgroup/memory") / v1[0].lstrip("/") / f"hpcvla-{os.getpid()}"
        limit = "memory.limit_in_bytes"
    else:  # v2: a child of the root, which may hold processes
        root = Path("/sys/fs/cgroup")
        root = root if (root / "cgroup.controllers").exists() else root / "unified"
        folder, limit = root / f"hpcvla-{os.getpid()}", "memory.max"
    folder.mkdir()
    try:
        yield folder, folder / limit
    finally:
        for _ in range(50):  # once its processes are gone
            try:
                folder.rmdir()
                break
            except OSError:
                import time
                time.sleep(0.1)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.cluster  # root: a cgroup
def test_the_host_memory_is_the_jobs_allocation_where_its_cgroup_limits_it(memory_cgroup):
    """A job's processes may use what their cgroup allows (Slurm's --mem, PBS's mem=, a
    container's limit), not the machine's memory: 4 LIBERO ranks of 2 envs (7.2 GiB by the
    memory model), which pass on this machine (the test above), fail in a cgroup of 6 GiB,
    which the doctor reads as the node's memory."""
    folder, limit = memory_cgroup
    limit.write_text(str(6 * 2 ** 30))
    wrap = ["sh", "-c", f'echo $$ > {folder}/cgroup.procs && exec "$@"', "sh"]
    args = ["configs/libero_spatial.yaml", "--world", 4, "--ranks-per-node", 4,
            "env.envs_per_simulator=2"]
    out, checks = doctor(*args, wrap=wrap)
    host = checks["host memory"]
    assert out.returncode == 1 and not host["ok"], checks
    assert "this node has 6.0 GiB" in host["found"], host


def test_an_open_mpi_without_windows_across_hosts_fails_naming_it(tmp_path):
    """An Open MPI 4.x whose ompi_info lists neither the ucx nor the rdma one-sided component
    (here Debian's 4.1 with those lines taken out of its ompi_info beside its mpirun): the
    trajectory ring's windows would fail across hosts, and `hpcvla doctor` says so, from what
    the MPI's selection found (MpiInstall.lacks_windows)."""
    (tmp_path / "mpirun").symlink_to("/usr/bin/mpirun.openmpi")
    info = tmp_path / "ompi_info"
    info.write_text("#!/bin/sh\n/usr/bin/ompi_info \"$@\" | grep -v -e '^mca:osc:ucx:' "
                    "-e '^mca:osc:rdma:'\n")
    info.chmod(0o755)
    out, checks = doctor("configs/default.yaml", env={
        "HPCVLA_MPI_FLAVOUR": "openmpi", "HPCVLA_MPIEXEC": str(tmp_path / "mpirun")})
    assert out.returncode == 1, out.stdout + out.stderr
    assert [n for n, c in checks.items() if not c["ok"]] == ["mpi"], checks
    assert "has neither the ucx nor the rdma one-sided component" in checks["mpi"]["found"]
    assert "HPCVLA_MPI=mpich" in checks["mpi"]["fix"], checks["mpi"]


def test_an_eval_job_is_checked_for_what_eval_of_its_arguments_needs(tmp_path):
    """`--job eval -- RUN_DIR [eval's flags] [key=value ...]`: the run's config as `hpcvla
    eval` reads it, with its --envs. No /dev/shm, windows or disk of train's; the memory
    model of eval's ranks: on GPUs of placement.gpu_memory_gb = 0.6 each rank's CUDA context
    alone overfills them (a preview here, where the gpus check fails too), named with eval's
    own flag. An override eval would not act on is refused as eval refuses it (exit 2), and
    so are eval's flags before `--`."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    out = subprocess.run([sys.executable, "-m", "hpcvla", "config", "configs/default.yaml"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    (run_dir / "config.yaml").write_text(out.stdout)
    world = ["--job", "eval", "--world", 4, "--ranks-per-node", 2, "--"]
    out, checks = doctor(*world, run_dir, "--untrained", "--envs", 4, "--episodes", 8)
    assert out.returncode == 0, out.stdout + out.stderr
    assert set(checks) == {"mpi", "gpus", "renderer", "memory", "host memory", "config"}
    assert checks["memory"]["found"] == "4 rank(s), 2 per node, 0 GPU(s) each: fits"
    gpus = ["placement.gpus_per_node=2", "placement.gpu_memory_gb=0.6"]
    out, checks = doctor(*world, run_dir, "--untrained", "--envs", 4, *gpus)
    assert out.returncode == 1 and not checks["memory"]["ok"], out.stdout + out.stderr
    assert checks["memory"]["fix"].startswith("--envs = 4: expected a layout that fits: "
                                              "rank(s) 0 on node 0 cuda:0 need "), checks
    assert "rank(s) 3 on node 1 cuda:1" in checks["memory"]["fix"], checks
    out, checks = doctor(*world, run_dir, "--untrained", "--envs", 64, "--episodes", 3, *gpus)
    assert checks["memory"]["fix"].startswith("--envs = 3: "), checks  # no more than episodes
    out, checks = doctor(*world, run_dir, "learner.micro_batch=3")
    assert out.returncode == 2 and not checks, out.stdout + out.stderr
    assert "learner.micro_batch = '3': expected a setting `hpcvla eval` reads" in out.stderr
    out, checks = doctor(*world[:-1], run_dir, "--envs", 4)  # eval's flag, but no `--`
    assert out.returncode == 2 and "unrecognized arguments: --envs 4 (`doctor --job eval` " \
        "takes eval's after `--`)" in out.stderr, out.stderr


def test_wandb_online_on_a_node_that_cannot_reach_its_server_is_refused(monkeypatch):
    """`run.wandb=online` with a login but no route to the W&B server (a compute node without
    internet): rank 0's wandb.init waited ~90 s and ended the world. Refused before any rank
    starts, naming the server (here a local port nothing listens on) or the proxy it would go
    through; a server that answers passes."""
    import socket
    from types import SimpleNamespace
    from hpcvla.metrics.tensorboard import wandb_problems
    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    online = SimpleNamespace(wandb="online")
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY",
                 "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    try:
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port}")
        (problem,) = wandb_problems(online)
        assert problem[0] == "run.wandb" and problem[2].startswith(
            f"offline: this node cannot reach 127.0.0.1:{closed_port} (Connection refused)"), \
            problem
        monkeypatch.setenv("WANDB_BASE_URL", "https://api.wandb.ai")
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{closed_port}")
        (problem,) = wandb_problems(online)
        assert f"cannot reach the proxy 127.0.0.1:{closed_port}" in problem[2], problem
        monkeypatch.setenv("HTTPS_PROXY", f"127.0.0.1:{listening.getsockname()[1]}")
        assert wandb_problems(online) == []  # the proxy answers
        # an on-site server reached directly (NO_PROXY), given without its scheme
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{closed_port}")
        monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
        monkeypatch.setenv("WANDB_BASE_URL", f"127.0.0.1:{listening.getsockname()[1]}")
        assert wandb_problems(online) == []
    finally:
        listening.close()


def test_full_size_checkpoints_in_the_home_folder_are_pointed_to_scratch(tmp_path, monkeypatch):
    """The job scripts' runs/ is in the checkout, often in a home folder capped at tens of GB
    (a file system's free space does not show the quota): the disk check says where
    checkpoints of this size belong; small ones, or ones elsewhere, it does not."""
    from hpcvla import doctor as checks
    from hpcvla.config import load_config
    monkeypatch.setenv("HOME", str(tmp_path))
    home = load_config(None, [f"run.root={tmp_path}/hpcvla/runs"])
    assert "run.root is in your home folder" in checks._disk(home, 3 << 30, 3 << 30).found
    assert "home folder" not in checks._disk(home, 1 << 20, 1 << 20).found
    scratch = load_config(None, [f"run.root={tmp_path.parent}/scratch/runs"])
    assert "home folder" not in checks._disk(scratch, 3 << 30, 3 << 30).found


def test_a_gpu_node_without_nvidias_egl_fails_where_its_ranks_would(monkeypatch):
    """The renderer check draws with any EGL device (Mesa's software one too), but LIBERO's
    ranks given a GPU need the EGL device of that GPU (envs/egl.py): a node without
    NVIDIA's EGL (a container without the driver's graphics capability) passed the doctor
    and failed at every rank's start. Here torch sees 2 GPUs and EGL lists one device, with
    no CUDA ordinal."""
    from hpcvla import devices
    from hpcvla.config import load_config
    from hpcvla.doctor.render import renderer_checks
    from hpcvla.envs import egl
    monkeypatch.delenv("MUJOCO_GL", raising=False)
    monkeypatch.setattr(devices, "torch_gpu_count", lambda: 2)
    monkeypatch.setattr(egl, "egl_cuda_ordinals", lambda: [None])
    cfg = load_config(ROOT / "configs/libero_spatial.yaml")
    found = {c.name: c for c in renderer_checks(cfg)}
    assert not found["egl-gpus"].ok and "none renders on CUDA device(s) [0, 1]" in \
        found["egl-gpus"].found and "NVIDIA_DRIVER_CAPABILITIES" in found["egl-gpus"].fix
    monkeypatch.setattr(egl, "egl_cuda_ordinals", lambda: [1, None, 0])
    assert {c.name: c for c in renderer_checks(cfg)}["egl-gpus"].ok
    monkeypatch.setattr(egl, "egl_cuda_ordinals", lambda: [0])
    cfg = load_config(ROOT / "configs/libero_spatial.yaml", ["placement.gpus_per_node=1"])
    assert {c.name: c for c in renderer_checks(cfg)}["egl-gpus"].ok  # its one GPU's is there
    cfg = load_config(ROOT / "configs/libero_spatial.yaml", ["placement.gpus_per_node=0"])
    assert "egl-gpus" not in {c.name for c in renderer_checks(cfg)}  # CPU ranks: no GPU's
    monkeypatch.setenv("MUJOCO_EGL_DEVICE_ID", "0")  # the user's choice: the ranks' too
    cfg = load_config(ROOT / "configs/libero_spatial.yaml")
    assert "egl-gpus" not in {c.name for c in renderer_checks(cfg)}
