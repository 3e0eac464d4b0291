"""Memory planned before launch: a policy's footprint measured on fake tensors (footprint.py),
the bytes of each rank by arithmetic on it (states.py), and the plan's figures per GPU and
per node with the layouts that do not fit (layout.py). docs/memory.md."""
