"""The scalars of a run: TensorBoard event files, written by the standard writer
(`torch.utils.tensorboard.SummaryWriter`, the `tensorboard` package), so that
`tensorboard --logdir runs/` on a login node shows every run under `runs/` live; and, with
`run.wandb`, the same scalars to Weights & Biases (`wandb`, offline on compute nodes).

One writer at a time per run directory: the rank that owns the learning progress (the weight
root), then the end-of-run report, `hpcvla eval --all` and `hpcvla sft`. The x axis is trained
env steps (all learners), as Sample Factory and CleanRL plot it, so runs with different batch
sizes line up. Tags are grouped by what they measure: `train/*` (loss statistics of each
micro-batch's last epoch), `rollout/*` (episodes inside trained segments), `perf/*` (throughput,
staleness), `busy/*` (each stage's busy fraction, once at the end), `sft/*` (`hpcvla sft`'s
losses), `eval/*` (`hpcvla eval --all`) and `heldout/*` (evaluation during training, eval.every;
its videos in the image tab).
"""

from __future__ import annotations

from pathlib import Path

from hpcvla.metrics.episode_metrics import KEY

SUBDIR = "tensorboard"
# the rest of a record: train/*; the env's episode metrics (`episode_<name>`: metrics/
# episode_metrics.py) are rollout/ too
GROUPS = {"success_rate": "rollout", "mean_return": "rollout", "mean_episode_chunks": "rollout"}


def _rollout(name: str) -> str:
    return "rollout" if name.startswith(KEY) else "train"


class RunBoard:
    """Scalars of one run into `<run_dir>/tensorboard/` and, where `run.wandb` asks, W&B
    (nothing where both are off). `run` is the config's `run` section."""

    def __init__(self, run_dir, run, config: dict | None = None, resumed_at: int | None = None):
        """`resumed_at`: the step (x) a resumed start goes on from, the checkpoint's: a start
        that died after it logged steps past it, which this one logs again, so TensorBoard
        drops the older events past it (its purge_step) and a curve is drawn once."""
        self.writer = self.wandb = None
        if run.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / SUBDIR),
                                        purge_step=None if resumed_at is None else resumed_at + 1)
        if run.wandb != "disabled":
            self.wandb = wandb_run(Path(run_dir), run.name, run.wandb, config)

    def scalars(self, values: dict, step: int, group: str | None = None) -> None:
        """`values` name -> number at `step`; each under `group/` (or its GROUPS entry,
        default `train`); a None (e.g. a success rate before any episode ended) is left out."""
        tags = {name if "/" in name else f"{group or GROUPS.get(name, _rollout(name))}/{name}":
                float(value) for name, value in values.items() if value is not None}
        if self.writer is not None:
            for tag, value in tags.items():
                self.writer.add_scalar(tag, value, global_step=int(step))
        if self.wandb is not None:  # W&B's own step only grows: the x axis is a scalar
            self.wandb.log({**tags, STEP: int(step)})

    def video(self, tag: str, path, step: int) -> None:
        """The MP4 at `path` (metrics/video.py) at `step`: in TensorBoard as an animated GIF
        in its image tab, in W&B as the video itself."""
        if self.writer is not None:
            from tensorboard.compat.proto.summary_pb2 import Summary

            from hpcvla.metrics.video import gif_bytes, read_video
            frames = read_video(path)
            image = Summary.Image(height=frames.shape[1], width=frames.shape[2], colorspace=3,
                                  encoded_image_string=gif_bytes(frames))
            # the writer's own event file, as its add_video writes one (which needs moviepy)
            self.writer._get_file_writer().add_summary(
                Summary(value=[Summary.Value(tag=tag, image=image)]), int(step))
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Video(str(path), format="mp4"), STEP: int(step)})

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


STEP = "trained_env_steps"
WANDB_ID = "wandb_id"  # the run directory's file holding its W&B run id


