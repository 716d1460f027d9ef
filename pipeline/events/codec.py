"""Bytes <-> typed events. Values are UTF-8 JSON (orjson), validated against the schema files."""

from __future__ import annotations

from typing import Any

import orjson

from .errors import EventValidationError
from .types import EVENT_TYPES, DeadLetter, Event, Producer, ServingStatus, TurnEvent
from .validation import validate as _validate

TYPE_HEADER = "liverl-type"
VERSION_HEADER = "liverl-schema-version"
_ENCODE_OPTS = orjson.OPT_SERIALIZE_NUMPY  # token ids straight from numpy need no .tolist()
_FIXED = ("type", "schema_version")


def encode(event: Event, validate: bool = False) -> bytes:
    """Serialize an event to its wire value; with `validate`, check the bytes that will be sent
    (catches what the type hints cannot, e.g. a NaN that JSON turns into null)."""
    try:
        raw = orjson.dumps(event, option=_ENCODE_OPTS)
    except orjson.JSONEncodeError as exc:
        raise EventValidationError(
            f"cannot encode: {exc}", schema=f"{event.type}.v{event.schema_version}"
        ) from exc
    if validate:
        _validate(orjson.loads(raw))
    return raw


def headers(event: Event) -> list[tuple[str, bytes]]:
    """Kafka headers that let consumers route or filter without parsing the value."""
    return [
        (TYPE_HEADER, event.type.encode()),
        (VERSION_HEADER, str(event.schema_version).encode()),
    ]


def key(event: Event) -> bytes | None:
    """Kafka key, as in topics/*.yaml: `session_id` for session-scoped events (co-partitioned),
    `replica_id` for serving status, the original key for dead letters, else `policy_id`."""
    if isinstance(event, TurnEvent):
        return event.session_id.encode()
    if isinstance(event, ServingStatus):
        return event.replica_id.encode()
    if isinstance(event, DeadLetter):
        return event.original_key()
    policy_id = getattr(event, "policy_id", None)
    return policy_id.encode() if isinstance(policy_id, str) else None


def decode(raw: bytes, expected_type: str | None = None, *, max_bytes: int | None = None) -> Event:
    """Parse, validate and type a wire value. Raises EventValidationError on any defect."""
    if raw is None:
        raise EventValidationError("value is null (tombstone), not an event")
    if max_bytes is not None and len(raw) > max_bytes:
        raise EventValidationError(f"value of {len(raw)} bytes exceeds limit {max_bytes}")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _json_error(raw, exc) from None
    if expected_type is not None and isinstance(obj, dict) and obj.get("type") != expected_type:
        got = obj.get("type")
        raise EventValidationError(f"expected type {expected_type!r}, got {got!r}", field="type")
    _validate(obj)
    return _build(obj)


def from_dict(obj: dict[str, Any]) -> Event:
    """Validate an already-parsed event document and return its typed event."""
    _validate(obj)
    return _build(obj)


def to_dict(event: Event) -> dict[str, Any]:
    """The event as its JSON document (plain dicts and lists), e.g. for table writers."""
    return orjson.loads(encode(event))


def _build(obj: dict[str, Any]) -> Event:
    # Only called on schema-valid documents, whose keys are exactly the dataclass fields.
    kwargs = {k: v for k, v in obj.items() if k not in _FIXED}
    kwargs["producer"] = Producer(**obj["producer"])
    return EVENT_TYPES[obj["type"]](**kwargs)


def _json_error(raw: bytes, exc: orjson.JSONDecodeError) -> EventValidationError:
    try:
        bytes(raw).decode("utf-8")
    except UnicodeDecodeError as u:
        return EventValidationError(f"invalid UTF-8 at byte {u.start}: {u.reason}")
    return EventValidationError(f"malformed JSON: {exc}")
