"""The MPICH segments a failed world leaves in /dev/shm: which ones a launcher removes
(hpcvla.job.segments). Real files in /dev/shm, mapped by real processes."""

import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpcvla.job import segments


def _segment(name: str) -> Path:
    path = segments.SHM_DIR / f"mpich_hpcvla_test_{os.getpid()}_{name}"
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    return path


def test_only_unmapped_segments_are_removed_and_one_mapped_during_the_settle_is_spared():
    before = segments.segments()
    left = _segment("left")  # a dead world's: nobody maps it
    live = _segment("live")  # a running world's
    with open(live, "r+b") as f, mmap.mmap(f.fileno(), 0):
        creating = _segment("creating")  # another world's, mapped an instant after creation

        def map_it(hold):
            with open(creating, "r+b") as g, mmap.mmap(g.fileno(), 0):
                hold.wait()

        hold = threading.Event()
        mapper = threading.Timer(0.2, map_it, args=(hold,))
        mapper.start()
        try:
            removed = segments.remove_orphans(before, settle_s=1.0)
        finally:
            hold.set()
            mapper.join()
        assert removed == {left} and not left.exists()
        assert creating.exists() and live.exists()
    leftovers = segments.segments() - before
    assert leftovers == {creating, live}
    for path in leftovers:
        path.unlink()


def test_the_command_a_job_runs_on_each_node_removes_orphans_and_says_which():
    """jobs/launch.sh runs it on every node after a failed world."""
    before = segments.segments()
    left = _segment("dead-world")
    # as jobs/launch.sh runs it: every orphan of this user's on the node goes, its own
    # (`before`) included; the test's are the ones named here
    out = subprocess.run([sys.executable, "-m", "hpcvla.job.segments", "remove-orphans"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert not left.exists()
    assert "removed" in out and left.name in out, out
    assert segments.segments() <= before


def test_a_second_look_is_taken_only_when_something_is_unmapped():
    start = time.monotonic()
    assert segments.orphans(segments.segments(), settle_s=5.0) == set()
    assert time.monotonic() - start < 2.0
