"""Errors a user can act on, raised by domain code and turned into one line at the CLI edge.

Every package keeps its own ``errors.py`` (as quix-streams keeps an ``exceptions.py`` per
package) whose classes derive from :class:`LiverlError`; the library never depends on click,
and ``pipeline.cli`` is the one place that prints them (``error: ...``, no traceback) and
exits with their ``exit_code``. This module also holds the errors of the top-level modules
(``report``, ``forget``).
"""

from __future__ import annotations


class LiverlError(Exception):
    """A failure whose message says what happened and what to do next."""

    exit_code = 1

    @property
    def message(self) -> str:
        return str(self)

    def one_line(self) -> str:
        """The message on one line (tables and paths in it may have been wrapped)."""
        return " ".join(str(self).split())


class ReportError(LiverlError):
    """The report cannot be drawn (no lake, no rows for the policy); the message says why."""


class ForgetError(LiverlError):
    """Forget cannot proceed safely (a live gateway spool, Kafka unreachable)."""
