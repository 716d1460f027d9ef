"""Unit tests for pipeline.events: round trips, rejections with the field named, event ids."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest

from pipeline.events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    DeadLetter,
    EventValidationError,
    Hint,
    Interaction,
    Producer,
    decode,
    derive_event_id,
    encode,
    from_dict,
    headers,
    key,
    new_event_id,
    to_dict,
    validate,
)
from pipeline.events.examples import examples, interaction

EXAMPLES = examples()


def doc(type_: str) -> dict:
    return to_dict(EXAMPLES[type_])


def reject(raw: bytes, **kwargs) -> EventValidationError:
    with pytest.raises(EventValidationError) as info:
        decode(raw, **kwargs)
    return info.value


def test_every_type_has_an_example() -> None:
    assert set(EXAMPLES) == set(EVENT_TYPES)
    # found from the dataclasses: one per schema file in schemas/
    schemas = Path(__file__).resolve().parents[1] / "schemas"
    assert set(EVENT_TYPES) == {p.name.split(".v")[0] for p in schemas.glob("*.json")}


@pytest.mark.parametrize("type_", sorted(EVENT_TYPES))
def test_a_minimal_event_is_built_from_each_schema(type_: str) -> None:
    """A new event type needs no hand-written example: its schema gives a valid one (what
    examples() uses for a type it has none for), checked by the reference validator too."""
    import json

    from jsonschema import Draft7Validator

    from pipeline.events import schema_files
    from pipeline.events.examples import synthesized

    event = synthesized(type_)
    doc = to_dict(event)
    schema = json.loads(schema_files()[(type_, 1)].read_text())
    assert list(Draft7Validator(schema).iter_errors(doc)) == []
    assert set(doc) >= set(schema["required"]) and decode(encode(event)) == event


def test_written_examples_are_kept_over_synthesized_ones() -> None:
    assert EXAMPLES["interaction"].messages and EXAMPLES["next_state"].kind == "user_reply"


def test_next_state_kinds_are_the_schemas() -> None:
    import json
    import typing

    from pipeline.events import schema_files
    from pipeline.events.types import NextStateKind

    schema = json.loads(schema_files()[("next_state", 1)].read_text())
    assert list(typing.get_args(NextStateKind)) == schema["properties"]["kind"]["enum"]


@pytest.mark.parametrize("type_", sorted(EVENT_TYPES))
def test_round_trip(type_: str) -> None:
    event = EXAMPLES[type_]
    raw = encode(event, validate=True)
    back = decode(raw, expected_type=type_)
    assert type(back) is EVENT_TYPES[type_]
    assert back == event
    assert back.type == type_ and back.schema_version == SCHEMA_VERSION
    assert isinstance(back.producer, Producer)
    assert encode(back) == raw
    assert from_dict(orjson.loads(raw)) == event


def test_optional_fields_default_when_absent() -> None:
    d = doc("interaction")
    for name in ("tools", "sampling", "turn_type", "session_done", "tool_calls"):
        del d[name]
    event = decode(orjson.dumps(d))
    assert isinstance(event, Interaction)
    assert event.tools == [] and event.sampling == {} and event.tool_calls == []
    assert event.turn_type == "main" and event.session_done is False


def test_group_id_and_scope_are_optional_and_backward_compatible() -> None:
    # Documents written before the fields existed still decode, with the defaults.
    d = doc("interaction")
    del d["group_id"]
    assert decode(orjson.dumps(d)).group_id is None  # type: ignore[attr-defined]
    n = doc("next_state")
    del n["scope"]
    assert decode(orjson.dumps(n)).scope == "turn"  # type: ignore[attr-defined]
    # New values round-trip; others are rejected with the field named.
    d["group_id"] = "task-42"
    assert decode(orjson.dumps(d)).group_id == "task-42"  # type: ignore[attr-defined]
    n["scope"] = "session"
    assert decode(orjson.dumps(n)).scope == "session"  # type: ignore[attr-defined]
    n["scope"] = "episode"
    assert reject(orjson.dumps(n)).field == "scope"
    d["group_id"] = ""
    assert reject(orjson.dumps(d)).field == "group_id"


def test_sample_opd_mask_and_penalty_are_optional_and_backward_compatible() -> None:
    # A sample written before the fields existed: OPD follows the loss mask, no path part.
    d = doc("sample")
    del d["opd_mask"], d["penalty"]
    d["loss_mask"] = [0] * len(d["response_token_ids"])
    old = decode(orjson.dumps(d))
    assert old.opd_mask == [] and old.penalty == 0.0  # type: ignore[attr-defined]
    assert old.opd_token_mask() == d["loss_mask"]  # type: ignore[attr-defined]
    assert not old.rl_trainable()  # type: ignore[attr-defined]
    # New: a hinted turn with a neutral score trains OPD only.
    d["opd_mask"] = [1] * len(d["response_token_ids"])
    new = decode(orjson.dumps(d))
    assert new.opd_token_mask() == d["opd_mask"] and not new.rl_trainable()  # type: ignore[attr-defined]
    d["opd_mask"][0] = 2
    assert reject(orjson.dumps(d)).field is not None


def test_headers_and_key() -> None:
    assert headers(EXAMPLES["reward"]) == [
        ("liverl-type", b"reward"),
        ("liverl-schema-version", b"1"),
    ]
    assert key(EXAMPLES["interaction"]) == b"sess-7f3a9c"
    assert key(EXAMPLES["weights"]) == b"qwen3-4b-agent"
    assert key(EXAMPLES["gradient_step"]) == b"qwen3-4b-agent"
    assert key(EXAMPLES["serving_status"]) == b"replica-0"
    assert key(EXAMPLES["gate_vote"]) == b"qwen3-4b-agent"
    assert key(EXAMPLES["dlq"]) == b"sess-7f3a9c"  # the failed record's own key


def test_ts_ms_defaults_to_now_and_type_is_fixed() -> None:
    hint = Hint(
        event_id=new_event_id(),
        producer=Producer(component="judge", version="1"),
        session_id="s",
        turn=0,
        hint="x" * 11,
        judge_id="j",
        rank=0,
    )
    assert hint.ts_ms > 1_700_000_000_000
    assert hint.type == "hint"
    with pytest.raises(TypeError):
        Hint(
            type="reward",
            event_id="e",
            producer=hint.producer,
            session_id="s",
            turn=0,
            hint="x" * 11,
            judge_id="j",
            rank=0,
        )  # type: ignore[call-arg]


def test_dead_letter_keeps_original_bytes() -> None:
    dlq = EXAMPLES["dlq"]
    assert isinstance(dlq, DeadLetter)
    assert dlq.original() == b'{"type": "interaction", "turn": "three"'
    assert dlq.original_key() == b"sess-7f3a9c"
    assert dlq.original_headers == {"liverl-type": "interaction", "liverl-schema-version": "1"}
    again = DeadLetter.wrap(
        b"\xff",
        topic="liverl.interactions.v1",
        partition=2,
        offset=90_210,
        error="x",
        producer=dlq.producer,
        headers={"h": b"\xff"},
    )
    assert again.event_id == dlq.event_id  # same record coordinates -> same DLQ id
    assert again.original_headers == {"h": "\\xff"}
    assert decode(encode(again)) == again


# --- rejections -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field", ["turn", "session_id", "messages", "response_token_ids", "event_id", "producer"]
)
def test_missing_required_field_is_named(field: str) -> None:
    d = doc("interaction")
    del d[field]
    err = reject(orjson.dumps(d))
    assert err.field == field
    assert err.reason == "required field is missing"
    assert str(err) == f"interaction.v1: field '{field}': required field is missing"


def test_missing_nested_field_is_named() -> None:
    d = doc("weights")
    del d["files"][1]["sha256"]
    err = reject(orjson.dumps(d))
    assert err.field == "files[1].sha256"
    assert "files[1].sha256" in str(err)


@pytest.mark.parametrize(
    ("type_", "path", "value", "field", "reason"),
    [
        ("interaction", ["turn"], "3", "turn", "must be integer"),
        ("interaction", ["turn"], True, "turn", "must be integer"),
        ("interaction", ["turn"], -1, "turn", "must be bigger than or equal to 0"),
        ("interaction", ["train"], "yes", "train", "must be boolean"),
        ("interaction", ["messages", 0, "role"], "robot", "messages[0].role", "must be one of"),
        (
            "interaction",
            ["response_token_ids", 5],
            -2,
            "response_token_ids[5]",
            "must be bigger than or equal to 0",
        ),
        ("interaction", ["finish_reason"], "eos", "finish_reason", "must be one of"),
        ("prm_score", ["score"], 2, "score", "must be one of"),
        ("hint", ["hint"], "too short", "hint", "must be longer than or equal to 11 characters"),
        ("sample", ["loss_mask", 0], 2, "loss_mask[0]", "must be one of"),
        ("weights", ["files", 0, "sha256"], "A" * 64, "files[0].sha256", "must match pattern"),
        ("weights", ["status"], "live", "status", "must be one of"),
        ("gradient_step", ["consumed_offsets", "0"], "12", "consumed_offsets.0", "must be integer"),
        ("serving_status", ["ok"], None, "ok", "must be boolean"),
        ("gate_vote", ["vote"], 2, "vote", "must be one of"),
        ("gate_vote", ["source"], "live", "source", "must be one of"),
        ("gate_vote", ["prompt_id"], "not-hex", "prompt_id", "must match pattern"),
        ("dlq", ["original_b64"], "not base64!", "original_b64", "must match pattern"),
        ("reward", ["producer", "component"], 7, "producer.component", "must be string"),
    ],
)
def test_wrong_value_is_named(
    type_: str, path: list, value: object, field: str, reason: str
) -> None:
    d = doc(type_)
    target = d
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    err = reject(orjson.dumps(d))
    assert err.field == field
    assert err.reason.startswith(reason)
    assert str(err).startswith(f"{type_}.v1: field '{field}': {reason}")


def test_extra_field_is_named() -> None:
    d = doc("reward")
    d["bonus"] = 1.0
    err = reject(orjson.dumps(d))
    assert (err.field, err.reason) == ("bonus", "unexpected field")
    d = doc("interaction")
    d["producer"]["host"] = "a"
    assert reject(orjson.dumps(d)).field == "producer.host"


def test_invalid_utf8() -> None:
    raw = encode(EXAMPLES["hint"]).replace(b"Update", b"Upd\xe9te")
    err = reject(raw)
    assert err.field is None
    assert "UTF-8" in err.reason and "UTF-8" in str(err)


def test_malformed_json() -> None:
    err = reject(encode(EXAMPLES["hint"])[:-1])
    assert err.field is None
    assert err.reason.startswith("malformed JSON: ")


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"interaction"', b"null", b"42"])
def test_not_an_object(raw: bytes) -> None:
    err = reject(raw)
    assert err.field is None
    assert "must be a JSON object" in str(err)


def test_unknown_type() -> None:
    d = doc("hint")
    d["type"] = "hunch"
    err = reject(orjson.dumps(d))
    assert err.field == "type"
    assert "unknown event type 'hunch'" in str(err)
    del d["type"]
    assert reject(orjson.dumps(d)).field == "type"


@pytest.mark.parametrize("version", [2, 0, "1", None, True])
def test_unknown_schema_version(version: object) -> None:
    d = doc("hint")
    d["schema_version"] = version
    err = reject(orjson.dumps(d))
    assert err.field == "schema_version"
    assert "schema_version" in str(err)


def test_expected_type_mismatch() -> None:
    err = reject(encode(EXAMPLES["hint"]), expected_type="reward")
    assert err.field == "type"
    assert str(err) == "field 'type': expected type 'reward', got 'hint'"


def test_oversized_value() -> None:
    raw = encode(EXAMPLES["interaction"])
    err = reject(raw, max_bytes=1024)
    assert err.field is None
    assert str(err) == f"value of {len(raw)} bytes exceeds limit 1024"
    assert decode(raw, max_bytes=len(raw)) == EXAMPLES["interaction"]


def test_tombstone() -> None:
    assert "tombstone" in str(reject(None))  # type: ignore[arg-type]


def test_encode_validate_catches_what_type_hints_cannot() -> None:
    bad = dataclasses.replace(
        EXAMPLES["reward"], total=float("nan")
    )  # JSON has no NaN: becomes null
    encode(bad)  # no validation requested
    with pytest.raises(EventValidationError) as info:
        encode(bad, validate=True)
    assert info.value.field == "total"
    with pytest.raises(EventValidationError, match="cannot encode"):
        encode(dataclasses.replace(EXAMPLES["gradient_step"], consumed_offsets={0: 5}))  # type: ignore[dict-item]


def test_validate_does_not_mutate() -> None:
    d = doc("interaction")
    del d["tools"]
    before = orjson.dumps(d)
    validate(d)
    assert orjson.dumps(d) == before


def test_large_interaction_round_trips() -> None:
    event = interaction(prompt_tokens=2048, response_tokens=512, text_repeat=5)
    raw = encode(event, validate=True, version=1)  # the bench's ~31 KB of JSON (v1 layout)
    assert 25_000 < len(raw) < 40_000
    assert decode(raw, "interaction") == event
    assert decode(encode(event, validate=True, version=2), "interaction") == event


# --- event ids --------------------------------------------------------------------------------


def test_derive_event_id_is_deterministic() -> None:
    a = derive_event_id("reward", ["p1", "p2"], "cfg-1", 3, {"b": 1, "a": 2})
    assert a == derive_event_id("reward", ["p1", "p2"], "cfg-1", 3, {"a": 2, "b": 1})
    assert len(a) == 32 and int(a, 16) >= 0
    # parents are a set: the order a join received them in must not matter (replays differ)
    assert a == derive_event_id("reward", ("p2", "p1"), "cfg-1", 3, {"b": 1, "a": 2})


def test_derive_event_id_is_sensitive_to_each_input() -> None:
    base = ("reward", ["p1", "p2"], "cfg-1", 3)
    ids = {
        derive_event_id(*base),
        derive_event_id("prm_score", *base[1:]),
        derive_event_id("reward", ["p1"], "cfg-1", 3),
        derive_event_id("reward", ["p1", "p3"], "cfg-1", 3),
        derive_event_id("reward", ["p1", "p2"], "cfg-2", 3),
        derive_event_id("reward", ["p1", "p2"], "cfg-1", 4),
        derive_event_id("reward", ["p1", "p2"], "cfg-1", "3"),
        derive_event_id("reward", ["p1", "p2"], "cfg-1"),
        derive_event_id("reward", ["p1", "p2"], "cfg-1", 3, None),
        derive_event_id("reward", ["p1p2"], "cfg-1", 3),
    }
    assert len(ids) == 10


def test_new_event_id_is_unique() -> None:
    assert len({new_event_id() for _ in range(1000)}) == 1000
