"""Scale model: a discrete-event model of the pipeline calibrated with probed stage
costs (model.py, probe.py), the layout search behind `hpcvla plan --auto` (autoplan.py), its
check against real runs (validate.py), the 8 -> 256 GPU prediction (predict.py) and the
workloads and cost presets of the emulated runs (presets.py)."""
