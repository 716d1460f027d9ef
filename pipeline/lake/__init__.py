"""Delta Lake tables (trajectories, gradient_steps, weights, the events/ archive) and
idempotent writers."""

from pipeline.lake.archive import ArchiveError, archive_path, read_archived
from pipeline.lake.tables import (
    GRADIENT_STEPS,
    GRADIENT_STEPS_SCHEMA,
    TRAJECTORIES,
    TRAJECTORIES_SCHEMA,
    WEIGHTS,
    WEIGHTS_SCHEMA,
    LakeTables,
)
from pipeline.lake.writer import Appender, MultiAppender

__all__ = [
    "GRADIENT_STEPS",
    "GRADIENT_STEPS_SCHEMA",
    "TRAJECTORIES",
    "TRAJECTORIES_SCHEMA",
    "WEIGHTS",
    "WEIGHTS_SCHEMA",
    "Appender",
    "ArchiveError",
    "LakeTables",
    "MultiAppender",
    "archive_path",
    "read_archived",
]
