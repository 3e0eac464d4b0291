"""Config loading: YAML + overrides into typed settings; every bad input names its field."""

from pathlib import Path

import re

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcvla.config import Config, ConfigError, describe_settings, dump_config, load_config
from hpcvla.config.loader import config_to_dict, recorded
from helpers import hpcvla, without_launcher

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    assert isinstance(load_config(path), Config)


def test_overrides_are_typed_and_win():
    cfg = load_config(ROOT / "configs/default.yaml",
                      ["learner.zero_stage=3", "placement.mode=hybrid",
                       "placement.per_node={simulator: 3, inference: 1, learner: 0}",
                       "launch.check_scheduler=false", "run.name=x y"])
    assert cfg.learner.zero_stage == 3 and cfg.placement.mode == "hybrid"
    assert cfg.placement.per_node == {"simulator": 3, "inference": 1, "learner": 0}
    assert cfg.launch.check_scheduler is False and cfg.run.name == "x y"


def test_exponent_floats_without_a_dot_are_floats():
    assert load_config(None, ["algorithm.lr=1e-3"]).algorithm.lr == 1e-3


def test_resolved_config_round_trips_with_its_paths_absolute(tmp_path, monkeypatch):
    """A run's config.yaml reads the same from any directory: the settings that name files
    or folders are recorded absolute (comma-separated lists each), nothing else changes."""
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "configs/libero_pi0.yaml", [
        "learner.zero_stage=2",
        "sft.demos=tests/a.h5, /data/b.h5", "run.resume="])
    dump_config(cfg, tmp_path / "config.yaml")
    expected = recorded(cfg)
    monkeypatch.chdir(tmp_path)
    again = load_config(tmp_path / "config.yaml")
    assert again.policy.pretrained == str(ROOT / "tests/fixtures/pi0/pi0/lerobot")
    assert again.policy.tokenizer == str(ROOT / "tests/fixtures/pi0/tokenizer")
    assert again.sft.demos == f"{ROOT / 'tests/a.h5'},/data/b.h5"
    assert again.run.root == str(ROOT / "runs") and again.run.resume == ""
    assert again == expected and recorded(again) == again
    paths = {"run.root", "policy.pretrained", "policy.tokenizer", "sft.demos"}
    assert config_to_dict(again) == {
        section: {k: (v if f"{section}.{k}" in paths else getattr(getattr(cfg, section), k))
                  for k, v in values.items()}
        for section, values in config_to_dict(again).items()}


def test_a_resume_records_its_config_and_names_what_it_changed(tmp_path, monkeypatch):
    """config.yaml stays the first run's; each resume adds its own and lists the settings
    that differ from the config the run last ran with (a relative path that names the same
    file is no change)."""
    from hpcvla.config import last_run_config, write_run_config
    monkeypatch.chdir(ROOT)
    demos = ["sft.demos=tests/a.h5", "placement.per_node={simulator: 2, inference: 1}"]
    assert write_run_config(load_config("configs/default.yaml", demos), tmp_path) == []
    assert last_run_config(tmp_path) == tmp_path / "config.yaml"
    first = (tmp_path / "config.yaml").read_text()
    resume = f"run.resume={tmp_path}"
    same = load_config("configs/default.yaml", [*demos, resume, "run.name=other",
                                                "run.root=elsewhere"])
    assert write_run_config(same, tmp_path) == []
    assert last_run_config(tmp_path).name.startswith("config.resume-")
    monkeypatch.setattr("time.strftime", lambda *_: "later")  # another resume's file name
    changed = load_config("configs/default.yaml", [
        resume, "sft.demos=/data/b.h5", "algorithm.name=grpo", "algorithm.group_size=4",
        "rollout.segment_len=20", "placement.per_node={simulator: 2, inference: 2}"])
    assert write_run_config(changed, tmp_path) == [
        "placement.per_node: {'simulator': 2, 'inference': 1} -> {'simulator': 2, 'inference': 2}",
        "algorithm.name: 'ppo' -> 'grpo'", "algorithm.group_size: 8 -> 4",
        "rollout.segment_len: 8 -> 20", f"sft.demos: '{ROOT / 'tests/a.h5'}' -> '/data/b.h5'"]
    assert last_run_config(tmp_path) == tmp_path / "config.resume-later.yaml"
    assert (tmp_path / "config.yaml").read_text() == first


