"""The scale model (hpcvla/scale/): closed-form limits, the auto-planner and `plan --auto`."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from hpcvla.cli import main
from hpcvla.config import load_config
from hpcvla.scale.autoplan import looser_staleness, problem, search
from hpcvla.scale.model import Layout, Network, StageCosts, predict
from hpcvla.preflight import check_pipeline
from hpcvla.topology.plan import PlanError, plan_from_config

CELL = {"simulator": 2, "inference": 1, "learner": 1}


def costs(sim=0.01, a=0.001, b=0.0, learn=0.0001, sigma=0.0) -> StageCosts:
    return StageCosts(sim_median_s=sim, sim_sigma=sigma, inf_a_s=a, inf_b_s=b,
                      learn_s_per_segment=learn)


def near(x, y, rel=0.03):
    return abs(x / y - 1) <= rel


def test_learner_bound():
    """A learner far slower than rollout: throughput = its capacity."""
    lay = Layout("streamer", 4, 4, CELL, envs=16, shards=4, micro_batch=16, micro_batches=2,
                 epochs=2, max_staleness=2)
    c = costs(learn=0.05)
    capacity = lay.micro_batch * lay.segment_len * lay.chunk_len / (
        lay.micro_batch * c.learn_s_per_segment * lay.epochs)
    pred = predict(lay, c)
    assert near(pred.env_steps_per_s, capacity) and pred.bottleneck == "train"


def test_inference_bound():
    """Forward passes far slower than stepping: each cell serves B_max envs per a + b B."""
    lay = Layout("streamer", 8, 4, CELL, envs=16, shards=16, batch_max=8, wait_max_s=0.001,
                 max_staleness=4)
    c = costs(sim=0.001, a=0.02, b=0.002)
    capacity = 2 * 8 * lay.chunk_len / (c.inf_a_s + c.inf_b_s * 8)  # 2 cells
    pred = predict(lay, c)
    assert near(pred.env_steps_per_s, capacity) and pred.bottleneck == "infer"


def test_closed_loop_littles_law():
    """Fast learner, one shard per simulator, the batcher waits for the whole cell: the N envs
    of a cell cycle through step + forward pass, so X = N / R (Little's law)."""
    lay = Layout("train-async", 4, 4, CELL, envs=16, micro_batch=16, micro_batches=2,
                 max_staleness=8)
    c = costs(sim=0.04, a=0.005, b=0.0005)
    n = 2 * lay.envs
    cycle = c.sim_median_s + c.inf_a_s + c.inf_b_s * n
    pred = predict(lay, c)
    assert near(pred.env_steps_per_s, n * lay.chunk_len / cycle)


def test_colocated_closed_form():
    lay = Layout("sync-colocated", 2, 2, envs=16, micro_batch=16, micro_batches=2, epochs=1)
    c = costs(sim=0.03, a=0.004, b=0.001, learn=0.002)
    groups = 2
    infer = c.inf_a_s + c.inf_b_s * 16
    version = groups * lay.segment_len * (c.sim_median_s + infer) + infer + \
        2 * 16 * c.learn_s_per_segment
    steps = 2 * groups * lay.segment_len * 16 * lay.chunk_len
    assert near(predict(lay, c, updates=5).env_steps_per_s, steps / version, rel=1e-6)


def test_learner_start_overlaps_rollouts_where_the_roles_are_apart():
    """The learners' engine build (`learner_start_s`): a colocated run waits it out; a split
    one's cells fill the first versions' quota meanwhile, so its run grows by less."""
    start = 0.5
    for lay, hidden in ((Layout("sync-colocated", 2, 2, envs=16, micro_batch=16),
                         False),
                        (Layout("streamer", 4, 4, CELL, envs=16, shards=4, micro_batch=16,
                                micro_batches=2, max_staleness=1), True)):
        c = costs(sim=0.01, a=0.002, learn=0.002)
        cold, warm = (predict(lay, replace(c, learner_start_s=s), updates=4) for s in (start, 0))
        grown = cold.wall_s - warm.wall_s
        assert (0 < grown < start - 0.05) if hidden else near(grown, start, rel=1e-6), grown
        assert near(predict(lay, replace(c, learner_start_s=start)).env_steps_per_s,
                    predict(lay, c).env_steps_per_s, rel=1e-6)  # the steady rate: no start


def test_network_costs():
    net = Network()
    assert net.broadcast_s(1e9, 1) == 0 and net.allreduce_s(1e9, 1, 1) == 0
    assert math.isclose(net.broadcast_s(25e9, 2), 2.0 + 2e-6)
    # the inter-node part tends to 2 x bytes / link bandwidth
    assert net.allreduce_s(25e9, 64, 64) == pytest.approx(2 * 63 / 64 + 2 * 63 * 2e-6)


def test_autoplan_picks_more_learners_when_training_is_the_bottleneck():
    base = Layout("streamer", 8, 8, {"simulator": 6, "inference": 1, "learner": 1},
                  envs=16, shards=4, micro_batch=16, micro_batches=2)
    ranked = search(base, costs(learn=0.05))
    best, pred = ranked[0]
    assert best.per_node["learner"] == 2 and pred.bottleneck == "train"
    assert all(p.env_steps_per_s <= pred.env_steps_per_s for _, p in ranked[1:])
    assert problem(best) is None


def test_autoplan_layout_is_a_valid_config():
    base = Layout("streamer", 8, 4, CELL, envs=16, shards=2, micro_batch=16, micro_batches=2)
    best, _ = search(base, costs(sigma=0.5))[0]
    cfg = load_config(None, best.to_overrides())
    check_pipeline(cfg, plan_from_config(cfg.placement, 8))


@pytest.mark.slow
def test_cli_plan_auto(capsys):
    argv = ["plan", "--auto", "configs/default.yaml", "--world", "8", "--ranks-per-node",
            "4", "--costs", "balanced"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world"] == 8 and out["ranks_per_node"] == 4
    assert out["best"]["env_steps_per_s"] > 0 and out["best"]["bottleneck"] in (
        "simulate", "infer", "train")
    assert any(o.startswith("placement.per_node=") for o in out["best"]["overrides"])
    assert isinstance(out["runner_ups"], list) and out["runner_ups"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "env steps/s" in text and "bottleneck" in text and "runners-up" in text
    assert [row["max_staleness"] for row in out["looser_staleness"]] == [2, 3]  # default 1
    assert "under a looser staleness bound" in text


def test_a_tight_staleness_bound_caps_the_plan_and_the_planner_says_what_a_looser_gives():
    """More envs than the quota lets run, and segments that take longer to roll out than the
    learner's versions: the looser bounds predict more (never less), sync modes have none."""
    base = Layout("streamer", 4, 4, CELL, envs=64, shards=64, micro_batch=8, micro_batches=4,
                  max_staleness=1)
    slow_loop = costs(sim=0.08, a=0.01, b=0.001, learn=0.002, sigma=0.5)
    best, pred = search(base, slow_loop)[0]
    looser = looser_staleness(best, slow_loop)
    assert [bound for bound, _ in looser] == [2, 3]
    assert pred.env_steps_per_s < looser[0][1].env_steps_per_s <= looser[1][1].env_steps_per_s
    assert looser[1][1].env_steps_per_s > 1.2 * pred.env_steps_per_s
    assert looser_staleness(Layout("sync-disaggregated", 4, 4, CELL, envs=16), slow_loop) == []


@pytest.mark.parametrize("world,rpn,field", [(10, 4, "--world"), (4, 2, "--ranks-per-node"),
                                             (0, 4, "--world")])
def test_cli_plan_auto_bad_input(capsys, world, rpn, field):
    args = ["plan", "--auto", "configs/default.yaml", "--world", str(world),
            "--ranks-per-node", str(rpn), "--costs", "balanced"]
    if world < 1:  # argparse's, by the flag: a whole number of 1 or more
        with pytest.raises(SystemExit) as ended:
            main(args)
        assert ended.value.code == 2
    else:
        assert main(args) == 2
    assert field in capsys.readouterr().err


def test_bad_layout_is_refused():
    with pytest.raises(PlanError):
        predict(Layout("streamer", 6, 4), costs())
    assert "micro_batch" in problem(Layout("streamer", 4, 4, CELL, envs=16, shards=1,
                                           micro_batch=8))


def test_bench_modes_auto_sweep_runs_each_mode_at_its_planned_layout():
    """`bench modes --sweep auto`: the overrides it starts each mode with are the planner's
    best layout, with the emulated learner's delay following the planned micro-batch; the
    ideal bound reads the layout's role counts."""
    from hpcvla.bench import modes
    from hpcvla.config import load_config
    preset = modes.PRESETS["balanced"]
    for mode in ("sync-colocated", "streamer"):
        base = [f"pipeline.mode={mode}", *modes._layout(mode, 2),
                *modes._workload("emulated", preset, preset["envs"], 10, mode)]
        extra, predicted = modes.auto_layout(mode, base, "balanced", preset, 2)
        cfg = load_config(None, base + extra)
        assert predicted > 0
        assert cfg.pipeline.mode == mode
        assert cfg.emulate.learner_ms_per_micro_batch == pytest.approx(
            preset["learn_ms_per_segment"] * cfg.learner.micro_batch)
        assert cfg.learner.micro_batch * cfg.learner.micro_batches == 32  # batch kept
    # --max-staleness: the bound the async modes run under, which the planner keeps
    base = ["pipeline.mode=streamer", *modes._layout("streamer", 2),
            *modes._workload("emulated", preset, preset["envs"], 10, "streamer", staleness=4)]
    cfg = load_config(None, base + modes.auto_layout("streamer", base, "balanced", preset, 2)[0])
    assert cfg.pipeline.max_staleness == 4
    # the auto sweep: both modes at the bench's bound, the streamer also one and two looser
    assert [(mode, s) for _, mode, _, _, s in modes.cases("auto", 32, 2)] == [
        ("sync-colocated", 2), ("streamer", 2), ("streamer", 3), ("streamer", 4)]
    cfg = load_config(None, ["pipeline.mode=streamer", *modes._layout("streamer", 4),
                             *modes._workload("emulated", preset, 32, 10, "streamer")])
    # 2 nodes of (2 simulators, 1 inference, 1 learner): the learner bound, 2 x 16 x 8 x 4
    # steps per 170 ms micro-batch
    assert modes.ideal_bound("streamer", cfg, preset, 4) == pytest.approx(2 * 16 * 32 / 0.17)


def test_search_envs_adds_envs_only_while_they_pay():
    """`plan --auto --search-envs`: a closed loop too small for its stages gets more envs; once
    the learner is the bottleneck, the fewest envs within 2 % of the best (8, not 16-32)."""
    lay = Layout("streamer", 4, 4, CELL, envs=8, shards=8, micro_batch=16, micro_batches=2,
                 max_staleness=2)
    loop_bound = costs(sim=0.04, a=0.001, learn=0.002)  # 8 envs: 1,561 steps/s, learner 16,000
    fixed, grown = search(lay, loop_bound)[0], search(lay, loop_bound, search_envs=True)[0]
    assert fixed[0].envs == 8 and grown[0].envs >= 32
    assert grown[1].env_steps_per_s > 3 * fixed[1].env_steps_per_s
    learner_bound = costs(sim=0.04, a=0.001, learn=0.04)  # 800 steps/s from 8 envs on
    (best, pred), *others = search(lay, learner_bound, search_envs=True)
    assert best.envs == 8 and near(pred.env_steps_per_s, 800, rel=0.01)
    assert any(lay.envs > 8 and near(p.env_steps_per_s, 800, rel=0.01) for lay, p in others)


def test_bench_scale_writes_the_models_table_and_chart(tmp_path, capsys):
    """What `hpcvla bench scale` runs (scale.predict.run; here at 8 and 16 GPUs of its seven
    sizes: ~2 s a prediction): π0's predicted throughput, each row the model's prediction for
    that layout, the efficiency against linear scaling from the first row, the weights synced
    rank by rank never faster; its JSON and chart."""
    from matplotlib.image import imread

    from hpcvla.scale.predict import HDR, PI0_LIBERO, pi0_layout, run
    out, chart = tmp_path / "scale.json", tmp_path / "scale.png"
    rows = run(json_path=out, chart_path=chart, gpus=(8, 16))
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    assert [r["gpus"] for r in rows] == [8, 16] and rows[0]["efficiency"] == 1.0
    predicted = predict(pi0_layout(16), PI0_LIBERO, HDR, updates=None)
    assert rows[1]["env_steps_per_s"] == predicted.env_steps_per_s
    assert rows[1]["efficiency"] == pytest.approx(
        rows[1]["env_steps_per_s"] / (2 * rows[0]["env_steps_per_s"]))
    assert all(r["sequential_sync_env_steps_per_s"] <= r["env_steps_per_s"] for r in rows)
    assert f"{16:>5} {2:>5}" in capsys.readouterr().out
    assert imread(chart).std() > 0  # drawn, not blank
