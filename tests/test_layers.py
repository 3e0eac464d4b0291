"""The architecture, as a test: hpcvla is built in floors, and a module imports only from its
own floor or the floors below it.

    8  cli, __main__                      the commands
    7  bench, eval_command                benchmarks: run the layers below and measure them;
                                          `hpcvla eval`'s command: what to evaluate, where
    6  job, imitation, evaluate, export,  a whole job: start the world, run it, restart it;
       scale, doctor                      record an expert's demonstrations, fine-tune on
                                          them; evaluate, export, plan a scale-out, check a
                                          node
    5  roles                              the per-rank loops: simulator, inference, learner
    4  factory, engines, preflight,       build what a role runs (envs, policies, engines);
       weight_checks, memory              check files, packages, checkpoints, the weights
                                          a run is given, and memory before a run
    3  envs, policies, algorithms,        the parts: simulators, models, losses, metrics,
       metrics, devices, checkpoint,      devices, checkpoints, SFT demonstrations
       demonstrations
    2  transport, seeds, process          the process machinery: rings and records over MPI,
                                          seeds, which MPI, liveness, signals
    1  config, topology, schedule         what a run is: settings, the rank plan and its
                                          communicators, the modes' schedules
    0  hpcvla (the package), text,        leaves
       emulate, files

A module's floor is that of its top-level name under hpcvla (hpcvla.roles.learner is on
`roles`' floor 5). The rules, checked on every module under src/hpcvla, function-local
(lazy) imports included:
  * no import of a higher floor;
  * no import cycle between modules. `from a.b import c` depends on the module a.b.c if there
    is one, else on a.b (for a package: its __init__); a package's __init__ is one module;
  * no module over 420 lines;
  * none of the pairs in FORBIDDEN, though the floors allow them (same floor or downward);
  * floor 1 is pure: no torch, and MPI (mpi4py) only where the communicators are built.
A new top-level module or package needs a floor here before it can be imported anywhere.
"""

import re
import ast
from pathlib import Path

import pytest

from helpers import ROOT

FLOORS = {
    0: ("hpcvla", "text", "emulate", "files"),
    1: ("config", "topology", "schedule"),
    2: ("transport", "seeds", "process"),
    3: ("envs", "policies", "algorithms", "metrics", "devices", "checkpoint", "demonstrations"),
    4: ("factory", "engines", "preflight", "weight_checks", "memory"),
    5: ("roles",),
    6: ("job", "imitation", "evaluate", "export", "scale", "doctor"),
    7: ("bench", "eval_command"),
    8: ("cli", "__main__"),
}
FLOOR_OF = {name: floor for floor, names in FLOORS.items() for name in names}
MAX_LINES = 420
# (importer, imported): dependencies the floors allow and the design does not
FORBIDDEN = {
    ("envs", "transport"): "a simulator does not know how its data travels",
    ("policies", "transport"): "a model runs the same in any process, without MPI",
    ("algorithms", "transport"): "a loss is tensors in, tensors out, without MPI",
    ("policies", "envs"): "a model meets a simulator only through the spec it is built for",
    ("envs", "policies"): "a simulator meets a model only through the spec it is built for",
    ("algorithms", "envs"): "a loss sees recorded segments, never a simulator",
    ("algorithms", "policies"): "a loss is given the policy's outputs, not the model",
    ("config", "topology"): "the settings are read before any rank plan exists",
}
# floor 1 describes a run; only topology/comms.py turns the plan into communicators
PURE_EXCEPT = {"mpi4py": {"hpcvla.topology.comms"}, "torch": set()}

SRC = ROOT / "src"
PACKAGE = SRC / "hpcvla"


