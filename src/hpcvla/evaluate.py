"""`hpcvla eval`: the success rate of a policy (a run's checkpoint, or the untrained policy
its config builds) on a fixed set of initial states of the configured env, in this process.

The env names the states (`VectorEnv.evaluation_states`): ids 0, 1, 2, ... where every id is
its own initial state (reach, ManiSkill), the suite's (task, fixed state) pairs taken task by
task in turn for LIBERO. They are all of the evaluation split, ids below EVAL_STATE_IDS,
which training never starts from (envs/base.py); the result names the split, the id range
and what the states are. Two policies evaluated with the same `episodes` see the same states,
so their success rates compare directly (the policy still samples its actions, as it does in
training, unless `deterministic`). An episode the env ended by a fault (`env_fault`) is no
verdict on the policy: it is left out and counted.

ManiSkill's evaluation conventions are reported beside this one: its evaluation runs every
episode to the horizon (ignore_terminations) and reports `success_once` (the task done at any
step) and `success_at_end` (done at the last step). For a ManiSkill env the episodes here run
the same way (`VectorEnv.run_to_horizon`): `success_rate` is then success_once, the same
outcome as an episode that ends at its first success (the same steps up to it), and
`success_at_end` is measured too.

On several ranks (`hpcvla eval --ranks N`, or srun/mpirun in jobs/slurm/eval.sbatch) the
states go out in batches of `envs`, batch b to rank b mod N, every rank an env batch and the
policy (a simulator and an inference role in one process, on a GPU of its node where there
are GPUs); the outcomes are gathered on every rank. A batch is the same states in the same
env slots whatever N is, and its sampling generator is seeded from (seed, batch), so the same
states and seed give the same per-episode outcomes on 1 rank and on N.

`hpcvla export`: a run's newest checkpoint as a Hugging Face-style folder (`export_policy`).
"""

from __future__ import annotations

import copy
import re
import socket
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from hpcvla import checkpoint
from hpcvla.devices import bind_rank_device, local_device
from hpcvla.envs import env_kwargs, make_env
from hpcvla.envs.base import is_evaluation_state
from hpcvla.metrics.stats import wilson_interval
from hpcvla.topology.plan import INF, SIM


class Episode(NamedTuple):
    """One evaluation episode's outcome; `position` is its state's index in the states run."""
    position: int
    success: bool
    ret: float
    env_fault: bool
    success_at_end: bool
    steps: int


def evaluate(cfg, weights: dict | None, episodes: int = 128, envs: int = 32, seed: int = 0,
             deterministic: bool = False, world=None, video: int = 0,
             video_dir: Path | None = None) -> dict:
    """Run the env's first `episodes` evaluation states, `envs` at a time, one episode each;
    returns success rate, mean return, episodes, faults, success per task and per episode.
    `weights` None: the untrained policy. `world` (an MPI communicator, collective): its
    ranks share the batches (module docstring) and all return the whole result. The policy
    runs on a GPU where there is one (placement.gpus_per_node=0: the CPU). `video` K: the
    first K episodes of every task also go to `video_dir` as MP4 (`_write_video`)."""
    from hpcvla.factory import build_policy  # the policy exactly as training builds it
    cfg, protocol, states = _protocol(cfg)
    kwargs = env_kwargs(cfg.env)
    if cfg.env.name == "reach":  # no emulated latency, no injected faults
        kwargs.update(latency_median_ms=0.0, hang_at_step=0, crash_at_step=0)
    envs = max(1, min(envs, episodes))
    rank, ranks = (0, 1) if world is None else (world.Get_rank(), world.Get_size())
    device = local_device(cfg.placement.gpus_per_node) if world is None else \
        bind_rank_device(cfg, [(SIM, INF)] * ranks, world)  # [dist] before any simulator
    env = make_env(cfg.env.name, envs, seed, **kwargs)
    env.run_to_horizon = cfg.env.name == "maniskill"  # ManiSkill's conventions (docstring)
    policy = build_policy(cfg, env.spec, device)
    if weights is not None:
        policy.load_arrays(weights)
    ids, tasks = states or env.evaluation_states(episodes)
    assert all(is_evaluation_state(int(i)) for i in ids), "evaluation states only"
    filmed = {p for p, n in enumerate(_ordinals(tasks)) if n < video}  # positions in ids
    mine, videos = [], []  # Episode records, paths
    try:
        for first in range(rank * envs, len(ids), ranks * envs):
            torch.manual_seed(int(np.random.SeedSequence([seed, first]).generate_state(1)[0]))
            outcomes, frames = _run_batch(env, policy, ids[first:first + envs], deterministic,
                                          first, filmed)
            mine += outcomes
            videos += [_write_video(video_dir, *frames[e.position], ids[e.position],
                                    tasks[e.position], e.success)
                       for e in outcomes if e.position in frames]
    finally:
        env.close()
    # every rank's episodes and videos, and the host and device it ran on
    parts = [(mine, videos, socket.gethostname(), str(device))]
    if world is not None:
        parts = world.allgather(parts[0])  # [dist]
    return {**_result(sorted(e for part in parts for e in part[0]), ids, tasks, env,
                      deterministic),
            "ranks": ranks, "hosts": sorted({part[2] for part in parts}),
            "device": ", ".join(sorted({part[3] for part in parts})),
            "protocol": protocol or {"name": "hpcvla", "steps": cfg.env.max_episode_chunks *
                                     cfg.env.chunk_len},
            **({"videos": sorted(v for part in parts for v in part[1])} if video else {})}


