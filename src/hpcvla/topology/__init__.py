"""Rank topology: the pure RankPlan (`plan`) and the MPI communicators built from it (`comms`).

`hpcvla.topology.comms` imports mpi4py (which initialises MPI); import it only inside ranks.
"""

from hpcvla.topology.plan import Cell, PlanError, RankInfo, RankPlan, build_plan, plan_from_config

__all__ = ["Cell", "PlanError", "RankInfo", "RankPlan", "build_plan", "plan_from_config"]
