"""Errors of the reward processors' configuration."""

from __future__ import annotations

from pipeline.errors import LiverlError


class RuleConfigError(LiverlError, ValueError):
    """A rule set that violates one of the four RLVP design rules (or is malformed)."""


class RetentionError(LiverlError, ValueError):
    """A session may outlive its interactions: the worker reads a turn's tokens back from the
    interactions topic, so that topic must keep records longer than ``processors.retain_s``."""
