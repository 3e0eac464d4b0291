"""Emulated stage costs: calibrated delays that let a few cores stand in for slow simulators
and many accelerators (docs/architecture.md, "Emulated costs"). An emulated cost is the
stage's whole duration: the real (tiny) compute runs inside it and a sleep pads the rest, so
the delays, not the cores, set the pace."""

from __future__ import annotations

import time


def pad(begin: float, seconds: float) -> None:
    """Sleep until `seconds` have passed since `begin` (a `time.monotonic()` reading)."""
    time.sleep(max(0.0, begin + seconds - time.monotonic()))
