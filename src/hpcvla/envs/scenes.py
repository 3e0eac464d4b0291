"""One compiled MuJoCo model and one renderer per robosuite scene and process, shared by every
env of this process that loads that scene (LIBERO's envs).

robosuite compiles each env's scene from the XML it generates (`MjModel.from_xml_string`: ~3 s
for a LIBERO scene's first compile on one CPU core, ~1.1 s each after). Every env of a task
generates the same XML, and so do all the tasks of libero_spatial and of libero_goal (one scene
each; libero_object has 10, libero_10 9, libero_90 20: SCENES, counted from robosuite's XML of
every task). So the first env of a scene compiles it, and every env, that one included,
simulates its own copy of the compiled model (~0.25 s, and ~150 MB less resident than a compile
leaves): its own, as robosuite changes a model's parameters (fixtures' poses at every reset).
The renderer (~1 s to make, ~550 MB on CPU rendering) is shared by the scene's envs: it draws
any of them from that env's model and data (LIBERO changes an env's model as it runs: its
stove's flame is a site's colour); its GL context holds what all of them share, meshes and
textures.

    install()                              # robosuite's MjSim.from_xml_string comes here
    renderer, option = acquire(sim, size)  # an env's scene's renderer; counts the env in
    release(sim)                           # the scene's last env frees its model, renderer
"""

from __future__ import annotations

import copy
import hashlib

# distinct scenes among each LIBERO suite's tasks: what a process renders at most with
# env.suite_task=-1 (memory/simulators.py)
SCENES = {"libero_spatial": 1, "libero_object": 10, "libero_goal": 1, "libero_10": 9,
          "libero_90": 20,
          # LIBERO-PRO's: moving or swapping objects or rewording keeps a suite's scenes; new
          # objects give libero_goal 9 and libero_10 a scene per task
          "libero_spatial_object": 1, "libero_spatial_swap": 1, "libero_spatial_lan": 1,
          "libero_spatial_task": 1, "libero_object_object": 10, "libero_object_swap": 10,
          "libero_object_lan": 10, "libero_object_task": 10, "libero_goal_object": 9,
          "libero_goal_swap": 1, "libero_goal_lan": 1, "libero_goal_task": 1,
          "libero_10_object": 10, "libero_10_swap": 9, "libero_10_lan": 9,
          "libero_10_task": 9}

_scenes: dict[str, dict] = {}  # XML digest -> {"model", "users", "renderers": {size: (r, o)}}
_SCENE_OF = "_hpcvla_scene"  # the attribute of a robosuite MjSim naming its scene


def install() -> None:
    """Route robosuite's scene compilation through the shared models (idempotent)."""
    from robosuite.utils.binding_utils import MjSim
    if getattr(MjSim.from_xml_string, "__func__", None) is not _from_xml_string:
        MjSim.from_xml_string = classmethod(_from_xml_string)


def _from_xml_string(cls, xml: str):
    """robosuite's `MjSim.from_xml_string`: a simulation of its own copy of the scene's
    compiled model, compiled here only for the scene's first env."""
    import mujoco
    key = hashlib.sha1(xml.encode()).hexdigest()
    if key not in _scenes:  # kept with no users until an env acquires it or another compiles
        _drop_unused()
        _scenes[key] = {"model": mujoco.MjModel.from_xml_string(xml), "users": 0,
                        "renderers": {}}
    sim = cls(copy.deepcopy(_scenes[key]["model"]))
    setattr(sim, _SCENE_OF, key)
    return sim


def acquire(sim, size: int):
    """The renderer (size x size) and scene option of `sim`'s scene; `sim`'s env counts as a
    user of the scene until `release(sim)`."""
    import mujoco
    scene = _scenes[getattr(sim, _SCENE_OF)]
    scene["users"] += 1
    if size not in scene["renderers"]:
        option = mujoco.MjvOption()
        option.geomgroup[0] = 0  # collision geoms hidden, as robosuite's cameras do
        # from this env's model, not the compiled one: robosuite sets visual parameters after
        # compiling; each draw then takes the drawn env's own (envs/libero.py)
        scene["renderers"][size] = (mujoco.Renderer(sim.model._model, size, size), option)
    return scene["renderers"][size]


def release(sim) -> None:
    """`sim`'s env no longer uses its scene: the last one frees its renderers and model."""
    key = getattr(sim, _SCENE_OF)
    _scenes[key]["users"] -= 1
    if _scenes[key]["users"] == 0:
        for renderer, _ in _scenes[key]["renderers"].values():
            _close(renderer)
        del _scenes[key]


def _close(renderer) -> None:
    """Close a renderer in its own GL context: `mujoco.Renderer.close()` frees its framebuffers
    and textures by id in whichever context is current, i.e. another renderer's, whose images
    are noise from then on (the ids coincide across contexts)."""
    if renderer._gl_context is not None:
        renderer._gl_context.make_current()
    renderer.close()


def _drop_unused() -> None:
    """Forget scenes compiled for envs that never acquired them (their construction failed)."""
    for key in [k for k, scene in _scenes.items() if scene["users"] == 0]:
        del _scenes[key]
