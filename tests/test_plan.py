"""Property tests of the pure RankPlan (no MPI)."""

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcvla.topology.plan import EVAL, INF, LEARN, SIM, SPARE, PlanError, build_plan
from helpers import ROOT

ALL_ROLES = {SIM, INF, LEARN}


def layout_learners(world, rpn, mode, per_node, learner_nodes, cap):
    """The learner count the documented rules give (before checking the producers)."""
    rollout_nodes = world // rpn - learner_nodes
    if mode == "hybrid":
        return rollout_nodes * per_node[INF]
    learners = rollout_nodes * per_node[LEARN] + learner_nodes * rpn
    return min(learners, cap) if cap and mode == "disaggregated" else learners


def feasible(world, rpn, mode, per_node, learner_nodes, cap):
    """The documented feasibility rules, restated independently of build_plan."""
    if world < 1 or rpn < 1 or world % rpn:
        return False
    if mode == "colocated":
        return True
    nodes = world // rpn
    s, i, l = per_node[SIM], per_node[INF], per_node[LEARN]
    if mode == "hybrid" and (l or learner_nodes):
        return False
    if s + i + l != rpn or i < 1 or s < i or learner_nodes >= nodes:
        return False
    producers = (nodes - learner_nodes) * i
    return 1 <= layout_learners(world, rpn, mode, per_node, learner_nodes, cap) <= producers


layouts = st.integers(1, 12).flatmap(lambda rpn: st.tuples(
    st.integers(1, 6).map(lambda nodes: nodes * rpn),
    st.just(rpn),
    st.sampled_from(["colocated", "disaggregated", "hybrid"]),
    st.fixed_dictionaries({SIM: st.integers(0, rpn), INF: st.integers(0, rpn),
                           LEARN: st.integers(0, rpn)}),
    st.integers(0, 3),
    st.integers(0, 4)))