@pytest.mark.parametrize("overrides,field,valid", [
    (["learner.zero_stage=4"], "learner.zero_stage", "<= 3"),
    (["learner.zero_stage=two"], "learner.zero_stage", "an int"),
    (["learner.zero_stage=true"], "learner.zero_stage", "an int"),
    (["placement.mode=diagonal"], "placement.mode", "one of colocated, disaggregated, hybrid"),
    (["placement.ranks_per_node=-1"], "placement.ranks_per_node", ">= 0"),
    (["placement.per_node={simulator: 2, gpu: 1}"], "placement.per_node",
     "keys among simulator, inference, learner"),
    (["placement.per_node={simulator: x}"], "placement.per_node", "a mapping of str to int"),
    (["placement.per_node.learner=-2"], "placement.per_node.learner", ">= 0"),
    (["learner.zero_stag=1"], "learner.zero_stag", "did you mean `zero_stage`"),
    (["learnr.zero_stage=1"], "learnr", "did you mean `learner`"),
    (["learner=3"], "learner", "a mapping"),
    (["run.seed"], "override", "section.field=value"),
    (["placement.mode=hybrid", "placement.learner_nodes=1"], "placement.learner_nodes",
     "0 unless placement.mode is disaggregated"),
    (["env.camera=false"], "env.camera", "true, except for env.name=maniskill"),
    # a camera rendered every step and read by nothing
    (["env.name=maniskill", "env.wrist_image=true"], "env.wrist_image",
     "false for policy.name=default (it reads one camera, `image`"),
    # held-out evaluation during training: where it runs, what it films
    (["eval.every=5"], "placement.evaluators", "1 with eval.every > 0 in a disaggregated"),
    (["placement.evaluators=1"], "placement.evaluators", "0 unless eval.every > 0"),
    (["placement.evaluators=2", "eval.every=5"], "placement.evaluators", "<= 1"),
    (["placement.mode=colocated", "placement.evaluators=1", "eval.every=5"],
     "placement.evaluators", "0 unless placement.mode is disaggregated"),
    (["placement.evaluators=1", "eval.every=5", "eval.video_every=7"], "eval.video_every",
     "a multiple of eval.every (5; > 0)"),
    # the critic's warm-up: versions under PPO, gradient steps under sac and rlpd
    (["algorithm.name=grpo", "rollout.segment_len=8", "algorithm.critic_warmup_versions=2"],
     "algorithm.critic_warmup_versions", "0 with algorithm.name=grpo (only ppo warms a value "
     "critic up by versions; grpo trains no critic"),
    (["pipeline.total_updates=5", "algorithm.critic_warmup_versions=5"],
     "algorithm.critic_warmup_versions", "below pipeline.total_updates (5)"),
    # PPO's loss and advantages
    (["algorithm.dual_clip=0.5"], "algorithm.dual_clip", "0 (off) or above 1"),
    (["algorithm.advantage_norm=batch"], "algorithm.advantage_norm",
     "micro_batch or none with pipeline.mode=streamer"),
    (["algorithm.name=grpo", "rollout.segment_len=20", "algorithm.advantage_norm=none"],
     "algorithm.advantage_norm", "algorithm.name=grpo does not read it (ppo does)"),
    (["algorithm.critic_warmup=100"], "algorithm.critic_warmup",
     "ppo's critic warms up by versions: algorithm.critic_warmup_versions"),
    (["algorithm.name=sac", "algorithm.lr_warmup_versions=3"], "algorithm.lr_warmup_versions",
     "0 with algorithm.name=sac (ppo or grpo's"),
    (["algorithm.name=sac", "algorithm.weight_decay=0.01"], "algorithm.weight_decay",
     "0 with algorithm.name=sac (its temperature, a trained parameter, would decay to 1)"),
    # hpcvla sft's learning-rate schedule
    (["sft.steps=100", "sft.warmup_steps=100"], "sft.warmup_steps", "below sft.steps (100)"),
    (["sft.final_lr=1e-5"], "sft.final_lr", "0 unless sft.schedule=cosine"),
    (["sft.schedule=cosine", "sft.lr=1e-4", "sft.final_lr=1e-3"], "sft.final_lr",
     "at most sft.lr (0.0001)"),
    (["sft.schedule=linear"], "sft.schedule", "one of constant, cosine"),
    (["sft.val_every=50"], "sft.val_every", "0 without sft.val_demos"),
    (["policy.temprature=1"], "policy.temprature", "did you mean `temperature`?"),
    (["learner.lr=1e-4"], "learner.lr", "no such setting here (it is `algorithm.lr` or `sft.lr`)"),
])
def test_bad_values_name_field_value_and_fix(overrides, field, valid):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/default.yaml", overrides)
    message = str(err.value)
    assert f"  {field} = " in message and valid in message, message


def test_horovod_backend_is_accepted_only_where_it_can_run():
    from hpcvla.engines.horovod import horovod_available
    from hpcvla.preflight import check_config

    missing = horovod_available()
    if missing:  # refused before any rank starts, saying how to get it
        with pytest.raises(ConfigError, match="make install-horovod"):
            check_config(load_config(ROOT / "configs/default.yaml", ["learner.backend=horovod"]))
    else:  # the check that refuses it where it is missing lets it through
        assert check_config(load_config(ROOT / "configs/default.yaml", [
            "learner.backend=horovod"])).learner.backend == "horovod"
    with pytest.raises(ConfigError, match="no fp32 masters"):
        load_config(ROOT / "configs/reach_flow.yaml",
                    ["learner.backend=horovod", "policy.dtype=bfloat16"])


