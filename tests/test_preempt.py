"""The stop-signal flag (process/preempt.py): what a second signal, arriving while the first
one's handler runs, does to it."""

import subprocess
import sys

# The first SIGTERM's handler, with a second SIGTERM's run at each line it executes (and at
# each line of whatever it calls), as Python runs a handler for a signal that arrives at that
# point; then the flag, and whether the signal it names is one of the two.
NESTED = """
import signal, sys
from hpcvla.process import preempt
inside = []
def trace(frame, event, arg):
    if event == "line" and not inside:
        inside.append(1)
        preempt._on_signal(signal.SIGUSR1, frame)
        inside.pop()
    return trace
sys.settrace(trace)
preempt._on_signal(signal.SIGTERM, None)
sys.settrace(None)
print(preempt.requested(), preempt.requested_by() in (signal.SIGTERM, signal.SIGUSR1))
"""


def test_a_signal_inside_the_first_signals_handler_does_not_wait_for_it():
    """Slurm and mpiexec may both send SIGTERM at once. A handler that took a lock (a
    threading.Event's set) waited forever for itself when the second arrived while the first
    held it: the learner never reached the version's stop vote, no checkpoint was written."""
    out = subprocess.run([sys.executable, "-c", NESTED], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["True", "True"], out.stderr
