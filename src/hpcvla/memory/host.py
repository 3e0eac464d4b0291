"""How much memory a rank's host gives the job: the machine's, or less where the job's cgroup
or its scheduler's request says so."""

from __future__ import annotations

import os
from pathlib import Path

MIB = 1 << 20


def host_bytes(environ=os.environ) -> int:
    """This machine's memory, or what the job may use of it where that is less: this
    process's cgroups' limits (Slurm's --mem where it constrains memory, PBS's mem=, a
    container's) and, in a Slurm job, its request (SLURM_MEM_PER_NODE, or SLURM_MEM_PER_CPU
    times its CPUs on the node), which a site that enforces it by polling rather than a cgroup
    (ConstrainRAMSpace=no) sets in no cgroup. The nodes of a job are alike, as a cluster's
    are."""
    import psutil
    return min([int(psutil.virtual_memory().total), *cgroup_memory_limits(),
                *slurm_memory_limits(environ)])


def slurm_memory_limits(environ=os.environ) -> list[int]:
    """The memory a Slurm job asked for on this node, in bytes ([] outside a job and where it
    asked for none: Slurm writes 0 for "the whole node")."""
    if "SLURM_JOB_ID" not in environ:
        return []
    per_node = environ.get("SLURM_MEM_PER_NODE", "").strip()
    per_cpu = environ.get("SLURM_MEM_PER_CPU", "").strip()
    cpus = environ.get("SLURM_CPUS_ON_NODE", "").strip()
    if per_node.isdigit() and int(per_node):
        return [int(per_node) * MIB]
    if per_cpu.isdigit() and int(per_cpu) and cpus.isdigit():
        return [int(per_cpu) * int(cpus) * MIB]
    return []


def cgroup_memory_limits() -> list[int]:
    """The memory limits of this process's cgroup and of those above it: cgroup v2's
    memory.max, v1's memory.limit_in_bytes (the ones set: "max" or v1's huge number is none)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, name = Path("/sys/fs/cgroup"), "memory.max"
            if not (root / "cgroup.controllers").exists():  # v2 beside v1 (hybrid)
                root = root / "unified"
        elif "memory" in controllers.split(","):
            root, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        group = root / path.lstrip("/")
        for level in (group, *group.parents):
            if not level.is_relative_to(root):
                break
            try:
                text = (level / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit():
                out.append(int(text))
    return out
