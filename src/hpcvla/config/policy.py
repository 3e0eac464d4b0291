"""The settings of what is trained: the policy (`policy.*`): its family, size, published
checkpoint and how it acts and is scored. How it is trained: learning.py."""

from __future__ import annotations

from dataclasses import dataclass

from hpcvla.config.families import ACTION_HEADS, FAMILIES
from hpcvla.config.learning import setting

# The choices of policy settings, read by the code that acts on them (one home each)
LOGPROB_MODES = ("last_step", "chain", "random_step")  # policies/flow_denoising.py
FLOW_NOISES = ("learned", "sde")  # policies/flow_denoising.py
SIZE_NAMES = ("tiny", "small", "full")  # policies/vla.py's presets
VARIANTS = ("pi0", "pi05")  # policies/flow.py
DENOISE_FROM = ("auto", "zero", "noise")  # policies/flow.py
GRANULARITIES = ("chunk", "action", "token")  # algorithms/granularity.py
SEQUENCES = ("rlinf", "official")  # policies/oft.py: RLinf's RL sequence, OFT's predict_action


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
        choices=tuple(FAMILIES),
        known_as={"pi0": "flow", "pi05": "flow", "pi0.5": "flow", "π0": "flow", "π0.5": "flow",
                  "openvla": "oft", "openvla-oft": "oft", "openvla_oft": "oft"})
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
        "sizes instead (from its tensors).", choices=SIZE_NAMES)
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
        choices=VARIANTS)
    logprob_mode: str = setting(
        "last_step", "`flow`: which denoising steps are noisy, i.e. what RL explores with and "
        "scores. `last_step`: only the last (x_0 = 0; a Gaussian around the denoised mean; "
        "exact, cheap). `chain`: every step, from x_0 ~ N(0, I), as πRL's flow-noise/ReinFlow: "
        "the policy samples like the pretrained sampler, the pipeline records the chain's "
        "start (the model's H x D, padded for a published π0) and each step's executed "
        "entries (K x the env's chunk) with every step (segments, ring, dumps) and scores "
        "all K transitions. `random_step`: one step drawn per sample, from x_0 ~ N(0, I), the "
        "others deterministic, as RLinf's flow-SDE recipes (joint_logprob false): records "
        "that step's start (one H x D) and scores that transition with one expert pass (the "
        "policy gradient of the chunk approximated by that step's). With padded dims "
        "the noise enters the executed entries alone (the rest follows the mean, as "
        "trained).", choices=LOGPROB_MODES)
    flow_noise: str = setting(
        "learned", "`flow` with logprob_mode random_step: the noisy step's Gaussian. "
        "`learned`: around the ODE's (Euler) step, its std exp(log_std) learned per executed "
        "entry. `sde`: RLinf's flow-SDE step (noise_method flow_sde): the std fixed by the "
        "step's time t, sqrt(1/K) * policy.noise_level * sqrt(t / (1 - t)) (at t = 1: t / (1 "
        "- t) is K), nothing learned, and the mean the Euler step's minus the SDE's drift "
        "correction std^2 (x + (1 - t) v) / (2 t) (v the velocity, K denoising steps).",
        choices=FLOW_NOISES)
    noise_level: float = setting(
        0.5, "`flow` with flow_noise=sde: the scale of the SDE's noise (RLinf's noise_level; "
        "its LIBERO recipes' 0.5).", ge=0.001)
    denoise_from: str = setting(
        "auto", "`flow`: where acting without exploration noise (`hpcvla eval "
        "--deterministic`, eval.deterministic, `demos --deterministic`) starts denoising. "
        "`zero`: x_0 = 0, the prior's mode (one chunk per observation; what last_step RL "
        "trains). `noise`: x_0 ~ N(0, I) drawn per chunk (seeded per evaluation batch), then "
        "the same Euler steps with nothing added: openpi's sampler and RLinf's π0 evaluation, "
        "what their published numbers are of, and the start chain and random_step RL train "
        "from. `auto`: the start policy.logprob_mode trains from (zero for last_step, else "
        "noise).", choices=DENOISE_FROM)
    init_log_std: float = setting(
        -0.7, "Initial log of the exploration std (learned): per action entry (`default`, "
        "`flow` last_step, `oft` with OFT's L1-regression head, in its normalized action "
        "space; `tokens`: the spread of its initial bins); `flow` chain: the "
        "total noise injected over the chain (each of K steps gets std / sqrt(K)); not "
        "read by `flow` with flow_noise=sde (the step's time sets it). Lower "
        "starts closer to a pretrained policy's own actions, explores less. From an `hpcvla "
        "sft` run (policy.checkpoint) it starts here too where SFT does not fit it (`flow`, "
        "`oft`'s L1 head); the `default` family keeps the std its likelihood fitted.")
    logprob_granularity: str = setting(
        "chunk", "`flow`/`tokens`/`oft`: unit of the PPO ratio and its clip: one per chunk, per "
        "action or per token (action dim). Finer units clip each part separately (fewer "
        "samples fully clipped) but ignore correlations inside the chunk, and leave out the "
        "actions a chunk never ran (its episode ended inside it). The policy loss "
        "is a mean over units: at `action`/`token` its gradient is 1/H or 1/(H x dims) of "
        "`chunk`'s, while the value loss and the entropy bonus (the chunk's) keep theirs, so "
        "value_coef and entropy_coef weigh that much more (as RLinf's token_level).",
        choices=GRANULARITIES)
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
        "reference.", choices=SEQUENCES)
    action_head: str = setting(
        "", "`oft`: the head that acts. `tokens`: the action tokens of `lm_head` (RLinf's "
        "and OFT's discrete recipe). `l1`: OFT's L1-regression head (its LIBERO recipe; "
        "reads `sequence` official): RL samples a Gaussian around its actions, the std "
        "learned from `init_log_std`, and `hpcvla sft` imitates with OFT's L1 loss. Empty: "
        "the `pretrained` folder's (l1 where it holds OFT's action_head--*.pt), tokens "
        "without one; a folder's head is its own: naming another is refused.",
        choices=("", *ACTION_HEADS))
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
