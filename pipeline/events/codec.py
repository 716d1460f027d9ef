"""Bytes <-> typed events. Values are UTF-8 JSON (orjson), validated against the schema files.

Codec versions: v1 writes every field as plain JSON. v2 writes the bulk numeric arrays of the
types that have a ``<type>.v2.json`` (interaction, sample) as base64 of little-endian binary
arrays (`binary.py`); every other type stays v1. Readers take both, whatever the writer chose,
so a topic may hold both. The version written is ``kafka.codec_version`` (settings): passed
explicitly by the writers that hold settings (EventProducer, the gateway's recorder, the Faust
agents), else the process default that the CLI sets from the settings
(:func:`set_codec_version`). Typed events in memory are the same for both (``schema_version``
1; token fields are lists or the packed arrays of `arrays.py`, which decoding gives and which
compare equal to the lists): the wire version is only a property of the bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from . import binary
from .arrays import json_default
from .errors import EventValidationError
from .typed import decode_fast
from .types import EVENT_TYPES, DeadLetter, Event, Producer, ServingStatus, TurnEvent
from .validation import binary_layout, check
from .validation import wire_version as _wire_version

TYPE_HEADER = "liverl-type"
VERSION_HEADER = "liverl-schema-version"
_ENCODE_OPTS = orjson.OPT_SERIALIZE_NUMPY  # token ids straight from numpy need no .tolist()
_FIXED = ("type", "schema_version")

CODEC_VERSIONS = (1, 2)
DEFAULT_CODEC_VERSION = 2
_codec_version = DEFAULT_CODEC_VERSION


def set_codec_version(version: int) -> None:
    """Make ``version`` what this process writes when a caller names none (the CLI does this
    once, from ``kafka.codec_version``)."""
    global _codec_version
    _codec_version = _checked(version)


def codec_version() -> int:
    """The codec version this process writes by default."""
    return _codec_version


def wire_version(event: Event, version: int | None = None) -> int:
    """The schema version ``encode(event, version=version)`` writes: the codec version for
    types whose layout it changes, 1 for the others."""
    requested = _codec_version if version is None else _checked(version)
    return 1 if requested == 1 else _wire_version(event.type, requested)


def _checked(version: int) -> int:
    if version not in CODEC_VERSIONS or isinstance(version, bool):
        raise ValueError(f"codec version must be one of {CODEC_VERSIONS}, got {version!r}")
    return version


def encode(event: Event, validate: bool = False, *, version: int | None = None) -> bytes:
    """Serialize an event to its wire value in codec ``version`` (default: the process's);
    with `validate`, check the bytes that will be sent (catches what the type hints cannot,
    e.g. a NaN that JSON turns into null, or a v2 mask whose length differs from the tokens)."""
    wire = wire_version(event, version)
    fields = binary_layout(event.type, wire) if wire != 1 else {}
    try:
        if fields:
            raw = orjson.dumps(_binary_document(event, wire, fields), option=_ENCODE_OPTS)
        else:
            raw = orjson.dumps(event, default=json_default, option=_ENCODE_OPTS)
    except orjson.JSONEncodeError as exc:
        raise EventValidationError(f"cannot encode: {exc}", schema=f"{event.type}.v{wire}") from exc
    if validate:
        check(orjson.loads(raw))
    return raw


_FIELD_NAMES: dict[type[Event], tuple[str, ...]] = {}


def _field_names(cls: type[Event]) -> tuple[str, ...]:
    # A dict, not functools.cache: typeshed's cache wants Hashable arguments, and an event
    # class (eq=True, so instances are unhashable) does not pass for one although it is.
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _binary_document(
    event: Event, wire: int, fields: dict[str, binary.ArrayField]
) -> dict[str, Any]:
    # Same keys in the same order as v1; the array fields become base64 text.
    doc = {name: getattr(event, name) for name in _field_names(type(event))}
    doc["schema_version"] = wire
    schema = f"{event.type}.v{wire}"
    for name, f in fields.items():
        doc[name] = binary.pack(doc[name], f, schema)
    return doc


def headers(event: Event, *, version: int | None = None) -> list[tuple[str, bytes]]:
    """Kafka headers that let consumers route or filter without parsing the value; pass the
    same ``version`` as to :func:`encode`."""
    return [
        (TYPE_HEADER, event.type.encode()),
        (VERSION_HEADER, str(wire_version(event, version)).encode()),
    ]


def key(event: Event) -> bytes | None:
    """Kafka key, as in topics/*.yaml: `session_id` for session-scoped events (co-partitioned),
    `replica_id` for serving status, the original key for dead letters, `judge_id` for judge
    consistency, else `policy_id`."""
    if isinstance(event, TurnEvent):
        return event.session_id.encode()
    if isinstance(event, ServingStatus):
        return event.replica_id.encode()
    if isinstance(event, DeadLetter):
        return event.original_key()
    owner = getattr(event, "policy_id", None) or getattr(event, "judge_id", None)
    return owner.encode() if isinstance(owner, str) else None


def decode(
    raw: bytes | None,
    expected_type: str | None = None,
    *,
    max_bytes: int | None = None,
    version_header: bytes | None = None,
    one_pass: bool = True,
) -> Event:
    """Parse, validate and type a wire value of any codec version. Raises EventValidationError
    on any defect, including a ``liverl-schema-version`` header (``version_header``) that
    disagrees with the value's ``schema_version``: filters that trust the header would
    misroute such a record.

    A valid value is decoded in one pass (`typed.py`); anything that pass does not accept
    takes the full path (orjson, the schema validator), whose verdict and message stand.
    ``one_pass=False`` takes the full path only (the contract tests and the codec bench
    compare the two)."""
    if raw is None:
        raise EventValidationError("value is null (tombstone), not an event")
    if max_bytes is not None and len(raw) > max_bytes:
        raise EventValidationError(f"value of {len(raw)} bytes exceeds limit {max_bytes}")
    fast = decode_fast(raw, expected_type) if one_pass else None
    if fast is not None and (version_header is None or version_header == str(fast[1]).encode()):
        return fast[0]
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _json_error(raw, exc) from None
    if expected_type is not None and isinstance(obj, dict) and obj.get("type") != expected_type:
        got = obj.get("type")
        raise EventValidationError(f"expected type {expected_type!r}, got {got!r}", field="type")
    version, arrays = check(obj)
    if version_header is not None and version_header != str(version).encode():
        raise EventValidationError(
            f"header {VERSION_HEADER} says {version_header.decode('utf-8', 'replace')!r} "
            f"but the value is version {version}",
            field="schema_version",
            schema=f"{obj['type']}.v{version}",
        )
    return _build(obj, arrays)


def from_dict(obj: dict[str, Any]) -> Event:
    """Validate an already-parsed event document (v1 or v2) and return its typed event; the
    document is not modified."""
    _, arrays = check(obj)
    return _build(obj, arrays)


def to_dict(event: Event) -> dict[str, Any]:
    """The event as its v1 JSON document (plain dicts and lists, token ids as lists of ints),
    e.g. for table writers and display, whatever the codec writes on the wire."""
    return orjson.loads(encode(event, version=1))


def _build(obj: dict[str, Any], arrays: Mapping[str, Sequence[Any]]) -> Event:
    # Only called on valid documents, whose keys are exactly the dataclass fields; a v2
    # document's base64 fields are replaced by their decoded arrays.
    kwargs = {k: v for k, v in obj.items() if k not in _FIXED}
    kwargs.update(arrays)
    kwargs["producer"] = Producer(**obj["producer"])
    return EVENT_TYPES[obj["type"]](**kwargs)


def _json_error(raw: bytes, exc: orjson.JSONDecodeError) -> EventValidationError:
    try:
        bytes(raw).decode("utf-8")
    except UnicodeDecodeError as u:
        return EventValidationError(f"invalid UTF-8 at byte {u.start}: {u.reason}")
    return EventValidationError(f"malformed JSON: {exc}")
