"""DeepSpeed ZeRO as the learners' data-parallel engine (`learner.backend: deepspeed`)."""

from __future__ import annotations

import os
import socket
import sys
import types
import warnings

import torch

from hpcvla.engines.base import adamw


def deepspeed_engine(cfg, policy, learners_comm, device: torch.device | None = None):
    """DeepSpeed's engine on the learner communicator only (initialising torch.distributed on
    all ranks makes ZeRO-3 barrier the whole world): learner 0 picks a port, all join by NCCL
    when the learners are on GPUs, by gloo on CPUs. `device` is this rank's (devices.py):
    DeepSpeed puts the model on GPU LOCAL_RANK, so LOCAL_RANK is that GPU's index, whatever
    the launcher's own variables say. A policy whose trained parameters are bf16 trains under
    DeepSpeed's `bf16` section: fp32 master weights in the optimizer at every ZeRO stage. The
    section casts every parameter of the module to bf16, frozen ones included, so it is off
    where only frozen parameters are bf16 (DSRL: a frozen bf16 flow policy under float32 SAC
    heads, whose target critics' Polyak steps and Q values bf16 would round away)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    deepspeed = lean_deepspeed(device)
    rank, size = learners_comm.Get_rank(), learners_comm.Get_size()
    local = str(device.index or 0)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=local)
    if "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ:  # DeepSpeed asserts the two agree; the
        os.environ["OMPI_COMM_WORLD_LOCAL_RANK"] = local  # device map, not Open MPI, decides
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not torch.distributed.is_initialized():  # a process's first engine (tests build more)
        from deepspeed.constants import default_pg_timeout
        store = rendezvous(learners_comm)  # [dist]
        os.environ.update(MASTER_ADDR=store.host, MASTER_PORT=str(store.port))
        torch.distributed.init_process_group(  # [dist] DeepSpeed then takes this group
            backend, store=store, rank=rank, world_size=size, timeout=default_pg_timeout,
            **({"device_id": device} if device.type == "cuda" else {}))
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)  # [dist]
    bf16 = any(p.dtype == torch.bfloat16 for p in policy.parameters() if p.requires_grad)
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.learner.micro_batch,
        "gradient_accumulation_steps": cfg.learner.micro_batches,
        "zero_optimization": {"stage": cfg.learner.zero_stage, **(
            {"offload_optimizer": {"device": "cpu", "pin_memory": device.type == "cuda"}}
            if cfg.learner.offload_optimizer else {})},
        # bf16 gradients are summed over micro-batches and learners in bf16 (DeepSpeed's
        # default): the sum's relative error grows from bf16's 0.2 % to 0.4 % at 8 micro-
        # batches (0.7 % at 32), far under a policy gradient's sampling noise. fp32 sums
        # (data_types.grad_accum_dtype) would hold a whole fp32 gradient on every learner at
        # ZeRO-1 (DeepSpeed's BF16_Optimizer: +13 GB for π0) and are refused at stage 0.
        "bf16": {"enabled": bf16},
        "gradient_clipping": cfg.algorithm.max_grad_norm,  # DeepSpeed's default is 1.0
        "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
        "zero_force_ds_cpu_optimizer": False,  # offload steps torch's fused AdamW (base.adamw)
    }
    engine, *_ = deepspeed.initialize(model=policy.to(device),  # [dist]
                                      optimizer=adamw(cfg, policy), config=ds_config)
    return engine


def rendezvous(learners_comm) -> torch.distributed.TCPStore:
    """Collective on the learners: torch's rendezvous store, served by learner 0 on a port
    the kernel gives it as it binds (port 0), which the others are told through MPI. A port
    probed free, closed and bound again later could be taken in between by anything on a
    shared node (another job's learner 0)."""
    from deepspeed.constants import default_pg_timeout
    rank, size = learners_comm.Get_rank(), learners_comm.Get_size()
    hosts = learners_comm.allgather(socket.gethostname())  # [dist]
    store, address = None, None
    if rank == 0:
        host = rendezvous_host(hosts[0], hosts[1:]) if size > 1 else "127.0.0.1"
        store = torch.distributed.TCPStore(host, 0, size, is_master=True,
                                           timeout=default_pg_timeout, wait_for_workers=False)
        address = (host, store.port)
    host, port = learners_comm.bcast(address, root=0)  # [dist]
    return store or torch.distributed.TCPStore(host, port, size, is_master=False,
                                               timeout=default_pg_timeout)


def lean_deepspeed(device: torch.device) -> types.ModuleType:
    """DeepSpeed, imported and set up for a learner on `device` without what hpcvla's learners
    never use: Muon's compiled kernels (without_muon_kernels) and the CPU shared-memory op
    (without_shared_memory_op); and without torch's deprecation warnings of the collectives
    ZeRO calls (all_gather_into_tensor, reduce_scatter_tensor: dozens in every ZeRO-3 run's
    log, none the user's to act on). Every DeepSpeed engine hpcvla builds starts from here. A CPU
    learner names DeepSpeed's CPU accelerator, which DeepSpeed picks as it is imported: on a
    machine with GPUs it would otherwise move the model to a GPU, and on one without it warns
    in every run's log that it found none."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for collective in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=f"`torch.distributed.{collective}` is deprecated")
    without_muon_kernels()
    import deepspeed

    without_shared_memory_op()
    return deepspeed


SHARED_MEMORY_OP = "deepspeed_shm_comm"


def without_shared_memory_op() -> None:
    """DeepSpeed's communication backend, as it starts on CPU, JIT-compiles a shared-memory
    all-reduce op that only its inference all-reduce uses (training's collectives are
    torch.distributed's): ~80 s of a first run on 2 cores, a compiler and ninja needed, and a
    build killed mid-way leaves a lock file every later run waits on forever. Marked as not
    compatible with this machine (DeepSpeed's own probe result, cached in `deepspeed.ops`),
    the op is neither built nor loaded (DeepSpeed's CUDA accelerator has no such op)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHARED_MEMORY_OP] = False


MUON_KERNELS = "deepspeed.runtime.zero.muon.original_muon"


def without_muon_kernels() -> None:
    """DeepSpeed's ZeRO engine imports its Muon optimizer's kernels at start (to ask whether
    the client's optimizer is Muon) and in ZeRO-1/2's gradient copies, and that module runs
    torch.compile as it is imported: ~2 s of CPU per learner start for an optimizer hpcvla
    never builds (base.adamw). A stand-in module with its three names answers every question
    DeepSpeed asks of a non-Muon optimizer the same way; its functions, which DeepSpeed calls
    only for Muon's parameters, raise."""
    if MUON_KERNELS in sys.modules:
        return

    def muon_only(*args, **kwargs):
        raise RuntimeError("hpcvla builds no Muon optimizer (engines/zero.py)")

    stand_in = types.ModuleType(MUON_KERNELS, "hpcvla: Muon's names alone (engines/zero.py)")
    setattr(stand_in, "MuonWithAuxAdam", type("MuonWithAuxAdam", (torch.optim.Optimizer,), {}))
    setattr(stand_in, "muon_update", muon_only)
    setattr(stand_in, "adam_update", muon_only)
    sys.modules[MUON_KERNELS] = stand_in


def rendezvous_host(own: str, peers: list[str]) -> str:
    """The address the other learners reach learner 0 at (torch.distributed's TCP store):
    $HPCVLA_LEARNER_ADDR when set (an address or name of this host on the fabric the
    learners share); else the local address of the route to the first learner on another
    host (a UDP socket's connect sends nothing), which a hostname resolving to a management
    network or to Debian's 127.0.1.1 would not be; else `own`, the hostname."""
    override = os.environ.get("HPCVLA_LEARNER_ADDR", "").strip()
    if override:
        return override
    for peer in peers:
        if peer == own:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:
                route.connect((peer, 9))
                return route.getsockname()[0]
        except OSError:  # the peer's name does not resolve here: the hostname it is
            break
    return own