def test_env_shards_must_divide_the_envs_only_where_the_mode_shards_them():
    with pytest.raises(ConfigError, match=r"env.shards = 2: expected a divisor of "
                                          r"env.envs_per_simulator \(3\)"):
        load_config(ROOT / "configs/default.yaml", ["env.envs_per_simulator=3"])  # streamer
    for mode in ("sync-colocated", "sync-disaggregated"):  # one shard: env.shards unread
        overrides = ["env.envs_per_simulator=3", f"pipeline.mode={mode}"]
        if mode == "sync-colocated":
            overrides.append("placement.mode=colocated")
        assert load_config(ROOT / "configs/default.yaml", overrides).env.shards == 2


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["learner.zero_stage=9", "placement.mode=x", "run.bogus=1"])
    assert [p[0] for p in err.value.problems] == ["run.bogus", "placement.mode",
                                                   "learner.zero_stage"]


def test_the_error_names_where_the_bad_setting_came_from():
    """A problem the command line brought is not blamed on the file or the built-in defaults."""
    for path, overrides, origin in [
            (None, ["run.out_dir=x"], "invalid command-line settings over the built-in defaults:"),
            (ROOT / "configs/default.yaml", ["run.out_dir=x"],
             f"invalid {ROOT / 'configs/default.yaml'} with its command-line overrides:")]:
        with pytest.raises(ConfigError) as err:
            load_config(path, overrides)
        assert str(err.value).startswith(origin), err.value


