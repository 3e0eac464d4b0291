"""Every command a shipped config's comment gives is a layout that fits the hardware it names,
by `hpcvla plan`: the 2-core recipes as shipped (`hpcvla train ... --ranks N`, planned as a
world of N here) and the cluster recipes (`hpcvla plan ...` on nodes of 8 GPUs with their
memory: the memory model at full size), with the layout rules `hpcvla train` checks. A
command with a placeholder for the user's own folder (`<...>`) is left out: the config's
`hpcvla plan` line plans that scale with the sizes such a folder gives (policy.size=full)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from hpcvla.cli import main
from helpers import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def commands(path: Path) -> list[list[str]]:
    """The `hpcvla train|plan` commands in a config's comments (continuation lines joined),
    as `hpcvla plan` arguments; those with a placeholder left out."""
    out, line = [], ""
    for raw in path.read_text().splitlines():
        if not raw.startswith("#"):
            continue
        line += raw[1:].strip()
        if line.endswith("\\"):
            line = line[:-1] + " "
            continue
        words = shlex.split(line) if line.startswith(("hpcvla train", "hpcvla plan")) else []
        line = ""
        if words and not any("<" in w for w in words):
            args = ["--world" if w == "--ranks" else w for w in words[2:]]
            out.append(args)
    return out


RECIPES = [(path.name, args) for path in CONFIGS for args in commands(path)]


def test_every_cluster_config_names_a_recipe_that_plan_checks():
    """The configs that scale to GPU nodes each give the `hpcvla plan` line of that scale."""
    named = {name for name, args in RECIPES if "placement.gpu_memory_gb=80" in args}
    assert {"libero10_flow.yaml", "libero_pi0.yaml", "libero_pi05.yaml", "libero_oft.yaml",
            "libero_spatial.yaml", "maniskill_pickcube.yaml", "maniskill_pickcube_oft.yaml",
            "maniskill_pickcube_tokens.yaml"} <= named, named


@pytest.mark.slow
@pytest.mark.parametrize("name,args", RECIPES, ids=[f"{n}:{i}" for i, (n, _) in
                                                     enumerate(RECIPES)])
def test_the_recipe_fits_its_hardware(name, args, capsys):
    """...and `train` would run it: plan refuses (exit 2) what train refuses, which a
    PLAN-ONLY config (hybrid.yaml) is, by its header."""
    plan_only = "# PLAN-ONLY" in (ROOT / "configs" / name).read_text()
    assert main(["plan", *args]) == (2 if plan_only else 0), capsys.readouterr()
    out, err = capsys.readouterr()
    assert ("train refuses it" in err) == plan_only, err
    if "placement.gpu_memory_gb=80" in args:
        assert "GPU capacity 80 GiB" in out and "busiest GPU" in out, out


def job_lines(path: Path) -> list[list[str]]:
    """The `sbatch ... jobs/slurm/multinode.sbatch CONFIG key=value...` commands in a doc's
    code blocks (continuation lines joined), as `hpcvla plan` arguments at the job's size:
    its --nodes (the script's 3) of --ntasks-per-node ranks (the script's 8), its
    --gpus-per-node (0: none) of 80 GiB, a user's folder (`/path/to/...`) as the sizes such
    a folder gives (policy.size=full)."""
    out, line, block = [], "", False
    for raw in path.read_text().splitlines():
        if raw.startswith("```"):
            block = not block
            continue
        line += raw.strip()
        if line.endswith("\\"):
            line = line[:-1] + " "
            continue
        words, line = (shlex.split(line) if block and line.startswith("sbatch ") else []), ""
        if "jobs/slurm/multinode.sbatch" not in words:
            continue
        assert not {"--nodes", "--ntasks-per-node", "--gpus-per-node"} & set(words), words
        options = dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)
        rest = words[words.index("jobs/slurm/multinode.sbatch") + 1:]
        nodes, ranks = int(options.get("nodes", 3)), int(options.get("ntasks-per-node", 8))
        out.append([rest[0], "--world", str(ranks * nodes), "--ranks-per-node", str(ranks),
                    f"placement.gpus_per_node={options.get('gpus-per-node', 0)}",
                    "placement.gpu_memory_gb=80", "policy.size=full",
                    *[w.split("=")[0] + "=" if "=/path/to/" in w else w for w in rest[1:]]])
    return out


def test_the_docs_gpu_job_lines_fit_their_nodes(capsys):
    """docs/cluster.md's worked job (π0 on LIBERO on 2 nodes of 8 GPUs) is a layout `train`
    takes at the script's 8 ranks a node, and fits 80-GiB GPUs."""
    (args,) = job_lines(ROOT / "docs/cluster.md")
    assert main(["plan", *args]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "GPU capacity 80 GiB" in out and "busiest GPU" in out, out
