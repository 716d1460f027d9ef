"""Errors of the reward processors' configuration."""

from __future__ import annotations

from pipeline.errors import LiverlError


class RuleConfigError(LiverlError, ValueError):
    """A rule set that violates one of the four RLVP design rules (or is malformed)."""