def test_a_command_with_an_optional_config_takes_overrides_alone(capsys):
    """`hpcvla train|config|doctor key=value ...` overrides the built-in defaults: the first
    `key=value` is no config file's name."""
    from hpcvla.cli import main

    assert main(["config", "run.seed=7", "learner.zero_stage=2"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert (resolved["run"]["seed"], resolved["learner"]["zero_stage"]) == (7, 2)
    assert main(["train", "run.out_dir=x"]) == 2  # refused before any rank starts
    assert "invalid command-line settings over the built-in defaults:\n  run.out_dir" \
        in capsys.readouterr().err


def test_malformed_and_missing_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("placement:\n  mode: [colocated\n")
    with pytest.raises(ConfigError, match=r"YAML at line \d+"):
        load_config(bad)
    with pytest.raises(ConfigError, match="a readable YAML file"):
        load_config(tmp_path / "missing.yaml")
    run = tmp_path / "default-20261207-120000"  # a run's folder, given as its config
    run.mkdir()
    (run / "config.yaml").write_text("{}\n")
    with pytest.raises(ConfigError, match=f"this is a run directory: to go on with it, "
                       f"run.resume={run}; the settings it ran with are {run}/config.yaml"):
        load_config(run)
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="a mapping of sections"):
        load_config(tmp_path / "list.yaml")


def test_every_setting_is_documented():
    rows = describe_settings()
    assert {name for name, *_ in rows} >= {"learner.zero_stage", "placement.mode",
                                           "placement.per_node", "run.root"}
    for name, _type, _default, doc in rows:
        assert len(doc) > 30, f"{name} needs a doc that says what it is and its trade-off"


def test_config_doc_gives_a_configs_values_beside_the_defaults(capsys):
    """`hpcvla config --doc` lists every setting (or a section's, or one); with a config (or
    overrides), each value there that is not the default; a config that cannot be read is
    refused, not ignored."""
    from hpcvla.cli import main
    assert main(["config", "--doc"]) == 0
    plain = capsys.readouterr().out
    assert plain.count("  (") == len(describe_settings()) and ", here " not in plain
    assert main(["config", "configs/reach_flow.yaml", "--doc", "run.seed=5"]) == 0
    text = capsys.readouterr().out
    assert "pipeline.total_updates  (int, default 500, here 300)" in text
    assert "run.seed  (int, default 0, here 5)" in text
    assert "learner.zero_stage  (int, default 1)\n" in text  # the same there
    assert main(["config", "configs/nonexistent.yaml", "--doc"]) == 2
    capsys.readouterr()
    # a section's settings, or one setting; a name that is neither is refused with a hint
    assert main(["config", "--doc", "learner"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines() if "  (" in line]
    assert names and all(n.startswith("learner.") for n in names), names
    assert main(["config", "configs/reach_flow.yaml", "--doc", "pipeline.total_updates"]) == 0
    assert capsys.readouterr().out.startswith("pipeline.total_updates  (int, default 500, "
                                              "here 300)\n")
    assert main(["config", "--doc", "learnr"]) == 2
    assert "--doc = 'learnr': expected a section or a setting (did you mean `learner`?)" in \
        capsys.readouterr().err


def test_a_files_override_style_keys_get_the_nesting_they_need(tmp_path):
    """`run.name: x` and `env: reach` in a YAML file (the command line's style, or a section
    named by its value) are refused with the nested form that is meant."""
    for text, said in (("run.name: x\n", "run.name = 'x': expected no such setting (in a file, "
                        "nest it: `run: {name: ...}`)"),
                       ("env: reach\n", "env = 'reach': expected a mapping (did you mean "
                        "`env: {name: reach}`?)")):
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(ConfigError) as refused:
            load_config(tmp_path / "c.yaml")
        assert said in str(refused.value)


# A value of any YAML-ish type for any known field: either a valid Config or a ConfigError
# naming that field (on itself, or in the message of a cross-field rule on its partner); never
# another exception.
scalars = st.one_of(st.integers(-5, 10), st.booleans(), st.text(max_size=8), st.floats(),
                    st.none(), st.dictionaries(st.text(max_size=5), st.integers(-2, 5), max_size=3))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([name for name, *_ in describe_settings()]), scalars)
def test_fuzzed_values_are_accepted_or_named(name, value):
    import yaml
    try:
        load_config(None, [f"{name}={yaml.safe_dump(value, default_flow_style=True).strip()}"])
    except ConfigError as err:  # the field itself, or a cross-field rule naming it
        assert err.problems and any(p[0].startswith(name) or name in p[2]
                                    for p in err.problems), err


@pytest.mark.mpi
def test_cli_rejects_bad_config_before_any_rank_starts():
    for args, says in ((["learner.zero_stage=7", "--ranks", "4"],
                        "learner.zero_stage = 7: expected an int >= 0 and <= 3"),
                       (["--ranks", "6"], "make placement.per_node sum to 6"),
                       # too few for the three roles: the layout that fits is named
                       (["--ranks", "2"], "run colocated (configs/colocated.yaml")):
        out = without_launcher("train", ROOT / "configs/default.yaml", *args)
        assert out.returncode == 2 and says in out.stderr, out.stderr


def test_the_traits_tables_and_the_registries_name_the_same_families_and_simulators():
    """config/families.py sits below the implementations (the config checks read it before
    any package is imported): the registries above must agree with it."""
    from hpcvla.config.families import FAMILIES, SIMULATORS
    from hpcvla.envs.registry import ENVS, GPU_ENVS
    from hpcvla.policies.registry import POLICIES

    assert set(FAMILIES) == set(POLICIES) and set(SIMULATORS) == set(ENVS)
    assert {n for n, t in SIMULATORS.items() if t.gpu_simulation} == set(GPU_ENVS)
    assert all(POLICIES[n].family == n for n in POLICIES)
    # a real simulator's package, host memory and renderer check each have a row (a missing
    # one was read as none: 0 bytes planned, "renders nothing" passed, no version recorded)
    from hpcvla.doctor.render import RENDER
    from hpcvla.memory.simulators import MEASURED
    real = {n for n, t in SIMULATORS.items() if not t.emulated}
    assert real == {n for n, t in SIMULATORS.items() if t.package} == set(RENDER)
    assert set(MEASURED) == set(SIMULATORS)
    # an algorithm's row: an advantage its learner computes (objective.advantages_of has no
    # fallback to pick), settings that are algorithm.* fields (a misspelt one would never be
    # refused), and the name algorithm.name accepts
    from dataclasses import fields

    from hpcvla.config.families import ADVANTAGES, ALGORITHMS
    from hpcvla.config.learning import AlgorithmConfig
    names = {f.name for f in fields(AlgorithmConfig)}
    for name, traits in ALGORITHMS.items():
        assert traits.advantage in (*ADVANTAGES, ""), name
        assert set(traits.settings) <= names, (name, set(traits.settings) - names)
    choices = next(f for f in fields(AlgorithmConfig) if f.name == "name").metadata["choices"]
    assert choices == tuple(ALGORITHMS)


def test_a_world_hpcvla_train_started_does_not_check_again_what_it_checked(monkeypatch):
    """`hpcvla train` hands the world it starts what check_launch passed (a token of this
    host, the config and the plan): that world's check_world, one rank's seconds while the
    others wait (a simulator's import, a tokenizer), has nothing left to do. Another config
    or plan, or no token (srun, mpiexec), is checked."""
    from hpcvla import preflight
    from hpcvla.topology.plan import plan_from_config
    checked = []
    real = preflight.file_problems
    monkeypatch.setattr(preflight, "file_problems",
                        lambda cfg, *last: checked.append(cfg) or real(cfg, *last))
    cfg = load_config(ROOT / "configs/default.yaml")
    plan = plan_from_config(cfg.placement, 4)
    monkeypatch.delenv(preflight.LAUNCH_CHECKED, raising=False)
    preflight.check_world(cfg, plan, "config")  # srun, mpiexec: no token
    assert len(checked) == 1
    token = preflight.check_launch(cfg, plan)[preflight.LAUNCH_CHECKED]
    monkeypatch.setenv(preflight.LAUNCH_CHECKED, token)
    preflight.check_world(cfg, plan, "config")
    assert len(checked) == 2  # check_launch's own; none in the world's
    other = load_config(ROOT / "configs/default.yaml", ["run.seed=1"])
    two_nodes = plan_from_config(cfg.placement, 8, 4)  # a world over two nodes of 4
    for cfg_, plan_ in ((other, plan), (cfg, two_nodes)):
        preflight.check_world(cfg_, plan_, "config")
    assert len(checked) == 4
    monkeypatch.setenv(preflight.LAUNCH_CHECKED, "elsewhere:" + token.split(":", 1)[1])
    preflight.check_world(cfg, plan, "config")  # checked on another host
    assert len(checked) == 5


@pytest.mark.mpi
def test_every_command_resolves_a_resume_without_a_config_to_the_runs_own(tmp_path):
    """`hpcvla config run.resume=DIR` (and doctor, plan) show what `hpcvla train
    run.resume=DIR` would run: the config the run last ran with, not the built-in default."""
    from hpcvla.config import load_config
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("env: {envs_per_simulator: 4}\npipeline: {total_updates: 7}\n")
    cfg = load_config(None, [f"run.resume={run}"])
    assert cfg.pipeline.total_updates == 7 and cfg.env.envs_per_simulator == 4
    (run / "config.resume-20261205-000000.yaml").write_text("pipeline: {total_updates: 9}\n")
    assert load_config(None, [f"run.resume={run}"]).pipeline.total_updates == 9
    out = hpcvla("config", f"run.resume={run}")
    assert out.returncode == 0 and "total_updates: 9" in out.stdout, out.stderr
    # a mistyped run, or a checkpoint's folder: named, not the built-in defaults' layout
    # refused on a machine that cannot hold it
    for typo, hint in ((tmp_path / "runn", "none is there\n"),
                       (run / "checkpoints" / "v000002", f"the run is {run}")):
        out = hpcvla("train", f"run.resume={typo}", "--ranks", 2)
        assert out.returncode == 2 and f"run.resume = '{typo}': expected a run's directory" \
            in out.stderr and hint in out.stderr, out.stderr


def test_one_key_of_a_mapping_setting_keeps_the_defaults_other_keys():
    """`placement.per_node.learner=2` over the built-in defaults (which spell per_node out
    nowhere) changes the learners only (it dropped the simulators and inference ranks)."""
    cfg = load_config(None, ["placement.per_node.learner=2"])
    assert cfg.placement.per_node == {"simulator": 2, "inference": 1, "learner": 2}
    whole = load_config(None, ["placement.per_node={simulator: 3, inference: 1, learner: 1}"])
    assert whole.placement.per_node == {"simulator": 3, "inference": 1, "learner": 1}


def test_a_section_given_twice_in_a_file_is_refused_naming_both_lines(tmp_path):
    """YAML keeps the last of two `learner:` sections silently (the first's zero_stage lost).
    A merge key's settings may be given again: that is what it is for."""
    path = tmp_path / "twice.yaml"
    path.write_text("learner:\n  zero_stage: 3\npipeline: {total_updates: 3}\nlearner:\n"
                    "  epochs: 2\n")
    with pytest.raises(ConfigError, match=r"`learner` given twice \(lines 1 and 4\)"):
        load_config(path)
    path.write_text("base: &base {epochs: 2, zero_stage: 2}\n")
    merged = tmp_path / "merged.yaml"
    merged.write_text("learner:\n  <<: {epochs: 2, zero_stage: 2}\n  epochs: 3\n")
    assert (load_config(merged).learner.epochs, load_config(merged).learner.zero_stage) == (3, 2)


def test_a_step_timeout_in_milliseconds_is_refused():
    with pytest.raises(ConfigError, match=r"env.step_timeout_s = 0.001: expected 0 \(no "
                                          r"watchdog\) or at least 1 \(seconds\)"):
        load_config(None, ["env.step_timeout_s=0.001"])
    assert load_config(None, ["env.step_timeout_s=0"]).env.step_timeout_s == 0
    with pytest.raises(ConfigError, match=r"env.build_timeout_s = 0.5: expected 0 \(no "
                                          r"watchdog\) or at least 1 \(seconds\)"):
        load_config(None, ["env.build_timeout_s=0.5"])


def test_rlinfs_flow_sde_noise_is_one_steps():
    """policy.flow_noise=sde (RLinf's flow-SDE step) noises the one step random_step draws:
    other modes refuse it, naming the mode; a family without a flow refuses the setting."""
    cfg = load_config("configs/reach_flow.yaml", ["policy.logprob_mode=random_step",
                                                  "policy.flow_noise=sde",
                                                  "policy.noise_level=0.3"])
    assert (cfg.policy.flow_noise, cfg.policy.noise_level) == ("sde", 0.3)
    with pytest.raises(ConfigError, match=r"policy.flow_noise = 'sde': expected learned unless "
                                          r"policy.logprob_mode=random_step"):
        load_config("configs/reach_flow.yaml", ["policy.flow_noise=sde"])
    with pytest.raises(ConfigError, match=r"policy.flow_noise = 'sde': .*\(flow does\)"):
        load_config("configs/reach_tokens.yaml", ["policy.flow_noise=sde"])


@pytest.mark.parametrize("text,kind", [("123", "int"), ("[]", "list"), ('"a"', "str")])
def test_a_pretrained_config_json_that_is_not_an_object_is_named(tmp_path, text, kind):
    """A truncated or foreign config.json that is valid JSON but no object: the folder check
    names it (it was a traceback)."""
    import torch
    from safetensors.torch import save_file

    from hpcvla.weight_checks import pretrained_problems
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(text)
    cfg = load_config(None, ["policy.name=flow", f"policy.pretrained={tmp_path}"])
    [(field, _, why)] = pretrained_problems(cfg.policy, cfg.env)
    assert field == "policy.pretrained" and f"not a JSON object (it holds a {kind})" in why


def test_a_hub_id_given_as_a_pretrained_folder_is_told_how_to_download_it(tmp_path,
                                                                          monkeypatch):
    """`policy.pretrained=lerobot/pi0_libero`: the ranks read folders (compute nodes often
    reach no internet), so a hub id is named as one, with the command that downloads it on a
    login node; a missing path that is no hub id is said missing alone."""
    from hpcvla.weight_checks import pretrained_problems
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["policy.name=flow", "policy.pretrained=lerobot/pi0_libero"])
    [(field, value, why)] = pretrained_problems(cfg.policy, cfg.env)
    assert field == "policy.pretrained" and "; nothing is there (lerobot/pi0_libero looks like " \
        "a Hugging Face hub id" in why and "`hf download lerobot/pi0_libero --local-dir " \
        "<folder>`" in why, why
    cfg = load_config(None, ["policy.name=flow", f"policy.pretrained={tmp_path}/a/b"])
    [(_, _, why)] = pretrained_problems(cfg.policy, cfg.env)
    assert why.endswith("; nothing is there"), why
    cfg = load_config(None, ["policy.name=flow", "policy.pretrained=fixtures/pi0/lerobot"])
    [(_, _, why)] = pretrained_problems(cfg.policy, cfg.env)  # a relative path: from where
    assert why.endswith(f"; nothing is there (a path from the current folder, {tmp_path})"), why


