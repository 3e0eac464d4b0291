"""`hpcvla bench learning`: the statistics, and a short real run of both modes, compared on
`hpcvla eval` of their final checkpoints."""

import json
import math

import numpy as np
import pytest
import yaml

from matplotlib.image import imread

from hpcvla.bench.learning import (PPO_BASELINE, _plot, curve, held_out_of, prior_data_arms,
                                   scratch_arms)
from hpcvla.config import load_config
from hpcvla.metrics.stats import welch_interval
from helpers import ROOT, hpcvla


def test_welch_interval_matches_the_textbook_formula():
    from scipy.stats import t
    from hpcvla.metrics.stats import T975
    assert T975 == pytest.approx([t.ppf(0.975, df) for df in range(1, 31)], abs=6e-4)
    a, b = [0.9, 0.95, 0.85], [0.8, 0.9, 0.7, 0.75]
    diff, low, high = welch_interval(a, b)
    va, vb = np.var(a, ddof=1) / 3, np.var(b, ddof=1) / 4
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 3)  # Welch-Satterthwaite: 4.85 here
    assert diff == pytest.approx(np.mean(a) - np.mean(b))
    # t at the degrees of freedom rounded down (the conservative side)
    assert (high - low) / 2 / se == pytest.approx(t.ppf(0.975, math.floor(df)), abs=6e-4)
    assert (high + low) / 2 == pytest.approx(diff)
    assert welch_interval([0.5, 0.5], [0.5, 0.5]) == (0.0, 0.0, 0.0)


def test_held_out_curves_give_the_env_steps_to_the_target_success():
    records = [{"update": 1}, {"held_out": {"trained_env_steps": 100, "success_rate": 0.5}},
               {"held_out": {"trained_env_steps": 200, "success_rate": 0.81}},
               {"held_out": {"trained_env_steps": 300, "success_rate": 0.7}}]
    assert held_out_of(records) == {"held_out": [[100, 0.5], [200, 0.81], [300, 0.7]],
                                    "env_steps_to_0.8": 200}
    assert held_out_of(records[:2])["env_steps_to_0.8"] is None
    assert held_out_of(records[:1]) == {}  # no held-out evaluation while training
    training = [{"trained_env_steps": 100, "success_rate": 0.2}, *records[1:],
                {"trained_env_steps": 300, "success_rate": 0.6}]
    assert curve(training, np.array([100, 200, 300])) == [0.2, 0.4, 0.6]  # theirs left out


def test_the_prior_data_and_scratch_arms_are_valid_runs_of_one_task_and_layout():
    """RLPD from the demonstrations against PPO from their SFT: both configs load, with the
    same env, layout and env steps per version, and evaluate held-out states while training;
    PPO trains as the task's PPO baseline recipe does."""
    cfgs = {}
    for arm, (config, *args) in prior_data_arms().items():
        args = [a.format(pretrained="sft-run", demos="demos.h5") for a in args if "=" in a]
        cfgs[arm] = load_config(ROOT / config, args)
    rlpd, ppo = cfgs["rlpd"], cfgs["ppo"]
    assert (rlpd.algorithm.name, ppo.algorithm.name) == ("rlpd", "ppo")
    assert rlpd.env == ppo.env and rlpd.placement == ppo.placement
    assert rlpd.rollout == ppo.rollout and rlpd.learner.micro_batch == ppo.learner.micro_batch
    assert rlpd.eval.every == ppo.eval.every > 0 and ppo.policy.checkpoint == "sft-run"
    baseline, recipe = load_config(ROOT / PPO_BASELINE), yaml.safe_load(
        (ROOT / PPO_BASELINE).read_text())
    for key in recipe["algorithm"]:  # set there; the rest (SAC's) PPO does not read
        assert getattr(ppo.algorithm, key) == getattr(baseline.algorithm, key), key
    assert ppo.learner.epochs == baseline.learner.epochs
    sac, scratch_ppo = (load_config(ROOT / config, [a for a in args if "=" in a])
                        for config, *args in scratch_arms().values())  # no demos, no SFT
    assert (sac.algorithm.name, sac.algorithm.demos, scratch_ppo.policy.checkpoint) == \
        ("sac", "", "")
    assert scratch_ppo.algorithm == ppo.algorithm and sac.env == ppo.env


