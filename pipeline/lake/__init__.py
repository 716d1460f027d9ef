"""Delta Lake tables (trajectories, gradient_steps, weights) and idempotent writers."""

from pipeline.lake.tables import (
    GRADIENT_STEPS,
    GRADIENT_STEPS_SCHEMA,
    TRAJECTORIES,
    TRAJECTORIES_SCHEMA,
    WEIGHTS,
    WEIGHTS_SCHEMA,
    LakeTables,
)
from pipeline.lake.writer import Appender, append_once, committed_version

__all__ = [
    "GRADIENT_STEPS",
    "GRADIENT_STEPS_SCHEMA",
    "TRAJECTORIES",
    "TRAJECTORIES_SCHEMA",
    "WEIGHTS",
    "WEIGHTS_SCHEMA",
    "Appender",
    "LakeTables",
    "append_once",
    "committed_version",
]