def test_a_setting_without_its_value_is_not_only_a_missing_file():
    """`hpcvla train learner.epochs 4` reads `learner.epochs` as the config file: the error
    says the setting needs `=VALUE` too."""
    with pytest.raises(ConfigError, match=r"as a setting it needs a value: learner.epochs=VALUE"):
        load_config("learner.epochs", ["4"])
    for name in ("missing.yaml", "env.yaml"):
        with pytest.raises(ConfigError) as err:
            load_config(name)
        assert "needs a value" not in str(err.value)


def test_a_text_setting_takes_what_was_typed():
    """YAML 1.1 reads `off` as false and `1.5` as a number: a text setting gets the text, so
    `run.wandb=off` is named with its choices (it said `False: expected a str`)."""
    assert load_config(None, ["run.name=1.5"]).run.name == "1.5"
    assert load_config(None, ["run.name=yes"]).run.name == "yes"
    with pytest.raises(ConfigError, match=r"run.wandb = 'off': expected one of disabled, "
                                          r"offline, online"):
        load_config(None, ["run.wandb=off"])
    assert load_config(None, ["learner.epochs=4"]).learner.epochs == 4
    assert load_config(None, ["run.resume=null"]).run.resume == ""  # unset, not "null"


def test_a_family_setting_typed_for_a_family_that_does_not_read_it_is_refused():
    """`policy.size=full` on the built-in default policy trained the small CNN silently;
    typed on the command line, a setting the chosen family does not read is refused. A
    config file's settings of another family stay (switching families by policy.name)."""
    with pytest.raises(ConfigError, match=r"policy.size = 'full': expected none: policy.name="
                                          r"default does not read it \(flow, tokens, oft do\)"):
        load_config(None, ["policy.size=full"])
    with pytest.raises(ConfigError, match=r"policy.denoise_steps = 3: .*\(flow does\)"):
        load_config("configs/reach_tokens.yaml", ["policy.denoise_steps=3"])
    switched = load_config("configs/reach_flow.yaml", ["policy.name=oft", "policy.size=tiny"])
    assert switched.policy.name == "oft" and switched.policy.denoise_steps == 4
    # the algorithm's alike: GRPO's groups under PPO, SAC's buffer under GRPO
    with pytest.raises(ConfigError, match=r"algorithm.group_size = 4: expected none: algorithm"
                                          r".name=ppo does not read it \(grpo does\)"):
        load_config(None, ["algorithm.group_size=4"])
    with pytest.raises(ConfigError, match=r"algorithm.utd = 2.0: .*\(sac, rlpd do\)"):
        load_config("configs/reach_grpo.yaml", ["algorithm.utd=2"])
    assert load_config("configs/maniskill_pushcube.yaml", ["algorithm.name=ppo"]).algorithm \
        .group_size == 4  # the file's, switching algorithms
    assert load_config(None, ["algorithm.noise_bound=1.0"])  # the default: changes nothing
    # a pretrained folder sets a flow or OFT policy's sizes: policy.size with it is refused
    with pytest.raises(ConfigError, match=r"policy.size = 'full': expected none: the folder "
                                          r"policy.pretrained=.* sets the sizes; to build at "
                                          r"this size without it: policy.pretrained= "):
        load_config("configs/libero_pi0.yaml", ["policy.size=full"])
    assert load_config("configs/libero_pi0.yaml", ["policy.pretrained=", "policy.tokenizer=",
                                                   "policy.size=full"]).policy.size == "full"