def test_the_dsrl_arms_steer_and_fine_tune_one_pretrained_flow_policy():
    """DSRL (SAC on the flow family: the noise actor) against PPO on the whole flow policy,
    both from the pretrained folder, in one layout and env-step budget."""
    from hpcvla.bench.learning import ARMS, PRETRAIN, env_steps_per_version
    cfgs = {arm: load_config(ROOT / config, [a.format(pretrained="start") for a in args
                                             if "=" in a])
            for arm, (config, *args) in ARMS["dsrl"].items()}
    dsrl, ppo = cfgs["dsrl"], cfgs["ppo"]
    assert (dsrl.algorithm.name, ppo.algorithm.name) == ("sac", "ppo")
    assert dsrl.policy == ppo.policy and dsrl.policy.name == "flow"
    assert dsrl.policy.pretrained == "start" and dsrl.placement == ppo.placement
    assert PRETRAIN["dsrl"][0] == ARMS["dsrl"]["ppo"][0]  # pretrained on the arms' recipe
    assert env_steps_per_version({"ppo": ARMS["dsrl"]["ppo"]}) == \
        env_steps_per_version(ARMS["dsrl"])
    # the noise actor on the state alone against on everything: one setting apart
    state, every = (load_config(ROOT / config, [a.format(pretrained="start") for a in args
                                                if "=" in a])
                    for config, *args in ARMS["dsrl-state"].values())
    assert every == dsrl and state.placement == every.placement and state.env == every.env
    assert {k for k, v in vars(state.algorithm).items() if getattr(every.algorithm, k) != v} \
        == {"noise_obs"}
    assert PRETRAIN["dsrl-state"] == PRETRAIN["dsrl"]


def test_the_dsrl_sft_arms_steer_and_train_one_sft_start_of_a_flow_recipe():
    """DSRL (the noise actor on the state, reach's DSRL settings but its temperature) against
    the recipe's own RL, both from its SFT run: one env, layout and env-step budget."""
    from hpcvla.bench.learning import (ARMS, DSRL_SETTINGS, FLOW_SFT_CONFIG, dsrl_sft_arms,
                                       env_steps_per_version)
    arms = dsrl_sft_arms()
    dsrl, recipe = (load_config(ROOT / config, [a.format(pretrained="sft") for a in args
                                                if "=" in a]) for config, *args in arms.values())
    assert arms["recipe"][0] == FLOW_SFT_CONFIG and recipe == load_config(
        ROOT / FLOW_SFT_CONFIG, ["policy.checkpoint=sft"])  # the recipe as it is
    assert (dsrl.algorithm.name, dsrl.algorithm.noise_obs, recipe.algorithm.name) == \
        ("sac", "state", "grpo")
    assert dsrl.policy == recipe.policy and dsrl.env == recipe.env
    assert dsrl.placement == recipe.placement and dsrl.learner == recipe.learner
    reach = load_config(ROOT / ARMS["dsrl"]["dsrl"][0], DSRL_SETTINGS).algorithm
    for setting in DSRL_SETTINGS:  # reach's DSRL settings, but a smaller temperature
        field = setting.split("=")[0].removeprefix("algorithm.")
        assert (getattr(dsrl.algorithm, field) == getattr(reach, field)) == \
            (field != "init_temperature"), setting
    assert dsrl.algorithm.init_temperature == reach.init_temperature / 100
    assert env_steps_per_version({"recipe": arms["recipe"]}) == env_steps_per_version(arms)


