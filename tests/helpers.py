"""What several test files share: the repository's paths, running the `hpcvla` CLI as a user
would, one training run, the learning statistic, a few fixtures built from real envs, and
each VLA family's config with a batch for its env, and the PIDs of a run's ranks.

Test files import from here (`from helpers import hpcvla`); no test file imports another.
tests/conftest.py puts this folder on sys.path, so tests in sub-folders import it the same way.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from hpcvla.job.leftovers import SETTLE_S, orphans, segments

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
MPI_DIR = TESTS / "mpi"  # the worker scripts the MPI tests launch
# PyPI's Open MPI 5 wheel, in a prefix of its own beside the venv's MPICH (`make install`)
OPENMPI5 = Path(sys.prefix) / "openmpi5" / "bin" / "mpirun"
FIXTURES = TESTS / "fixtures"



def hpcvla(*args, env=None, timeout=180):
    """Run the `hpcvla` CLI as a user would; the outer timeout guards against any hang.
    Whatever the outcome, the world must leave no shared-memory files behind."""
    full_env = {**os.environ, **(env or {})}
    before = segments()
    out = subprocess.run([sys.executable, "-m", "hpcvla", *map(str, args)], cwd=ROOT,
                         env=full_env, capture_output=True, text=True, timeout=timeout)
    left = left_behind(before)
    assert not left, f"shared-memory files left behind: {left}"
    return out


def left_behind(before: set[Path], wait_s: float = 60.0) -> list[str]:
    """The MPICH segments made since `before` that no process maps, for good: a world another
    test runs beside this one (xdist's other worker) may have made one and not yet mapped it,
    or have had a rank killed (tests/faults) whose segments its launcher removes once that
    world has ended; a segment of a world that has ended here stays."""
    left = orphans(before, settle_s=SETTLE_S)
    deadline = time.monotonic() + wait_s
    while left and time.monotonic() < deadline:
        time.sleep(1.0)
        left &= orphans(before)
    return sorted(map(str, left))


def plant_orphan_segment(name: str) -> Path:
    """An MPICH segment in this worker's own /dev/shm (tests/conftest.py) that no process
    maps, as a killed rank leaves one: the evidence that a launcher's cleanup ran. A failed
    world's own segments are no such evidence: a rank that says why it fails unlinks them
    before its abort (deathwatch.abort_world), and whether one does before the MPI launcher
    kills it is a race."""
    planted = Path("/dev/shm") / f"mpich_{name}"
    planted.write_bytes(bytes(4096))
    return planted


def removed_by_name(planted: Path, text: str) -> bool:
    """Whether `planted` is gone and a cleanup's line in `text` named it (such a line may name
    other segments too)."""
    return not planted.exists() and any(
        planted.name in line.split() for line in text.splitlines()
        if "MPI segment(s) that no process maps" in line)


def without_launcher(*args, hide=None, env=None, timeout=120):
    """`hpcvla ARGS` with the world launcher (hpcvla.job.launch) made unimportable: a command
    that started a world would fail to import it (exit 1), so exit 2 means it refused its
    input before any rank; `hide` makes one more package uninstalled for that process (as on
    a machine without it)."""
    code = "import sys\nsys.modules['hpcvla.job.launch'] = None\n" + \
        (f"sys.modules[{hide!r}] = None\n" if hide else "") + \
        "from hpcvla.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


def fake_checkpoint(path: Path, **state) -> Path:
    """A complete-looking checkpoint directory as checkpoint/store.py's save lays it out, one
    learner, its files whole but empty (their contents are checked only when loaded, against
    the sha256 in state.json). `state` overrides state.json's fields; a field given as None is
    left out; then sealed."""
    from safetensors.numpy import save_file

    from hpcvla.checkpoint.catalog import FORMAT, sealed

    path.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.rank0.safetensors"):
        save_file({}, str(path / name))
    full = {"format": FORMAT, "version": 2, "counters": {"trained_env_steps": 0},
            "learners": 1, "zero_stage": 1, "model_sha256": "0" * 64,
            "optimizer": [{"file": "optimizer.rank0.safetensors", "sha256": "0" * 64,
                           "fragments": {}, "steps": {}, "keys": []}], **state}
    (path / "state.json").write_text(json.dumps(sealed({k: v for k, v in full.items()
                                                        if v is not None})))
    return path


def run_train(tmp_path, *overrides, config="configs/default.yaml", ranks=4, timeout=400):
    """`hpcvla train` into tmp_path; asserts it succeeded. Returns the completed process, the
    run's summary.json and its run folder."""
    out = hpcvla("train", config, "--ranks", ranks, f"run.root={tmp_path}", *overrides,
                 timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    return out, json.loads((run_dir / "summary.json").read_text()), run_dir


class Clock:
    """A clock a test moves by hand (`now`), for code that takes one to read."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def reach_demos(path: Path, episodes: int) -> Path:
    """`episodes` demonstrations of the default `reach` task's oracle (`hpcvla demos`) written
    to `path`, for `hpcvla sft`; asserts it succeeded."""
    made = hpcvla("demos", "configs/default.yaml", "--episodes", episodes, "--out", path)
    assert made.returncode == 0, made.stderr[-2000:]
    return path


def sft_worlds(run_dir: Path, resumed: int) -> tuple[list[dict], list[dict]]:
    """An `hpcvla sft` run's metrics.jsonl records (one a step) cut where the world restarted
    from step `resumed` began: at the last record of step resumed + 1 (the dead world may have
    recorded it too, or died before it); the dead world's records and the restarted one's."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cut = max(i for i, record in enumerate(records) if record["step"] == resumed + 1)
    return records[:cut], records[cut:]


def progress_version(line: str) -> int | None:
    """The version a progress line (`[hpcvla] update V/N | ...`) reports; None for any other
    line. Lines come every pipeline.progress_every_s, not at every version: wait for a version
    at or past V, never for V exactly."""
    match = re.match(r"\[hpcvla\] update (\d+)/", line)
    return int(match.group(1)) if match else None


MIN_Z = 3.5  # success must rise by a margin chance gives a non-learning policy with p < 3e-4
# (one-sided two-proportion z over 128 episodes each: from 0.06 untrained, about +0.17).


def improvement_z(before: float, after: float, n: int) -> float:
    """One-sided two-proportion z statistic of a success rate rising from `before` to `after`,
    each over n episodes."""
    pooled = (before + after) / 2
    return (after - before) / max(1e-12, (pooled * (1 - pooled) * 2 / n) ** 0.5)


def reach_segments(n_groups: int, n_envs=4, T=5, seed=3):
    """Segment groups as an inference rank builds them, from the real `reach` env acting
    with random actions; the policy version goes up every 2 groups, batch = version + 1."""
    import numpy as np

    from hpcvla.envs import make_env
    from hpcvla.roles.segments import SegmentBuilder, outcome_of

    env = make_env("reach", n_envs, seed, image_size=16, chunk_len=2, max_episode_chunks=4)
    spec, rng = env.spec, np.random.default_rng(seed)
    builder = SegmentBuilder(spec.obs, n_envs, spec.chunk_len, spec.action_dim, T, producer=7,
                             slot=1)
    obs, groups = env.reset(), []
    while len(groups) < n_groups:
        version = len(groups) // 2
        value = rng.normal(size=n_envs).astype(np.float32)
        if builder.full:
            groups.append(builder.finish(value))
        if builder.t == 0:
            builder.batch = version + 1
        actions = rng.uniform(-1, 1, (n_envs, spec.chunk_len, spec.action_dim)).astype(
            np.float32)
        builder.add_step(obs, actions, rng.normal(size=n_envs).astype(np.float32), value,
                         version)
        result = env.step(actions)
        builder.record_outcome(outcome_of(result))
        obs = result.obs
    env.close()
    return groups, spec


def writer(path, spec, flush_s=10.0, in_process=True, config="run: {name: test}\n",
           start_version=0, max_bytes=0):
    """A trajectory dump of producer 7 for `reach_segments`' groups (`in_process`: written
    by this process, else by a writer process, as a training run's), a start of a run of
    `config` from `start_version`, its file's most size `max_bytes` (0: none)."""
    from hpcvla.metrics.dump_writer import TrajectoryDump

    return TrajectoryDump(path, 7, list(spec.obs), spec.vocab, lambda slot: 1000 + slot,
                          "reach", spec.chunk_len, config, flush_s,
                          start_version=start_version, in_process=in_process,
                          max_bytes=max_bytes)


def reach_dump(path, n_groups=6, **start):
    """`reach_segments(n_groups)` written through `writer` to `path` (`start`: writer's
    config and start_version); the groups and spec."""
    groups, spec = reach_segments(n_groups)
    dump = writer(path, spec, **start)
    for group in groups:
        dump.add_segment(group)
    dump.close()
    return groups, spec


def libero_fixture_observation(cfg) -> tuple[dict, dict]:
    """The env's render of LIBERO's fixture observation (libero_spatial task 0, fixed state 0,
    as set: no settle steps) and the exported one (tests/fixtures/pi0/libero_obs.safetensors),
    same task asserted."""
    import numpy as np
    from safetensors import safe_open

    from hpcvla.envs import env_kwargs, make_env

    with safe_open(str(FIXTURES / "pi0" / "libero_obs.safetensors"), "np") as f:
        task = f.metadata()["task"]
        exported = {k: f.get_tensor(k) for k in f.keys()}
    env = make_env("libero", 1, seed=0, settle_steps=0, **env_kwargs(cfg.env))
    try:
        obs = env.reset(init_state_ids=np.array([0]))
        assert env.instructions()[0] == task
    finally:
        env.close()
    return obs, exported


VLA_CASES = {  # id -> (config, overrides): every VLA family and flow mode, tiny, on CPU envs
    "pi0": ("configs/reach_flow.yaml", []),
    "pi0-chain": ("configs/reach_flow.yaml", ["policy.logprob_mode=chain"]),
    "pi0-expert-only": ("configs/reach_flow.yaml", ["policy.train_expert_only=true"]),
    "pi05": ("configs/reach_flow.yaml", ["policy.variant=pi05"]),
    "tokens": ("configs/reach_tokens.yaml", []),
    "oft": ("configs/maniskill_pickcube_oft.yaml", ["policy.pretrained=", "policy.tokenizer="]),
}


def policy_batch(spec, n=3):
    """`n` random observations of the env `spec` (images, instruction ids in its vocabulary,
    states) and action chunks in [-1, 1], as tensors; the same on every call."""
    import numpy as np
    import torch
    rng = np.random.default_rng(1)
    obs = {}
    for key, (shape, dtype) in spec.obs.items():
        if dtype == "|u1":
            obs[key] = torch.from_numpy(rng.integers(0, 256, (n, *shape), dtype=np.uint8))
        elif "i" in dtype:
            obs[key] = torch.from_numpy(rng.integers(1, len(spec.vocab), (n, *shape))).int()
        else:
            obs[key] = torch.from_numpy(rng.standard_normal((n, *shape))).float()
    actions = torch.from_numpy(rng.uniform(-1, 1, (n, spec.chunk_len, spec.action_dim)))
    return obs, actions.float()


def wandb_offline_history(run_dir: Path) -> tuple[list[dict], dict]:
    """The history rows and the config of a run's W&B offline runs, read back from their
    `run-*.wandb` files with the protobuf schema wandb ships (`Record`). The files are
    LevelDB-style logs: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
    chunks (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto.wandb_internal_pb2 import Record

    rows, config = [], {}
    for path in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")):
        data, record, pos = path.read_bytes(), b"", 7
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            room = 32768 - pos % 32768
            if room < 7:  # a block's tail too short for a chunk header is padding
                pos += room
                continue
            length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            if kind == 0:
                break
            record += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                parsed = Record()
                parsed.ParseFromString(record)
                record = b""
                if parsed.HasField("history"):
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                 for i in parsed.history.item})
                for update in (parsed.config.update, parsed.run.config.update):
                    config.update({i.key: json.loads(i.value_json) for i in update})
    return rows, config


def rank_pids(run_root: Path, variable: str = "PMI_RANK") -> dict[int, int]:
    """MPI rank -> pid of the rank processes whose command line names `run_root` (mpiexec
    puts PMI_RANK in their environment, srun SLURM_PROCID)."""
    pids = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_text().split("\0") if proc.name.isdigit() else []
            if not (argv and Path(argv[0]).name.startswith("python") and "mpi4py" in argv
                    and any(str(run_root) in arg for arg in argv)):
                continue  # not a rank of this run (mpiexec, srun, the launcher, others)
            env = dict(item.split("=", 1) for item in
                       (proc / "environ").read_text().split("\0") if "=" in item)
        except OSError:
            continue
        if variable in env:
            pids[int(env[variable])] = int(proc.name)
    return pids
