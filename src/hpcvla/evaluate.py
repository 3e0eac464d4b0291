"""`hpcvla eval`: the success rate of a policy (a run's checkpoint, or the untrained policy
its config builds) on a fixed set of initial states of the configured env: the held-out
states of roles/heldout.py (which says what they are and how episodes count), the result
naming the split, the id range and what the states are. Two policies evaluated with the same
`episodes` see the same states, so their success rates compare directly (the policy still
samples its actions, as it does in training, unless `deterministic`), and episode by
episode: several policies in one `hpcvla eval` (`--untrained`, `--all`) are each compared
with the first on the same episodes (`paired_with_first`).

On several ranks (`hpcvla eval --ranks N`, or srun/mpirun in jobs/slurm/eval.sbatch) the
states go out in batches of `envs`, batch b to rank b mod N, every rank an env batch and the
policy (a simulator and an inference role in one process, on a GPU of its node where there
are GPUs); the outcomes are gathered on every rank, and 1 rank and N give the same
per-episode outcomes.

`hpcvla export` (export.py) writes a run's checkpoint as a policy folder.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from hpcvla.checkpoint import catalog, store
from hpcvla.config.env import WITHOUT_EMULATION
from hpcvla.config.evaluation import OWN_PROTOCOL
from hpcvla.config.families import simulator
from hpcvla.config.loader import last_run_config
from hpcvla.devices import bind_rank_device, gpu_identity, gpu_names, local_device
from hpcvla.metrics.episode_metrics import KEY, figures_in
from hpcvla.metrics.progress import figure
from hpcvla.metrics.stats import paired_difference
from hpcvla.process.deathwatch import Refused
from hpcvla.process.watchdog import reminding
from hpcvla.roles.heldout import HeldOut, envs_at_once
from hpcvla.topology.plan import INF, SIM
from hpcvla.transport.backoff import idle_barrier, idle_bcast


def evaluate(cfg, weights: dict | None, episodes: int = 128, envs: int = 32, seed: int = 0,
             deterministic: bool = False, world=None, video: int = 0,
             video_dir: Path | None = None) -> dict:
    """Run the env's first `episodes` evaluation states (roles/heldout.py), `envs` at a
    time, one episode each; returns success rate, mean return, episodes, faults, success per
    task and per episode. `weights` None: the untrained policy. `world` (an MPI communicator,
    collective): its ranks share the batches and all return the whole result. The policy runs
    on a GPU where there is one (placement.gpus_per_node=0: the CPU). `video` K: the first K
    episodes of every task also go to `video_dir` as MP4."""
    rank, ranks = (0, 1) if world is None else (world.Get_rank(), world.Get_size())
    device = local_device(cfg.placement.gpus_per_node) if world is None else \
        bind_rank_device(cfg, [(SIM, INF)] * ranks, world)  # [dist] before any simulator
    held_out = HeldOut(cfg, episodes, envs, seed, device, video=video)
    if weights is not None:
        store.check_fit(weights, held_out.policy.state_dict(), "the evaluated checkpoint")
        held_out.policy.load_arrays(weights)
    try:
        mine, videos = held_out.run(deterministic, rank, ranks, video_dir if video else None)
        # every rank's episodes and videos, and the host and device it ran on
        parts = [(mine, videos, socket.gethostname(), str(device))]
        if world is not None:  # a rank stuck in its batches is the one not saying this:
            with reminding(cfg.pipeline.stall_timeout_s, lambda waited: (
                    f"hpcvla eval: rank {rank}, its {len(mine)} episode(s) done, has waited "
                    f"{waited:.0f} s for the other ranks")):
                idle_barrier(world)  # [dist] ranks done first wait asleep: allgather spins
            parts = world.allgather(parts[0])  # [dist]
        return {**held_out.report([e for part in parts for e in part[0]], deterministic),
                "ranks": ranks, "hosts": sorted({part[2] for part in parts}),
                "device": ", ".join(sorted({part[3] for part in parts})),
                **({"videos": sorted(v for part in parts for v in part[1])} if video else {})}
    finally:
        held_out.close()


# What `hpcvla eval` reads of the run's config, by prefix: an override of anything else
# (algorithm.*, learner.*, pipeline.*, ...) would change nothing, so it is refused
# (check_overrides); the settings its flags stand for, and the simulator settings of
# training's env ranks, are named with what does act.
EVAL_READS = ("env.", "policy.", "launch.", "run.seed", "placement.gpus_per_node",
              "placement.gpu_memory_gb",  # the memory plan of its ranks (memory/sft_eval.py)
              "eval.protocol", "eval.states_per_task", "eval.tasks")
EVAL_FLAGS = {"eval.episodes": "--episodes", "eval.envs": "--envs",
              "env.envs_per_simulator": "--envs", "eval.deterministic": "--deterministic",
              "eval.video_every": "--video", "launch.ranks": "--ranks"}
_SIMULATOR_RANKS = ("none: a setting of training's simulator ranks; `hpcvla eval` steps its "
                    "envs in its own processes, --envs at a time")
TRAINING_ONLY = {**dict.fromkeys(("env.shards", "env.isolation", "env.max_restarts",
                                  "env.restart_window_s"),
                                 _SIMULATOR_RANKS),
                 "env.train_states": "none: where the run's training started, which says "
                                     "whether its evaluation is held out",
                 **dict.fromkeys((f"env.{k}" for k in (*WITHOUT_EMULATION, "latency_sigma")),
                                 "none: training's emulation of its simulator ranks; `hpcvla "
                                 "eval` runs the env without latency or injected faults")}


def eval_problem(cfg, trained, episodes: int, envs: int, video: int,
                 ranks: int | None = None) -> str | None:
    """What is wrong with `hpcvla eval`'s flags (--ranks: argparse, as `train`'s), or with
    evaluating the run configured as `trained` in the env `cfg` configures, before any rank
    starts; where it starts `ranks` processes here, whether they fit this host's GPUs."""
    from hpcvla.config.evaluation import EVAL_STATE_IDS
    for flag, value, low, high in (("--episodes", episodes, 1, EVAL_STATE_IDS),
                                   ("--envs", envs, 1, None), ("--video", video, 0, None)):
        if value < low or high is not None and value > high:
            return (f"{flag} {value}: give {low} or more"
                    + (f", at most {high} (the evaluation split's states)" if high else ""))
    if video and not cfg.env.camera:
        return "--video needs a camera: the run has env.camera=false"
    return vocabulary_problem(cfg, trained) or memory_problem(
        cfg, ranks, envs_at_once(cfg, envs, episodes))


