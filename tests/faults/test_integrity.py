"""Data integrity: damaged ring slots never reach training (that every accepted group is
trained exactly once is tests/faults/test_exactly_once.py); checkpoints, HDF5 dumps and
records are checked when read, with errors naming the file (or field) and the problem."""

import contextlib
import faulthandler
import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcvla.checkpoint import catalog, store
from hpcvla.metrics.dump import DumpError, summarize, verify
from hpcvla.transport import records
from helpers import ROOT, fake_checkpoint, hpcvla, reach_segments, writer

FAULTS = ROOT / "tests" / "faults"


# ------------------------------------------------------------------ the trajectory ring

@pytest.mark.mpi
def test_damaged_ring_slots_are_dropped_counted_reported_never_trained():
    out = hpcvla("launch", "-n", 2, "--timeout", 90, "--", FAULTS / "integrity_world.py")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "2 of 4 segment groups damaged in the ring: dropped, counted (bad_slots 2, " \
           "lost_records 2), reported, never trained, the run ended" in out.stdout


# ------------------------------------------------------------------ HDF5 trajectory dumps

@pytest.fixture(scope="module")
def dump_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("dump") / "rank7.h5"
    groups, spec = reach_segments(4)
    dump = writer(path, spec, flush_s=0.0)
    for group in groups:
        dump.add_segment(group)
    dump.close()
    return path.read_bytes()