def test_a_config_files_setting_its_own_choices_do_not_read_is_refused(tmp_path):
    """A user's YAML with GRPO's `group_size` and no algorithm.name ran PPO without a word: a
    file's settings are judged by the file's own choices, as typed ones are (typing the
    file's own choice again changes nothing). A command line that re-points a recipe leaves
    the file's other settings as a recipe's. A run's record of what it ran is read as it was
    written (`record`, as every reader of a run's config.yaml reads it: the runs recorded
    before this rule too), and `hpcvla config` prints what loads back as a file."""
    from hpcvla.config.checks import as_read
    path = tmp_path / "mine.yaml"
    path.write_text("algorithm:\n  group_size: 4\npolicy:\n  name: flow\n  size: tiny\n"
                    "  denoise_steps: 3\n")
    for typed in ([], ["algorithm.name=ppo"]):
        with pytest.raises(ConfigError, match=r"algorithm.group_size = 4: expected none: "
                                              r"algorithm.name=ppo does not read it \(grpo "
                                              r"does\); drop it"):
            load_config(path, typed)
    assert load_config(path, ["algorithm.name=grpo", "rollout.segment_len=20"]).algorithm \
        .group_size == 4
    assert load_config(path, ["algorithm.name=sac"]).algorithm.group_size == 4  # re-pointed
    path.write_text("policy:\n  denoise_steps: 3\n")  # flow's, on the default policy
    with pytest.raises(ConfigError, match=r"policy.denoise_steps = 3: .*\(flow does\)"):
        load_config(path)
    switched = load_config("configs/reach_flow.yaml", ["policy.name=oft", "policy.size=tiny"])
    assert switched.policy.denoise_steps == 4  # the recipe's, not read by oft
    run = tmp_path / "run"
    run.mkdir()
    dump_config(switched, run / "config.yaml")
    with pytest.raises(ConfigError, match=r"policy.denoise_steps = 4: expected none"):
        load_config(run / "config.yaml")  # as a user's file
    assert load_config(run / "config.yaml", record=True) == recorded(switched)
    assert load_config(None, [f"run.resume={run}"]).policy.denoise_steps == 4  # a resume's
    dump_config(as_read(switched), tmp_path / "printed.yaml")
    printed = load_config(tmp_path / "printed.yaml")
    assert printed.policy.denoise_steps == 0 and printed.learner.epochs == 4  # read: kept


