"""Errors of replay, diff and namespaces."""

from __future__ import annotations

from pipeline.errors import LiverlError


class ReplayError(LiverlError):
    """A replay or diff cannot go on (a partition stopped answering, a bad manifest)."""


class DeliveryFailed(ReplayError):
    """Replayed records were not acknowledged by the target cluster."""


class ReplayArgumentError(ReplayError):
    """An argument of replay or diff that cannot be read or met (a time, a speed, a topic
    the broker lacks, a range the archive lacks): a usage error, exit status 2."""

    exit_code = 2


class NamespaceError(LiverlError):
    """A namespace is not there, or cannot be used as asked."""


class NamespaceNameError(NamespaceError):
    """A name that cannot be a namespace: a usage error, exit status 2."""

    exit_code = 2
