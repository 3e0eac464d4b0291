"""The process machinery around the ranks: which MPI starts them and what it needs set
(mpi_select.py), which rank died first (deathwatch.py), a call that never returns
(watchdog.py), the stop signal the learners agree on (preempt.py), a rank's helper
processes (worker.py), and its stderr read by its launcher before it aborts (stdio.py)."""
