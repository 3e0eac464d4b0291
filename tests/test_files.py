"""Files rewritten whole or not at all (hpcvla/files.py): summary.json and eval.jsonl were
rewritten in place, and a write cut short (a quota, a full disk) left a run's summary.json
truncated, with every earlier start's record, which the next resume failed on at its end.
And logs appended to, whose write errors name them."""

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hpcvla.files import open_log
from hpcvla.roles.outputs import starts_so_far

# A process whose files may not grow past 1 KiB (RLIMIT_FSIZE: EFBIG, as a quota's EDQUOT
# or a full disk's ENOSPC would stop the write) rewrites a 5 KB file.
CUT_SHORT = """
import resource, signal, sys
from hpcvla.files import replace_text
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
replace_text(sys.argv[1], "y" * 5000)
"""


def test_a_rewrite_cut_short_leaves_the_old_file_whole_and_names_it(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("x" * 5000)
    out = subprocess.run([sys.executable, "-c", CUT_SHORT, str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and f"writing {path}: File too large" in out.stderr, out.stderr
    assert path.read_text() == "x" * 5000  # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no temporary


def test_an_unreadable_summary_costs_the_earlier_starts_said_not_the_run(tmp_path, capsys):
    cfg = SimpleNamespace(run=SimpleNamespace(resume="somewhere"))
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"starts": [{"from_version": 0}]}))
    starts = starts_so_far(cfg, path, {"from_version": 5})
    assert [{k: v for k, v in s.items() if k != "ended"} for s in starts] == [
        {"from_version": 0}, {"from_version": 5}]
    path.write_text('{"starts": [{"from_ver')  # cut short (an older write, a lost node)
    assert [s["from_version"] for s in starts_so_far(cfg, path, {"from_version": 5})] == [5]
    assert "cannot be read" in capsys.readouterr().err


def test_a_log_cut_mid_line_is_ended_before_the_next_start_appends(tmp_path):
    """A rank killed mid-write (or a node lost before its write-back) cuts a log's last line;
    the next start's first record was glued to it, and both were lost to every reader."""
    from hpcvla.files import open_log, read_log
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"update": 1}\n{"update": 2, "trai')
    with open_log(path) as log:
        log.write('{"update": 3}\n')
    assert read_log(path) == [{"update": 1}, {"update": 3}]
    with open_log(path) as log:  # a whole file gets nothing added
        log.write('{"update": 4}\n')
    assert path.read_text().endswith('"trai\n{"update": 3}\n{"update": 4}\n')
    with open_log(tmp_path / "new.jsonl") as log:
        log.write("{}\n")
    assert (tmp_path / "new.jsonl").read_text() == "{}\n"


def test_learner_0_finds_a_sidecar_by_its_folder_and_names_a_slow_one(tmp_path, capsys):
    """Learner 0 waits for each learner's sidecar to publish a checkpoint: by its folder's
    listing (a stat trusts NFS's cached "no such file" for up to a minute), saying so while
    it takes long (it waited silently, without end)."""
    import threading

    from hpcvla.checkpoint.store import _await_json
    path = tmp_path / "optimizer.rank1.json"
    threading.Timer(0.5, lambda: path.write_text('{"file": "x"}')).start()
    assert _await_json(path, remind_s=0.1) == {"file": "x"}
    assert re.search(rf"learner 0 has waited \d+ s for {path} \(another learner's",
                     capsys.readouterr().err)


def test_an_appended_log_that_cannot_be_written_names_its_file():
    """files.open_log (metrics.jsonl, timelines, restarts.jsonl, software.jsonl): a full
    disk's or an exceeded quota's error names the log (here /dev/full, whose every write
    fails with ENOSPC), as replace_text's does: a rank's files may sit on several file
    systems, and the errno alone does not say which one is full."""
    log = open_log("/dev/full")
    log.write("{}\n")  # buffered
    with pytest.raises(OSError, match="writing /dev/full: No space left on device"):
        log.flush()
    with pytest.raises(OSError, match="writing /dev/full"):  # what it still holds
        log.close()
    with pytest.raises(OSError, match="writing /dev/full"):
        with open_log("/dev/full", buffering=1) as line_buffered:
            line_buffered.write("{}\n")
