"""Errors of the trainer a user can act on."""

from __future__ import annotations

from pipeline.errors import LiverlError


class OfflineInputError(LiverlError, ValueError):
    """The selection cannot be read (unknown table, bad filter); the message says which."""
