"""The settings of `hpcvla eval` and of the held-out evaluation during training (`eval.*`)."""

from __future__ import annotations

from dataclasses import dataclass

from hpcvla.config.families import SIMULATORS
from hpcvla.config.learning import setting

EVAL_STATE_IDS = 2 ** 20  # init_state_ids below this are the evaluation split (envs/base.py)
# eval.protocol's own: the env's evaluation states at the config's horizon; the others are
# the simulators' benchmarks (SimulatorTraits.benchmark, VectorEnv.benchmark_protocol)
OWN_PROTOCOL = "hpcvla"


@dataclass
class EvalConfig:
    protocol: str = setting(
        "hpcvla", "The protocol of `hpcvla eval` and of eval.every's held-out evaluation. "
        "`hpcvla`: the env's first --episodes evaluation states at the config's horizon. "
        "`libero` (env.name=libero): LIBERO's benchmark as openpi's and OpenVLA(-OFT)'s "
        "evaluation scripts run it (LIBERO's own: 600 steps, 20 trials): every task of "
        "env.suite (or eval.tasks) in turn, its fixed initial states (eval.states_per_task "
        "of 50), the suite's step limit (spatial 220, object 280, goal 300, libero_10 520, "
        "libero_90 400; LeRobot runs spatial to 280), 10 settle steps, success when the task "
        "is first done, `hpcvla eval` acting deterministically unless --sampled; --episodes "
        "(eval.episodes) is then ignored.",
        choices=(OWN_PROTOCOL, *(t.benchmark for t in SIMULATORS.values() if t.benchmark)))
    states_per_task: int = setting(
        50, "eval.protocol=libero: the first this many fixed initial states of every task "
        "(LIBERO's 50: the published numbers).", ge=1)
    tasks: str = setting(
        "", "eval.protocol=libero: the suite's tasks evaluated, comma-separated indices "
        "(e.g. `0,1`); empty: every task (the published numbers).")
    every: int = setting(
        0, "Held-out evaluation during training: every this many policy versions (and the "
        "last), the newest weights on the env's evaluation states (eval.episodes of them, or "
        "eval.protocol's), into metrics.jsonl, TensorBoard/W&B (`heldout/*`) and the "
        "progress line. Disaggregated modes evaluate on a rank set aside "
        "(placement.evaluators=1), while training goes on; colocated ones between versions, "
        "every rank a share of the states. 0: off (`hpcvla eval` afterwards).", ge=0)
    episodes: int = setting(
        32, "eval.every: the first this many evaluation states, one episode each.", ge=1,
        le=EVAL_STATE_IDS)
    envs: int = setting(
        8, "eval.every: the evaluation's env batch (on each evaluating rank).", ge=1)
    deterministic: bool = setting(
        True, "eval.every: the policy's deterministic action (its mean) rather than a sample.")
    video_every: int = setting(
        0, "eval.every: also film one episode per task every this many versions (a multiple "
        "of eval.every; the first evaluation too; an evaluator that skipped the version films "
        "the next one it evaluates), as MP4 in RUN_DIR/videos/v<version>-heldout/ and as a "
        "video in TensorBoard (`heldout/video`, an animated GIF) and W&B. 0: none.", ge=0)


def eval_tasks(cfg: EvalConfig) -> list[int] | None:
    """The task indices `eval.tasks` names; None: every task."""
    return [int(t) for t in cfg.tasks.split(",") if t.strip()] or None
