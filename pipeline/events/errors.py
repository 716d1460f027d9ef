"""The one error type raised for any event that does not meet its contract."""

from __future__ import annotations


class EventValidationError(ValueError):
    """An event's bytes or fields do not satisfy its schema.

    `field` is a path such as ``turn`` or ``messages[0].role`` (None when the
    problem is the document as a whole); `reason` says what is wrong.
    """

    def __init__(self, reason: str, field: str | None = None, schema: str | None = None) -> None:
        self.field = field
        self.reason = reason
        self.schema = schema
        prefix = f"{schema}: " if schema else ""
        where = f"field {field!r}: " if field is not None else ""
        super().__init__(f"{prefix}{where}{reason}")
