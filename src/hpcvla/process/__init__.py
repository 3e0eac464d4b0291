"""The process machinery around the ranks: which MPI starts them and what it needs set
(mpi_select.py), which rank died first (deathwatch.py), a call that never returns
(watchdog.py), and the stop signal the learners agree on (preempt.py)."""
