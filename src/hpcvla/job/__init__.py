"""A whole training job: start the world (launch.py on one machine; jobs/launch.sh under a
scheduler), run it on every rank (runtime.py), run `hpcvla train` from another program
(trainrun.py), and restart it inside the allocation after a failure (restarts.py)."""
