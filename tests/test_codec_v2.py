"""Codec v2: token ids, log-probs and masks as base64 of little-endian binary arrays.

Round trips in both versions for every event type; the v2 contract (valid and mutated
documents get the same verdict from the reference validator on the v2 schema file plus an
independent statement of the rules checked in code, and from the fast path); NaN and
infinity rejected as in v1; the setting and the process default; lists for every consumer
(the trainer's trajectory rows); a topic that holds both versions, on the real broker.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import math
import re
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastjsonschema
import numpy as np
import orjson
import pyarrow as pa
import pytest
from click.testing import CliRunner
from jsonschema import Draft7Validator

from pipeline import events
from pipeline.cli import cli
from pipeline.events import binary, examples, schema_files
from pipeline.events.validation import B64_PATTERN
from pipeline.kafka import EventConsumer, EventProducer
from pipeline.lake import tables as T
from pipeline.settings import KafkaSettings, Settings
from pipeline.trainer.core import SampleOutcome, StepResult
from pipeline.trainer.publish import trajectory_rows

from .conftest import create_topic
from .test_schemas_contract import PALETTE, paths, with_value, without

EXAMPLES = examples.examples()
CHANGED = {"interaction", "sample"}
V1 = {t: json.loads(p.read_text()) for (t, v), p in schema_files().items() if v == 1}
V2 = {t: json.loads(p.read_text()) for (t, v), p in schema_files().items() if v == 2}
# struct formats of the wire item types (little-endian), for the independent oracle below.
FORMATS = {"uint8": "B", "uint32": "I", "float64": "d"}
CANONICAL_B64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")


def v2_doc(type_: str) -> dict[str, Any]:
    return orjson.loads(events.encode(EXAMPLES[type_], version=2))


def reject(raw: bytes, **kwargs: Any) -> events.EventValidationError:
    with pytest.raises(events.EventValidationError) as info:
        events.decode(raw, **kwargs)
    return info.value


@pytest.fixture
def restore_codec_version() -> Iterator[None]:
    before = events.codec_version()
    yield
    events.set_codec_version(before)


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("type_", sorted(events.EVENT_TYPES))
def test_round_trip_in_each_version(type_: str, version: int) -> None:
    event = EXAMPLES[type_]
    raw = events.encode(event, validate=True, version=version)
    wire = version if type_ in CHANGED else 1
    assert orjson.loads(raw)["schema_version"] == wire
    assert events.wire_version(event, version) == wire
    assert dict(events.headers(event, version=version)) == {
        events.TYPE_HEADER: type_.encode(),
        events.VERSION_HEADER: str(wire).encode(),
    }
    back = events.decode(raw, type_, version_header=str(wire).encode())
    assert back == event and type(back) is type(event)
    assert back.schema_version == 1  # in memory every version is the same typed event
    assert events.encode(back, version=version) == raw  # byte-stable re-encoding
    assert events.from_dict(orjson.loads(raw)) == event
    assert events.to_dict(back) == orjson.loads(events.encode(event, version=1))


@pytest.mark.parametrize("type_", sorted(CHANGED))
def test_v2_decodes_to_packed_arrays_of_python_numbers(type_: str) -> None:
    back = events.decode(events.encode(EXAMPLES[type_], version=2))
    packed = {"uint32": events.U32Array, "uint8": events.U8Array, "float64": events.F64Array}
    for name, f in binary.layout(V2[type_]).items():
        values = getattr(back, name)
        assert type(values) is packed[f.dtype], name
        assert values == getattr(EXAMPLES[type_], name)
        assert values.tolist() == list(getattr(EXAMPLES[type_], name))
        kind = float if "logprobs" in name else int
        assert all(type(v) is kind for v in values), name


def test_v2_is_lossless_and_smaller_on_the_bench_event() -> None:
    event = examples.interaction(prompt_tokens=2048, response_tokens=512, text_repeat=5)
    v1, v2 = events.encode(event, version=1), events.encode(event, version=2)
    assert len(v2) < 0.8 * len(v1)
    assert events.decode(v1) == events.decode(v2) == event
    edge = dataclasses.replace(
        event,
        prompt_token_ids=[0, 1, 2**31, 2**32 - 1],
        response_token_ids=[7, 8, 9],
        response_logprobs=[-0.0, -1e-310, -1.7976931348623157e308],  # subnormal, extremes
    )
    back = events.decode(events.encode(edge, version=2))
    assert back == edge
    assert math.copysign(1.0, back.response_logprobs[0]) == -1.0  # type: ignore[attr-defined]


def test_numpy_arrays_encode_like_lists() -> None:
    event = EXAMPLES["sample"]
    arrays = dataclasses.replace(
        event,
        prompt_token_ids=np.asarray(event.prompt_token_ids, dtype=np.int64),  # type: ignore[attr-defined]
        behavior_logprobs=np.asarray(event.behavior_logprobs, dtype=np.float64),  # type: ignore[attr-defined]
    )
    assert events.encode(arrays, version=2) == events.encode(event, version=2)


def test_to_dict_keeps_lists_whatever_the_codec(restore_codec_version: None) -> None:
    events.set_codec_version(2)
    doc = events.to_dict(EXAMPLES["sample"])
    assert doc["schema_version"] == 1 and isinstance(doc["loss_mask"], list)


def test_trainer_trajectory_rows_from_v2_samples_are_native_list_columns() -> None:
    sample = events.decode(events.encode(EXAMPLES["sample"], version=2), "sample")
    record = events_record(sample)
    result = StepResult(
        step=1, weight_version=1, losses={"total": 0.0}, kl=0.0, clip_fraction=0.0,
        grad_norm=None, samples=1, tokens=1, trained_tokens=1, dropped_stale=0,
        reward_mean=0.0, metrics={}, outcomes=[SampleOutcome(status="trained", staleness=0)],
    )  # fmt: skip

    class Tokenizer:
        def decode(self, ids: list[int]) -> str:
            return " ".join(map(str, ids))

    rows = trajectory_rows([record], result, Tokenizer())
    table = T.to_table(T.TRAJECTORIES, rows)  # as written to Delta: the rows hold packed arrays
    for name in ("prompt_token_ids", "response_token_ids", "loss_mask", "opd_mask"):
        assert pa.types.is_list(table.schema.field(name).type), name
        assert table.column(name).to_pylist() == [getattr(EXAMPLES["sample"], name)], name
    logprobs = table.column("behavior_logprobs").to_pylist()[0]  # float32 in the table
    assert logprobs == pytest.approx(EXAMPLES["sample"].behavior_logprobs, rel=1e-6)  # type: ignore[attr-defined]


def events_record(event: events.Event) -> Any:
    from pipeline.kafka import Record

    return Record("liverl.samples.v1", 0, 0, None, event.ts_ms, event)


# --- the switch --------------------------------------------------------------------------------


def test_setting_and_process_default(
    restore_codec_version: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert KafkaSettings().codec_version == events.DEFAULT_CODEC_VERSION == events.codec_version()
    monkeypatch.setenv("LIVERL_KAFKA_CODEC_VERSION", "2")
    assert Settings().kafka.codec_version == 2
    for bad in ("0", "3"):
        monkeypatch.setenv("LIVERL_KAFKA_CODEC_VERSION", bad)
        with pytest.raises(ValueError, match="codec_version"):
            Settings()
    for version in (1, 2):
        events.set_codec_version(version)
        raw = events.encode(EXAMPLES["interaction"])
        assert orjson.loads(raw)["schema_version"] == version
        assert dict(events.headers(EXAMPLES["interaction"]))[events.VERSION_HEADER] == (
            str(version).encode()
        )
    for bad_version in (0, 3, True):
        with pytest.raises(ValueError, match="codec version must be one of"):
            events.set_codec_version(bad_version)
        with pytest.raises(ValueError, match="codec version must be one of"):
            events.encode(EXAMPLES["sample"], version=bad_version)


def test_gateway_recorder_frames_interactions_in_the_settings_version(
    restore_codec_version: None, tmp_path: Path
) -> None:
    from pipeline.serving.recorder import Recorder, unframe
    from pipeline.serving.spool import Spool

    event = EXAMPLES["interaction"]
    for version in (1, 2):
        events.set_codec_version(3 - version)  # the settings win over the process default
        settings = Settings()
        settings.kafka.codec_version = version
        recorder = Recorder(settings, Spool(tmp_path / f"spool{version}"))
        topic, key, value, hdrs = unframe(recorder._frame_or_letter("t", event))
        assert (topic, key) == ("t", b"sess-7f3a9c")
        assert orjson.loads(value)["schema_version"] == version
        assert dict(hdrs)[events.VERSION_HEADER] == str(version).encode()
        assert events.decode(value) == event


def test_cli_sets_the_process_default_from_settings(
    restore_codec_version: None, tmp_path: Path
) -> None:
    config = tmp_path / "liverl.toml"
    for version in (1, 2):
        events.set_codec_version(3 - version)
        config.write_text(f"[kafka]\ncodec_version = {version}\n")
        result = CliRunner().invoke(cli, ["--config", str(config), "broker"])
        assert events.codec_version() == version, result.output
    config.write_text("[kafka]\ncodec_version = 7\n")
    result = CliRunner().invoke(cli, ["--config", str(config), "broker"])
    assert result.exit_code == 1 and "codec_version" in result.output


# --- what only code can check ------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(("type_", "name"), [("interaction", "response_logprobs"),
                                             ("sample", "behavior_logprobs")])  # fmt: skip
def test_non_finite_floats_are_rejected_in_both_versions(type_: str, name: str, bad: float) -> None:
    values = list(getattr(EXAMPLES[type_], name))
    values[len(values) // 2] = bad
    event = dataclasses.replace(EXAMPLES[type_], **{name: values})
    for version in (1, 2):
        raw = events.encode(event, version=version)  # encoding alone does not validate
        err = reject(raw)
        assert err.field is not None and err.field.startswith(name), (version, err)
        with pytest.raises(events.EventValidationError):
            events.encode(event, validate=True, version=version)
    err = reject(events.encode(event, version=2))
    assert f"item {len(values) // 2} is {bad}, must be a finite number" in str(err)
    assert str(err).startswith(f"{type_}.v2: field '{name}'")


@pytest.mark.parametrize(
    "edge",
    # Finite doubles whose last byte is 0x7F or 0xFF, like NaN's and infinity's: the byte
    # scan cannot clear them, so the item-by-item look must, and accept them.
    [1.7976931348623157e308, -1.7976931348623157e308, 2.0**1009, -(2.0**1015), 2.0**1020],
)
def test_huge_finite_floats_pass_the_finite_check(edge: float) -> None:
    import struct

    assert struct.pack("<d", edge)[7] in (0x7F, 0xFF)  # the case the fast scan defers
    event = EXAMPLES["interaction"]
    values = list(event.response_logprobs)
    values[-1] = edge
    decoded = events.decode(events.encode(dataclasses.replace(event, response_logprobs=values),
                                          version=2))  # fmt: skip
    assert isinstance(decoded, events.Interaction)
    assert decoded.response_logprobs[-1] == edge


def test_length_ties_are_checked_with_clear_errors() -> None:
    sample = EXAMPLES["sample"]
    n = len(sample.response_token_ids)  # type: ignore[attr-defined]
    short = dataclasses.replace(sample, loss_mask=[1] * (n - 1))
    err = reject(events.encode(short, version=2))
    assert str(err) == (
        f"sample.v2: field 'loss_mask': has {n - 1} items, must have as many as "
        f"response_token_ids ({n})"
    )
    with pytest.raises(events.EventValidationError, match="loss_mask"):
        events.encode(short, validate=True, version=2)
    err = reject(events.encode(dataclasses.replace(sample, opd_mask=[1, 0]), version=2))
    assert err.field == "opd_mask" and "(or none)" in err.reason
    older = dataclasses.replace(sample, opd_mask=[])  # written before opd_mask: follows loss_mask
    assert events.decode(events.encode(older, version=2)) == older
    inter = EXAMPLES["interaction"]
    err = reject(events.encode(dataclasses.replace(inter, response_logprobs=[-1.0]), version=2))
    assert err.field == "response_logprobs"
    # v1 never checked lengths (its schema cannot) and still does not: the contract is unchanged.
    assert events.decode(events.encode(short, version=1)) == short


def test_unrepresentable_items_fail_at_encode_with_the_field_named() -> None:
    inter = EXAMPLES["interaction"]
    for bad in (-1, 2**32, "7", None, 1.5):
        event = dataclasses.replace(inter, prompt_token_ids=[1, bad])
        with pytest.raises(events.EventValidationError, match="cannot encode as uint32") as info:
            events.encode(event, version=2)
        assert info.value.field == "prompt_token_ids"
    mask = dataclasses.replace(EXAMPLES["sample"], loss_mask=[256])
    with pytest.raises(events.EventValidationError, match="cannot encode as uint8"):
        events.encode(mask, version=2)


def test_mask_items_outside_0_1_are_named() -> None:
    sample = EXAMPLES["sample"]
    mask = list(sample.loss_mask)  # type: ignore[attr-defined]
    mask[5] = 2
    err = reject(events.encode(dataclasses.replace(sample, loss_mask=mask), version=2))
    assert (err.field, err.reason) == ("loss_mask", "item 5 is 2, must be one of 0, 1")


def test_bad_base64_and_item_size() -> None:
    doc = v2_doc("interaction")
    doc["prompt_token_ids"] = doc["prompt_token_ids"][:-4]  # 3 bytes short of a whole item
    err = reject(orjson.dumps(doc))
    assert err.field == "prompt_token_ids" and "not a whole number of uint32 items" in err.reason
    doc = v2_doc("interaction")
    for text in ("AAAA=", "AAAA==", "AAAAAAAA=", "AAAAAAAAAAA=="):  # surplus padding
        doc["prompt_token_ids"] = text  # the pattern, lenient and strict decoders let it through
        err = reject(orjson.dumps(doc))
        assert err.field == "prompt_token_ids" and err.reason.startswith("not valid base64")
    doc["response_token_ids"] = doc["response_token_ids"][:-2]
    err = reject(orjson.dumps(doc))  # fastjsonschema asserts contentEncoding itself
    assert (err.field, err.reason) == ("response_token_ids", "must be encoded by base64")
    doc["response_token_ids"] = "not base64!"
    err = reject(orjson.dumps(doc))  # the schema's pattern speaks first
    assert err.field == "response_token_ids" and err.reason.startswith("must match pattern")


@pytest.mark.parametrize(
    ("text", "items"),
    [("", []), ("AAAAAA==", [0]), ("AQAAAAIAAAA=", [1, 2]), ("AAAA=", None), ("AAAA==", None),
     ("AAAAAAAA=", None), ("AAAAAAAAAAA==", None), ("AAAAA=A=", None), ("A", None)],
)  # fmt: skip
def test_base64_text_and_its_raw_bytes_get_the_same_verdict(text: str, items: Any) -> None:
    """The one-pass decoder hands the field's bytes (a memoryview), the full path its str."""
    from pipeline.events.binary import ArrayField, unpack_field

    f = ArrayField("prompt_token_ids", "uint32")
    for given in (text, memoryview(text.encode()), text.encode()):
        if items is None:
            with pytest.raises(events.EventValidationError, match="not valid base64"):
                unpack_field(given, f, "interaction.v2")
        else:
            assert unpack_field(given, f, "interaction.v2") == items


