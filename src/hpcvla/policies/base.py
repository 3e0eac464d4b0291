"""The policy interface every hpcvla policy implements.

A policy maps a dict of batched observation tensors to an *action chunk*
(B, chunk_len, action_dim) and scores it: the value is one number per batch element; the
log-probability and entropy are too (chunk level, the unit PPO works on) unless the policy
scores finer units (`policy.logprob_granularity`, policies/vla.py): action, (B, chunk_len),
or token, (B, chunk_len, action_dim). `act` reports the chunk's log-prob, (B,), either way.

`act` is what rollout workers call (no autograd graph); `evaluate` is what the learner calls
(differentiable). Keeping the two apart lets rollout code run under inference settings while
the learner recomputes everything it needs with gradients. `imitation_loss` is what supervised
fine-tuning (`hpcvla sft`) minimises on demonstrated chunks, over their real steps only (a chunk
that runs past its episode's end is padded): the negative log-likelihood per step and dim of the
Gaussian chunk (default), the cross-entropy per action token (tokens, OFT's token head:
policies/vla.py), the L1 error of OFT's L1 head (oft.py), or flow matching, π0's objective
(flow).
"""

from __future__ import annotations

import abc
import warnings
from typing import NamedTuple

import numpy as np
import torch
from torch import nn


def is_critic(name: str) -> bool:
    """A parameter of the value function: every policy names its critic modules `value_*`
    (the learner gives them algorithm.critic_lr)."""
    return name.split(".", 1)[0].startswith("value_")


class ActOutput(NamedTuple):
    """What `Policy.act` returns; every tensor is detached."""

    actions: torch.Tensor  # (B, chunk_len, action_dim) float32, the sampled (or mean) chunk
    logprob: torch.Tensor  # (B,) log-probability of the whole chunk under the policy
    value: torch.Tensor  # (B,) state-value estimate


