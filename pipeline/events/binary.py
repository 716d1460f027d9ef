"""Bulk numeric arrays as base64 of little-endian binary arrays (codec v2).

Token ids and log-probs are most of an interaction's bytes, and as JSON numbers they cost a
parse and a per-item schema check each. A v2 schema declares such a field as a base64 string
(``contentEncoding: base64``) whose ``x-liverl-array`` annotation gives the item type:

    {"dtype": "uint32" | "uint8" | "float64", "enum": [0, 1], "same_length_as": "other",
     "empty_allowed": true}

JSON Schema can say "base64 text" but not what the decoded bytes must hold, so those rules
are checked here, in code, with the same error type as the schema's: valid base64 (strict,
padded), a byte length that is a multiple of the item size, finite floats (v1 could not carry
NaN or infinity either: JSON has neither), items in ``enum``, and lengths tied to another
field. Decoding copies the bytes into packed arrays (`arrays.py`: they compare equal to the
lists v1 gives and serve the same reads); encoding a packed array is a copy too. Base64 is
pybase64's SIMD codec: binascii's took ~40 µs each way for an interaction's ~2,500 numbers.
"""

from __future__ import annotations

import binascii
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pybase64

from .arrays import PACKED_TYPES
from .errors import EventValidationError

ANNOTATION = "x-liverl-array"


@dataclass(frozen=True, slots=True)
class ArrayField:
    """How one v2 field is laid out and what its items must satisfy."""

    name: str
    dtype: str
    enum: bytes | None = None  # allowed byte values (uint8 only)
    same_length_as: str | None = None
    empty_allowed: bool = False

    @property
    def itemsize(self) -> int:
        return PACKED_TYPES[self.dtype].ITEMSIZE


def layout(schema: Mapping[str, Any]) -> dict[str, ArrayField]:
    """The binary array fields a schema declares, in property order; {} for a v1 schema.
    A malformed annotation is an error in the schema file, raised as ValueError."""
    out: dict[str, ArrayField] = {}
    for name, prop in schema.get("properties", {}).items():
        spec = prop.get(ANNOTATION)
        if spec is None:
            continue
        where = f"{schema.get('$id', '?')}: {name}"
        if prop.get("type") != "string" or prop.get("contentEncoding") != "base64":
            raise ValueError(f"{where}: {ANNOTATION} needs type string and base64 encoding")
        unknown = set(spec) - {"dtype", "enum", "same_length_as", "empty_allowed"}
        if unknown or spec.get("dtype") not in PACKED_TYPES:
            raise ValueError(f"{where}: bad {ANNOTATION} {spec!r}")
        enum = spec.get("enum")
        if enum is not None and (spec["dtype"] != "uint8" or not set(enum) <= set(range(256))):
            raise ValueError(f"{where}: enum is supported for uint8 items only")
        tied = spec.get("same_length_as")
        if tied is not None and tied not in schema["properties"]:
            raise ValueError(f"{where}: same_length_as names no property: {tied!r}")
        out[name] = ArrayField(
            name=name,
            dtype=spec["dtype"],
            enum=None if enum is None else bytes(sorted(enum)),
            same_length_as=tied,
            empty_allowed=bool(spec.get("empty_allowed", False)),
        )
    return out


def pack(values: Iterable[Any], f: ArrayField, schema: str) -> str:
    """Items (a packed array, list, tuple, or anything with ``tolist()`` such as a numpy array)
    as the field's base64 text. Items the item type cannot hold (a negative or >= 2**32 token
    id, a str) raise EventValidationError; range and enum rules are the reader's to check."""
    cls = PACKED_TYPES[f.dtype]
    packed: Any = values
    if type(packed) is not cls:
        if not isinstance(packed, (list, tuple)):
            tolist = getattr(packed, "tolist", None)
            packed = tolist() if callable(tolist) else list(packed)
        try:
            packed = cls(packed)
        except (OverflowError, TypeError, ValueError) as exc:
            raise EventValidationError(
                f"cannot encode as {f.dtype}: {exc}", f.name, schema
            ) from None
    return pybase64.b64encode_as_string(packed.le_bytes())


def _surely_finite(raw: bytes) -> bool:
    """True if no little-endian float64 in ``raw`` can be NaN or infinite, False = look closer.

    A non-finite double has all 11 exponent bits set, so its last byte (sign + the exponent's
    top 7 bits) is 0x7F or 0xFF. Two byte scans in C decide for any log-prob; summing the
    items instead built a Python float per item (~9 µs an interaction)."""
    top = raw[7::8]
    return b"\x7f" not in top and b"\xff" not in top


def unpack_field(text: str | bytes | memoryview, f: ArrayField, schema: str) -> Sequence[Any]:
    """One field's items from its base64 text (or its ASCII bytes), with every rule but
    ``same_length_as`` (which needs the other field) checked; raises EventValidationError
    naming the field."""
    name = f.name
    try:
        raw = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EventValidationError(f"not valid base64: {exc}", name, schema) from None
    # Padding must complete the last group of 4 ("AAAA==" is not base64, RFC 4648). On the
    # hot path (the one-pass decoder's bytes) without building a str or bytes for the tail.
    n = len(text)
    eq: Any = "=" if isinstance(text, str) else 61
    pad = 0 if n < 2 or text[-1] != eq else 2 if text[-2] == eq else 1
    if n % 4 or len(raw) != n // 4 * 3 - pad:
        raise EventValidationError(
            "not valid base64: padding must complete the last group of 4", name, schema
        )
    size = f.itemsize
    if len(raw) % size:
        raise EventValidationError(
            f"decodes to {len(raw)} bytes, not a whole number of {f.dtype} items "
            f"({size} bytes each)",
            name,
            schema,
        )
    if f.enum is not None and raw.translate(None, f.enum):  # some byte is not allowed
        index = next(i for i, b in enumerate(raw) if b not in f.enum)
        allowed = ", ".join(map(str, f.enum))
        raise EventValidationError(
            f"item {index} is {raw[index]}, must be one of {allowed}", name, schema
        )
    arr: Sequence[Any] = PACKED_TYPES[f.dtype].from_le_bytes(raw)  # type: ignore[assignment]
    if f.dtype == "float64" and not _surely_finite(raw):
        bad = next((i for i, x in enumerate(arr) if not math.isfinite(x)), None)
        if bad is not None:
            raise EventValidationError(
                f"item {bad} is {arr[bad]}, must be a finite number", name, schema
            )
    return arr


def unpack(
    obj: Mapping[str, Any], fields: Mapping[str, ArrayField], schema: str
) -> dict[str, Sequence[Any]]:
    """The decoded items (packed arrays) of every array field present in a schema-valid
    document; raises EventValidationError naming the field for any rule the schema cannot
    express."""
    out: dict[str, Sequence[Any]] = {}
    for name, f in fields.items():
        text = obj.get(name)
        if text is None:  # an optional field left out (the schema checked required ones)
            continue
        out[name] = unpack_field(text, f, schema)
    for name, values in out.items():
        f = fields[name]
        if f.same_length_as is None or (f.empty_allowed and not values):
            continue
        other = out.get(f.same_length_as, obj.get(f.same_length_as))
        if isinstance(other, Sequence) and not isinstance(other, str) and len(values) != len(other):
            also = " (or none)" if f.empty_allowed else ""
            raise EventValidationError(
                f"has {len(values)} items, must have as many as {f.same_length_as} "
                f"({len(other)}){also}",
                name,
                schema,
            )
    return out