def _protocol(cfg) -> tuple:
    """The config an evaluation runs and, for eval.protocol=libero, what its protocol
    fixes: LIBERO's benchmark (every task, or eval.tasks, with its fixed states task by task,
    the suite's step limit; STEP_LIMITS of envs/libero.py), and its (ids, task labels);
    else None and None."""
    if cfg.eval.protocol != "libero":
        return cfg, None, None
    from hpcvla.config.learning import eval_tasks
    from hpcvla.envs.libero import SETTLE_STEPS, STEP_LIMITS, benchmark_states
    cfg = copy.deepcopy(cfg)
    limit = STEP_LIMITS[cfg.env.suite]
    cfg.env.suite_task = -1  # the env loads each state's task
    cfg.env.max_episode_chunks = -(-limit // cfg.env.chunk_len)  # whole chunks: >= the limit
    ids, labels, tasks = benchmark_states(cfg.env.suite, eval_tasks(cfg.eval),
                                          cfg.eval.states_per_task)
    return cfg, {"name": "libero", "suite": cfg.env.suite, "tasks": tasks,
                 "states_per_task": cfg.eval.states_per_task, "step_limit": limit,
                 "steps": cfg.env.max_episode_chunks * cfg.env.chunk_len,
                 "settle_steps": SETTLE_STEPS, "success": "the task done at any step (it "
                 "ends the episode)"}, (ids, labels)


def _run_batch(env, policy, batch: np.ndarray, deterministic: bool, first: int,
               filmed: set) -> tuple[list, dict]:
    """One episode from each state of `batch` (the env's first len(batch) slots; the others
    repeat states, and their outcomes are dropped); returns the Episode of each, and for those in `filmed` their instruction and
    frames (position -> (instruction, [(step, image)])): the camera observation each chunk
    was chosen from, and (step, None) when the episode ended."""
    n = env.num_envs
    obs = env.reset(init_state_ids=np.resize(batch, n))
    running = np.ones(n, bool)
    success, ret = np.zeros(n, bool), np.zeros(n, np.float32)
    fault, success_at_end = np.zeros(n, bool), np.zeros(n, bool)
    steps = np.zeros(n, np.int64)
    said = env.instructions()
    frames = {first + i: (said[i], []) for i in range(len(batch)) if first + i in filmed}
    step = 0
    while running.any():  # each env's first episode; auto-reset ones are ignored
        for position, (_, film) in frames.items():
            if running[position - first]:
                film.append((step, _camera(obs, position - first)))
        with torch.no_grad():
            actions = policy.act(policy.obs_to_tensors(obs, policy.device),
                                 deterministic).actions
        result = env.step(actions.cpu().numpy())
        step += env.spec.chunk_len
        ended = running & (result.terminated | result.truncated)
        success[ended], ret[ended] = result.success[ended], result.episode_return[ended]
        fault[ended] = result.env_fault[ended]
        steps[ended] = result.episode_length[ended] * env.spec.chunk_len
        if result.success_at_end is not None:
            success_at_end[ended] = result.success_at_end[ended]
        for position, (_, film) in frames.items():
            if ended[position - first]:  # the episode's length, for the last caption
                film.append((step, None))
        running &= ~ended
        obs = result.obs
    return [Episode(first + i, bool(success[i]), float(ret[i]), bool(fault[i]),
                    bool(success_at_end[i]), int(steps[i])) for i in range(len(batch))], frames


def _camera(obs: dict, i: int) -> np.ndarray:
    """Env i's camera images side by side (the third-person camera, then the wrist's)."""
    return np.concatenate([obs[k][i] for k in ("image", "wrist_image") if k in obs], axis=1)


def _ordinals(tasks: list) -> list[int]:
    """Each state's index among the states of its task."""
    seen = defaultdict(int)
    out = []
    for task in tasks:
        out.append(seen[task])
        seen[task] += 1
    return out


def _write_video(video_dir: Path, instruction: str, film: list, state_id, task: str,
                 success: bool) -> str:
    """One episode's frames as `<task>-state<id>-<success|failure>.mp4` (video.episode_video)."""
    from hpcvla.metrics.video import episode_video
    outcome = "success" if success else "failure"
    seen = [(step, image) for step, image in film if image is not None]
    slug = re.sub(r"[^A-Za-z0-9]+", "_", task).strip("_")[:60] or "task"
    return episode_video(Path(video_dir) / f"{slug}-state{int(state_id)}-{outcome}.mp4",
                         [image for _, image in seen], [step for step, _ in seen],
                         f"state {state_id}", instruction, outcome, film[-1][0])


def _wilson(outcomes: list[bool]) -> list[float]:
    return [round(x, 4) for x in wilson_interval(sum(outcomes), len(outcomes))]


def _result(episodes: list, ids, tasks, env, deterministic) -> dict:
    """The report of the gathered episodes (position order): an episode the env ended by a
    fault is left out and counted."""
    kept = [e for e in episodes if not e.env_fault]
    per_task = defaultdict(list)
    for e in kept:
        per_task[tasks[e.position]].append(e.success)
    outcomes = [e.success for e in kept]
    return {"split": "evaluation", "init_state_ids": [int(ids.min()), int(ids.max())],
            "states": env.evaluation_kind,
            "actions": "deterministic" if deterministic else "sampled",
            "episodes": len(kept), "success_rate": float(np.mean(outcomes)),
            "success_ci95": _wilson(outcomes),
            "mean_return": float(np.mean([e.ret for e in kept])),
            "env_faults": len(episodes) - len(kept),
            **({"success_once": float(np.mean(outcomes)),
                "success_at_end": float(np.mean([e.success_at_end for e in kept]))}
               if env.run_to_horizon else {}),
            "per_task": {task: {"episodes": len(s), "success_rate": float(np.mean(s)),
                                "success_ci95": _wilson(s)} for task, s in per_task.items()},
            "per_episode": [{"init_state_id": int(ids[e.position]), "task": tasks[e.position],
                             "success": e.success, "return": e.ret, "steps": e.steps,
                             "env_fault": e.env_fault} for e in episodes]}


def eval_problem(cfg, trained, episodes: int, envs: int, video: int,
                 ranks: int | None) -> str | None:
    """What is wrong with `hpcvla eval`'s flags, or with evaluating the run configured as
    `trained` in the env `cfg` configures, before any rank starts."""
    from hpcvla.envs.base import EVAL_STATE_IDS
    for flag, value, low, high in (("--episodes", episodes, 1, EVAL_STATE_IDS),
                                   ("--envs", envs, 1, None), ("--video", video, 0, None),
                                   ("--ranks", 1 if ranks is None else ranks, 1, None)):
        if value < low or high is not None and value > high:
            return (f"{flag} {value}: give {low} or more"
                    + (f", at most {high} (the evaluation split's states)" if high else ""))
    if video and not cfg.env.camera:
        return "--video needs a camera: the run has env.camera=false"
    return vocabulary_problem(cfg, trained)


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
    episodes of every task as MP4 in RUN_DIR/videos/v<version>-<actions>/."""
    curve = []
    for path in policies:
        weights, state = (None, {"version": 0}) if path is None else checkpoint_weights(path)
        actions = "deterministic" if deterministic else "sampled"
        curve.append({"run_dir": str(run_dir), "version": state["version"],
                      "trained_env_steps": state.get("counters", {}).get("trained_env_steps", 0),
                      **evaluate(cfg, weights, episodes=episodes, envs=envs, seed=cfg.run.seed,
                                 deterministic=deterministic, world=world, video=video,
                                 video_dir=run_dir / "videos" /
                                 f"v{state['version']:06d}-{actions}")})
    return curve


def describe(result: dict) -> str:
    """A result as `hpcvla eval` prints it."""
    low, high = result["success_ci95"]
    lines = [f"policy version {result['version']}: success {result['success_rate']:.3f} "
             f"(95 % {low:.3f}-{high:.3f}) over "
             f"{result['episodes']} episodes ({result['actions']} actions), mean return "
             f"{result['mean_return']:.2f}"
             + (f" ({result['env_faults']} left out: env faults)" if result["env_faults"] else "")]
    if "success_at_end" in result:
        lines.append(f"  ManiSkill's conventions: success_once {result['success_once']:.3f}, "
                     f"success_at_end {result['success_at_end']:.3f}")
    ids = result["init_state_ids"]
    lines.append(f"  {result['split']} split: init_state_ids {ids[0]}..{ids[1]}, "
                 f"{result['states']}; {result['ranks']} rank(s) on {len(result['hosts'])} "
                 f"host(s), {result['device']}")
    protocol = result.get("protocol", {})
    if protocol.get("name") == "libero":
        lines.append(f"  LIBERO protocol: {protocol['suite']} tasks {protocol['tasks']}, "
                     f"{protocol['states_per_task']} fixed states each, step limit "
                     f"{protocol['step_limit']} ({protocol['steps']} run: whole chunks), "
                     f"{protocol['settle_steps']} settle steps, success: {protocol['success']}")
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
    postprocess/report.py draws beside the training curve) and TensorBoard's `eval` group."""
    import json

    from hpcvla.metrics.tensorboard import RunBoard
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in curve))
    board = RunBoard(run_dir, cfg.run)
    for r in curve:
        board.scalars({k: r[k] for k in ("success_rate", "mean_return", "success_at_end")
                       if k in r}, r["trained_env_steps"], group="eval")
    board.close()


def checkpoint_weights(run_dir: Path) -> tuple[dict, dict]:
    """The newest checkpoint's weights of a run directory (or of a checkpoint directory), and
    its state (policy `version`, `counters` such as trained_env_steps)."""
    path = checkpoint.latest(run_dir)
    if path is None:
        raise checkpoint.CheckpointError(f"{run_dir}: no complete checkpoint "
                                         "(checkpoints/v*/state.json)")
    return checkpoint.load_weights(path), checkpoint.read_state(path)


def export_policy(cfg, run_dir: Path, out: Path) -> dict:
    """The newest checkpoint of the run `cfg` configured, as a folder `policy.pretrained` and
    `policies.load_pretrained` read (policies.save_pretrained), LoRA adapters merged into the
    weights (policies/lora.py); returns its version, merged layers and folder."""
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    from hpcvla.policies import save_pretrained
    from hpcvla.policies.lora import merge_lora
    policy = build_policy(cfg, env_spec(cfg.env))
    weights, state = checkpoint_weights(run_dir)
    policy.load_arrays(weights)
    merged = merge_lora(policy) if cfg.policy.lora_rank else 0
    save_pretrained(policy, out)
    return {"version": state["version"], "merged_lora_layers": merged, "folder": str(out)}
