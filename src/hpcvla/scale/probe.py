"""Stage costs on this hardware, in seconds, for the scale model (model.StageCosts).

* `emulated_costs(preset)`: the emulated workload's costs are the preset's (scale/presets.py);
  the probe still times a few calls to confirm the delays hold on this machine (an emulated
  step sleeps the slowest of its envs' draws, a forward pass is padded to a + b * B), and
  measures the one cost the preset does not set: the inference rank's own bookkeeping per
  request (gathering a shard's observations, adding the step to its segment), which is real
  CPU work and, with a shard per env, a tenth of the inference rank's time.
* `reach_costs(cfg)`: the real `reach` workload: the env step of one shard per size (fit
  fixed + per env; a simulator rank steps its shards inline, one after the other), a policy
  forward per batch size (fit a + b * B), a learner micro-batch of two sizes (the PPO loss,
  backward and an optimizer step; fit fixed + per segment) and the weight bytes.

Every probe returns (StageCosts, details) where details are the raw timings.
"""

from __future__ import annotations

import time

import numpy as np

from hpcvla.config.families import simulator
from hpcvla.scale.model import StageCosts
from hpcvla.scale.presets import COST_NAMES


def _median_s(fn, repeats: int = 5) -> float:
    """Median seconds of `fn()` over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return float(np.median(times))


def _fit(xs, ys) -> tuple[float, float]:
    """Least squares y = a + b x, a and b clipped at 0."""
    b, a = np.polyfit(np.asarray(list(xs), float), np.asarray(list(ys), float), 1)
    return max(0.0, float(a)), max(0.0, float(b))


def _request_overhead(cfg, envs_per_shard: int, repeats: int = 50) -> float:
    """Seconds the inference rank spends per request besides the forward pass: gather the
    shard's observation into the batch, add the step to its segment builder and, every T
    requests, encode the finished segment for the learner's ring."""
    from hpcvla.envs import env_spec
    from hpcvla.roles.segments import SegmentBuilder, outcome_fields
    from hpcvla.transport import records
    spec = env_spec(cfg.env)
    n, H, A = envs_per_shard, spec.chunk_len, spec.action_dim
    obs = {k: np.zeros((n, *shape), dt) for k, (shape, dt) in spec.obs.items()}
    outcome = {k: np.zeros((n, *shape), dt)
               for k, (shape, dt) in outcome_fields(spec.episode_metrics).items()}
    builder = SegmentBuilder(spec.obs, n, H, A, cfg.rollout.segment_len, 0, 0,
                             spec.episode_metrics)
    actions, zeros = np.zeros((n, H, A), np.float32), np.zeros(n, np.float32)

    def one():
        gathered = {k: np.concatenate([v]) for k, v in obs.items()}
        builder.record_outcome(outcome)
        if builder.full:
            records.encode(builder.finish(zeros))
        builder.add_step(gathered, actions, zeros, zeros, 0)
    return _median_s(lambda: [one() for _ in range(repeats)]) / repeats


def emulated_costs(preset_name: str = "balanced", confirm: bool = True
                   ) -> tuple[StageCosts, dict]:
    from hpcvla.config import load_config
    from hpcvla.emulate import pad
    from hpcvla.scale.presets import PRESETS
    p = PRESETS[preset_name]
    cfg = load_config(None, ["env.image_size=32"])
    details = {"preset": preset_name, "inf_per_request_s": _request_overhead(cfg, 1)}
    if confirm:  # the delays hold: a padded forward of 16 envs, the pad's overshoot
        want = (p["inf_a_ms"] + p["inf_b_ms"] * 16) / 1e3
        details["forward16_s"] = {"want": want, "got": _median_s(
            lambda: pad(time.monotonic(), want), repeats=3)}
    costs = StageCosts(sim_median_s=p["sim_ms"] / 1e3, sim_sigma=p["sigma"],
                       inf_a_s=p["inf_a_ms"] / 1e3, inf_b_s=p["inf_b_ms"] / 1e3,
                       learn_s_per_segment=p["learn_ms_per_segment"] / 1e3,
                       inf_per_request_s=details["inf_per_request_s"])
    return costs, details


