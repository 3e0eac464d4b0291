"""Flow-matching action expert (π0 / π0.5 style) with RL log-probs through noisy denoising.

Architecture (π0): a PaliGemma-style prefix (SigLIP patches + Gemma over the instruction, see
vla.py) runs once per observation and leaves its keys/values (PrefixCache); a small Gemma
*action expert* of the same depth attends to them layer by layer. Its tokens are [state;
H action tokens]: the state token (optional, `state_proj`) sees the prefix and itself, the
action tokens see everything; an action token is `action_time_mlp(action_in_proj(x_t),
sinusoidal(t))` and its output goes through `action_out_proj` to a velocity. Denoising runs
t = 1 (noise) -> 0 (action) in K Euler steps of size 1/K: x <- x - v(x, t) / K (π0's
convention x_t = t * noise + (1 - t) * action, v = noise - action).

RL needs a likelihood, which an ODE sampler does not have: the denoising steps are made Gaussian
transitions, `logprob_mode` choosing which (last_step, chain, random_step); how the policy
samples, what it records and what `evaluate` scores: policies/flow_denoising.py.

Published π0/π0.5 folders (policies/folders.py, `policy.pretrained`): the variant, padded
dims, horizon and every size (`paligemma_size`) come from the checkpoint; its prompt and
normalization are policies/processor.py's, so `act` then returns the env's units and
`evaluate` maps recorded actions back to the model's space before scoring.

π0.5 (`variant="pi05"`): the expert is conditioned on the flow time through adaptive RMS norms
(policies/adarms.py) fed by `time_mlp_out(silu(time_mlp_in(sinusoidal(t))))` (then silu),
and its tokens are the H actions alone (`action_in_proj(x_t)`, no state token, no
`action_time_mlp_*`): π0.5 reads the state as discrete tokens in its prompt. Its value head
reads the prefix alone.

Model dimensions (`model_dims`, read from a checkpoint by policies/folders.py): a published
π0 predicts a horizon of H_m actions (50) of D_m padded dims (32) and reads a state padded
to 32; the env executes the first chunk_len actions' first action_dim dims (RLinf: 5 of 50).
The state is zero-padded in; the denoising runs on the whole (H_m, D_m) chunk; noise enters
the executed part alone, the only part scored.

Value: an MLP on the mean of the prefix's last hidden states, concatenated with the expert's
output at the state token (which depends on neither t nor x). `train_expert_only` freezes
the prefix (vision tower, projector, language model): the expert, its projections, the
value head and log_std train (log_std not under flow_noise=sde: the step's time sets its
std).

Published folders (their names, sizes, sampler and processor): policies/flow_folders.py.
SAC steers a frozen flow policy through its sampler's noise: policies/noise_actor.py (DSRL).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpcvla.config.policy import DENOISE_FROM, FLOW_NOISES, VARIANTS
from hpcvla.policies.adarms import make_adaptive
from hpcvla.policies.backbones import backbone
from hpcvla.policies.base import real_steps_mean
from hpcvla.policies.flow_denoising import LOGPROB_MODES, FlowDenoising
from hpcvla.policies.flow_folders import PublishedFlowFolders
from hpcvla.policies.noise_actor import NOISE, NoiseActor
from hpcvla.policies.vla import (VisionLanguagePrefix, VLAPolicy, PrefixCache, block_mask,
                                 masked_mean, resolve_size, sinusoidal, value_mlp)

DEFAULT_DENOISE_STEPS = 4  # Euler steps when neither the config nor a folder says


class FlowPolicy(NoiseActor, PublishedFlowFolders, FlowDenoising, VLAPolicy):
    """π0-style flow-matching VLA; see the module docstring.

    Args (beyond the Policy ones):
        size: "tiny" | "small" | "full" (vla.SIZES) or a resolved dict of configs.
        denoise_steps: K, Euler steps per chunk (π0 uses 10; RL fine-tuning uses fewer).
        denoise_from: "auto" | "zero" | "noise", x_0 of deterministic acting
            (policy.denoise_from; auto: zero under last_step, else noise).
        logprob_mode: "last_step", "chain" or "random_step" (policies/flow_denoising.py).
        flow_noise: "learned" or "sde" (RLinf's flow-SDE, random_step only), its scale
            `noise_level` (policies/flow_denoising.py).
        train_expert_only: freeze the vision-language prefix.
        logprob_granularity: "chunk" | "action" | "token", the shape evaluate returns.
        init_log_std: initial log of the exploration std.
        dtype: "auto" (bf16 on CUDA, float32 on CPU), "float32" or "bfloat16".
        soft_critics: freeze the policy and add SAC's noise actor and critics (DSRL,
            policies/noise_actor.py) of width `hidden`, its noise in (-noise_bound,
            noise_bound), reading the observation fields `noise_obs` (empty: all);
            `critic_layer_norm` and `init_temperature` as the default policy's.
    """

    family = "flow"
    published_tensor = "action_in_proj.weight"  # LeRobot's and openpi's π0 and π0.5
    imitation_fits_std = False  # flow matching: the velocity alone (base.Policy)

    def __init__(self, obs_spec, action_dim, chunk_len, vocab_size, size="tiny",
                 denoise_steps: int = DEFAULT_DENOISE_STEPS, denoise_from: str = "auto",
                 logprob_mode: str = "last_step", flow_noise: str = "learned",
                 noise_level: float = 0.5, train_expert_only: bool = False,
                 logprob_granularity: str = "chunk", init_log_std: float = -0.7,
                 dtype: str = "auto", model_dims: dict | None = None, variant: str = "pi0",
                 hidden: int = 128, soft_critics: bool = False, critic_layer_norm: bool = False,
                 init_temperature: float = 1.0, noise_bound: float = 1.0,
                 noise_obs: tuple[str, ...] = ()):
        super().__init__()
        for name, value, choices in (("variant", variant, VARIANTS),
                                     ("logprob_mode", logprob_mode, LOGPROB_MODES),
                                     ("flow_noise", flow_noise, FLOW_NOISES),
                                     ("denoise_from", denoise_from, DENOISE_FROM)):
            if value not in choices:
                raise ValueError(f"flow {name} {value!r}: expected one of {choices}")
        if denoise_steps < 1:
            raise ValueError(f"denoise_steps must be >= 1, got {denoise_steps}")
        if flow_noise == "sde" and logprob_mode != "random_step":
            raise ValueError(f"flow_noise 'sde' noises one step (random_step), not "
                             f"{logprob_mode!r}")
        parts = resolve_size("flow", size, obs_spec, vocab_size)
        dims = self._model_dims(obs_spec, action_dim, chunk_len, model_dims)
        self._setup(obs_spec, action_dim, chunk_len, vocab_size, logprob_granularity, dtype,
                    dict(size=parts, denoise_steps=denoise_steps, denoise_from=denoise_from,
                         logprob_mode=logprob_mode, flow_noise=flow_noise,
                         noise_level=noise_level, train_expert_only=train_expert_only,
                         logprob_granularity=logprob_granularity, init_log_std=init_log_std,
                         dtype=dtype, model_dims=dims, variant=variant, hidden=hidden,
                         soft_critics=soft_critics, critic_layer_norm=critic_layer_norm,
                         init_temperature=init_temperature, noise_bound=noise_bound,
                         noise_obs=tuple(noise_obs)))
        self.variant = variant
        self.model_horizon, self.model_action_dim = dims["horizon"], dims["action_dim"]
        self.model_state_dim = dims["state_dim"]
        self.denoise_steps, self.logprob_mode = int(denoise_steps), logprob_mode
        # acting without noise starts where RL explores from: x_0 = 0 under last_step alone
        self.denoise_from = denoise_from if denoise_from != "auto" else (
            "zero" if logprob_mode == "last_step" else "noise")
        self.flow_noise, self.noise_level = flow_noise, float(noise_level)
        self.train_expert_only = bool(train_expert_only)
        self.checkpoint_passes = False  # enable_gradient_checkpointing

        from transformers import GemmaConfig, GemmaModel

        self.prefix = VisionLanguagePrefix(parts, "gemma", self.compute_dtype)
        self.expert_config = GemmaConfig(**parts["expert"], vocab_size=1, pad_token_id=None,
                                         bos_token_id=None, eos_token_id=None)
        text = self.prefix.text_config
        for key in ("num_hidden_layers", "num_key_value_heads", "head_dim"):
            if getattr(self.expert_config, key) != getattr(text, key):
                raise ValueError(f"flow size: expert {key} {getattr(self.expert_config, key)} "
                                 f"must equal the language model's {getattr(text, key)} (the "
                                 f"expert attends to its keys/values layer by layer)")
        self.gemma_expert = backbone(GemmaModel, self.expert_config, self.compute_dtype)
        self.gemma_expert.embed_tokens = None  # the expert reads embeddings, never token ids
        width = self.expert_config.hidden_size
        self.action_in_proj = nn.Linear(self.model_action_dim, width)
        if variant == "pi05":  # the time conditions every expert norm (adaRMS)
            self.time_mlp_in = nn.Linear(width, width)
            self.time_mlp_out = nn.Linear(width, width)
            self.condition = make_adaptive(self.gemma_expert)
        else:  # π0: the time joins each action token, the state is a token of its own
            if self.has_state:
                self.state_proj = nn.Linear(self.model_state_dim, width)
            self.action_time_mlp_in = nn.Linear(2 * width, width)
            self.action_time_mlp_out = nn.Linear(width, width)
        self.action_out_proj = nn.Linear(width, self.model_action_dim)
        self.state_token = variant == "pi0" and self.has_state
        value_in = text.hidden_size + (width if self.state_token else 0)
        self.value_head = value_mlp(value_in, min(256, value_in))
        self.log_std = nn.Parameter(torch.full((self.chunk_len, self.action_dim),
                                               float(init_log_std)),
                                    requires_grad=flow_noise == "learned")  # sde: time's
        if self.train_expert_only:
            self.prefix.requires_grad_(False)
        self.to(self.compute_dtype)
        self.steered = bool(soft_critics)  # DSRL: the noise actor acts (float32)
        if self.steered:
            self.add_noise_actor(obs_spec, vocab_size, hidden, noise_bound, critic_layer_norm,
                                 init_temperature, noise_obs)

    @staticmethod
    def _model_dims(obs_spec, action_dim, chunk_len, model_dims) -> dict:
        """The model's horizon, action and state dims (module docstring): the env's unless
        `model_dims` pads them."""
        env = {"horizon": chunk_len, "action_dim": action_dim,
               "state_dim": obs_spec["state"][0][0] if "state" in obs_spec else 0}
        dims = {k: int((model_dims or {}).get(k) or v) for k, v in env.items()}
        for key, value in env.items():
            if dims[key] < value:
                raise ValueError(f"flow model_dims: {key} {dims[key]} is smaller than the "
                                 f"env's {value}; the model must cover what the env uses")
        return dims

    def extra_fields(self) -> dict[str, tuple[tuple, str]]:
        """What evaluate scores beside the observation: a processor's chunk in the model's
        space (VLAPolicy's) and flow_denoising.py's fields; steered (DSRL): the noise the
        actor chose, SAC's action."""
        if self.steered:
            return {NOISE: ((self.chunk_len, self.action_dim), "<f4")}
        return {**super().extra_fields(), **self.denoising_fields()}

    def action_mode(self, deterministic: bool) -> str:
        noise = deterministic and self.denoise_from == "noise" and not self.steered
        return "noise-free flow from N(0, I)" if noise else super().action_mode(deterministic)

    def sample(self, obs, deterministic: bool = False):
        """VLAPolicy's; steered (DSRL), the noise actor's chunk (policies/noise_actor.py)."""
        if self.steered:
            return self.steered_sample(obs, deterministic)
        return super().sample(obs, deterministic)

    # --------------------------------------------------------------------- network pieces
    def lora_models(self):
        """The expert, and the prefix's language model unless it is frozen (its forward
        runs without gradients then)."""
        return [self.gemma_expert] + ([] if self.train_expert_only else
                                      [self.prefix.language_model])

    def enable_gradient_checkpointing(self) -> None:
        """The prefix's layers (SigLIP, the VLM) recompute in the backward pass, recording
        the PrefixCache again (which keeps its first tensors); the expert recomputes each of
        its passes whole (`_expert_pass`): π0.5's norms read the pass's time from state the
        passes share, which a recompute layer by layer would find changed."""
        self.prefix.vision_tower.activation_checkpointing_enable()
        self.prefix.language_model.activation_checkpointing_enable()
        for layer in self.prefix.language_model.layers:
            layer._can_checkpoint_with_cache = True  # transformers' switch for such caches
        self.checkpoint_passes = True

    def _expert_pass(self, cache, pad, state, x, t):
        """`_velocity`, recomputed in the backward pass under gradient checkpointing."""
        if self.checkpoint_passes and torch.is_grad_enabled():
            return checkpoint(self._velocity, cache, pad, state, x, t, use_reentrant=False)
        return self._velocity(cache, pad, state, x, t)

    def _padded_state(self, obs):
        state = obs.get("state")
        if state is None or state.shape[-1] == self.model_state_dim:
            return state
        return torch.nn.functional.pad(state.float(), (0, self.model_state_dim - state.shape[-1]))

    def _encode(self, obs):
        """Prefix keys/values (PrefixCache), its padding mask and its pooled output."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.train_expert_only):
            embeds, pad = self.prefix.embed(obs)
            blocks = torch.zeros(pad.shape[1], dtype=torch.long, device=pad.device)
            cache = PrefixCache()
            hidden = self.prefix(embeds, pad, blocks, cache)
        return cache.freeze(), pad, masked_mean(hidden, pad)

    def _velocity(self, cache, pad, state, x, t):
        """One expert pass: velocity (B, H, D) at x (B, H, D), times t (B,); and the output
        at the state token (B, W) (None without state)."""
        B, H, _ = x.shape
        dtype = self.action_in_proj.weight.dtype
        silu = torch.nn.functional.silu
        time = sinusoidal(t, self.expert_config.hidden_size).to(dtype)
        if self.variant == "pi05":
            tokens = self.action_in_proj(x.to(dtype))
            self.condition.value = silu(self.time_mlp_out(silu(self.time_mlp_in(time))))
        else:
            tokens = self.action_time_mlp_out(silu(self.action_time_mlp_in(torch.cat(
                [self.action_in_proj(x.to(dtype)), time[:, None].expand(B, H, -1)], dim=-1))))
        blocks = [2] * H
        if self.state_token:
            tokens = torch.cat([self.state_proj(state.to(dtype))[:, None], tokens], dim=1)
            blocks = [1] + blocks
        S = tokens.shape[1]
        suffix_blocks = torch.tensor(blocks, device=x.device)
        key_pad = torch.cat([pad, torch.ones(B, S, dtype=torch.bool, device=x.device)], dim=1)
        key_blocks = torch.cat([torch.zeros(pad.shape[1], dtype=torch.long, device=x.device),
                                suffix_blocks])
        positions = pad.long().sum(dim=1, keepdim=True) + torch.arange(S, device=x.device)
        out = self.gemma_expert(inputs_embeds=tokens, position_ids=positions,
                                attention_mask=block_mask(key_pad, key_blocks, suffix_blocks,
                                                          tokens.dtype),
                                past_key_values=cache, use_cache=False).last_hidden_state
        velocity = self.action_out_proj(out[:, S - H:]).float()
        return velocity, (out[:, 0] if self.state_token else None)

    @torch.no_grad()
    def value(self, obs):
        """`act`'s value without its denoising: the value head reads the prefix and π0's
        state token, whose block sees no action token, so one expert pass (at the first
        step's time and x = 0: any x gives the same value) gives it exactly."""
        inputs = self._inputs(obs)
        cache, pad, pooled = self._encode(inputs)
        state_out = None
        if self.state_token:
            x = torch.zeros(pad.shape[0], self.model_horizon, self.model_action_dim,
                            device=pad.device)
            _, state_out = self._velocity(cache, pad, self._padded_state(inputs), x,
                                          self._times(pad.shape[0], pad.device)[0])
        return self._value(pooled, state_out).float()

    def _value(self, pooled, state_out):
        features = pooled if state_out is None else torch.cat([pooled, state_out], dim=-1)
        return self.value_head(features).squeeze(-1).float()

    # --------------------------------------------------------------------- act / evaluate
    @property
    def imitation_horizon(self) -> int:
        """The whole action horizon, as openpi and LeRobot train it (the env acts its first
        chunk_len)."""
        return self.model_horizon

    def imitation_loss(self, obs, actions, real):
        """Flow matching, π0's training objective (supervised fine-tuning, `hpcvla sft`): at a
        time t ~ Beta(1.5, 1) (π0's emphasis on the noisy end), the expert's velocity at
        x_t = t·noise + (1 - t)·actions must be noise - actions, which is the direction the
        Euler steps of `_sample` integrate from t = 1 to 0. Mean squared error over the
        real steps and dims of `actions` (up to the horizon; the model's padding and the
        episode's end are left out)."""
        inputs = self._inputs(obs)
        target = self._model_actions(actions, obs).float()
        cache, pad, _ = self._encode(inputs)
        B, H, D = target.shape[0], target.shape[1], self.action_dim  # up to the horizon
        clean = torch.zeros(B, self.model_horizon, self.model_action_dim, device=pad.device)
        clean[:, :H, :D] = target
        noise = torch.randn_like(clean)
        # Beta(1.5, 1) by its inverse CDF (F(t) = t^1.5): one uniform draw, an op every device
        # has (the memory model runs this on meta tensors, where Beta's sampler has no kernel)
        t = torch.rand(B, device=pad.device).pow(1 / 1.5) * 0.999 + 0.001
        x = t[:, None, None] * noise + (1 - t[:, None, None]) * clean
        velocity, _ = self._expert_pass(cache, pad, self._padded_state(inputs), x, t)
        return real_steps_mean((velocity - (noise - clean))[:, :H, :D].pow(2), real)

    def _sample(self, obs, deterministic, x0=None):
        """(chunk, log-prob terms, value, extras): the mode's denoising from x_0, or from
        `x0` (B, model horizon, model action dims) where given (DSRL)."""
        cache, pad, pooled = self._encode(obs)
        x, terms, state_out, extras = self._denoise(cache, pad, self._padded_state(obs),
                                                    deterministic, x0)
        return x, terms, self._value(pooled, state_out), extras

    def _score(self, obs, actions):
        """(log-prob terms, entropy terms, value) of the recorded actions, with gradients."""
        cache, pad, pooled = self._encode(obs)
        terms, entropy, state_out = self._rescore(cache, pad, self._padded_state(obs), obs,
                                                  actions)
        return terms, entropy, self._value(pooled, state_out)


__all__ = ["FlowPolicy", "LOGPROB_MODES", "VARIANTS"]
