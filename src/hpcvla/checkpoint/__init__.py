"""Checkpoints: what the learners need to continue a run. store.py writes, finds, verifies and
reads a run's checkpoint directories; optimizer_state.py is the learners' optimizer state by
parameter range, the form they are stored in, so that any learner count and ZeRO stage
resumes them."""
