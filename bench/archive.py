"""Archive throughput: a pre-filled topic into a tmp Delta table, next to a raw consume.

Fills a fresh topic with ~2 KB interaction envelopes (the real EventProducer, so values,
keys and headers are what the gateway sends), then in the same run reads it twice: a plain
confluent-kafka consume of every record (the broker's rate for these bytes), and
``Archiver`` one-shot into a temporary lake (consume + envelope decode + Arrow + Parquet +
Delta commits). The issue's target: >= 20,000 events/s, or within 2x of the raw rate.

    .venv/bin/python bench/archive.py [--events 200000] [--partitions 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from deltalake import DeltaTable

from pipeline import events
from pipeline.events import examples
from pipeline.kafka import EventProducer
from pipeline.lake.archive import Archiver, archive_path
from pipeline.settings import Settings


def fill(settings: Settings, topic: str, n: int) -> tuple[int, int]:
    """n interactions (distinct ids and sessions); returns (value bytes, one value's size)."""
    base = examples.interaction(prompt_tokens=24, response_tokens=8)
    producer = EventProducer(settings, client_id="bench-archive")
    size = len(events.encode(base))
    for i in range(n):
        producer.send(
            topic, dataclasses.replace(base, event_id=f"{i:032x}", session_id=f"s{i % 997}")
        )
    producer.flush(120)
    return size * n, size


def raw_consume(
    settings: Settings, topic: str, partitions: int, n: int
) -> tuple[float, float, int]:
    """Wall and CPU seconds to receive all n records with plain confluent-kafka, and bytes."""
    consumer = Consumer(
        settings.kafka_client_config(
            **{
                "group.id": f"bench-raw-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            }
        )
    )
    start, cpu = time.perf_counter(), time.process_time()
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    got = nbytes = 0
    last = time.monotonic()
    while got < n:
        msgs = consumer.consume(num_messages=10_000, timeout=1.0)
        if msgs:
            last = time.monotonic()
        elif time.monotonic() - last > 60:
            raise SystemExit(f"read {got} of {n} records; none in the last 60 s")
        for msg in msgs:
            if msg.error() is None:
                value, key = msg.value(), msg.key()
                nbytes += len(value or b"") + len(key or b"")
                got += 1
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    consumer.close()
    return elapsed, cpu, nbytes


def archive(settings: Settings, topic: str, n: int) -> tuple[float, float, int, int]:
    """Wall and CPU seconds to archive the topic into a fresh lake (open to last commit),
    bytes, commits."""
    with tempfile.TemporaryDirectory(prefix="bench-archive-") as lake:
        archiver = Archiver(settings, [topic], lake)
        start, cpu = time.perf_counter(), time.process_time()
        archiver.open()
        archiver.run()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        sink = archiver.tables[topic]
        rows = DeltaTable(str(archive_path(Path(lake), topic))).count()
        assert rows == n == sink.records, (rows, n, sink.records)
        return elapsed, cpu, sink.bytes, sink.commits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    settings = Settings()
    admin = AdminClient(settings.kafka_client_config())
    topic = f"bench.archive.{uuid.uuid4().hex[:8]}"
    for fut in admin.create_topics([NewTopic(topic, args.partitions, 1)]).values():
        fut.result(30)
    try:
        t0 = time.perf_counter()
        total, size = fill(settings, topic, args.events)
        print(
            f"{args.events:,} interaction envelopes of {size:,} B ({total / 1e6:.0f} MB) in "
            f"{args.partitions} partitions, filled in {time.perf_counter() - t0:.0f} s "
            f"({settings.bootstrap})"
        )
        raws, archs = [], []
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            raws.append(raw_consume(settings, topic, args.partitions, args.events))
            archs.append(archive(settings, topic, args.events))
        raw_s, arch_s = (statistics.median(r[0] for r in runs) for runs in (raws, archs))
        raw_cpu, arch_cpu = (statistics.median(r[1] for r in runs) for runs in (raws, archs))
        raw_mb, arch_mb = raws[0][2] / 1e6, archs[0][2] / 1e6
        print(f"{'path':<26}{'events/s':>10}{'MB/s':>8}{'wall s':>8}{'CPU s':>7}{'CPU us/ev':>11}")
        for name, secs, cpu, mb in (
            ("raw consume (confluent)", raw_s, raw_cpu, raw_mb),
            ("archive -> Delta", arch_s, arch_cpu, arch_mb),
        ):
            print(
                f"{name:<26}{args.events / secs:>10,.0f}{mb / secs:>8.1f}{secs:>8.2f}"
                f"{cpu:>7.2f}{cpu / args.events * 1e6:>11.1f}"
            )
        print(
            f"archive / raw: {arch_s / raw_s:.2f}x the wall time, {arch_cpu / raw_cpu:.2f}x the "
            f"CPU ({archs[0][3]} commit(s); median of {args.repeats} run(s); target: "
            ">= 20,000 events/s or <= 2x)"
        )
    finally:
        for fut in admin.delete_topics([topic]).values():
            fut.result(30)


if __name__ == "__main__":
    main()