def reach_costs(cfg, shard_sizes=(1, 4, 16), batch_sizes=(1, 8, 32), micro_sizes=(4, 16)
                ) -> tuple[StageCosts, dict]:
    """Time the real reach env, the configured policy and its PPO update on this machine."""
    import torch

    from hpcvla.envs import env_spec
    from hpcvla.envs.build import make_envs
    from hpcvla.factory import build_policy
    from hpcvla.algorithms.objective import policy_loss
    from hpcvla.roles.segments import SegmentBuilder, outcome_of
    spec = env_spec(cfg.env)
    policy = build_policy(cfg, spec, "cpu")
    details: dict = {"env_step_s": {}, "forward_s": {}}
    rng = np.random.default_rng(0)

    def actions(n):
        return rng.uniform(-1, 1, (n, spec.chunk_len, spec.action_dim)).astype(np.float32)
    for n in shard_sizes:
        env = make_envs(cfg, n, seed=0)
        env.reset()
        details["env_step_s"][n] = _median_s(lambda: env.step(actions(n)))
        env.close()
    env = make_envs(cfg, max(batch_sizes), seed=0)
    obs = env.reset()
    for n in batch_sizes:
        part = policy.obs_to_tensors({k: v[:n] for k, v in obs.items()}, "cpu")
        with torch.no_grad():
            details["forward_s"][n] = _median_s(lambda: policy.sample(part))
    # a learner micro-batch: `micro_batch` segments of T real steps, loss + backward + step
    T = cfg.rollout.segment_len
    builder = SegmentBuilder({**spec.obs, **policy.extra_fields()}, max(batch_sizes),
                             spec.chunk_len, spec.action_dim, T, 0, 0, spec.episode_metrics)
    result = None
    for _ in range(T):
        with torch.no_grad():
            out, extras = policy.sample(policy.obs_to_tensors(obs, "cpu"))
        act, logprob, value = (t.numpy() for t in out)
        if result is not None:
            builder.record_outcome(outcome_of(result, spec.episode_metrics))
        builder.add_step({**obs, **{k: v.numpy() for k, v in extras.items()}}, act, logprob,
                         value, 0)
        result = env.step(act)
        obs = result.obs
    builder.record_outcome(outcome_of(result, spec.episode_metrics))
    group = builder.finish(np.zeros(builder.n, np.float32))
    env.close()
    optim = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    details["learner_micro_batch_s"] = {}
    for m in micro_sizes:
        batch = {k: v[:, :m] for k, v in group.items()
                 if k not in ("version", "meta", "bootstrap_value")}
        batch["bootstrap_value"] = group["bootstrap_value"][:m]

        def update():
            loss, _, _ = policy_loss(cfg.algorithm, policy, batch)
            optim.zero_grad()
            loss.backward()
            optim.step()
        details["learner_micro_batch_s"][m] = _median_s(update, repeats=3)
    details["weight_bytes"] = int(sum(p.numel() * p.element_size()
                                      for p in policy.parameters()))
    sim_fixed, sim_per_env = _fit(list(details["env_step_s"]), details["env_step_s"].values())
    a, b = _fit(list(details["forward_s"]), details["forward_s"].values())
    learn = details["learner_micro_batch_s"]
    learn_fixed, learn_per_segment = _fit(list(learn), learn.values())
    latency = cfg.env.latency_median_ms / 1e3
    costs = StageCosts(sim_median_s=latency, sim_sigma=cfg.env.latency_sigma if latency else 0,
                       sim_fixed_s=sim_fixed, sim_per_env_s=sim_per_env, sim_serial=True,
                       inf_a_s=a, inf_b_s=b, learn_s_per_segment=learn_per_segment,
                       learn_fixed_s=learn_fixed,
                       inf_per_request_s=_request_overhead(cfg, 1),
                       weight_bytes=details["weight_bytes"])
    details["fit"] = {"sim_fixed_s": sim_fixed, "sim_per_env_s": sim_per_env,
                      "inf_a_s": a, "inf_b_s": b, "learn_fixed_s": learn_fixed,
                      "learn_s_per_segment": learn_per_segment}
    return costs, details


def describe(costs: StageCosts) -> str:
    c = costs
    sim = [f"chunk {c.sim_median_s * 1e3:.1f} ms median (sigma {c.sim_sigma:g})"] \
        if c.sim_median_s else []
    if c.sim_fixed_s or c.sim_per_env_s:
        sim.append(f"{c.sim_fixed_s * 1e3:.2f} ms + {c.sim_per_env_s * 1e3:.3f} ms/env")
    return (("sim " + " + ".join(sim) + "; " if sim else "") +
            f"inference {c.inf_a_s * 1e3:.2f} + {c.inf_b_s * 1e3:.3f} ms/env"
            f" + {c.inf_per_request_s * 1e3:.3f} ms/request; learner "
            f"{c.learn_fixed_s * 1e3:.2f} ms/micro-batch + "
            f"{c.learn_s_per_segment * 1e3:.2f} ms/segment/epoch; weights "
            f"{c.weight_bytes / 2**20:.1f} MiB")


def config_costs(cfg) -> tuple[StageCosts, dict]:
    """Costs of the config's own workload: its emulated delays when it sets any (emulate.*,
    env.latency_median_ms), else the probed reach env and policy."""
    em = cfg.emulate
    if em.inference_ms or em.inference_ms_per_env or em.learner_ms_per_micro_batch or \
            cfg.env.latency_median_ms:
        overhead = _request_overhead(cfg, 1)
        return StageCosts(sim_median_s=cfg.env.latency_median_ms / 1e3,
                          sim_sigma=cfg.env.latency_sigma, inf_a_s=em.inference_ms / 1e3,
                          inf_b_s=em.inference_ms_per_env / 1e3,
                          learn_s_per_segment=0.0,  # emulated: a micro-batch costs the same
                          learn_fixed_s=em.learner_ms_per_micro_batch / 1e3,
                          inf_per_request_s=overhead), \
            {"source": "emulate.* of the config", "inf_per_request_s": overhead}
    if not simulator(cfg.env.name).emulated:
        raise ValueError(f"env.name={cfg.env.name}: the probe times the reach env only; "
                         f"pass --costs {'|'.join(c for c in COST_NAMES if c != 'config')}")
    costs, details = reach_costs(cfg)
    return costs, {"source": "probed reach", **details}


def named_costs(name: str, cfg=None) -> tuple[StageCosts, dict]:
    """`config` (config_costs), an emulated preset (`balanced`, `table3`) or `pi0-libero`
    (RL-VLA³'s costs, scale/predict.py)."""
    if name == "config":
        return config_costs(cfg)
    if name == "pi0-libero":  # its learner cost is per chunk sample: scale to the segments
        from dataclasses import replace

        from hpcvla.scale.predict import PI0_LIBERO, PI0_SEGMENT_LEN
        T = cfg.rollout.segment_len if cfg is not None else PI0_SEGMENT_LEN
        return replace(PI0_LIBERO, learn_s_per_segment=PI0_LIBERO.learn_s_per_segment
                       * T / PI0_SEGMENT_LEN), \
            {"source": "RL-VLA³ Tables 2-3 (hpcvla/scale/predict.py)"}
    costs, details = emulated_costs(name, confirm=False)
    return costs, {"source": f"emulated preset {name}", **details}
