"""One size policy (``KafkaSettings``): event (codec) < record (broker, topics, producers) < fetch.

Reproduced failures (each on the real broker, each fixed here): a 1.2 MB interaction crashed the
Faust worker on every restart (aiokafka's 1 MB request size); a 2.67 MB next state crashed it
while being dead-lettered and was then gone; a 7.2 MB sample put the trainer in a crash loop
(its base64 dead letter exceeded the broker's limit); a 10.5 MB (compressed: accepted) value on
the weights topic stopped the reloader's consumer; keyless events produced nothing at all.
Every case now ends in a bounded dead letter (at most ``max_event_bytes``, payload cut with its
size, sha256 and coordinates kept), the consumer keeps running and the next good record is
processed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import ConfigResource, NewTopic

from pipeline import events
from pipeline.events import Producer, Sample, examples
from pipeline.kafka import EventConsumer, EventProducer, names, topics
from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
MB = 1_000_000


# ---- the policy itself (no broker) -------------------------------------------------------------


def test_policy_is_stated_once_and_ordered(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from pipeline.kafka import consumer as consumer_mod
    from pipeline.kafka import producer as producer_mod
    from pipeline.kafka.broker import LocalBroker
    from pipeline.processors.app import create_app
    from pipeline.processors.config import ProcessorSettings

    settings = Settings(state_dir=tmp_path)
    k = settings.kafka
    assert k.max_event_bytes < k.max_record_bytes < k.max_fetch_bytes
    assert (k.max_event_bytes, k.max_record_bytes, k.max_fetch_bytes) == (
        8 * 2**20,
        9 * 2**20,
        10 * 2**20,
    )

    broker = LocalBroker(settings)
    broker.home.mkdir(parents=True, exist_ok=True)
    props = dict(
        line.split("=", 1) for line in broker._write_config().read_text().splitlines() if line
    )
    assert int(props["message.max.bytes"]) == k.max_record_bytes

    for spec in topics.load_specs(settings.topics.specs_dir):
        assert int(spec.config["max.message.bytes"]) == k.max_record_bytes, spec.name

    confs: list[dict[str, Any]] = []
    monkeypatch.setattr(producer_mod, "Producer", lambda conf: confs.append(conf))
    monkeypatch.setattr(consumer_mod, "Consumer", lambda conf: confs.append(conf))
    EventConsumer(settings, group_id="g", expected_types={})
    consumer_conf, producer_conf = confs
    assert producer_conf["message.max.bytes"] == k.max_record_bytes
    assert consumer_conf["max.partition.fetch.bytes"] == k.max_fetch_bytes
    assert consumer_conf["fetch.max.bytes"] >= k.max_fetch_bytes

    app = create_app(settings, ProcessorSettings(web_enabled=False), settings.state_dir)
    assert app.conf.producer_max_request_size == k.max_record_bytes
    assert app.conf.consumer_max_fetch_size == k.max_fetch_bytes


def test_a_spec_cannot_lower_the_record_limit(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text(
        "name: t\npartitions: 1\nkey: k\nvalue_schema: x.v1\n"
        "config:\n  max.message.bytes: '1048576'\n"
    )
    with pytest.raises(topics.TopicSpecError, match="below the size policy"):
        topics.load_specs(tmp_path, max_record_bytes=9 * 2**20)
    assert topics.load_specs(tmp_path, max_record_bytes=2**20)[0].config == {
        "max.message.bytes": "1048576"
    }


def letter_for(value: bytes, key: bytes | None = b"k", error: str = "bad") -> events.DeadLetter:
    return events.DeadLetter.wrap(
        value,
        topic="t",
        partition=2,
        offset=7,
        error=error,
        producer=Producer(component="test", version="1"),
        key=key,
        headers=[("h", b"v")],
    )


def test_bound_dead_letter_keeps_size_hash_and_coordinates() -> None:
    from pipeline.kafka.producer import bound_dead_letter

    small = letter_for(b"x" * 100)
    assert bound_dead_letter(small, 64 * 1024) is small

    value = random.Random(1).randbytes(200_000)
    cut = bound_dead_letter(letter_for(value, error="e" * 10_000), 64 * 1024)
    check_letter(cut, value, ("t", 2, 7), limit=64 * 1024, truncated=True)
    assert cut.original_key() == b"k" and cut.original_headers["h"] == "v"
    assert cut.event_id == small.event_id  # id from the coordinates: replays dedupe

    huge_key = b"K" * 300_000
    cut = bound_dead_letter(letter_for(b"v" * 10, key=huge_key), 128 * 1024)
    assert len(events.encode(cut)) <= 128 * 1024
    assert cut.original_headers["liverl-dlq-original-key-bytes"] == str(len(huge_key))


def check_letter(
    letter: events.DeadLetter,
    value: bytes,
    coords: tuple[str, int, int],
    *,
    limit: int,
    truncated: bool | None = None,
) -> None:
    """A bounded dead letter of ``value``: within ``limit``, coordinates kept, and either the
    exact bytes or a leading cut with the original size and sha256."""
    assert len(events.encode(letter)) <= limit
    assert (letter.source_topic, letter.source_partition, letter.source_offset) == coords
    cut = letter.original_headers.get("liverl-dlq-truncated") == "true"
    if truncated is not None:
        assert cut == truncated
    if cut:
        assert letter.original_headers["liverl-dlq-original-bytes"] == str(len(value))
        sha = hashlib.sha256(value).hexdigest()
        assert letter.original_headers["liverl-dlq-original-sha256"] == sha
        assert sha in letter.error
        assert value.startswith(letter.original()) and len(letter.original()) > limit // 2
    else:
        assert letter.original() == value


# ---- on the real broker ------------------------------------------------------------------------


def spec_topic(admin, settings: Settings, name: str, like: str) -> int:  # type: ignore[no-untyped-def]
    """Create ``name`` with the partitions and config (sizes included) of the spec of ``like``."""
    specs = topics.load_specs(
        settings.topics.specs_dir, max_record_bytes=settings.kafka.max_record_bytes
    )
    (spec,) = (s for s in specs if s.name == like)
    for fut in admin.create_topics(
        [NewTopic(name, spec.partitions, 1, config=spec.config)]
    ).values():
        fut.result(timeout=30)
    return spec.partitions


class Sender:
    """Produces raw records (also ones over every limit, lz4-compressed so that the broker
    accepts them, as it did in the reproduction) and remembers where each one landed."""

    def __init__(self, settings: Settings) -> None:
        self.p = EventProducer(settings, client_id="test-size", **{"message.max.bytes": 64 * 2**20})
        self.where: dict[str, tuple[str, int, int]] = {}
        self.values: dict[str, bytes] = {}

    def __call__(self, label: str, topic: str, value: bytes, key: bytes | None) -> None:
        def done(err: Any, msg: Any) -> None:
            assert err is None, err
            self.where[label] = (msg.topic(), msg.partition(), msg.offset())

        self.values[label] = value
        self.p.send_raw(topic, value, key=key, on_delivery=done)
        self.p.flush()


def end_offsets(settings: Settings, topic: str) -> dict[int, int]:
    c = Consumer(settings.kafka_client_config(**{"group.id": "size-wm"}))
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), 10)[1] for p in parts}
    finally:
        c.close()


class DlqReader:
    """Reads the shared DLQ from its end at creation; keeps letters by source coordinates."""

    def __init__(self, settings: Settings) -> None:
        self.c = Consumer(
            settings.kafka_client_config(
                **{
                    "group.id": "size-dlq-reader",
                    "max.partition.fetch.bytes": settings.kafka.max_fetch_bytes,
                }
            )
        )
        start = end_offsets(settings, names.DLQ)
        self.c.assign([TopicPartition(names.DLQ, p, o) for p, o in start.items()])
        self.letters: dict[tuple[str, int, int], events.DeadLetter] = {}
        self.raw_sizes: dict[tuple[str, int, int], int] = {}

    def poll(self, timeout: float = 0.5) -> None:
        for msg in self.c.consume(100, timeout=timeout):
            if msg.error() is None:
                letter = events.decode(msg.value(), expected_type="dlq")
                assert isinstance(letter, events.DeadLetter)
                coords = (letter.source_topic, letter.source_partition, letter.source_offset)
                self.letters[coords] = letter
                self.raw_sizes[coords] = len(msg.value())

    def wait(self, coords: list[tuple[str, int, int]], limit_s: float = 60.0) -> None:
        deadline = time.monotonic() + limit_s
        while not all(c in self.letters for c in coords) and time.monotonic() < deadline:
            self.poll()

    def close(self) -> None:
        self.c.close()


def padded_json(size: int, **fields: Any) -> bytes:
    """A JSON object of ``size`` bytes (compresses to almost nothing)."""
    head = orjson.dumps({**fields, "pad": ""})
    return head[:-2] + b"x" * (size - len(head)) + b'"}'


@pytest.mark.integration
def test_weights_consumer_dead_letters_oversized_values_and_goes_on(
    kafka_settings: Settings, admin, unique: str
) -> None:
    """The reloader's consumer (same EventConsumer arguments) on a weights-like topic."""
    topic = f"test.size.weights.{unique}"
    spec_topic(admin, kafka_settings, topic, names.WEIGHTS)
    dlq = DlqReader(kafka_settings)
    send = Sender(kafka_settings)
    good = dataclasses.replace(examples.examples()["weights"], event_id=f"w-{unique}")
    send("huge", topic, padded_json(10_500_000, type="weights"), b"p")  # over the codec limit
    send("poison", topic, b"{" + b"x" * 7_200_000, b"p")  # within it, invalid, base64 > limit
    send("good", topic, events.encode(good), b"p")

    consumer = EventConsumer(
        kafka_settings,
        group_id=f"size-reloader-{unique}",
        topics=[topic],
        component="reloader",
        auto_offset_reset="earliest",
        **{"enable.auto.commit": False},
    )
    got: list[events.Event] = []
    dead = 0
    deadline = time.monotonic() + 60
    try:
        while not got and time.monotonic() < deadline:
            batch = consumer.poll_batch(max_records=100, timeout=0.5)
            got += [r.event for r in batch.records]
            dead += batch.dead_lettered
    finally:
        consumer.close()
    assert [e.event_id for e in got] == [good.event_id] and dead == 2

    dlq.wait([send.where["huge"], send.where["poison"]])
    dlq.close()
    limit = kafka_settings.kafka.max_event_bytes
    for label in ("huge", "poison"):
        letter = dlq.letters[send.where[label]]
        check_letter(letter, send.values[label], send.where[label], limit=limit, truncated=True)
    assert "exceeds limit" in dlq.letters[send.where["huge"]].error


