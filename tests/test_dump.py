"""HDF5 trajectory dumps (metrics/dump.py): episodes cut from real segments, read back with
plain h5py; readable during a run and after a crash; clear errors for bad files; a training
run's dumps hold what its learner trained."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import h5py
import numpy as np
import pytest

from hpcvla.metrics.dump import DumpError, attr_text, describe, summarize
from hpcvla.transport.segment_meta import SegmentMeta
from helpers import TESTS, hpcvla, reach_dump, reach_segments, writer


def test_dump_holds_every_finished_episode_of_every_env(tmp_path):
    groups, spec = reach_dump(tmp_path / "d.h5")
    # The expected episodes, from the segments alone: each env's steps end to end, cut
    # after every done.
    expected = {}
    for env in range(4):
        steps = {k: np.concatenate([g[k][:, env] for g in groups])
                 for k in ("obs.image", "obs.instruction", "actions", "reward", "done")}
        steps["version"] = np.concatenate([g["version"] for g in groups])
        steps["batch"] = np.concatenate([np.full(5, SegmentMeta.of(g).batch) for g in groups])
        ends = np.flatnonzero(steps["done"]) + 1
        expected[env] = [{k: v[a:b] for k, v in steps.items()}
                         for a, b in zip([0, *ends[:-1]], ends)]
    with h5py.File(tmp_path / "d.h5", "r") as f:
        assert f.attrs["complete"] and f.attrs["segments"] == 6
        demos = [f["data"][f"demo_{i}"] for i in range(len(f["data"]))]
        assert len(demos) == sum(len(e) for e in expected.values()) > 4
        assert f["data"].attrs["total"] == sum(d.attrs["num_samples"] for d in demos)
        open_steps = sum(30 - sum(len(e["reward"]) for e in episodes)
                         for episodes in expected.values())
        assert f.attrs["open_episode_steps"] == open_steps
        assert json.loads(f["data"].attrs["env_args"])["env_name"] == "reach"
        # text is stored inline (fixed length), never in the global heap (metrics/dump.py)
        types = [o.attrs.get_id(k).get_type() for o in (f, f["data"], *demos) for k in o.attrs]
        texts = [t for t in types if t.get_class() == h5py.h5t.STRING]
        assert len(texts) == 5 + 2 * len(demos)  # format source env config env_args; env_id
        # and instruction of each demo
        assert not any(t.is_variable_str() for t in texts)
        judged = [(int(d.attrs["policy_version"]), bool(d.attrs["success"])) for d in demos]
        for demo in demos:
            want = expected[demo.attrs["env_index"]][demo.attrs["episode"]]
            assert attr_text(demo.attrs["env_id"]) == f"p7/s1/e{demo.attrs['env_index']}"
            assert demo.attrs["seed"] == 1001 and demo.attrs["policy_version"] == \
                want["version"][0]
            np.testing.assert_array_equal(demo["obs/image"][()], want["obs.image"])
            np.testing.assert_array_equal(demo["actions"][()], want["actions"])
            np.testing.assert_array_equal(demo["rewards"][()], want["reward"])
            np.testing.assert_array_equal(demo["dones"][()], want["done"].astype(np.uint8))
            np.testing.assert_array_equal(demo["policy_versions"][()], want["version"])
            np.testing.assert_array_equal(demo["staleness"][()],
                                          want["batch"] - want["version"])
            words = attr_text(demo.attrs["instruction"]).split()
            assert words[:2] == ["reach", "the"] and words[3] == "object"
            assert demo["obs/image"].compression == "gzip" and demo["obs/image"].chunks
            assert demo.attrs["return"] == pytest.approx(float(want["reward"].sum()), abs=1e-4)
    # inspect's success by policy version: every episode in the range of its version
    bins = summarize(tmp_path / "d.h5")["by_version"]
    assert sum(b["episodes"] for b in bins) == len(judged) and len(bins) > 1
    for b in bins:
        inside = [ok for v, ok in judged if b["versions"][0] <= v <= b["versions"][1]]
        assert (b["episodes"], b["success_rate"]) == (len(inside), np.mean(inside))


def test_an_envs_episode_metrics_are_each_episodes_attributes(tmp_path):
    """A segment's episode metric fields (`metric.<name>`: EnvSpec.episode_metrics) become
    each dumped episode's `episode_<name>` attribute, its value where the episode ended."""
    groups, spec = reach_segments(4)
    for i, group in enumerate(groups):
        group["metric.grasped"] = np.where(group["done"], i + 0.5, 0.0).astype(np.float32)
    dump = writer(tmp_path / "m.h5", spec)
    for group in groups:
        dump.add_segment(group)
    dump.close()
    with h5py.File(tmp_path / "m.h5", "r") as f:
        demos = [f["data"][f"demo_{i}"] for i in range(len(f["data"]))]
        assert demos and all(d.attrs["episode_grasped"] in (0.5, 1.5, 2.5, 3.5) for d in demos)
        assert not any(k.startswith("metric") for d in demos for k in d)  # no step dataset
        values = [d.attrs["episode_grasped"] for d in demos if not d.attrs["env_fault"]]
    shown = summarize(tmp_path / "m.h5")  # `hpcvla inspect`: their mean
    assert len(set(values)) > 1 and shown["episode_grasped"] == pytest.approx(np.mean(values))
    assert f"| grasped {np.mean(values):.3f} (env faults" in describe(shown)


