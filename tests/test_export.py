"""A trained policy written back in the layout of the published folder it started from
(policies/export.py, `hpcvla export`): the reference's own loader reads it and acts as hpcvla
ran it. Against the references: LeRobot 0.6.1 loaded hpcvla's exports of trained π0/π0.5
policies, OpenVLA-OFT's code that of a trained OFT (tests/fixtures/{pi0,oft}/export_trained.py,
then check_exports.py in their side environments), and what they computed is each folder's
`exported_io.safetensors`. Every fixture folder, LeRobot's,
openpi's and OpenVLA-OFT's, comes back byte for byte when the policy is exported unchanged.
(`hpcvla export` of a whole run: the LIBERO run test in test_pi0_pretrained.py.)"""

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpcvla.factory import build_policy
from hpcvla.policies.export import save_like
from hpcvla.policies.folders import read_tensors
from hpcvla.policies.oft_checkpoint import to_published
from test_oft_reference import LOGIT_TOL, OFFICIAL_PROPRIO, SAMPLES, env_obs, reference_io
from test_oft_reference import config as oft_config
from test_pi0_pretrained import EXECUTED, FIXTURES, config, fixture, raw_observation

OFT_CHECKPOINT = Path(__file__).parent / "fixtures" / "oft" / "checkpoint"


def fixture_script(path: Path):
    """A fixture folder's export_trained.py, as a module."""
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_export_trained", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


export_trained = fixture_script(FIXTURES / "export_trained.py")
export_oft = fixture_script(OFT_CHECKPOINT.parent / "export_trained.py")


@pytest.fixture(scope="module")
def oft_io():
    return reference_io()


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("folder", ["pi0/lerobot", "pi0/lerobot_tied", "pi0/lerobot_sharded",
                                    "pi0/openpi", "pi05/lerobot", "pi05/lerobot_tied",
                                    "pi05/lerobot_sharded", "pi05/openpi", "variants/finetuned",
                                    "variants/relative", "variants/steps6"])
def test_an_unchanged_pi0_comes_back_byte_for_byte(folder, tmp_path):
    family = "pi05" if folder.startswith("pi05") else "pi0"
    obs, env = raw_observation(*fixture(family))
    policy = build_policy(config(FIXTURES / folder, **{"policy.denoise_steps": 0}), env)
    written = save_like(policy, FIXTURES / folder, tmp_path / "out")
    assert files_of(tmp_path / "out") == files_of(FIXTURES / folder)
    assert written["rl_heads_left_out"] > 0 and written["from_policy"] > 80
    # kept from the source: the expert's unused lm_head, and PaliGemma's lm_head beside the
    # embed_tokens π0 computes with (openpi's and the tied files hold one of them)
    assert written["from_source"] == (1 if folder.endswith(("tied", "openpi")) else 2)


def test_a_hub_cache_snapshot_exports_as_plain_files(tmp_path):
    """A folder as the Hugging Face hub cache holds it (snapshots/<rev>/ files are symlinks
    into blobs/): the export writes plain files with the same bytes."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "0123abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted((FIXTURES / "pi0/lerobot").iterdir())):
        shutil.copy(file, blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / f"blob{i}")
    obs, env = raw_observation(*fixture("pi0"))
    policy = build_policy(config(snapshot), env)
    save_like(policy, snapshot, tmp_path / "out")
    assert not any(p.is_symlink() for p in (tmp_path / "out").iterdir())
    assert files_of(tmp_path / "out") == files_of(FIXTURES / "pi0/lerobot")


@pytest.mark.parametrize("proprio", [False, True])
def test_an_unchanged_oft_comes_back_byte_for_byte(oft_io, proprio, tmp_path):
    obs, env = env_obs(oft_io, wrist=proprio, state=proprio)
    policy = build_policy(oft_config(**(OFFICIAL_PROPRIO if proprio else {})), env)
    written = save_like(policy, OFT_CHECKPOINT, tmp_path / "out")
    assert files_of(tmp_path / "out") == files_of(OFT_CHECKPOINT)
    assert written["from_source"] == 13  # SigLIP's pooling head, which OFT never runs
    assert written["other_files"] == (["proprio_projector--100_checkpoint.pt"] if proprio else [])


@pytest.mark.parametrize("name", list(export_trained.SOURCES))
def test_lerobot_acts_from_a_trained_export_as_hpcvla_did(name, tmp_path):
    """LeRobot's `from_pretrained(strict=True)` and processors on the exported folder give the
    trained policy's deterministic chunk (the tied file's lm_head carries the trained
    embed_tokens; a folder keeping both has the trained embed_tokens); hpcvla reads its export
    back to the same chunk."""
    policy, obs = export_trained.export(name, tmp_path / name)
    reference = load_file(str(FIXTURES / "exported_io.safetensors"))
    torch.testing.assert_close(obs["state"], reference["raw.observation.state"])
    with torch.no_grad():
        trained = policy.act(obs, deterministic=True).actions
        torch.testing.assert_close(trained, reference[f"{name}.actions"][:, :EXECUTED],
                                   rtol=0, atol=1e-5)
        source = FIXTURES / export_trained.SOURCES[name][1]
        before = build_policy(config(source, **{"policy.denoise_steps": 0}), policy_spec(name))
        assert (before.act(obs, deterministic=True).actions - trained).abs().max() > 1e-2
        again = build_policy(config(tmp_path / name, **{"policy.denoise_steps": 0}),
                             policy_spec(name))
        torch.testing.assert_close(again.act(obs, deterministic=True).actions, trained,
                                   rtol=0, atol=1e-6)


def policy_spec(name):
    return raw_observation(*fixture(export_trained.SOURCES[name][0]))[1]


def test_a_source_with_a_value_head_gets_the_trained_one(oft_io, tmp_path):
    """An OFT folder that holds RLinf's value head in its shards (value_head.mlp.*): the
    export writes the trained value head there, in the shard's dtype; no RL head is left out."""
    import json

    from safetensors.torch import save_file
    folder = tmp_path / "with_value_head"
    shutil.copytree(OFT_CHECKPOINT, folder)
    shard = "model-00004-of-00004.safetensors"
    tensors = load_file(str(folder / shard))
    head = load_file(str(OFT_CHECKPOINT.parent / "rlinf_value_head.safetensors"))
    save_file({**tensors, **{k: v.to(torch.bfloat16) for k, v in head.items()}},
              str(folder / shard), metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: shard for k in head})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    obs, env = env_obs(oft_io)
    policy = build_policy(oft_config(folder), env)
    with torch.no_grad():
        policy.value_head[0].weight.add_(0.5)
    written = save_like(policy, folder, tmp_path / "out")
    assert written["rl_heads_left_out"] == 0
    out = load_file(str(tmp_path / "out" / shard))
    torch.testing.assert_close(out["value_head.mlp.0.weight"],
                               policy.value_head[0].weight.detach().to(torch.bfloat16))


