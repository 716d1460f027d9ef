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
from typing import Annotated, Any, Literal, Union, cast

import msgspec
import orjson

from . import binary
from .errors import EventValidationError
from .types import EVENT_TYPES, Event, Producer
from .validation import _schema_files, load_schema, plain_b64_array, schemas_dir

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
    kind = schema.get("type")
    if None in values and (
        kind is None or (isinstance(kind, list) and len(kind) == 2 and "null" in kind)
    ):
        # An enum with null: the literal of the rest, or None.
        rest = {k: v for k, v in schema.items() if k != "type"}
        if kind is not None:
            rest["type"] = next(k for k in kind if k != "null")
        return Union[_literal([v for v in values if v is not None], rest), None]  # noqa: UP007
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
    if extra:
        raise Unsupported(f"{where}: keywords {sorted(extra)}")
    if kind == "string":
        meta: dict[str, Any] = {}
        if "minLength" in schema:
            meta["min_length"] = schema["minLength"]
        if "maxLength" in schema:
            meta["max_length"] = schema["maxLength"]
        if "pattern" in schema:
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
class TypedDecoder:
    """A schema's one-pass decoder: :meth:`decode` gives the typed event or None (undecided:
    run the full path)."""

    type_name: str
    version: int
    cls: type[Event]
    source: str  # the generated function's code, for reading and debugging
    run: Callable[[bytes | memoryview], Event | None]

    def decode(self, raw: bytes | memoryview) -> Event | None:
        return self.run(raw)


def _plain_struct(node: _Node, cls: type) -> bool:
    """Whether ``node`` is a closed object of exactly ``cls``'s fields, all required."""
    struct = node.verdict
    if node.free or not isinstance(struct, type) or not issubclass(struct, msgspec.Struct):
        return False
    names = {f.name for f in dataclasses.fields(cls)}
    info = msgspec.inspect.type_info(struct)
    return (
        isinstance(info, msgspec.inspect.StructType)
        and info.forbid_unknown_fields
        and {f.name for f in info.fields} == names
        and all(f.required for f in info.fields)
    )


