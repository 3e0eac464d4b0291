"""`hpcvla bench fullsize`: the users' job at its real size, through `hpcvla train` as a user
runs it, on this node's first GPU: π0 (3.3 B) from a pretrained folder, streamer against
sync-disaggregated, LoRA, Open MPI, a stop by SIGTERM, and OpenVLA-OFT (7.5 B) with LoRA.
`--quick`: the same steps at the tiny sizes on the CPU (the CPU suite runs it, through
jobs/validate_gpu.sh, the job that runs this on a GPU node).

Each step is a process of its own writing its log into OUT as it goes, so a job cut by its
time limit keeps what it did; `--steps` runs some of them (a job split over short calls):

  (folder)  first, where missing: the policy at the size, randomly initialised on the GPU and
            saved as a pretrained folder (a stand-in for a published or fine-tuned one: the
            same layout and bytes); OFT's without its LoRA adapters
  plan      `hpcvla plan` of the job: its wall time and the memory model's figures
  streamer  N policy versions, pipeline.mode=streamer, no checkpoint (a full-size π0's is
            ~45 GB of weights, fp32 masters and Adam moments: `sigterm` writes one)
  sync      the same in pipeline.mode=sync-disaggregated
  lora      the streamer with policy.lora_rank=16
  openmpi   the streamer under Open MPI (launch.mpi=openmpi; the others run under `auto`)
  sigterm   the streamer until its first version is trained, then SIGTERM to `hpcvla train`,
            as a scheduler's time limit sends it: signal to checkpoint written, and to exit
  oft       OpenVLA-OFT at its size with LoRA, from its own folder
  sft       `hpcvla sft` of π0 from its folder with LoRA (one learner, SFT_STEPS steps of
            SFT_BATCH chunks) on demonstrations of the job's env at its image size, recorded
            by `hpcvla demos` first: its peak memory over the model's imitation figure
  refuse    (a GPU's only: no default of --quick) the job's world started directly, as a
            user's own srun/mpirun line starts it (`hpcvla launch -n 4 -- train`: no
            launcher plans it first), on a GPU it overfills (placement.gpu_memory_gb=1): it
            must end with exit 2 and the memory model's message once; the seconds it took

Reported per run: summary.json's start and stop (phases_s: seconds since launch), env steps
per second (sft: steps per second), and every rank's peak memory (CUDA allocated, host RSS)
over the memory model's figure (GPU runs); the streamer's throughput over sync's, measured
one after the other.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from hpcvla.job.trainrun import train_run

# the runs' settings; the folder they load sets the policy's sizes (built at `size`)
JOB = {"full": ["configs/reach_flow.yaml", "--ranks", "4", "policy.dtype=bfloat16",
                "env.image_size=224", "env.envs_per_simulator=8", "rollout.segment_len=4",
                "learner.micro_batch=8", "learner.epochs=1",
                "learner.gradient_checkpointing=true"],
       "tiny": ["configs/reach_flow.yaml", "--ranks", "4", "env.image_size=32",
                "env.envs_per_simulator=8", "rollout.segment_len=4", "learner.micro_batch=8",
                "learner.epochs=1", "learner.gradient_checkpointing=true"]}
OFT = ["policy.name=oft", "policy.lora_rank=16"]
NO_CHECKPOINT = ["learner.checkpoint_every=-1"]
ARMS = {"streamer": ["pipeline.mode=streamer"], "sync": ["pipeline.mode=sync-disaggregated"],
        "lora": ["pipeline.mode=streamer", "policy.lora_rank=16"],
        "openmpi": ["pipeline.mode=streamer", "launch.mpi=openmpi"]}


RUNS = ("streamer", "sync", "lora", "openmpi", "sigterm", "oft")  # `hpcvla train` runs
STEPS = ("plan", *RUNS, "sft", "refuse")
GPU_ONLY = ("refuse",)  # a world on CPUs plans no GPU memory: nothing to refuse
SFT_STEPS, SFT_BATCH = 10, 8


def run(out: Path, quick: bool = False, updates: int = 20, steps=None, json_path=None) -> int:
    """`steps` into `out` (their logs and run directories), after the pretrained folder they
    need; the results in `out`/fullsize.json (and `json_path`), rewritten after each step and
    kept across calls (a job split over two short ones). A step that fails is recorded with
    its error and the others still run; returns 1 if any failed. `steps` None: all of them
    (`quick`: those a CPU can run)."""
    size = "tiny" if quick else "full"
    steps = steps or [s for s in STEPS if not (quick and s in GPU_ONLY)]
    if not quick and not torch.cuda.is_available():
        raise SystemExit("hpcvla bench fullsize: no CUDA GPU here (torch.cuda.is_available() "
                         "is False); --quick runs the same steps at the tiny sizes on the CPU")
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    record = out / "fullsize.json"
    results = json.loads(record.read_text()) if record.is_file() else {}
    results.update(size=size, updates=updates, device=_device())
    job = [*JOB[size], f"pipeline.total_updates={updates}",
           f"policy.pretrained={out / 'pi0-folder'}"]
    oft = [*JOB[size], OFT[0], f"pipeline.total_updates={updates}",
           f"policy.pretrained={out / 'oft-folder'}"]
    commands = {
        "plan": lambda: plan(out, job),
        **{arm: (lambda arm=arm: train(out, arm, [*job, *ARMS[arm], *NO_CHECKPOINT]))
           for arm in ARMS},
        "sigterm": lambda: stop_by_signal(out, [*job, *ARMS["streamer"],
                                                "pipeline.total_updates=100000"]),
        "oft": lambda: train(out, "oft", [*oft, *OFT[1:], *NO_CHECKPOINT]),
        "sft": lambda: fine_tune(out, job),
        "refuse": lambda: refused(out, job, quick)}
    for name in steps:
        folder = "oft" if name == "oft" else "pi0"
        try:
            if not (out / f"{folder}-folder" / "config.json").is_file():
                results[f"{folder}_folder"] = make_folder(out / f"{folder}-folder", [
                    *(oft if name == "oft" else job), f"policy.size={size}"])
            results[name] = commands[name]()
            print(f"[fullsize] {name}: {json.dumps(_headline(results[name]))}", flush=True)
        except Exception as err:  # noqa: BLE001 - recorded; the job's other steps still run
            results[name] = {"error": repr(err)[-3000:]}
            print(f"hpcvla bench fullsize: {name} failed: {err}", file=sys.stderr, flush=True)
        if "env_steps_per_s" in results.get("streamer", {}) and \
                "env_steps_per_s" in results.get("sync", {}):
            results["streamer_over_sync"] = (results["streamer"]["env_steps_per_s"] /
                                             results["sync"]["env_steps_per_s"])
        for path in [record, *([json_path] if json_path else [])]:
            Path(path).write_text(json.dumps(results, indent=1))
    print(table(results), flush=True)
    return int(any("error" in results.get(name, {}) for name in steps))


def make_folder(folder: Path, job: list) -> dict:
    """The job's policy, randomly initialised where the job computes (its GPU, else the CPU),
    saved as a pretrained folder; seconds to build and to save."""
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    from hpcvla.policies.folders import save_pretrained

    cfg = load_config(job[0], [a for a in job[1:] if "=" in a and
                               not a.startswith(("policy.pretrained=", "policy.lora_rank="))])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    begin = time.monotonic()
    with torch.device(device):  # on the GPU: the CPU init of 3.3 B parameters takes minutes
        policy = build_policy(cfg, env_spec(cfg.env), device)
    built = time.monotonic()
    save_pretrained(policy, folder)
    saved = time.monotonic()
    parameters = sum(p.numel() for p in policy.parameters())
    del policy
    if torch.cuda.is_available():  # the runs that follow need the GPU whole
        torch.cuda.empty_cache()
    return {"parameters": parameters, "build_s": built - begin, "save_s": saved - built,
            "bytes": sum(f.stat().st_size for f in folder.iterdir())}


def plan(out: Path, job: list) -> dict:
    """`hpcvla plan --json` of the job on its rank count: wall seconds and the figures."""
    ranks, overrides = _world(job)
    begin = time.monotonic()
    text = _run([sys.executable, "-m", "hpcvla", "plan", job[0], "--world", ranks, "--json",
                 *overrides], out / "plan.log", 300)
    memory = json.loads(text[text.index("{"):])["memory"]
    return {"wall_s": time.monotonic() - begin, "memory": memory}


def train(out: Path, name: str, job: list) -> dict:
    """One `hpcvla train` run into out/name, its log out/name.log: its summary's figures."""
    root = out / name
    shutil.rmtree(root, ignore_errors=True)
    _, summary = train_run(job, root, label=f"hpcvla train ({name})", log=out / f"{name}.log")
    return _figures(summary)


