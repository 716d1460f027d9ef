"""The schema files are the public contract; prove the fast path honours them exactly.

For every event type, valid documents and many mutated ones (each required field
dropped, each property and nested value replaced by values of every JSON type,
extra properties) are checked three ways: the reference `jsonschema`
Draft7Validator on the file, the compiled fastjsonschema validator, and
`pipeline.events.decode`. All three must agree on every document.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import fastjsonschema
import orjson
import pytest
from jsonschema import Draft7Validator

from pipeline.events import EVENT_TYPES, TurnEvent, decode, schema_files, to_dict
from pipeline.events.examples import examples

SCHEMAS: dict[str, dict[str, Any]] = {
    t: json.loads(path.read_text()) for (t, v), path in schema_files().items() if v == 1
}
EXAMPLES = {t: to_dict(e) for t, e in examples().items()}
ENVELOPE = ["event_id", "type", "schema_version", "ts_ms", "producer", "parents"]
TURN_SCOPED = {"interaction", "next_state", "prm_score", "hint", "path_penalty", "reward", "sample"}

# One value of every JSON kind, plus boundary values the schemas care about.
PALETTE: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    1.0,
    0.5,
    -0.5,
    2**40,
    "",
    "x",
    "hello world!",
    "a" * 64,
    "0" * 64,
    "stop",
    "user",
    "candidate",
    "main",
    [],
    [1],
    [-1],
    ["x"],
    [None],
    [{}],
    {},
    {"k": 1},
    {"k": "v"},
    {"role": "user", "content": "hi"},
]

Path = tuple[str | int, ...]


def paths(node: Any, prefix: Path = ()) -> Iterator[Path]:
    """Every location in a document; long arrays (token ids) give their first and last item."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield prefix + (k,)
            yield from paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i in range(len(node)) if len(node) <= 8 else (0, len(node) - 1):
            yield prefix + (i,)
            yield from paths(node[i], prefix + (i,))


def get_parent(doc: Any, path: Path) -> Any:
    for part in path[:-1]:
        doc = doc[part]
    return doc


def with_value(doc: dict, path: Path, value: Any) -> dict:
    out = copy.deepcopy(doc)
    get_parent(out, path)[path[-1]] = value
    return out


def without(doc: dict, path: Path) -> dict:
    out = copy.deepcopy(doc)
    parent = get_parent(out, path)
    if isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent.pop(path[-1])
    return out


def minimal(type_: str) -> dict:
    schema = SCHEMAS[type_]
    return {k: v for k, v in EXAMPLES[type_].items() if k in schema["required"]}


def documents(type_: str) -> Iterator[tuple[str, Any]]:
    doc = EXAMPLES[type_]
    yield "example", doc
    yield "minimal", minimal(type_)
    for value in (None, [], "x", 1):
        yield f"root={value!r}", value
    for path in paths(doc):
        yield f"drop {path}", without(doc, path)
        for value in PALETTE:
            yield f"{path}={value!r}", with_value(doc, path, value)
    for path in [(), *paths(doc)]:
        if isinstance(
            get_parent(doc, path + ("zz_extra",)), dict
        ):  # the node at `path` is an object
            yield f"extra at {path}", with_value(doc, path + ("zz_extra",), 1)


def verdicts(type_: str, doc: Any, fast: Any, ref: Draft7Validator) -> tuple[bool, bool, bool]:
    reference = ref.is_valid(doc)
    try:
        fast(copy.deepcopy(doc))
        compiled = True
    except fastjsonschema.JsonSchemaValueException:
        compiled = False
    try:
        decode(orjson.dumps(doc))
        decoded = True
    except ValueError:
        decoded = False
    return reference, compiled, decoded


def test_one_schema_file_per_event_type() -> None:
    assert set(SCHEMAS) == set(EVENT_TYPES)
    for (type_, version), path in schema_files().items():
        assert path.name == f"{type_}.v{version}.json"


@pytest.mark.parametrize("type_", sorted(EVENT_TYPES))
def test_fast_path_agrees_with_reference_validator(type_: str) -> None:
    schema = SCHEMAS[type_]
    ref = Draft7Validator(schema)
    fast = fastjsonschema.compile(schema, use_default=False)
    accepted = rejected = 0
    disagreements = []
    for label, doc in documents(type_):
        reference, compiled, decoded = verdicts(type_, doc, fast, ref)
        if not reference == compiled == decoded:
            disagreements.append(
                f"{label}: jsonschema={reference} fastjsonschema={compiled} decode={decoded}"
            )
        accepted += reference
        rejected += not reference
    assert not disagreements, "\n".join(disagreements[:20])
    assert ref.is_valid(EXAMPLES[type_]) and ref.is_valid(minimal(type_))
    assert accepted >= 10 and rejected >= 50, (accepted, rejected)


