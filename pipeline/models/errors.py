"""Errors of the model store."""

from __future__ import annotations

from pipeline.errors import LiverlError


class ModelStoreError(LiverlError, RuntimeError):
    """A model could not be found, fetched or converted; the message says what to do."""
