"""Errors of the demo."""

from __future__ import annotations

from pipeline.errors import LiverlError


class LoopError(LiverlError, RuntimeError):
    """The stack did not come up; the message carries the end of its logs."""
