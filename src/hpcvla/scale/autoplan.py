"""`hpcvla plan --auto`: search the layouts of a world with the scale model.

Knobs searched (everything else, including pipeline.mode and the batch each learner trains
per version, stays as the config says):

* placement.per_node: every (simulator, inference, learner) split of the ranks of a node with
  >= 1 inference rank, >= 1 simulator per inference rank, >= 1 learner and at least as many
  inference ranks as learners (each learner needs a producer);
* env.shards (envs per shard = envs / shards): the divisors of the envs per simulator;
* rollout.batch_max (B_max): the whole cell, half or a quarter of it; rollout.wait_max_ms
  (T_max): 1, 5 or 20 ms;
* learner.micro_batch: the divisors of the learner batch that are multiples of the envs per
  shard (learner.micro_batches = batch / micro_batch).

* env.envs_per_simulator, only when asked (`--search-envs`): half, the same, 2x or 4x the
  config's; the fewest envs within 2 % of the best throughput (more envs only add staleness
  and memory once another stage is the bottleneck).

On GPU nodes only layouts whose ranks fit their GPUs are chosen (the memory model,
scale/memory_fit.py); where none fits at the config's memory settings, the search turns on
learner.gradient_checkpointing (VLA families), then raises learner.zero_stage, then offloads
the optimizer state (learner.offload_optimizer), one at a time, and prints what it turned.

The search is coordinate descent: starting from the config (or the first valid layout),
each knob in turn is set to its best value with the others held, until a round changes
nothing. Each layout is scored by the model's steady env steps/s (same random draws for
every layout). A layout the pipeline would refuse (schedule.layout_problems, the rules
`hpcvla train` checks) is skipped. Returns the best and the runners-up (the next best
layouts seen, those that predict another throughput than the ones listed first).

pipeline.max_staleness is the user's bound, never searched: for the async modes the plan
also prints the best prediction under bounds one and two versions looser, what the bound
costs in throughput.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

from hpcvla.process.threads import usable_cores
from hpcvla.scale.model import Network, Prediction, StageCosts, predict
from hpcvla.schedule import Layout, layout_problem, traits
from hpcvla.topology.plan import PlanError, node_size

problem = layout_problem  # why the pipeline would refuse a Layout (None: it runs)


def per_node_options(ranks_per_node: int) -> list[dict]:
    out = []
    for inf in range(1, ranks_per_node):
        for learn in range(1, inf + 1):
            sims = ranks_per_node - inf - learn
            if sims >= inf:
                out.append({"simulator": sims, "inference": inf, "learner": learn})
    return out


def _values(knob: str, lay: Layout) -> list:
    e = lay.envs_per_shard
    if knob == "per_node":
        return per_node_options(lay.ranks_per_node)
    if knob == "shards":
        return [s for s in range(1, lay.envs + 1) if lay.envs % s == 0]
    if knob == "batch_max":
        cell = lay.envs * max(1, lay.per_node["simulator"] // lay.per_node["inference"])
        return sorted({0, *(b for b in (cell // 2, cell // 4) if b >= e)})
    if knob == "wait_max_s":
        return [0.001, 0.005, 0.02]
    if knob == "micro_batch":
        batch = lay.micro_batch * lay.micro_batches
        return [m for m in range(e, batch + 1, e) if batch % m == 0]
    if knob == "envs":
        return sorted({n for n in (lay.envs // 2, lay.envs, 2 * lay.envs, 4 * lay.envs) if n})
    raise ValueError(knob)


def _set(lay: Layout, knob: str, value) -> Layout:
    if knob == "micro_batch":
        batch = lay.micro_batch * lay.micro_batches
        return replace(lay, micro_batch=value, micro_batches=batch // value)
    if knob == "envs":  # keep the shards dividing the envs
        return replace(lay, envs=value, shards=math.gcd(lay.shards, value))
    return replace(lay, **{knob: value})


def knobs(mode: str, envs: bool = False) -> list[str]:
    t = traits(mode)
    out = ["envs"] if envs else []
    if not t.colocated:
        out.append("per_node")
    if t.sharded:
        out.append("shards")
    if t.dynamic_batcher:
        out += ["batch_max", "wait_max_s"]
    return out + ["micro_batch"]


def _start(base: Layout, fits) -> Layout:
    """The config's layout if it runs and fits, else the first that does (the mode's knobs
    in turn, `knobs`)."""
    if problem(base) is None and fits(base) is None:
        return base
    tried = [base]
    for knob in knobs(base.mode):
        tried = [_set(lay, knob, v) for lay in tried for v in _values(knob, lay)] + tried
        for lay in tried:
            if problem(lay) is None and fits(lay) is None:
                return lay
    raise PlanError(f"no layout of {base.world} ranks in nodes of {base.ranks_per_node} runs "
                    f"pipeline.mode={base.mode} with {base.envs} envs per simulator and a "
                    f"learner batch of {base.micro_batch * base.micro_batches}: "
                    f"{problem(base) or fits(base)}")


def search(base: Layout, costs: StageCosts, network: Network = Network(), rounds: int = 3,
           runner_ups: int = 4, search_envs: bool = False,
           fits=lambda lay: None) -> list[tuple[Layout, Prediction]]:
    """[(layout, prediction)], best first: the best then up to `runner_ups` others. `fits`
    (scale/memory_fit.MemoryFit, which judges each layout once): None where a layout fits its
    GPUs, else why not; asked only of the layouts that would be chosen, best first."""
    check_world(base.world, base.ranks_per_node, base.mode)
    seen: dict[tuple, tuple[Layout, Prediction]] = {}

    def score(lay: Layout) -> float:
        key = tuple(lay.to_overrides())
        if key not in seen:
            seen[key] = (lay, predict(lay, costs, network, updates=None))
        return seen[key][1].env_steps_per_s

    def fit(lay: Layout) -> bool:
        return fits(lay) is None

    best = _start(base, fits)
    score(best)
    for _ in range(rounds):
        before = best
        for knob in knobs(best.mode, search_envs):
            options = [_set(best, knob, v) for v in _values(knob, best)]
            options = [lay for lay in options if problem(lay) is None] + [best]
            if knob == "envs":
                options = [lay for lay in options if fit(lay)]
                top = max(map(score, options))
                best = min((lay for lay in options if score(lay) >= 0.98 * top),
                           key=lambda lay: lay.envs)
            else:
                best = next(lay for lay in sorted(options, key=score, reverse=True) if fit(lay))
        if best == before:
            break
    chosen = seen[tuple(best.to_overrides())]  # first, though a layout with more envs may edge it
    ranked = [chosen] + sorted((lp for lp in seen.values() if lp is not chosen),
                               key=lambda lp: -lp[1].env_steps_per_s)
    # runners-up: layouts that fit and predict something else first (ties tell a reader nothing)
    distinct, ties = ranked[:1], []
    for lay, pred in ranked[1:]:
        if len(distinct) > runner_ups or not fit(lay):
            continue
        same = any(abs(pred.env_steps_per_s / p.env_steps_per_s - 1) < 1e-3 for _, p in distinct)
        (ties if same else distinct).append((lay, pred))
    return (distinct + ties)[:1 + runner_ups]


def looser_staleness(best: Layout, costs: StageCosts, search_envs: bool = False,
                     steps: int = 2, fits=lambda lay: None) -> list[tuple[int, Prediction]]:
    """[(max_staleness, best prediction)] one and two versions above the bound of `best` (the
    search's pick), for the modes it limits: a tight bound caps throughput (a version cannot
    take less than the rollout time of a segment over the bound, docs/architecture.md §7),
    which no other knob undoes. Each search starts from the previous pick, so a looser bound
    never predicts less."""
    if not best.traits.bounded_staleness:
        return []
    out = []
    for bound in range(best.max_staleness + 1, best.max_staleness + 1 + steps):
        best, pred = search(replace(best, max_staleness=bound), costs, runner_ups=0,
                            search_envs=search_envs, fits=fits)[0]
        out.append((bound, pred))
    return out


def check_world(world: int, ranks_per_node: int, mode: str) -> None:
    """Clear errors, naming the flag, for worlds no layout can fit."""
    if world < 1:
        raise PlanError(f"--world {world}: the world needs at least one rank")
    if ranks_per_node < 1:
        raise PlanError(f"--ranks-per-node {ranks_per_node}: a node needs at least one rank")
    if world % ranks_per_node:
        raise PlanError(f"--world {world} is not a multiple of --ranks-per-node "
                        f"{ranks_per_node}: every node holds the same number of ranks")
    if not traits(mode).colocated and not per_node_options(ranks_per_node):
        raise PlanError(f"--ranks-per-node {ranks_per_node}: pipeline.mode={mode} needs at "
                        "least 3 ranks per node (a simulator, an inference rank, a learner)")


def fitting_search(cfg, base: Layout, costs: StageCosts, search_envs: bool):
    """search() among the layouts that fit the GPUs; where none does, with the memory
    settings turned one more at a time (scale/memory_fit.py). Returns the ranking, the fit
    check and the settings turned, as overrides."""
    from hpcvla.memory.levers import memory_levers, override, turned
    from hpcvla.scale.memory_fit import MemoryFit
    levers, chosen = memory_levers(cfg, automatic_only=True), []
    while True:
        fits = MemoryFit(cfg)
        try:
            return search(base, costs, search_envs=search_envs, fits=fits), fits, chosen
        except PlanError:
            if not levers:
                raise
            lever = levers.pop(0)
            cfg = turned(cfg, lever.field, lever.value)
            chosen.append(override(lever.field, lever.value))


def best_overrides(cfg, world: int, ranks_per_node: int, costs_name: str) -> list[str]:
    """The best layout's overrides (a job's auto plan: job/restarts.py's `auto`)."""
    *_, ranked, _, levers = _search(cfg, world, ranks_per_node, costs_name, False)
    return ranked[0][0].to_overrides() + levers


