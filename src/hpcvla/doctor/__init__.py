"""`hpcvla doctor [CONFIG]`: does this node have what a job of CONFIG needs? Checked for real
where it is cheap (a 2-rank MPI world, a tiny render), one line per check, each failure with
its fix; exit status 1 when any fails. jobs/launch.sh runs it on the job's first node before
starting the ranks, then `--node-only` on its other nodes at once, so a broken node fails the
job in seconds, saying why.

Checks: the MPI launcher starts one world with the library mpi4py loads (and, for Open MPI,
its one-sided components); /dev/shm has room for what the node's ranks share there (`train`'s
windows; with `--job sft`, the demonstrations' one copy); the GPUs torch sees
against what the scheduler granted, and NCCL where there are GPUs; the simulator's renderer
(EGL for LIBERO's MuJoCo, Vulkan for ManiSkill's SAPIEN) draws a tiny scene; the PhysX GPU
library for ManiSkill's GPU simulation; the config's files (checkpoints, pretrained folders,
tokenizers), packages and logins (preflight.config_problems); free disk under run.root for
the checkpoints kept; with the job's world (`--world`, `--ranks-per-node`: jobs/launch.sh
passes its own) whether its layout fits this node's GPUs' memory (the memory model, what
`hpcvla train --ranks`/`sft --ranks` refuse before starting a world).

`hpcvla doctor --job eval [--world N ...] -- RUN_DIR [flags] [key=value ...]` checks a node
for `hpcvla eval` of those arguments (the run's config as eval reads it, its --envs): MPI
(windows aside), GPUs, renderer, policy, files and memory.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from pathlib import Path

from hpcvla.config.loader import whole_number
from hpcvla.doctor.checks import Check, last_line, run_python
from hpcvla.doctor.render import renderer_checks
from hpcvla.transport.windows import MPI_OWN_SHM, shared_memory_free

MiB = 1 << 20


def add_doctor_parser(sub, config_args) -> None:
    """The `doctor` subcommand on the top-level parser's subparsers; `config_args` adds the
    CONFIG and key=value arguments every config-reading command takes."""
    doctor = sub.add_parser("doctor", help="check this node for what a job of CONFIG needs "
                            "(MPI, /dev/shm, GPUs, NCCL, rendering, memory, files, disk); "
                            "exit 1 on any failure")
    config_args(doctor, required=False)
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--job", choices=("train", "sft", "eval"), default="train",
                        help="its command; eval: that of `hpcvla eval` after `--` (RUN_DIR, "
                        "its flags, key=value ...)")
    doctor.add_argument("--world", type=whole_number(1), default=None, help="the job's "
                        "ranks: with it, "
                        "whether its layout fits this node's GPUs and host memory (without, "
                        "/dev/shm is checked for launch.ranks' layout)")
    doctor.add_argument("--ranks-per-node", type=whole_number(1), default=None,
                        help="the job's ranks per node (default: --world)")
    doctor.add_argument("--node-only", action="store_true", help="only what may differ "
                        "between a job's nodes (/dev/shm, renderer, EGL devices): "
                        "jobs/launch.sh's check of its other nodes")


def doctor_command(args) -> int:
    world = args.world and (args.world, args.ranks_per_node)
    if args.job != "eval":
        from hpcvla.config import load_config
        return main(load_config(args.config, args.overrides, job=args.job), args.json,
                    args.job, world, node_only=args.node_only)
    from hpcvla.checkpoint.catalog import run_and_checkpoint
    from hpcvla.evaluate import eval_config
    from hpcvla.roles.heldout import envs_at_once
    run = args.evaluation  # `hpcvla eval`'s arguments (cli.py parses them as eval does)
    cfg = eval_config(run_and_checkpoint(Path(run.run_dir))[0], run.overrides, run.untrained)
    return main(cfg, args.json, "eval", world, envs_at_once(cfg, run.envs, run.episodes),
                args.node_only)


def run_checks(cfg, job: str = "train", world: tuple[int, int | None] | None = None,
               envs: int = 32, node_only: bool = False) -> list[Check]:
    """Every check for a job of `cfg` running `job` (train, sft, eval) on this node, in the
    order a job needs them; `world`: the job's ranks and ranks per node, where known; `envs`:
    eval's per rank. Eval shares nothing in /dev/shm, makes no windows, and writes no
    checkpoints: those checks are train's and sft's. `node_only`: those of what a node has
    of its own (/dev/shm, renderer), for a job's nodes after its first passed every check
    (the file systems, MPI and the job's grant are one and the same on its nodes, and an srun
    step's GPUs may differ from the job's)."""
    from hpcvla.envs import env_problems
    from hpcvla.preflight import config_problems, run_root_problems

    if node_only:  # (the policy's size for train's windows alone)
        weights, _, recorded = _policy_size(cfg) if job == "train" else (0, 0, 0)
        return [*_shared_memory_checks(cfg, job, world, weights, recorded)[0],
                *renderer_checks(cfg)]
    last = ("sft.steps", cfg.sft.steps) if job == "sft" else ("pipeline.total_updates", None)
    problems = [p for p in config_problems(cfg, last) + env_problems(cfg)
                if p[0] != "placement.gpus_per_node"]  # the gpus check's
    problems += [] if job == "eval" else run_root_problems(cfg)  # eval writes no run
    unbuilt = []
    try:
        weights, trainable, recorded = _policy_size(cfg)
    except Exception as err:  # noqa: BLE001  said below; the sizes go on without the policy
        weights = trainable = recorded = 0
        if not problems:
            unbuilt = [Check("policy", False, f"cannot be built: {type(err).__name__}: {err}",
                             "`hpcvla config CONFIG` shows what the config resolves to")]
    demos, shm = 0, []
    try:  # /dev/shm's need is sized from the env's spec, which a config with problems may
        # not have (an unknown suite): the config check then says why
        shm, demos = _shared_memory_checks(cfg, job, world, weights, recorded)
    except Exception:  # noqa: BLE001
        if not problems:
            raise
    checks = [_mpi(cfg, windows=job != "eval"), *shm,
              *_gpus(cfg), *renderer_checks(cfg), *unbuilt]
    if world and not problems and not unbuilt:
        checks += _memory(cfg, job, world, demos, envs)
    checks.append(Check("config", not problems, "the config's files, packages and logins: "
                        + ("fine" if not problems else f"{len(problems)} problem(s)"),
                        "; ".join(f"{name} = {value!r}: expected {text}"
                                  for name, value, text in problems)))
    return checks if job == "eval" else [*checks, _disk(cfg, weights, trainable)]


def _mpi(cfg, windows: bool = True) -> Check:
    """The launcher starts 2 ranks that see one world of 2, with the library mpi4py loads;
    with `windows`, an Open MPI must have one-sided components that work across hosts."""
    from hpcvla.process.mpi_select import THREAD_LEVEL_FIX, MpiSelectError, select_mpi
    try:  # the MPI jobs/launch.sh chose, else the config's
        install = select_mpi(os.environ.get("HPCVLA_MPI_FLAVOUR", cfg.launch.mpi),
                             os.environ.get("HPCVLA_MPIEXEC", cfg.launch.mpiexec))
    except MpiSelectError as err:
        return Check("mpi", False, str(err), "`make install` (MPICH from PyPI), or load the "
                     "site's MPI module and set launch.mpi/launch.mpiexec")
    if windows and install.lacks_windows:
        return Check("mpi", False, f"Open MPI ({install.mpiexec}) has neither the ucx nor the "
                     "rdma one-sided component (ompi_info: mca:osc)", "an Open MPI built with "
                     "UCX (the site's module for InfiniBand), or HPCVLA_MPI=mpich")
    code = ("from mpi4py import MPI; w = MPI.COMM_WORLD; n = w.allreduce(1)\n"
            "from hpcvla.process.mpi_select import thread_level_problem\n"
            "if w.rank == 0: print(n, thread_level_problem() or "
            "MPI.Get_library_version().splitlines()[0].strip())")
    env = {**os.environ, **install.env, **install.here_env}  # on this node, as launch's
    out = run_python(code, env, 60, (install.mpiexec, "-n", "2", *install.args))
    words = out.stdout.split(maxsplit=1)
    if out.returncode != 0 or not words or words[0] != "2":
        found = (f"`{install.mpiexec} -n 2` started "
                 + ("two 1-rank worlds" if words and words[0] == "1" else "no world of 2")
                 + f": {last_line(out)}")
        return Check("mpi", False, found, "mpi4py must load the library of this launcher "
                     "(MPI4PY_LIBMPI for Open MPI); check `mpiexec -n 2 hostname` works here")
    if "MPI_THREAD_MULTIPLE" in words[1]:  # thread_level_problem's text
        return Check("mpi", False, words[1].strip(), THREAD_LEVEL_FIX)
    return Check("mpi", True, f"{install.flavour}: {install.mpiexec} -n 2 starts one world "
                 f"of 2 ({' '.join(words[1].split())[:60]})")


def _shared_memory_checks(cfg, job: str, world, weights: int,
                          recorded: int) -> tuple[list[Check], int]:
    """/dev/shm's check of `job` (none for eval, which shares nothing there) and the bytes of
    sft's demonstrations (their files' headers read once; 0 for the others)."""
    demos = _demonstrations(cfg) if job == "sft" else 0
    if job == "eval":
        return [], demos
    return [_shared_memory(cfg, weights, job, world, demos, recorded)], demos


def _demonstrations(cfg) -> int:
    """The bytes of `hpcvla sft`'s demonstrations' one copy per node (from their headers)."""
    from hpcvla.envs import env_spec
    from hpcvla.memory.sft_eval import demonstration_bytes
    return demonstration_bytes(cfg, env_spec(cfg.env))


def _shared_memory(cfg, weights: int, job: str = "train", world=None, demos: int = 0,
                   recorded: int = 0) -> Check:
    """Room in /dev/shm for what a node's ranks share there (and MPI's own): for
    `train` its weight window (two halves) and the rings of its learners (_node_learners), as
    the memory model counts them (memory/layout.py; `recorded`: the bytes a step of the
    policy's extra fields); for `sft` the one copy of its demonstrations (`demos` bytes)."""
    if job == "sft":
        what, need, fewer = "the demonstrations' one copy needs", demos, \
            "fewer demonstrations (sft.per_task)"
    else:
        rings = _node_learners(cfg, world) * _ring_bytes(cfg, recorded)
        what, need, fewer = "a node's windows need", 2 * weights + rings, \
            "smaller learner.ring_slots"
    need += MPI_OWN_SHM  # (the one room every check before a job leaves MPI)
    free = shared_memory_free()
    if free is None:
        return Check("/dev/shm", False, "cannot be read", "a node with a /dev/shm tmpfs (MPI's "
                     "shared-memory windows live there)")
    found = f"{free / MiB:,.1f} MiB free, {what} >= {need / MiB:,.1f} MiB"
    return Check("/dev/shm", free >= need, found, "a larger /dev/shm (e.g. `mount -o "
                 f"remount,size=...`; containers: --shm-size), or {fewer}")


def _ring_bytes(cfg, recorded: int) -> int:
    """A learner's ring as the memory model sizes it (memory/layout.ring_bytes), one producer
    a learner (the most each lane holds)."""
    from hpcvla.envs import env_spec
    from hpcvla.memory.layout import ring_bytes
    return ring_bytes(cfg, env_spec(cfg.env) if not cfg.learner.ring_slots else None, 1,
                      recorded)


def _node_learners(cfg, world=None) -> int:
    """The most learner ranks on one node of the job's `world` (ranks, ranks per node), else
    of the one `hpcvla train` starts here (launch.ranks), each with its ring in the node's
    /dev/shm; 1 where that layout cannot be planned (the config check says why)."""
    from hpcvla.topology.plan import LEARN, PlanError, plan_from_config
    try:
        plan = plan_from_config(cfg.placement, *(world or (cfg.launch.ranks,)))
    except PlanError:
        return 1
    nodes = [info.node for info in plan.ranks if LEARN in info.roles]
    return max(nodes.count(node) for node in set(nodes))


def _memory(cfg, job: str, world: tuple[int, int | None], demos: int = 0,
            envs: int = 32) -> list[Check]:
    """Whether the job's layout fits this node's GPUs (the memory model: train's plan,
    memory/layout.py, with sac/rlpd's replay buffers; sft's learners, a GPU each, and eval's
    ranks, `envs` envs each, memory/sft_eval.py), and its busiest node's host memory this
    node's (its ranks' policy builds, simulators' envs, the node's windows and rings, replay
    buffers; sft's demonstrations' one copy, `demos` bytes)."""
    from hpcvla.envs import env_spec
    from hpcvla.memory.host import host_bytes
    from hpcvla.memory.layout import layout_devices, layout_gpus, plan_memory
    from hpcvla.memory.sft_eval import eval_devices, eval_memory, sft_memory
    from hpcvla.memory.states import size
    from hpcvla.preflight import pipeline_problems
    from hpcvla.topology.plan import PlanError, plan_from_config
    ranks, per_node = world
    spec, per = env_spec(cfg.env), per_node or ranks
    nodes = [rank // per for rank in range(ranks)]
    try:
        if job == "sft":
            memory = sft_memory(cfg, nodes, layout_gpus(cfg), spec, shared=demos)
        elif job == "eval":  # every node's ranks on its GPUs as eval_devices puts them
            node = eval_devices(cfg, per, layout_gpus(cfg))
            memory = eval_memory(cfg, {r: node[r % per] for r in range(ranks)}, envs, spec,
                                 nodes)
        else:
            plan = plan_from_config(cfg.placement, ranks, per_node)
            refused = pipeline_problems(cfg, plan)  # what train refuses on this layout
            if refused:
                raise PlanError("; ".join(f"{name} = {value!r}: expected {text}"
                                          for name, value, text in refused))
            memory = plan_memory(cfg, plan, layout_devices(cfg, plan), spec)
    except PlanError as err:
        return [Check("layout", False, f"{ranks} rank(s), {per_node or ranks} per node: {err}",
                      "a layout `hpcvla plan CONFIG --world N --ranks-per-node M` accepts")]
    problems = memory.problems
    found = f"{ranks} rank(s), {per_node or ranks} per node, {layout_gpus(cfg)} GPU(s) each: " \
        + ("does not fit" if problems else "fits")
    node, parts = max(memory.per_node_host().items(), key=lambda kv: sum(kv[1].values()))
    need, capacity = sum(parts.values()), host_bytes()
    largest = ", ".join(f"{k} {size(v)}" for k, v in
                        sorted(parts.items(), key=lambda kv: -kv[1])[:3])
    return [Check("memory", not problems, found, "; ".join(
                f"{name} = {value!r}: expected {text}" for name, value, text in problems)),
            Check("host memory", need <= capacity, f"the memory model puts {size(need)} on "
                  f"node {node} of the job, this node has {size(capacity)} ({largest})",
                  "fewer ranks per node (simulators' envs: env.envs_per_simulator, "
                  "placement.per_node), or nodes with more memory")]


def _gpus(cfg) -> list[Check]:
    import torch

    from hpcvla.devices import granted_gpus, missing_gpus_problem
    missing = missing_gpus_problem(cfg.placement.gpus_per_node)
    count = torch.cuda.device_count()
    found = f"torch sees {count} GPU(s); granted: {granted_gpus() or 'none'}"
    checks = [Check("gpus", missing is None, found, missing or "")]
    if count:
        try:
            version = ".".join(map(str, torch.cuda.nccl.version()))
            checks.append(Check("nccl", True, f"NCCL {version}"))
        except (RuntimeError, AttributeError) as err:
            checks.append(Check("nccl", False, f"torch has no NCCL: {err}", "a CUDA build "
                                "of torch with NCCL (the learners' collectives on GPUs)"))
    return checks


def _policy_size(cfg) -> tuple[int, int, int]:
    """The policy's weights in bytes (in the dtype `policy.dtype=auto` gives on this node: bf16
    where torch sees a GPU), its trained parameters, and the bytes it records a step (its
    extra fields), built on the meta device (nothing allocated)."""
    import torch

    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    from hpcvla.memory.states import fields_bytes
    policy = build_policy(cfg, env_spec(cfg.env), "meta", torch.cuda.is_available())
    params = list(policy.parameters())
    return sum(p.numel() * p.element_size() for p in params), \
        sum(p.numel() for p in params if p.requires_grad), fields_bytes(policy.extra_fields())


def _disk(cfg, weights: int, trainable: int) -> Check:
    """Room under run.root for the checkpoints kept (and the one being written): the weights
    and the trained parameters' states each (memory/states.checkpoint_disk_bytes)."""
    from hpcvla.memory.states import checkpoint_disk_bytes
    root = Path(cfg.run.root).resolve()
    existing = next((p for p in (root, *root.parents) if p.exists()), Path("/"))
    need = (cfg.learner.checkpoint_keep + 1) * checkpoint_disk_bytes(weights, trainable)
    free = shutil.disk_usage(existing).free
    found = (f"{free / MiB:,.0f} MiB free under {existing}, {cfg.learner.checkpoint_keep} + 1 "
             f"checkpoints need ~{need / MiB:,.0f} MiB (free as the file system says: a "
             "quota may allow less, `lfs quota -u $USER DIR`, `mmlsquota`, `quota -s`)")
    if root.is_relative_to(Path.home().resolve()) and need > 10 * 2**30:  # (a checkout's runs/)
        found += ("; run.root is in your home folder, which sites often cap at tens of GB "
                  "and back up: checkpoints this size belong on a scratch file system "
                  "(HPCVLA_RUNS=$SCRATCH/runs for the job scripts)")
    return Check("disk", free >= need, found, "a run.root on a larger (scratch) file system, "
                 "or a smaller learner.checkpoint_keep")


def main(cfg, as_json: bool, job: str = "train", world=None, envs: int = 32,
         node_only: bool = False) -> int:
    checks = run_checks(cfg, job, world, envs, node_only)
    if as_json:
        import json
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        print("\n".join(c.line() for c in checks))
    return 0 if all(c.ok for c in checks) else 1
