"""What a restart inside the allocation records (hpcvla.restarts, called by jobs/launch.sh):
the version it resumes from and the env steps trained since that checkpoint, read from a
metrics.jsonl whose last line the dying world may have left half-written. The restart itself
runs in tests/test_slurm.py."""

import json

from hpcvla import checkpoint, restarts
from helpers import fake_checkpoint


def test_a_restart_records_what_it_resumes_from_and_what_it_lost(tmp_path):
    run = tmp_path / "default-1"
    fake_checkpoint(checkpoint.checkpoint_dir(run, 2), counters={"trained_env_steps": 2048})
    (run / "config.yaml").write_text("run: {name: default}\n")
    (run / "metrics.jsonl").write_text(
        json.dumps({"update": 3, "trained_env_steps": 3072}) + '\n{"update": 3, "trained_en')
    assert restarts.newest_version(tmp_path) == 2
    entry = restarts.record(tmp_path, 255, ["h2"], ["h0", "h1"], 6)
    assert entry["resumed_from_version"] == 2 and entry["lost_env_steps"] == 1024
    assert entry["dropped_nodes"] == ["h2"] and entry["nodes"] == ["h0", "h1"]
    assert restarts.recorded(run) == [entry]


def test_no_run_yet_records_nothing(tmp_path):
    assert restarts.newest_version(tmp_path) == -1
    assert restarts.record(tmp_path, 9, [], ["h0"], 4) is None