def wandb_id(run_dir: Path) -> str:
    """The run directory's W&B id: made by its first writer from the directory's name and a
    hash of its path then, and kept in it (WANDB_ID: the id and that path), so that a run
    moved elsewhere (from scratch to project storage) and resumed there goes on in the same
    W&B run. A copy (`cp -r`: the directory it was made in still holds the same id) gets an
    id of its own, as a run that has none yet (older ones) gets the one its path gives."""
    import hashlib

    from hpcvla.files import replace_text

    path = run_dir.resolve()
    kept = path / WANDB_ID
    held = kept.read_text().strip() if kept.is_file() else ""
    run_id, _, made_in = held.partition(" ")
    if run_id and made_in not in ("", str(path)) and _holds_id(Path(made_in), run_id):
        run_id = ""  # a copy: the directory it was copied from still runs under that id
    run_id = run_id or f"{path.name}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if held != f"{run_id} {path}":  # new, copied or moved (every writer of it agrees)
        replace_text(kept, f"{run_id} {path}\n")
    return run_id


def _holds_id(folder: Path, run_id: str) -> bool:
    """Whether `folder` is a run directory that keeps W&B id `run_id`."""
    try:
        return (folder / WANDB_ID).read_text().split(" ", 1)[0].strip() == run_id
    except OSError:
        return False


def wandb_run(run_dir: Path, group: str, mode: str, config: dict | None):
    """The W&B run of a run directory: one id per directory (wandb_id), resumed by every
    writer of the run online (the training's, the report's, `eval --all`'s); offline, each
    writes an offline run of its own under that id, which W&B's sync is not known to join
    (docs/outputs.md)."""
    import os

    import wandb

    path = str(run_dir.resolve())
    run = wandb.init(
        mode=mode, dir=path, project=os.environ.get("WANDB_PROJECT", "hpcvla"),
        id=wandb_id(run_dir), name=run_dir.name,
        group=group, config=config, resume="allow",
        settings=wandb.Settings(console="off", quiet=True, x_disable_stats=True))
    run.define_metric(STEP)
    run.define_metric("*", step_metric=STEP)
    if mode == "offline" and config is not None:  # the training's writer says it once
        print(f"[hpcvla] W&B offline run in {path}/wandb: from a login node, "
              f"`wandb sync {path}/wandb/offline-run-*` uploads it", flush=True)
    return run


def wandb_problems(run) -> list[tuple[str, object, str]]:
    """Why `run.wandb` cannot work on this machine (pre-flight, before any rank starts)."""
    if run.wandb == "disabled":
        return []
    try:
        import wandb  # noqa: F401
    except ImportError as err:
        return [("run.wandb", run.wandb, f"disabled, or wandb installed ({err}; make install)")]
    if run.wandb == "online":
        import netrc
        import os
        from urllib.parse import urlsplit

        base = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
        server = urlsplit(base if "://" in base else f"https://{base}")
        try:
            logged_in = netrc.netrc().authenticators(server.hostname or "") is not None
        except (OSError, netrc.NetrcParseError):
            logged_in = False
        if not (os.environ.get("WANDB_API_KEY") or logged_in):
            return [("run.wandb", "online", "offline where there is no W&B login (no "
                     "WANDB_API_KEY, no `wandb login`): `wandb sync` the run from a login node")]
        unreachable = _unreachable(server)
        if unreachable:
            return [("run.wandb", "online", f"offline: {unreachable} (compute nodes often "
                     "reach no internet; rank 0 would wait for it, then end the world): "
                     "`wandb sync` the run from a login node")]
    return []


def _unreachable(server, timeout_s: float = 5.0) -> str:
    """Why this machine cannot open a connection to the W&B server `server` (a split URL), or
    to the HTTPS proxy it would go through; '' where it can."""
    import socket
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    # the proxy the environment names for the server's scheme, unless NO_PROXY lets it be
    proxy = "" if proxy_bypass(server.hostname or "") else getproxies().get(server.scheme, "")
    target = urlsplit(proxy if "://" in proxy else f"http://{proxy}") if proxy else server
    port = target.port or (443 if target.scheme == "https" else 80)
    what = f"{'the proxy ' if proxy else ''}{target.hostname}:{port}"
    try:
        socket.create_connection((target.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        return f"this node cannot reach {what} ({err.strerror or err})"
    return ""


def read_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a run's event files, tag -> [(step, value)] (for tests and
    scripts; TensorBoard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(Path(run_dir) / SUBDIR), size_guidance={"scalars": 0})
    board.Reload()
    return {tag: [(e.step, e.value) for e in board.Scalars(tag)]
            for tag in board.Tags()["scalars"]}


__all__ = ["RunBoard", "read_scalars", "SUBDIR", "wandb_problems"]