class Policy(nn.Module, abc.ABC):
    """Abstract base: a chunked stochastic policy with a value head."""

    action_dim: int
    chunk_len: int
    family: str  # its name in the registry (policies/registry.py POLICIES)
    # What every family's constructor sets, which `config_json` saves and the registry
    # rebuilds it from: the observation spec it was built for, the instruction vocabulary's
    # size and its own constructor arguments (its policy.* settings: FamilyTraits.settings)
    obs_spec: dict[str, tuple[tuple[int, ...], str]]
    vocab_size: int
    init_args: dict
    # Published checkpoints (policies/folders.py, factory.build_policy); the defaults are a
    # family that has none:
    variant: str = ""  # which published model the weights are (flow: "pi0" or "pi05")
    HF_LAYOUT: dict = {}  # their root prefix, tied and unused tensors (policies/folders.py)
    processor = None  # a published folder's prompt, tokenizer and normalization, once loaded
    # whether it acts through such a processor: set on every build (factory.published_folder),
    # a meta one too, which loads no processor but records what a real one does
    published = False
    # Optional, None where a family has none (policies/folders.py):
    #   classmethod folder_kwargs(folder) -> dict: constructor arguments it reads from a
    #     published folder itself (oft);
    #   classmethod checkpoint_kwargs(shapes, config) -> dict: those a checkpoint's tensor
    #     shapes and config.json fix (flow: π0's variant, padded dims);
    #   load_published(folder) -> list[str]: loads a published folder that needs more than
    #     renaming (oft's timm towers); returns the RL-head names left fresh.
    folder_kwargs = checkpoint_kwargs = load_published = None
    # A tensor name's ending only this family's published folders hold ("": none), which
    # tells a folder of another family apart before its sizes are read (preflight.py).
    published_tensor = ""
    # Whether `imitation_loss` fits the exploration std (`log_std`): a likelihood does (the
    # default family's BC); flow matching and OFT's L1 loss leave it where it started,
    # so an RL run from an `hpcvla sft` checkpoint starts it at its own
    # policy.init_log_std (factory.build_policy).
    imitation_fits_std = True

    def make_processor(self, spec, policy_cfg):
        """The processor of the published checkpoint `policy_cfg.pretrained` for the env
        `spec` (EnvSpec), None for one of hpcvla's own. Default: None (a family without
        published folders)."""
        return None

    @abc.abstractmethod
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False) -> ActOutput:
        """Sample (or, if `deterministic`, take the mode of) an action chunk per observation.

        The outputs must not require grad: callers use them as plain data.
        """

    @abc.abstractmethod
    def evaluate(
        self, obs: dict[str, torch.Tensor], actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Score given action chunks: (logprob, value (B,), entropy), differentiable;
        logprob and entropy are (B,) per chunk, or (B, H) / (B, H, D) per action / token
        (module docstring)."""

    @torch.no_grad()
    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """V(obs), (B,), detached: the value `act` gives, from its deterministic pass (which
        draws no random numbers, so valuing leaves the sampling streams as they were)."""
        return self.act(obs, deterministic=True).value

    def action_mode(self, deterministic: bool) -> str:
        """How `act(deterministic=...)` chooses, in the words evaluations report."""
        return "deterministic" if deterministic else "sampled"

    def extra_fields(self) -> dict[str, tuple[tuple, str]]:
        """Fields `sample` returns besides the action, name -> (shape per env, dtype), which
        the learner reads back as observation fields (`evaluate`, e.g. the flow family's
        denoising chain in chain mode; SAC's critics, DSRL's noise): rollouts record them with
        every step. None by default."""
        return {}

    def sample(self, obs, deterministic: bool = False) -> tuple[ActOutput, dict]:
        """`act` plus the `extra_fields` (tensors, batch first)."""
        return self.act(obs, deterministic), {}

    def load_arrays(self, arrays: dict) -> None:
        """Copy named tensors (a published weight version, a checkpoint; numpy arrays too)
        into the parameters and buffers, in place: onto their device, in their dtype."""
        with torch.no_grad():
            state = self.state_dict()
            for name, value in arrays.items():
                state[name].copy_(torch.as_tensor(value), non_blocking=True)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # What pre-flight (preflight.py) and the memory model ask of a family, before any policy
    # is built: each family answers for itself, so nothing outside the registry asks its name.
    @classmethod
    def folder_problems(cls, folder, policy_cfg, env_cfg) -> list[tuple[str, str, str]]:
        """Config problems of a published folder (policy.pretrained) for this family. Default:
        a family with no published weights takes only the folders hpcvla writes."""
        return [("policy.pretrained", folder, f"a folder written by `hpcvla sft` (its "
                 f"`policy/`) or save_pretrained: the {cls.family} policy has no published "
                 "weights")]

    @classmethod
    def env_fit_problems(cls, policy_cfg, spec_of) -> list[str]:
        """Why the published folder policy_cfg.pretrained cannot act in the configured env
        (`spec_of()`: its EnvSpec, built only when asked); none by default."""
        return []

    @classmethod
    def resolved_size(cls, size: str, obs_spec: dict, vocab_size: int) -> dict | None:
        """A size preset as the configs of its parts (memory/footprint.py); None for a family
        without presets."""
        return None

    def lora_models(self) -> list[nn.Module]:
        """The language models that take LoRA adapters (policy.lora_rank, policies/lora.py);
        a family without one has none (the config checks refuse the setting for it)."""
        return []

    def enable_gradient_checkpointing(self) -> None:
        """learner.gradient_checkpointing: the learner's copy recomputes its activations in the
        backward pass instead of keeping them. A family without layers worth recomputing has
        none to offer (the config checks refuse the setting for it first)."""
        raise ValueError(f"learner.gradient_checkpointing: the {self.family} policy has no "
                         f"transformer layers to recompute")

    @property
    def imitation_horizon(self) -> int:
        """The action steps `hpcvla sft` supervises from each observation: the chunk it acts,
        or a longer horizon the model predicts (π0's, OFT's), as their references train."""
        return self.chunk_len

    @abc.abstractmethod
    def imitation_loss(self, obs: dict[str, torch.Tensor], actions: torch.Tensor,
                       real: torch.Tensor) -> torch.Tensor:
        """The supervised loss of demonstrated actions `actions` (B, H, action_dim), H up to
        `imitation_horizon` steps from each observation, a scalar averaged over the real steps
        only: `real` (B, H) is False where they run past the episode's end and `actions` only
        repeats a padding value."""

    def forward(self, obs: dict[str, torch.Tensor], actions: torch.Tensor,
                real: torch.Tensor | None = None):
        """`evaluate`, or with the `real` steps mask `imitation_loss`: training calls the
        DeepSpeed engine (`engine(obs, actions)`), whose forward hooks gather ZeRO-3 shards."""
        if real is None:
            return self.evaluate(obs, actions)
        return self.imitation_loss(obs, actions, real)

    # Hugging Face-style folders (policies/folders.py): a family that follows a published
    # model maps its names to that model's (VLAPolicy); built-in names are their own.
    @classmethod
    def to_hf_key(cls, key: str) -> str:
        return key

    @classmethod
    def from_hf_key(cls, key: str) -> str:
        return key

    def published_tensors(self, state: dict, source) -> tuple[dict, dict]:
        """`state` under the published model's names (policies/export.py writes them in the
        layout of the folder `source`), and the family's other weight files, file name ->
        what `torch.save` writes (oft: its proprio projector and L1 action head). Default:
        renamed, none."""
        return {self.to_hf_key(k): v for k, v in state.items()}, {}

    def config_json(self) -> dict:
        """What rebuilds this policy (registry.load_pretrained): the family, the observation
        spec and the constructor arguments (`obs_spec`, `vocab_size`, `init_args`, which
        every family that can be saved records)."""
        return {"hpcvla_policy": self.family, "architectures": [type(self).__name__],
                "obs_spec": {k: [list(s), dt] for k, (s, dt) in self.obs_spec.items()},
                "action_dim": self.action_dim, "chunk_len": self.chunk_len,
                "vocab_size": self.vocab_size, "kwargs": self.init_args}

    @staticmethod
    def obs_to_tensors(obs: dict[str, np.ndarray], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Wrap numpy observation arrays as tensors on `device`, sharing memory where possible.

        dtypes are kept (uint8 images stay uint8: the model converts, so transfers to a GPU
        move 4x fewer bytes). Arrays decoded from received buffers are often read-only; torch
        warns about that when sharing memory, but policies never write into observations, so
        the warning is silenced instead of paying for a copy.
        """
        out = {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            for name, arr in obs.items():
                out[name] = torch.as_tensor(arr, device=device)
        return out


def real_steps_mean(terms: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Mean of per-step terms (B, H, ...) over the steps where `real` (B, H) is True."""
    weight = real.to(terms.dtype).view(*real.shape, *([1] * (terms.dim() - 2)))
    return (terms * weight).sum() / (weight.expand_as(terms).sum().clamp(min=1))