@pytest.mark.parametrize("chosen, unread, readers", [
    ("algorithm.name=sac", "learner.epochs=4", "ppo, grpo do"),
    ("algorithm.name=sac", "algorithm.clip=0.1", "ppo, grpo do"),
    ("algorithm.name=sac", "algorithm.entropy_coef=0.01", "ppo, grpo do"),
    ("algorithm.name=sac", "algorithm.gae_lambda=0.9", "ppo does"),
    ("algorithm.name=grpo", "algorithm.value_coef=1.0", "ppo does"),
    ("algorithm.name=grpo", "algorithm.critic_lr=0.001", "ppo, sac, rlpd do"),
    ("algorithm.name=grpo", "algorithm.gamma=0.9", "ppo, sac, rlpd do"),
    ("pipeline.mode=sync-disaggregated", "pipeline.max_staleness=3",
     "train-async, rollout-async, streamer do"),
    ("pipeline.mode=train-async", "rollout.wait_max_ms=50", "rollout-async, streamer do"),
    ("env.name=reach", "env.state_mode=visual", "maniskill does"),
    ("env.name=libero", "env.latency_median_ms=5", "reach does"),
    ("env.name=maniskill", "env.suite_task=3", "libero does"),
    ("env.name=maniskill", "env.suite=libero_10", "libero does"),
    ("env.name=maniskill", "env.state_format=axis_angle", "libero does"),
    ("env.name=libero", "env.task=PushCube-v1", "maniskill does"),
    ("env.name=libero", "env.state_mode=visual", "maniskill does"),
    ("placement.mode=colocated", "placement.per_node={simulator: 1, inference: 1, learner: 2}",
     "disaggregated, hybrid do"),
    ("placement.mode=colocated", "placement.per_node.learner=2", "disaggregated, hybrid do"),
    ("eval.every=0", "eval.episodes=64", "eval.every > 0 does"),
    ("eval.every=0", "eval.deterministic=false", "eval.every > 0 does")])
def test_a_setting_the_chosen_algorithm_mode_or_simulator_does_not_read_is_refused(
        chosen, unread, readers):
    """A sweep over a setting nothing reads runs identical arms: typed on the command line,
    it is refused, naming what would read it; at its default it loads (benches pass every
    arm's settings); a mapping's one key is the mapping typed."""
    key = ".".join(unread.partition("=")[0].split(".")[:2])
    chooser = chosen.partition("=")[0]
    base = {"algorithm.name=grpo": "configs/reach_grpo.yaml",
            "placement.mode=colocated": "configs/colocated.yaml"}.get(chosen)
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} = .*: expected none: "
                                          rf"{re.escape(chosen)} does not read it "
                                          rf"\({readers}\); drop it, or set {chooser}"):
        load_config(base, [chosen, unread])
    from hpcvla.config.checks import _default_of
    assert load_config(base, [chosen, f"{key}={_default_of(key)}"])
    if key == "pipeline.max_staleness":  # what the synchronous modes run at: said, it loads
        assert load_config(base, [chosen, f"{key}=0"])


