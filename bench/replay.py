"""Replay throughput: Kafka -> Kafka (and Delta -> Kafka) next to the broker's raw produce rate.

One run, one broker, the same bytes: N interaction envelopes of ~2 KB (with their liverl
headers, keyed by session over 6 partitions) are produced raw with confluent-kafka
(idempotent, acks=all, the codec's compression): that is the raw rate. Then the replay copies
them into a namespace (``pipeline.replay.replay.run``, --speed max: byte-exact, six more
headers, original timestamps, partition by partition). With the archive available, the same
topic is archived into a scratch lake and replayed from Delta too. Topics and the lake are
removed at the end.

    .venv/bin/python bench/replay.py [--events 50000] [--out .liverl/bench-replay.json]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from pipeline import events
from pipeline.events import examples
from pipeline.kafka import names
from pipeline.replay.replay import DeltaSource, KafkaSource, Manifest, Span, run, watermarks
from pipeline.settings import Settings

PARTITIONS = 6


def envelope(target: int = 2048) -> tuple[bytes, list[tuple[str, bytes]]]:
    """An interaction envelope of about ``target`` bytes, and its headers."""
    n = 8
    while True:
        ev = examples.interaction(prompt_tokens=n, response_tokens=n // 4)
        value = events.encode(ev)
        if len(value) >= target:
            return value, events.headers(ev)
        n += 8


def create(admin: AdminClient, topics: list[str]) -> None:
    new = [NewTopic(t, PARTITIONS, 1, config={"retention.ms": "-1"}) for t in topics]
    for fut in admin.create_topics(new).values():
        fut.result(30)


def produce_raw(
    settings: Settings, topic: str, value: bytes, headers: list[tuple[str, bytes]], n: int
) -> float:
    """Records/s of the plain client for the same bytes (keys spread over 1,000 sessions)."""
    p = Producer(
        settings.kafka_client_config(
            **{
                "enable.idempotence": True,
                "acks": "all",
                "compression.type": settings.kafka.compression,
                "linger.ms": 50,
                "batch.size": 1_000_000,
                "queue.buffering.max.kbytes": 131072,
                "partitioner": "murmur2_random",
            }
        )
    )
    keys = [f"bench-session-{i}".encode() for i in range(1000)]
    started = time.perf_counter()
    for i in range(n):
        deadline = time.monotonic() + 120
        while True:
            try:
                p.produce(topic, value=value, key=keys[i % 1000], headers=headers)
                break
            except BufferError:  # queue full: serve delivery reports until there is room
                if time.monotonic() > deadline:
                    raise SystemExit("the producer queue stayed full for 120 s") from None
                p.poll(0.05)
        if i & 1023 == 0:
            p.poll(0)
    assert p.flush(120) == 0
    return n / (time.perf_counter() - started)


def spans_of(settings: Settings, topic: str) -> list[Span]:
    from pipeline.replay.replay import reader

    c = reader(settings)
    try:
        out = []
        for p in range(PARTITIONS):
            low, high = watermarks(c, topic, p)
            if high > low:
                out.append(Span(topic, p, low, high))
        return out
    finally:
        c.close()


def replay_rate(settings: Settings, source: Any, spans: list[Span], ns: str) -> dict[str, Any]:
    manifest = Manifest(ns, {"bench": True}, spans)
    starts = {(s.topic, s.partition): s.start for s in spans}
    stats = run(settings, manifest, source, starts, speed=None, keys=None)
    source.close()
    return {"records": stats.produced, "seconds": round(stats.seconds, 2), "rate": stats.rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=50_000)
    ap.add_argument("--out", type=Path, default=None, help="Also write the figures as JSON.")
    args = ap.parse_args()
    settings = Settings()
    admin = AdminClient(settings.kafka_client_config())
    tag = uuid.uuid4().hex[:8]
    raw_topic, src = f"bench.replay-raw.{tag}", f"bench.replay-src.{tag}"
    ns_kafka, ns_delta = f"benchk{tag}", f"benchd{tag}"
    dests = [names.resolve(src, ns_kafka), names.resolve(src, ns_delta)]
    value, headers = envelope()
    create(admin, [raw_topic, src, *dests])
    lake = Path(tempfile.mkdtemp(prefix="bench-replay-lake-"))
    result: dict[str, Any] = {"events": args.events, "value_bytes": len(value)}
    try:
        result["raw_produce_rate"] = produce_raw(settings, raw_topic, value, headers, args.events)
        produce_raw(settings, src, value, headers, args.events)  # the replay's source
        spans = spans_of(settings, src)
        result["kafka_to_kafka"] = replay_rate(settings, KafkaSource(settings), spans, ns_kafka)
        try:
            from pipeline.lake.archive import Archiver
        except ImportError:
            result["delta_to_kafka"] = None  # the archive is not there yet
        else:
            t0 = time.perf_counter()
            Archiver(settings, [src], lake).run()
            result["archive_seconds"] = round(time.perf_counter() - t0, 2)
            source = DeltaSource(settings, lake)
            delta_spans = source.spans([src], None, None, lambda topic, n: None)
            result["delta_to_kafka"] = replay_rate(settings, source, delta_spans, ns_delta)
    finally:
        for fut in admin.delete_topics([raw_topic, src, *dests]).values():
            try:
                fut.result(60)
            except Exception as exc:  # noqa: BLE001 - report, keep cleaning
                print(f"cleanup: {exc}")
        shutil.rmtree(lake, ignore_errors=True)
    raw = result["raw_produce_rate"]
    print(f"{args.events} events of {len(value)} bytes")
    print(f"raw produce (confluent-kafka, same bytes): {raw:10,.0f} events/s")
    for name in ("kafka_to_kafka", "delta_to_kafka"):
        figures = result.get(name)
        if figures:
            print(
                f"replay {name.replace('_to_', ' -> '):<15}: {figures['rate']:10,.0f} events/s "
                f"({figures['rate'] / raw:.2f}x raw, {figures['seconds']} s)"
            )
        elif name in result:
            print(f"replay {name}: skipped (no pipeline/lake/archive.py)")
    if args.out:
        args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