def module_of(path: Path) -> str:
    """src/hpcvla/roles/learner.py -> hpcvla.roles.learner; a package's __init__.py -> the
    package's name."""
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_of(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def top_name(module: str) -> str:
    """hpcvla.roles.learner -> roles; the package itself -> hpcvla."""
    return module.split(".")[1] if "." in module else module


def imports_of(module: str, package_prefix: str = "hpcvla") -> list[tuple[int, str]]:
    """(line, module) of every import of `package_prefix`'s modules in the module's file, at
    any depth."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, `level` - 1 packages up
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append((node.lineno, submodule if submodule in MODULES else source))
    return sorted({(line, target) for line, target in found
                   if target == package_prefix or target.startswith(package_prefix + ".")})


def where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def edges() -> list[tuple[str, int, str]]:
    """(importer, line, imported) over the whole package; an imported name that is not a module
    of its own resolves to the module that defines it."""
    out = []
    for module in MODULES:
        for line, target in imports_of(module):
            while target not in MODULES and "." in target:  # hpcvla.x.name -> hpcvla.x
                target = target.rpartition(".")[0]
            if target != module:
                out.append((module, line, target))
    return out


def test_every_module_has_a_floor():
    unknown = sorted({top_name(m) for m in MODULES} - set(FLOOR_OF))
    if unknown:
        pytest.fail(f"no floor for hpcvla.{', hpcvla.'.join(unknown)}: give each one in "
                    "tests/test_layers.py's FLOORS (and the picture in its docstring)",
                    pytrace=False)


def test_no_module_imports_a_higher_floor():
    upward = [f"{where(a, line)}: {a} (floor {FLOOR_OF[top_name(a)]}) imports {b} "
              f"(floor {FLOOR_OF[top_name(b)]})"
              for a, line, b in edges()
              if top_name(a) in FLOOR_OF and top_name(b) in FLOOR_OF
              and FLOOR_OF[top_name(b)] > FLOOR_OF[top_name(a)]]
    if upward:
        pytest.fail("imports of a higher floor (move the code down, or pass the value in):\n"
                    + "\n".join(upward), pytrace=False)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, or one that imports
    itself."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    all_edges = edges()
    graph = {module: set() for module in MODULES}
    for a, _, b in all_edges:
        graph[a].add(b)
    cycles = []
    for component in strongly_connected(graph):
        inside = [f"    {where(a, line)}: {a} imports {b}"
                  for a, line, b in all_edges if a in component and b in component]
        cycles.append(f"{' <-> '.join(component)}:\n" + "\n".join(inside))
    if cycles:
        pytest.fail("import cycles (lazy imports included):\n" + "\n".join(cycles),
                    pytrace=False)


def test_no_module_is_over_420_lines():
    long = [f"{path.relative_to(ROOT)}: {n} lines" for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    if long:
        pytest.fail(f"modules over {MAX_LINES} lines (split them by job):\n" + "\n".join(long),
                    pytrace=False)


def test_no_forbidden_dependency():
    found = [f"{where(a, line)}: {a} imports {b}: {FORBIDDEN[top_name(a), top_name(b)]}"
             for a, line, b in edges() if (top_name(a), top_name(b)) in FORBIDDEN]
    if found:
        pytest.fail("dependencies the design forbids (pass the value in, or move the code):\n"
                    + "\n".join(found), pytrace=False)


def test_floor_one_imports_neither_torch_nor_mpi():
    found = [f"{where(module, line)}: {module} imports {target}"
             for module in MODULES if FLOOR_OF.get(top_name(module)) == 1
             for package, allowed in PURE_EXCEPT.items() if module not in allowed
             for line, target in imports_of(module, package)]
    if found:
        pytest.fail("floor 1 describes a run without torch or MPI:\n" + "\n".join(found),
                    pytrace=False)


# A policy family, a simulator or an algorithm is asked for its traits (config/families.py)
# or its code (policies/registry.py, envs/registry.py: the class registered under the name),
# never compared by name: a new family is its module plus a row in each of the two, a new
# algorithm its loss and a row.
NAME_CHECK = re.compile(r"\b(policy|env|env_cfg|algorithm|alg)\.name\s*"
                        r"(==|!=|(not\s+)?in\s*[([{]\s*[\"'])|\benv_name\s*(==|!=)")


def test_no_module_branches_on_a_family_simulator_or_algorithm_name():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in MODULES.values()
             for n, line in enumerate(path.read_text().splitlines(), 1) if NAME_CHECK.search(line)]
    assert not found, "ask config/families.py or the registry instead:\n" + "\n".join(found)


# The modules of the simulators themselves (envs/registry.py holds their classes): the per-rank
# loops and the evaluation run any simulator through VectorEnv and its class methods (a
# benchmark's protocol: VectorEnv.benchmark_protocol), so a new one needs no edit there.
SIMULATOR_MODULES = {"hpcvla.envs.libero", "hpcvla.envs.libero_suites", "hpcvla.envs.scenes",
                     "hpcvla.envs.maniskill", "hpcvla.envs.maniskill_gpu", "hpcvla.envs.reach"}


def test_the_roles_and_the_evaluation_import_no_simulator_of_their_own():
    found = [f"{where(a, line)}: {a} imports {b}" for a, line, b in edges()
             if top_name(a) in ("roles", "evaluate") and b in SIMULATOR_MODULES]
    assert not found, "ask the env's class (envs/registry.py) instead:\n" + "\n".join(found)
