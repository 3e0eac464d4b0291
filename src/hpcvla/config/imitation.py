"""The settings of supervised fine-tuning (`sft.*`, `hpcvla sft`; schema.py documents the
conventions), and how the demonstration settings read: the files and datasets, and the
features of a LeRobot dataset that hold the env's fields."""

from __future__ import annotations

from dataclasses import dataclass

from hpcvla.config.learning import AlgorithmConfig, setting


@dataclass
class SFTConfig:
    demos: str = setting(
        "", "`hpcvla sft`: the demonstrations (comma-separated) it fine-tunes on: HDF5 files "
        "(this project's trajectory dumps and `hpcvla demos` files, LIBERO's (robomimic) "
        "datasets, ManiSkill3 trajectory files) and LeRobot dataset folders (formats v2.x, "
        "v3.0); `hpcvla/demonstrations/` detects the layout of each. Checked against the "
        "env's observations and actions before any rank starts.", paths=True)
    per_task: int = setting(
        0, "Few-shot: at most this many demonstrations of each task (instruction), the first "
        "ones in file order; 0: all.", ge=0)
    successful_only: bool = setting(
        False, "Only episodes that succeeded (this project's dumps record `success` per "
        "episode; ManiSkill's files too). Off: every episode, failures included.")
    steps: int = setting(
        1000, "Optimizer steps of `hpcvla sft`, each on batch_size x micro_batches chunks per "
        "learner (epochs over the data = steps x those x learners / samples).", ge=1)
    batch_size: int = setting(
        64, "Demonstrated chunks per learner per forward/backward pass: larger is smoother "
        "and slower per step; what a learner's memory holds at once.", ge=1)
    micro_batches: int = setting(
        1, "Forward/backward passes of batch_size chunks per learner per optimizer step "
        "(gradient accumulation): a step trains batch_size x micro_batches x learners "
        "chunks. A job's restart on fewer learners (jobs/launch.sh) raises it (and lowers "
        "batch_size where needed) to keep a step's chunks; a resume training another "
        "number says so.", ge=1)
    lr: float = setting(
        1e-3, "Adam learning rate of `hpcvla sft` (every parameter; the critic gets no "
        "gradient from imitation and stays as initialised): the peak of sft.schedule.", ge=0)
    schedule: str = setting(
        "constant", "The learning rate after the warm-up: `constant` (sft.lr to the end) or "
        "`cosine` (from sft.lr down to sft.final_lr at sft.steps, as openpi's and LeRobot's "
        "π0 recipes decay it). A pure function of the step: a resumed run goes on with it.",
        choices=("constant", "cosine"))
    warmup_steps: int = setting(
        0, "The learning rate rises linearly over the first this many steps (the first at "
        "sft.lr / (warmup_steps + 1)); 0: none.", ge=0)
    final_lr: float = setting(
        0.0, "sft.schedule=cosine: the learning rate of the last step.", ge=0)
    val_demos: str = setting(
        "", "Held-out demonstration files (comma-separated; sft.demos' layouts), never trained "
        "on: their mean imitation loss after every sft.val_every steps and the last "
        "(`sft/val_loss`, summary.json `val_losses`, the progress line), the fit of what was "
        "not shown beside the training loss. Empty: none.", paths=True)
    val_every: int = setting(
        0, "sft.val_demos: their loss every this many steps as well as after the last; 0: "
        "after the last only.", ge=0)
    features: str = setting(
        "", "LeRobot datasets in sft.demos and sft.val_demos: the feature that holds each of "
        "the env's fields, `field=feature` comma-separated (fields: image, wrist_image, "
        "state, actions), e.g. `image=observation.images.front,wrist_image=observation."
        "images.wrist` (as LeRobot's rename_map); a field not named is found by LeRobot's and "
        "openpi's LIBERO names (docs/imitation.md).")
    checkpoint_every: int = setting(
        0, "A checkpoint every this many SFT steps (`hpcvla sft run.resume=<dir>` and a job's "
        "restart after a node failure go on from the newest), written in the background as "
        "`train`'s (learner.checkpoint_background); 0: only at the end.", ge=0)


