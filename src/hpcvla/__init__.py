"""hpcvla: fully asynchronous RL post-training of VLA policies as an MPI batch job."""

__version__ = "0.1.0"
