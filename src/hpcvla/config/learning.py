"""The settings of how the policy is trained: the RL algorithm (`algorithm.*`); the policy's
(`policy.*`) are in policy.py, supervised fine-tuning's (`sft.*`) in imitation.py, the other
sections in schema.py, which documents the conventions. `setting` declares a documented field
(used by every section)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpcvla.config.families import ALGORITHMS, AlgorithmTraits, algorithm

GROUP_LOSS_MEANS = ("steps", "episodes", "constant")  # algorithm.group_loss_mean
# The observation fields an env may give (envs/base.EnvSpec refuses others): a simulator maps
# its cameras and state onto these names (LIBERO's agentview camera is `image`, its
# eye-in-hand one `wrist_image`), which is how every policy finds them
OBSERVATION_FIELDS = ("image", "wrist_image", "instruction", "state")
# those the small network's encoders read (policies/default.add_encoders): the `default`
# policy's, and DSRL's noise actor's (algorithm.noise_obs)
ENCODED_FIELDS = ("image", "instruction", "state")


def setting(default: Any, doc: str, *, choices: tuple | None = None,
            ge: float | None = None, le: float | None = None, paths: bool = False,
            known_as: dict[str, str] | None = None) -> Any:
    """A documented config field. Mutable defaults (dicts) are copied per instance. `paths`:
    its value names files or folders (comma-separated), which a run records as absolute
    paths (loader.recorded). `known_as`: names users bring from elsewhere, and the choice
    each is here (named when one is given)."""
    meta = {"doc": doc, "choices": choices, "ge": ge, "le": le, "paths": paths,
            "known_as": known_as or {}}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class AlgorithmConfig:
    name: str = setting(
        "ppo", "RL algorithm, both with the decoupled (staleness-aware) objective. `ppo`: "
        "actor-critic, chunk-level GAE. `grpo`: critic-free, each episode's advantage is its "
        "score against its group's (episodes from one initial state; envs restart in groups "
        "every segment, so rollout.segment_len must equal env.max_episode_chunks). `sac`: "
        "off-policy soft actor-critic (twin critics with targets, automatic entropy "
        "temperature, a tanh-squashed actor) from a replay buffer every transition enters "
        "once (algorithm.replay_capacity, utd, batch_size, tau, learning_starts); the "
        "`default` policy, or the `flow` family frozen and steered through its sampler's "
        "noise by a small actor (DSRL, algorithm.noise_bound), in any mode (disaggregated: the ring streams the transitions), "
        "learner.zero_stage < 3 (roles/off_policy.py). `rlpd`: SAC with prior data (Ball et al. 2023): half of every "
        "sampled batch from the demonstrations of `algorithm.demos`, half from the online "
        "buffer, and layer-normed critics.", choices=tuple(ALGORITHMS))
    group_size: int = setting(
        8, "GRPO: episodes per group (consecutive envs of a shard, so it must divide the envs "
        "per shard). Larger groups: better baselines, fewer distinct initial states.", ge=2)
    group_score: str = setting(
        "success", "GRPO: what an episode is scored by: `success` (0/1, the papers' sparse "
        "reward) or `return` (summed reward).", choices=("success", "return"))
    group_normalize_std: bool = setting(
        True, "GRPO: divide advantages by the group's std (false: only centre them, as Dr. "
        "GRPO argues, so easy and hard groups weigh alike).")
    group_loss_mean: str = setting(
        "steps", "GRPO: what the loss averages over. `steps`: every chunk-step of the kept "
        "episodes weighs the same (DAPO's token mean), so where success ends an episode a "
        "failure that runs to the time limit outweighs its group's successes; `episodes`: "
        "each episode's steps are averaged first, so every episode weighs the same "
        "(DeepSeekMath's GRPO). Both are means per micro-batch (the streamer trains each as "
        "it arrives). `constant`: the kept steps' policy losses summed over every step the "
        "micro-batch holds, kept or not (Dr. GRPO's constant normalizer): steps weigh as "
        "in `steps`, and the whole batch's sum is what the learners train, streamed or not; "
        "a batch with few kept steps (most groups degenerate) moves the policy less. (The "
        "entropy bonus is a mean over the kept steps under all three.)",
        choices=GROUP_LOSS_MEANS)
    lr: float = setting(3e-4, "Adam learning rate of the policy: faster learning vs. "
                        "stability.", ge=0)
    critic_lr: float = setting(
        3e-3, "Adam learning rate of the value function (the policy's `value_*` modules; 0 = "
        "`lr`). A version gives the critic `learner.epochs` optimizer steps; reach's returns "
        "take ~200 Adam steps to fit (held-out explained variance 0.89 after 200 at 3e-3, "
        "0.04 after 64). Measured on the default reach run (60 versions, explained variance "
        "of the recorded values, versions 30-45 / 45-60): `lr` for both, 4 epochs, value "
        "clip: -0.02 / -0.01; 3e-3: 0.05 / 0.17; 3e-3 unclipped: 0.09 / 0.37; 3e-3 "
        "unclipped with 8 epochs: 0.73 / 0.90; side by side over 4 seeds "
        "(`hpcvla bench learning --arms critic`) 0.56-0.89 vs ~0, and `hpcvla eval` success "
        "at 60 versions 0.94 vs 0.80. The default run (1 epoch, 500 versions): 0.94-0.98 "
        "over its second half, 4 seeds. PPO's value head and sac/rlpd's Q critics (grpo has "
        "no critic).", ge=0)
    gamma: float = setting(
        0.99, "Discount per action chunk: higher values look further ahead, with noisier "
        "returns.", ge=0, le=1)
    gae_lambda: float = setting(
        0.95, "GAE lambda: 1 = Monte Carlo (unbiased, noisy), 0 = one-step TD (biased, "
        "smooth).", ge=0, le=1)
    bootstrap_truncated: bool = setting(
        False, "PPO: bootstrap the last step of an episode the horizon "
        "(env.max_episode_chunks) ends from the value of the observation it ended at, as a "
        "time limit outside the task calls for (partial-episode bootstrapping, Pardo et al. "
        "2018; RLinf's bootstrap_type=standard). The envs keep that observation, the "
        "simulators send it beside the next episode's first, the inference rank values it "
        "after answering them: one more pass where a horizon ended episodes. false: the "
        "horizon ends the return as a failure would, which suits a task evaluated within "
        "the same time limit (success within it is the task): on reach, 4 seeds, held-out "
        "success 0.51 with against 0.67 without at 100 versions, alike at 300 and with 8 "
        "epochs (docs/results.md). An env fault is never bootstrapped, success never.")
    clip: float = setting(
        0.2, "PPO ratio clip around the proximal policy: smaller = more conservative "
        "updates. It acts from the second of `learner.epochs` on: a pass is one optimizer "
        "step, so the first one's ratio is 1, and at epochs=1 only "
        "`algorithm.max_behaviour_weight`, the learning rate and the gradient clip bound a "
        "version's step.", ge=0)
    critic_epochs: int = setting(
        0, "PPO: value-only passes over each batch after the `learner.epochs` PPO passes, "
        "one optimizer step each that moves the critic alone (the policy's weights and Adam "
        "state sit it out): more critic steps without moving the policy further, where PPO epochs are costly or unstable. Each "
        "costs a forward/backward of the micro-batches. On reach (4 epochs, 3e-3, "
        "unclipped) explained variance at versions 30-45 / 45-60: 4 passes 0.28 / 0.52, 12 "
        "passes 0.48 / 0.71, at 2.6x the learner time of 8 PPO epochs (0.73 / 0.90).", ge=0)
    critic_warmup_versions: int = setting(
        0, "PPO: the run's first versions train the critic alone: every pass over their "
        "batches (`learner.epochs`, then `critic_epochs`) is value-only, the actor's weights "
        "and Adam state untouched, so the policy acts unchanged while the critic learns its "
        "returns (verl's trainer.critic_warmup). Meant for a policy started from a "
        "checkpoint (policy.checkpoint), whose first updates a fresh critic's advantages "
        "steer; on OFT's L1 recipe on reach 5 of 100 versions gained nothing (held-out "
        "0.73 against 0.83, 3 seeds, `hpcvla bench learning --arms setting`): the "
        "frozen backbone holds the critic near a constant baseline. Counted in "
        "pipeline.total_updates; a run resumed past them does none.", ge=0)
    lr_warmup_versions: int = setting(
        0, "PPO and GRPO: the policy's learning rate (`lr`; the critic keeps `critic_lr`) "
        "rises linearly over its first trained versions (after critic_warmup_versions): the "
        "first at 1/(n+1) of it, version n on at all of it; 0: all of it from the first. "
        "Adam's first steps move every weight by about the learning rate whatever the "
        "gradient's size, which from an imitation start can throw the policy far from it in "
        "one version: on OFT's L1 recipe on reach 10 versions took the first version's KL "
        "from 0.40-0.53 to 0.004-0.009, held-out 0.81 against 0.76 (3 seeds, not separated; "
        "`hpcvla bench learning --arms setting`). A run resumed inside the ramp continues "
        "it.", ge=0)
    value_clip: bool = setting(
        False, "Clip the value update around the critic's values when the version's training "
        "began (within `clip`, in return units; not the values the acting policy recorded, "
        "versions older under asynchrony), as CleanRL: steadier critic, slower to follow large "
        "return changes. It acts from a version's second pass on (learner.epochs > 1, "
        "algorithm.critic_epochs): the first is its anchor. Off by default: anchored on the "
        "recorded values it held the critic back on reach; on the first pass, reach's critic "
        "at 4 epochs explained 0.66 of the returns against 0.52 unclipped (3 seeds, not "
        "separated; docs/results.md).")
    value_coef: float = setting(
        0.5, "Weight of the value loss against the policy loss in the shared trunk.", ge=0)
    entropy_coef: float = setting(
        0.0, "Weight of the entropy bonus (the entropy of the whole action chunk, at every "
        "`policy.logprob_granularity`): more exploration, slower convergence.", ge=0)
    advantage_norm: str = setting(
        "micro_batch", "PPO: over what the advantages are made zero-mean and unit-std. "
        "`micro_batch`: each micro-batch's own (the streamer trains one as it arrives); "
        "`batch`: the version's whole batch, every learner's (RLinf's: its rollout batch), "
        "where a micro-batch of no ended episode would otherwise scale its critic's noise up "
        "to the size of another's outcomes (sparse rewards); every mode but the streamer; "
        "`none`: as GAE gives them. On reach, dense and sparse (env.progress_reward=false), "
        "8 seeds each, batch and micro_batch were not separated (sparse, 4 epochs: 8 of 8 "
        "seeds solved against 7 of 8; docs/results.md).", choices=("micro_batch", "batch", "none"))
    dual_clip: float = setting(
        3.0, "PPO and GRPO: a negative advantage's surrogate is bounded below by this times "
        "the advantage (dual-clip PPO, Ye et al. 2020; verl's clip_ratio_c, 3 too): PPO-clip "
        "leaves ratio x advantage unbounded there, and a chunk's ratio, a product over its "
        "many action dimensions, can run far in a version of several `learner.epochs`; 0: "
        "off. Acts only where the ratio exceeds it.", ge=0)
    max_behaviour_weight: float = setting(
        2.0, "Cap of the importance weight proximal/behaviour policy for stale samples "
        "(higher corrects more, with more variance).", ge=1)
    replay_capacity: int = setting(
        100_000, "`sac`: transitions (one env's chunk-step each) the replay buffer of each "
        "learner holds in host memory, the oldest overwritten first; `hpcvla plan` counts "
        "its bytes (observation and next observation, the chunk, reward, terminal).", ge=1)
    batch_size: int = setting(
        256, "`sac`: transitions sampled per pass; a gradient step is learner.micro_batches "
        "passes on each learner.", ge=1)
    utd: float = setting(
        0.5, "`sac`: update-to-data ratio, gradient steps per env step a learner collects, "
        "counting those the buffer drops (cut by the horizon or an env fault), rounded up per "
        "micro-batch; the weights are published after each version's. "
        "Higher learns more per env step at more learner time and "
        "risks the critics overfitting (critic_layer_norm helps; DSRL on reach at 2, "
        "layer-normed, one seed: Q rose from 1 to 23 in 29 versions, past any return, and "
        "the success fell from 0.79 to 0.01).", ge=0)
    tau: float = setting(
        0.005, "`sac`: Polyak rate of the target critics per gradient step: smaller moves "
        "the Bellman target more slowly and steadily.", ge=0, le=1)
    learning_starts: int = setting(
        1000, "`sac`: transitions every learner's buffer holds before their first gradient "
        "step (until then the initial policy acts).", ge=0)
    critic_warmup: int = setting(
        0, "`sac`: the first gradient steps of each world (a resumed one too, as it refills "
        "its buffer) train the critics alone, on the "
        "policy's features as they are (no gradient to the encoders, the actor or the "
        "temperature, whose Adam state sits the steps out). A policy started from a checkpoint (policy.checkpoint: an `hpcvla "
        "sft` run) otherwise follows critics that know nothing yet and loses what it "
        "imitated; 0: every step trains all of it.", ge=0)
    init_temperature: float = setting(
        0.1, "`sac`: the entropy temperature alpha at the start; it then follows the entropy "
        "target (`target_entropy`) at `lr`: Adam moves log(alpha) by at most ~lr a gradient "
        "step, so a short run at a small lr keeps it near its start (the flow PushCube "
        "recipe's DSRL, lr 5e-5, 2,400 steps: 1e-4 -> 0.94e-4). Its scale is the reward's: "
        "alpha x the chunk's entropy is added to every step's reward, so a task whose chunks "
        "earn little (reach: ~0.05) needs a small start, or the entropy bonus is all the "
        "critics learn until alpha has decayed.", ge=1e-8)
    target_entropy: float = setting(
        -1.0, "`sac`: the entropy the temperature holds the actor at, per dimension of its "
        "action (the chunk's, or the noise's under DSRL): SAC's -1 makes the target minus "
        "the action's dimensions; DSRL's recipe uses 0, the entropy of a Gaussian of std 0.24 "
        "per dimension. Below log(2 x the box's half-width: 1, or `noise_bound`), the "
        "entropy of the uniform over the box, which no squashed actor exceeds.")
    critic_layer_norm: bool = setting(
        False, "`sac`: LayerNorm after each hidden layer of the critics (`rlpd` always has "
        "it): bounds their extrapolation to unseen actions, which high `utd` otherwise turns "
        "into divergence.")
    noise_bound: float = setting(
        1.0, "`sac` with the `flow` family (DSRL: SAC steers the frozen flow policy through "
        "its sampler's initial noise): the noise actor's outputs lie in (-noise_bound, "
        "noise_bound). The sampler was trained on N(0, 1) noise, and the bound holds in "
        "every dimension at once: once most chunks succeed the critics rank no noise above "
        "another and the actor drifts towards the bound, where the sampler never went (on "
        "reach a run at 1.5 ended below its start, three at 1.0 at or above it: "
        "docs/results.md). Larger reaches further from the demonstrated behaviour.",
        ge=0.01)
    noise_obs: str = setting(
        "", "`sac` with the `flow` family (DSRL): the observation fields the noise actor and "
        "its critics read, comma-separated (`image`, `instruction`, `state`); empty: those of "
        "them the env has (a wrist camera is the flow policy's alone). Without `image` a SAC "
        "step skips the CNN, most of its cost; the flow policy it steers still reads every "
        "field. The state alone suits tasks whose state "
        "holds the goal (reach's, ManiSkill's), not LIBERO's, which is the robot's alone.")
    demos: str = setting(
        "", "`rlpd`: the prior data, HDF5 files (comma-separated) of this project's trajectory "
        "dumps or `hpcvla demos` files, which record each chunk's reward and how its episode "
        "ended; checked against the env's observations and actions before launch by `hpcvla "
        "train` (in a world srun or mpirun started: when the learners read them, a failure "
        "that ends the world). "
        "Each host holds one copy in shared memory, its learners sampling from it.", paths=True)
    demos_per_task: int = setting(
        0, "`rlpd`: at most this many demonstrations of each task (instruction), the first in "
        "file order; 0: all.", ge=0)
    max_grad_norm: float = setting(
        0.5, "Gradient clipping norm (DeepSpeed gradient_clipping); 0 = off. With `sac`, one "
        "norm over the critics', actor's and temperature's gradients together (one optimizer "
        "steps them all), so a large critic gradient shrinks the actor's step too; SAC's and "
        "RLPD's references clip nothing (0).", ge=0)
    adam_beta2: float = setting(
        0.999, "AdamW's second-moment decay (beta1 is 0.9), `hpcvla sft`'s too: lower adapts "
        "sooner to a change in gradient scale, which steadies large models' fine-tuning "
        "(RLinf's π0/π0.5 recipes and openpi: 0.95; RLinf's OFT ones: 0.999).",
        ge=0.0, le=0.99999)
    adam_eps: float = setting(
        1e-5, "AdamW's epsilon, `hpcvla sft`'s too: PPO's customary 1e-5 (CleanRL, Stable "
        "Baselines3) against torch's and RLinf's 1e-8; larger damps the steps of parameters "
        "whose gradients are tiny; 0 would divide by zero where a gradient is.", ge=1e-12)
    weight_decay: float = setting(
        0.0, "AdamW's decoupled weight decay on every trained parameter, `hpcvla sft`'s too "
        "(RLinf's recipes: 0.01): norms, biases and the learned exploration log-std (towards "
        "std 1) alike; 0: none. ppo and grpo only: SAC's temperature is a trained "
        "parameter the decay would pull to 1.", ge=0)


    @property
    def values_truncations(self) -> bool:
        """Rollouts value the observation each horizon-ended episode ended at (PPO with
        bootstrap_truncated): simulators send it, inference ranks value it."""
        return self.traits.advantage == "gae" and self.bootstrap_truncated

    @property
    def off_policy(self) -> bool:
        """Learns from a replay buffer (roles/off_policy.py) rather than each version's
        fresh segments; its segments carry the observation after their last row (the last
        transition's next observation: roles/segments.py)."""
        return self.traits.off_policy

    @property
    def traits(self) -> AlgorithmTraits:
        """What the code asks of this algorithm (config/families.ALGORITHMS), rather than its
        name: the modules below the settings (schedule, losses, roles) ask it here."""
        return algorithm(self.name)


def noise_obs_fields(alg: AlgorithmConfig) -> tuple[str, ...]:
    """algorithm.noise_obs as a tuple of field names (empty: ENCODED_FIELDS the env has)."""
    return tuple(f.strip() for f in alg.noise_obs.split(",") if f.strip())


def states_stage(learner) -> int:
    """The ZeRO stage that partitions the learners' optimizer states (checkpoints, the memory
    plan): learner.zero_stage under DeepSpeed; Horovod's learners each hold all (0)."""
    return learner.zero_stage if learner.backend == "deepspeed" else 0

