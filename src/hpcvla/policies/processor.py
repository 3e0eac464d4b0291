"""A published checkpoint's inputs and outputs: raw env observations become the model inputs
it was trained on, its actions go back to the env's units.

    processor = CheckpointProcessor.from_folder(folder, tokenizer_folder, variant, vocab,
                                                state_dim, action_dim)
    model_obs = processor.inputs(obs)          # prompt ids, normalized state
    env_actions = processor.actions_out(a, obs)  # model (normalized) -> env units
    a = processor.actions_in(env_actions, obs)   # and back (demonstrations)

Built-in policies and folders written by `save_pretrained` (config.json with `hpcvla_policy`)
read the env's observations as they are: `from_folder` gives None for them. A LeRobot or
openpi π0/π0.5 folder needs three things the weights do not hold:

* **Prompt** (tokenizer from a local folder, `transformers.AutoTokenizer`: PaliGemma's is gated
  on the hub, users bring it), from the env's instruction ids decoded back to their words
  (hpcvla/text.py: lower-case words, as LIBERO's). π0 as LeRobot: BOS + task + "\\n"; π0 as
  openpi: the task cleaned (strip, `_` and newlines to spaces), then "\\n" encoded apart;
  π0.5: "Task: {cleaned}, State: {bins};\\nAction: ", bins = the normalized state digitized
  into 256 bins over [-1, 1] (np.digitize - 1: -1 below; LeRobot 0.4's processor padded the
  state with zeros to its max_state_dim first: policy.pi05_state=prompt_padded), or, trained
  with openpi's
  `discrete_state_input=False` (its pi05_libero; policy.pi05_state=none), openpi's π0 prompt
  and no state. Right-padded with id 0 to 48 (π0) / 200 (π0.5) tokens, or LeRobot's
  `tokenizer_processor` max_length; longer prompts are cut there.
* **Normalization** of the state in and the actions out. LeRobot: the normalizer steps of
  `policy_preprocessor.json` / `policy_postprocessor.json` and their safetensors
  (`observation.state.<stat>`, `action.<stat>`), modes MEAN_STD, QUANTILES, QUANTILE10,
  MIN_MAX, IDENTITY and eps as written there. openpi: `assets/<asset id>/norm_stats.json`,
  mean/std for π0 and q01/q99 for π0.5, with openpi's 1e-6. The env's state and action dims
  must be those the checkpoint was trained on (`trained_dims`: LeRobot's config.json
  features, the length of openpi's statistics, which older openpi saved padded to the
  model's width and are then cut to the env's), not just fit in the model's padding.
* **Relative actions**: a checkpoint trained on `action - state` in some leading dims
  (LeRobot's `relative_actions_processor`, recorded in its folder; openpi's
  `extra_delta_transform`, which its folders do not record: policy.delta_action_dims) acts
  relative to the raw state of the observation, added back to its unnormalized action for
  every step of the chunk, and taken off again for scoring.
* **Images**: the prefix resizes with padding (policies/vla.py), as both do. The env's `image`
  is the checkpoint's third-person camera, `wrist_image` its wrist camera, in the order the
  checkpoint was trained with: openpi's is fixed (base first); LeRobot feeds its cameras in
  the order of its config.json `input_features`, so a folder whose first is a wrist camera
  (by name) sees `wrist_image` first. Cameras the env lacks are left out, which is what the
  references' masked empty cameras amount to (no token attends to them and positions count
  only real tokens).

Actions: RL samples and scores in the model's (normalized) space; the policy returns the env's
action (`actions_out`) and records the sampled chunk beside it (VLAPolicy.extra_fields), which
scoring reads: the map back (`actions_in`, for demonstrations in the env's units) loses a dim
the statistics hold constant (q01 = q99, std 0) and is off by the references' eps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hpcvla.policies.folders import config_json, is_hpcvla_folder
from hpcvla.policies.norm_stats import AssetChoice, is_lerobot, lerobot_steps, openpi_stats
from hpcvla.text import detokenize

PROMPT_TOKENS = {"pi0": 48, "pi05": 200}  # openpi's max_token_len; LeRobot's defaults
OPENPI_EPS, STATE_BINS = 1e-6, 256


@dataclass
class Affine:
    """x -> (x - offset) / scale_in - shift, and back with scale_out (the references differ
    from the exact inverse by their eps)."""
    offset: torch.Tensor
    scale_in: torch.Tensor
    shift: float
    scale_out: torch.Tensor

    def forward(self, x):
        return (x - self.offset.to(x)) / self.scale_in.to(x) - self.shift

    def inverse(self, y):
        return (y + self.shift) * self.scale_out.to(y) + self.offset.to(y)


def affine(mode: str, stats: dict, eps: float, openpi: bool, dim: int, where,
           feature: str) -> Affine:
    """The normalization `mode` of `feature` (state or action) with statistics `stats`
    (name -> tensor), cut to `dim`."""
    def stat(name):
        if name not in stats:
            raise ValueError(f"{where}: {mode} normalization needs the statistic {name!r}; "
                             f"the file has {sorted(stats)}")
        value = torch.as_tensor(stats[name], dtype=torch.float32).flatten()
        if value.numel() < dim:
            raise ValueError(f"{where}: {feature} statistic {name!r} has {value.numel()} "
                             f"entries, the env's {feature} {dim}")
        return value[:dim]

    if mode == "IDENTITY":
        zero, one = torch.zeros(dim), torch.ones(dim)
        return Affine(zero, one, 0.0, one)
    if mode == "MEAN_STD":
        mean, std = stat("mean"), stat("std")
        return Affine(mean, std + eps, 0.0, std + eps if openpi else std)
    bounds = {"QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90"), "MIN_MAX": ("min", "max")}
    if mode not in bounds:
        raise ValueError(f"{where}: normalization mode {mode!r} is not supported (MEAN_STD, "
                         f"{', '.join(bounds)}, IDENTITY)")
    low, high = bounds[mode]
    low, high = stat(low), stat(high)
    span = high - low + eps if openpi else torch.where(high == low, eps, high - low)
    return Affine(low, span / 2, 1.0, span / 2)


class CheckpointProcessor:
    """See the module docstring."""

    def __init__(self, tokenizer, prompt: str, max_tokens: int, state: Affine | None,
                 action: Affine, vocab, delta: torch.Tensor | None = None,
                 state_width: int | None = None, wrist_first: bool = False):
        if tokenizer.pad_token_id != 0:
            raise ValueError(f"the tokenizer's padding id is {tokenizer.pad_token_id}; the "
                             "model reads id 0 as padding (PaliGemma's tokenizer)")
        self.tokenizer, self.prompt, self.max_tokens = tokenizer, prompt, int(max_tokens)
        self.state, self.action, self.vocab = state, action, tuple(vocab)
        self.delta = delta  # which leading action dims are relative to the raw state
        self.state_width = state_width  # π0.5's prompt state zero-padded to it (LeRobot 0.4)
        self.wrist_first = wrist_first  # the checkpoint's first camera is the wrist's

    @classmethod
    def from_folder(cls, folder, tokenizer_folder, variant: str, vocab, state_dim: int,
                    action_dim: int, padded: dict | None = None, delta_action_dims: int = -1,
                    pi05_state: str = "folder", asset_id: str = "") -> "CheckpointProcessor | None":
        """`state_dim`, `action_dim`: the env's (0: no state); `padded`: the model's widths
        ({"state_dim", "action_dim"}), which tell openpi's padded statistics apart;
        `delta_action_dims`, `pi05_state`, `asset_id`: the policy settings (recipe_problems)."""
        folder = Path(folder)
        if is_hpcvla_folder(folder):
            return None
        unsaid = recipe_problems(folder, variant, delta_action_dims, pi05_state, asset_id)
        if unsaid:
            raise ValueError("; ".join(f"{field}={value}: {fix}" for field, value, fix in unsaid))
        mismatch = dims_problems(folder, trained_dims(folder, padded or {}, variant,
                                                      pi05_state, asset_id), state_dim, action_dim)
        if mismatch:
            raise ValueError(f"{folder}: " + "; ".join(mismatch))
        tokenizer = load_tokenizer(tokenizer_folder, folder)
        steps = {}  # LeRobot's processor steps (openpi's folders have none)
        if is_lerobot(folder):
            stats, steps = lerobot_steps(folder)
            eps, modes = steps["normalizer_processor"]
            max_tokens = steps.get("tokenizer_processor") or PROMPT_TOKENS[variant]
            state = affine(modes.get("STATE", "IDENTITY"), stats["observation.state"], eps,
                           False, state_dim, folder, "state") if state_dim else None
            action = affine(modes.get("ACTION", "IDENTITY"), stats["action"], eps, False,
                            action_dim, folder, "action")
            prompt = variant if pi05_state != "none" else "openpi_pi0"
            config = config_json(folder)
            width = config.get("max_state_dim", 32) if pi05_state == "prompt_padded" else None
            wrist_first = _wrist_first(config)
        else:
            stats, where = openpi_stats(folder, asset_id)
            mode = "MEAN_STD" if variant == "pi0" else "QUANTILES"
            state = affine(mode, stats["state"], OPENPI_EPS, True, state_dim, where,
                           "state") if state_dim else None
            action = affine(mode, stats["actions"], OPENPI_EPS, True, action_dim, where,
                            "action")
            max_tokens, width, wrist_first = PROMPT_TOKENS[variant], None, False
            prompt = "pi05" if variant == "pi05" and pi05_state == "prompt" else "openpi_pi0"
        if prompt == "pi05" and state is None:
            raise ValueError("π0.5 reads the state in its prompt: the env must give one "
                             "(env.state)")
        delta = delta_mask(steps, delta_action_dims, action_dim)
        if delta is not None and len(delta) > state_dim:
            raise ValueError(f"{folder}: its first {len(delta)} action dims are relative to "
                             f"the state, but the env gives a {state_dim}-d state: "
                             "policy.delta_action_dims=0 if the checkpoint acts absolutely")
        return cls(tokenizer, prompt, max_tokens, state, action, vocab, delta, width,
                   wrist_first)

    # ------------------------------------------------------------------ observations
    def texts(self, instruction: torch.Tensor) -> list[str]:
        """The env's instruction ids (B, L) back to their words."""
        return [detokenize(row, self.vocab) for row in instruction.tolist()]

    def prompts(self, texts: list[str], state: torch.Tensor | None) -> list[list[int]]:
        encode = self.tokenizer.encode
        if self.prompt == "pi05":
            values = state.float().cpu().numpy()
            if self.state_width and values.shape[1] < self.state_width:
                values = np.pad(values, ((0, 0), (0, self.state_width - values.shape[1])))
            bins = np.digitize(values, np.linspace(-1, 1, STATE_BINS + 1)[:-1]) - 1
            return [encode(f"Task: {clean(t)}, State: {' '.join(map(str, b))};\nAction: ")
                    for t, b in zip(texts, bins)]
        if self.prompt == "openpi_pi0":
            return [encode(clean(t)) + encode("\n", add_special_tokens=False) for t in texts]
        return [encode(t if t.endswith("\n") else t + "\n") for t in texts]  # LeRobot π0

    def inputs(self, obs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(obs)
        if self.state is not None:
            out["state"] = self.state.forward(obs["state"].float())
        ids = self.prompts(self.texts(obs["instruction"]), out.get("state"))
        tokens = torch.zeros(len(ids), self.max_tokens, dtype=torch.long)
        for row, seq in zip(tokens, ids):
            seq = seq[:self.max_tokens]
            row[:len(seq)] = torch.tensor(seq)
        out["instruction"] = tokens
        if self.wrist_first and "wrist_image" in obs:  # the prefix sees `image` first
            out["image"], out["wrist_image"] = obs["wrist_image"], obs["image"]
        return out

    # ------------------------------------------------------------------ actions
    def actions_out(self, actions: torch.Tensor, obs: dict) -> torch.Tensor:
        """Model actions (B, H, D) for the raw observations `obs` -> the env's."""
        return self.action.inverse(actions.float()) + self._offset(actions, obs)

    def actions_in(self, actions: torch.Tensor, obs: dict) -> torch.Tensor:
        return self.action.forward(actions.float() - self._offset(actions, obs))

    def _offset(self, actions, obs):
        """What relative dims add to the model's unnormalized action: the raw state there,
        the same for every step of the chunk (0 for absolute checkpoints)."""
        if self.delta is None:
            return 0.0
        n = len(self.delta)
        offset = torch.zeros(actions.shape[0], actions.shape[-1], device=actions.device)
        offset[:, :n] = obs["state"][:, :n].to(offset) * self.delta.to(offset)
        return offset[:, None, :]


def check_folder(folder, tokenizer_folder, asset_id: str = "",
                 vocabulary: int = 0) -> list[tuple[str, str, str]]:
    """What a published folder lacks besides its weights, as config problems (field, value,
    what it should be), before any rank starts; `vocabulary`: its token embedding's rows,
    which the tokenizer's ids index (0: unknown)."""
    folder = Path(folder)
    if is_hpcvla_folder(folder):
        return []
    problems = []
    try:
        tokenizer = load_tokenizer(tokenizer_folder, folder)
        if vocabulary and not _vocabulary_fits(tokenizer, vocabulary):  # another model's
            problems.append(("policy.tokenizer", tokenizer_folder, "the checkpoint's "
                             f"tokenizer: this one has {len(tokenizer)} tokens, the "
                             f"checkpoint's embedding {vocabulary}: the prompts would be "
                             "encoded for another model"))
    except (ValueError, OSError) as err:
        problems.append(("policy.tokenizer", tokenizer_folder, str(err).split(": ", 1)[-1]))
    try:
        if is_lerobot(folder):
            lerobot_steps(folder)
        else:
            openpi_stats(folder, asset_id)
    except AssetChoice as err:
        problems.append(("policy.asset_id", asset_id, str(err)))
    except (ValueError, OSError) as err:
        problems.append(("policy.pretrained", str(folder), f"a checkpoint with its "
                         f"normalization statistics: {err}"))
    return problems


def _vocabulary_fits(tokenizer, rows: int) -> bool:
    """Whether a tokenizer is the embedding's: its base vocabulary (ids a prompt can give)
    within the rows, and the rows no more than its tokens padded to a multiple of 128. Not
    equal: PaliGemma's tokenizer adds `<image>` (257153 tokens against LeRobot's 257152
    rows), Hugging Face's PaliGemma pads its embedding (257216 rows)."""
    return tokenizer.vocab_size <= rows <= -(-len(tokenizer) // 128) * 128


def recipe_problems(folder, variant: str, delta_action_dims: int, pi05_state: str,
                    asset_id: str = "") -> list[tuple[str, object, str]]:
    """How a published folder was trained where the folder does not say (openpi's record
    neither its `extra_delta_transform` nor its `discrete_state_input`; LeRobot's processor
    steps record both), as config problems: guessed, every action would be off."""
    problems: list[tuple[str, object, str]] = []
    if variant == "pi0" and pi05_state != "folder":
        problems.append(("policy.pi05_state", pi05_state, "folder for a π0 checkpoint (its "
                         "state is a token of its own)"))
    if is_lerobot(folder):
        if asset_id:
            problems.append(("policy.asset_id", asset_id, "empty for a LeRobot folder (its "
                             "statistics are its processor files; asset ids are openpi's)"))
        if variant == "pi05":
            problems += _lerobot_pi05_problems(folder, pi05_state)
        return problems
    if delta_action_dims < 0:
        problems.append(("policy.delta_action_dims", delta_action_dims, "the number of "
                         "leading action dims the openpi checkpoint predicts relative to the "
                         "state (its training config's extra_delta_transform, which the folder does not "
                         "record): 6 for openpi's pi0_libero, 0 for pi05_libero (a run begun "
                         "with -1 acted absolutely: 0 goes on so)"))
    if variant == "pi05" and pi05_state in ("folder", "prompt_padded"):
        problems.append(("policy.pi05_state", pi05_state, "prompt or none: whether the openpi "
                         "π0.5 checkpoint reads the state in its prompt (its training config's "
                         "discrete_state_input, which the folder does not record): none for "
                         "openpi's pi05_libero, prompt for π0.5's default (pi05_droid)"))
    return problems


def _lerobot_pi05_problems(folder, pi05_state: str) -> list[tuple[str, object, str]]:
    """LeRobot 0.4.0-0.4.4 padded π0.5's state to max_state_dim before discretizing it into
    the prompt, 0.5.0 stopped (as openpi), and both write the same files; a folder of 0.5.1 or
    later says so by its relative_actions_processor step (lerobot_steps)."""
    recent = "relative_actions_processor" in lerobot_steps(Path(folder))[1]
    if not recent and pi05_state == "folder":
        return [("policy.pi05_state", pi05_state, "prompt_padded if LeRobot 0.4 wrote the π0.5 "
                 "folder (its prompt's state zero-padded to max_state_dim before "
                 "discretizing), prompt if LeRobot 0.5.0 did: a folder from before LeRobot "
                 "0.5.1 does not say which (0.5.1 on: relative_actions_processor in its "
                 "policy_preprocessor.json)")]
    if recent and pi05_state == "prompt_padded":
        return [("policy.pi05_state", pi05_state, "folder: LeRobot 0.5.1 or later wrote it, "
                 "whose prompt's state is not padded")]
    return []


def _wrist_first(config: dict) -> bool:
    """Whether a LeRobot folder's first camera (its config.json `input_features` order, the
    order LeRobot feeds them in) is a wrist camera."""
    cameras = [name for name, feature in config.get("input_features", {}).items()
               if feature.get("type") == "VISUAL"]
    return bool(cameras) and "wrist" in cameras[0].lower()


def trained_dims(folder, padded: dict, variant: str = "pi0", pi05_state: str = "folder",
                 asset_id: str = "") -> dict[str, int | None]:
    """The state and action dims a published folder was trained on, before the model pads
    them: LeRobot's config.json features (`observation.state`, `action`); for openpi the
    length of its statistics, unless that is the model's padded width (`padded`, older openpi
    statistics were saved padded): None where unknown, or not read (π0.5 without its state
    prompt)."""
    folder = Path(folder)
    if variant == "pi05" and pi05_state == "none":
        return {**trained_dims(folder, padded, asset_id=asset_id), "state_dim": None}
    if is_lerobot(folder):
        config = config_json(folder)
        features = {**config.get("input_features", {}), **config.get("output_features", {})}
        shape = {key: (features.get(name) or {}).get("shape") or [None]
                 for key, name in (("state_dim", "observation.state"), ("action_dim", "action"))}
        return {key: value[0] for key, value in shape.items()}
    stats = openpi_stats(folder, asset_id)[0]
    found = {key: len(stats[name].get("mean") or stats[name].get("q01") or ())
             for key, name in (("state_dim", "state"), ("action_dim", "actions"))}
    return {key: None if not n or n == padded.get(key) else n for key, n in found.items()}


def delta_mask(steps: dict, delta_action_dims: int, action_dim: int) -> torch.Tensor | None:
    """Which leading action dims the checkpoint predicts relative to the state (bool, None
    for none): `delta_action_dims` > 0 the first N, 0 none, -1 as the folder's LeRobot
    processor `steps` (lerobot_steps) record it: its absolute_actions_processor when enabled,
    with the mask of its paired relative_actions_processor: every dim but the joints its
    `exclude_joints` name among `action_names`, all when it has no names."""
    if delta_action_dims >= 0:
        if delta_action_dims > action_dim:
            raise ValueError(f"policy.delta_action_dims={delta_action_dims}: the env's "
                             f"actions have {action_dim} dims")
        return torch.ones(delta_action_dims, dtype=torch.bool) if delta_action_dims else None
    if not steps.get("absolute_actions_processor", {}).get("enabled"):
        return None  # the post-processor adds the state back only where this step is on
    config = steps.get("relative_actions_processor", {})  # the pre-processor's: its mask
    names, excluded = config.get("action_names"), config.get("exclude_joints") or []
    if not names or not excluded:
        return torch.ones(action_dim, dtype=torch.bool)
    excluded = [str(e).lower() for e in excluded if e]
    return torch.tensor([not any(e in str(name).lower() for e in excluded)
                         for name in names[:action_dim]] + [True] * (action_dim - len(names)))


def dims_problems(folder, trained: dict, state_dim: int, action_dim: int) -> list[str]:
    """Where the env's state and action dims differ from those the folder was trained on:
    the model would read a state, or act in dims, that mean something else."""
    problems = []
    if trained.get("action_dim") not in (None, action_dim):
        problems.append(f"the checkpoint acts in {trained['action_dim']} dims, the env takes "
                        f"{action_dim}-d actions: use an env whose actions are the ones it "
                        "was trained on (or a checkpoint trained on this env's)")
    if trained.get("state_dim") not in (None, state_dim):
        problems.append(f"the checkpoint reads a {trained['state_dim']}-d state, the env gives "
                        + (f"a {state_dim}-d one" if state_dim else "none") + " (LIBERO: the "
                        "published π0/OFT checkpoints read the 8-d state, "
                        "env.state_format=axis_angle)")
    return problems


def clean(text: str) -> str:
    """openpi's (and LeRobot π0.5's) task cleaning."""
    return text.strip().replace("_", " ").replace("\n", " ")


def load_tokenizer(tokenizer_folder, checkpoint):
    """`transformers.AutoTokenizer` from a local folder, or an error saying how to get one."""
    from transformers import AutoTokenizer

    hint = ("PaliGemma's tokenizer (google/paligemma-3b-pt-224 on the Hugging Face hub, "
            "gated): download it once on a login node, e.g. `hf download "
            "google/paligemma-3b-pt-224 tokenizer.json tokenizer.model tokenizer_config.json "
            "--local-dir <folder>`")
    if not tokenizer_folder:
        raise ValueError(f"policy.tokenizer: {checkpoint} is a published π0/π0.5 folder whose "
                         f"prompts need {hint}, then set policy.tokenizer=<folder>")
    folder = Path(tokenizer_folder)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        raise ValueError(f"policy.tokenizer: {folder} holds no tokenizer.json or "
                         f"tokenizer.model; it should hold {hint}")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                             trust_remote_code=False)  # no prompt, no code
    except Exception as err:  # noqa: BLE001 - transformers and tokenizers raise many kinds
        raise ValueError(f"policy.tokenizer: {folder}: a tokenizer transformers can load "
                         f"({type(err).__name__}: {err}); it should hold {hint}") from None


__all__ = ["CheckpointProcessor", "PROMPT_TOKENS", "check_folder", "dims_problems",
           "load_tokenizer", "trained_dims"]