WRITER = """
import sys, time
sys.path.insert(0, {tests!r})
from helpers import reach_segments, writer
groups, spec = reach_segments(8)
dump = writer({path!r}, spec, flush_s=0.0)
for group in groups[:4]:
    dump.add_segment(group)          # flushes after every segment (flush_s=0)
print("flushed", dump.file.written, flush=True)
dump.flush_s = 1e9                   # the rest stays in memory: lost in the crash
for group in groups[4:]:
    dump.add_segment(group)
time.sleep(600)
"""


def test_dump_readable_during_the_run_and_after_a_crash(tmp_path):
    path = tmp_path / "rank7.h5"
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(tests=str(TESTS),
                                                                 path=str(path))],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("flushed"), line
        written = int(line.split()[1])
        time.sleep(0.5)
        with h5py.File(path, "r") as f:  # while the writer lives
            assert len(f["data"]) == written > 0 and not f.attrs["complete"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    summary = summarize(path)  # after the crash: everything up to the last flush
    assert summary["episodes"] == written and summary["complete"] is False
    assert "the run died" in describe(summary)


STAGER = """
import sys, time
sys.path.insert(0, {tests!r})
from helpers import reach_segments, writer
groups, spec = reach_segments(8)
dump = writer({path!r}, spec, flush_s=0.0)
for group in groups[:4]:
    dump.add_segment(group)
print("flushed", dump.file.written, flush=True)
dump.flush_s = 1e9
for group in groups[4:]:
    dump.add_segment(group)
import hpcvla.metrics.dump_file as w
compress = w._dataset
def slow(*args, **kwargs):           # a flush that compresses for seconds, as a writer behind
    time.sleep(0.5)                  # its rank does
    compress(*args, **kwargs)
w._dataset = slow
dump.flush()
"""


def test_a_writer_killed_while_it_compresses_a_flush_leaves_the_dump_readable(tmp_path):
    """A flush compresses into a staging file and opens the dump only to copy the episodes
    in: SIGKILL in the middle of the compression leaves the dump as the last flush left it,
    not marked open for write (the whole dump unreadable, as it was when a flush wrote into
    the dump itself); the next writer drops the staging file."""
    path = tmp_path / "rank7.h5"
    staging = path.with_name(path.name + ".staging")
    proc = subprocess.Popen([sys.executable, "-c", STAGER.format(tests=str(TESTS),
                                                                 path=str(path))],
                            stdout=subprocess.PIPE, text=True)
    try:
        written = int(proc.stdout.readline().split()[1])
        deadline = time.monotonic() + 60
        while not staging.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(1.0)  # in the middle of the staged flush
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    summary = summarize(path)
    assert summary["episodes"] == written > 0 and summary["complete"] is False
    from hpcvla.metrics.dump_file import DumpFile
    with h5py.File(path, "r") as f:
        args = (7, "run", "reach", int(f.attrs["chunk_len"]), "")
    DumpFile(path, *args)  # a resumed run's writer: appends to the dump, drops the staging
    assert not staging.exists() and summarize(path)["episodes"] == written


HOLDER = """
import sys, h5py
with h5py.File(sys.argv[1], "r"):  # h5py's default: HDF5's file lock, until told
    print("holding", flush=True)
    sys.stdin.read()
"""


def test_a_reader_holding_the_lock_never_holds_the_writer_up(tmp_path):
    """A reader that opens the dump with HDF5's lock (h5py's default, a notebook's) and keeps
    it: the writer appends beside it all the same (it takes no lock: the run's .lock keeps a
    second writer out). Before, it kept its episodes while the lock was held and, the lock
    held at the end of the run, failed the run and lost them all."""
    path = tmp_path / "rank7.h5"
    groups, spec = reach_segments(6)
    dump = writer(path, spec, flush_s=1e9)
    for group in groups[:3]:
        dump.add_segment(group)
    dump.flush()
    held = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().startswith("holding")
        before = dump.file.written
        for group in groups[3:]:
            dump.add_segment(group)
        dump.flush()
        assert not dump.file.pending and dump.file.written > before
        dump.close()  # while it still holds the lock
        assert held.poll() is None, "the reader let go before the writer closed"
        summary = summarize(path)
        assert summary["complete"] and summary["episodes"] == dump.file.written
        resumed = writer(path, spec)  # a resumed run's writer appends beside it too
        assert resumed.file.written == summary["episodes"]
        assert not summarize(path)["complete"]  # being written again
    finally:
        held.communicate(timeout=30)


def test_a_writer_appends_every_max_pending_episodes_between_flushes(tmp_path, monkeypatch):
    """A run producing episodes faster than its writer compresses them: the writer appends
    each MAX_PENDING of them without waiting for the flush interval, so the rank waits for it
    as it goes and its stop for at most that many. Before, a flush interval's episodes piled
    up (the README's job with dumps: 119 s of backlog after its last checkpoint, now 4 s)."""
    import hpcvla.metrics.dump_file as dump_file
    monkeypatch.setattr(dump_file, "MAX_PENDING", 5)
    groups, spec = reach_segments(6)
    dump = writer(tmp_path / "rank7.h5", spec, flush_s=1e9)
    for group in groups:
        dump.add_segment(group)
    handed = sum(dump.episodes.values())
    assert handed >= 10 and len(dump.file.pending) < 5
    assert summarize(tmp_path / "rank7.h5")["episodes"] == dump.file.written == \
        handed - len(dump.file.pending)
    dump.close()
    assert summarize(tmp_path / "rank7.h5")["episodes"] == handed


def test_a_dump_at_its_share_of_dump_max_gib_takes_no_more_episodes(tmp_path, capfd):
    """run.dump_max_gib: a file that a flush left at its most size or past it takes no more
    episodes (said once, by the writer process of a training run), counts the finished ones
    it did not write and still closes complete; a resumed start finds it full; one under a
    larger share (0: none) writes on."""
    path, groups, spec = tmp_path / "rank7.h5", *reach_segments(12)
    size = lambda: path.stat().st_size  # noqa: E731
    writer(path, spec).close()  # a first start, with no most size
    # its share: room for its start's record (~0.2 KB), not for a flush's episodes (~150 KB)
    share = size() + 20_000
    dump = writer(path, spec, flush_s=1e9, in_process=False, max_bytes=share)
    for group in groups[:6]:
        dump.add_segment(group)
    dump.flush()  # past the share now: these episodes are in, no later one
    for group in groups[6:]:
        dump.add_segment(group)
    dump.close()
    handed = sum(dump.episodes.values())
    said = capfd.readouterr().err
    assert said.count(f"its share of run.dump_max_gib ({share / 2**30:.3g} GiB a producer): "
                      "the episodes after its ") == 1, said
    s = summarize(path)
    assert s["complete"] and 0 < s["episodes"] < handed and s["segments"] == 12
    assert s["episodes"] + s["episodes_not_written"] == handed, s
    assert f"{s['episodes_not_written']} finished episodes not written" in describe(s)
    full = writer(path, spec, max_bytes=size() + 1)  # resumed: full from its start
    full.add_segment(groups[0])
    full.close()
    assert summarize(path)["episodes"] == s["episodes"] and "the episodes after its " \
        f"{s['episodes']} are not written" in capfd.readouterr().err
    more = writer(path, spec)  # resumed with no most size: it writes on, its count kept
    for group in groups[:6]:
        more.add_segment(group)
    more.close()
    after = summarize(path)
    assert after["episodes"] > s["episodes"] and \
        after["episodes_not_written"] == s["episodes_not_written"] + sum(full.episodes.values())


def test_each_start_of_a_run_is_told_apart_with_its_config(tmp_path):
    """Two starts resumed from one checkpoint (the first died between checkpoints) share a
    start_version and their envs' episode numbers: each episode names its start, so `(start,
    env_id, episode)` is unique; each start records its config (a resume may change any
    setting) and its steps of episodes open at its close."""
    path = tmp_path / "rank7.h5"
    for start, config in enumerate(("env: {max_episode_chunks: 20}\n",) * 2 +
                                   ("env: {max_episode_chunks: 10}\n",)):
        reach_dump(path, 3, config=config, start_version=0 if start < 2 else 5)
    with h5py.File(path, "r") as f:
        starts = f["starts"]
        assert sorted(starts) == ["0", "1", "2"]
        assert [attr_text(starts[n].attrs["config"]) for n in "012"] == [
            "env: {max_episode_chunks: 20}\n"] * 2 + ["env: {max_episode_chunks: 10}\n"]
        opened = [int(starts[n].attrs["open_episode_steps"]) for n in "012"]
        assert opened[0] > 0 and int(f.attrs["open_episode_steps"]) == sum(opened)
        keys = [(int(d.attrs["start"]), attr_text(d.attrs["env_id"]), int(d.attrs["episode"]))
                for d in f["data"].values()]
        by_version = [(int(d.attrs["start_version"]), attr_text(d.attrs["env_id"]),
                       int(d.attrs["episode"])) for d in f["data"].values()]
    assert len(set(keys)) == len(keys) and {k[0] for k in keys} == {0, 1, 2}
    assert len(set(by_version)) < len(by_version)  # the key the docs gave before


def test_a_dump_from_before_starts_is_resumed_again_and_again(tmp_path):
    """A file an older hpcvla wrote (no starts/, no episode `start`): its first resume records
    its one start as starts/0 from the root's config and open steps, then its own; a second
    resume its own again (it failed creating starts/1 twice)."""
    path = tmp_path / "rank7.h5"
    reach_dump(path)
    with h5py.File(path, "a") as f:
        old_open = int(f["starts/0"].attrs["open_episode_steps"])
        del f["starts"]
        for demo in f["data"].values():
            del demo.attrs["start"]
    for _ in range(2):
        reach_dump(path, 2)
    with h5py.File(path, "r") as f:
        starts = f["starts"]
        assert sorted(starts) == ["0", "1", "2"]
        assert attr_text(starts["0"].attrs["config"]) == attr_text(f.attrs["config"])
        assert int(starts["0"].attrs["open_episode_steps"]) == old_open > 0
        assert int(f.attrs["open_episode_steps"]) == sum(
            int(s.attrs["open_episode_steps"]) for s in starts.values())
        assert {int(d.attrs.get("start", 0)) for d in f["data"].values()} == {0, 1, 2}
    assert summarize(path)["starts"] == 3


def test_a_resumed_run_moves_an_unreadable_dump_aside_and_goes_on(tmp_path, capfd):
    """A dump left unreadable (here: its bytes cut, as a process killed mid-append leaves one
    refused) does not stop the resumed run: it is moved aside, named, and a new one begun;
    each episode says which start wrote it (start_version)."""
    path = tmp_path / "rank7.h5"
    reach_dump(path)
    path.write_bytes(path.read_bytes()[:2000])
    groups, spec = reach_segments(2)
    from hpcvla.metrics.dump_writer import TrajectoryDump
    dump = TrajectoryDump(path, 7, list(spec.obs), spec.vocab, lambda slot: 1000 + slot,
                          "reach", spec.chunk_len, start_version=5)
    assert "moved aside" in capfd.readouterr().err
    assert (tmp_path / "rank7.h5.unreadable").stat().st_size == 2000
    for group in groups:
        dump.add_segment(group)
    dump.close()
    with h5py.File(path, "r") as f:
        assert len(f["data"]) > 0 and all(demo.attrs["start_version"] == 5
                                          for demo in f["data"].values())


def _contents(path) -> dict:
    """Every attribute and dataset of an HDF5 file, by name; but the wall-clock time each
    start began (starts/<n>.attrs[began]), which two writers never share."""
    with h5py.File(path, "r") as f:
        found = {"/": dict(f.attrs)}
        f.visititems(lambda name, item: found.__setitem__(name, item[()] if hasattr(
            item, "shape") else {k: v for k, v in item.attrs.items() if k != "began"}))
    return found


def test_a_writer_process_writes_what_this_process_would(tmp_path):
    """A training run's dump is written by a helper process of its producer rank (gzip holds
    the GIL: the rank's time is its steps'): the same file as one this process writes from
    the same segments; it ignores a stop signal (its rank's to handle); a resumed dump goes
    on with its count of segments."""
    groups, spec = reach_segments(6)
    paths = {mode: tmp_path / f"{mode}.h5" for mode in ("inline", "process")}
    for mode, path in paths.items():
        dump = writer(path, spec, flush_s=0.0, in_process=mode == "inline")
        for group in groups:
            dump.add_segment(group)
            if mode == "process" and group is groups[2]:
                os.kill(dump.file._proc.pid, signal.SIGTERM)
        dump.close()
    inline, process = _contents(paths["inline"]), _contents(paths["process"])
    assert inline.keys() == process.keys() and len(inline) > 20
    for name, value in inline.items():
        if isinstance(value, dict):
            assert value == process[name], name
        else:
            np.testing.assert_array_equal(value, process[name], err_msg=name)
    assert writer(paths["process"], spec, in_process=False).segments == len(groups)


def test_a_writer_process_that_fails_or_dies_fails_its_producer_naming_the_file(tmp_path):
    """No run goes on without the dump it asked for: the writer's error, or its death, is the
    producer's DumpError at its next dump call, naming the file, the rank and why."""
    groups, spec = reach_segments(4)
    (tmp_path / "a file").write_text("")
    with pytest.raises(DumpError, match=r"rank7.h5: producer rank 7: FileExistsError"):
        writer(tmp_path / "a file" / "rank7.h5", spec, in_process=False)
    dump = writer(tmp_path / "rank7.h5", spec, flush_s=0.0, in_process=False)
    dump.add_segment(groups[0])
    os.kill(dump.file._proc.pid, signal.SIGKILL)
    with pytest.raises(DumpError, match=r"rank7.h5: producer rank 7: the dump writer died "
                                        r"\(killed by SIGKILL\)"):
        for group in groups[1:]:
            dump.add_segment(group)
        dump.close()


def test_a_producer_held_up_by_its_stopped_dump_writer_says_so(tmp_path, capfd):
    """A writer that takes nothing in (stopped here; a hung file system alike) holds its
    producer once the queue is full: the producer says so, naming the writer and the file,
    each remind_s, and goes on when the writer does."""
    groups, spec = reach_segments(40)
    dump = writer(tmp_path / "rank7.h5", spec, flush_s=0.0, in_process=False)
    dump.file.queue_bytes, dump.file.remind_s = 1, 0.5
    os.kill(dump.file._proc.pid, signal.SIGSTOP)
    threading.Timer(3.0, os.kill, (dump.file._proc.pid, signal.SIGCONT)).start()
    for group in groups:
        dump.add_segment(group)
    dump.close()
    said = capfd.readouterr().err
    assert re.search(rf"hpcvla: producer rank 7 has waited \d+ s for its dump writer \(pid "
                     rf"{dump.file._proc.pid}\) to take in \d+ MB queued for "
                     rf"{re.escape(str(tmp_path / 'rank7.h5'))}", said), said[-2000:]
    assert summarize(tmp_path / "rank7.h5")["segments"] == len(groups)


def test_a_producer_closing_its_stopped_dump_writer_says_so(tmp_path, capfd):
    """The writer stopped (a hung file system alike) when its producer closes the file at the
    run's end: the producer says so each remind_s, naming the writer and the file (it waited
    without a word, and so did the world's teardown), and the file ends whole once it goes."""
    groups, spec = reach_segments(4)
    dump = writer(tmp_path / "rank7.h5", spec, flush_s=0.0, in_process=False)
    for group in groups:
        dump.add_segment(group)
    dump.file.remind_s = 0.5
    os.kill(dump.file._proc.pid, signal.SIGSTOP)
    threading.Timer(2.0, os.kill, (dump.file._proc.pid, signal.SIGCONT)).start()
    dump.close()
    said = capfd.readouterr().err
    assert re.search(rf"hpcvla: producer rank 7 has waited \d+ s for its dump writer \(pid "
                     rf"{dump.file._proc.pid}\) (to take in the rest of|to open or finish) "
                     rf"{re.escape(str(tmp_path / 'rank7.h5'))}", said), said[-2000:]
    assert summarize(tmp_path / "rank7.h5")["segments"] == len(groups)


def test_a_writer_that_fails_while_the_producer_sends_names_its_error(tmp_path):
    """The writer's flush fails (a folder holds its staging file's name) while the producer
    is still sending it episodes: the producer's error is the writer's, not 'died'."""
    groups, spec = reach_segments(6)
    dump = writer(tmp_path / "rank7.h5", spec, flush_s=0.0, in_process=False)
    (tmp_path / "rank7.h5.staging").mkdir()
    with pytest.raises(DumpError, match=r"rank7.h5: producer rank 7: (OSError|IsADirectory)"):
        for _ in range(50):
            for group in groups:
                dump.add_segment(group)
        dump.close()


def test_a_sender_that_fails_other_than_by_os_error_is_said_not_waited_for(tmp_path):
    """Pickling an episode for the writer may fail (MemoryError, at a few hundred MB of
    images): the producer's next call or its close names it; the close waited forever for an
    answer to a message never sent, and the world hung in its teardown."""
    groups, spec = reach_segments(6)
    dump = writer(tmp_path / "rank7.h5", spec, flush_s=0.0, in_process=False)

    class Unpicklable:  # the writer's pipe, which cannot pickle an episode
        def __init__(self, conn):
            self.conn = conn

        def send(self, message):
            if message[0] == "episode":
                raise MemoryError("pickling an episode")
            self.conn.send(message)

        def __getattr__(self, name):
            return getattr(self.conn, name)

    dump.file._conn = Unpicklable(dump.file._conn)
    raised = []

    def produce():
        try:
            for _ in range(50):
                for group in groups:
                    dump.add_segment(group)
            dump.close()
        except DumpError as err:
            raised.append(str(err))
    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    producer.join(60)
    assert not producer.is_alive(), "the producer waits for a sender that died"
    assert raised and "producer rank 7: sending to its writer: MemoryError" in raised[0], raised
    dump.file._proc.kill()  # a rank that raised ends, and its writer with it (PDEATHSIG)
    dump.file._proc.wait()


@pytest.mark.mpi
def test_bad_files_give_clear_errors(tmp_path):
    groups, spec = reach_segments(4)
    good = tmp_path / "good.h5"
    dump = writer(good, spec, flush_s=0.0)
    for group in groups:
        dump.add_segment(group)
    dump.close()
    assert summarize(good)["episodes"] > 0
    with pytest.raises(DumpError, match="no such file"):
        summarize(tmp_path / "missing.h5")
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(good.read_bytes()[:os.path.getsize(good) // 3])
    with pytest.raises(DumpError, match="not a readable HDF5 file"):
        summarize(truncated)
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(DumpError, match="not an hpcvla trajectory dump"):
        summarize(foreign)
    with h5py.File(good, "a") as f:
        del f["data/demo_0/actions"]
    with pytest.raises(DumpError, match="demo_0 lacks actions"):
        summarize(good)
    out = hpcvla("inspect", truncated)
    assert out.returncode == 2 and "not a readable HDF5 file" in out.stderr


def test_inspect_summarises_every_readable_file_and_names_the_rest(tmp_path, capsys):
    """A run directory with one producer's dump killed mid-write and another's good, and
    the files a resumed run and a killed writer set aside: the good file is summarised, the
    bad one named with why (exit 2), the set-aside ones named. Before, the first bad file
    ended the command and hid the good ones."""
    import argparse
    from hpcvla.metrics.command import inspect_command
    trajectories = tmp_path / "trajectories"
    trajectories.mkdir()
    reach_dump(trajectories / "rank2.h5")
    bad = trajectories / "rank0.h5"
    bad.write_bytes((trajectories / "rank2.h5").read_bytes()[:3000])
    (trajectories / "rank0.h5.unreadable").write_bytes(b"x")
    (trajectories / "rank0.h5.staging").write_bytes(b"x")
    args = argparse.Namespace(paths=[str(tmp_path)], json=False, video=0, verify=False)
    assert inspect_command(args) == 2
    out, err = capsys.readouterr()
    assert "rank2.h5: hpcvla trajectory dump" in out and "rank0.h5: hpcvla" not in out
    assert "rank0.h5" in err and "not a readable HDF5 file" in err
    assert "rank0.h5.unreadable set aside" in err and "rank0.h5.staging set aside" in err


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("config,ranks", [("configs/default.yaml", 4),
                                          ("configs/colocated.yaml", 2)])
def test_training_run_dump_matches_what_the_learner_trained(tmp_path, config, ranks):
    out = hpcvla("train", config, "--ranks", ranks, f"run.root={tmp_path}",
                 "run.dump_trajectories=true", "run.dump_flush_s=0.5",
                 "pipeline.total_updates=3", timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    files = sorted((run_dir / "trajectories").glob("rank*.h5"))
    producers = [r for r in summary["per_rank"] if r["role"] in ("inference",
                                                                 "simulator+inference+learner")]
    assert [f.name for f in files] == [f"rank{r['rank']}.h5" for r in producers]
    # The success rate and mean return are over the episodes that ended in the segments the
    # learners trained: batches 0..2 (segments tagged for later batches were not used), every
    # learner's pooled (each one's window covers all it trained here).
    trained, per_file = [], []
    for path in files:
        with h5py.File(path, "r") as f:
            assert f.attrs["complete"]
            mine = []
            for demo in f["data"].values():
                batch = int(demo["staleness"][-1] + demo["policy_versions"][-1])
                if batch < 3:
                    mine.append((demo.attrs["success"], demo.attrs["return"]))
                if ranks == 2:
                    assert demo.attrs["staleness"] == 0
            trained += mine
            per_file.append(mine)
    assert summary["success_rate"] == pytest.approx(np.mean([s for s, _ in trained]))
    assert summary["mean_return"] == pytest.approx(np.mean([r for _, r in trained]))
    if ranks == 2:  # colocated: each rank trained on the episodes it dumped, two learners
        for rank, mine in zip(summary["per_rank"], per_file):
            assert rank["success_rate"] == pytest.approx(np.mean([s for s, _ in mine]))
            assert rank["ended_episodes"] == len(mine)
    if ranks == 4:
        (learner,) = [r for r in summary["per_rank"] if r["role"] == "learner"]
        with h5py.File(files[0], "r") as f:  # every segment group the learner received
            assert f.attrs["segments"] == learner["ring"]["records"]
        # the dump writer's backlog comes after the work: in wall_s, not in the throughput
        phase = producers[0]["phases_s"]
        assert phase["all_ranks_ready"] < phase["dump_written"] <= phase["finished"]
    assert 0 < summary["active_s"] <= summary["wall_s"]
    assert summary["env_steps_per_s"] == pytest.approx(summary["env_steps"] / summary["active_s"])
    inspect = hpcvla("inspect", run_dir)
    assert inspect.returncode == 0 and "hpcvla trajectory dump" in inspect.stdout
    assert "obs/image" in inspect.stdout and "complete" in inspect.stdout


@pytest.mark.slow
@pytest.mark.bench
def test_dump_benchmark_measures_the_three_ways_side_by_side(tmp_path):
    """CI's short run of `hpcvla bench dump`: the producer with no dump, with the dump written
    in its own process and by a writer process; the ratios are those of the measured rates."""
    out = hpcvla("bench", "dump", "--quick", "--json", tmp_path / "dump.json", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads((tmp_path / "dump.json").read_text())
    assert (r["groups"], r["rounds"]) == (24, 1) and "by a process / in its own" in out.stdout
    assert r["inline"]["file_mb"] == r["process"]["file_mb"] > 0 == r["none"]["file_mb"]
    assert r["producer_rate_process_to_inline"] == pytest.approx(
        r["process"]["groups_per_s"] / r["inline"]["groups_per_s"])



def test_a_producers_share_of_dump_max_gib_leaves_out_the_files_of_ranks_producing_no_more(
        tmp_path):
    """roles/outputs.dump_share: run.dump_max_gib over this world's producers, less what the
    dumps of ranks that produce no more hold (a restart on fewer nodes, a resume on another
    layout): the run's dumps stay inside it together. Past it already, each file is full."""
    from hpcvla.roles.outputs import dump_share
    (tmp_path / "rank0.h5").write_bytes(bytes(1000))  # a producer's own: inside its share
    (tmp_path / "rank5.h5").write_bytes(bytes(2**20))  # rank 5 produces no more
    assert dump_share(1.0, tmp_path, [0, 1]) == (2**30 - 2**20) // 2
    assert dump_share(0.0, tmp_path, [0, 1]) == 0  # no limit
    assert dump_share(2**-30, tmp_path, [0, 1]) == 1  # taken already: full from the start