def memory_problem(cfg, ranks: int | None, envs: int) -> str | None:
    """Whether `ranks` evaluating processes on this host, `envs` envs each, fit its GPUs
    (memory/sft_eval.eval_memory); None on a host without GPUs, or for a world srun/mpirun
    started (`ranks` None: this process does not know its layout)."""
    from hpcvla.envs import env_spec
    from hpcvla.memory.layout import layout_gpus
    from hpcvla.memory.sft_eval import eval_devices, eval_memory
    gpus = layout_gpus(cfg) if ranks else 0
    problems = eval_memory(cfg, eval_devices(cfg, ranks, gpus), envs,
                           env_spec(cfg.env)).problems if gpus else []
    return "; ".join(f"{name} = {value!r}: expected {text}"
                     for name, value, text in problems) or None


def refuse_overfilled(cfg, world, envs: int) -> None:
    """A world srun/mpirun started (jobs/slurm/eval.sbatch), once each rank has its GPU (by
    UUID: ranks bound to a GPU each all say cuda:0): rank 0 plans the ranks' memory on them
    (memory/sft_eval.eval_memory) and, where a GPU is overfilled, every rank ends the world
    with one message (Refused), before any builds its policy. (`--ranks N`: memory_problem,
    before starting.)"""
    device = str(bind_rank_device(cfg, [(SIM, INF)] * world.Get_size(), world))  # [dist]
    refuse_placed(cfg, world, world.allgather((device, gpu_identity(device))), envs)  # [dist]


def refuse_placed(cfg, world, placed: list[tuple[str, str | None]], envs: int) -> None:
    """refuse_overfilled's verdict on every rank's device and gpu_identity (`placed`)."""
    from mpi4py import MPI

    from hpcvla.config import ConfigError
    from hpcvla.envs import env_spec
    from hpcvla.job.runtime import node_numbers
    from hpcvla.memory.sft_eval import eval_memory
    if all(gpu is None for _, gpu in placed):
        return
    nodes = node_numbers(world.allgather(MPI.Get_processor_name()))  # [dist]
    problems = idle_bcast(world, lambda: eval_memory(  # [dist]
        cfg, gpu_names(placed, nodes), envs, env_spec(cfg.env), nodes).problems)
    if problems:
        raise Refused(ConfigError(problems, "memory plan of the evaluating ranks' GPUs"))


