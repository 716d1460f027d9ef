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


class RawPath:
    """Baseline: pre-encoded bytes through plain confluent-kafka clients."""

    def __init__(self, settings: Settings, topic: str, payload: bytes) -> None:
        self.payload = payload
        self.topic = topic
        self.prod = Producer(
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
        self.cons = Consumer(
            settings.kafka_client_config(
                **{"group.id": topic, "auto.offset.reset": "earliest", "enable.auto.commit": False}
            )
        )
        self.cons.subscribe([topic])

    def send(self, i: int) -> None:
        self.prod.produce(self.topic, self.payload, key=str(i).encode())
        self.prod.poll(0)

    def flush(self) -> None:
        self.prod.flush(30)

    def receive(self, timeout: float, max_n: int = 500) -> list[int]:
        msgs = self.cons.consume(max_n, timeout=timeout)
        return [int(m.key()) for m in msgs if m.error() is None]

    def close(self) -> None:
        self.cons.close()


class CodecPath:
    """liverl: EventProducer.send (encode) -> EventConsumer.poll_batch (decode + validate)."""

    def __init__(self, settings: Settings, topic: str, event: events.Interaction) -> None:
        self.event = event
        self.topic = topic
        self.prod = EventProducer(settings, client_id="bench")
        self.cons = EventConsumer(
            settings, group_id=topic, topics=[topic], expected_types={topic: "interaction"}
        )

    def send(self, i: int) -> None:
        self.prod.send(self.topic, replace(self.event, event_id=str(i)))

    def flush(self) -> None:
        self.prod.flush()

    def receive(self, timeout: float, max_n: int = 500) -> list[int]:
        batch = self.cons.poll_batch(max_records=max_n, timeout=timeout)
        self.cons.store(batch)
        return [int(r.event.event_id) for r in batch.records]

    def close(self) -> None:
        self.cons.close()


def measure(path: RawPath | CodecPath, n: int, pings: int) -> dict[str, float]:
    """Throughput: produce n, then drain. Latency: one event in flight at a time."""
    path.receive(0.5)  # join the group before timing
    start = time.perf_counter()
    for i in range(n):
        path.send(i)
    path.flush()
    got = 0
    while got < n:
        got += len(path.receive(1.0))
    elapsed = time.perf_counter() - start
    lat: list[float] = []
    for i in range(n, n + pings):
        t0 = time.perf_counter()
        path.send(i)
        path.flush()
        # consume() returns at max_n records or the timeout: ask for one so it returns at once.
        while i not in path.receive(1.0, max_n=1):
            pass
        lat.append(time.perf_counter() - t0)
    path.close()
    return {
        "events_s": n / elapsed,
        "p50_ms": _pct(lat, 0.5) * 1e3,
        "p99_ms": _pct(lat, 0.99) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pings", type=int, default=200, help="latency samples per run")
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
        raws.append(
            measure(RawPath(settings, _topic(admin, "raw"), payload), args.events, args.pings)
        )
        codecs.append(
            measure(CodecPath(settings, _topic(admin, "codec"), event), args.events, args.pings)
        )
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
