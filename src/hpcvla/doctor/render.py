"""The simulators' renderers on this node: a tiny scene drawn as the simulator draws it, and
for EGL on GPUs a device of each GPU the ranks render on."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from hpcvla.config.families import simulator
from hpcvla.doctor.checks import Check, last_line, run_python

RENDER = {  # a tiny scene drawn the way the simulator draws (MuJoCo's EGL, SAPIEN's Vulkan)
    "libero": ("EGL (MuJoCo)", "import mujoco\n"
               "m = mujoco.MjModel.from_xml_string('<mujoco><worldbody><light pos=\"0 0 1\"/>"
               "<geom size=\".1\"/></worldbody></mujoco>')\n"
               "d = mujoco.MjData(m); mujoco.mj_forward(m, d)\n"
               "r = mujoco.Renderer(m, 16, 16); r.update_scene(d); assert r.render().max() > 0",
               "EGL for headless rendering: the NVIDIA driver's libEGL_nvidia on GPU nodes, "
               "Mesa's EGL elsewhere (`make install-sims`); or MUJOCO_GL=osmesa (CPU)"),
    "maniskill": ("Vulkan (SAPIEN)", "import sapien\n"
                  "s = sapien.Scene(); s.set_ambient_light([0.5, 0.5, 0.5])\n"
                  "b = s.create_actor_builder(); b.add_box_visual(half_size=[0.1] * 3)\n"
                  "b.build_kinematic(); c = s.add_camera('doctor', 16, 16, 1.0, 0.01, 10.0)\n"
                  "c.set_entity_pose(sapien.Pose([-1, 0, 0])); s.update_render()\n"
                  "c.take_picture(); assert c.get_picture('Color')[..., :3].max() > 0",
                  "a Vulkan driver: the NVIDIA driver's ICD (nvidia_icd.json) on GPU nodes, "
                  "Mesa's lavapipe elsewhere (`make install-sims`)"),
}


# Backends a user may choose instead (the library, its variable, what each needs): MuJoCo's
# other than EGL that LIBERO renders with (robosuite, imported, makes any other MUJOCO_GL egl,
# EGL and typos included)
CHOSEN_BACKENDS = {"libero": ("MuJoCo", "MUJOCO_GL", {
    "osmesa": "Mesa's OSMesa library (libOSMesa), or MUJOCO_GL unset for EGL",
    "glx": "an X display (DISPLAY) with GLX; headless nodes: MUJOCO_GL unset (EGL)"})}


def renderer_checks(cfg) -> list[Check]:
    if simulator(cfg.env.name).emulated:  # numpy's pixels (reach)
        return [Check("renderer", True, f"env.name={cfg.env.name} renders nothing")]
    what, code, fix = RENDER[cfg.env.name]
    library, variable, chosen = CHOSEN_BACKENDS.get(cfg.env.name, ("", "", {}))
    env = {}
    if variable:  # the backend the ranks render with: the one chosen, else the default
        backend = os.environ.get(variable, "")  # as robosuite compares it: case and all
        env[variable] = backend if backend in chosen else "egl"
        env["PYOPENGL_PLATFORM"] = os.environ.get("PYOPENGL_PLATFORM", env[variable])
        if backend in chosen:
            what, fix = f"{backend} ({library}, {variable})", chosen[backend]
    out = run_python(code, {**os.environ, **env})
    checks = [Check("renderer", out.returncode == 0, f"{what}: " + (
        "drew a 16x16 scene" if out.returncode == 0 else f"failed: {last_line(out)}"), fix)]
    if env.get(variable) == "egl":
        checks += _egl_gpus(cfg)
    if cfg.env.sim_backend == "gpu":  # (config/checks.py: a simulator with a GPU variant)
        libs = glob.glob(str(Path.home() / ".sapien" / "physx" / "*" / "libPhysXGpu_64.so"))
        checks.append(Check("physx-gpu", bool(libs), ", ".join(libs) or "no libPhysXGpu_64.so "
                            "under ~/.sapien/physx", "run one GPU simulation where the node "
                            "can download it (SAPIEN fetches it on first use), or copy "
                            "~/.sapien/physx from such a machine"))
    return checks


def _egl_gpus(cfg) -> list[Check]:
    """Where ranks render with EGL on their GPUs: an EGL device for each GPU torch sees here
    (envs/egl.py picks the one whose CUDA ordinal is the rank's). The scene above may be drawn
    by any EGL device, Mesa's software one included, on a node whose NVIDIA EGL library is
    missing, as in containers started without the driver's graphics capability: every rank
    given a GPU would then fail as it starts."""
    from hpcvla.devices import torch_gpu_count
    from hpcvla.envs import env_uses_gpu
    from hpcvla.envs.egl import egl_cuda_ordinals
    chosen = cfg.placement.gpus_per_node
    gpus = torch_gpu_count() if chosen < 0 else chosen  # the ranks' (the first k of them)
    if not gpus or not env_uses_gpu(cfg.env) or "MUJOCO_EGL_DEVICE_ID" in os.environ:
        return []  # (a device the user chose is the ranks' too: envs/egl.py)
    ordinals = egl_cuda_ordinals()
    missing = [g for g in range(gpus) if g not in ordinals]
    return [Check("egl-gpus", not missing, f"EGL lists {len(ordinals)} device(s), with CUDA "
                  f"ordinals {ordinals}, for the {gpus} GPU(s) torch sees" + (
                      f": none renders on CUDA device(s) {missing}" if missing else ""),
                  "the NVIDIA driver's EGL library (libEGL_nvidia, its vendor file "
                  "10_nvidia.json) on the node; in a container the driver's graphics "
                  "capability (NVIDIA_DRIVER_CAPABILITIES=all or compute,utility,graphics; "
                  "Apptainer --nv); or MUJOCO_GL=osmesa to render on the CPU")]