# The learners' settings `hpcvla sft` sets from its own (imitation/sft.engine_config): typed
# for it they would change nothing (`hpcvla sft` refuses them, naming the one to set)
SFT_SETS = {"algorithm.lr": "sft.lr", "algorithm.critic_lr": "sft.lr",
            "learner.micro_batch": "sft.batch_size", "learner.micro_batches": "sft.micro_batches"}


# The settings only `hpcvla train` reads, by name or prefix (its roles' layout, pipeline,
# rollout, simulator shards, trajectory ring, checkpoints, held-out evaluations and emulated
# costs; every rank of an sft world is a learner, which steps no env): typed for `hpcvla sft`
# they would change nothing, and what training's rules ask of them is not sft's to meet (a
# GRPO config's rollout.segment_len, per_node's sum). Each with sft's own setting for it,
# where it has one.
TRAIN_ONLY = {"placement.mode": "", "placement.ranks_per_node": "", "placement.per_node": "",
              "placement.learner_nodes": "", "placement.learners": "",
              "placement.evaluators": "", "pipeline.mode": "", "pipeline.max_staleness": "",
              "pipeline.total_updates": "sft.steps", "rollout.": "", "env.shards": "",
              "learner.epochs": "", "learner.ring_": "",
              "learner.checkpoint_every_s": "sft.checkpoint_every (steps)",
              "learner.checkpoint_every": "sft.checkpoint_every",
              "eval.every": "", "eval.episodes": "", "eval.envs": "",
              "eval.video_every": "", "emulate.": ""}


def job_unread_problems(job: str, overrides) -> list[tuple[str, object, str]]:
    """The overrides among `overrides` that the command `job` ("train" or "sft") does not
    read, as config problems: for sft, SFT_SETS' (it sets them itself) and TRAIN_ONLY's; for
    train, the sft section's (a config file's sft section stays: one file may serve both
    commands)."""
    typed = [item.partition("=")[::2] for item in overrides]
    if job == "sft":
        train_only = [(key, value, next(own for name, own in TRAIN_ONLY.items()
                                        if key.startswith(name)))
                      for key, value in typed if trains_only(key)]
        return [(key, value, f"none: hpcvla sft sets it from {SFT_SETS[key]}; set that")
                for key, value in typed if key in SFT_SETS] + \
            [(key, value, "none: hpcvla sft does not read it (hpcvla train does); " +
              (f"set {own}" if own else "drop it")) for key, value, own in train_only]
    return [(key, value, "none: hpcvla train does not read the sft section (hpcvla sft "
             "does); drop it") for key, value in typed if key.startswith("sft.")]


def trains_only(key: str) -> bool:
    """Whether the setting `key` is one only `hpcvla train` reads (TRAIN_ONLY)."""
    return key.startswith(tuple(TRAIN_ONLY))


def read_by(job: str, overrides) -> list[str]:
    """`overrides` less those `job` does not read (job_unread_problems): a benchmark gives its
    SFT start and its RL arms the same ones."""
    unread = {key for key, _, _ in job_unread_problems(job, overrides)}
    return [item for item in overrides if item.partition("=")[0] not in unread]


def demo_paths(section: SFTConfig | AlgorithmConfig, field: str = "demos") -> list[str]:
    """The files `sft.demos`, `sft.val_demos` or `algorithm.demos` names."""
    return [path.strip() for path in getattr(section, field).split(",") if path.strip()]


def dataset_features(sft: SFTConfig) -> dict[str, str]:
    """sft.features as {field: feature}; ValueError saying what is expected of a malformed
    one (config/checks.py refuses it before anything runs)."""
    pairs = [item.strip() for item in sft.features.split(",") if item.strip()]
    bad = [item for item in pairs if item.count("=") != 1 or not all(
        part.strip() for part in item.split("="))]
    if bad:
        raise ValueError(f"field=feature items, e.g. image=observation.images.front (not "
                         f"{', '.join(bad)})")
    return {k.strip(): v.strip() for k, v in (item.split("=") for item in pairs)}
