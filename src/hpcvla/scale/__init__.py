"""Scale model (issue 19): a discrete-event model of the pipeline calibrated with probed stage
costs (model.py, probe.py), the layout search behind `hpcvla plan --auto` (autoplan.py), its
check against real runs (validate.py) and the 8 -> 256 GPU prediction (predict.py)."""