def check_overrides(overrides: list[str], untrained: bool) -> None:
    """Raise a ConfigError naming each override `hpcvla eval` would not act on, with what
    does (EVAL_READS, EVAL_FLAGS); policy.checkpoint only with --untrained: a trained
    checkpoint holds every weight."""
    from hpcvla.config import ConfigError
    reads = ", ".join(p + "*" if p.endswith(".") else p for p in EVAL_READS)
    problems = []
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.strip()
        if key in EVAL_FLAGS:
            problems.append((key, value, f"{EVAL_FLAGS[key]}: `hpcvla eval` takes it as a flag"))
        elif key in TRAINING_ONLY:
            problems.append((key, value, TRAINING_ONLY[key]))
        elif key == "policy.checkpoint" and not untrained:
            problems.append((key, value, "--untrained with it: it is the start of a run; a "
                             "trained checkpoint holds every weight"))
        elif not key.startswith(EVAL_READS):
            problems.append((key, value, f"a setting `hpcvla eval` reads ({reads}): this one "
                             "would change nothing"))
    if problems:
        raise ConfigError(problems, "`hpcvla eval` settings")


def eval_config(run_dir: Path, overrides: list[str], untrained: bool):
    """The config `hpcvla eval` evaluates the run in `run_dir` with: the run's own as it last
    ran (config/loader.last_run_config: a resume's settings, e.g. its horizon), without
    its start (policy.checkpoint: a trained checkpoint holds every weight; kept for
    `untrained`; run.resume: a resume's config names the run it continued) and with
    DeepSpeed's backend (eval runs no learner: a Horovod run's evaluating nodes need no
    Horovod), `overrides` on top once check_overrides passes them. Raises ConfigError."""
    from hpcvla.config import load_config
    check_overrides(overrides, untrained)  # before the config's own checks
    start = ["learner.backend=deepspeed", "run.resume="] + \
        ([] if untrained else ["policy.checkpoint="])
    return load_config(run_config(run_dir), [*start, *overrides], record=True)


def run_config(run_dir: Path) -> Path:
    """The config file of the settings the run in `run_dir` last ran with: its newest
    config.resume-*.yaml, else its config.yaml (config/loader.last_run_config)."""
    return last_run_config(run_dir) or run_dir / "config.yaml"


def weights_problem(cfg, trained, checkpoints: list[Path], untrained: bool,
                    overridden: bool) -> str | None:
    """Whether the policy `cfg` configures (the run's config `trained` and the overrides,
    `overridden` if any) takes the weights it is to evaluate, before any rank builds it, from
    meta-device builds: each of `checkpoints` exactly; with `untrained`, its start: the
    weights of policy.checkpoint (RL heads may be absent), and the names and shapes of the
    run's own build but for the RL heads, which start fresh either way (π0's log_std follows
    env.chunk_len, which the LIBERO protocol sets)."""
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    from hpcvla.policies.folders import rl_only_names
    from hpcvla.weight_checks import checkpoint_fit_problem
    policy = build_policy(cfg, env_spec(cfg.env), device="meta")
    start = catalog.latest(cfg.policy.checkpoint) if untrained and cfg.policy.checkpoint else None
    for path, heads_may_lack in [*((p, False) for p in checkpoints),
                                 *([(start, True)] if start else [])]:
        problem = checkpoint_fit_problem(policy, path, heads_may_lack)
        if problem:
            return f"expected {problem}"
    if not (untrained and overridden):
        return None
    heads = rl_only_names(policy)
    ours = {k: tuple(t.shape) for k, t in policy.state_dict().items() if k not in heads}
    runs = {k: tuple(t.shape) for k, t in build_policy(trained, env_spec(trained.env),
                                                       device="meta").state_dict().items()
            if k not in heads}
    changed = sorted(set(ours) ^ set(runs)) or sorted(k for k in ours if ours[k] != runs[k])
    return None if not changed else (
        f"the overrides change the run's start ({len(changed)} weight(s) another name or shape "
        f"than the run's config gives, e.g. {changed[0]}): --untrained evaluates the policy "
        "the run started from; a policy.* or env.* override may change how it acts, not its "
        "weights")