def stop_by_signal(out: Path, job: list) -> dict:
    """The streamer, stopped by SIGTERM once its first version is trained: seconds from the
    signal to the last checkpoint written and to the exit of `hpcvla train`."""
    root = out / "sigterm"
    shutil.rmtree(root, ignore_errors=True)
    cmd = [sys.executable, "-m", "hpcvla", "train", *job, f"run.root={root}"]
    with open(out / "sigterm.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None and not _trained(root):
                time.sleep(0.5)
            signalled = time.time()
            proc.send_signal(signal.SIGTERM)  # nothing if it already ended
            proc.wait(timeout=1800)
        finally:  # a run that does not stop is not left behind
            proc.kill()
    exited = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"the stopped run failed (exit {proc.returncode}): "
                           f"{out / 'sigterm.log'}")
    (run_dir,) = root.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = summary["phases_s"]
    written = sum(f.stat().st_size for f in (run_dir / "checkpoints").glob("*/*"))
    shutil.rmtree(run_dir / "checkpoints")  # ~45 GB at full size: the disk is for the others
    return {**_figures(summary), "signal_to_exit_s": exited - signalled,
            "signal_to_checkpoint_s": steps["last_checkpoint_written"] - steps["stop_signal"],
            "checkpoint_bytes": written}


def fine_tune(out: Path, job: list) -> dict:
    """`hpcvla sft` of the job's policy with LoRA on one learner, on demonstrations of the
    job's env (recorded into out first, where missing): its start and stop, steps per second,
    peak memory against the model's figure."""
    env = [a for a in job if a.startswith("env.image_size=")]
    demos = out / "reach-demos.h5"
    if not demos.is_file():
        _run([sys.executable, "-m", "hpcvla", "demos", job[0], *env, "--episodes", 4,
              "--out", demos], out / "demos.log", 600)
    root = out / "sft"
    shutil.rmtree(root, ignore_errors=True)
    policy = [a for a in job if a.startswith(("policy.", "learner.gradient_checkpointing="))]
    _run([sys.executable, "-m", "hpcvla", "sft", job[0], *env, *policy, "policy.lora_rank=16",
          f"sft.demos={demos}", f"sft.steps={SFT_STEPS}", f"sft.batch_size={SFT_BATCH}",
          f"run.root={root}", "--ranks", 1], out / "sft.log", 1800)
    (run_dir,) = root.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(run_dir / "checkpoints")  # its weights whole: the disk is for the others
    times = [json.loads(line)["time"] for line in open(run_dir / "metrics.jsonl")]
    return {"steps_per_s": (len(times) - 1) / (times[-1] - times[0]),  # the steps, no start
            "phases_s": summary["phases_s"], "ranks": [
                {"rank": r["rank"], "role": "sft learner", "device": r["device"],
                 "peak": r["peak_memory"], "planned": r.get("planned_memory")}
                for r in summary["per_rank"]]}


