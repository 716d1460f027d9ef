"""Errors of the lake: SQL over the Delta tables and the topic archive."""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.errors import LiverlError


class SqlError(LiverlError):
    """A query that cannot run (bad SQL, no such table); exit status 2, as a usage error."""

    exit_code = 2


class ArchiveError(LiverlError):
    """A problem the archive cannot work around (broker unreachable, table ahead of topic)."""


class ArchiveStopped(ArchiveError):
    """A stop was asked for while the archive waited for the broker."""

    def __init__(self) -> None:
        super().__init__("stopped while waiting for the broker")


class MissingTopics(ArchiveError):
    """Topics to archive that the broker does not have."""

    def __init__(self, missing: Sequence[str], bootstrap: str) -> None:
        self.missing = list(missing)
        super().__init__(
            f"no such topic on the broker ({bootstrap}): {', '.join(self.missing)}; "
            "`liverl topics apply` creates liverl's topics"
        )
