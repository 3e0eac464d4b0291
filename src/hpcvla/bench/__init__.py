"""Benchmarks (`hpcvla bench ...`): measured side by side in one run, written as JSON."""