def _search(cfg, world: int, ranks_per_node: int | None, costs_name: str, search_envs: bool):
    """The costs probed or looked up, then the search: the node size, the base layout, the
    costs and their details, then fitting_search's (layout, prediction)s best first, fits and
    memory levers turned."""
    from hpcvla.scale.probe import named_costs  # the probe imports torch and sims
    rpn = node_size(cfg.placement, world, ranks_per_node)
    check_world(world, rpn, cfg.pipeline.mode)  # before probing anything
    try:
        costs, details = named_costs(costs_name, cfg)
    except ValueError as err:
        raise PlanError(f"--costs {costs_name}: {err}") from None
    base = Layout.from_config(cfg, world, rpn)
    return (rpn, base, costs, details, *fitting_search(cfg, base, costs, search_envs))


def print_auto_plan(cfg, world: int, ranks_per_node: int | None, costs_name: str,
                    as_json: bool, search_envs: bool = False) -> int:
    """`hpcvla plan --auto`: probe or look up the stage costs, search, print the best layout
    as config overrides with its predicted env steps/s and bottleneck, then the runners-up."""
    from hpcvla.scale.probe import describe
    rpn, base, costs, details, ranked, fits, levers = _search(cfg, world, ranks_per_node,
                                                              costs_name, search_envs)
    rows = [{"overrides": lay.to_overrides() + levers, "env_steps_per_s": p.env_steps_per_s,
             "bottleneck": p.bottleneck, "busy": p.busy} for lay, p in ranked]
    best = rows[0]
    looser = [{"max_staleness": s, "env_steps_per_s": p.env_steps_per_s}
              for s, p in looser_staleness(ranked[0][0], costs, search_envs, fits=fits)]
    if as_json:
        print(json.dumps({"world": world, "ranks_per_node": rpn, "mode": base.mode,
                          "costs": {**costs.__dict__, "source": details.get("source")},
                          "best": best, "runner_ups": rows[1:], "looser_staleness": looser,
                          "memory_levers": levers}, indent=1))
        return 0
    if levers:
        print("no layout fits the GPUs at the config's memory settings; turned: "
              + " ".join(levers))
    print(f"auto plan: {world} ranks, {world // rpn} node(s) of {rpn}, "
          f"pipeline.mode={base.mode}\ncosts ({details.get('source')}): {describe(costs)}")
    print(f"predicted {best['env_steps_per_s']:,.0f} env steps/s; bottleneck: "
          f"{best['bottleneck']} (busy " + ", ".join(
              f"{k} {v:.2f}" for k, v in best["busy"].items()) + ")")
    print("overrides:\n  " + " \\\n  ".join(f"'{o}'" if " " in o else o
                                            for o in best["overrides"]))
    cores = usable_cores()
    if cores and rpn > cores and details.get("source", "").startswith("probed"):
        print(f"note: the model gives every rank a core of its own; this host has {cores} "
              f"for a node's {rpn} ranks, so a run here measures less; the probed costs also "
              "move with whatever else ran beside the probe (probe again to see the spread)")
    print("runners-up:")
    for n, row in enumerate(rows[1:], 1):
        changed = [o for o in row["overrides"] if o not in best["overrides"]]
        print(f"  {n}. {row['env_steps_per_s']:>9,.0f} env steps/s ({row['bottleneck']}): "
              + (" ".join(changed) or "same"))
    if looser:  # what the staleness bound costs: the user's trade-off, not a knob we turn
        print("under a looser staleness bound (best layout for each): " + ", ".join(
            f"pipeline.max_staleness={row['max_staleness']} "
            f"{row['env_steps_per_s']:,.0f} env steps/s "
            f"({row['env_steps_per_s'] / best['env_steps_per_s'] - 1:+.0%})" for row in looser))
    return 0
