"""Run metrics: per-rank busy/idle timelines, throughput, summaries."""
