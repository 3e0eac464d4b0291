"""Host memory of a simulator rank's envs, from measurements on the 2-core CPU machine: the
resident memory a process gains making the envs, resetting them and taking three steps
(docs/memory.md). An env family costs a first env (its libraries, renderer and first
task's assets), each further env, and (LIBERO) each further task a process renders; a shard
in a worker process (env.isolation=process) pays its own first env. A simulator rank imports
no torch of its own, so a family whose simulator imports it (ManiSkill) pays it here.
ManiSkill's GPU simulation keeps its scenes on the GPU and is not modelled (nothing
counted)."""

from __future__ import annotations

MIB = 2 ** 20
# env name -> (first env, each further env, each further task), bytes, CPU simulation
MEASURED = {"reach": (1 * MIB, 0, 0),
            "maniskill": (771 * MIB, 8 * MIB, 0),  # PickCube-v1, 64 px camera, torch included
            "libero": (1584 * MIB, 460 * MIB, 555 * MIB)}  # libero_spatial, 64 px, 2 cameras
SUITE_TASKS = {"libero_90": 90}  # the other suites have 10


def simulator_bytes(env) -> int:
    """Host bytes of one simulator rank's envs (`env`: the config's env section); 0 where
    not modelled."""
    if env.name not in MEASURED or env.sim_backend == "gpu":
        return 0
    first, per_env, per_task = MEASURED[env.name]
    processes = env.shards if env.isolation == "process" else 1
    envs = max(1, env.envs_per_simulator // processes)
    tasks = 1
    if per_task and env.suite_task < 0:  # a process's envs take the suite's tasks in turn
        tasks = min(envs, SUITE_TASKS.get(env.suite, 10))
    return processes * (first + (envs - 1) * per_env + (tasks - 1) * per_task)


__all__ = ["MEASURED", "simulator_bytes"]
