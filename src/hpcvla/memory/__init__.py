"""Memory planned before launch: a policy's footprint measured on tensors without storage
(footprint.py; a VLA's from shallow copies of it, depths.py, on meta tensors that take the
CPU's paths, cpu_meta.py), the bytes of each rank by arithmetic on it (states.py), and the
plan's figures per GPU and per node with the layouts that do not fit (layout.py).
docs/memory.md."""