def test_header_must_agree_with_the_value() -> None:
    raw = events.encode(EXAMPLES["interaction"], version=2)
    err = reject(raw, version_header=b"1")
    assert err.field == "schema_version"
    assert "header liverl-schema-version says '1' but the value is version 2" in str(err)
    assert events.decode(raw, version_header=b"2") == EXAMPLES["interaction"]
    assert events.decode(raw) == EXAMPLES["interaction"]  # no header: the value decides


def test_malformed_annotation_is_a_schema_error() -> None:
    schema = copy.deepcopy(V2["sample"])
    schema["properties"]["loss_mask"]["x-liverl-array"]["dtype"] = "int7"
    with pytest.raises(ValueError, match="bad x-liverl-array"):
        binary.layout(schema)
    schema = copy.deepcopy(V2["sample"])
    schema["properties"]["loss_mask"]["x-liverl-array"]["same_length_as"] = "nope"
    with pytest.raises(ValueError, match="same_length_as names no property"):
        binary.layout(schema)


# --- the v2 schema files -----------------------------------------------------------------------


def test_v2_files_exist_for_exactly_the_changed_types() -> None:
    assert set(V2) == CHANGED
    for type_ in events.EVENT_TYPES:
        assert (type_, 1) in schema_files()  # v1 files stay, unchanged, for every type


