"""The settings of what is trained and how: the policy (`policy.*`) and the RL algorithm
(`algorithm.*`); supervised fine-tuning (`sft.*`) is in imitation.py, the other sections in
schema.py, which documents the conventions. `setting` declares a documented field (used by
every section)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpcvla.config.families import FAMILIES

GROUP_LOSS_MEANS = ("steps", "episodes", "constant")  # algorithm.group_loss_mean
OBS_FIELDS = ("image", "instruction", "state")  # what an env's observations may hold


def setting(default: Any, doc: str, *, choices: tuple | None = None,
            ge: float | None = None, le: float | None = None, paths: bool = False) -> Any:
    """A documented config field. Mutable defaults (dicts) are copied per instance. `paths`:
    its value names files or folders (comma-separated), which a run records as absolute
    paths (loader.recorded)."""
    meta = {"doc": doc, "choices": choices, "ge": ge, "le": le, "paths": paths}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class PolicyConfig:
    name: str = setting(
        "default", "Policy family: `default` is a small CNN + instruction encoder with a "
        "Gaussian action-chunk head and a value head. `flow`: π0-style VLA, a "
        "SigLIP+Gemma prefix and a Gemma action expert that denoises the chunk (flow "
        "matching; RL log-probs as policy.logprob_mode says). `tokens`: "
        "OpenVLA-OFT-style VLA, a SigLIP+Llama model decoding 256-bin action tokens in "
        "one pass. Both built from transformers configs, with random weights unless "
        "`pretrained` or `checkpoint` gives them. `oft`: "
        "OpenVLA-OFT as published (DINOv2+SigLIP, Llama-2, action tokens in its vocabulary), "
        "loading OFT's checkpoint folders (`pretrained`) and sampling/scoring as RLinf's RL "
        "(policies/oft.py).",
        choices=tuple(FAMILIES))
    hidden: int = setting(
        128, "`default`: width of the policy's feature trunk: wider learns more, costs more "
        "per step. `flow` under algorithm.name=sac: the same for its noise actor and critics "
        "(DSRL, policies/noise_actor.py).", ge=8)
    size: str = setting(
        "tiny", "`flow`/`tokens`/`oft`: size preset. `tiny` (~0.2M parameters; oft ~1.1M, "
        "mostly its 32064-row vocabulary) trains on a CPU; `small` (~8M; oft ~22M, 16M of them "
        "its vocabulary) for one GPU; `full` is the real size (flow: PaliGemma-3B + 300M "
        "expert like π0; tokens: Llama-2-7B + SigLIP like OpenVLA; oft: OpenVLA-7B), for GPUs "
        "with learner.zero_stage 3. `flow`/`oft` with a `pretrained` folder take the checkpoint's "
        "sizes instead (from its tensors).", choices=("tiny", "small", "full"))
    denoise_steps: int = setting(
        0, "`flow`: Euler denoising steps per chunk. More give a finer flow (π0 uses 10) "
        "at proportionally more expert passes per act and per training step. 0 = the "
        "pretrained folder's own sampler (LeRobot's `num_inference_steps` in config.json, "
        "openpi's 10), else 4.", ge=0)
    train_expert_only: bool = setting(
        False, "`flow`: freeze the vision-language prefix and train only the action "
        "expert, value head and exploration std: cheaper backward, keeps pretrained VLM "
        "features intact, adapts less.")
    lora_rank: int = setting(
        0, "`flow`/`tokens`/`oft`: >0 puts LoRA adapters of this rank (peft) on the language "
        "models' attention and MLP projections (π0's expert too) and freezes every pretrained "
        "weight: only the adapters and the heads train, get optimizer state and cross the "
        "weight plane each version (far less learner memory and network; adapts less than a "
        "full fine-tune). 0: off. `hpcvla export` merges them into the weights.", ge=0)
    lora_alpha: float = setting(
        16.0, "LoRA's scale numerator: the adapters' update is scaled by lora_alpha / "
        "lora_rank (higher: larger steps for the same learning rate).", ge=0.001)
    variant: str = setting(
        "pi0", "`flow`: `pi0` (the time joins each action token; the state is a token of its "
        "own) or `pi05` (π0.5: the time conditions every expert norm, adaRMS; the state "
        "belongs in the prompt). A `pretrained` folder sets it from its tensors.",
        choices=("pi0", "pi05"))
    logprob_mode: str = setting(
        "last_step", "`flow`: which denoising steps are noisy, i.e. what RL explores with and "
        "scores. `last_step`: only the last (x_0 = 0; a Gaussian around the denoised mean; "
        "exact, cheap). `chain`: every step, from x_0 ~ N(0, I), as πRL's flow-SDE/ReinFlow: "
        "the policy samples like the pretrained sampler, the pipeline records the whole "
        "denoising chain with every step (segments, ring, dumps: K x H x D floats per env "
        "and step) and scores all K transitions.", choices=("last_step", "chain"))
    denoise_from: str = setting(
        "zero", "`flow`: where acting without exploration noise (`hpcvla eval "
        "--deterministic`, eval.deterministic, `demos --deterministic`) starts denoising. "
        "`zero`: x_0 = 0, the prior's mode (one chunk per observation; what last_step RL "
        "trains). `noise`: x_0 ~ N(0, I) drawn per chunk (seeded per evaluation batch), then "
        "the same Euler steps with nothing added: openpi's sampler and RLinf's π0 evaluation, "
        "what their published numbers are of.", choices=("zero", "noise"))
    init_log_std: float = setting(
        -0.7, "Initial log of the exploration std (learned): per action entry (`default`, "
        "`flow` last_step, `oft` with OFT's L1-regression head, in its normalized action "
        "space; `tokens`: the spread of its initial bins); `flow` chain: the "
        "total noise injected over the chain (each of K steps gets std / sqrt(K)). Lower "
        "starts closer to a pretrained policy's own actions, explores less. From an `hpcvla "
        "sft` run (policy.checkpoint) it starts here too where SFT does not fit it (`flow`, "
        "`oft`'s L1 head); the `default` family keeps the std its likelihood fitted.")
    logprob_granularity: str = setting(
        "chunk", "`flow`/`tokens`/`oft`: unit of the PPO ratio and its clip: one per chunk, per "
        "action or per token (action dim). Finer units clip each part separately (fewer "
        "samples fully clipped) but ignore correlations inside the chunk. The policy loss "
        "is a mean over units: at `action`/`token` its gradient is 1/H or 1/(H x dims) of "
        "`chunk`'s, while the value loss and the entropy bonus (the chunk's) keep theirs, so "
        "value_coef and entropy_coef weigh that much more (as RLinf's token_level).",
        choices=("chunk", "action", "token"))
    dtype: str = setting(
        "auto", "`flow`/`tokens`/`oft`: the dtype the policy holds and computes in. `auto`: "
        "bfloat16 when the run's inference/learner ranks are on GPUs, float32 on CPUs (CPU "
        "bf16 matmuls are slow). Learners in bf16 keep fp32 master weights in the optimizer "
        "(DeepSpeed's bf16 mode), checkpointed with them; the weight plane carries bf16.",
        choices=("auto", "float32", "bfloat16"))
    pretrained: str = setting(
        "", "A Hugging Face-style folder (model.safetensors) loaded into the configured "
        "policy on every rank before training; every missing or misshaped tensor is named. "
        "Empty: random init. Any family: a folder hpcvla wrote (`hpcvla export RUN --format "
        "hpcvla`, `hpcvla.policies.save_pretrained`). `flow`: also a published π0/π0.5 folder "
        "(LeRobot's, or openpi's converted PyTorch one), which fixes the variant, sizes and "
        "padded dims and brings its normalization statistics; its prompts need `tokenizer` "
        "(policies/processor.py). `oft`: an OpenVLA-OFT folder (config.json, sharded weights, "
        "dataset_statistics.json, tokenizer, optional proprio projector and L1 action head "
        ".pt files), which fixes the sizes and brings its statistics and tokenizer.",
        paths=True)
    checkpoint: str = setting(
        "", "A run directory (or one of its checkpoints/v*/) whose newest weights replace "
        "the initial ones on every rank, after the policy is built (and `pretrained` loaded: "
        "its sizes, tokenizer and normalization stay): RL from an `hpcvla sft` run is "
        "`hpcvla train CONFIG policy.checkpoint=<sft run dir>`, with the config the SFT ran "
        "(same family, env and `pretrained`). Shapes must match exactly; the RL-only "
        "tensors (a value head, DSRL's noise actor and critics) may be absent and start "
        "fresh: DSRL from a PPO-config SFT run of the flow family. Continuing a run "
        "is `run.resume` instead (optimizer, counters).", paths=True)
    tokenizer: str = setting(
        "", "`flow` with a published `pretrained` folder: a local folder holding the "
        "checkpoint's tokenizer (PaliGemma's: tokenizer.json / tokenizer.model, read by "
        "transformers.AutoTokenizer; gated on the hub, so download it once). `oft`: empty "
        "reads the one the checkpoint folder ships. Unused otherwise: built-in policies "
        "read the env's instruction ids.", paths=True)
    delta_action_dims: int = setting(
        -1, "`flow` with a published `pretrained` folder: how many leading action dims the "
        "checkpoint predicts relative to the state (it acts `action - state` there; the "
        "state is added back before the env steps). -1: what the folder records (LeRobot's "
        "`relative_actions_processor` and its joint mask; openpi's folders record nothing: "
        "must be set). 0: absolute. N: the first N dims, e.g. 6 for openpi's pi0_libero "
        "(its `extra_delta_transform`; configs/libero_pi0.yaml).", ge=-1)
    pi05_state: str = setting(
        "folder", "`flow` with a published π0.5 folder: `prompt`, the state discretized into "
        "its prompt (π0.5's default, LeRobot's always), `prompt_padded`, the same with the "
        "state zero-padded to the model's max_state_dim first (LeRobot 0.4.0-0.4.4's "
        "processor), or `none`, the task alone and no state (openpi's "
        "`discrete_state_input=False`: its pi05_libero). `folder`: LeRobot's record, from "
        "LeRobot 0.5.1 on (openpi's folders record nothing, nor do LeRobot's before 0.5.1 "
        "whether they pad: must be set).",
        choices=("folder", "prompt", "prompt_padded", "none"))
    asset_id: str = setting(
        "", "`flow` with an openpi folder: the `assets/<asset id>` whose norm_stats.json "
        "normalize its state and actions, e.g. `franka` or `physical-intelligence/libero`. "
        "openpi's base checkpoints (pi0_base) ship one per robot of their mixture; empty: "
        "the folder's only one.")
    temperature: float = setting(
        1.6, "`oft`: divides the action-token logits when sampling and scoring (RLinf's "
        "LIBERO configs: 1.6). Higher explores more (flatter bins) and lowers the log-probs "
        "PPO ratios are taken of; deterministic acting (eval) takes the argmax either way.",
        ge=0.01)
    unnorm_key: str = setting(
        "", "`oft` with a `pretrained` folder: the dataset key of its dataset_statistics.json "
        "whose q01/q99 unnormalize the actions (and normalize the state), e.g. "
        "`libero_spatial_no_noops`; empty: the file's only key.")
    sequence: str = setting(
        "rlinf", "`oft`: the token sequence the model reads, which must be the one its "
        "checkpoint was fine-tuned with. `rlinf`: RLinf's (its OpenVLA-OFT RL checkpoints; "
        "no STOP token after the action positions). `official`: OpenVLA-OFT's own "
        "`predict_action` (a STOP token after them), for folders fine-tuned by OFT's "
        "repository, with the discrete token head or its L1-regression head (which reads "
        "only this one); with the env's state as a proprio token, only `official` matches a "
        "reference.", choices=("rlinf", "official"))
    action_head: str = setting(
        "", "`oft`: the head that acts. `tokens`: the action tokens of `lm_head` (RLinf's "
        "and OFT's discrete recipe). `l1`: OFT's L1-regression head (its LIBERO recipe; "
        "reads `sequence` official): RL samples a Gaussian around its actions, the std "
        "learned from `init_log_std`, and `hpcvla sft` imitates with OFT's L1 loss. Empty: "
        "the `pretrained` folder's (l1 where it holds OFT's action_head--*.pt), tokens "
        "without one; a folder's head is its own: naming another is refused.",
        choices=("", "tokens", "l1"))
    max_prompt_length: int = setting(
        128, "`oft` with a `pretrained` folder: prompts are left-padded to this many tokens "
        "(RLinf's max_prompt_length; longer ones lengthen the batch). Padding is masked and "
        "positions skip it, so it changes only shapes: more costs compute, fewer varies "
        "them.", ge=1)
    center_crop: float = setting(
        0.0, "`oft`: the area fraction of OFT's centre crop (`--center_crop True` of its "
        "LIBERO evaluation: 0.9): every camera image, resized to the towers' size, is "
        "replaced by its centred square box of that area resampled back to full size "
        "(bilinear, as OFT's tf.image.crop_and_resize), wherever the policy reads images: "
        "acting, the learner's scoring, evaluation and `hpcvla sft` alike (so PPO ratios "
        "compare the images actions were drawn from; no random crops). 0.9 for OFT's own "
        "LIBERO fine-tunes (trained on random 90 % crops); 1: no crop (RLinf's LIBERO OFT "
        "checkpoints and configs). 0: the `pretrained` folder's: 0.9 where OFT's L1 action "
        "head or an `--image_aug` name says it was trained on crops, else 1 (a folder hpcvla "
        "wrote: the crop it recorded); 1 without a folder.",
        ge=0.0, le=1.0)


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
        "buffer, and layer-normed critics.", choices=("ppo", "grpo", "sac", "rlpd"))
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
        False, "Clip the value update around the recorded value (within `clip`, in return "
        "units), as CleanRL: steadier critic, slower to follow large return changes (off: "
        "it held the critic back on reach, see `critic_lr`).")
    value_coef: float = setting(
        0.5, "Weight of the value loss against the policy loss in the shared trunk.", ge=0)
    entropy_coef: float = setting(
        0.0, "Weight of the entropy bonus (the entropy of the whole action chunk, at every "
        "`policy.logprob_granularity`): more exploration, slower convergence.", ge=0)
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
        "its critics read, comma-separated (`image`, `instruction`, `state`); empty: all the "
        "env has. Without `image` a SAC step skips the CNN, most of its cost; the flow "
        "policy it steers still reads every field. The state alone suits tasks whose state "
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


    @property
    def values_truncations(self) -> bool:
        """Rollouts value the observation each horizon-ended episode ended at (PPO with
        bootstrap_truncated): simulators send it, inference ranks value it."""
        return self.name == "ppo" and self.bootstrap_truncated

    @property
    def off_policy(self) -> bool:
        """Learns from a replay buffer (roles/off_policy.py) rather than each version's
        fresh segments; its segments carry the observation after their last row (the last
        transition's next observation: roles/segments.py)."""
        return self.name in ("sac", "rlpd")


def noise_obs_fields(alg: AlgorithmConfig) -> tuple[str, ...]:
    """algorithm.noise_obs as a tuple of field names (empty: all the env has)."""
    return tuple(f.strip() for f in alg.noise_obs.split(",") if f.strip())
