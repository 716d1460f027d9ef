"""Validation against the schema files in `schemas/`, the public contract.

The files are compiled once each with fastjsonschema (about 25x faster than the
reference `jsonschema` validator); tests/test_schemas_contract.py proves both
accept and reject the same documents.

Token ids and log-probs dominate an event (2,560 numbers in a typical interaction), and
fastjsonschema checks them one Python statement at a time. So each schema is compiled
twice: in full, and "light" with the items of such bulk numeric arrays unchecked. The hot
path runs the light validator plus a C-speed check of the bulk arrays (element types via
``map(type, ...)``, bounds via ``min``/``max``); only when that check is not conclusively
valid does the full validator run, so verdicts and error messages are the full schema's.

Version 2 schemas (codec v2) carry those arrays as base64 text instead; what the decoded bytes
must hold is checked in code (`binary.py`), and :func:`check` runs both.
"""

from __future__ import annotations

import copy
import os
import re
import threading
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any, cast

import fastjsonschema
import orjson

from pipeline.contracts import contracts_dir

from . import binary
from .errors import EventValidationError

# The layout of the typed events in memory (lists) and of the files every type has; the
# version written on the wire is the codec's choice (`codec.wire_version`).
SCHEMA_VERSION = 1
_FILE_RE = re.compile(r"^(?P<type>[a-z_]+)\.v(?P<version>[0-9]+)\.json$")
_lock = threading.Lock()


_DEFAULT_DIR = contracts_dir("schemas")  # resolved once: hot path


@cache
def schemas_dir() -> Path:
    """Folder holding `<type>.v<N>.json`; `LIVERL_SCHEMAS_DIR` overrides the shipped ones
    (pipeline/contracts.py).

    Read once per process: every encode and decode asks, and looking up a variable that is not
    set costs a KeyError inside ``os.environ`` (~4 µs, four times per event sent and read)."""
    override = os.environ.get("LIVERL_SCHEMAS_DIR")
    return Path(override) if override else _DEFAULT_DIR


@cache
def _schema_files(root: Path) -> dict[tuple[str, int], Path]:
    files: dict[tuple[str, int], Path] = {}
    for path in sorted(root.glob("*.json")):
        m = _FILE_RE.match(path.name)
        if m:
            files[(m["type"], int(m["version"]))] = path
    if not files:
        raise FileNotFoundError(f"no event schemas (<type>.v<N>.json) in {root}")
    return files


def schema_files() -> dict[tuple[str, int], Path]:
    """Map (type, version) -> schema file path."""
    return _schema_files(schemas_dir())


def load_schema(type: str, version: int = SCHEMA_VERSION) -> dict[str, Any]:
    """The parsed schema document for a type and version."""
    try:
        path = schema_files()[(type, version)]
    except KeyError:
        raise EventValidationError(f"no schema for {type}.v{version}", field="type") from None
    return orjson.loads(path.read_bytes())


def wire_version(type: str, requested: int) -> int:
    """The version a writer asking for ``requested`` writes ``type`` in: the newest of the
    type's schema files up to it (types whose layout did not change stay at 1)."""
    return _wire_version(schemas_dir(), type, requested)


@cache
def _wire_version(root: Path, type: str, requested: int) -> int:
    # Asked twice per event sent (value and headers); the files of a folder do not change.
    files = _schema_files(root)
    for version in range(requested, 1, -1):
        if (type, version) in files:
            return version
    return 1


# (fast validator, full validator, binary array fields)
_Compiled = tuple[Callable[[Any], Any], Callable[[Any], Any], dict[str, binary.ArrayField]]
_compiled: dict[tuple[Path, str, int], _Compiled] = {}

_BULK_ITEM_KEYS = {"type", "minimum", "maximum", "enum", "description"}
_ITEM_TYPES: dict[str, frozenset[type]] = {
    "integer": frozenset({int}),
    "number": frozenset({int, float}),
}


def _bulk_check(items: dict[str, Any]) -> Callable[[list[Any]], bool]:
    """A check that is True only if every element satisfies ``items`` (False = undecided)."""
    allowed = _ITEM_TYPES[items["type"]]
    low, high = items.get("minimum"), items.get("maximum")
    enum = frozenset(items["enum"]) if "enum" in items else None

    def check(values: list[Any]) -> bool:
        if not values:
            return True
        if not set(map(type, values)) <= allowed:  # excludes bool, str, None, float NaN-free
            return False
        if enum is not None and not set(values) <= enum:
            return False
        if low is not None and min(values) < low:
            return False
        return high is None or max(values) <= high

    return check


# A base64 field with exactly this pattern skips it on the hot path: text that decodes in
# binascii's strict mode (which `binary.unpack` does anyway) always matches it.
B64_PATTERN = "^[A-Za-z0-9+/]*={0,2}$"
_B64_KEYS = {"type", "contentEncoding", "contentMediaType", "pattern", binary.ANNOTATION}


def plain_b64_array(prop: dict[str, Any]) -> bool:
    """Whether a property is a v2 array field whose only text rule is :data:`B64_PATTERN`,
    which the strict decode in `binary.unpack_field` implies: the hot paths may skip it."""
    return (
        binary.ANNOTATION in prop
        and prop.get("pattern") == B64_PATTERN
        and set(prop) - {"description"} <= _B64_KEYS
    )


