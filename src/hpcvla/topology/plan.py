"""RankPlan: who does what in the MPI world. A pure function of (world, ranks per node, placement).

Vocabulary (docs/architecture.md, "Vocabulary: ranks, nodes, cells"):

* node: `ranks_per_node` consecutive world ranks (block placement, as `srun --distribution=block`
  and `mpiexec` give by default; the MPI side checks that the real layout agrees).
* cell: one inference rank plus the simulator ranks it serves, always on one node, so the
  high-frequency observation/action traffic never leaves the node.
* producer: a rank with the inference role; it assembles trajectories and streams them to one
  learner (`feeds`). Producers are spread over learners in blocks, balanced within one.
* node leader: the lowest inference rank of a node; the weight control plane sends each new
  policy version once to every node leader, which shares it with the node's inference ranks.
* weight root: learner 0, which publishes weights.
* evaluator: a rank set aside (placement.evaluators) that evaluates held-out states during
  training: the last learner rank of the rollout nodes, where it can read its node's weight
  copy as inference ranks do.
* spare: a rank with no role, where `placement.learners` caps the learners below what the
  nodes' ranks would give (the last learner ranks are spare). It takes part in start-up and the
  report and computes nothing; a restart on fewer rollout nodes leaves the learner nodes' extra
  ranks spare, since every learner needs a producer of its own.

Layout of a rollout node (disaggregated/hybrid): each cell's inference rank followed by its
simulators, cells one after another, then the node's learners. Colocated: every rank has every
role and is a cell of its own. Hybrid (inference ranks also learn) is plan-only: it is laid out
here and by `hpcvla plan`, but `hpcvla train` refuses it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

SIM, INF, LEARN, EVAL, SPARE = "simulator", "inference", "learner", "evaluator", "spare"


class PlanError(ValueError):
    """The placement cannot be laid out on this world; the message says why and what fits."""


def rank_named(rank: int, roles: str, node: int, host: str) -> str:
    """How a failure names a rank: its roles, node and host."""
    return f"rank {rank} ({roles}) on node {node} (host {host})"


@dataclass(frozen=True)
class RankInfo:
    rank: int
    node: int
    local_rank: int
    roles: tuple[str, ...]          # subset of (simulator, inference, learner), in that order;
                                    # (evaluator,) or (spare,) for a rank with neither
    cell: int | None                # cell id for simulators and inference ranks


@dataclass(frozen=True)
class Cell:
    id: int
    node: int
    inference: int                  # world rank serving actions in this cell
    simulators: tuple[int, ...]     # world ranks stepping environments in this cell


@dataclass(frozen=True)
class RankPlan:
    mode: str
    world_size: int
    ranks_per_node: int
    ranks: tuple[RankInfo, ...]
    cells: tuple[Cell, ...]
    learners: tuple[int, ...]       # world ranks, in learner-communicator order
    feeds: dict[int, int]           # producer (inference) rank -> learner rank it streams to
    node_leaders: tuple[int, ...]   # one per node that hosts inference, ascending

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def weight_root(self) -> int:
        return self.learners[0]

    @property
    def control_plane(self) -> tuple[int, ...]:
        """Ranks of the weight control plane: the weight root first, then node leaders."""
        return (self.weight_root,) + tuple(r for r in self.node_leaders if r != self.weight_root)

    def with_role(self, role: str) -> tuple[int, ...]:
        return tuple(info.rank for info in self.ranks if role in info.roles)

    def who(self, rank: int, host: str) -> str:
        """How a failure names a rank of this plan (`host`: the rank's own): rank_named."""
        info = self.ranks[rank]
        return rank_named(rank, "+".join(info.roles), info.node, host)

    def producers_of(self, learner: int) -> tuple[int, ...]:
        return self._producers.get(learner, ())

    @cached_property
    def _producers(self) -> dict[int, tuple[int, ...]]:
        """Each learner's producers, found in one pass over the feeds."""
        out: dict[int, list[int]] = {}
        for producer, learner in sorted(self.feeds.items()):
            out.setdefault(learner, []).append(producer)
        return {learner: tuple(ps) for learner, ps in out.items()}

    def to_dict(self) -> dict:
        out = asdict(self)
        out["feeds"] = {str(k): v for k, v in self.feeds.items()}
        out.update(num_nodes=self.num_nodes, weight_root=self.weight_root,
                   control_plane=list(self.control_plane))
        return out

    def table(self, devices: dict[int, str] | None = None,
              columns: dict[str, dict[int, str]] | None = None) -> str:
        """A map a person can read: one summary line, then one row per rank (with its device
        when `devices`, rank -> "cuda:i" | "cpu", is given, and `columns`: heading -> rank ->
        text, before the notes)."""
        devices, columns = devices or {}, columns or {}
        extra = {h: max([len(h), *map(len, col.values())]) for h, col in columns.items()}
        n_inf, n_learn = len(self.with_role(INF)), len(self.learners)
        n_spare = len(self.with_role(SPARE))
        lines = [
            f"mode {self.mode}: {self.world_size} ranks on {self.num_nodes} node(s) of "
            f"{self.ranks_per_node}; {len(self.cells)} cell(s), {n_learn} learner(s), "
            + (f"{n_spare} spare, " if n_spare else "")
            + f"inference:learner = {n_inf}:{n_learn}, weight root rank {self.weight_root}",
            f"{'rank':>5} {'node':>4} {'local':>5}  {'roles':<28} {'cell':>4} {'feeds':>5}  "
            + (f"{'device':<7} " if devices else "")
            + "".join(f"{h:>{w}}  " for h, w in extra.items()) + "notes",
        ]
        leaders = set(self.node_leaders)
        for info in self.ranks:
            notes = []
            if info.rank == self.weight_root:
                notes.append("weight root")
            if info.rank in leaders:
                notes.append("node leader")
            cell = "-" if info.cell is None else str(info.cell)
            feeds = str(self.feeds[info.rank]) if info.rank in self.feeds else "-"
            device = f"{devices[info.rank]:<7} " if devices else ""
            added = "".join(f"{columns[h].get(info.rank, '-'):>{w}}  " for h, w in extra.items())
            lines.append(f"{info.rank:>5} {info.node:>4} {info.local_rank:>5}  "
                         f"{'+'.join(info.roles):<28} {cell:>4} {feeds:>5}  {device}{added}"
                         f"{', '.join(notes)}".rstrip())
        return "\n".join(lines)


def build_plan(world_size: int, ranks_per_node: int, mode: str,
               per_node: dict[str, int] | None = None, learner_nodes: int = 0,
               max_learners: int = 0, evaluators: int = 0) -> RankPlan:
    """Lay out the world. `evaluators`: the last this many learner ranks of the rollout
    nodes evaluate instead; `max_learners` > 0 then caps the learners (the ones beyond are
    spare). Raises PlanError (with what would fit) if the layout is impossible."""
    per_node = {SIM: 0, INF: 0, LEARN: 0, **(per_node or {})}
    if world_size < 1 or ranks_per_node < 1:
        raise PlanError(f"world size ({world_size}) and ranks per node ({ranks_per_node}) "
                        "must be >= 1")
    if world_size % ranks_per_node:
        raise PlanError(f"world size {world_size} is not a multiple of ranks per node "
                        f"{ranks_per_node}: every node must hold the same number of ranks "
                        "(set placement.ranks_per_node to a divisor of the world, or start a "
                        "multiple of it: train's --ranks, plan's and doctor's --world, the "
                        "job's tasks)")
    num_nodes = world_size // ranks_per_node
    if mode == "colocated":
        return _colocated(world_size, ranks_per_node)
    if mode not in ("disaggregated", "hybrid"):
        raise PlanError(f"placement mode {mode!r}: expected colocated, disaggregated or hybrid")

    sims, infs, learns = per_node[SIM], per_node[INF], per_node[LEARN]
    if mode == "hybrid" and (learns or learner_nodes):
        raise PlanError("hybrid mode: inference ranks are the learners, so per_node.learner "
                        f"(= {learns}) and learner_nodes (= {learner_nodes}) must be 0")
    if sims + infs + learns != ranks_per_node:
        raise PlanError(_per_node_mismatch(sims, infs, learns, world_size, ranks_per_node))
    if infs < 1 or sims < infs:
        raise PlanError(f"per_node has {infs} inference and {sims} simulator ranks: every node "
                        "needs >= 1 inference rank and >= 1 simulator rank per inference rank")
    if learner_nodes >= num_nodes:
        raise PlanError(f"learner_nodes = {learner_nodes} leaves no rollout node out of "
                        f"{num_nodes}: use at most {num_nodes - 1}")

    ranks: list[RankInfo] = []
    cells: list[Cell] = []
    for node in range(num_nodes):
        base = node * ranks_per_node
        if node >= num_nodes - learner_nodes:
            ranks += [RankInfo(base + i, node, i, (LEARN,), None) for i in range(ranks_per_node)]
            continue
        local = 0
        for c in range(infs):
            n_sims = sims // infs + (c < sims % infs)
            cell_id = len(cells)
            inf_roles = (INF, LEARN) if mode == "hybrid" else (INF,)
            ranks.append(RankInfo(base + local, node, local, inf_roles, cell_id))
            sim_ranks = tuple(range(base + local + 1, base + local + 1 + n_sims))
            ranks += [RankInfo(r, node, r - base, (SIM,), cell_id) for r in sim_ranks]
            cells.append(Cell(cell_id, node, base + local, sim_ranks))
            local += 1 + n_sims
        ranks += [RankInfo(base + i, node, i, (LEARN,), None)
                  for i in range(local, ranks_per_node)]

    if evaluators:
        ranks = _set_aside_evaluators(ranks, evaluators, num_nodes - learner_nodes)
    learners = tuple(r.rank for r in ranks if LEARN in r.roles)
    if mode == "disaggregated" and 0 < max_learners < len(learners):
        spare = set(learners[max_learners:])
        ranks = [RankInfo(r.rank, r.node, r.local_rank, (SPARE,), None) if r.rank in spare
                 else r for r in ranks]
        learners = learners[:max_learners]
    producers = [c.inference for c in cells]
    if not learners and evaluators:
        raise PlanError(f"placement.evaluators = {evaluators} takes the rollout nodes' last "
                        "learner rank(s) and leaves none to train: give each node one more "
                        f"learner, placement.per_node={{simulator: {sims}, inference: {infs}, "
                        f"learner: {learns + evaluators}}} ({ranks_per_node + evaluators} "
                        "ranks per node)")
    if not learners:
        raise PlanError("no learner rank: set placement.per_node.learner >= 1 or "
                        "placement.learner_nodes >= 1")
    if len(producers) < len(learners):
        raise PlanError(f"{len(producers)} inference rank(s) cannot feed {len(learners)} "
                        "learners: every learner needs at least one producer; add inference "
                        f"ranks, remove learners or cap them (placement.learners="
                        f"{len(producers)} leaves the others spare)")
    if mode == "hybrid":
        feeds = {p: p for p in producers}
    else:  # contiguous blocks: balanced within one, and neighbouring producers share a learner
        feeds = {p: learners[k * len(learners) // len(producers)]
                 for k, p in enumerate(producers)}
    return RankPlan(mode, world_size, ranks_per_node, tuple(ranks), tuple(cells), learners,
                    feeds, _node_leaders(cells))


def _per_node_mismatch(sims: int, infs: int, learns: int, world_size: int,
                       ranks_per_node: int) -> str:
    """What fits when placement.per_node does not sum to the nodes' ranks."""
    total = sims + infs + learns
    fixes = [f"start {total} ranks per node (one node: train's `--ranks {total}`, plan's and "
             f"doctor's `--world {total}`; srun/mpirun: {total} tasks per node)"]
    if ranks_per_node >= 3:  # a rollout node with a learner holds 3 roles
        fixes.append(f"make placement.per_node sum to {ranks_per_node}")
    if total and world_size % total == 0:
        fixes.append(f"set placement.ranks_per_node={total} (it cuts these nodes into nodes of "
                     f"{total}; to plan for a cluster whose nodes have {total}: "
                     f"`--ranks-per-node {total}`)")
    if ranks_per_node < 3:
        fixes.append("with fewer than 3 ranks per node, run colocated (configs/colocated.yaml: "
                     "every rank simulates, acts and learns)")
    return (f"placement.per_node = {sims} simulator + {infs} inference + {learns} learner = "
            f"{total} ranks, but nodes have {ranks_per_node}: " + ", or ".join(fixes))


def _set_aside_evaluators(ranks: list, evaluators: int, rollout_nodes: int) -> list:
    """The last `evaluators` learner ranks of the rollout nodes as evaluators."""
    candidates = [r.rank for r in ranks if LEARN in r.roles and r.node < rollout_nodes]
    if len(candidates) < evaluators:
        raise PlanError(f"placement.evaluators = {evaluators}, but the rollout nodes hold "
                        f"{len(candidates)} learner rank(s): an evaluator reads its node's "
                        "weight copy, so it takes a learner rank of a rollout node (add one "
                        "to per_node.learner)")
    taken = set(candidates[-evaluators:])
    return [RankInfo(r.rank, r.node, r.local_rank, (EVAL,), None) if r.rank in taken else r
            for r in ranks]


def _colocated(world_size: int, ranks_per_node: int) -> RankPlan:
    ranks = tuple(RankInfo(r, r // ranks_per_node, r % ranks_per_node, (SIM, INF, LEARN), r)
                  for r in range(world_size))
    cells = tuple(Cell(r, r // ranks_per_node, r, (r,)) for r in range(world_size))
    return RankPlan("colocated", world_size, ranks_per_node, ranks, cells,
                    tuple(range(world_size)), {r: r for r in range(world_size)},
                    _node_leaders(cells))


def _node_leaders(cells) -> tuple[int, ...]:
    first: dict[int, int] = {}
    for cell in cells:
        first[cell.node] = min(first.get(cell.node, cell.inference), cell.inference)
    return tuple(sorted(first.values()))


def plan_from_config(placement, world_size: int, real_ranks_per_node: int | None = None
                     ) -> RankPlan:
    """Plan for a `PlacementConfig` in nodes of `node_size`'s ranks."""
    return build_plan(world_size, node_size(placement, world_size, real_ranks_per_node),
                      placement.mode, placement.per_node, placement.learner_nodes,
                      placement.learners, placement.evaluators)


def node_size(placement, world_size: int, real_ranks_per_node: int | None) -> int:
    """Ranks per node of the plan: the emulated node size (placement.ranks_per_node) wins over
    the real one (the launcher's, or `--ranks-per-node` in plan); with neither, the whole world
    is one node."""
    if real_ranks_per_node is not None and real_ranks_per_node < 1:
        raise PlanError(f"{real_ranks_per_node} ranks per node: a node holds at least one rank")
    rpn = placement.ranks_per_node or real_ranks_per_node or world_size
    if real_ranks_per_node and placement.ranks_per_node and real_ranks_per_node % rpn:
        raise PlanError(f"placement.ranks_per_node = {rpn} does not divide the real node size "
                        f"{real_ranks_per_node}: emulated nodes must not straddle real ones")
    return rpn