@pytest.mark.parametrize("from_sft", [True, False])
def test_the_setting_arms_differ_in_the_settings_alone(from_sft):
    """`--arms setting`: the recipe with the `--setting`s against it as it is, from its SFT
    run (`--demos`) or a fresh policy; one layout and env-step budget."""
    from dataclasses import replace

    from hpcvla.bench.learning import env_steps_per_version, setting_arms
    recipe = "configs/reach_oft_l1.yaml"
    settings = ["algorithm.lr_warmup_versions=10", "algorithm.critic_warmup_versions=2"]
    arms = setting_arms(recipe, settings, from_sft)
    changed, as_is = (load_config(ROOT / config, [a.format(pretrained="sft") for a in args
                                                  if "=" in a]) for config, *args in arms.values())
    assert as_is == load_config(ROOT / recipe, ["policy.checkpoint=sft"] if from_sft else [])
    assert (changed.algorithm.lr_warmup_versions, changed.algorithm.critic_warmup_versions) == \
        (10, 2)
    assert replace(changed, algorithm=as_is.algorithm) == as_is
    assert arms["changed"][1:3] == arms["recipe"][1:3] == ["--ranks", "4"]
    assert env_steps_per_version({"recipe": arms["recipe"]}) == env_steps_per_version(arms)


def test_a_seed_whose_evaluation_gave_no_verdict_is_left_out_of_the_comparison(
        tmp_path, monkeypatch, capsys):
    """`bench learning` over seeds whose runs are given (train_and_eval's results, recorded,
    not trained here): an evaluation every episode of which was an env fault (success None)
    is printed `-`, left out of the arm's mean and of the difference, whose seeds are
    counted; an arm with no verdict at all has no difference, said so."""
    from hpcvla.bench import learning

    def done(eval_success):
        return {"summary": {"success_rate": 0.5, "wall_s": 1.0, "env_steps": 100},
                "metrics": [{"trained_env_steps": 100, "success_rate": 0.5}],
                "eval": {"success_rate": eval_success},
                "eval_deterministic": {"success_rate": None}}
    verdicts = iter([0.75, 0.25, None, 0.5, 0.25, 0.25])  # seeds 0-2 of each arm
    monkeypatch.setattr(learning, "train_and_eval", lambda *_: done(next(verdicts)))
    results = learning.run(seeds=3, updates=2, json_path=tmp_path / "l.json", eval_episodes=4)
    out = capsys.readouterr().out
    streamer, colocated = (results["modes"][arm] for arm in ("streamer", "sync-colocated"))
    assert (streamer["eval_mean"], colocated["eval_mean"]) == (0.5, pytest.approx(1 / 3))
    assert streamer["eval_mean_deterministic"] is None
    difference = results["difference"]
    assert difference["seeds"] == [2, 3]
    assert difference["streamer_minus_sync-colocated"] == pytest.approx(0.5 - 1 / 3)
    assert results["deterministic_difference"] is None
    assert "streamer        seed 2: eval success - (deterministic -; rolling 0.500)" in out
    assert "deterministic difference: streamer -, sync-colocated -; no difference: an arm's " \
        "every evaluation gave no verdict" in out, out
    assert json.loads((tmp_path / "l.json").read_text())["deterministic_difference"] is None


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.bench
def test_learning_bench_runs_both_modes_on_one_budget(tmp_path):
    """The machinery, not the figures: the default job's 32 px and 1 epoch (overrides come
    last). ~50-80 s: the smallest bench that has an interval, two modes x two seeds (four
    training worlds) and their evaluations."""
    out = hpcvla("bench", "learning", "--quick", "--json", tmp_path / "learning.json",
                 "env.image_size=32", "learner.epochs=1", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "learning.json").read_text())
    assert list(results["modes"]) == ["streamer", "sync-colocated"]
    grid = results["grid_env_steps"]
    assert grid[-1] == results["env_step_budget"] == 3 * 32 * 8 * 4
    assert results["eval_episodes"] == 32
    for mode in results["modes"].values():
        assert [r["seed"] for r in mode["runs"]] == [0, 1]
        for run in mode["runs"]:
            assert len(run["curve"]) == len(grid) and 0 <= run["final_success"] <= 1
            assert 0 <= run["eval_success"] <= 1  # hpcvla eval of the final checkpoint
            assert 0 <= run["eval_success_deterministic"] <= 1  # and of its mean action
            assert math.isfinite(run["explained_variance"])  # the critic's, per micro-batch
    png = imread(tmp_path / "learning.png")  # the curves per seed and mean, next to the JSON
    assert png.shape[:2] == (460, 900) and png.std() > 0
    for name, of_run in (("difference", lambda r: r["eval_success"]),
                         ("deterministic_difference", lambda r: r["eval_success_deterministic"]),
                         ("rolling_difference", lambda r: r["final_success"]),
                         ("curve_difference", lambda r: np.mean(r["curve"]))):
        a, b = ([of_run(r) for r in results["modes"][mode]["runs"]]
                for mode in ("streamer", "sync-colocated"))
        assert results[name]["streamer_minus_sync-colocated"] == \
            pytest.approx(np.mean(a) - np.mean(b))
        assert results[name]["ci95"] == pytest.approx(list(welch_interval(a, b)[1:]))