@settings(max_examples=600, deadline=None)
@given(layouts)
def test_plan_invariants_or_documented_error(layout):
    world, rpn, mode, per_node, learner_nodes, cap = layout
    if mode == "colocated":
        learner_nodes = 0
    if not feasible(world, rpn, mode, per_node, learner_nodes, cap):
        with pytest.raises(PlanError):
            build_plan(world, rpn, mode, per_node, learner_nodes, cap)
        return
    plan = build_plan(world, rpn, mode, per_node, learner_nodes, cap)

    # every rank once, in order, on the node its block says
    assert [r.rank for r in plan.ranks] == list(range(world))
    for info in plan.ranks:
        assert info.node == info.rank // rpn and info.local_rank == info.rank % rpn

    # roles per mode
    for info in plan.ranks:
        roles = set(info.roles)
        if mode == "colocated":
            assert roles == ALL_ROLES
        elif mode == "hybrid":
            assert roles in ({SIM}, {INF, LEARN})
        else:
            assert len(roles) == 1

    # cells: one inference rank, >= 1 simulator, never across nodes, cover every sim/inf rank
    in_cells = Counter()
    for cell in plan.cells:
        ranks = (cell.inference, *cell.simulators)
        assert cell.simulators
        assert {plan.ranks[r].node for r in ranks} == {cell.node}
        assert INF in plan.ranks[cell.inference].roles
        assert all(SIM in plan.ranks[r].roles and plan.ranks[r].cell == cell.id
                   for r in cell.simulators)
        in_cells.update(ranks)
    assert set(in_cells) == set(plan.with_role(SIM)) | set(plan.with_role(INF))
    assert all(n == 1 for n in in_cells.values()) or mode == "colocated"

    # every producer feeds exactly one learner; learners balanced within one
    producers = plan.with_role(INF)
    assert sorted(plan.feeds) == sorted(producers)
    assert set(plan.feeds.values()) <= set(plan.learners)
    load = Counter(plan.feeds.values())
    counts = [load[learner] for learner in plan.learners]
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1

    # counts match the placement
    nodes = world // rpn
    if mode == "colocated":
        assert len(plan.cells) == len(plan.learners) == world
    else:
        rollout_nodes = nodes - learner_nodes
        assert len(plan.with_role(SIM)) == rollout_nodes * per_node[SIM]
        assert len(producers) == len(plan.cells) == rollout_nodes * per_node[INF]
        learners = layout_learners(world, rpn, mode, per_node, learner_nodes, cap)
        assert len(plan.learners) == learners
        # a cap leaves the last learner ranks of the layout spare
        uncapped = layout_learners(world, rpn, mode, per_node, learner_nodes, 0)
        assert len(plan.with_role(SPARE)) == uncapped - learners
        assert all(s > r for s in plan.with_role(SPARE) for r in plan.learners)

    # weight plane: one leader per node that runs inference, the lowest such rank
    for node in range(nodes):
        inf_here = [r for r in producers if r // rpn == node]
        leaders_here = [r for r in plan.node_leaders if r // rpn == node]
        assert leaders_here == ([min(inf_here)] if inf_here else [])
    assert plan.control_plane[0] == plan.learners[0] == plan.weight_root
    assert len(set(plan.control_plane)) == len(plan.control_plane)


@pytest.mark.parametrize("ratio,per_node", [
    ("1:1", {SIM: 4, INF: 2, LEARN: 2}),
    ("2:1", {SIM: 5, INF: 2, LEARN: 1}),
    ("3:1", {SIM: 4, INF: 3, LEARN: 1}),
])
def test_paper_ratios(ratio, per_node):
    plan = build_plan(32, 8, "disaggregated", per_node)
    inf, learn = map(int, ratio.split(":"))
    assert len(plan.with_role(INF)) * learn == len(plan.learners) * inf
    assert f"inference:learner = {len(plan.with_role(INF))}:{len(plan.learners)}" in plan.table()


def test_layout_of_a_node_is_cells_then_learners():
    plan = build_plan(8, 8, "disaggregated", {SIM: 4, INF: 2, LEARN: 2})
    assert [c.inference for c in plan.cells] == [0, 3]
    assert [c.simulators for c in plan.cells] == [(1, 2), (4, 5)]
    assert plan.learners == (6, 7)
    assert plan.feeds == {0: 6, 3: 7}
    assert plan.node_leaders == (0,) and plan.control_plane == (6, 0)


@pytest.mark.parametrize("args,needle", [
    ((10, 4, "colocated"), "not a multiple of ranks per node"),
    ((8, 4, "disaggregated", {SIM: 2, INF: 1, LEARN: 2}), "make placement.per_node sum to 4"),
    ((10, 10, "disaggregated", {SIM: 2, INF: 1, LEARN: 2}), r"placement\.ranks_per_node=5"),
    ((2, 2, "disaggregated", {SIM: 2, INF: 1, LEARN: 1}), "run colocated"),
    ((8, 4, "disaggregated", {SIM: 0, INF: 2, LEARN: 2}), ">= 1 simulator rank per inference"),
    ((8, 4, "disaggregated", {SIM: 3, INF: 1, LEARN: 0}), "no learner rank"),
    ((8, 4, "disaggregated", {SIM: 1, INF: 1, LEARN: 2}), "every learner needs at least one"),
    ((8, 4, "hybrid", {SIM: 2, INF: 1, LEARN: 1}), "hybrid mode"),
    ((8, 4, "disaggregated", {SIM: 2, INF: 1, LEARN: 1}, 2), "leaves no rollout node"),
    ((8, 4, "diagonal"), "expected colocated, disaggregated or hybrid"),
])
def test_infeasible_layouts_say_why(args, needle):
    with pytest.raises(PlanError, match=needle):
        build_plan(*args)


def test_a_node_too_small_for_the_three_roles_is_not_told_to_hold_them():
    """`--ranks 2` on a layout of 4: per_node cannot sum to 2 and hold a simulator, an
    inference rank and a learner; colocated is what fits (it was offered both)."""
    with pytest.raises(PlanError) as refused:
        build_plan(2, 2, "disaggregated", {SIM: 2, INF: 1, LEARN: 1})
    assert "sum to 2" not in str(refused.value) and "run colocated" in str(refused.value)


def test_an_evaluator_takes_the_last_learner_rank_of_the_rollout_nodes():
    """It reads its node's weight copy, so it must be on a node with an inference rank."""
    plan = build_plan(12, 6, "disaggregated", {SIM: 2, INF: 2, LEARN: 2}, evaluators=1)
    assert plan.with_role(EVAL) == (11,) and plan.learners == (4, 5, 10)
    assert plan.ranks[11].node == 1 and 1 in {plan.ranks[r].node for r in plan.node_leaders}
    assert "evaluator" in plan.table()
    with pytest.raises(PlanError, match="the rollout nodes hold 0 learner rank"):
        build_plan(8, 4, "disaggregated", {SIM: 3, INF: 1, LEARN: 0}, 1, evaluators=1)
    with pytest.raises(PlanError, match=r"leaves none to train: give each node one more "
                       r"learner, placement.per_node=\{simulator: 2, inference: 1, learner: 2\} "
                       r"\(5 ranks per node\)"):  # it took the only one
        build_plan(4, 4, "disaggregated", {SIM: 2, INF: 1, LEARN: 1}, evaluators=1)


def test_a_learner_cap_leaves_the_learner_nodes_other_ranks_spare():
    """A learner_nodes layout that lost a rollout node: 2 producers, 4 learner ranks."""
    per_node = {SIM: 2, INF: 2, LEARN: 0}
    with pytest.raises(PlanError, match=r"placement.learners=2 leaves the others spare"):
        build_plan(8, 4, "disaggregated", per_node, 1)
    plan = build_plan(8, 4, "disaggregated", per_node, 1, 2)
    assert plan.learners == (4, 5) and plan.with_role(SPARE) == (6, 7)
    assert [plan.ranks[r].cell for r in (6, 7)] == [None, None]
    assert "2 learner(s), 2 spare, inference:learner = 2:2" in plan.table()


@pytest.mark.parametrize("config,ranks,source", [
    ("default.yaml", 4, 1),  # reach, disaggregated: rank 0 is the inference rank
    ("maniskill_pickcube_tokens.yaml", 4, 1),
    ("hybrid.yaml", 4, 1),
    ("libero10_flow.yaml", 4, None),  # LIBERO's spec is its settings': rank 0 works it out
    ("colocated.yaml", 2, None),  # its loops build the envs after the policy
])
def test_the_env_spec_comes_from_the_first_simulators_env(config, ranks, source):
    """No rank builds an env only to learn the spec (a ManiSkill env takes seconds): where only
    a built env knows it, the first simulator tells the others."""
    from hpcvla.config import load_config
    from hpcvla.roles.prologue import spec_source
    from hpcvla.topology.plan import plan_from_config
    cfg = load_config(Path(__file__).parents[1] / "configs" / config)
    plan = plan_from_config(cfg.placement, ranks)
    assert spec_source(cfg, plan) == source
    if source is not None:
        assert plan.ranks[source].roles == (SIM,) and all(
            SIM not in r.roles for r in plan.ranks[:source])


def test_plan_refuses_auto_options_without_auto(capsys):
    """--search-envs and --costs choose how --auto searches: alone they would change nothing."""
    from hpcvla.cli import main
    for flags in (["--search-envs"], ["--costs", "table3"]):
        assert main(["plan", str(ROOT / "configs/default.yaml"), "--world", "4", *flags]) == 2
        assert "choose how --auto searches: add --auto" in capsys.readouterr().err


def test_plan_ranks_per_node_is_the_real_node_and_placement_emulates_inside_it(capsys):
    """`plan --ranks-per-node` is what the launcher gives train (srun's tasks per node);
    placement.ranks_per_node emulates smaller nodes inside it, as in train: the flag does not
    overwrite the config's setting, which must divide it."""
    import json
    from hpcvla.cli import main

    def plan(world, rpn, *overrides):
        return main(["plan", str(ROOT / "configs/default.yaml"), *overrides, "--json",
                     "--world", str(world), "--ranks-per-node", str(rpn)])
    assert plan(8, 8) == 2  # default's per_node is 4 ranks: a real node of 8 needs emulation
    assert "make placement.per_node sum to 8, or set placement.ranks_per_node=4" in \
        capsys.readouterr().err
    assert plan(8, 8, "placement.ranks_per_node=4") == 0
    assert json.loads(capsys.readouterr().out)["ranks_per_node"] == 4
    # a layout train refuses: said in the JSON too, not only on stderr
    assert plan(2, 2, "placement.mode=colocated") == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["refused"] == err.splitlines() and "train refuses it" in err, err
    # the checkpoints the job would start from: not there (train and sft refused them, plan
    # said nothing)
    for job in ([], ["--job", "sft"]):
        assert plan(4, 4, "policy.checkpoint=/nowhere", "run.resume=/nowhere", *job) == 2
        err = capsys.readouterr().err
        assert "policy.checkpoint = '/nowhere': expected a run directory holding a complete " \
            "checkpoint" in err and "run.resume = '/nowhere'" in err, err
    assert plan(8, 4) == 0
    assert json.loads(capsys.readouterr().out)["num_nodes"] == 2
    assert plan(12, 6, "placement.ranks_per_node=4") == 2
    assert "placement.ranks_per_node = 4 does not divide the real node size 6" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as ended:  # argparse's: the flag named
        plan(8, 0)
    assert ended.value.code == 2 and "argument --ranks-per-node: '0': give a whole number" \
        in capsys.readouterr().err
    # a dynamic batcher's B_max above a cell's envs (32 here) never fills: every forward
    # pass would wait out T_max
    assert plan(4, 4, "rollout.batch_max=33") == 2
    assert "rollout.batch_max = 33: expected at most the envs of every cell (the smallest " \
        "holds 32" in \
        capsys.readouterr().err
    assert plan(4, 4, "rollout.batch_max=32") == 0


@pytest.mark.parametrize("gpus", [1, 2])
def test_every_case_of_the_batching_sweep_is_a_layout_train_takes(gpus, capsys):
    """`bench modes --sweep batching`'s B_max values fit the cell of its layout (one GPU:
    one simulator a cell; a fixed 2 x envs was refused there)."""
    from hpcvla.bench.modes import _layout, _workload, cases
    from hpcvla.cli import main
    from hpcvla.scale.presets import PRESETS, ranks_for
    preset = PRESETS["balanced"]
    envs = preset["envs"]
    for _, mode, envs, extra, bound in cases("batching", envs, 2, gpus):
        args = [*_layout(mode, gpus), *_workload("emulated", preset, envs, 2, mode, bound),
                *extra]
        assert main(["plan", "--world", str(ranks_for(mode, gpus)), *args]) == 0, \
            capsys.readouterr().err