@pytest.mark.parametrize("type_", sorted(CHANGED))
def test_v2_schema_mirrors_v1_except_the_bulk_arrays(type_: str) -> None:
    v1, v2 = V1[type_], V2[type_]
    Draft7Validator.check_schema(v2)
    assert v2["$id"] == f"https://liverl.dev/schemas/{type_}.v2.json"
    assert v2["properties"]["schema_version"]["const"] == 2
    assert list(v2["properties"]) == list(v1["properties"])
    assert [f.name for f in dataclasses.fields(events.EVENT_TYPES[type_])] == list(v2["properties"])
    assert v2["required"] == v1["required"]
    assert v2["additionalProperties"] is False
    layout = binary.layout(v2)
    for name, prop in v1["properties"].items():
        items = prop.get("items", {})
        bulk = prop.get("type") == "array" and items.get("type") in ("integer", "number")
        assert (name in layout) == bulk, name  # every bulk numeric array, and only those
        if name in layout:
            p2 = v2["properties"][name]
            assert p2["type"] == "string" and p2["contentEncoding"] == "base64"
            assert p2["pattern"] == B64_PATTERN  # what the fast path relies on
            assert ("enum" in items) == (layout[name].enum is not None)
        else:
            assert v2["properties"][name] == (
                prop if name != "schema_version" else {**prop, "const": 2}
            )


