"""The normalization statistics of published π0/π0.5 folders, as their references write them:
LeRobot's processor pipelines (`policy_preprocessor.json` / `policy_postprocessor.json` and
their safetensors) and openpi's `assets/<asset id>/norm_stats.json`. What they mean is
policies/processor.py's."""

from __future__ import annotations

import json
from pathlib import Path

from hpcvla.policies.folders import tensor_shapes


# LeRobot's processor files and the feature whose statistics each holds (actions: the
# post-processor, which unnormalizes them)
PROCESSORS = {"policy_preprocessor.json": "observation.state",
              "policy_postprocessor.json": "action"}


def is_lerobot(folder) -> bool:
    """A LeRobot folder: it holds either of its processor files (lerobot_steps names the other
    where it is missing); openpi's hold neither."""
    return any((Path(folder) / name).is_file() for name in PROCESSORS)


def lerobot_steps(folder: Path) -> tuple[dict, dict]:
    """LeRobot's processor pipelines: the statistics (feature -> stat -> tensor; actions from
    the post-processor, which unnormalizes them), and per step what we read: the normalizer's
    (eps, norm_map), the tokenizer's max_length, the relative and absolute action steps'
    configs."""
    from safetensors.torch import load_file

    stats, steps = {}, {}
    for name, feature in PROCESSORS.items():
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{folder}: {name} is missing (LeRobot writes it beside the "
                             "weights; it names the normalization statistics)")
        for step in json.loads(path.read_text()).get("steps", []):
            config = step.get("config", {})
            if step.get("registry_name") == "tokenizer_processor":
                steps["tokenizer_processor"] = config.get("max_length")
            if step.get("registry_name") in ("relative_actions_processor",
                                             "absolute_actions_processor"):
                steps[step["registry_name"]] = config
            if step.get("registry_name") in ("normalizer_processor",
                                             "unnormalizer_processor") and "state_file" in step:
                steps.setdefault("normalizer_processor", (config.get("eps", 1e-8),
                                                          config.get("norm_map", {})))
                tensors = load_file(str(folder / step["state_file"]))
                prefix = feature + "."
                found = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
                if not found:
                    raise ValueError(f"{folder / step['state_file']}: no {feature} statistics")
                stats[feature] = found
    if "normalizer_processor" not in steps or len(stats) < 2:
        raise ValueError(f"{folder}: the processor files hold no normalizer step with "
                         "statistics for observation.state and action")
    return stats, steps


def _statistics_in_weights(folder: Path) -> bool:
    """Whether the weights hold LeRobot's normalization buffers (its layout before the
    processor pipelines), from the files' headers."""
    try:
        names = tensor_shapes(folder)
    except ValueError:  # no weights: named elsewhere
        return False
    return any(k.startswith(("normalize_inputs.", "normalize_targets.", "unnormalize_outputs."))
               for k in names)


class AssetChoice(ValueError):
    """policy.asset_id does not pick one of an openpi folder's statistics (a config problem
    of that setting; the message says what it should be)."""


def openpi_stats(folder: Path, asset_id: str = "") -> tuple[dict, Path]:
    """openpi's `assets/<asset id>/norm_stats.json`: the folder's only one, or `asset_id`'s
    (policy.asset_id; openpi's base checkpoints ship one per robot of their mixture)."""
    found = sorted(folder.glob("assets/**/norm_stats.json"))
    if not found and _statistics_in_weights(folder):
        raise ValueError(f"{folder}: a LeRobot folder from before LeRobot 0.4, whose "
                         "normalization statistics are buffers in its weights "
                         "(normalize_inputs.*): LeRobot's own migration writes them as the "
                         "processor files read here: `python -m "
                         "lerobot.processor.migrate_policy_normalization --pretrained-path "
                         f"{folder} --output-dir <new folder>` (LeRobot >= 0.4)")
    ids = [f.parent.relative_to(folder / "assets").as_posix() for f in found]
    if asset_id:
        if asset_id not in ids:
            raise AssetChoice(f"an asset id of {folder}: it has no assets/{asset_id}/"
                              f"norm_stats.json (its ids: {ids or 'none'})")
        found = [found[ids.index(asset_id)]]
    elif len(found) > 1:
        raise AssetChoice(f"one of {ids}: {folder} holds {len(found)} sets of normalization "
                          "statistics, assets/<id>/norm_stats.json (openpi's base checkpoints "
                          "ship one per robot): name the one the env's robot and actions were "
                          f"normalized with, e.g. policy.asset_id={ids[0]}")
    elif not found:
        raise ValueError(f"{folder}: no assets/<id>/norm_stats.json (nor LeRobot's processor "
                         "files): the checkpoint's normalization statistics are needed")
    stats = json.loads(found[0].read_text()).get("norm_stats", {})
    for key in ("state", "actions"):
        if key not in stats:
            raise ValueError(f"{found[0]}: no {key!r} statistics")
    return stats, found[0]


__all__ = ["AssetChoice", "lerobot_steps", "openpi_stats"]