def test_a_trained_oft_is_written_in_the_sources_dtype_and_key_format(oft_io, tmp_path):
    """OFT's bf16 shards get the trained float32 weights rounded to bf16 (its fused qkv and
    timm names: oft_checkpoint.to_published), its proprio projector .pt keeps DDP's `module.`
    names; hpcvla reads the export back to those weights."""
    obs, env = env_obs(oft_io, wrist=True, state=True)
    policy = build_policy(oft_config(**OFFICIAL_PROPRIO), env)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.01)
    save_like(policy, OFT_CHECKPOINT, tmp_path / "out")
    again = build_policy(oft_config(tmp_path / "out", **OFFICIAL_PROPRIO), env)
    trained, read = (to_published(p.state_dict()) for p in (policy, again))
    assert set(read) == set(trained)  # DINOv2's cls row: folded into its cls token, both ways
    for key, value in trained.items():
        if not key.startswith("value_head."):
            torch.testing.assert_close(read[key], value.to(torch.bfloat16).float(), rtol=0,
                                       atol=0)
    ours = {k: v for k, v in again.state_dict().items() if k.startswith("proprio_projector.")}
    assert ours and all(torch.equal(v, policy.state_dict()[k]) for k, v in ours.items())
    source, out = read_tensors(OFT_CHECKPOINT), read_tensors(tmp_path / "out")
    assert {k: v.dtype for k, v in out.items()} == {k: v.dtype for k, v in source.items()}
    projector = torch.load(tmp_path / "out" / "proprio_projector--100_checkpoint.pt")
    assert all(k.startswith("module.") for k in projector)


def test_oft_acts_from_a_trained_export_as_hpcvla_reads_it(oft_io, tmp_path):
    """OpenVLA-OFT's own `from_pretrained` and `predict_action` on hpcvla's export of a trained
    policy in OFT's recipe (two images, the proprio token; tests/fixtures/oft/export_trained.py,
    then check_exports.py in OFT's side environment) give what hpcvla computes from the same
    folder: OFT's inference sequence on the fixture's inputs, logits to LOGIT_TOL (the tiny
    model's float32 rounding, test_oft_reference.py), actions to 1e-5; trained, it acts
    otherwise than the checkpoint it came from."""
    export_oft.export(tmp_path / "out")
    reference = load_file(str(OFT_CHECKPOINT.parent / "exported_io.safetensors"))
    for name, row in SAMPLES.items():
        sample = "libero" if name == "libero" else "raw"
        tasks = None if sample == "libero" else [oft_io["meta"]["tasks"][row]]
        obs, env = env_obs(oft_io, sample, tasks, wrist=True, state=True)
        policy = build_policy(oft_config(tmp_path / "out", **OFFICIAL_PROPRIO), env).eval()
        ids = oft_io[f"oft_proprio.{name}.input_ids"]
        assert torch.equal(reference[f"oft_proprio.{name}.input_ids"], ids)
        logits, actions = policy.predict_action_reference({
            "pixel_values": oft_io[f"oft_proprio.{name}.pixel_values"], "input_ids": ids,
            "prompt_mask": torch.ones_like(ids, dtype=torch.bool),
            "state": oft_io[f"oft_proprio.{name}.proprio_normalized"][None].float()})
        torch.testing.assert_close(logits[0, :, 31744:32000],
                                   reference[f"oft_proprio.{name}.action_logits"], rtol=0,
                                   atol=LOGIT_TOL)
        assert torch.equal(logits[0].argmax(dim=-1).view(8, 7),
                           reference[f"oft_proprio.{name}.action_token_ids"])
        trained = policy.processor.actions_out(actions[0], {}).double()
        torch.testing.assert_close(trained, reference[f"oft_proprio.{name}.actions"], rtol=0,
                                   atol=1e-5)
        assert (trained - oft_io[f"oft_proprio.{name}.actions"]).abs().max() > 0.05


