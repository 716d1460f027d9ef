"""What to train on next: success per task from the events, and frontier allocation."""

from .frontier import (
    FLOOR,
    TaskSuccess,
    frontier_allocation,
    frontier_weight,
    split_budget,
    success_by_task,
)

__all__ = [
    "FLOOR",
    "TaskSuccess",
    "frontier_allocation",
    "frontier_weight",
    "split_budget",
    "success_by_task",
]
