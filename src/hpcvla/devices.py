"""Which device each rank computes on, and getting data onto it.

    assign_node(roles, visible, sim_gpu)   # pure: a node's ranks -> GPU ids (or None)
    plan_devices(plan, gpus, sim_gpu)      # pure: every rank of a plan -> "cuda:i" | "cpu"
    rank_device(cfg, roles, world)         # at run time: this rank's device, bound ("cuda:i")
    bind_rank_device(cfg, roles, world)    # the same as a torch.device
    gpu_names(placed, nodes)               # pure: ranks' devices named one name per GPU
    HostStaging(device)                    # pinned host buffers for batches bound to a GPU

The map (RLinf and verl do the same): inference and learner ranks get a GPU each; a rank that
is both (colocated, or the plan-only hybrid) shares its GPU across the roles; simulator ranks
get a GPU only when their simulator renders or simulates on it (`envs.env_uses_gpu`), and
several may share one. No two learners ever share a GPU (ZeRO's collectives and memory
assume one each): a node with more learner ranks than GPUs is an error naming the fix. Where
there are fewer GPUs than inference + learner ranks, inference ranks share the least loaded
ones.

What a rank can see: the GPUs CUDA shows it (`CUDA_VISIBLE_DEVICES`), told apart by UUID.
When the launcher binds GPUs per task (Slurm `--gpus-per-task`, `--gpu-bind`, Open MPI
rankfiles), ranks of a node see different sets (each maybe as its cuda:0); the same greedy
rule then picks from each rank's own set, so a bound layout is kept as it is. `placement.gpus_per_node`: -1 detects, 0 runs on CPU only,
k > 0 uses the first k visible GPUs (and lets `hpcvla plan` preview a GPU node anywhere).

torch is imported where a device is asked for, not with the module: the checks before launch
(`missing_gpus_problem` on a node given no GPUs) and the launcher then start without it, ~2 s
of CPU each.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

from hpcvla.config.families import simulator
from hpcvla.topology.plan import EVAL, INF, LEARN, SIM, PlanError


def assign_node(roles: list[tuple[str, ...]], visible: list[tuple[str, ...]],
                sim_gpu: bool) -> list[str | None]:
    """The GPU (an id from the rank's own `visible` list) each rank of one node computes on,
    or None for the CPU. Learners first, then the other inference ranks (and evaluators),
    then simulators that use a GPU; each takes its least loaded visible GPU (ties: the lowest
    in its list), a simulator one without a learner where it can (a learner's GPU is the
    fullest, and the renderer's memory is not in the memory model)."""
    load: dict[str, int] = {}
    learner_gpus: set[str] = set()
    out: list[str | None] = [None] * len(roles)
    wants = [0 if LEARN in r else 1 if (INF in r or EVAL in r) else
             2 if (SIM in r and sim_gpu) else None for r in roles]
    for tier in (0, 1, 2):
        for local, rank_roles in enumerate(roles):
            if wants[local] != tier or not visible[local]:
                continue
            choices = visible[local]
            if tier == 0:  # a learner never shares with another learner
                choices = tuple(g for g in choices if g not in learner_gpus)
                if not choices:
                    raise PlanError(
                        f"node-local rank {local} ({'+'.join(rank_roles)}) finds no GPU that "
                        f"another learner does not use: the node has "
                        f"{sum(w == 0 for w in wants)} learner ranks and "
                        f"{len({g for v in visible for g in v})} GPU(s). Use at most one learner "
                        "rank per GPU (placement.per_node / ranks per node), ask the scheduler "
                        "for a GPU per learner rank (sbatch --gpus-per-node=N), or train on CPU "
                        "(placement.gpus_per_node=0)")
            gpu = min(choices, key=lambda g: (tier == 2 and g in learner_gpus, load.get(g, 0),
                                              choices.index(g)))
            load[gpu] = load.get(gpu, 0) + 1
            if tier == 0:
                learner_gpus.add(gpu)
            out[local] = gpu
    return out


def plan_devices(plan, gpus_per_node: int, sim_gpu: bool) -> dict[int, str]:
    """Every rank's device for nodes of `gpus_per_node` GPUs that all ranks see (what
    `hpcvla plan` shows; a run detects what each rank really sees)."""
    visible = tuple(str(i) for i in range(gpus_per_node))
    out = {}
    by_node: dict[int, list] = {}
    for info in plan.ranks:  # one pass: a plan of 10^5 ranks is a typo's, not a wait's
        by_node.setdefault(info.node, []).append(info)
    for infos in by_node.values():
        gpus = assign_node([i.roles for i in infos], [visible] * len(infos), sim_gpu)
        out.update({i.rank: "cpu" if g is None else f"cuda:{g}" for i, g in zip(infos, gpus)})
    return out


def visible_gpus(gpus_per_node: int = -1) -> tuple[str, ...]:
    """Identities of the GPUs this process may use, in torch's order (cuda:0, cuda:1, ...):
    their UUIDs, so that ranks which each see their own GPU as cuda:0 (Slurm's
    `--gpus-per-task` under device cgroups) are told apart. Cut to `gpus_per_node` >= 0."""
    count = torch_gpu_count()
    if gpus_per_node > count:
        raise PlanError(f"placement.gpus_per_node = {gpus_per_node}, but this rank sees "
                        f"{count} GPU(s) (CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): set it to -1 (detect) "
                        "or ask the scheduler for the GPUs")
    n = count if gpus_per_node < 0 else gpus_per_node
    if n == 0:
        return ()
    return tuple(_uuid(i) for i in range(n))


def _uuid(index: int) -> str:
    """torch's cuda:index told apart from every other GPU: its UUID (its index where torch
    reports none)."""
    import torch
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", index))


def gpu_identity(device: str) -> str | None:
    """The GPU a rank's device ("cuda:i", as rank_device bound it) is, by UUID; None for the
    CPU. Ranks bound to a GPU each (Slurm's `--gpus-per-task`) all say cuda:0."""
    return _uuid(int(device.split(":")[1])) if device.startswith("cuda") else None


def gpu_names(placed: list[tuple[str, str | None]], nodes: list[int]) -> dict[int, str]:
    """Each rank's device (`placed[r]`: its device and gpu_identity; `nodes[r]`: its node)
    named so that on a node one name is one GPU, for the memory model, which adds up the
    ranks of a (node, device): its "cuda:i" where that tells the GPU apart, else with the
    UUID ("cuda:0 (GPU-8c2f...)": ranks bound to a GPU each)."""
    first: dict[tuple[int, str | None], str] = {}  # (node, GPU) -> the first name it was seen by
    for (device, gpu), node in zip(placed, nodes):
        first.setdefault((node, gpu if gpu is not None else device), device)
    named = Counter((node, name) for (node, _), name in first.items())  # GPUs a name names
    out = {}
    for rank, ((device, gpu), node) in enumerate(zip(placed, nodes)):
        name = first[(node, gpu if gpu is not None else device)]
        out[rank] = f"{name} ({gpu})" if named[(node, name)] > 1 else name
    return out


def torch_gpu_count() -> int:
    """The GPUs torch sees in this process (without a driver's device files: 0, and torch is
    not imported)."""
    if not _gpu_device_files():
        return 0
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpu_device_files() -> bool:
    """Whether this host (or container) has the device files a GPU driver makes: NVIDIA's
    /dev/nvidia0.., AMD's /dev/kfd (ROCm), WSL's /dev/dxg. Without them CUDA and HIP see no
    device."""
    return Path("/dev/kfd").exists() or Path("/dev/dxg").exists() or \
        any(Path("/dev").glob("nvidia[0-9]*"))


def granted_gpus(environ=os.environ) -> str | None:
    """What says this process was given GPUs ("SLURM_GPUS_ON_NODE=8", ...), or None: the
    scheduler's per-node count or list, else a non-empty CUDA_VISIBLE_DEVICES (empty, -1
    and Slurm's NoDevFiles hide every GPU)."""
    for var in ("SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS",
                "CUDA_VISIBLE_DEVICES"):
        value = environ.get(var, "").strip()
        none = ("", "-1", "NoDevFiles", *(("0",) if var == "SLURM_GPUS_ON_NODE" else ()))
        if value not in none:
            return f"{var}={value}"
    return None


def slurm_gpu_count(environ=os.environ) -> int | None:
    """How many of this node's GPUs the Slurm job was given, the most any of its variables
    says (SLURM_GPUS_ON_NODE; the lists SLURM_JOB_GPUS, SLURM_STEP_GPUS), or None where none
    says: no Slurm job, or one that asked for none."""
    counts = []
    on_node = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if on_node.isdigit():
        counts.append(int(on_node))
    for var in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        listed = [x for x in environ.get(var, "").split(",") if x.strip()]
        if listed and listed != ["NoDevFiles"]:
            counts.append(len(listed))
    return max(counts) if counts else None


def unowned_gpus_problem(count: int, environ=os.environ) -> str | None:
    """Why the `count` GPUs torch sees on this node are not all this Slurm job's to detect
    (placement.gpus_per_node=-1): Slurm gave it fewer. Where its device cgroups are off
    (ConstrainDevices=no) a job that overrides the CUDA_VISIBLE_DEVICES Slurm sets sees the
    node's other GPUs, other jobs', and would train on them (another user's OOM, or "all
    CUDA-capable devices are busy"). None outside a Slurm job and where Slurm says nothing
    of GPUs (a site whose Slurm does not schedule them hands out whole GPU nodes)."""
    given = slurm_gpu_count(environ) if "SLURM_JOB_ID" in environ else None
    if given is None or count <= given:
        return None
    return (f"GPUs this job was given: torch sees {count} on this node, but this Slurm job was "
            f"given {given} (SLURM_GPUS_ON_NODE={environ.get('SLURM_GPUS_ON_NODE')!r}, "
            f"SLURM_JOB_GPUS={environ.get('SLURM_JOB_GPUS')!r}, CUDA_VISIBLE_DEVICES="
            f"{environ.get('CUDA_VISIBLE_DEVICES')!r}): the others are other jobs'. Leave "
            f"CUDA_VISIBLE_DEVICES to Slurm, or set placement.gpus_per_node={given}")


def missing_gpus_problem(gpus_per_node: int, environ=os.environ) -> str | None:
    """Why this node cannot run the GPUs the config asks for: more (`placement.
    gpus_per_node` > 0) than torch sees here (visible_gpus, as every rank will), or, for
    detection (-1), more than a Slurm job was given (unowned_gpus_problem), or a GPU node
    whose GPUs torch cannot see, which would silently mean the CPU: GPUs the job was given,
    or a Slurm/PBS job on a node with NVIDIA's device files that was given none and hides
    none (it asked the scheduler for none; device cgroups hide them). None when they are
    there, outside a batch job (a workstation's CPU-only torch), when CUDA_/ROCR_/
    HIP_VISIBLE_DEVICES hides them, or when the CPU was chosen (0)."""
    count = torch_gpu_count()
    if gpus_per_node > count:
        return (f"at most the {count} GPU(s) torch sees on this node (CUDA_VISIBLE_DEVICES="
                f"{environ.get('CUDA_VISIBLE_DEVICES')!r}): -1 detects them, 0 trains on the "
                f"CPU; or ask the scheduler for {gpus_per_node} GPU(s)")
    if gpus_per_node == -1 and count > 0:
        return unowned_gpus_problem(count, environ)
    if gpus_per_node != -1:
        return None
    granted = granted_gpus(environ)
    if granted is None:  # a batch job on an NVIDIA node that asked for no GPU
        hidden = any(v in environ for v in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                                            "HIP_VISIBLE_DEVICES"))
        in_job = "SLURM_JOB_ID" in environ or "PBS_JOBID" in environ
        if hidden or not in_job or not any(Path("/dev").glob("nvidia[0-9]*")):
            return None  # (and torch not imported: the launcher's check stays light)
    import torch
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    if granted is None:
        return ("GPUs for the ranks: this batch job runs on a node with NVIDIA GPUs but was "
                f"given none (no SLURM_GPUS_ON_NODE, SLURM_JOB_GPUS or CUDA_VISIBLE_DEVICES), "
                f"and torch {torch.__version__} ({build}) sees none: every rank would run on "
                "the CPU. Ask the scheduler for the node's GPUs (sbatch --gpus-per-node=N, PBS "
                "select=...:ngpus=N), or set placement.gpus_per_node=0 to run on the CPU on "
                "purpose")
    hiding = environ.get("CUDA_VISIBLE_DEVICES")  # Slurm sets it too: only a value that
    if torch.version.cuda and hiding in ("", "-1", "NoDevFiles"):  # hides every GPU is why
        return (f"GPUs torch can see: this node was given GPUs ({granted}) but "
                f"CUDA_VISIBLE_DEVICES={hiding!r} hides them from torch: unset it (the "
                "scheduler sets it for each task), or set placement.gpus_per_node=0 to train "
                "on the CPU on purpose")
    return (f"GPUs torch can see: this node was given GPUs ({granted}) but torch "
            f"{torch.__version__} ({build}) sees none. Install a torch that matches the node's "
            "driver, or set placement.gpus_per_node=0 to train on the CPU on purpose")


def _system_gpu(index: int) -> str:
    """How the system names torch's cuda:index: its CUDA_VISIBLE_DEVICES entry (or index)."""
    listed = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
              if x.strip()]
    return listed[index] if index < len(listed) else str(index)


