"""`hpcvla bench learning`: compare two training set-ups ("arms") on one task, seeds each.

Arm sets (`--arms`):

* `modes` (default): does asynchrony cost sample efficiency? `streamer` (4 ranks: 2
  simulators, 1 inference, 1 learner; samples up to `pipeline.max_staleness` versions old,
  corrected by the decoupled PPO objective) against `sync-colocated` (2 ranks in lock-step,
  never stale; 2 learners x 16 segments), the same learner batch per version.
* `critic`: the critic's own schedule (`critic`, the defaults: `algorithm.critic_lr` 10x the
  policy's, no value clip; 8 epochs) against a shared one (`shared`: the policy's rate,
  clipped, 4 epochs), both streamer.
* `flow-noise`: RL from a pretrained flow policy, as from a π0 checkpoint: `reach_flow`
  first trained for `PRETRAIN_UPDATES` (seed 1000) and saved as a checkpoint folder
  (`save_pretrained`), then both arms start from it (`policy.pretrained`): `last_step`
  (x_0 = 0, one noisy last step) against `chain` (x_0 ~ N(0, I), noise at every step as
  πRL's flow-noise; the pretrained sampler's own distribution). policies/flow_denoising.py.
* `flow-sde`: the same start, `random_step` (x_0 ~ N(0, I), one noisy step drawn per sample,
  scored with one expert pass: RLinf's flow-SDE) against `last_step`.
* `flow-sde-step`: the same start, both `random_step`: its step as RLinf's flow-SDE takes it
  (`sde`: the std fixed by the step's time, the mean drift-corrected) against a std learned
  around the Euler step (`learned`).
* `dsrl`: the same pretrained start, RL in its noise space against fine-tuning it: `dsrl`
  (SAC's small noise actor steers the frozen flow policy's sampler, policies/noise_actor.py;
  SAC's settings of configs/colocated_sac.yaml for reach's small rewards) against `ppo`
  (`last_step`: PPO on the whole flow policy).
* `dsrl-state`: `dsrl` with the noise actor and its critics reading reach's state alone
  (algorithm.noise_obs=state, as DSRL's own experiments steer from the low-dim state)
  against reading everything the flow policy reads (camera, instruction, state).
* `families`: the two VLA heads on reach under PPO, 4 ranks, 32 px (4 image patches of
  their tiny towers): `flow` (π0-style flow matching, configs/reach_flow.yaml) against
  `tokens` (OFT-style parallel action tokens, configs/reach_tokens.yaml). Measured before
  (held-out success, 128 states): flow after 150 updates 0.90 / 0.34 / 0.77 / 0.94 over seeds
  0-3, tokens after 120 updates 1.0 / 1.0 / 0.99 over seeds 0-2; at 64 px flow's take-off
  varied with the seed and the async timing (0.01-0.92 at 120 updates).
* `off-policy`: SAC against PPO on reach, both sync-colocated on 2 ranks with the same env
  steps per version (configs/colocated_sac.yaml against configs/colocated.yaml).
* `imitation`: `modes` on a real task from an imitation start, as VLA users post-train:
  ManiSkill PushCube-v1 (configs/maniskill_pushcube.yaml), `IMITATION_DEMOS` scripted-expert
  demonstrations (`hpcvla demos`, training states, `--demo-noise` on the expert's actions),
  `hpcvla sft` on them, then both arms from that SFT run (`policy.checkpoint`): streamer
  (4 ranks, 1 learner x 16 segments) against sync-colocated (2 ranks, 2 learners x 8
  segments), 16 segments of 10 chunks per version each.
* `prior-data`: what off-policy RL gains from demonstrations, as the field's recipe for
  robots uses them: ManiSkill PushCube-v1 from state (configs/maniskill_pushcube_sac.yaml;
  `--config`: another recipe, e.g. configs/maniskill_pickcube_sac.yaml), `PRIOR_DEMOS`
  scripted-expert demonstrations (`--demos`); `rlpd` keeps them as prior data (half of
  every sampled batch) from a fresh policy, `ppo` starts from `hpcvla sft` on the same
  demonstrations with ManiSkill's PPO baseline's settings (PPO_BASELINE's). Both evaluate the
  held-out states every `PRIOR_EVAL_EVERY` versions while training (eval.every, deterministic
  actions): each run's env steps to a held-out success of `TARGET_SUCCESS`.
* `dsrl-sft`: DSRL on a real task from an imitation start, as DSRL steers a fine-tuned π0:
  ManiSkill PushCube-v1 with the flow policy (configs/maniskill_pushcube_flow.yaml;
  `--config`: another flow recipe), `hpcvla demos` and `hpcvla sft` as `imitation`, then
  `dsrl` (SAC's noise actor on the state, reach's DSRL settings, a 100x smaller
  temperature: dsrl_sft_arms) against `recipe` (the recipe's own RL: GRPO on success), both
  from that SFT run.
* `scratch`: `prior-data` without the demonstrations: `sac` against `ppo` (the same
  baseline settings), both from a fresh policy, the same held-out schedule.
* `setting`: any change to a recipe, measured: the recipe `--config` with the `--setting`s
  (`changed`) against it as it is (`recipe`), both on 4 ranks; from a fresh policy, or with
  `--demos` from `hpcvla demos` and `hpcvla sft` on that many as `imitation` (both arms from
  that SFT run). E.g. OpenVLA-OFT's L1 recipe from its SFT start with a learning-rate warm-up:
  `--arms setting --config configs/reach_oft_l1.yaml --demos 128 --demo-noise 0 --setting
  algorithm.lr_warmup_versions=10`.

Every run of an arm set is a real `hpcvla train` with the same env-step budget as its twin (on
reach 32 segments of 8 chunks per version; `off-policy`: 64, 2 colocated learners); every rank
draws its own exploration noise. Compared on `hpcvla eval` of each run's final checkpoint: the
same fixed initial states (`eval_episodes` of them) for every arm and seed, not the rolling
training success (which counts episodes of several policy versions, sampled on the training
states); each checkpoint twice, acting as training does (sampled) and with its deterministic
action (as ManiSkill's baselines evaluate). Reported: per run both eval successes, the rolling
success curve against trained env steps (on a common grid) and the mean explained variance of
the critic from update 30 on; per arm the means; the differences of the means (first arm -
second) with 95 % Welch confidence intervals. A PNG of the overlaid curves goes next to the
JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from hpcvla.config import load_config
from hpcvla.config.imitation import read_by
from hpcvla.files import read_log
from hpcvla.job.trainrun import train_run
from hpcvla.metrics.progress import figure
from hpcvla.metrics.stats import known_difference, known_mean

# Arm sets: arm -> command-line of its runs. Every arm trains 32 segments x 8 chunks per version
# (off-policy: 64, its 2 colocated learners at the learner defaults).
# `modes` and `critic` run reach with 64 px images and 8 PPO epochs per version (the default
# job's 32 px and 1 epoch would be a different, learner-light comparison).
REACH = ["env.image_size=64", "learner.epochs=8"]
STREAMER = ["configs/default.yaml", "--ranks", "4", "pipeline.mode=streamer", *REACH]
ARMS = {
    "modes": {"streamer": STREAMER,
              "sync-colocated": ["configs/colocated.yaml", "--ranks", "2",
                                 "learner.micro_batches=1", *REACH]},
    "critic": {"critic": STREAMER,  # the default critic: its own rate, unclipped
               "shared": STREAMER + ["algorithm.critic_lr=0", "algorithm.value_clip=true",
                                     "learner.epochs=4"]},
}
ARMS["families"] = {family: [f"configs/reach_{family}.yaml", "--ranks", "4", "env.image_size=32"]
                    for family in ("flow", "tokens")}
ARMS["off-policy"] = {"sac": ["configs/colocated_sac.yaml", "--ranks", "2"],
                      "ppo": ["configs/colocated.yaml", "--ranks", "2"]}
FLOW = ["configs/reach_flow.yaml", "--ranks", "4", "policy.pretrained={pretrained}"]
ARMS["flow-noise"] = {"last_step": FLOW, "chain": FLOW + ["policy.logprob_mode=chain"]}
ARMS["flow-sde"] = {"random_step": FLOW + ["policy.logprob_mode=random_step"], "last_step": FLOW}
ARMS["flow-sde-step"] = {"sde": ARMS["flow-sde"]["random_step"] + ["policy.flow_noise=sde"],
                         "learned": ARMS["flow-sde"]["random_step"]}
DSRL_SETTINGS = ["algorithm.name=sac", "algorithm.init_temperature=0.01",
                 "algorithm.batch_size=128", "algorithm.utd=0.25"]
DSRL = FLOW + DSRL_SETTINGS
ARMS["dsrl"] = {"dsrl": DSRL, "ppo": FLOW}
ARMS["dsrl-state"] = {"state": DSRL + ["algorithm.noise_obs=state"], "dsrl": DSRL}
PUSHCUBE_SAC = "configs/maniskill_pushcube_sac.yaml"
PRIOR_DEMOS, PRIOR_EVAL_EVERY, TARGET_SUCCESS = 16, 10, 0.8
PPO_BASELINE = "configs/maniskill_pushcube_baseline.yaml"  # ManiSkill's ppo.py settings
HELD_OUT = [f"eval.every={PRIOR_EVAL_EVERY}", "eval.episodes=64", "eval.deterministic=true"]


def ppo_baseline() -> list[str]:
    """PPO_BASELINE's algorithm section and epochs, as overrides of another recipe of its task
    (PUSHCUBE_SAC: its controller and layout)."""
    import yaml
    recipe = yaml.safe_load(Path(PPO_BASELINE).read_text())
    return [*(f"algorithm.{key}={value}" for key, value in recipe["algorithm"].items()),
            f"learner.epochs={recipe['learner']['epochs']}"]


def prior_data_arms(config: str = PUSHCUBE_SAC) -> dict:
    return {"rlpd": [config, "--ranks", "2", "algorithm.name=rlpd", "algorithm.demos={demos}",
                     *HELD_OUT],
            "ppo": [config, "--ranks", "2", *ppo_baseline(), "policy.checkpoint={pretrained}",
                    *HELD_OUT]}


def scratch_arms(config: str = PUSHCUBE_SAC) -> dict:
    return {"sac": [config, "--ranks", "2", *HELD_OUT],
            "ppo": [config, "--ranks", "2", *ppo_baseline(), *HELD_OUT]}


PRETRAIN = {"flow-noise": ["configs/reach_flow.yaml", "--ranks", "4", "run.seed=1000"]}
PRETRAIN["dsrl"] = PRETRAIN["dsrl-state"] = PRETRAIN["flow-sde"] = PRETRAIN["flow-noise"]
PRETRAIN["flow-sde-step"] = PRETRAIN["flow-noise"]
PRETRAIN_UPDATES = 40  # the start: ~0.89 held-out success (sampled; 2 runs of seed 1000)
IMITATION_CONFIG = "configs/maniskill_pushcube.yaml"  # `--config` names another recipe
# (the `imitation` arm set is built from its recipe when run: imitation_arms)


def imitation_arms(config: str = IMITATION_CONFIG) -> dict:
    """The `imitation` arm set on a task recipe `config` (its demos, SFT and RL settings):
    the recipe's layout, and sync-colocated's 2 learners taking half its batch each."""
    learner = load_config(config).learner
    half = learner.micro_batch * learner.micro_batches // 2
    push = [config, "policy.checkpoint={pretrained}"]
    return {"streamer": push + ["--ranks", "4"],
            "sync-colocated": push + ["--ranks", "2", "placement.mode=colocated",
                                      "pipeline.mode=sync-colocated", "env.shards=1",
                                      f"learner.micro_batch={half}",
                                      "learner.micro_batches=1"]}


IMITATION_DEMOS = 64  # the default recipe's: sft.per_task (16) of them are used, ~0.2 success
FLOW_SFT_CONFIG = "configs/maniskill_pushcube_flow.yaml"  # `dsrl-sft`'s recipe: all 64 used
DEMO_NOISE = 0.1  # the expert's action noise in the recipes' demonstrations (--demo-noise)


def dsrl_sft_arms(config: str = FLOW_SFT_CONFIG) -> dict:
    """The `dsrl-sft` arm set on a flow recipe `config`: DSRL (its noise actor on the state,
    reach's DSRL settings but a 100x smaller temperature) against the recipe's own RL, both
    from its SFT run. PushCube's noise has 35 dimensions and a sparse reward: at reach's 0.01
    the entropy bonus (~0.2 a chunk) outweighed the success and the actor stayed at the prior;
    at 1e-4 it lifts the start (docs/results.md, "DSRL from the flow recipe's SFT start")."""
    start = [config, "--ranks", "4", "policy.checkpoint={pretrained}"]
    return {"dsrl": [*start, *DSRL_SETTINGS, "algorithm.noise_obs=state",
                     "algorithm.init_temperature=0.0001"], "recipe": start}


def setting_arms(config: str, settings: list[str], from_sft: bool) -> dict:
    """The `setting` arm set: the recipe `config` with `settings` changed against it as it is,
    on 4 ranks, from its SFT run when `from_sft`."""
    start = [config, "--ranks", "4", *(["policy.checkpoint={pretrained}"] if from_sft else [])]
    return {"changed": [*start, *settings], "recipe": start}


# the arm sets built on a task recipe: their arms of a recipe, their recipe and demonstrations
RECIPE_ARMS = {"imitation": (imitation_arms, IMITATION_CONFIG, IMITATION_DEMOS),
               "prior-data": (prior_data_arms, PUSHCUBE_SAC, PRIOR_DEMOS),
               "scratch": (scratch_arms, PUSHCUBE_SAC, 0),
               "dsrl-sft": (dsrl_sft_arms, FLOW_SFT_CONFIG, IMITATION_DEMOS)}
EVAL_SEED = 12345  # the eval's states and action noise: one fixed set for every run
# Each checkpoint's two evals (both_evals): the result's key -> the suffix of its JSON figures
EVALS = {"eval": "", "eval_deterministic": "_deterministic"}


def env_steps_per_version(arm_set: dict, overrides=()) -> int:
    """Trained env steps per version (segments x chunks x chunk_len, over the learners),
    equal for both arms of a set: what the set's first arm trains (reach: 16 x 2 x 8 x 4 on
    one learner). Every arm's settings are loaded with the bench's `overrides` first: one an
    arm refuses raises ConfigError, naming the arm, before any arm has trained."""
    from hpcvla.config import ConfigError, load_config
    from hpcvla.topology.plan import plan_from_config
    for arm, (config, *args) in reversed(arm_set.items()):  # the first arm's loaded last
        try:  # the placeholders of what pretrain makes: names only, no file is read here
            cfg = load_config(config, [a.format(pretrained="start", demos="demos.h5")
                                       for a in args if "=" in a] + list(overrides))
        except ConfigError as err:
            raise ConfigError(err.problems, f"settings of arm {arm} ({config} with its "
                              "layout and the bench's overrides)") from None
    learners = len(plan_from_config(cfg.placement, int(args[args.index("--ranks") + 1]))
                   .learners)
    return learners * cfg.learner.micro_batch * cfg.learner.micro_batches * \
        cfg.rollout.segment_len * cfg.env.chunk_len


def curve(records: list[dict], grid: np.ndarray) -> list[float]:
    """Rolling success rate against trained env steps, sampled on `grid` (last value held);
    the training records only (a held-out evaluation's record has its own: held_out_of). 0
    before any episode's end is counted (with several learners, pooled at the end of the
    version before a record's)."""
    records = [r for r in records if "trained_env_steps" in r and "held_out" not in r]
    steps = np.array([r["trained_env_steps"] for r in records], float)
    success = np.array([r["success_rate"] or 0.0 for r in records], float)
    return np.interp(grid, steps, success).round(4).tolist()


def held_out_of(records: list[dict]) -> dict:
    """The held-out evaluations made while training (eval.every): their curve against trained
    env steps and the env steps at which it first reached TARGET_SUCCESS (None: never); empty
    for a run without them."""
    held = [r["held_out"] for r in records if "held_out" in r]
    if not held:
        return {}
    reached = [h["trained_env_steps"] for h in held  # (None: every episode an env fault)
               if h["success_rate"] is not None and h["success_rate"] >= TARGET_SUCCESS]
    return {"held_out": [[h["trained_env_steps"], h["success_rate"]] for h in held],
            f"env_steps_to_{TARGET_SUCCESS:g}": reached[0] if reached else None}


def late_explained_variance(records: list[dict], from_update: int = 30) -> float | None:
    """Mean explained variance of the critic over the micro-batches from `from_update` on
    (None under GRPO, which has no critic; the last half of the run when it is shorter)."""
    ev = [(r["update"], r["explained_variance"]) for r in records if "explained_variance" in r]
    if not ev:
        return None
    start = min(from_update, ev[-1][0] // 2)
    return float(np.mean([e for u, e in ev if u >= start]))


def train_and_eval(args: list[str], root: Path, eval_episodes: int) -> dict:
    """One `hpcvla train *args` under `root` (less the sft settings a bench gives its SFT start
    too), then `hpcvla eval` of its final checkpoint (in this process)."""
    from hpcvla.evaluate import checkpoint_weights
    run_dir, summary = train_run(read_by("train", args), root, timeout=3600)
    weights, _ = checkpoint_weights(run_dir)
    return {"run_dir": run_dir, "summary": summary, "metrics": read_log(run_dir / "metrics.jsonl"),
            **both_evals(load_config(run_dir / "config.yaml", record=True), weights,
                         eval_episodes)}


def both_evals(cfg, weights, eval_episodes: int) -> dict:
    """`hpcvla eval` with sampled actions (as training acts) and with deterministic ones
    (as ManiSkill's baselines evaluate), on the same fixed states."""
    from hpcvla.evaluate import evaluate
    return {key: evaluate(cfg, weights, episodes=eval_episodes, seed=EVAL_SEED,
                          deterministic=deterministic)
            for key, deterministic in zip(EVALS, (False, True))}


def pretrain(arms: str, root: Path, eval_episodes: int, overrides=(), config=IMITATION_CONFIG,
             demos=IMITATION_DEMOS, noise=DEMO_NOISE) -> tuple[Path, dict] | tuple[None, None]:
    """The arm set's starting checkpoint folder (`PRETRAIN`) or SFT run (`imitation` on the
    recipe `config`, which takes the bench's `overrides` too: the demonstrations, SFT and RL
    see one env and policy), and its eval; none for most."""
    if arms in ("imitation", "dsrl-sft") or (arms == "setting" and demos):
        return imitation_start(root, eval_episodes, overrides, config, demos, noise=noise)
    if arms == "prior-data":  # the demonstrations (root/demos.h5) and PPO's SFT start
        return imitation_start(root, eval_episodes, overrides, config, demos,
                               sft=[*ppo_baseline(), f"sft.per_task={demos}"], noise=noise)
    if arms not in PRETRAIN:
        return None, None
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    from hpcvla.policies import save_pretrained
    runs = root / "pretrain"
    done = train_and_eval([*PRETRAIN[arms], f"pipeline.total_updates={PRETRAIN_UPDATES}",
                           "pipeline.progress_every_s=1000"], runs, eval_episodes)
    from hpcvla.evaluate import checkpoint_weights
    cfg = load_config(done["run_dir"] / "config.yaml", record=True)
    policy = build_policy(cfg, env_spec(cfg.env))
    policy.load_arrays(checkpoint_weights(done["run_dir"])[0])
    print(f"pretrained {PRETRAIN_UPDATES} updates: eval success "
          f"{figure(done['eval']['success_rate'], 3)}", flush=True)
    return save_pretrained(policy, root / "pretrained"), \
        {key: done[key] for key in EVALS}


def imitation_start(root: Path, eval_episodes: int, overrides=(), config=IMITATION_CONFIG,
                    episodes=IMITATION_DEMOS, sft=(), noise=DEMO_NOISE) -> tuple[Path, dict]:
    """`hpcvla demos` (`episodes` of them, at `noise`, into root/demos.h5) then `hpcvla sft`
    with the recipe `config` and `overrides` (e.g. env.camera=false; `sft`: the SFT's own):
    the SFT run directory every `imitation` arm starts from, and its eval."""
    from hpcvla.evaluate import checkpoint_weights
    demos = root / "demos.h5"
    for command in (["demos", config, *overrides, "--episodes", str(episodes),
                     "--noise", str(noise), "--out", str(demos)],
                    ["sft", config, *read_by("sft", [*overrides, *sft]), f"sft.demos={demos}",
                     f"run.root={root / 'sft'}"]):
        subprocess.run([sys.executable, "-m", "hpcvla", *command], check=True, timeout=3600)
    (run_dir,) = (root / "sft").iterdir()
    result = both_evals(load_config(run_dir / "config.yaml", record=True),
                        checkpoint_weights(run_dir)[0], eval_episodes)
    print(f"imitation start (sft): eval success {figure(result['eval']['success_rate'], 3)} "
          f"(deterministic {figure(result['eval_deterministic']['success_rate'], 3)})",
          flush=True)
    return run_dir, result


def run(seeds=3, updates=200, json_path=None, overrides=(), arms="modes",
        eval_episodes=256, config=None, demos=None, demo_noise=None, settings=()) -> dict:
    """The arm set `arms`; those built on a task recipe (RECIPE_ARMS) on `config` instead of
    their own, from `demos` demonstrations at `demo_noise` instead of their count and
    DEMO_NOISE; `setting` on the recipe `config` with `settings`, from `demos` (0: none)."""
    noise = DEMO_NOISE if demo_noise is None else demo_noise
    recipe = RECIPE_ARMS.get(arms)
    if recipe:
        config, demos = config or recipe[1], recipe[2] if demos is None else demos
        arm_set = recipe[0](config)
    elif arms == "setting":
        demos = demos or 0
        arm_set = setting_arms(config, list(settings), demos > 0)
    else:
        arm_set = ARMS[arms]
    per_version = env_steps_per_version(arm_set, overrides)
    budget = updates * per_version
    grid = np.linspace(per_version, budget, min(updates, 50))
    results = {"arms": arms, "seeds": seeds, "updates": updates, "env_step_budget": budget,
               "eval_episodes": eval_episodes, "eval_seed": EVAL_SEED,
               "overrides": list(overrides), "grid_env_steps": grid.tolist(), "modes": {},
               **({"config": config, "demos": demos, "demo_noise": noise}
                  if recipe or arms == "setting" else {}),
               **({"settings": list(settings)} if arms == "setting" else {})}
    with tempfile.TemporaryDirectory(prefix="hpcvla-learning-") as tmp:
        pretrained, start = pretrain(arms, Path(tmp), eval_episodes, overrides, config, demos,
                                     noise)
        if start is not None:
            results.update({f"pretrained_eval_success{suffix}": start[key]["success_rate"]
                            for key, suffix in EVALS.items()})
        for arm, layout in arm_set.items():
            runs, layout = [], [p.format(pretrained=pretrained, demos=Path(tmp) / "demos.h5")
                                for p in layout]
            for seed in range(seeds):
                root = Path(tmp) / f"{arm}-{seed}"
                done = train_and_eval([*layout, f"run.seed={seed}",
                                       f"pipeline.total_updates={updates}",
                                       "pipeline.progress_every_s=1000", *overrides],
                                      root, eval_episodes)
                summary = done["summary"]
                runs.append({"seed": seed,
                             **{f"eval_success{suffix}": done[key]["success_rate"]
                                for key, suffix in EVALS.items()},
                             "final_success": summary["success_rate"],
                             "explained_variance": late_explained_variance(done["metrics"]),
                             "wall_s": summary["wall_s"], "env_steps": summary["env_steps"],
                             "curve": curve(done["metrics"], grid),
                             **held_out_of(done["metrics"])})
                ev = runs[-1]["explained_variance"]
                print(f"{arm:<15} seed {seed}: eval success "
                      f"{figure(runs[-1]['eval_success'], 3)} (deterministic "
                      f"{figure(runs[-1]['eval_success_deterministic'], 3)}; "
                      f"rolling {figure(summary['success_rate'], 3)}), explained variance "
                      f"{'-' if ev is None else f'{ev:.2f}'}, {summary['wall_s']:.0f} s",
                      flush=True)
            results["modes"][arm] = {
                "runs": runs,
                **{f"eval_mean{suffix}": known_mean([r[f"eval_success{suffix}"] for r in runs])
                   for suffix in EVALS.values()},
                "final_mean": known_mean([r["final_success"] for r in runs]),
                "curve_mean": float(np.mean([np.mean(r["curve"]) for r in runs]))}
    # eval success (the verdict), rolling final success and the curve's mean over the budget
    # (how early it learns per env step): first arm - second, with a 95 % Welch interval
    first, second = list(arm_set)
    for name, of_run in (("difference", lambda r: r["eval_success"]),
                         ("deterministic_difference", lambda r: r["eval_success_deterministic"]),
                         ("rolling_difference", lambda r: r["final_success"]),
                         ("curve_difference", lambda r: float(np.mean(r["curve"])))):
        a, b = ([of_run(r) for r in results["modes"][arm]["runs"]] for arm in (first, second))
        found = results[name] = known_difference(a, b, key := f"{first}_minus_{second}")
        print(f"{name.replace('_', ' ')}: {first} {figure(known_mean(a), 3)}, {second} "
              f"{figure(known_mean(b), 3)}; " + (  # (None: an arm has no seed with it)
                  f"difference {found[key]:+.3f} (95 % CI {found['ci95'][0]:+.3f} .. "
                  f"{found['ci95'][1]:+.3f}; seeds {found['seeds'][0]} / {found['seeds'][1]})"
                  if found else "no difference: an arm's every evaluation gave no verdict"),
              flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
        _plot(results, Path(json_path).with_suffix(".png"))
    return results


def _plot(results: dict, path: Path) -> None:
    """Rolling success per arm against trained env steps: each seed thin, the mean across
    seeds thick with its 95 % t interval shaded (hpcvla.metrics.charts.seed_curves)."""
    from hpcvla.metrics.charts import seed_curves

    seed_curves(path, results["grid_env_steps"],
                {mode: [r["curve"] for r in m["runs"]] for mode, m in results["modes"].items()},
                "success rate vs trained env steps (same budget per mode)",
                "trained env steps", "success rate", ylim=(0, 1))
