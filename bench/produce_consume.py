"""Produce→consume throughput and latency on the local broker: liverl codec vs raw bytes.

The baseline (raw pre-encoded bytes through confluent-kafka) and the codec path
(EventProducer.send → EventConsumer.poll_batch: encode, decode, schema validation) run
back to back on the same broker with the same event, so the ratio is what the codec costs.

    .venv/bin/python bench/produce_consume.py [--events 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from dataclasses import replace

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from pipeline import events
from pipeline.events import examples
from pipeline.kafka import EventConsumer, EventProducer
from pipeline.settings import Settings


def _topic(admin: AdminClient, tag: str) -> str:
    name = f"bench.{tag}.{uuid.uuid4().hex[:8]}"
    for fut in admin.create_topics([NewTopic(name, 1, 1)]).values():
        fut.result(30)
    return name


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_raw(settings: Settings, admin: AdminClient, payload: bytes, n: int) -> dict[str, float]:
    topic = _topic(admin, "raw")
    prod = Producer(
        settings.kafka_client_config(
            **{
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "compression.type": settings.kafka.compression,
                "message.max.bytes": settings.kafka.max_event_bytes,
            }
        )
    )
    cons = Consumer(
        settings.kafka_client_config(
            **{"group.id": topic, "auto.offset.reset": "earliest", "enable.auto.commit": False}
        )
    )
    cons.subscribe([topic])
    cons.poll(0.5)
    sent: dict[bytes, float] = {}
    lat: list[float] = []
    start = time.perf_counter()
    for i in range(n):
        key = str(i).encode()
        sent[key] = time.perf_counter()
        prod.produce(topic, payload, key=key)
        prod.poll(0)
        for msg in cons.consume(100, timeout=0):
            if msg.error() is None:
                lat.append(time.perf_counter() - sent[msg.key()])
    prod.flush(30)
    while len(lat) < n:
        for msg in cons.consume(500, timeout=1.0):
            if msg.error() is None:
                lat.append(time.perf_counter() - sent[msg.key()])
    elapsed = time.perf_counter() - start
    cons.close()
    return {
        "events_s": n / elapsed,
        "p50_ms": _pct(lat, 0.5) * 1e3,
        "p99_ms": _pct(lat, 0.99) * 1e3,
    }


def run_codec(
    settings: Settings, admin: AdminClient, event: events.Interaction, n: int
) -> dict[str, float]:
    topic = _topic(admin, "codec")
    prod = EventProducer(settings, client_id="bench")
    cons = EventConsumer(
        settings, group_id=topic, topics=[topic], expected_types={topic: "interaction"}
    )
    cons.poll_batch(timeout=0.5)
    sent: dict[str, float] = {}
    lat: list[float] = []
    variants = [replace(event, event_id=f"e{i}") for i in range(n)]
    start = time.perf_counter()
    for ev in variants:
        sent[ev.event_id] = time.perf_counter()
        prod.send(topic, ev)
        for rec in cons.poll_batch(max_records=100, timeout=0):
            lat.append(time.perf_counter() - sent[rec.event.event_id])
    prod.flush()
    while len(lat) < n:
        for rec in cons.poll_batch(max_records=500, timeout=1.0):
            lat.append(time.perf_counter() - sent[rec.event.event_id])
    elapsed = time.perf_counter() - start
    cons.close()
    return {
        "events_s": n / elapsed,
        "p50_ms": _pct(lat, 0.5) * 1e3,
        "p99_ms": _pct(lat, 0.99) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    settings = Settings()
    admin = AdminClient(settings.kafka_client_config())
    admin.list_topics(timeout=10)
    event = examples.interaction(prompt_tokens=2048, response_tokens=512, text_repeat=10)
    payload = events.encode(event)
    print(
        f"event: interaction, {len(payload) / 1024:.1f} KiB JSON, 2,048 prompt + 512 "
        f"response tokens; {args.events} events x {args.repeats} runs on {settings.bootstrap}"
    )
    raws, codecs = [], []
    for _ in range(args.repeats):
        raws.append(run_raw(settings, admin, payload, args.events))
        codecs.append(run_codec(settings, admin, event, args.events))
    raw = {k: statistics.median(r[k] for r in raws) for k in raws[0]}
    codec = {k: statistics.median(r[k] for r in codecs) for k in codecs[0]}
    mb = len(payload) / 1e6
    print(f"{'path':<8}{'events/s':>10}{'MB/s':>8}{'p50 ms':>9}{'p99 ms':>9}")
    for name, r in (("raw", raw), ("codec", codec)):
        print(
            f"{name:<8}{r['events_s']:>10.0f}{r['events_s'] * mb:>8.1f}"
            f"{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}"
        )
    overhead = raw["events_s"] / codec["events_s"] - 1
    print(
        f"codec cost: {overhead * 100:+.0f}% wall time per event vs raw (target <= +25%); "
        f"p50 {codec['p50_ms'] / raw['p50_ms']:.2f}x raw"
    )


if __name__ == "__main__":
    main()