def refused(out: Path, job: list, quick: bool) -> dict:
    """The job's world started directly (`hpcvla launch -n N -- train`), placement.
    gpu_memory_gb=1: its ranks plan their GPUs once each has one (roles/prologue.py) and
    must end with exit 2 and the memory model's message, once; seconds from start to exit."""
    if quick:
        raise RuntimeError("refuse needs a GPU: a world on CPUs plans no GPU memory")
    ranks, overrides = _world(job)
    # 2 versions: should the refusal fail, the run it failed to stop ends soon
    overrides = [a for a in overrides if not a.startswith("pipeline.total_updates=")]
    overrides.append("pipeline.total_updates=2")
    root = out / "refuse"
    shutil.rmtree(root, ignore_errors=True)
    begin = time.monotonic()
    with open(out / "refuse.log", "w") as log:
        code = subprocess.run([sys.executable, "-m", "hpcvla", "launch", "-n", ranks,
                               "--timeout", "600", "--", "train", job[0], *overrides,
                               "placement.gpu_memory_gb=1", f"run.root={root}"],
                              stdout=log, stderr=subprocess.STDOUT, timeout=900).returncode
    said = (out / "refuse.log").read_text().count("invalid memory plan of the training world")
    if code != 2 or said != 1:
        raise RuntimeError(f"the overfilled world ended with exit {code}, its refusal said "
                           f"{said} time(s) (expected exit 2, once): {out / 'refuse.log'}")
    return {"wall_s": time.monotonic() - begin, "exit": code}