def bind_rank_device(cfg, roles, world) -> torch.device:
    """rank_device as a torch.device."""
    import torch
    return torch.device(rank_device(cfg, roles, world))


def rank_device(cfg, roles, world) -> str:
    """This rank's device, "cpu" or "cuda:i", from the roles (`roles[r]`: world rank r's, a
    tuple) and visible GPUs of every rank on its real node (collective on `world`; every
    rank reaches the same verdict). Binds CUDA to it; its env worker processes see only it,
    and MuJoCo's EGL renders on it (envs/egl.py). Imports torch only to bind CUDA (or, on a
    host with a GPU driver, to list the GPUs): a simulator rank on a CPU needs none."""
    from mpi4py import MPI

    from hpcvla.envs import env_uses_gpu

    rank = world.Get_rank()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    error, mine = None, None
    try:
        visible = visible_gpus(cfg.placement.gpus_per_node)
    except PlanError as err:
        error, visible = str(err), ()
    members = node.allgather((rank, visible))
    node.Free()
    if error is None:
        try:
            gpus = assign_node([roles[r] for r, _ in members],
                               [v for _, v in members], env_uses_gpu(cfg.env))
            mine = gpus[[r for r, _ in members].index(rank)]
        except PlanError as err:
            error = f"host {MPI.Get_processor_name()}: {err}"
    # learners share one collective backend (NCCL or gloo): all on GPUs or all on CPUs
    learner = LEARN in roles[rank]
    everyone = world.allgather((error, learner, mine is not None))
    errors = [e for e, _, _ in everyone if e]
    if not errors and len({gpu for _, is_learner, gpu in everyone if is_learner}) > 1:
        errors = ["some learner ranks see a GPU and some do not (CUDA_VISIBLE_DEVICES): they "
                  "must all train on GPUs or all on CPUs (placement.gpus_per_node=0)"]
    if errors:
        raise PlanError(errors[0])
    if mine is None:
        return "cpu"
    index = visible.index(mine)
    if not renders_only(roles[rank], cfg.env.name):
        import torch
        torch.cuda.set_device(index)  # creates this process's CUDA context there
    os.environ["HPCVLA_GPU"] = _system_gpu(index)  # env workers' CUDA_VISIBLE_DEVICES
    if simulator(cfg.env.name).egl:  # before MuJoCo is imported: it opens its EGL display then
        from hpcvla.envs.egl import choose_egl_device
        choose_egl_device(index)  # the rank's GPU as EGL numbers it; env workers inherit it
    return f"cuda:{index}"