def vocabulary_problem(cfg, trained) -> str | None:
    """Why the policy `trained` (the run's own config) built cannot read the instructions of
    the env `cfg` evaluates on, before any rank starts: a built-in policy's instruction
    embedding is its training env's word vocabulary, so another env must have the very same
    one (a LIBERO-PRO `_object`/`_swap` suite does; `_lan`/`_task` ones and other tasks
    mostly do not). A published checkpoint (policy.pretrained) tokenizes the words itself."""
    from hpcvla.envs import env_spec
    if cfg.policy.pretrained or cfg.env == trained.env:
        return None
    have, want = env_spec(trained.env).vocab, env_spec(cfg.env).vocab
    if have == want:
        return None
    new = sorted(set(want) - set(have))
    return (f"env {cfg.env.name} here has another instruction vocabulary than the run trained "
            f"with ({len(want)} words against {len(have)}"
            + (f"; new: {', '.join(new[:8])}{' ...' if len(new) > 8 else ''}" if new else "")
            + "): a built-in policy reads only its training env's words; evaluate it where "
            "they are the same, or a checkpoint with its own tokenizer (policy.pretrained)")


def evaluate_policies(cfg, run_dir: Path, policies: list, episodes: int, envs: int,
                      deterministic: bool, world=None, video: int = 0) -> list[dict]:
    """`hpcvla eval`: each of `policies` (a checkpoint directory, or None: the untrained
    policy) on the same states, with its version and trained env steps; `video` K: K
    episodes of every task as MP4 in RUN_DIR/videos/v<version>-<actions>-<start>/: a folder
    of this evaluation's own (<start>: rank 0's time, host and process), so that evaluations
    of one run at once (a job per task or seed) neither replace nor mix each other's films."""
    start = f"{time.strftime('%Y%m%d-%H%M%S')}-{socket.gethostname()}-{os.getpid()}"
    if world is not None:  # one plan: the policies differ in weights only
        from hpcvla.transport.backoff import idle_bcast
        refuse_overfilled(cfg, world, envs_at_once(cfg, envs, episodes))  # [dist]
        # rank 0's choice: a run still training publishes and prunes checkpoints while the
        # ranks start, and ranks that each chose evaluated different ones under rank 0's
        # label (with --all, lists of different lengths left ranks in a gather: a hang)
        policies, start = idle_bcast(world, lambda: (list(policies), start))  # [dist]
    curve = []
    for path in policies:
        weights, state = (None, {"version": 0}) if path is None else checkpoint_weights(path)
        actions = "deterministic" if deterministic else "sampled"
        curve.append({"run_dir": str(run_dir), "config": run_config(run_dir).name,
                      "version": state["version"],
                      "trained_env_steps": state.get("counters", {}).get("trained_env_steps", 0),
                      **evaluate(cfg, weights, episodes=episodes, envs=envs, seed=cfg.run.seed,
                                 deterministic=deterministic, world=world, video=video,
                                 video_dir=run_dir / "videos" /
                                 f"v{state['version']:06d}-{actions}-{start}")})
    return paired_with_first(curve)


def paired_with_first(curve: list[dict]) -> list[dict]:
    """Each result after the first, `vs_first`: its success minus the first's on the episodes
    both ran (the same task and initial state; env faults in either left out), paired
    (metrics/stats.paired_difference). For an RL run, `hpcvla eval RUN --untrained --all`
    compares each kept checkpoint with the policy it started from (its policy.checkpoint)."""
    first = {(e["task"], e["init_state_id"]): e["success"]
             for e in curve[0]["per_episode"] if not e["env_fault"]} if curve else {}
    for result in curve[1:]:
        pairs = [(first[key], e["success"]) for e in result["per_episode"]
                 if not e["env_fault"] and (key := (e["task"], e["init_state_id"])) in first]
        if pairs:
            before, after = zip(*pairs)
            result["vs_first"] = {"version": curve[0]["version"],
                                  **paired_difference(before, after)}
    return curve


