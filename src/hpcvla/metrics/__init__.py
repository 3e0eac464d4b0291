"""Run metrics: per-rank busy/idle timelines, throughput, summaries, and the log of the
restarts a run went through."""