def test_a_folder_that_is_not_the_policys_source_is_refused(tmp_path):
    obs, env = raw_observation(*fixture("pi0"))
    policy = build_policy(config(FIXTURES / "pi0/lerobot"), env)
    with pytest.raises(ValueError, match="no place for .* of the policy's tensor"):
        save_like(policy, FIXTURES / "pi05/lerobot", tmp_path / "out")
    with pytest.raises(ValueError, match="inside the source folder"):
        save_like(policy, FIXTURES / "pi0/lerobot", FIXTURES / "pi0/lerobot/sub")
    # a run from no published folder, or from one that has moved: the fix is named
    from hpcvla.config import load_config
    from hpcvla.export import export_policy
    with pytest.raises(ValueError, match=r"started from no pretrained folder \(policy\."
                       r"pretrained unset\); export it with --format hpcvla"):
        export_policy(load_config("configs/reach_flow.yaml"), tmp_path, tmp_path / "out",
                      "published")
    moved = load_config("configs/reach_flow.yaml", [f"policy.pretrained={tmp_path / 'moved'}"])
    for layout in ("published", "auto", "hpcvla"):  # a folder that moved, whatever the layout
        with pytest.raises(ValueError, match=r"policy\.pretrained = .*moved.*: expected a "
                           r"folder holding model\.safetensors .*edit policy\.pretrained in "
                           + re.escape(str(tmp_path / "config.yaml"))):
            export_policy(moved, tmp_path, tmp_path / "out", layout)
    assert not (tmp_path / "out").exists()
    # a folder holding files (an earlier sharded export's index would win over the new
    # weights): refused, named, before anything is built
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match=r"out: a new or empty folder to write the policy in "
                       r"\(it holds model.safetensors.index.json\)"):
        export_policy(load_config("configs/reach_flow.yaml"), tmp_path, tmp_path / "out",
                      "hpcvla")


def test_written_weights_get_the_umasks_mode(tmp_path):
    """safetensors writes 0600; a checkpoint's or an exported policy's files get what the
    umask gives any new file, for the group on a shared file system to read."""
    import os
    import stat

    from hpcvla.checkpoint.store import save_file
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.policies import save_pretrained
    cfg = load_config("configs/default.yaml")
    before = os.umask(0o027)
    try:
        save_file({"a": torch.zeros(2)}, tmp_path / "x.safetensors")
        save_pretrained(build_policy(cfg, env_spec(cfg.env)), tmp_path / "policy")
    finally:
        os.umask(before)
    for path in (tmp_path / "x.safetensors", tmp_path / "policy" / "model.safetensors",
                 tmp_path / "policy" / "config.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o640, path



def test_written_weights_get_what_a_folders_default_acl_gives(tmp_path):
    """A project space grants its group access by a default ACL, which the umask does not
    narrow: a checkpoint's files get the mode any new file gets there (a chmod to the
    umask's mode took the group's access away under umask 077)."""
    import os
    import stat
    import struct

    from hpcvla.checkpoint.store import save_file
    # user rwx, group 12345 r-x, mask rwx, others none (setfacl -d -m g:12345:rx)
    entries = [(0x01, 7, -1), (0x04, 0, -1), (0x08, 5, 12345), (0x10, 7, -1), (0x20, 0, -1)]
    os.setxattr(tmp_path, "system.posix_acl_default", struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", tag, perm, ident & 0xFFFFFFFF) for tag, perm, ident in entries))
    before = os.umask(0o077)
    try:
        (tmp_path / "plain").touch()
        save_file({"a": torch.zeros(2)}, tmp_path / "x.safetensors")
    finally:
        os.umask(before)
    mode = stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    assert mode == 0o660  # the group's mask: rw (its grant r-x, masked by the create's rw-)
    assert stat.S_IMODE((tmp_path / "x.safetensors").stat().st_mode) == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "x.safetensors"]
