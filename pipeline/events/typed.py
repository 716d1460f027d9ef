"""One-pass decoding: msgspec types compiled from the schema files.

The schema files stay the contract, and `validation.py` checks a parsed document against
them. That costs three passes over an event: orjson builds the objects, the compiled
validator walks them, `codec` copies them into the dataclass. Here each schema is compiled
once into a msgspec ``Struct`` whose field types carry the schema's rules (types, bounds,
lengths, patterns, consts, enums, required and unknown fields), so parsing *is* validating.

The fast path only ever shortcuts "valid": a document it rejects, or a schema construct it
does not translate, goes to the full path (orjson, the compiled validator), whose verdict and
error message stand. tests/test_events_typed.py proves, on the contract corpus, that what it
accepts the full path accepts, as the same event.

What keeps the two in agreement:

* typed integers are bounded to int64 (msgspec's bound; orjson parses past 2⁶⁴ as a float),
  so a larger one takes the full path;
* a field that holds objects or free-form JSON is decoded twice from its raw bytes: by
  msgspec against its compiled type (the verdict: nested objects checked as closed or open
  Structs) and by orjson for its value, exactly as the full path builds it (dicts in
  document order with unknown keys kept, integers past 64 bits as floats);
* base64 array fields (v2) are read as raw bytes, not text: `binary.unpack_field` checks them
  as on the full path, and an escape in them fails its strict base64.
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import re
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import msgspec
import orjson

from . import binary
from .errors import EventValidationError
from .types import EVENT_TYPES, Event, Producer
from .validation import _B64_KEYS, B64_PATTERN, _schema_files, load_schema, schemas_dir

INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # msgspec's bounds fit an int64; larger: full path
_NOTES = {"description", "title", "default", "$schema", "$id", "examples", binary.ANNOTATION}
_SCALAR_KEYS = {
    "string": {"minLength", "maxLength", "pattern"},
    "integer": {"minimum", "maximum"},
    "number": {"minimum", "maximum"},
    "boolean": set(),
    "null": set(),
    "array": {"items", "minItems", "maxItems"},
    "object": {"properties", "required", "additionalProperties"},
}
_FIXED = ("type", "schema_version")
_PREFIX = re.compile(rb'"type":"([a-z_]+)","schema_version":([0-9]+)')


class Unsupported(Exception):
    """A schema construct this module does not translate exactly; that type keeps the
    full path only."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Node:
    """One compiled subschema: what msgspec decodes it as, the type its raw bytes are checked
    against when that is not enough (None: decoding checks everything), and whether it holds
    free-form JSON (whose value orjson parses)."""

    decode: Any
    verdict: Any | None
    free: bool


_ANY = _Node(Any, None, True)


def _int(schema: Mapping[str, Any]) -> Any:
    low, high = schema.get("minimum"), schema.get("maximum")
    ge = INT_MIN if low is None else max(INT_MIN, math.ceil(low))
    le = INT_MAX if high is None else min(INT_MAX, math.floor(high))
    return Annotated[int, msgspec.Meta(ge=ge, le=le)]


def _float(schema: Mapping[str, Any]) -> Any:
    bounds: dict[str, Any] = {
        k: float(schema[s]) for s, k in (("minimum", "ge"), ("maximum", "le")) if s in schema
    }
    return Annotated[float, msgspec.Meta(**bounds)] if bounds else float


def _literal(values: list[Any], schema: Mapping[str, Any]) -> Any:
    if None in values and schema.get("type") in (
        None,
        ["integer", "null"],
        ["string", "null"],
        ["null", "integer"],
        ["null", "string"],
    ):
        rest = [v for v in values if v is not None]
        kind = schema.get("type")
        inner = None if kind is None else next(k for k in kind if k != "null")
        core = _literal(
            rest,
            {k: v for k, v in schema.items() if k != "type"}
            | ({} if inner is None else {"type": inner}),
        )
        return Union[core, None]  # noqa: UP007
    kinds = {type(v) for v in values}
    if not values or not (kinds == {str} or kinds == {int}):
        raise Unsupported(f"enum/const of {sorted(k.__name__ for k in kinds)}")
    declared = schema.get("type")
    want = "string" if kinds == {str} else "integer"
    if declared not in (None, want) and not (want == "integer" and declared == "number"):
        raise Unsupported(f"enum/const of {want} under type {declared!r}")
    if set(schema) - _NOTES - {"type", "enum", "const"}:
        raise Unsupported("enum/const beside other keywords")
    return Literal[tuple(values)]


