"""The progress line's ETA: the remaining versions at the recent versions' rate, shown only
once three versions have ended, so that start-up and the first, slower versions do not make
the first estimates wrong by a factor."""

from hpcvla.metrics import progress
from hpcvla.metrics.progress import Progress


def test_the_eta_follows_the_recent_rate_not_the_start_up(monkeypatch, capsys):
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    line = Progress(None, total_updates=20, chunk_len=4, every_s=0, enabled=True)
    clock[0] = 60.0  # a minute of start-up before the first version ends
    line.on_update(1)
    clock[0] += 5.0  # then 5 s per version, except a slow second one
    line.on_update(2)
    clock[0] += 2.0
    line.on_update(3)
    printed = capsys.readouterr().out.splitlines()
    assert [p.rsplit("ETA ", 1)[1] for p in printed] == ["--", "--", "0m59s"]  # 17 x 7 s / 2
    for n in range(4, 11):
        clock[0] += 2.0
        line.on_update(n)
    assert line.eta_s() == 20.0  # the window (8 versions) now holds only the 2 s ones
    assert capsys.readouterr().out.splitlines()[-1].endswith("ETA 0m20s")
    clock[0] += 1.0
    line.on_update(20)
    assert capsys.readouterr().out.splitlines()[-1].endswith("ETA 0m00s")