# --- v2 contract: reference validator + the rules in code, and the fast path -------------------


def oracle(type_: str, doc: Any) -> bool:
    """The rules v2 checks in code, written independently of pipeline.events.binary:
    canonical padded base64 (RFC 4648), whole items, finite floats, enums, tied lengths."""
    decoded: dict[str, tuple[Any, ...]] = {}
    specs = {n: p["x-liverl-array"] for n, p in V2[type_]["properties"].items()
             if "x-liverl-array" in p}  # fmt: skip
    for name, spec in specs.items():
        if name not in doc:
            continue
        text = doc[name]
        if not CANONICAL_B64.fullmatch(text):
            return False
        raw = base64.b64decode(text)
        size = struct.calcsize("<" + FORMATS[spec["dtype"]])
        if len(raw) % size:
            return False
        items = struct.unpack(f"<{len(raw) // size}{FORMATS[spec['dtype']]}", raw)
        if spec["dtype"] == "float64" and not all(map(math.isfinite, items)):
            return False
        if "enum" in spec and not set(items) <= set(spec["enum"]):
            return False
        decoded[name] = items
    for name, items in decoded.items():
        tied = specs[name].get("same_length_as")
        mismatch = tied in decoded and len(items) != len(decoded[tied])
        if mismatch and not (specs[name].get("empty_allowed") and not items):
            return False
    return True


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def binary_mutations(type_: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Bad base64, wrong item sizes, NaN/inf, bad mask items, length mismatches, edge values."""
    base = v2_doc(type_)
    layout = binary.layout(V2[type_])
    for name, f in layout.items():
        text = base[name]
        raw = base64.b64decode(text)
        fmt = "<" + FORMATS[f.dtype]
        size = struct.calcsize(fmt)
        n = len(raw) // size
        mid = len(text) // 2
        texts = {
            "empty": "",
            "bang": "!" + text[1:],
            "urlsafe -": text[:mid] + "-" + text[mid + 1 :],
            "urlsafe _": text[:mid] + "_" + text[mid + 1 :],
            "space": text[:mid] + " " + text[mid + 1 :],
            "non-ascii": text[:mid] + "é" + text[mid + 1 :],
            "trailing newline": text + "\n",
            "leading space": " " + text,
            "no padding": text.rstrip("="),
            "extra padding": text + "==",
            "surplus padding": text.rstrip("=") + "=" * (2 + (len(text.rstrip("=")) % 4 == 0)),
            "four pads": text + "====",
            "padding inside": text[:4] + "=" + text[5:],
            "one char short": text[:-1],
            "two chars short": text[:-2],
            "one char": text[:1],
            "only padding": "==",
            "one byte short": b64(raw[:-1]),
            "two bytes short": b64(raw[:-2]),
            "three bytes short": b64(raw[:-3]),
            "one byte more": b64(raw + b"\x00"),
            "one item short": b64(raw[:-size]),
            "one item more": b64(raw + raw[:size]),
            "doubled": b64(raw + raw),
            "non-canonical bits": text[:-3] + chr(ord(text[-3]) | 1) + text[-2:]
            if text.endswith("=") and text[-3] in "ACEGIKMOQSUWYacegikmoqsuwy"
            else text,
        }
        for label, value in texts.items():
            yield f"{name} {label}", {**base, name: value}
        positions = sorted({0, n // 2, n - 1}) if n else []
        if f.dtype == "float64":
            specials = [math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308]
        elif f.dtype == "uint8":
            specials = [0, 1, 2, 255]
        else:
            specials = [0, 2**31, 2**32 - 1]
        items = list(struct.unpack(f"<{n}{FORMATS[f.dtype]}", raw))
        for where in positions:
            for value in specials:
                changed = items.copy()
                changed[where] = value
                packed = struct.pack(f"<{n}{FORMATS[f.dtype]}", *changed)
                yield f"{name}[{where}]={value!r}", {**base, name: b64(packed)}


def schema_mutations(type_: str) -> Iterator[tuple[str, Any]]:
    """The generic mutations of the v1 contract test, on the v2 document."""
    doc = v2_doc(type_)
    yield "example", doc
    yield "minimal", {k: v for k, v in doc.items() if k in V2[type_]["required"]}
    for value in (None, [], "x", 1):
        yield f"root={value!r}", value
    for path in paths(doc):
        yield f"drop {path}", without(doc, path)
        for value in PALETTE:
            yield f"{path}={value!r}", with_value(doc, path, value)
    yield "extra", {**doc, "zz_extra": 1}
    yield "version 1 with v2 arrays", {**doc, "schema_version": 1}


@pytest.mark.parametrize("type_", sorted(CHANGED))
def test_v2_contract_reference_plus_code_rules_equals_decode(type_: str) -> None:
    reference = Draft7Validator(V2[type_])
    full = fastjsonschema.compile(V2[type_], use_default=False)
    disagreements: list[str] = []
    by_code = by_schema = accepted = 0
    cases = [*schema_mutations(type_), *binary_mutations(type_)]
    for label, doc in cases:
        schema_ok = reference.is_valid(doc)
        try:
            full(copy.deepcopy(doc))
            compiled_ok = True
        except fastjsonschema.JsonSchemaValueException:
            compiled_ok = False
        expected = schema_ok and isinstance(doc, dict) and oracle(type_, doc)
        try:
            got = events.decode(orjson.dumps(doc)) is not None
        except events.EventValidationError:
            got = False
        try:
            events.validate(copy.deepcopy(doc))
            validated = True
        except events.EventValidationError:
            validated = False
        # fastjsonschema also asserts contentEncoding (an annotation to the reference validator
        # in draft 7): it may reject more, never anything the rules in code accept.
        compiled_agrees = compiled_ok == schema_ok or (schema_ok and not expected)
        if not (compiled_agrees and got == expected == validated):
            disagreements.append(
                f"{label}: jsonschema={schema_ok} fastjsonschema={compiled_ok} "
                f"rules={expected} decode={got} validate={validated}"
            )
        accepted += expected
        by_schema += not schema_ok
        by_code += schema_ok and not expected
    assert not disagreements, "\n".join(disagreements[:20])
    # Both kinds of rejection occur, and plenty of documents are accepted.
    assert accepted >= 30 and by_schema >= 100 and by_code >= 40, (accepted, by_schema, by_code)


# --- on the broker -----------------------------------------------------------------------------


@pytest.mark.integration
def test_topic_with_v1_and_v2_records_is_consumed_in_order(
    kafka_settings: Settings, admin: Any, unique: str
) -> None:
    topic = f"test.codec.{unique}"
    create_topic(admin, topic, 1)
    producers = {}
    for version in (1, 2):
        settings = kafka_settings.model_copy(deep=True)
        settings.kafka.codec_version = version
        producers[version] = EventProducer(settings, client_id=f"test-codec-v{version}")
    sent: list[events.Event] = []
    for i in range(8):
        kind = "interaction" if i % 4 < 2 else "sample"
        event = dataclasses.replace(EXAMPLES[kind], event_id=f"e{i}", turn=i)
        producers[1 + i % 2].send(topic, event)  # v1, v2, v1, v2, ...
        producers[1 + i % 2].flush()  # one partition, flushed in turn: offsets follow i
        sent.append(event)
    mislabelled = events.encode(EXAMPLES["interaction"], version=2)
    producers[2].send_raw(topic, mislabelled, key=b"bad", headers=[(events.VERSION_HEADER, b"1")])
    last = dataclasses.replace(EXAMPLES["reward"], event_id="e-last")
    producers[2].send(topic, last)  # a type without a v2 layout: written as v1
    producers[2].flush()
    sent.append(last)

    consumer = EventConsumer(
        kafka_settings, group_id=f"g-{unique}", topics=[topic], component="test",
        expected_types={},
    )  # fmt: skip
    records = []
    dead = 0
    deadline = time.monotonic() + 60
    while len(records) + dead < len(sent) + 1 and time.monotonic() < deadline:
        batch = consumer.poll_batch(max_records=4, timeout=1.0)
        records.extend(batch.records)
        dead += batch.dead_lettered
        consumer.store(batch)
    consumer.close()

    assert [r.event for r in records] == sent  # in order, equal to what was sent
    versions = [orjson.loads(r.value)["schema_version"] for r in records]
    assert versions == [1, 2, 1, 2, 1, 2, 1, 2, 1]
    assert [dict(r.headers)[events.VERSION_HEADER] for r in records] == [
        str(v).encode() for v in versions
    ]
    # v1 decodes to lists, v2 to packed arrays; both compared equal to the sent lists above
    kinds = [type(r.event.prompt_token_ids) for r in records[:-1]]  # type: ignore[attr-defined]
    assert kinds == [list, events.U32Array] * 4
    assert dead == 1  # the value says 2, its header 1
