"""Kept for importers not yet switched: the schedule lives in hpcvla/schedule.py."""
from hpcvla.schedule import check_pipeline, envs_of_cell, producer_quota, schedule_of

__all__ = ["check_pipeline", "envs_of_cell", "producer_quota", "schedule_of"]
