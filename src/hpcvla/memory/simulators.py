"""Host memory of a simulator rank's envs, from measurements on the 2-core CPU machine: the
resident memory a process gains making the envs, resetting them and taking three steps
(docs/memory.md). An env family costs a first env (its libraries, renderer and first
scene's assets), each further env, and (LIBERO) each further scene a process renders (its
compiled model and renderer, shared by the scene's envs: envs/scenes.py); a shard
in a worker process (env.isolation=process) pays its own first env. A simulator rank imports
no torch of its own, so a family whose simulator imports it (ManiSkill) pays it here.
ManiSkill's GPU simulation keeps its scenes on the GPU and is not modelled (nothing
counted)."""

from __future__ import annotations

from hpcvla.envs.scenes import SCENES

MIB = 2 ** 20
# env name -> (first env, each further env, each further scene), bytes, CPU simulation
MEASURED = {"reach": (1 * MIB, 0, 0),
            "maniskill": (771 * MIB, 8 * MIB, 0),  # PickCube-v1, 64 px camera, torch included
            # libero_spatial (first env, further envs) and libero_object (further scenes),
            # 64 px, 2 cameras
            "libero": (1837 * MIB, 268 * MIB, 995 * MIB)}


def simulator_bytes(env, shards: int) -> int:
    """Host bytes of one simulator rank's envs (`env`: the config's env section) in `shards`
    shards (the mode's: schedule.shards_of); 0 for a GPU simulation (not modelled)."""
    if env.sim_backend == "gpu":
        return 0
    first, per_env, per_scene = MEASURED[env.name]
    processes = shards if env.isolation == "process" else 1
    envs = max(1, env.envs_per_simulator // processes)
    scenes = 1
    if per_scene and env.suite_task < 0:  # a process's envs take the suite's tasks in turn
        scenes = min(envs, SCENES[env.suite])
    return processes * (first + (envs - 1) * per_env + (scenes - 1) * per_scene)


__all__ = ["MEASURED", "simulator_bytes"]