def make_sample(i: int, policy: str, **overrides: Any) -> Sample:
    rng = random.Random(i)
    response = [rng.randrange(10, 400) for _ in range(4)]
    fields: dict[str, Any] = {
        "event_id": f"size-sample-{policy}-{i}",
        "producer": Producer(component="test", version="0"),
        "session_id": f"sess-{i}",
        "turn": i,
        "policy_id": policy,
        "prompt_token_ids": [1, *[rng.randrange(10, 400) for _ in range(6)], 2],
        "response_token_ids": response,
        "loss_mask": [1] * len(response),
        "behavior_logprobs": [-6.0] * len(response),
        "reward": rng.choice([-1.0, 1.0]),
        "hints": [],
        "behavior_weight_version": 0,
    }
    fields.update(overrides)
    return Sample(**fields)


@pytest.mark.integration
def test_trainer_dead_letters_oversized_samples_and_trains_the_rest(
    kafka_settings: Settings, admin, unique: str, tmp_path: Path
) -> None:
    """A 7.2 MB sample (valid, too long to train: its base64 letter exceeded the broker's
    limit) and a value over the codec limit, between good samples, all on one partition."""
    from deltalake import DeltaTable

    from pipeline.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(tmp_path / "tiny")
    topic, policy = f"test.size.samples.{unique}", f"p-{unique}"
    spec_topic(admin, kafka_settings, topic, names.SAMPLES)
    dlq = DlqReader(kafka_settings)
    send = Sender(kafka_settings)
    good = [make_sample(i, policy) for i in range(4)]
    long = make_sample(9, policy, prompt_token_ids=[1] * 3_600_000)  # "1," per id: 7.2 MB
    for s in good[:2]:
        send(s.event_id, topic, events.encode(s), b"k")
    send("long", topic, events.encode(long, version=1), b"k")  # v2: 4 bytes (base64 5.3) per id
    assert 7 * MB < len(send.values["long"]) < kafka_settings.kafka.max_event_bytes
    send("huge", topic, padded_json(9_000_000, type="sample"), b"k")
    for s in good[2:]:
        send(s.event_id, topic, events.encode(s), b"k")

    cmd = [
        sys.executable, "-m", "pipeline.trainer.commands", "--policy", policy,
        "--method", "rl",  # the old default: these samples carry rewards, not hints
        "--model", str(tiny), "--topic", topic,
        "--weights-root", str(tmp_path / "weights"), "--lake-root", str(tmp_path / "lake"),
        "--batch-samples", "2", "--batch-wait", "0.05", "--publish-every-steps", "1",
        "--publish-max-overhead", "1", "--device", "cpu", "--exit-when-idle", "3",
    ]  # fmt: skip
    env = dict(os.environ, LIVERL_KAFKA_BOOTSTRAP=kafka_settings.bootstrap)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows = DeltaTable(str(tmp_path / "lake" / "trajectories")).to_pyarrow_table().to_pylist()
    assert sorted(r["event_id"] for r in rows) == sorted(s.event_id for s in good)
    dlq.wait([send.where["long"], send.where["huge"]])
    dlq.close()
    limit = kafka_settings.kafka.max_event_bytes
    for label in ("long", "huge"):
        letter = dlq.letters[send.where[label]]
        check_letter(letter, send.values[label], send.where[label], limit=limit, truncated=True)