def compile_schema(schema: Mapping[str, Any]) -> TypedDecoder:
    """The decoder of one schema document; raises Unsupported for a construct it does not
    translate exactly.

    The decoder is generated code, as dataclasses generate ``__init__``: one event is ~25
    fields, and a loop over field descriptors cost as much as the parse."""
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
    if hasattr(cls, "__post_init__") or cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise Unsupported(f"{cls.__name__}: a __post_init__ or frozen fields")
    props: dict[str, Any] = schema["properties"]
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    if set(props) - init != set(_FIXED) or not init <= set(props) or "producer" not in props:
        raise Unsupported(f"{type_}.v{version}: properties differ from {cls.__name__}'s fields")
    required = set(schema.get("required", []))
    layout = binary.layout(schema)
    name_space: dict[str, Any] = {
        "UNSET": msgspec.UNSET,
        "DecodeError": msgspec.DecodeError,
        "ValidationError": msgspec.ValidationError,
        "EventValidationError": EventValidationError,
        "loads": orjson.loads,
        "unpack": binary.unpack_field,
        "new": object.__new__,
        "cls": cls,
        "Producer": Producer,
        "SCHEMA": f"{type_}.v{version}",
    }
    fields: list[Any] = []
    checks: list[str] = []  # lines inside the try: parts and arrays
    producer = "Producer(**v_producer)"
    for name, sub in props.items():
        optional = name not in required
        if name in layout:
            # The bulk text is read as raw bytes, no str built: only a field whose one text
            # rule is the base64 pattern (which unpack_field's strict decode implies) can be.
            if not plain_b64_array(sub):
                raise Unsupported(f"{type_}.v{version}.{name}: rules beside base64")
            name_space[f"field_{name}"] = layout[name]
            # the text's raw bytes, quotes and all: an escape in them fails the strict base64
            step = [
                f"v_{name} = memoryview(v_{name})",
                f"if v_{name}[0] != 34: return None",  # not a string (34 is a quote)
                f"v_{name} = unpack(v_{name}[1:-1], field_{name}, SCHEMA)",
            ]
            t: Any = msgspec.Raw
        else:
            node = _node(sub, f"{type_}.v{version}.{name}")
            t, step = node.decode, []
            if name == "producer" and _plain_struct(node, Producer):
                t = node.verdict  # a dataclass whatever the order: decoded straight to it
                names = [k.name for k in msgspec.structs.fields(cast(Any, t))]
                producer = f"Producer({', '.join(f'{k}=v_producer.{k}' for k in names)})"
            elif node.verdict is not None or node.free:
                verdict = node.verdict if node.verdict is not None else node.decode
                name_space[f"check_{name}"] = msgspec.json.Decoder(verdict).decode
                # checked against its compiled type, its value parsed as the full path does
                step = [f"check_{name}(v_{name})", f"v_{name} = loads(memoryview(v_{name}))"]
                t = msgspec.Raw
        checks.append(f"v_{name} = s.{name}")
        if step and optional:
            checks.append(f"if v_{name} is not UNSET:")
            checks += [f"    {line}" for line in step]
        else:
            checks += step
        if optional:
            fields.append((name, Union[t, msgspec.UnsetType], msgspec.UNSET))  # noqa: UP007
        else:
            fields.append((name, t))
    struct = msgspec.defstruct(
        f"{cls.__name__}V{version}", fields, forbid_unknown_fields=True, kw_only=True
    )
    name_space["top"] = msgspec.json.Decoder(struct).decode
    ties: list[str] = []
    for name, array in layout.items():
        other = array.same_length_as
        if other is None:
            continue
        cond = [f"v_{name} is not UNSET", f"v_{other} is not UNSET"]
        if array.empty_allowed:
            cond.append(f"len(v_{name})")
        if other not in layout:
            cond.append(f"not isinstance(v_{other}, str)")
        ties.append(f"if {' and '.join(cond)} and len(v_{name}) != len(v_{other}): return None")
    build: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name in _FIXED:  # the in-memory values, whatever the wire version
            name_space[f"fixed_{f.name}"] = f.default
            build.append(f"e.{f.name} = fixed_{f.name}")
            continue
        if f.default_factory is not dataclasses.MISSING:
            name_space[f"factory_{f.name}"] = f.default_factory
            fallback = f"factory_{f.name}()"
        elif f.default is not dataclasses.MISSING:
            name_space[f"default_{f.name}"] = f.default
            fallback = f"default_{f.name}"
        else:
            fallback = None
        value = producer if f.name == "producer" else f"v_{f.name}"
        if fallback is None and f.name not in required:
            raise Unsupported(f"{type_}.v{version}: {f.name} is optional but has no default")
        if fallback is None or f.name in required:
            build.append(f"e.{f.name} = {value}")
        else:
            build.append(f"e.{f.name} = {fallback} if v_{f.name} is UNSET else {value}")
    body = [
        "def decode(raw):",
        "    try:",
        "        s = top(raw)",
        "    except (ValidationError, DecodeError):",
        "        return None",
        "    try:",
        *(f"        {line}" for line in checks),
        "    except (ValueError, ValidationError, EventValidationError):",
        "        return None",
        *(f"    {line}" for line in ties),
        "    e = new(cls)",
        *(f"    {line}" for line in build),
        "    return e",
    ]
    source = "\n".join(body) + "\n"
    exec(compile(source, f"<typed decoder {type_}.v{version}>", "exec"), name_space)  # noqa: S102
    return TypedDecoder(type_, version, cls, source, name_space["decode"])


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
    decoder = _by_prefix(schemas_dir()).get(m[0])
    if decoder is None or (expected_type is not None and decoder.type_name != expected_type):
        return None
    event = decoder.run(raw)
    return None if event is None else (event, decoder.version)


@cache
def _by_prefix(root: Path) -> dict[bytes, TypedDecoder]:
    # Keyed by the bytes the prefix pattern matches, as the codec writes them.
    return {
        f'"type":"{t}","schema_version":{v}'.encode(): d for (t, v), d in _decoders(root).items()
    }
