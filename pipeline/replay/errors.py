"""Errors of replay, diff and namespaces."""

from __future__ import annotations

from pipeline.errors import LiverlError


class ReplayError(LiverlError):
    """A replay or diff cannot go on (a partition stopped answering, a bad manifest)."""


class DeliveryFailed(ReplayError):
    """Replayed records were not acknowledged by the target cluster."""


class NamespaceError(LiverlError):
    """A namespace is not there, or cannot be used as asked."""