def test_learning_chart_shades_the_interval_across_seeds(tmp_path):
    """Each mode's band: its colour at alpha 0.2 over white (#1f77b4 -> (210, 228, 240),
    #ff7f0e -> (255, 229, 207)) over a large area with 3 seeds, and nowhere with one seed
    (only the lines' anti-aliased edges pass through that colour)."""
    grid = np.linspace(1024, 10240, 10).tolist()

    def band_pixels(seeds: int) -> list[int]:
        rng = np.random.default_rng(0)
        results = {"grid_env_steps": grid, "modes": {
            mode: {"runs": [{"seed": s, "curve": np.clip(np.linspace(0, top, 10) +
                                                         rng.normal(0, 0.05, 10), 0, 1).tolist()}
                            for s in range(seeds)]} for mode, top in (("streamer", 0.9),
                                                                      ("sync-colocated", 0.6))}}
        _plot(results, tmp_path / f"learning{seeds}.png")
        rgb = (imread(tmp_path / f"learning{seeds}.png")[..., :3] * 255).round().astype(int)
        assert rgb.shape == (460, 900, 3)
        return [int((np.abs(rgb - band).max(-1) <= 3).sum())
                for band in ((210, 228, 240), (255, 229, 207))]

    assert min(band_pixels(3)) > 10_000 and max(band_pixels(1)) < 500


@pytest.mark.mpi
@pytest.mark.slow
def test_the_imitation_start_learns_from_as_many_demonstrations_as_asked(tmp_path):
    """`bench learning --arms imitation --demos N`: a recipe that needs more demonstrations
    than the default's 64 (configs/maniskill_pushcube_tokens.yaml: 256) gets them."""
    from hpcvla.bench.learning import imitation_start
    small = ["env.camera=false", "sft.steps=2", "sft.per_task=0"]
    run_dir, start = imitation_start(tmp_path, 4, small, "configs/maniskill_pushcube.yaml", 3)
    shown = hpcvla("inspect", tmp_path / "demos.h5", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)[0]["episodes"] == 3
    assert start["eval"]["episodes"] == 4 and (run_dir / "config.yaml").exists()


@pytest.mark.mpi
def test_imitation_settings_without_the_imitation_arms_are_refused(tmp_path):
    for args, says in ((["--demos", 3], "add --arms imitation"),
                       (["--arms", "scratch", "--demos", 3], "start without demonstrations"),
                       (["--arms", "imitation", "--demos", 0],
                        "argument --demos: '0': give a whole number, 1 or more"),
                       (["--demo-noise", 0], "add --arms imitation"),
                       (["--arms", "imitation", "--demo-noise", -1],
                        "--demo-noise must be >= 0, got -1"),
                       (["--setting", "algorithm.lr=1e-4"], "--arms setting go together"),
                       (["--arms", "setting", "--config", "configs/default.yaml"],
                        "--arms setting go together"),
                       (["--arms", "setting", "--setting", "algorithm.lr=1e-4"],
                        "--arms setting needs --config"),
                       # an override one arm does not read: before the other arm trains
                       (["--arms", "off-policy", "algorithm.utd=0.25"],
                        "invalid settings of arm ppo (configs/colocated.yaml")):
        out = hpcvla("bench", "learning", *args, "--json", tmp_path / "out.json")
        assert out.returncode == 2 and says in out.stderr, out.stderr
    assert not list(tmp_path.iterdir())  # nothing ran


