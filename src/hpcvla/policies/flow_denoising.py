"""How the flow policy (policies/flow.py) denoises when it acts, and what RL scores.

An ODE sampler has no likelihood. Each denoising step is made a Gaussian transition
x_{k+1} ~ N(x_k - v(x_k, t_k) / K, sigma_k^2) (noise injection, as ReinFlow, Flow-GRPO and
πRL's flow-noise/flow-SDE do), sigma = exp(log_std) learnable per executed (h, d), kept
inside LOG_STD_BOUNDS (policies/log_std.py). `policy.logprob_mode` decides which steps are noisy:

* "last_step" (the default): x_0 = 0 (the prior's mode) and steps 0..K-2 are deterministic,
  only the last step is noisy with std sigma. x_{K-1} is then a function of the observation
  alone, so the chunk log-prob is log N(a; mu, sigma^2) with mu the last step's mean:
  `evaluate(obs, a)` recomputes it from the final chunk `a` only (re-running the K expert
  passes with gradients). Exact, needs nothing but what rollouts already record; the price
  is that the exploration is Gaussian around the denoised mean (no multi-modal sampling
  from the prior during RL).
* "chain": x_0 ~ N(0, I) and every step is noisy with std sigma / sqrt(K) (an SDE with total
  injected variance sigma^2). The chunk log-prob is the sum over the K transitions of the
  Gaussian step log-probs (x_0's prior term does not depend on the weights and is left
  out), which needs the chain: sampling returns its start x_0 (extras["flow_chain_start"],
  the model's H_m x D_m) and each step's noisy entries, the executed ones of x_1..x_K
  (extras["flow_chain_taken"], K x H x D: x_K's is the returned chunk), and `evaluate`
  reads them from obs. evaluate replays the chain step by step from x_0, each step's noisy
  entries as recorded, the rest recomputed: K expert passes with gradients.
* "random_step": x_0 ~ N(0, I), one step k drawn uniformly per sample is noisy with std
  sigma, the others follow the ODE (RLinf's flow-SDE as its LIBERO recipes run it,
  `joint_logprob: False`). The log-prob is that transition's given the state it started
  from, which sampling records (extras `flow_step_x` = x_k, `flow_step_t` = t_k,
  `flow_step_taken` = x_{k+1}'s noisy entries): evaluate runs one expert pass, at x_k and
  t_k, instead of K. The exploration starts from the prior like chain's, with a K-th of its
  scoring work and of what it records. `flow_noise="sde"` makes that step RLinf's flow-SDE
  step exactly: std sqrt(1/K) * noise_level * sqrt(t_k / (1 - t_k)) fixed by its time
  (nothing learned), the mean the Euler step's less the SDE's drift correction (the
  marginals stay the flow's); RLinf draws one step for the whole batch, this one per sample.

The pipeline records the extras with every step (segments, ring, dumps) like observations.

Published folders pad the model's chunk: a horizon of H_m actions of D_m dims of which the
env executes the first H actions' first D dims (RLinf: 5 of 50). Noise enters the executed
entries alone, the only ones scored; the rest follows the deterministic mean (as trained:
openpi pads with zeros). last_step's log-prob is the executed part's exact marginal; chain's
is exact given x_0, evaluate recomputing the rest of each state with the weights it scores
(RLinf's flow-SDE noises every entry and drops the unexecuted ones' factors); random_step's
is the exact density of the one noisy transition x_k -> x_{k+1} given the recorded x_k, not
of the executed chunk (the deterministic steps before and after it are not differentiated:
RLinf's joint_logprob false, an approximation of the chunk's policy gradient).

In every mode acting returns x_K, the executed chunk (unclipped: the env clips), and its
log-prob terms per executed (h, d); `deterministic=True` adds no noise, from x_0 = 0 (the
same chunk in every mode) or, `denoise_from="noise"` (chain and random_step's default: the
start they train from), x_0 ~ N(0, I) (openpi's sampler).
Entropy: of the noisy step(s)' Gaussians, per token (the chain's is the sum of its steps'
conditional entropies).
"""

from __future__ import annotations

import math

import torch

