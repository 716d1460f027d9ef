"""The one-pass decoder (pipeline/events/typed.py) against the full path, on the contract corpus.

The one-pass decoder may only shortcut "valid": whatever it accepts, the full path (orjson,
the schema validator, the dataclass) must accept as the same event, with the same bytes when
re-encoded; whatever it declines goes to the full path. The corpus is the contract tests'
(every field dropped, replaced by every JSON kind, extra fields; v2's binary mutations) plus
byte-level cases a parsed-then-dumped document cannot hold: escapes, duplicate keys, key
order, integers past 64 bits, invalid UTF-8.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from pipeline import events
from pipeline.events import EVENT_TYPES, encode, examples, typed
from pipeline.events.examples import interaction

from .test_codec_v2 import V2, binary_mutations, schema_mutations, v2_doc
from .test_schemas_contract import _bulk_mutations, documents


def full(raw: bytes) -> events.Event | None:
    try:
        return events.decode(raw, one_pass=False)
    except events.EventValidationError:
        return None


def agree(raw: bytes) -> tuple[bool, bool]:
    """(one pass accepted, full path accepted); fails if the one pass accepts what the full
    path does not, or gives another event."""
    fast = typed.decode_fast(raw)
    reference = full(raw)
    if fast is not None:
        event, version = fast
        assert reference is not None, f"one pass accepted what the full path rejects: {raw[:200]!r}"
        assert event == reference
        assert type(event) is type(reference)
        assert version == orjson.loads(raw)["schema_version"]
        # The same bytes when re-sent (dict order, int or float): in its version, and in v1.
        for v in {1, version}:
            assert encode(event, version=v) == encode(reference, version=v)
    return fast is not None, reference is not None


def corpus(type_: str) -> Iterator[tuple[str, Any]]:
    yield from documents(type_)
    if type_ in V2:
        yield from schema_mutations(type_)
        yield from binary_mutations(type_)
    if type_ in ("interaction", "sample"):
        yield from _bulk_mutations(type_)


@pytest.mark.parametrize("type_", sorted(EVENT_TYPES))
def test_one_pass_accepts_only_what_the_full_path_accepts(type_: str) -> None:
    taken = valid = 0
    for _label, doc in corpus(type_):
        fast, reference = agree(orjson.dumps(doc))
        taken += fast
        valid += reference
    # The shortcut is taken for most valid documents; the full path takes the numbers JSON
    # Schema counts as integers and msgspec does not (1.0, -0.0, 1e300) and ints past int64.
    assert valid >= 10 and taken >= 0.8 * valid, (taken, valid)


def test_every_schema_file_compiles() -> None:
    assert set(typed.decoders()) == set(events.schema_files())


@pytest.mark.parametrize("version", [1, 2])
def test_the_bench_interaction_takes_one_pass(version: int) -> None:
    event = interaction(prompt_tokens=2048, response_tokens=512, text_repeat=5)
    raw = encode(event, version=version)
    fast = typed.decode_fast(raw)
    assert fast is not None and fast[0] == event and fast[1] == version


def _raw_cases() -> Iterator[tuple[str, bytes]]:
    for type_, event in examples.examples().items():
        for version in (1, 2):
            raw = encode(event, version=version)
            doc = orjson.loads(raw)
            yield f"{type_}.v{version}", raw
            # An escaped character the decoders must read alike, in the event id.
            yield f"{type_} escape", raw.replace(b'"event_id":"', b'"event_id":"\\u0041\\/', 1)
            yield f"{type_} lone surrogate", raw.replace(b'"event_id":"', b'"event_id":"\\ud800', 1)
            yield f"{type_} invalid utf-8", raw.replace(b'"event_id":"', b'"event_id":"\xff', 1)
            yield f"{type_} control char", raw.replace(b'"event_id":"', b'"event_id":"\x01', 1)
            # A duplicate key: the last one counts, for both.
            yield f"{type_} duplicate", raw.replace(b'"ts_ms":', b'"ts_ms":"x","ts_ms":', 1)
            yield f"{type_} duplicate bad", raw.replace(b'"ts_ms":', b'"ts_ms":5,"ts_ms":"x"', 1)
            yield f"{type_} whitespace", b" \n" + orjson.dumps(doc, option=orjson.OPT_INDENT_2)
            yield f"{type_} reordered", orjson.dumps(dict(reversed(list(doc.items()))))
            yield f"{type_} trailing", raw + b" x"
            yield f"{type_} trailing NUL", raw + b"\x00"
            yield f"{type_} BOM", b"\xef\xbb\xbf" + raw
            yield f"{type_} truncated", raw[:-1]
            for wide in (2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30):
                yield (
                    f"{type_} ts_ms={wide}",
                    orjson.dumps({**doc, "ts_ms": 0}).replace(
                        b'"ts_ms":0', b'"ts_ms":' + str(wide).encode()
                    ),
                )
            yield f"{type_} float ts", raw.replace(b'"ts_ms":', b'"ts_ms":1e3,"x":', 1)
    base = v2_doc("interaction")
    for text in ('[{"type":"text","text":"hi","n":%d}]', '{"a":%d}'):
        for wide in (2**64 - 1, 2**64, 10**40, -(2**63) - 1):
            doc = {**base, "messages": [{"role": "user", "content": "@"}]}
            if text.startswith("{"):
                doc = {**base, "sampling": "@"}
            raw = orjson.dumps(doc)
            value = (text % wide).encode()
            yield f"free-form int {wide}", raw.replace(b'"@"', value, 1)
    prompt = base["prompt_token_ids"]
    for escaped in ("\\/", "\\u0041"):
        yield (
            f"escape in base64 {escaped}",
            orjson.dumps(base).replace(
                prompt.encode(), prompt[:-4].encode() + escaped.encode() + b"AAA=", 1
            ),
        )


def test_byte_level_cases_agree() -> None:
    labels = []
    for label, raw in _raw_cases():
        fast, reference = agree(raw)
        labels.append((label, fast, reference))
    # Some are taken in one pass, some are rejected by both, some only the full path takes.
    outcomes = {(fast, reference) for _label, fast, reference in labels}
    assert outcomes == {(True, True), (False, False), (False, True)}, outcomes


def test_wide_integers_keep_the_full_paths_value() -> None:
    """orjson reads an integer past 64 bits as a float; so must the event."""
    base = v2_doc("interaction")
    raw = orjson.dumps({**base, "sampling": {"seed": "@"}}).replace(b'"@"', str(2**64).encode(), 1)
    event = events.decode(raw)
    assert event.sampling["seed"] == float(2**64)  # type: ignore[attr-defined]
    assert isinstance(event.sampling["seed"], float)  # type: ignore[attr-defined]


def test_the_expected_type_and_the_header_still_rule() -> None:
    raw = encode(examples.examples()["reward"], version=2)
    with pytest.raises(events.EventValidationError, match="expected type 'sample'"):
        events.decode(raw, expected_type="sample")
    with pytest.raises(events.EventValidationError, match="header"):
        events.decode(raw, version_header=b"2")
    assert events.decode(raw, version_header=b"1") == examples.examples()["reward"]


def test_a_base64_field_with_more_rules_keeps_the_full_path() -> None:
    """The one pass reads a v2 array's text as raw bytes and checks only what base64 implies:
    a schema that puts another rule on that text (here a length) gets no one-pass decoder."""
    schema = copy.deepcopy(V2["interaction"])
    schema["properties"]["prompt_token_ids"]["maxLength"] = 8
    with pytest.raises(typed.Unsupported, match="prompt_token_ids: rules beside base64"):
        typed.compile_schema(schema)
    assert typed.compile_schema(V2["interaction"]).version == 2
