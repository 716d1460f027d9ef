"""Errors of ``liverl versions``."""

from __future__ import annotations

from pipeline.errors import LiverlError


class VersionError(LiverlError):
    """The command names a version that does not exist or cannot take the action (exit 2,
    a usage error: nothing was sent)."""

    exit_code = 2