def _node(schema: Any, where: str) -> _Node:
    if not isinstance(schema, dict):
        raise Unsupported(f"{where}: schema {schema!r}")
    if schema == {} or set(schema) <= _NOTES:
        return _ANY
    if "const" in schema:
        return _Node(_literal([schema["const"]], schema), None, False)
    if "enum" in schema:
        return _Node(_literal(list(schema["enum"]), schema), None, False)
    kind = schema.get("type")
    if isinstance(kind, list):
        if len(set(kind)) != len(kind) or not kind:
            raise Unsupported(f"{where}: type {kind!r}")
        # Each type of the list reads its own keywords (JSON Schema applies the rest only
        # to values of the types they are for).
        parts = [
            _node(
                {
                    key: v
                    for key, v in schema.items()
                    if key in _NOTES or key in _SCALAR_KEYS.get(k, set())
                }
                | {"type": k},
                where,
            )
            for k in kind
        ]
        allowed = set().union(*(_SCALAR_KEYS.get(k, set()) for k in kind))
        if set(schema) - _NOTES - {"type"} - allowed:
            raise Unsupported(f"{where}: keywords {sorted(set(schema) - _NOTES - allowed)}")
        verdicts = [p.verdict if p.verdict is not None else p.decode for p in parts]
        checked = any(p.verdict is not None for p in parts)
        return _Node(
            Union[tuple(p.decode for p in parts)],  # noqa: UP007 (a runtime tuple)
            Union[tuple(verdicts)] if checked else None,  # noqa: UP007
            any(p.free for p in parts),
        )
    if kind not in _SCALAR_KEYS:
        raise Unsupported(f"{where}: type {kind!r}")
    extra = set(schema) - _NOTES - {"type"} - _SCALAR_KEYS[kind]
    if kind == "string" and binary.ANNOTATION in schema:
        extra -= _B64_KEYS
    if extra:
        raise Unsupported(f"{where}: keywords {sorted(extra)}")
    if kind == "string":
        meta: dict[str, Any] = {}
        if "minLength" in schema:
            meta["min_length"] = schema["minLength"]
        if "maxLength" in schema:
            meta["max_length"] = schema["maxLength"]
        # A v2 array's base64 pattern is implied by the strict decode in `binary.unpack_field`.
        if "pattern" in schema and not (
            binary.ANNOTATION in schema and schema["pattern"] == B64_PATTERN
        ):
            meta["pattern"] = schema["pattern"]
        return _Node(Annotated[str, msgspec.Meta(**meta)] if meta else str, None, False)
    if kind == "integer":
        return _Node(_int(schema), None, False)
    if kind == "number":
        return _Node(Union[_int(schema), _float(schema)], None, False)  # noqa: UP007
    if kind == "boolean":
        return _Node(bool, None, False)
    if kind == "null":
        return _Node(None, None, False)
    if kind == "array":
        item = _node(schema.get("items", {}), f"{where}[]")
        meta = {}
        if "minItems" in schema:
            meta["min_length"] = schema["minItems"]
        if "maxItems" in schema:
            meta["max_length"] = schema["maxItems"]

        def sized(t: Any) -> Any:
            return Annotated[list[t], msgspec.Meta(**meta)] if meta else list[t]

        verdict = None if item.verdict is None else sized(item.verdict)
        return _Node(sized(item.decode), verdict, item.free)
    return _object(schema, where)