def _world(job: list) -> tuple[str, list]:
    """A job's (`JOB`'s form) rank count and its overrides."""
    return job[job.index("--ranks") + 1], [a for a in job[1:] if "=" in a]


def _trained(root: Path) -> bool:
    """Whether the run under `root` has trained a version (its metrics.jsonl has a line)."""
    return any(p.stat().st_size for p in root.glob("*/metrics.jsonl"))


def _headline(result: dict) -> dict:
    """A step's figures in one line of the log (the whole in fullsize.json)."""
    keep = ("wall_s", "env_steps_per_s", "steps_per_s", "signal_to_checkpoint_s",
            "signal_to_exit_s", "checkpoint_bytes")
    line = {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()
            if k in keep}
    phases = result.get("phases_s", {})
    line.update({k: phases[k] for k in ("first_act", "first_version_trained", "first_step")
                 if k in phases})
    for r in result.get("ranks", []):
        line[f"rank{r['rank']}_peak_gib"] = {k: round(v / 2**30, 2) for k, v in r["peak"].items()}
    return line


def _figures(summary: dict) -> dict:
    ranks = [{"rank": r["rank"], "role": r["role"], "device": r["device"],
              "peak": r["peak_memory"], "planned": r.get("planned_memory")}
             for r in summary["per_rank"]]
    return {"env_steps_per_s": summary["env_steps_per_s"], "wall_s": summary["wall_s"],
            "phases_s": summary["phases_s"], "ranks": ranks}


def _run(cmd: list, log: Path, timeout: float) -> str:
    """Run `cmd`, its output into `log` as it comes; its output, or RuntimeError."""
    with open(log, "w") as f:
        proc = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout)
    text = log.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[2:4]))} failed (exit {proc.returncode}); "
                           f"its log, {log}, ends:\n{text[-3000:]}")
    return text


def _device() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def table(results: dict) -> str:
    """The runs side by side: start, stop, throughput and the peaks against the model."""
    plan_s = results.get("plan", {}).get("wall_s")
    lines = [f"hpcvla bench fullsize ({results['size']}, {results['updates']} versions, "
             f"{results['device']}); plan " + (f"{plan_s:.1f} s" if plan_s else "-"),
             f"{'run':<9} {'first act':>9} {'1st version':>11} {'env steps/s':>11} "
             f"{'GPU peak/plan':>13} {'host peak/plan':>14}"]
    for name in RUNS:
        r = results.get(name)
        if not r or "error" in r:
            lines.append(f"{name:<9} {'failed' if r else 'not run'}")
            continue
        lines.append(f"{name:<9} {r['phases_s'].get('first_act', 0):>9.1f} "
                     f"{r['phases_s'].get('first_version_trained', 0):>11.1f} "
                     f"{r['env_steps_per_s']:>11.1f} {_ratio(r, 'gpu'):>13} "
                     f"{_ratio(r, 'host'):>14}")
    if "streamer_over_sync" in results:
        lines.append(f"streamer/sync env steps/s {results['streamer_over_sync']:.2f}")
    sft = results.get("sft", {})
    if "steps_per_s" in sft:
        lines.append(f"sft (LoRA, {SFT_BATCH} chunks a step): first step at "
                     f"{sft['phases_s']['first_step']:.1f} s, {sft['steps_per_s']:.2f} steps/s, "
                     f"GPU peak/plan {_ratio(sft, 'gpu')}, host peak/plan {_ratio(sft, 'host')}")
    if "exit" in results.get("refuse", {}):
        lines.append(f"an overfilled world started directly: refused, exit 2 after "
                     f"{results['refuse']['wall_s']:.1f} s")
    stop = results.get("sigterm", {})
    if "signal_to_exit_s" in stop:
        lines.append(f"SIGTERM to checkpoint {stop['signal_to_checkpoint_s']:.1f} s, to exit "
                     f"{stop['signal_to_exit_s']:.1f} s ({stop['checkpoint_bytes'] / 1e9:.1f} GB)")
    return "\n".join(lines)


def _ratio(run: dict, kind: str) -> str:
    """The largest rank's measured peak over the model's figure ('-' without one)."""
    key = "gpu_allocated" if kind == "gpu" else "host_rss"
    pairs = [(r["peak"].get(key), (r["planned"] or {}).get(kind)) for r in run["ranks"]]
    pairs = [(m, p) for m, p in pairs if m and p]
    if not pairs:
        return "-"
    measured, planned = max(pairs)
    return f"{measured / planned:.2f}"