@pytest.mark.mpi
def test_dump_with_a_corrupted_chunk_fails_naming_file_and_dataset(tmp_path, dump_bytes):
    path = tmp_path / "rank7.h5"
    path.write_bytes(dump_bytes)
    nbytes = verify(path)
    assert nbytes > 0
    out = hpcvla("inspect", "--verify", path)  # says what it read
    assert out.returncode == 0 and f"verified: {nbytes:,} bytes read, every chunk's checksum " \
        "right" in out.stdout, out.stdout[-2000:]
    with h5py.File(path, "r") as f:
        info = f["data/demo_0/actions"].id.get_chunk_info(0)
    data = bytearray(dump_bytes)
    data[info.byte_offset + info.size // 2] ^= 0x01  # one bit of one compressed chunk
    path.write_bytes(bytes(data))
    with pytest.raises(DumpError, match=r"rank7\.h5: demo_0/actions is corrupted"):
        verify(path)
    out = hpcvla("inspect", "--verify", path)
    assert out.returncode == 2, out.stdout
    assert str(path) in out.stderr and "demo_0/actions is corrupted" in out.stderr


@pytest.mark.parametrize("fraction", [0.02, 0.3, 0.6, 0.95, 0.999])
def test_truncated_dump_fails_naming_the_file(tmp_path, dump_bytes, fraction):
    path = tmp_path / "rank7.h5"
    path.write_bytes(dump_bytes[:int(len(dump_bytes) * fraction)])
    for read in (summarize, verify):
        with pytest.raises(DumpError, match=r"rank7\.h5: "):
            read(path)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(st.data())
def test_dump_with_a_flipped_bit_reads_or_raises_dump_error(tmp_path_factory, dump_bytes, data):
    """Wherever the damage is: a DumpError naming the file, or a successful read (the bit
    was in unused space or in dense attribute storage, which HDF5 does not checksum)."""
    where = data.draw(st.integers(0, len(dump_bytes) - 1))
    bit = data.draw(st.integers(0, 7))
    damaged = bytearray(dump_bytes)
    damaged[where] ^= 1 << bit
    path = tmp_path_factory.mktemp("flip") / "rank7.h5"
    path.write_bytes(bytes(damaged))
    # A hang inside libhdf5 holds the GIL, where pytest-timeout's signal cannot act: this
    # watchdog thread ends the whole session, with the stack, after 60 s of one example.
    faulthandler.dump_traceback_later(60, exit=True)
    try:
        summarize(path)
        verify(path)
    except DumpError as err:
        assert str(path) in str(err)
    finally:
        faulthandler.cancel_dump_traceback_later()


# ------------------------------------------------------------------ checkpoints

def test_a_flipped_byte_of_an_optimizer_file_is_refused_by_its_checksum(tmp_path):
    """A resumed learner reads its optimizer partition from optimizer.rank<R>.safetensors
    only against the sha256 state.json holds for it: a byte flipped in its data (a file
    system's damage, a copy's) is named, never loaded into Adam's moments."""
    from safetensors.numpy import save_file
    path = fake_checkpoint(tmp_path / "v000002")
    opt = path / "optimizer.rank0.safetensors"
    save_file({"w/exp_avg": np.arange(64, dtype=np.float32)}, str(opt))
    entry = {"file": opt.name, "sha256": catalog.sha256(opt), "fragments": {"w": [0, 64]},
             "steps": {"w": 1}, "keys": ["exp_avg"]}
    assert np.array_equal(store._FragmentReader(path, [entry]).read("w", "exp_avg", 0, 64),
                          np.arange(64, dtype=np.float32))
    data = bytearray(opt.read_bytes())
    data[-8] ^= 0x01  # in the tensor's bytes: the file still parses
    opt.write_bytes(bytes(data))
    with pytest.raises(catalog.CheckpointError, match="checksum mismatch"):
        store._FragmentReader(path, [entry]).read("w", "exp_avg", 0, 64)


def test_damaged_checkpoint_state_is_named(tmp_path):
    ok = fake_checkpoint(tmp_path / "ok", format=1, counters={},
                         optimizer=[{"file": "optimizer.rank0.safetensors", "sha256": "0" * 64}])
    assert catalog.read_state(ok)["version"] == 2
    # format 1 (an older hpcvla): its weights load, its optimizer state is refused, named
    with pytest.raises(catalog.CheckpointError, match=r"format 1 .*policy\.checkpoint="):
        store.load_optimizer(ok, engine=None, learners=None)
    with pytest.raises(catalog.CheckpointError, match="lacks model_sha256, optimizer"):
        catalog.read_state(fake_checkpoint(tmp_path / "keys", model_sha256=None,
                                         optimizer=None))
    path = fake_checkpoint(tmp_path / "gone")
    (path / "optimizer.rank0.safetensors").unlink()
    with pytest.raises(catalog.CheckpointError,
                       match=r"optimizer\.rank0\.safetensors: missing; the checkpoint is "):
        catalog.read_state(path)
    path = fake_checkpoint(tmp_path / "binary")
    (path / "state.json").write_bytes(b"\xff\xfe{\x00garbage")
    with pytest.raises(catalog.CheckpointError, match=r"state\.json: not valid JSON"):
        catalog.read_state(path)
    for text, said in (("[1, 2]", "format 'list', none this hpcvla wrote; the file is "
                        "damaged (move this checkpoint out of"),
                       ("{}", "format None, none this hpcvla wrote; the file is damaged"),
                       (json.dumps(catalog.sealed({"format": 9})), "format 9, written by a "
                        "newer hpcvla; this one reads formats 1, 2, 3"),
                       ('{"format": 9, "sha256": "0"}', "format 9, none this hpcvla wrote; "
                        "the file is damaged")):  # its seal broken: a flipped digit
        (path / "state.json").write_text(text)
        with pytest.raises(catalog.CheckpointError, match=re.escape(f"state.json: {said}")):
            catalog.read_state(path)
    # a digit flipped in the version, a key in an optimizer entry: named, not taken
    with pytest.raises(catalog.CheckpointError, match=r"version 5 in a checkpoint named "
                       "v000004; the file is damaged"):
        catalog.read_state(fake_checkpoint(tmp_path / "run" / "checkpoints" / "v000004",
                                           version=5))
    with pytest.raises(catalog.CheckpointError, match="optimizer entries without file and "
                       "sha256"):
        catalog.read_state(fake_checkpoint(tmp_path / "entry", optimizer=[
            {"fild": "optimizer.rank0.safetensors", "sha256": "0" * 64}]))
    # state.json carries its own checksum (store writes it sealed): a flipped counter or
    # Adam step, which no other check sees, is named
    path = fake_checkpoint(tmp_path / "sealed", counters={"trained_env_steps": 2048})
    state = catalog.sealed(json.loads((path / "state.json").read_text()))
    (path / "state.json").write_text(json.dumps(state, indent=1))
    assert catalog.read_state(path)["counters"]["trained_env_steps"] == 2048
    (path / "state.json").write_text(json.dumps(state, indent=1).replace("2048", "2049"))
    with pytest.raises(catalog.CheckpointError, match=r"do not match its sha256; the file is "
                       "damaged"):
        catalog.read_state(path)
    # a byte flipped in the checksum's own key: not taken for an unsealed (older) file
    flipped = {("sha2%6" if k == "sha256" else k): v for k, v in state.items()}
    (path / "state.json").write_text(json.dumps(flipped, indent=1))
    with pytest.raises(catalog.CheckpointError, match=r"lacks its sha256 \(format 3 seals it\)"):
        catalog.read_state(path)
    older = {k: v for k, v in state.items() if k != "sha256"} | {"format": 2}
    (path / "state.json").write_text(json.dumps(older))  # an older hpcvla's format 2 may
    assert catalog.read_state(path)["counters"]["trained_env_steps"] == 2048


def test_only_checkpoint_names_are_checkpoints_and_a_run_resumes_from_its_directory(tmp_path):
    """A checkpoint moved aside (v000004.corrupt) is not one, and v1000000 sorts after
    v999999; run.resume names a run directory, not one of its checkpoints (the run would be
    written inside it)."""
    from hpcvla.checkpoint.catalog import resume_problems
    run = tmp_path / "run"
    for version in (999999, 1000000):
        fake_checkpoint(catalog.checkpoint_dir(run, version), version=version)
    fake_checkpoint(run / "checkpoints" / "v1000001.corrupt", version=1000001)
    assert [p.name for p in catalog.complete(run)] == ["v999999", "v1000000"]
    assert catalog.latest(run).name == "v1000000"
    (field, value, text), = resume_problems(str(catalog.checkpoint_dir(run, 999999)), False,
                                             ("pipeline.total_updates", 2000000))
    assert field == "run.resume" and text.startswith(f"a run directory ({run}), not one of "
                                                     "its checkpoints"), text
    assert resume_problems(str(run), False, ("pipeline.total_updates", 2000000)) == []


@pytest.mark.mpi
@pytest.mark.slow
def test_a_background_checkpoint_that_fails_stops_the_run_within_a_few_versions(tmp_path):
    """v000040 cannot be renamed into place (a file holds its name): the write fails in the
    background, and the run stops naming it within a few versions, not at the next checkpoint
    due (v000080: 40 versions of training no checkpoint would keep). ~15 s: two worlds, the
    first for a run to resume (whose name the second then knows)."""
    runs = tmp_path / "runs"
    first = hpcvla("train", "configs/default.yaml", "--ranks", 4, f"run.root={runs}",
                   "pipeline.total_updates=1", "learner.checkpoint_every=1", timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = runs.iterdir()
    (run_dir / "checkpoints" / "v000040").write_text("in the way")
    out = hpcvla("train", "configs/default.yaml", "--ranks", 4, f"run.resume={run_dir}",
                 "pipeline.total_updates=400", "learner.checkpoint_every=40", timeout=300)
    assert out.returncode != 0 and "writing checkpoint" in out.stderr and \
        "v000040 failed" in out.stderr and "(learner) on node" in out.stderr, out.stderr[-3000:]
    trained = [json.loads(line)["update"] for line in
               (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert 40 <= max(trained) < 80, max(trained)  # before the next one due


@pytest.mark.mpi
@pytest.mark.slow
def test_an_sft_checkpoint_that_fails_in_the_background_stops_it_within_a_step(tmp_path):
    """`hpcvla sft`'s as train's: v000100 cannot be renamed into place, and the fine-tuning
    stops naming it within a few steps (it went on to the next checkpoint due, v000200).
    ~25 s: two worlds, the first for a run to resume."""
    from helpers import reach_demos
    demos, runs = reach_demos(tmp_path / "demos.h5", 4), tmp_path / "runs"
    common = ["configs/default.yaml", f"sft.demos={demos}", "sft.batch_size=8", "--ranks", 2]
    first = hpcvla("sft", *common, f"run.root={runs}", "sft.steps=1", timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = runs.iterdir()
    (run_dir / "checkpoints" / "v000100").write_text("in the way")
    out = hpcvla("sft", *common, f"run.resume={run_dir}", "sft.steps=400",
                 "sft.checkpoint_every=100", timeout=300)
    assert out.returncode != 0 and "writing checkpoint" in out.stderr and \
        "v000100 failed" in out.stderr, out.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in
             (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert 100 <= max(steps) < 160, max(steps)  # well before the next one due


# ------------------------------------------------------------------ records

def sample_record():
    rng = np.random.default_rng(0)
    return {"obs.image": rng.integers(0, 255, (3, 2, 8, 8, 3), dtype=np.uint8),
            "actions": rng.standard_normal((3, 2, 4, 7)).astype(np.float32),
            "done": np.array([[False, True]] * 3), "version": np.arange(3, dtype=np.int64),
            "meta": np.array([5, 0, 17, 2, 3], np.int64)}


RECORD = records.encode(sample_record())
META_END = records.RECORD_HEADER.itemsize + records.FIELD_ENTRY.itemsize * 5


@settings(max_examples=1000, deadline=None)
@given(st.integers(0, META_END - 1), st.integers(1, 255))
def test_any_damaged_metadata_byte_is_refused(where, xor):
    """Header and field table are checksummed: damage there is a RecordError, never arrays
    with wrong shapes, dtypes or offsets."""
    damaged = RECORD.copy()
    damaged[where] ^= xor
    with pytest.raises(records.RecordError):
        records.decode(damaged)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=2 * RECORD.nbytes))
def test_random_bytes_are_refused(noise):
    """Arbitrary bytes (or a record's bytes cut short) never decode."""
    for buf in (np.frombuffer(noise, np.uint8), RECORD[:len(noise) % RECORD.nbytes]):
        with pytest.raises(records.RecordError):
            records.decode(buf)


@contextlib.contextmanager
def run_held_elsewhere(run_dir, hold_s: int = 60):
    """Another process holding `run_dir`'s lock (checkpoint/catalog.hold_run), as another
    world's rank 0 does, until the block ends (killed then); yields it once it holds it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom hpcvla.checkpoint.catalog import hold_run\n"
         f"hold_run({str(run_dir)!r})\nprint('held', flush=True)\ntime.sleep({hold_s})"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_one_world_at_a_time_writes_a_run(tmp_path):
    """Rank 0 holds RUN_DIR/.lock for its world's life: a second claim (another world
    resuming the same run) is refused once its wait is over, naming the run; the kernel
    releases the lock however the holder ends (here: the holding process exits). The claim
    removes the .partial checkpoints an ended world left (they were never removed, tens of
    GB each at full size)."""
    import socket
    partial = tmp_path / "checkpoints" / "v000009.partial"
    partial.mkdir(parents=True)
    (partial / "optimizer.rank0.safetensors").write_bytes(b"x" * 100)
    with run_held_elsewhere(tmp_path) as holder:
        assert not partial.exists()
        with pytest.raises(catalog.CheckpointError, match=f"{tmp_path} is in use: another "
                           rf"world's rank 0 holds its .lock \(pid {holder.pid} on "
                           rf"{socket.gethostname()}, since .*Z; two worlds.*`mv "
                           rf"{tmp_path}/.lock {tmp_path}/.lock.stale` and start again"):
            catalog.hold_run(tmp_path, wait_s=1.5)
    catalog.hold_run(tmp_path)  # released with its holder
    assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} on ")  # one record
    assert (tmp_path / ".lock").read_text().count("\n") == 1


def test_a_run_another_world_holds_is_every_ranks_verdict_not_a_failure(tmp_path):
    """A world that cannot claim its run (another job's world holds it) ends as a refusal,
    Refused on every rank (exit 2, which jobs/launch.sh does not restart: as a failure, its
    restarts recorded themselves in the other job's run), not a rank's error (exit 1)."""
    from mpi4py import MPI
    from hpcvla.job.runtime import claim_run
    from hpcvla.process.deathwatch import Refused
    with run_held_elsewhere(tmp_path) as holder:
        with pytest.raises(Refused, match=f"{tmp_path} is in use: another world's rank 0 "
                           rf"holds its .lock \(pid {holder.pid} on "):
            claim_run(MPI.COMM_SELF, tmp_path, wait_s=1.0)
    claim_run(MPI.COMM_SELF, tmp_path)  # released with its holder: this world's now
    assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} on ")


def test_a_run_this_jobs_earlier_world_still_holds_is_a_failure_not_a_verdict(tmp_path,
                                                                              monkeypatch):
    """A restart whose run's lock is still held by this same job's earlier world (its rank
    0's node died; NFSv3 and Lustre keep a dead node's lock) fails as a restart does (the job's
    restart rules decide), rather than refusing as if another job held the run."""
    from mpi4py import MPI
    from hpcvla.checkpoint.catalog import RunInUse
    from hpcvla.job.runtime import claim_run
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with run_held_elsewhere(tmp_path):  # (the job's id in its environment: inherited)
        record = (tmp_path / ".lock").read_text()
        assert ", job 4242" in record
        with pytest.raises(RunInUse, match=f"{tmp_path} is in use"):
            claim_run(MPI.COMM_SELF, tmp_path, wait_s=1.0)
    assert RunInUse("", holder=record).by_this_job()
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # another job, its id a prefix of the holder's
    assert not RunInUse("", holder=record).by_this_job()


def test_a_run_on_a_file_system_without_locks_is_said_unclaimed(tmp_path, monkeypatch, capsys):
    """flock failing (Lustre without -o flock): the run cannot be claimed; it says so and
    leaves the unfinished checkpoints, which another world may be writing, until it publishes
    a newer one: then those of older versions go (a job killed in each stop's checkpoint
    left one, tens of GB at full size, that nothing removed)."""
    import fcntl

    def no_locks(*_):
        raise OSError(38, "Function not implemented")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    partial = tmp_path / "checkpoints" / "v000009.partial"
    partial.mkdir(parents=True)
    catalog.hold_run(tmp_path)
    assert partial.exists()
    said = capsys.readouterr().err
    assert "takes no locks" in said and "stay until this one publishes a newer checkpoint " \
        "(another world may be writing them): v000009.partial" in said, said
    from hpcvla.checkpoint.store import _publish
    newer = tmp_path / "checkpoints" / "v000012.partial"  # (only a second world's, here)
    newer.mkdir()
    (tmp_path / "checkpoints" / "v000003-copy.partial").mkdir()  # a user's: not a version
    mine = tmp_path / "checkpoints" / "v000010.partial"  # this world's, its files written
    mine.mkdir()
    (mine / "optimizer.rank0.json").write_text("{}")
    _publish(mine, tmp_path / "checkpoints" / "v000010", {"version": 10}, learners=1, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "v000003-copy.partial", "v000010", "v000012.partial"]
    catalog.remove(tmp_path / "gone already")  # (another's removal came first): nothing said
    assert "could not be deleted" not in capsys.readouterr().err


@pytest.mark.cluster  # root: a mount namespace of its own
def test_a_checkpoint_that_cannot_be_deleted_whole_is_said(tmp_path):
    """A checkpoint no longer kept that cannot be deleted whole (here a mount point in it:
    EBUSY; on a cluster a file another user wrote, NFS's `.nfs*` of an open file) is named:
    what is left has no state.json, is never tried again, and held its space unseen."""
    import subprocess
    import sys
    stuck = tmp_path / "checkpoints" / "v000002"
    (stuck / "busy").mkdir(parents=True)
    (stuck / "model.safetensors").write_bytes(b"x")
    out = subprocess.run(
        ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs "$1" && exec "$2" -c '
         '"from hpcvla.checkpoint.catalog import remove; import sys; remove(sys.argv[1])" "$3"',
         "sh", stuck / "busy", sys.executable, stuck], capture_output=True, text=True,
        timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"[hpcvla] {stuck} could not be deleted whole ({stuck / 'busy'}: [Errno 16] " \
        "Device or resource busy" in out.stderr, out.stderr
    assert "delete it yourself" in out.stderr and not (stuck / "model.safetensors").exists()


@pytest.mark.mpi
@pytest.mark.slow
def test_a_world_that_waited_for_the_run_resumes_every_rank_from_the_same_checkpoint(tmp_path):
    """A resumed world whose rank 0 waits for another world's lock (one still writing its
    last checkpoint) resumes from what that world left: every rank from the newest checkpoint
    rank 0 sees once it holds the run, none from what was newest before (two ranks of
    different versions deadlocked in their first checkpoint)."""
    import shutil
    import subprocess
    import sys
    import time
    out = hpcvla("train", "configs/colocated.yaml", "--ranks", 2, f"run.root={tmp_path}",
                 "pipeline.total_updates=4", "learner.checkpoint_every=2")
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    newest = run / "checkpoints" / "v000004"
    shutil.move(newest, tmp_path / "held")  # the other world's last, not written yet
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom hpcvla.checkpoint.catalog import hold_run\n"
         f"hold_run({str(run)!r})\nprint('held', flush=True)\ntime.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    resumed = None
    try:
        assert holder.stdout.readline().strip() == "held"
        resumed = subprocess.Popen(
            [sys.executable, "-m", "hpcvla", "train", f"run.resume={run}", "--ranks", "2",
             "pipeline.total_updates=6", "pipeline.stall_timeout_s=30"], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        head = []
        for line in resumed.stdout:  # rank 0 waits for the lock; the others are started
            head.append(line)
            if "waiting up to" in line:
                break
        time.sleep(3)
        shutil.move(tmp_path / "held", newest)  # the other world ends: its checkpoint is in
        holder.kill()
        text = "".join(head) + resumed.communicate(timeout=240)[0]
    finally:
        holder.kill()
        if resumed is not None:
            resumed.kill()
    assert resumed.returncode == 0, text[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert {r["first_version"] for r in summary["per_rank"]} == {4}, summary["per_rank"]