def _object(schema: Mapping[str, Any], where: str) -> _Node:
    props: dict[str, Any] = schema.get("properties", {})
    required = list(schema.get("required", []))
    extra = schema.get("additionalProperties", True)
    if not props and not required:
        if extra is False:
            raise Unsupported(f"{where}: an object that admits nothing but {{}}")
        value = _ANY if extra is True else _node(extra, f"{where}.*")
        verdict = None if value.verdict is None else dict[str, value.verdict]  # type: ignore[name-defined]
        return _Node(dict[str, value.decode], verdict, value.free)  # type: ignore[name-defined]
    if extra not in (True, False) or set(required) - set(props):
        raise Unsupported(
            f"{where}: additionalProperties beside properties, or a required "
            "field without a property"
        )
    fields: list[Any] = []
    free = extra is True
    for name, sub in props.items():
        if not name.isidentifier() or keyword.iskeyword(name):
            raise Unsupported(f"{where}: property {name!r}")
        node = _node(sub, f"{where}.{name}")
        free |= node.free
        t = node.verdict if node.verdict is not None else node.decode
        if name in required:
            fields.append((name, t))
        else:
            fields.append((name, Union[t, msgspec.UnsetType], msgspec.UNSET))  # noqa: UP007
    struct = msgspec.defstruct(
        f"Check_{re.sub(r'[^A-Za-z0-9_]', '_', where)}",
        fields,
        forbid_unknown_fields=extra is False,
        kw_only=True,
    )
    # Decoded as a dict (document order, unknown keys kept), checked by converting.
    return _Node(dict[str, Any], struct, free)


@dataclasses.dataclass(frozen=True, slots=True)
class _Part:
    """A top-level field that holds objects or free-form JSON: checked by decoding its raw
    bytes against its compiled type, its value parsed by orjson (as the full path parses it:
    dicts in document order, integers past 64 bits as floats)."""

    index: int
    verdict: msgspec.json.Decoder[Any]

    def value(self, raw: msgspec.Raw) -> Any:
        """The field's value; raises ValueError when the fast path cannot decide it."""
        try:
            self.verdict.decode(raw)
        except msgspec.ValidationError:
            raise ValueError from None
        return orjson.loads(memoryview(raw))


@dataclasses.dataclass(frozen=True, slots=True)
class _Slot:
    """Where one dataclass field's value comes from: the decoded tuple (``index``), else its
    default (absent optional fields, the in-memory ``type`` and ``schema_version``)."""

    name: str
    index: int | None
    default: Any
    factory: Callable[[], Any] | None


@dataclasses.dataclass(frozen=True, slots=True)
class TypedDecoder:
    """A schema's one-pass decoder: :meth:`decode` gives the typed event or None (undecided:
    run the full path)."""

    type_name: str
    version: int
    decoder: msgspec.json.Decoder[Any]
    parts: tuple[_Part, ...]
    arrays: tuple[tuple[int, binary.ArrayField], ...]
    ties: tuple[tuple[int, int, bool], ...]  # (array index, index it matches, empty allowed)
    slots: tuple[_Slot, ...]
    cls: type[Event]

    def decode(self, raw: bytes | memoryview) -> Event | None:
        try:
            values = list(msgspec.structs.astuple(self.decoder.decode(raw)))
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
        unset = msgspec.UNSET
        try:
            for part in self.parts:
                if values[part.index] is not unset:
                    values[part.index] = part.value(values[part.index])
            schema = f"{self.type_name}.v{self.version}"
            for index, f in self.arrays:
                text = values[index]
                if text is not unset:
                    # The text's raw bytes, quotes and all: an escape in them fails base64.
                    text = bytes(text)
                    if text[:1] != b'"':
                        return None
                    values[index] = binary.unpack_field(text[1:-1], f, schema)
        except (ValueError, EventValidationError):
            return None
        for index, other, empty_allowed in self.ties:
            mine, theirs = values[index], values[other]
            if mine is unset or theirs is unset or (empty_allowed and not mine):
                continue
            if not isinstance(theirs, str) and len(mine) != len(theirs):
                return None
        event: Event = object.__new__(self.cls)
        for slot in self.slots:
            value = unset if slot.index is None else values[slot.index]
            if value is unset:
                value = slot.default if slot.factory is None else slot.factory()
            object.__setattr__(event, slot.name, value)
        producer = event.producer
        if not isinstance(producer, dict):
            return None
        object.__setattr__(event, "producer", Producer(**producer))
        return event