@pytest.mark.parametrize("type_", sorted(EVENT_TYPES))
def test_each_required_field_is_required(type_: str) -> None:
    ref = Draft7Validator(SCHEMAS[type_])
    for name in SCHEMAS[type_]["required"]:
        doc = without(EXAMPLES[type_], (name,))
        assert not ref.is_valid(doc), name
        with pytest.raises(ValueError):
            decode(orjson.dumps(doc))


@pytest.mark.parametrize("type_", sorted(EVENT_TYPES))
def test_schema_file_is_well_formed(type_: str) -> None:
    schema = SCHEMAS[type_]
    Draft7Validator.check_schema(schema)
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema["$id"] == f"https://liverl.dev/schemas/{type_}.v1.json"
    assert schema["title"] and schema["description"]
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert schema["properties"]["type"]["const"] == type_
    assert "$ref" not in json.dumps(schema)
    assert set(schema["required"]) <= set(schema["properties"])


@pytest.mark.parametrize("type_", sorted(EVENT_TYPES))
def test_dataclass_matches_schema(type_: str) -> None:
    schema = SCHEMAS[type_]
    fields = {f.name: f for f in dataclasses.fields(EVENT_TYPES[type_])}
    assert list(fields) == list(schema["properties"])
    for name, f in fields.items():
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        if not has_default:
            assert name in schema["required"], (
                f"{name} has no default but the schema makes it optional"
            )
        if name not in schema["required"]:
            assert has_default, f"{name} is optional in the schema but has no default"
        if "default" in schema["properties"][name]:
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            assert value == schema["properties"][name]["default"], name
    assert issubclass(EVENT_TYPES[type_], TurnEvent) == (type_ in TURN_SCOPED)


def test_envelope_is_identical_across_files() -> None:
    def envelope(type_: str, names: list[str]) -> tuple[Any, ...]:
        schema = SCHEMAS[type_]
        props = copy.deepcopy({n: schema["properties"][n] for n in names})
        if "type" in props:
            props["type"]["const"] = "<type>"
        required = [n for n in schema["required"] if n in names]
        return props, required

    reference = envelope("interaction", ENVELOPE)
    turn_reference = envelope("interaction", ["session_id", "turn"])
    for type_, schema in SCHEMAS.items():
        assert envelope(type_, ENVELOPE) == reference, type_
        assert schema["required"][: len(ENVELOPE)] == ENVELOPE, type_
        assert list(schema["properties"])[: len(ENVELOPE)] == ENVELOPE, type_
        if type_ in TURN_SCOPED:
            assert envelope(type_, ["session_id", "turn"]) == turn_reference, type_
        else:
            assert (
                "session_id" not in schema["properties"] and "turn" not in schema["properties"]
            ), type_


# Bulk numeric arrays (token ids, log-probs, loss masks) take a fast path that skips
# per-element schema checks when a C-speed check proves them valid; these mutations put
# every kind of bad (and borderline) element at the start, middle and end of each array.
BULK_ELEMENTS: list[Any] = [
    -1,
    2,
    0,
    1,
    1.0,
    -0.0,
    0.5,
    1e300,
    2**63,
    -(2**63),
    True,
    False,
    None,
    "1",
    [],
    {},
    [0],
]


def _bulk_mutations(type_: str) -> Iterator[tuple[str, dict[str, Any]]]:
    base = EXAMPLES[type_]
    for name, prop in SCHEMAS[type_]["properties"].items():
        items = prop.get("items")
        if prop.get("type") != "array" or not isinstance(items, dict):
            continue
        if items.get("type") not in ("integer", "number") or not base.get(name):
            continue
        size = len(base[name])
        for where in sorted({0, size // 2, size - 1}):
            for element in BULK_ELEMENTS:
                doc = copy.deepcopy(base)
                doc[name][where] = element
                yield f"{name}[{where}]={element!r}", doc


@pytest.mark.parametrize("type_", ["interaction", "sample"])
def test_bulk_array_fast_path_agrees_with_reference(type_: str) -> None:
    reference = Draft7Validator(SCHEMAS[type_])
    cases = list(_bulk_mutations(type_))
    assert len(cases) > 100
    verdicts = set()
    for label, doc in cases:
        expected = reference.is_valid(doc)
        verdicts.add(expected)
        try:
            decode(orjson.dumps(doc))
            got = True
        except ValueError:
            got = False
        assert got == expected, f"{type_} {label}: reference says {expected}, decode says {got}"
    assert verdicts == {True, False}, "mutations must include both valid and invalid documents"
