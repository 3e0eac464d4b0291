"""What every rank does around its role: check the world, build the plan and communicators,
run, and take the whole job down loudly if this rank fails.

    run_ranks(cfg, main)   # main(cfg, plan, comms) runs on every rank of COMM_WORLD
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from hpcvla.config import ConfigError, write_run_config
from hpcvla.job import provenance
from hpcvla.metrics import phases
from hpcvla.process import deathwatch, heap, preempt
from hpcvla.process.deathwatch import Refused
from hpcvla.process.mpi_select import THREAD_LEVEL_FIX, LaunchError, thread_level_problem
from hpcvla.process.watchdog import reminding
from hpcvla.topology.plan import PlanError, rank_named
from hpcvla.transport.backoff import idle_barrier, idle_bcast


def or_abort_the_world(command: str, start) -> int:
    """`start()`: `hpcvla COMMAND` on a rank of a world (its checks, then run_ranks or
    run_guarded, which begin with agreed_start). Where this rank's own checks refuse (a
    ConfigError, PlanError or LaunchError, or Refused: cli.py's refusals), the world hears it
    in agreed_start and ends with one message, exit 2, every rank ending MPI rather than
    aborting it (as on any verdict every rank reached: _refused). Any other failure outside
    the roles' run names the rank, its host and the error and aborts the world. Either way no
    rank waits for this one forever (in MPI_Init, or its first collective)."""
    try:
        code = start()
    except (ConfigError, PlanError, LaunchError, Refused) as err:
        from mpi4py import MPI
        try:
            agreed_start(MPI.COMM_WORLD, str(err))
        except Refused as verdict:
            code = _refused(MPI.COMM_WORLD, verdict, command)
        else:
            raise  # (agreed_start raises on a failure)
    except Exception as err:  # noqa: BLE001 - any other failure must take the world down
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank()
        deathwatch.abort_world(MPI.COMM_WORLD, rank, f"hpcvla {command}: rank {rank} (host "
                               f"{MPI.Get_processor_name()}) failed: {err!r}", 1,
                               traceback.format_exc())
        raise  # (abort_world ends this process)
    if code:  # every rank refused together (_refused): MPI ends here, not in the abort
        from mpi4py import MPI  # `python -m mpi4py` (both launchers) makes of exit status 2
        if not MPI.Is_finalized():
            MPI.Finalize()  # [dist]
    return code


def agreed_start(world, refusal: str | None = None) -> list[str]:
    """The first collective of every world (run_ranks, run_guarded), where the ranks whose own
    checks refused (`refusal`, or_abort_the_world) meet those whose passed: every rank's
    verdict and host to all. Returns the ranks' hosts; raises Refused, alike on every rank,
    where any rank refused: its message where every rank found the same, else each message
    with the ranks and hosts that found it (the others did not: a file on one node's own disk,
    one node's setup)."""
    from mpi4py import MPI

    said = world.allgather((refusal, MPI.Get_processor_name()))  # [dist]
    found: dict[str, list[str]] = {}
    for rank, (why, host) in enumerate(said):
        if why is not None:
            found.setdefault(why, []).append(f"{rank} ({host})")
    if len(found) == 1 and all(why is not None for why, _ in said):
        raise Refused(next(iter(found)))
    if found:
        raise Refused("only some ranks found a problem; the others passed the same checks\n"
                      + "\n".join(f"rank(s) {', '.join(ranks)}: {why}"
                                  for why, ranks in found.items()))
    return [host for _, host in said]


def run_ranks(cfg, main, check=None, command: str = "") -> int:
    """Run `main(cfg, plan, comms)` on this rank. A rank that raises aborts the world after
    printing its rank, roles, node and host; a layout that cannot work (or fails
    `check(cfg, plan)`), or a verdict `main` reaches on every rank (Refused), stops every
    rank with one message (from `hpcvla COMMAND`) and exit 2."""
    phases.mark("imports")
    from mpi4py import MPI

    from hpcvla.topology.comms import (build_communicators, check_scheduler_world,
                                       real_ranks_per_node)
    from hpcvla.topology.plan import plan_from_config

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    preempt.install()  # SIGTERM/SIGUSR1: stop after the next version, with a checkpoint
    heap.keep_freed_buffers()  # before the policy's and the envs' allocations
    try:
        agreed_start(world)  # [dist]
        _require_thread_multiple()
        if cfg.launch.check_scheduler:
            check_scheduler_world(world.Get_size())
        plan = plan_from_config(cfg.placement, world.Get_size(), real_ranks_per_node(world))
        if check is not None:  # one rank checks for all (seconds: a simulator's import)
            problem = idle_bcast(world, lambda: _problem(check, cfg, plan))  # [dist]
            if problem is not None:
                raise PlanError(problem)  # its message, on every rank
        comms = build_communicators(plan, world)  # [dist]
        phases.mark("communicators")
        deathwatch.register(rank, "+".join(plan.ranks[rank].roles), plan.ranks[rank].node,
                            MPI.Get_processor_name())
    except (PlanError, ConfigError, LaunchError, Refused) as err:  # every rank's same verdict
        return _refused(world, err, command)
    info = plan.ranks[rank]
    try:
        _or_abort(world, "+".join(info.roles), info.node, lambda: main(cfg, plan, comms))
    except Refused as err:  # every rank's verdict once the world knows its GPUs (prologue.py)
        deathwatch.finished(rank)
        return _refused(world, err, command)
    comms.free()
    deathwatch.finished(rank)
    preempt.ignore_from_now()
    return 0


def _refused(world, err: Exception, command: str) -> int:
    """Every rank, on the same verdict `err`: rank 0 says it once for the world, as
    `hpcvla COMMAND` says a refusal outside a world (cli.py)."""
    from mpi4py import MPI

    rank = world.Get_rank()
    if rank == 0:
        print(f"hpcvla {command}: {err}" if command else f"hpcvla: {err}", file=sys.stderr,
              flush=True)
    # Every rank leaves together, once rank 0 has said why, and the world's command ends MPI
    # (or_abort_the_world) instead of aborting it: mpiexec may drop output that it has not
    # yet forwarded when a world aborts (all of an aborting rank's, once, on a loaded machine).
    try:
        idle_barrier(world, timeout=10.0)  # [dist]
    except TimeoutError:  # a rank gone elsewhere: the world cannot end together
        deathwatch.abort_world(world, rank, f"hpcvla: rank {rank} (host "
                               f"{MPI.Get_processor_name()}): not every rank reached this "
                               f"verdict within 10 s: {err}", 2)
    return 2


def _problem(check, cfg, plan) -> str | None:
    """What `check(cfg, plan)` refuses, as its message; None if nothing."""
    try:
        check(cfg, plan)
    except (PlanError, ConfigError) as err:
        return str(err)
    return None


def _require_thread_multiple() -> None:
    """LaunchError where this process's MPI is below MPI_THREAD_MULTIPLE."""
    problem = thread_level_problem()
    if problem is not None:
        raise LaunchError(f"{problem}: {THREAD_LEVEL_FIX}")


def run_guarded(world, role: str, main, command: str, threads: bool = False) -> int:
    """Run `main()` on every rank of `world`, each in one `role` (e.g. `hpcvla sft`'s
    learners): a rank that raises aborts the world, as in run_ranks; one that raises
    Refused, as every rank does then, ends it with one message (from `hpcvla COMMAND`) and
    exit 2. Else the exit status `main()` returns (0 for none). `threads`: `main` calls MPI
    from threads beside the main thread's (Horovod's background thread), which only
    MPI_THREAD_MULTIPLE allows: refused below it."""
    try:
        hosts = agreed_start(world)  # [dist]
        if threads:
            _require_thread_multiple()
    except (Refused, LaunchError) as err:  # a rank's own checks refused (or_abort_the_world)
        return _refused(world, err, command)
    node = node_numbers(hosts)[world.Get_rank()]
    deathwatch.register(world.Get_rank(), role, node, hosts[world.Get_rank()])
    try:
        code = _or_abort(world, role, node, main)
    except Refused as err:
        deathwatch.finished(world.Get_rank())  # an exit the launcher need not explain
        return _refused(world, err, command)
    deathwatch.finished(world.Get_rank())
    preempt.ignore_from_now()
    return code or 0


def node_numbers(hosts: list[str]) -> list[int]:
    """Each rank's node, from every rank's host: the hosts numbered as they first appear."""
    order = sorted(set(hosts), key=hosts.index)
    return [order.index(host) for host in hosts]


def _or_abort(world, role: str, node: int, main):
    """`main()`'s return; if it raises, print this rank's rank, role, node and host with the
    error and abort the world (every rank goes down within seconds, process/deathwatch.py)."""
    from mpi4py import MPI

    rank = world.Get_rank()
    try:
        return main()
    except BaseException as err:  # noqa: BLE001 - any failure must take the world down
        if isinstance(err, SystemExit) and not err.code or isinstance(err, Refused):
            raise
        from hpcvla.checkpoint.catalog import CheckpointError
        # a damaged or missing checkpoint says all in its message (the file and the fix); a
        # write that failed carries its cause (`from error`), whose traceback is wanted
        said_all = isinstance(err, CheckpointError) and err.__cause__ is None
        detail = "" if said_all else traceback.format_exc()
        deathwatch.abort_world(world, rank, f"hpcvla: "
                               f"{rank_named(rank, role, node, MPI.Get_processor_name())} "
                               f"failed: {err!r}", 1, detail)


def create_run_dir(cfg, world) -> Path:
    """Rank 0 makes `<root>/<name>-<time>` (unique), or takes the run being resumed; every
    rank gets the same path back."""
    if cfg.run.resume:
        return Path(cfg.run.resume).resolve()
    path = None
    if world.Get_rank() == 0:
        base = Path(cfg.run.root) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        path, n = base, 1
        while True:
            try:
                path.mkdir(parents=True)
                break
            except FileExistsError:
                n += 1
                path = base.with_name(f"{base.name}-{n}")
        path = str(path.resolve())
    return Path(world.bcast(path, root=0))  # [dist]


def claim_run(world, run_dir: Path, wait_s: float = 150.0) -> None:
    """Rank 0's hold on `run_dir` for the life of the world (checkpoint/catalog.hold_run: one
    world at a time writes a run), the others asleep meanwhile. A run another job's world
    holds is every rank's verdict (Refused: exit 2, which a job does not start again,
    jobs/launch.sh; as a failure its restarts would record themselves in the other job's
    run). One this job's earlier world holds (its rank 0's node died, and the file system
    keeps the dead node's lock) is this world's failure, as any other of a restart."""
    from hpcvla.checkpoint.catalog import RunInUse, hold_run  # no torch: rank 0 may simulate

    def hold() -> str | None:
        try:
            hold_run(run_dir, wait_s)
        except RunInUse as err:
            if err.by_this_job():
                raise
            return str(err)
        return None
    in_use = idle_bcast(world, hold)  # [dist]
    if in_use:
        raise Refused(in_use)


def record_run_start(cfg, run_dir: Path, who: str = "hpcvla") -> None:
    """Rank 0 of a run's world: the config it runs with and its software recorded in its
    directory; a resumed run says which settings and which software changed since it last
    ran (config/loader.py's write_run_config, job/provenance.py)."""
    changed = write_run_config(cfg, run_dir)
    if changed:
        print(f"[{who}] resumed with settings changed since the run last ran: "
              + "; ".join(changed), flush=True)
    other = provenance.record_start(run_dir)
    if other:
        print(f"[{who}] resumed with other software than the run last ran with: "
              + "; ".join(other), flush=True)


def train_main(cfg, plan, comms) -> None:
    """The main job: write the run directory, run the pipeline on every rank."""
    from hpcvla.roles.pipeline import run_pipeline

    world = comms.world
    run_dir = create_run_dir(cfg, world)
    claim_run(world, run_dir)  # [dist] no rank reads or writes the run before its lock is held
    if world.Get_rank() == 0:
        record_run_start(cfg, run_dir)
        (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
        print(f"run directory: {run_dir}", flush=True)  # the rank map follows, with devices
        deathwatch.register_run_dir(run_dir)
    idle_barrier(world)  # [dist] a rank failing from here on has the run's last words read
    run_pipeline(cfg, plan, comms, run_dir)
    leave_together(world, cfg.pipeline.stall_timeout_s)


def leave_together(world, stall_timeout_s: float) -> None:
    """Every rank at the end of its work (`train`'s, `sft`'s): the learners' gloo/NCCL threads
    end before anyone exits (a rank leaving while a peer's still talk to it, or a process
    whose threads outlive its interpreter, ends in std::terminate: seen in CI), then each
    waits for the others, saying so every `stall_timeout_s`. A rank that never imported torch
    (a simulator) has no process group."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()  # [dist]
    rank = world.Get_rank()
    with reminding(stall_timeout_s, lambda waited: f"hpcvla: rank {rank} has "
                   f"finished and waited {waited:.0f} s for the others to finish too"):
        idle_barrier(world)  # [dist]