from hpcvla.config.policy import LOGPROB_MODES
from hpcvla.policies.log_std import bounded_log_std

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class FlowDenoising:
    """The flow policy's sampler and scorer (module docstring). Reads the policy's
    `_velocity`/`_expert_pass` (one expert pass), `log_std`, `denoise_steps`,
    `logprob_mode`, `denoise_from` and its model and env dims."""

    def denoising_fields(self) -> dict[str, tuple[tuple, str]]:
        """What sampling records for evaluate, by mode: name -> (shape, dtype)."""
        model = (self.model_horizon, self.model_action_dim)
        if self.logprob_mode == "chain":
            return {"flow_chain_start": (model, "<f4"), "flow_chain_taken": (
                (self.denoise_steps, self.chunk_len, self.action_dim), "<f4")}
        if self.logprob_mode == "random_step":
            return {"flow_step_x": (model, "<f4"), "flow_step_t": ((1,), "<f4"),
                    "flow_step_taken": ((self.chunk_len, self.action_dim), "<f4")}
        return {}

    def _sigma(self):
        return bounded_log_std(self.log_std)

    def _step_log_std(self):
        """Each noisy step's log std: chain's K steps share the variance sigma^2."""
        log_std = self._sigma()
        return log_std - 0.5 * math.log(self.denoise_steps) if self.logprob_mode == "chain" \
            else log_std

    def _noisy_step(self, x, velocity, t, executed):
        """(mean, log std) of a noisy step's executed entries from x (B, H_m, D_m) at times t
        (B,), `executed` the ODE step's entries there: flow_noise learned, the ODE's step and
        log_std; sde, RLinf's flow-SDE step (the setting's doc): its time's std, the ODE's
        step less the drift correction std^2 x_1 / (2 t), x_1 = x + (1 - t) v the noise the
        velocity points back to."""
        if self.flow_noise == "learned":
            return executed, self._step_log_std()
        H, D, K = self.chunk_len, self.action_dim, self.denoise_steps
        t = t.float().view(-1, 1, 1)
        after_first = torch.where(t == 1, torch.full_like(t, 1 - 1 / K), t)  # its t / (1 - t)
        variance = self.noise_level ** 2 * t / (1 - after_first) / K  # (sqrt(1/K) sigma_t)^2
        noise = (x + (1 - t) * velocity)[:, :H, :D]
        return executed - variance * noise / (2 * t), 0.5 * torch.log(variance)

    def _times(self, B, device):
        return [torch.full((B,), 1.0 - k / self.denoise_steps, device=device)
                for k in range(self.denoise_steps)]

    def _noisy_steps(self, B, device, deterministic) -> list[torch.Tensor | None]:
        """Per step, which samples it adds noise to and scores, (B,) bools, or None for none
        (deterministic acting scores the same steps, adding nothing; random_step's then the
        last). Decided without reading a tensor (the memory model runs this on meta ones)."""
        K = self.denoise_steps
        every = torch.ones(B, dtype=torch.bool, device=device)
        if self.logprob_mode == "chain":
            return [every] * K
        if self.logprob_mode == "random_step" and not deterministic:
            picked = torch.randint(K, (B,), device=device)
            return [picked == k for k in range(K)]
        return [None] * (K - 1) + [every]

    def _denoise(self, cache, pad, state, deterministic, x0=None):
        """(chunk x_K's executed (B, H, D), log-prob terms (B, H, D), the state token's
        output, extras); from the initial noise `x0` (B, H_m, D_m) where given (DSRL), else
        from the mode's x_0."""
        B, K, H, D = pad.shape[0], self.denoise_steps, self.chunk_len, self.action_dim
        x = torch.zeros(B, self.model_horizon, self.model_action_dim, device=pad.device)
        if x0 is not None:
            x = x0.to(x)
        elif self.denoise_from == "noise" if deterministic else self.logprob_mode != "last_step":
            x = torch.randn_like(x)
        terms, state_out, start, taken = torch.zeros(B, H, D, device=pad.device), None, x, []
        step = {name: torch.zeros(B, *shape, device=pad.device)
                for name, (shape, _) in self.denoising_fields().items()
                if self.logprob_mode == "random_step"}
        noisy = self._noisy_steps(B, pad.device, deterministic)
        for k, t in enumerate(self._times(B, pad.device)):
            velocity, out = self._velocity(cache, pad, state, x, t)
            if k == 0:  # the value head reads the state features of the first step
                state_out = out
            mean = x - velocity / K
            if noisy[k] is not None:  # noise on the executed entries of the samples it picks
                picked = noisy[k][:, None, None]
                executed = mean[:, :H, :D]  # the ODE's, where no noise is drawn
                centre, log_std = self._noisy_step(x, velocity, t, executed)
                drawn = executed if deterministic else torch.where(
                    picked, centre + log_std.exp() * torch.randn_like(executed), executed)
                terms = terms + torch.where(picked, _gaussian(drawn, centre, log_std), 0.0)
                for name, value in (("flow_step_x", x), ("flow_step_t", t[:, None]),
                                    ("flow_step_taken", drawn)):
                    if name in step:  # random_step: the state its noisy step started from
                        at = noisy[k].view(-1, *[1] * (value.dim() - 1))
                        step[name] = torch.where(at, value, step[name])
                mean = _with_executed(mean, drawn)
                taken.append(drawn)
            x = mean
        extras = {"flow_chain_start": start, "flow_chain_taken": torch.stack(taken, dim=1)} \
            if self.logprob_mode == "chain" else step
        return x[:, :H, :D], terms, state_out, extras

    def _rescore(self, cache, pad, state, obs, actions):
        """(log-prob terms, entropy terms, the state token's output) of the recorded
        `actions` under the current weights, with gradients: the mode's transitions."""
        missing = [name for name in self.denoising_fields() if name not in obs]
        if missing:
            raise KeyError(f"logprob_mode={self.logprob_mode!r} scores what sampling recorded: "
                           f"pass obs[{missing[0]!r}] as sample() returned it in extras, or "
                           "use logprob_mode='last_step'")
        if self.logprob_mode == "random_step":  # one expert pass, where the noise entered
            x, t = obs["flow_step_x"].float(), obs["flow_step_t"].float()[:, 0]
            velocity, state_out = self._expert_pass(cache, pad, state, x, t)
            mean = x - velocity / self.denoise_steps
            centre, log_std = self._noisy_step(x, velocity, t,
                                               mean[:, :self.chunk_len, :self.action_dim])
            terms = _gaussian(obs["flow_step_taken"].float(), centre, log_std)
        else:
            log_std = self._step_log_std()
            terms, state_out = self._replay(cache, pad, state, obs, actions, log_std)
        steps = self.denoise_steps if self.logprob_mode == "chain" else 1
        entropy = (steps * (log_std + 0.5 + _LOG_SQRT_2PI)).expand_as(terms)
        return terms, entropy, state_out

    def _replay(self, cache, pad, state, obs, actions, log_std):
        """last_step and chain: the denoising replayed with gradients from x_0 (0, or chain's
        recorded start), chain's executed entries set to the recorded ones after each step,
        the rest recomputed."""
        B, K, H, D = pad.shape[0], self.denoise_steps, self.chunk_len, self.action_dim
        x = torch.zeros(B, self.model_horizon, self.model_action_dim, device=pad.device)
        if self.logprob_mode == "chain":
            x = obs["flow_chain_start"].float()
            recorded = obs["flow_chain_taken"].float()  # x_1 .. x_K's executed entries
        terms, state_out = torch.zeros(B, H, D, device=pad.device), None
        for k, t in enumerate(self._times(B, pad.device)):
            velocity, out = self._expert_pass(cache, pad, state, x, t)
            if k == 0:  # the value head reads the state features of the first step
                state_out = out
            x = x - velocity / K
            if k == K - 1:
                terms = terms + _gaussian(actions.float(), x[:, :H, :D], log_std)
            elif self.logprob_mode == "chain":
                taken = recorded[:, k]
                terms = terms + _gaussian(taken, x[:, :H, :D], log_std)
                x = _with_executed(x, taken)
        return terms, state_out


def _with_executed(x, executed):
    """x (B, H_m, D_m) with its first H actions' first D dims replaced by executed (B, H, D)."""
    H, D = executed.shape[1:]
    head = torch.cat([executed, x[:, :H, D:]], dim=2)
    return torch.cat([head, x[:, H:]], dim=1)


def _gaussian(x, mean, log_std):
    """Elementwise log N(x; mean, exp(log_std)^2)."""
    return -0.5 * ((x - mean) * torch.exp(-log_std)) ** 2 - log_std - _LOG_SQRT_2PI


__all__ = ["FlowDenoising", "LOGPROB_MODES"]