def _compile(schema: dict[str, Any]) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """(fast, full) validators. ``fast`` may leave the patterns of base64 array fields
    unchecked: :func:`check` runs ``full`` whenever decoding one of them fails."""
    # use_default=False: validation must never mutate the caller's dict.
    full = fastjsonschema.compile(schema, use_default=False)
    bulk: dict[str, Callable[[list[Any]], bool]] = {}
    light = copy.deepcopy(schema)
    lightened = False
    for name, prop in schema.get("properties", {}).items():
        if plain_b64_array(prop):
            light["properties"][name] = {"type": "string"}
            lightened = True
            continue
        items = prop.get("items") if prop.get("type") == "array" else None
        if (
            isinstance(items, dict)
            and isinstance(items.get("type"), str)
            and items["type"] in _ITEM_TYPES
            and set(items) <= _BULK_ITEM_KEYS
            and set(prop) <= {"type", "items", "description"}
        ):
            bulk[name] = _bulk_check(items)
            light["properties"][name] = {"type": "array"}
    if not bulk and not lightened:
        return full, full
    light_fn = fastjsonschema.compile(light, use_default=False)
    if not bulk:
        return light_fn, full

    def validate_fast(obj: Any) -> Any:
        light_fn(obj)
        for name, check in bulk.items():
            values = obj.get(name) if isinstance(obj, dict) else None
            if isinstance(values, list) and not check(values):
                return full(obj)
        return obj

    return validate_fast, full


def _validator(type: str, version: int) -> _Compiled:
    key = (schemas_dir(), type, version)
    entry = _compiled.get(key)
    if entry is None:
        with _lock:
            entry = _compiled.get(key)
            if entry is None:
                schema = load_schema(type, version)
                entry = (*_compile(schema), binary.layout(schema))
                _compiled[key] = entry
    return entry


def binary_layout(type: str, version: int) -> dict[str, binary.ArrayField]:
    """The base64 array fields of a schema version ({} for a JSON-only layout such as v1)."""
    return _validator(type, version)[2]


def _path(name: str) -> str | None:
    """fastjsonschema's 'data.messages[0].role' -> 'messages[0].role'; 'data' -> None."""
    if name == "data":
        return None
    return name[5:] if name.startswith("data.") else name


def _join(parent: str | None, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _translate(exc: fastjsonschema.JsonSchemaValueException, schema: str) -> EventValidationError:
    where = _path(exc.name or "data")
    definition = exc.definition or {}
    if exc.rule == "required" and isinstance(exc.value, dict):
        missing = [k for k in definition.get("required", ()) if k not in exc.value]
        if missing:
            return EventValidationError(
                "required field is missing", _join(where, missing[0]), schema
            )
    if exc.rule == "additionalProperties" and isinstance(exc.value, dict):
        known = definition.get("properties", {})
        extra = sorted(k for k in exc.value if k not in known)
        if extra:
            return EventValidationError("unexpected field", _join(where, extra[0]), schema)
    message = exc.message or "invalid"
    name = exc.name or "data"
    reason = message[len(name) :].strip() if message.startswith(name) else message
    return EventValidationError(reason, where, schema)


def validate(obj: Any) -> None:
    """Check a decoded event (a dict) against the schema file named by its type and version,
    and (v2) the binary arrays against the rules checked in code."""
    check(obj)


def check(obj: Any) -> tuple[int, dict[str, Sequence[Any]]]:
    """:func:`validate`, returning the document's schema version and the decoded items of its
    binary array fields ({} for v1), so a decoder does not decode them twice."""
    if not isinstance(obj, dict):
        raise EventValidationError(f"event must be a JSON object, got {_json_kind(obj)}")
    type_ = obj.get("type")
    if not isinstance(type_, str):
        raise EventValidationError(
            "required field is missing" if "type" not in obj else "must be string", field="type"
        )
    version = obj.get("schema_version")
    if isinstance(version, float) and version.is_integer():
        version = int(version)  # JSON Schema treats 1.0 as the integer 1; so do we.
    root = schemas_dir()
    # Hot path: a (type, version) already compiled is known to have its file.
    entry = _compiled.get((root, type_, version)) if type(version) is int else None
    if entry is None:
        files = _schema_files(root)
        if not any(t == type_ for t, _ in files):
            raise EventValidationError(f"unknown event type {type_!r}", field="type")
        if (
            isinstance(version, bool)
            or not isinstance(version, int)
            or (type_, version) not in files
        ):
            reason = (
                "required field is missing"
                if "schema_version" not in obj
                else f"unsupported version {version!r}"
            )
            raise EventValidationError(reason, field="schema_version", schema=type_)
        entry = _validator(type_, version)
    fast, full, fields = entry
    version = cast(int, version)
    try:
        fast(obj)
        if not fields:
            return version, {}
        try:
            return version, binary.unpack(obj, fields, f"{type_}.v{version}")
        except EventValidationError:
            full(obj)  # the schema's verdict comes first (e.g. a character outside base64)
            raise
    except fastjsonschema.JsonSchemaValueException as exc:
        raise _translate(exc, f"{type_}.v{version}") from None


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return type(value).__name__