def describe(result: dict) -> str:
    """A result as `hpcvla eval` prints it."""
    low, high = result["success_ci95"]
    lines = [f"policy version {result['version']}: success {figure(result['success_rate'], 3)} "
             f"(95 % {low:.3f}-{high:.3f}) over "
             f"{result['episodes']} episodes ({result['actions']} actions), mean return "
             f"{figure(result['mean_return'])}"
             + (f" ({result['env_faults']} left out: env faults; counted as failures, as "
                f"OFT's and openpi's scripts count them: "
                f"{result['success_rate_faults_failed']:.3f})" if result["env_faults"] else "")]
    if not result["episodes"]:
        lines.append(f"  no verdict on the policy: every one of the {result['env_faults']} "
                     "episodes ended by an env fault (the simulator's: see its log lines)")
    if "success_at_end" in result:
        lines.append(f"  ManiSkill's conventions: success_once "
                     f"{figure(result['success_once'], 3)}, "
                     f"success_at_end {figure(result['success_at_end'], 3)}")
    metrics = figures_in(result)
    if metrics:  # the env's own (EnvSpec.episode_metrics), over the episodes kept
        lines.append("  the env's episode metrics: " + ", ".join(
            f"{name} {value:.3f}" for name, value in metrics.items()))
    if "vs_first" in result:
        vs = result["vs_first"]
        lines.append(f"  against version {vs['version']} on the same {vs['episodes']} episodes: "
                     f"{vs['difference']:+.3f} (95 % {vs['ci95'][0]:+.3f} .. {vs['ci95'][1]:+.3f}"
                     f", paired; {vs['gained']} gained, {vs['lost']} lost, McNemar p "
                     f"{vs['mcnemar_p']:.2g})")
    if result.get("config", "config.yaml") != "config.yaml":  # a resumed run's last settings
        lines.append(f"  with the settings of {result['config']} (the run's last start)")
    ids = result["init_state_ids"]
    lines.append(f"  {result['split']} split: init_state_ids {ids[0]}..{ids[1]}, "
                 f"{result['states']}; {result['ranks']} rank(s) on {len(result['hosts'])} "
                 f"host(s), {result['device']}")
    if not result.get("held_out", True):
        lines.append("  not held out: training started from these states too "
                     "(env.train_states=benchmark, RLinf's)")
    protocol = result.get("protocol", {})
    if protocol.get("name") == OWN_PROTOCOL:  # the run's own episodes: say so where a
        benchmark = simulator(protocol["env"]).benchmark  # benchmark's are to be had
        lines.append(f"  protocol {OWN_PROTOCOL}: the config's episode length, "
                     f"{protocol['steps']} env steps, {result['actions']} actions" + (
                         f"; not the {benchmark} benchmark's protocol, whose numbers papers "
                         f"report (eval.protocol={benchmark})" if benchmark else ""))
    elif protocol:  # a benchmark's (VectorEnv.benchmark_protocol)
        lines.append(f"  {protocol['describe']}, {result['actions']} actions")
    if result.get("videos"):
        lines.append(f"  {len(result['videos'])} video(s) in "
                     f"{Path(result['videos'][0]).parent}")
    if len(result["per_task"]) > 1:  # a markdown table
        lines += ["", "| task | episodes | success | 95 % (Wilson) |", "|---|---:|---:|---|"]
        lines += [f"| {task} | {r['episodes']} | {r['success_rate']:.3f} | "
                  f"{r['success_ci95'][0]:.3f}-{r['success_ci95'][1]:.3f} |"
                  for task, r in result["per_task"].items()]
    return "\n".join(lines)


def write_curve(cfg, run_dir: Path, curve: list[dict]) -> None:
    """An evaluation of every kept checkpoint, kept with the run: eval.jsonl (which
    postprocess/report.py draws beside the training curve; the newest `--all` replaces it),
    each result with the software that evaluated it (job/provenance.py), and TensorBoard's
    `eval` group."""
    import json

    from hpcvla.files import replace_text
    from hpcvla.job.provenance import software
    from hpcvla.metrics.tensorboard import RunBoard
    if len(curve) == 1:
        print("hpcvla eval: one policy, no curve: the run kept one checkpoint (train with "
              "learner.checkpoint_every=K learner.checkpoint_keep=M for more), or add "
              "--untrained to compare it with the start", file=sys.stderr)
    made_with = software()
    replace_text(run_dir / "eval.jsonl", "".join(json.dumps({**r, "software": made_with}) + "\n"
                                                 for r in curve))
    board = RunBoard(run_dir, cfg.run)
    for r in curve:
        board.scalars({k: v for k, v in r.items() if k in (
            "success_rate", "mean_return", "success_at_end") or k.startswith(KEY)},
            r["trained_env_steps"], group="eval")
    board.close()


def checkpoint_weights(run_dir: Path) -> tuple[dict, dict]:
    """The newest checkpoint's weights of a run directory (or of a checkpoint directory), and
    its state (policy `version`, `counters` such as trained_env_steps)."""
    path = catalog.latest(run_dir)
    if path is None:
        raise catalog.CheckpointError(f"{run_dir}: no complete checkpoint "
                                    f"(checkpoints/v*/state.json): {catalog.NONE_WRITTEN}")
    return store.load_weights(path), catalog.read_state(path)