def compile_schema(schema: Mapping[str, Any]) -> TypedDecoder:
    """The decoder of one schema document; raises Unsupported for a construct it does not
    translate exactly."""
    type_ = schema.get("properties", {}).get("type", {}).get("const")
    version = schema.get("properties", {}).get("schema_version", {}).get("const")
    if type_ not in EVENT_TYPES or not isinstance(version, int):
        raise Unsupported(f"{schema.get('$id')}: no const type and schema_version")
    if schema.get("additionalProperties") is not False or set(schema) - _NOTES - {
        "type",
        "properties",
        "required",
        "additionalProperties",
    }:
        raise Unsupported(f"{type_}.v{version}: the top level must be a closed object")
    cls = EVENT_TYPES[type_]
    if hasattr(cls, "__post_init__"):
        raise Unsupported(f"{cls.__name__} has a __post_init__ the fast path would skip")
    props: dict[str, Any] = schema["properties"]
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    if set(props) - init != set(_FIXED) or not init <= set(props):
        raise Unsupported(f"{type_}.v{version}: properties differ from {cls.__name__}'s fields")
    required = set(schema.get("required", []))
    layout = binary.layout(schema)
    position = {name: i for i, name in enumerate(props)}
    fields: list[Any] = []
    parts: list[_Part] = []
    for index, (name, sub) in enumerate(props.items()):
        node = _node(sub, f"{type_}.v{version}.{name}")
        t = node.decode
        if node.verdict is not None or node.free:
            verdict = node.verdict if node.verdict is not None else node.decode
            parts.append(_Part(index, msgspec.json.Decoder(verdict)))
            t = msgspec.Raw
        elif name in layout:
            t = msgspec.Raw  # no str built for the bulk text: unpack_field reads the bytes
        if name in required:
            fields.append((name, t))
        else:
            fields.append((name, Union[t, msgspec.UnsetType], msgspec.UNSET))  # noqa: UP007
    struct = msgspec.defstruct(
        f"{cls.__name__}V{version}", fields, forbid_unknown_fields=True, kw_only=True
    )
    slots = []
    for f in dataclasses.fields(cls):
        factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
        default = None if f.default is dataclasses.MISSING else f.default
        slots.append(
            _Slot(f.name, None if f.name in _FIXED else position[f.name], default, factory)
        )
    return TypedDecoder(
        type_name=type_,
        version=version,
        decoder=msgspec.json.Decoder(struct),
        parts=tuple(parts),
        arrays=tuple((position[n], f) for n, f in layout.items()),
        ties=tuple(
            (position[n], position[f.same_length_as], f.empty_allowed)
            for n, f in layout.items()
            if f.same_length_as is not None
        ),
        slots=tuple(slots),
        cls=cls,
    )


@cache
def _decoders(root: Path) -> dict[tuple[str, int], TypedDecoder]:
    out: dict[tuple[str, int], TypedDecoder] = {}
    for type_, version in _schema_files(root):
        try:
            out[(type_, version)] = compile_schema(load_schema(type_, version))
        except Unsupported:
            continue
    return out


def decoders() -> dict[tuple[str, int], TypedDecoder]:
    """Every schema's one-pass decoder, by (type, version); a schema with a construct this
    module does not translate has none (its events take the full path)."""
    return _decoders(schemas_dir())


def decode_fast(
    raw: bytes | memoryview, expected_type: str | None = None
) -> tuple[Event, int] | None:
    """The typed event and its schema version if the one-pass decoder of the type and
    version the value names accepts it; None means undecided (run the full path), never
    invalid."""
    m = _PREFIX.search(raw, 0, 256)
    if m is None:
        return None
    type_ = m[1].decode()
    if expected_type is not None and type_ != expected_type:
        return None
    version = int(m[2])
    decoder = decoders().get((type_, version))
    event = None if decoder is None else decoder.decode(raw)
    return None if event is None else (event, version)