def test_a_home_folder_in_a_path_setting_is_expanded(tmp_path, monkeypatch):
    """`run: {root: ~/runs}` in a file (or quoted on a command line): the shell expands no
    `~` there, and the run went to a folder named `~` under the working directory."""
    import os
    path = tmp_path / "home.yaml"
    path.write_text("run:\n  root: ~/runs\n")
    home = os.path.expanduser("~")
    assert load_config(path).run.root == f"{home}/runs"
    cfg = load_config(None, ["sft.demos=~/a.h5, b.h5", "policy.pretrained=~/pi0"])
    assert (cfg.sft.demos, cfg.policy.pretrained) == (f"{home}/a.h5,b.h5", f"{home}/pi0")
    run = tmp_path / "home" / "runs" / "r"  # a resume without a config reads the run's own
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("pipeline: {total_updates: 7}\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_config(None, ["run.resume=~/runs/r"])
    assert (cfg.pipeline.total_updates, cfg.run.resume) == (7, str(run))


@pytest.mark.parametrize("override,said", [
    ("pipeline.mode=streamr", "(did you mean `streamer`?)"),
    ("policy.name=pi0", "(did you mean `flow`?)"),  # LeRobot's and openpi's name for it
    ("policy.name=OpenVLA-OFT", "(did you mean `oft`?)"),
    ("placement.per_node.inferance=1", "(got inferance; did you mean `inference`?)"),
    ("algorithm.name=PPO", "(did you mean `ppo`?)"),  # another case: no hint was offered
    ("run.name=", "run.name = '': expected a name for the run's directory"),
    ("run.name=-x", "not starting with '-'"),
    ("run.name=a/b", "no '/'")])
def test_misspelt_choices_and_unusable_run_names_are_refused_with_the_fix(override, said):
    """A close choice is offered; an empty run name made a directory `-<time>`, which
    shells take for an option, and one with a '/' a folder elsewhere."""
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(None, [override])


def test_an_abbreviated_flag_is_not_taken_for_the_longer_one(capsys):
    """argparse's prefix matching took `train --rank 4` for `--ranks 4` and started a
    world; `--ranks-per 4` for --ranks-per-node."""
    from hpcvla.cli import main
    with pytest.raises(SystemExit) as ended:
        main(["plan", "--world", "4", "--ranks-per", "4"])
    assert ended.value.code == 2
    assert "unrecognized arguments: --ranks-per" in capsys.readouterr().err


@pytest.mark.parametrize("args,said", [
    (["plan", "--world", "-3"], "argument --world: '-3': give a whole number, 1 or more"),
    (["plan", "--world", "4", "--ranks-per-node", "0"], "argument --ranks-per-node: '0'"),
    (["launch", "--timeout", "0", "--", "true"], "--timeout: '0': give seconds, a number above"),
    (["launch", "--timeout", "nan", "--", "true"], "--timeout: 'nan': give seconds")])
def test_counts_and_seconds_out_of_range_are_refused_by_their_flag(args, said, capsys):
    """`plan --world -3` blamed a ranks-per-node the user never gave; `launch --timeout 0`
    started a world and killed it at once, `nan` never."""
    from hpcvla.cli import main
    with pytest.raises(SystemExit) as ended:
        main(args)
    assert ended.value.code == 2 and said in capsys.readouterr().err


def test_an_empty_config_file_is_refused_not_run_as_the_defaults(tmp_path):
    """A file that holds no setting (empty, or its settings commented out) ran the built-in
    defaults; `{}` says so on purpose."""
    path = tmp_path / "mine.yaml"
    path.write_text("# learner:\n#   micro_batch: 8\n")
    with pytest.raises(ConfigError, match="it holds none: give no CONFIG, or `{}`"):
        load_config(path)
    path.write_text("{}\n")
    assert load_config(path) == load_config(None)


@pytest.mark.parametrize("text,said", [
    ("learner:\nmicro_batch: 4\n", "learner: expected a mapping (it is empty: indent its "
     "settings under it)"),
    ("learner:\n  micro_batch: \"8\"\n", "expected an int (quoted: drop the quotes)"),
    ("run:\n  wandb: off\n", "run.wandb = False: expected a str, one of disabled, offline, "
     "online (YAML reads off, on, no and yes unquoted as false or true: did you mean "
     "`disabled`?)"),
    ("run:\n  name: yes\n", "run.name = True: expected a str (YAML reads off, on, no and "
     "yes unquoted as false or true: quote the word)")])
def test_yaml_slips_are_said_with_their_fix(tmp_path, text, said):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(path)

