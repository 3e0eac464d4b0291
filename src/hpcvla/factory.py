"""The policy as configured, built exactly as a training rank builds it, shared by training,
evaluation, the scale probe and the benches (the envs: envs/build.py). Below roles/: the
roles, `evaluate`, `scale` and `bench` all import it, it imports none of them."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from hpcvla.checkpoint import catalog, store
from hpcvla.config.families import family
from hpcvla.config.learning import noise_obs_fields
from hpcvla.policies.backbones import backbones_from_folder
from hpcvla.policies.flow import DEFAULT_DENOISE_STEPS
from hpcvla.policies.registry import POLICIES, make_policy, policy_kwargs
from hpcvla.policies.folders import (checkpoint_kwargs, is_hpcvla_folder, load_weights,
                                     rl_only_names)
from hpcvla.policies.lora import add_lora


# The settings whose 0 (their default) means the pretrained folder's, which any other value
# overrides, and their value where no folder says: π0's sampler steps, OFT's evaluation crop
FOLDERS_OR = {"denoise_steps": DEFAULT_DENOISE_STEPS, "center_crop": 1.0}


def constructor_kwargs(cfg, on_gpus: bool) -> dict:
    """The configured policy's constructor arguments: its config section's, then what a
    pretrained folder fixes (e.g. π0's variant, padded action/state dims and horizon), and the
    dtype `auto` means where the run acts and learns on GPUs (`on_gpus`: bf16) or not."""
    kwargs = policy_kwargs(cfg.policy.name, cfg.policy)
    if cfg.policy.pretrained:
        found = checkpoint_kwargs(POLICIES[cfg.policy.name], cfg.policy.pretrained)
        kwargs.update({name: value for name, value in found.items()
                       if not (name in FOLDERS_OR and kwargs.get(name))})  # the config's wins
    for name, value in FOLDERS_OR.items():
        if kwargs.get(name) == 0:  # no folder says
            kwargs[name] = value
    if cfg.algorithm.off_policy:  # SAC's critics and squashed actor (policies/soft_critics.py)
        kwargs.update(soft_critics=True, critic_layer_norm=cfg.algorithm.critic_layer_norm or
                      cfg.algorithm.traits.prior_data,
                      init_temperature=cfg.algorithm.init_temperature)
        if family(cfg.policy.name).noise_actor:  # DSRL's (policies/noise_actor.py)
            kwargs["noise_bound"] = cfg.algorithm.noise_bound
            kwargs["noise_obs"] = noise_obs_fields(cfg.algorithm)
    if kwargs.get("dtype") == "auto":  # one dtype on every rank: the weight plane's manifest
        kwargs["dtype"] = "bfloat16" if on_gpus else "float32"
    return kwargs


def published_folder(cfg) -> bool:
    """Whether policy.pretrained is a published checkpoint's folder (LeRobot, openpi, OFT),
    whose processor the policy acts through, not one hpcvla wrote (save_pretrained)."""
    return bool(cfg.policy.pretrained) and not is_hpcvla_folder(cfg.policy.pretrained)


def build_policy(cfg, spec, device="cpu", on_gpus: bool | None = None, load: bool = True):
    """The configured policy on `device`, with the same initial weights on every rank (drawn
    from run.seed on a forked CPU RNG: the caller's own streams, CPU and CUDA, are left as
    they were). On the "meta" device it has names, dtypes and shapes but no memory (what the
    memory model and `hpcvla doctor` count).
    `on_gpus`: whether the run acts and learns on GPUs (policy.dtype auto: bf16); default:
    whether `device` is one. `load=False`: policy.pretrained's and policy.checkpoint's weights
    are not read (a published folder's backbones then hold whatever memory they got), for a
    rank that takes every tensor from the weight plane's first version, which is whole (an
    inference or evaluator rank of a training world), or from its engine's start (a learner
    other than learner 0, engines.init_engine): 6.5 GB less read per such rank of π0."""
    on_gpus = torch.device(device).type == "cuda" if on_gpus is None else on_gpus
    kwargs = constructor_kwargs(cfg, on_gpus)
    if str(device) == "meta":
        with torch.device("meta"):
            policy = make_policy(cfg.policy.name, spec.obs, spec.action_dim, spec.chunk_len,
                                 len(spec.vocab), **kwargs)
            if cfg.policy.lora_rank:
                add_lora(policy, cfg.policy.lora_rank, cfg.policy.lora_alpha)
        policy.published = published_folder(cfg)
        return policy
    with torch.random.fork_rng(devices=[]):  # built on the CPU: only its generator is used
        # (torch.manual_seed would also reseed every CUDA generator, which fork_rng(devices=[])
        # does not restore: every GPU rank would then sample the same noise)
        torch.random.default_generator.manual_seed(cfg.run.seed)
        with backbones_from_folder(bool(cfg.policy.pretrained)):  # the folder sets them
            policy = make_policy(cfg.policy.name, spec.obs, spec.action_dim, spec.chunk_len,
                                 len(spec.vocab), **kwargs)
    if cfg.policy.pretrained and load:  # names and shapes must fit exactly; RL heads fresh
        load_weights(policy, cfg.policy.pretrained)
    policy.published = published_folder(cfg)
    if policy.published:  # its prompt, tokenizer and normalization
        policy.processor = policy.make_processor(spec, cfg.policy)
    if cfg.policy.lora_rank:  # on the loaded weights; the same adapters on every rank
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(cfg.run.seed + 1)
            add_lora(policy, cfg.policy.lora_rank, cfg.policy.lora_alpha)
    if cfg.policy.checkpoint and load:  # e.g. an `hpcvla sft` run: its weights, this processor
        path = catalog.latest(Path(cfg.policy.checkpoint))
        # the RL-only tensors may be absent (e.g. DSRL's actor after a PPO-config SFT run)
        policy.load_arrays(store.load_weights(path, policy.state_dict(),
                                              may_lack=rl_only_names(policy)))
        if cfg.algorithm.off_policy:  # a run's temperature starts where its config says
            with torch.no_grad():
                policy.sac_log_alpha.fill_(math.log(cfg.algorithm.init_temperature))
        if not policy.imitation_fits_std and catalog.by_sft(path):  # SFT left it at the
            with torch.no_grad():  # SFT config's: the RL run explores as its config says
                policy.log_std.fill_(cfg.policy.init_log_std)
    return policy.to(device)
