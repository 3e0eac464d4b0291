"""An OpenVLA-OFT checkpoint's prompt, state normalization and action units.

    processor = OFTProcessor.from_folder(folder, tokenizer_folder, unnorm_key, vocab, ...)
    model_obs = processor.inputs(obs)      # + input_ids / prompt_mask, normalized state
    env_actions = processor.actions_out(a, obs)  # normalized [-1, 1] -> the dataset's units
    a = processor.actions_in(env_actions, obs)   # and back (demonstrations)

* **Prompt**: `In: What action should the robot take to {task.lower()}?\\nOut: ` (the trailing
  space encodes as 29871, the id OFT's `predict_action` appends), with the Llama tokenizer the
  checkpoint folder ships (`transformers.AutoTokenizer`, `trust_remote_code=False`: published
  folders name OFT's own processor code in `auto_map`, which is not needed for the
  tokenizer). The env's instruction ids are decoded back to words (hpcvla/text.py), as the π0
  processor does. RLinf's layout: left-padded with the pad id (32000) to `max_prompt_length`
  (a longer prompt makes the batch longer instead of being cut), then BOS moved to index 0;
  `prompt_mask` is False on the pads. With positions counting real tokens only and padding
  keys masked, the length changes nothing but the shapes.
* **Actions** (OFT's `_unnormalize_actions`, BOUNDS_Q99): `0.5 (a + 1) (q99 - q01 + 1e-8) +
  q01` where the statistics' `mask` is true; other dims (LIBERO's gripper) stay normalized.
* **Proprio** (OFT's `normalize_proprio`): `clip(2 (x - q01) / (q99 - q01 + 1e-8) - 1, -1, 1)`
  where the proprio `mask` (all true when absent) says so.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hpcvla.text import detokenize
from hpcvla.policies.oft_checkpoint import load_tokenizer, read_statistics

PROMPT = "In: What action should the robot take to {task}?\nOut: "
BOS, PAD, EMPTY = 1, 32000, 29871  # Llama-2's BOS, OFT's added <PAD>, "▁"
EPS = 1e-8


class Bounds:
    """OFT's q01/q99 map of the dims in `mask` (BOUNDS_Q99)."""

    def __init__(self, stats: dict, dim: int, where: str):
        for name in ("q01", "q99"):
            if len(stats.get(name, ())) != dim:
                raise ValueError(f"{where}: {name} has {len(stats.get(name, ()))} entries, the "
                                 f"env's data {dim}")
        self.low = torch.tensor(stats["q01"], dtype=torch.float64)
        self.span = torch.tensor(stats["q99"], dtype=torch.float64) - self.low + EPS
        self.mask = torch.tensor(stats.get("mask", [True] * dim), dtype=torch.bool)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        y = 2 * (x.double() - self.low.to(x.device)) / self.span.to(x.device) - 1
        return torch.where(self.mask.to(x.device), y, x.double()).float()

    def unnormalize(self, a: torch.Tensor) -> torch.Tensor:
        y = 0.5 * (a.double() + 1) * self.span.to(a.device) + self.low.to(a.device)
        return torch.where(self.mask.to(a.device), y, a.double()).float()


class OFTProcessor:
    """See the module docstring."""

    def __init__(self, tokenizer, action: Bounds, proprio: Bounds | None, vocab,
                 max_prompt_length: int, unnorm_key: str):
        self.tokenizer, self.action, self.proprio = tokenizer, action, proprio
        self.vocab, self.max_prompt_length = tuple(vocab), int(max_prompt_length)
        self.unnorm_key = unnorm_key

    @classmethod
    def from_folder(cls, folder, tokenizer_folder, unnorm_key: str, vocab, action_dim: int,
                    state_dim: int, max_prompt_length: int) -> "OFTProcessor":
        """`state_dim` 0: the policy reads no state (no proprio token)."""
        key, stats = read_statistics(folder, unnorm_key)
        where = f"{Path(folder) / 'dataset_statistics.json'} [{key}]"
        proprio = None
        if state_dim:
            if "proprio" not in stats:
                raise ValueError(f"{where}: no proprio statistics for the env's state")
            proprio = Bounds(stats["proprio"], state_dim, where + " proprio")
        return cls(load_tokenizer(tokenizer_folder or folder),
                   Bounds(stats["action"], action_dim, where + " action"), proprio, vocab,
                   max_prompt_length, key)

    # ------------------------------------------------------------------ observations
    def prompt_ids(self, tasks: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """RLinf's prompt ids (B, L) and mask (False on pads), module docstring."""
        rows = [self.tokenizer.encode(PROMPT.format(task=t.lower())) for t in tasks]
        length = max([self.max_prompt_length, *map(len, rows)])
        ids = torch.full((len(rows), length), PAD, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.bool)
        for row, seq in enumerate(rows):
            if seq[0] != BOS:
                raise ValueError("the tokenizer adds no BOS (Llama's adds 1)")
            ids[row, 0], mask[row, 0] = BOS, True
            ids[row, length - len(seq) + 1:] = torch.tensor(seq[1:])
            mask[row, length - len(seq) + 1:] = True
        return ids, mask

    def inputs(self, obs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(obs)
        tasks = [detokenize(row, self.vocab) for row in obs["instruction"].tolist()]
        out["input_ids"], out["prompt_mask"] = self.prompt_ids(tasks)
        if self.proprio is not None:
            out["state"] = self.proprio.normalize(obs["state"]).clamp(-1.0, 1.0)
        return out

    # ------------------------------------------------------------------ actions
    def actions_out(self, actions: torch.Tensor, obs: dict) -> torch.Tensor:
        return self.action.unnormalize(actions)

    def actions_in(self, actions: torch.Tensor, obs: dict) -> torch.Tensor:
        return self.action.normalize(actions)


__all__ = ["OFTProcessor", "Bounds", "PROMPT"]