def test_bench_options_a_target_ignores_or_cannot_run_are_refused(tmp_path, capsys,
                                                                  monkeypatch):
    """An option or override a benchmark would ignore, or a value it cannot run, is refused,
    naming it, before anything runs (nothing written); what a target reads is accepted."""
    from hpcvla.bench.command import _options_problem
    from hpcvla.cli import _parser, main
    for args, says in ((["modes", "env.image_size=64"], "key=value overrides: not read by "
                        "`hpcvla bench modes --workload emulated`"),
                       (["modes", "--ranks", "4"], "--ranks: not read"),
                       (["modes", "--workload", "real", "--max-staleness", "3"],
                        "--max-staleness: not read by `hpcvla bench modes --workload real`"),
                       (["scale", "--preset", "table3"], "--preset: not read by `hpcvla "
                        "bench scale`"),
                       (["policies", "--updates", "3", "--seeds", "2"], "--updates, --seeds"),
                       (["fullsize", "--steps", "plan,strmer", "--quick", "--out",
                         str(tmp_path / "fullsize")], "--steps strmer: no such step"),
                       (["modes", "--modes", "streamer,foo"], "--modes foo: no such mode"),
                       (["modes", "--gpus", "3"], "--gpus 3: an even number"),
                       (["modes", "--sweep", "auto", "--workload", "real"],
                        "--sweep auto: the emulated workload only")):
        assert main(["bench", *args, "--json", str(tmp_path / "out.json")]) == 2
        assert says in capsys.readouterr().err
    with monkeypatch.context() as patch:  # a target that runs the repository's recipes
        patch.chdir("/")
        assert main(["bench", "checkpoint", "--json", "out.json"]) == 2
    assert "run it from the repository's root" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # argparse's: a count below 1
        main(["bench", "shards", "--shards", "0", "--json", str(tmp_path / "out.json")])
    assert exit_.value.code == 2 and "argument --shards: '0'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    # results written at a benchmark's end: where they cannot be, refused first
    (tmp_path / "a_file").write_text("")
    for path, says in ((tmp_path / "a_file" / "out.json", "a_file is not a folder"),
                       (tmp_path, "a folder; name the file to write")):
        assert main(["bench", "policies", "--json", str(path)]) == 2
        assert f"--json {path}: " in (err := capsys.readouterr().err) and says in err, err
    from hpcvla.bench.command import _outputs_problem
    assert main(["bench", "modes", "--modes", "bogus", "--json", str(tmp_path / "new" / "x.json")
                 ]) == 2 and not (tmp_path / "new").exists()  # refused first: no folder made
    capsys.readouterr()
    later = tmp_path / "results" / "later"  # the folders they go in: made now
    assert _outputs_problem(_parser().parse_args(["bench", "scale", "--json", str(
        later / "scale.json"), "--chart", str(later / "chart.png")])) == "" and later.is_dir()
    for args in (["scale", "--validate", "--preset", "table3", "--updates", "3"],
                 ["modes", "--preset", "table3", "--max-staleness", "3", "--modes", "streamer"],
                 ["transport", "--ranks", "8", "--ranks-per-node", "2"],
                 ["learning", "--arms", "setting", "--config", "c.yaml", "--setting", "a=1"]):
        assert _options_problem(_parser().parse_args(["bench", *args])) == "", args
