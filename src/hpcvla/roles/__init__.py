"""The loop each rank runs (simulator, inference, learner, evaluator; the colocated
baseline) and the pipeline that wires them to the transport (pipeline.py: one shared set-up,
then this rank's role). The execution modes are schedules of them: hpcvla/schedule.py."""