@pytest.mark.integration
def test_worker_dead_letters_oversized_and_keyless_records_and_goes_on(
    kafka_settings: Settings, unique: str, tmp_path: Path
) -> None:
    """The Faust worker on the real interactions/next_states topics (sessions of this test's
    prefix): big valid records are processed, oversized and keyless ones dead-lettered with a
    bounded letter, the worker stays up, and the good session after them is judged and sampled."""
    from confluent_kafka.admin import AdminClient

    from .test_processors_integration import (
        RULES,
        drop_internal_topics,
        high_watermarks,
        input_ends,
        start_group_at,
        start_worker,
        stop,
    )

    prefix = f"size-{unique}"
    big_sid, ok_sid = f"{prefix}-big", f"{prefix}-ok"
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    dlq = DlqReader(kafka_settings)
    start = high_watermarks(kafka_settings)
    inputs = input_ends(kafka_settings)  # the worker starts here, not at a broker's history
    send = Sender(kafka_settings)
    base = examples.interaction(prompt_tokens=4, response_tokens=2)

    def inter(sid: str, **kw: Any) -> events.Interaction:
        fields: dict[str, Any] = dict(
            event_id=f"{sid}-i0", session_id=sid, turn=0, tool_calls=[], session_done=True
        )
        return dataclasses.replace(base, **{**fields, **kw})

    def ns(sid: str, turn: int, content: str) -> events.NextState:
        return events.NextState(
            event_id=f"{sid}-ns{turn}",
            producer=Producer(component="test", version="1"),
            session_id=sid,
            turn=turn,
            kind="user_reply",
            role="user",
            content=content,
            source="feedback-endpoint",
        )

    # 1.2 MB of token ids: the token payload and the sample are over aiokafka's 1 MB default.
    big = inter(big_sid, prompt_token_ids=[7] * 620_000)
    send("big", names.INTERACTIONS, events.encode(big), big_sid.encode())
    assert len(send.values["big"]) > 1.2 * MB
    send(
        "huge-i",
        names.INTERACTIONS,
        padded_json(9_000_000, type="interaction"),
        b"%s-h" % prefix.encode(),
    )
    send("keyless-i", names.INTERACTIONS, events.encode(inter(f"{prefix}-nokey")), None)
    stray = ns(big_sid, 9, "y" * 2_670_000)  # unknown turn: dead-lettered after the grace
    send("stray", names.NEXT_STATES, events.encode(stray), big_sid.encode())
    send(
        "huge-n",
        names.NEXT_STATES,
        padded_json(9_000_000, type="next_state"),
        b"%s-h" % prefix.encode(),
    )
    send("keyless-n", names.NEXT_STATES, events.encode(ns(f"{prefix}-nokey", 0, "hi")), None)
    send("ok-i", names.INTERACTIONS, events.encode(inter(ok_sid)), ok_sid.encode())
    send(
        "ok-n",
        names.NEXT_STATES,
        events.encode(ns(ok_sid, 0, "Thanks, that works")),
        ok_sid.encode(),
    )

    app_id = f"size-{unique}"
    # Each session is done at turn 0: its reply (and the stray) must find it open, whichever
    # topic the worker reads first (a next state after the assembly is left out: "late").
    # From the topics' ends before this test's records: on a broker with a long history a
    # worker reading from the beginning met the ok session's reply long before its turn and
    # gave up on it after grace_s.
    start_group_at(kafka_settings, app_id, inputs)
    proc = start_worker(app_id, prefix, rules, tmp_path, hint_wait_s="5")
    out = Consumer(
        kafka_settings.kafka_client_config(
            **{"group.id": f"size-out-{unique}", "max.partition.fetch.bytes": 10 * 2**20}
        )
    )
    out.assign([TopicPartition(t, p, o) for (t, p), o in start.items() if t != names.DLQ])
    got: dict[tuple[str, str], list[Any]] = {}
    bad = ["huge-i", "keyless-i", "stray", "huge-n", "keyless-n"]

    def done() -> bool:
        return (
            all((s, names.SAMPLES) in got for s in (big_sid, ok_sid))
            and (ok_sid, names.PRM_SCORES) in got
            and all(send.where[b] in dlq.letters for b in bad)
        )

    try:
        deadline = time.monotonic() + 120
        while not done() and time.monotonic() < deadline and proc.poll() is None:
            for msg in out.consume(100, timeout=0.3):
                if msg.error() is None and msg.key() in (big_sid.encode(), ok_sid.encode()):
                    got.setdefault((msg.key().decode(), msg.topic()), []).append(
                        events.decode(msg.value())
                    )
            dlq.poll(timeout=0.2)
        alive = proc.poll() is None
        changelog = f"{app_id}-tokens-changelog"
        resource = ConfigResource(ConfigResource.Type.TOPIC, changelog)
        admin = AdminClient(kafka_settings.kafka_client_config())
        described = admin.describe_configs([resource])[resource].result(timeout=10)
    finally:
        stop(proc)
        out.close()
        dlq.close()
        drop_internal_topics(kafka_settings, app_id)
    log = (tmp_path / f"{app_id}.log").read_text()[-3000:]
    assert alive, log
    missing = [b for b in bad if send.where[b] not in dlq.letters]
    assert done(), (missing, sorted(got), log)

    assert got[(big_sid, names.SAMPLES)][0].prompt_token_ids == big.prompt_token_ids
    assert any(p.score == 1 for p in got[(ok_sid, names.PRM_SCORES)])
    limit = kafka_settings.kafka.max_event_bytes
    for label in bad:
        letter = dlq.letters[send.where[label]]
        check_letter(letter, send.values[label], send.where[label], limit=limit)
    assert "no Kafka key" in dlq.letters[send.where["keyless-i"]].error
    assert "no Kafka key" in dlq.letters[send.where["keyless-n"]].error
    assert "unknown turn 9" in dlq.letters[send.where["stray"]].error
    assert dlq.letters[send.where["stray"]].original() == send.values["stray"]  # 3.6 MB: fits
    assert "exceeds limit" in dlq.letters[send.where["huge-n"]].error
    assert int(described["max.message.bytes"].value) == kafka_settings.kafka.max_record_bytes
