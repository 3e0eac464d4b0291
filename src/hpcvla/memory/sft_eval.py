"""The memory of `hpcvla sft`'s and `hpcvla eval`'s worlds, each of one role: sft's learners
(a GPU each) and eval's acting ranks (sharing GPUs); train's layouts are layout.py's, whose
figures and refusals these share. docs/memory.md."""

from __future__ import annotations

from dataclasses import replace

from hpcvla.config.learning import states_stage
from hpcvla.memory.layout import LayoutMemory, add, build_bytes, fit_problems, gpu_capacity_gib
from hpcvla.memory.simulators import simulator_bytes
from hpcvla.memory.states import checkpoint_bytes, inference_bytes, learner_bytes, offloaded_bytes
from hpcvla.topology.plan import INF, SIM, PlanError

DEMOS = "sft demonstrations (one copy per node)"  # a node's host part, held by its first learner


def sft_memory(cfg, nodes: list[int], gpus: int, spec, footprint=None,
               shared: int | None = None) -> LayoutMemory:
    """`hpcvla sft`'s memory: every rank a learner, rank r on node `nodes[r]`, on nodes of
    `gpus` GPUs each on a GPU of its own (devices.assign_node: learners never share one;
    PlanError where a node has too few), on CPUs where `gpus` is 0. Each holds its engine's
    states (ZeRO over all of them) at a batch of sft.batch_size demonstration chunks through
    the family's imitation loss, and builds the policy in host memory; each node's first
    also the demonstrations' one copy (hold_demonstrations): `shared` bytes where the caller
    knows them (0: left out, for a verdict on the GPUs alone), else from the files' headers
    (demonstration_bytes)."""
    most = max(map(nodes.count, nodes))
    if 0 < gpus < most:
        raise PlanError(f"{most} sft learners on a node of {gpus} GPU(s): learners never share "
                        "a GPU; at most as many learners per node as GPUs")
    if footprint is None:
        from hpcvla.memory.footprint import policy_footprint as footprint
    on_gpus = gpus > 0
    fp = footprint(cfg, spec, cfg.sft.batch_size, 1, on_gpus, imitation=True)
    learner = cfg.learner
    parts = learner_bytes(fp, states_stage(learner), len(nodes), on_gpus,
                          learner.offload_optimizer)
    host = {"policy builds": build_bytes(fp)}
    if learner.offload_optimizer:
        host.update(offloaded_bytes(fp, states_stage(learner), len(nodes)))
    if not on_gpus:
        add(host, "cpu ranks' working memory", sum(parts.values()))
    devices = {r: f"cuda:{nodes[:r].count(node)}" if on_gpus else "cpu"
               for r, node in enumerate(nodes)}
    snapshot = {r: {"checkpoint snapshot": checkpoint_bytes(fp, states_stage(learner), len(nodes),
                                                            r == 0)} for r in devices}
    out = LayoutMemory(gpu={r: dict(parts) for r in devices} if on_gpus else {},
                       host={r: host | snapshot[r] for r in devices}, device=devices,
                       node=dict(enumerate(nodes)), capacity_gib=gpu_capacity_gib(cfg.placement),
                       dtype_bytes=fp.dtype_bytes, batch=(
                           "sft.batch_size", cfg.sft.batch_size,
                           f"{cfg.sft.batch_size} demonstration chunks per learner and pass"))
    hold_demonstrations(out, demonstration_bytes(cfg, spec) if shared is None else shared)
    out.problems = fit_problems(cfg, out)[:1]  # every learner's GPU alike: rank 0's says it
    return out


def hold_demonstrations(memory: LayoutMemory, nbytes: int) -> None:
    """`nbytes` of demonstrations in each node's first learner's host memory (none for 0)."""
    firsts = {node: rank for rank, node in reversed(list(memory.node.items()))}.values()
    for first in firsts if nbytes else ():
        memory.host[first][DEMOS] = nbytes


def eval_devices(cfg, ranks: int, gpus: int) -> dict[int, str]:
    """`hpcvla eval`'s `ranks` processes on this host of `gpus` GPUs (0: the CPU), each
    taking the least loaded (devices.assign_node), as each will."""
    from hpcvla.devices import assign_node
    from hpcvla.envs import env_uses_gpu
    visible = tuple(str(i) for i in range(gpus))
    return {r: "cpu" if g is None else f"cuda:{g}" for r, g in enumerate(assign_node(
        [(SIM, INF)] * ranks, [visible] * ranks, env_uses_gpu(cfg.env)))}


def eval_memory(cfg, devices: dict[int, str], envs: int, spec,
                nodes: list[int] | None = None, footprint=None) -> LayoutMemory:
    """`hpcvla eval`'s ranks on their `devices` (eval_devices; in a world, devices.gpu_names),
    rank r on node `nodes[r]` (default: one node), each stepping `envs` envs and acting on
    them with the policy: on a GPU the weights, a batch of `envs` observations through `act`
    and its CUDA context; its policy build and envs in host memory."""
    if footprint is None:
        from hpcvla.memory.footprint import policy_footprint as footprint
    on_gpus = any(d.startswith("cuda") for d in devices.values())
    fp = footprint(cfg, spec, 1, envs, on_gpus)
    stepped = simulator_bytes(replace(cfg.env, envs_per_simulator=envs), 1)
    gpu, host = {}, {}
    for rank, device in devices.items():
        parts = inference_bytes(fp, device != "cpu")
        host[rank] = {"policy builds": build_bytes(fp), "simulator envs": stepped}
        if device != "cpu":
            gpu[rank] = parts
        else:
            add(host[rank], "cpu ranks' working memory", sum(parts.values()))
    out = LayoutMemory(gpu=gpu, host=host, device=devices, node=dict(enumerate(
                           nodes or [0] * len(devices))),
                       capacity_gib=gpu_capacity_gib(cfg.placement), dtype_bytes=fp.dtype_bytes,
                       acting=("--envs", envs, "fewer episodes at a time per rank (--envs) or "
                               "fewer ranks per GPU (--ranks, or ranks per node)"))
    out.problems = fit_problems(cfg, out)
    return out


def demonstration_bytes(cfg, spec) -> int:
    """`hpcvla sft`'s demonstrations and held-out ones as a node holds them, from the files'
    headers (an upper bound: sft.successful_only is not applied); 0 where none are set or
    they cannot be read (`hpcvla sft` refuses them, saying why)."""
    from hpcvla.config.imitation import demo_paths
    from hpcvla.demonstrations import demonstration_rows, sample_bytes
    try:
        rows = sum(demonstration_rows(paths, spec, per_task) for paths, per_task in (
            (demo_paths(cfg.sft), cfg.sft.per_task or None),
            (demo_paths(cfg.sft, "val_demos"), None)) if paths)
    except (ValueError, OSError):
        return 0
    return rows * sample_bytes(spec)
