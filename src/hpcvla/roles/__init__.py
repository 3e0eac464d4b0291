"""The loop each rank runs (simulator, inference, learner; the colocated baseline), the five
execution modes as schedules of them, and the pipeline that wires them to the transport."""