def renders_only(roles, env_name: str) -> bool:
    """Whether a rank uses its GPU only to render through EGL (a simulator-only rank of
    LIBERO's MuJoCo): it then opens no CUDA context, which would hold ~0.5 GB of the GPU and
    fail on GPUs in EXCLUSIVE_PROCESS mode, where the inference rank sharing it holds one."""
    return tuple(roles) == (SIM,) and simulator(env_name).egl


def local_device(gpus_per_node: int = -1) -> torch.device:
    """A single process's device (`hpcvla eval`, benchmarks): the first visible GPU, else CPU."""
    import torch
    return torch.device("cuda", 0) if visible_gpus(gpus_per_node) else torch.device("cpu")


def peak_memory(device: torch.device | str) -> dict[str, int]:
    """This process's memory peaks so far, bytes: its host resident set (the kernel's
    ru_maxrss: every page it touched, a node's shared weight window included) and, on a GPU,
    the CUDA caching allocator's peaks of allocated and of reserved memory."""
    import resource
    out = {"host_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # KiB
    if str(device).startswith("cuda"):
        import torch
        out["gpu_allocated"] = torch.cuda.max_memory_allocated(device)
        out["gpu_reserved"] = torch.cuda.max_memory_reserved(device)
    return out


class HostStaging:
    """Host buffers that batches are gathered into before they go to `device`: page-locked
    when the device is a GPU (the copy then runs by DMA, asynchronously), plain numpy on the
    CPU. A buffer is reused for the next batch, so a batch must have been consumed (the
    forward pass synchronises when its outputs come back to the host) before the next."""

    def __init__(self, device: torch.device):
        import torch
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}

    def gather(self, key: str, parts: list[np.ndarray]) -> np.ndarray:
        """`parts` concatenated along axis 0, into this key's staging buffer."""
        if not self.pinned:
            return np.concatenate(parts)
        rows = sum(len(p) for p in parts)
        shape, dtype = (rows, *parts[0].shape[1:]), parts[0].dtype
        need = int(np.prod(shape)) * dtype.itemsize
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < need:
            import torch
            buf = self._buffers[key] = torch.empty(need, dtype=torch.uint8).pin_memory()
        out = buf[:need].numpy().view(dtype).reshape(shape)
        return np.concatenate(parts, out=out)

    def to_device(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Tensors on the device (CPU: sharing the arrays' memory)."""
        import torch
        with warnings.catch_warnings():  # read-only received arrays: never written to
            warnings.filterwarnings("ignore", message=".*not writable.*")
            return {k: torch.as_tensor(a).to(self.device, non_blocking=self.pinned)
                    for k, a in arrays.items()}
