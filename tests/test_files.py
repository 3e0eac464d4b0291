"""Files rewritten whole or not at all (hpcvla/files.py): summary.json and eval.jsonl were
rewritten in place, and a write cut short (a quota, a full disk) left a run's summary.json
truncated, with every earlier start's record, which the next resume failed on at its end."""

import json
import subprocess
import sys
from types import SimpleNamespace

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
