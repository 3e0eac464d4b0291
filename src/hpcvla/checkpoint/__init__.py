"""Checkpoints: what the learners need to continue a run. catalog.py finds a run's checkpoint
directories and checks their state.json and checksums (no torch); store.py writes them and
reads their tensors; optimizer_state.py is the learners' optimizer state by
parameter range, the form they are stored in, so that any learner count and ZeRO stage
resumes them."""
