"""Produce→consume throughput and latency on the local broker: liverl codec v1 and v2 vs raw bytes.

The baseline (raw pre-encoded bytes through confluent-kafka) and the codec path
(EventProducer.send → EventConsumer.poll_batch: encode, decode, schema validation) run
back to back on the same broker with the same event, so the ratio is what the codec costs.
Each repeat runs raw v1 bytes, codec v1, raw v2 bytes, codec v2 and codec v2 "packed" in turn
(the codec version is ``kafka.codec_version``), so all ratios come from the same run. Codec v2
sends an event whose token fields are lists (as the gateway builds it from the engine's
answer: encoding packs them); "packed" sends one that holds the packed arrays a decoded event
has (what the processors, replay and the trainer re-send), so encoding is a copy.

    .venv/bin/python bench/produce_consume.py [--events 2000] [--halves]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

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


STALL_S = 60.0  # a wait for records gives up after this long without one


def raw_producer(settings: Settings) -> Producer:
    """The baseline's producer: what EventProducer sets that changes the wire, nothing else."""
    return Producer(
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


class RawPath:
    """Baseline: pre-encoded bytes through plain confluent-kafka clients."""

    def __init__(self, settings: Settings, topic: str, payload: bytes) -> None:
        self.payload = payload
        self.topic = topic
        self.prod = raw_producer(settings)
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
        # Told apart by key, as the raw path's records are (a copy of the event per send
        # would put the bench's own work on the codec's side).
        self.prod.send(self.topic, self.event, key=str(i))

    def flush(self) -> None:
        self.prod.flush()

    def receive(self, timeout: float, max_n: int = 500) -> list[int]:
        batch = self.cons.poll_batch(max_records=max_n, timeout=timeout)
        self.cons.store(batch)
        return [int(r.key or b"-1") for r in batch.records]

    def close(self) -> None:
        self.cons.close()


class ProducerHalf(RawPath):
    """Where the codec's cost lies, its producer half: EventProducer.send (encoding, headers,
    a delivery report per record) into the baseline's consumer."""

    def __init__(self, settings: Settings, topic: str, event: events.Event) -> None:
        super().__init__(settings, topic, b"")
        self.event = event
        self.events = EventProducer(settings, client_id="bench")

    def send(self, i: int) -> None:
        self.events.send(self.topic, self.event, key=str(i))

    def flush(self) -> None:
        self.events.flush()


class ConsumerHalf(CodecPath):
    """The consumer half: the baseline's producer sending the codec's bytes and headers into
    EventConsumer.poll_batch (decoding, validation, the typed records)."""

    def __init__(self, settings: Settings, topic: str, event: events.Event) -> None:
        super().__init__(settings, topic, event)
        v = settings.kafka.codec_version
        self.value, self.headers = events.encode(event, version=v), events.headers(event, version=v)
        self.raw_prod = raw_producer(settings)

    def send(self, i: int) -> None:
        self.raw_prod.produce(self.topic, self.value, key=str(i).encode(), headers=self.headers)
        self.raw_prod.poll(0)

    def flush(self) -> None:
        self.raw_prod.flush(30)


def measure(path: RawPath | CodecPath, n: int, pings: int) -> dict[str, float]:
    """Throughput: produce n, then drain. Latency: one event in flight at a time."""
    path.receive(0.5)  # join the group before timing
    start = time.perf_counter()
    for i in range(n):
        path.send(i)
    path.flush()
    got, last = 0, time.monotonic()
    while got < n:
        new = len(path.receive(1.0))
        got += new
        if new:
            last = time.monotonic()
        elif time.monotonic() - last > STALL_S:
            raise SystemExit(f"received {got} of {n} events; none in the last {STALL_S:.0f} s")
    elapsed = time.perf_counter() - start
    lat: list[float] = []
    for i in range(n, n + pings):
        t0 = time.perf_counter()
        path.send(i)
        path.flush()
        # consume() returns at max_n records or the timeout: ask for one so it returns at once.
        deadline = time.monotonic() + STALL_S
        while i not in path.receive(1.0, max_n=1):
            if time.monotonic() > deadline:
                raise SystemExit(f"ping {i} not received within {STALL_S:.0f} s")
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
    parser.add_argument(
        "--halves",
        action="store_true",
        help="also run packed v2 through each half of the codec path alone "
        "(its producer into a raw consumer, a raw producer into its consumer)",
    )
    args = parser.parse_args()

    base = Settings()
    admin = AdminClient(base.kafka_client_config())
    admin.list_topics(timeout=10)
    event = examples.interaction(prompt_tokens=2048, response_tokens=512, text_repeat=10)
    payloads = {v: events.encode(event, version=v) for v in (1, 2)}
    packed = events.decode(payloads[2], "interaction")
    assert isinstance(packed, events.Interaction) and packed == event
    settings = {}
    for v in (1, 2):
        settings[v] = base.model_copy(deep=True)
        settings[v].kafka.codec_version = v
    print(
        f"event: interaction, v1 {len(payloads[1]) / 1024:.1f} KiB, v2 "
        f"{len(payloads[2]) / 1024:.1f} KiB of JSON, 2,048 prompt + 512 response tokens; "
        f"{args.events} events x {args.repeats} runs on {base.bootstrap}"
    )
    runs: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for v in (1, 2):
            raw_path = RawPath(base, _topic(admin, f"raw{v}"), payloads[v])
            runs.setdefault(f"raw v{v}", []).append(measure(raw_path, args.events, args.pings))
            codec_path = CodecPath(settings[v], _topic(admin, f"codec{v}"), event)
            runs.setdefault(f"codec v{v}", []).append(measure(codec_path, args.events, args.pings))
        packed_path = CodecPath(settings[2], _topic(admin, "packed"), packed)
        runs.setdefault("packed v2", []).append(measure(packed_path, args.events, args.pings))
        if args.halves:
            for name, half in (("producer half v2", ProducerHalf),
                               ("consumer half v2", ConsumerHalf)):  # fmt: skip
                path = half(settings[2], _topic(admin, name.split()[0]), packed)
                runs.setdefault(name, []).append(measure(path, args.events, args.pings))
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    print(f"{'path':<17}{'events/s':>10}{'MB/s':>8}{'p50 ms':>9}{'p99 ms':>9}")
    for name, r in med.items():
        mb = len(payloads[int(name[-1])]) / 1e6
        print(
            f"{name:<17}{r['events_s']:>10.0f}{r['events_s'] * mb:>8.1f}"
            f"{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}"
        )

    def cost(codec: str, raw: str) -> str:
        over = med[raw]["events_s"] / med[codec]["events_s"] - 1
        p50 = med[codec]["p50_ms"] / med[raw]["p50_ms"]
        return f"{over * 100:+.0f}% wall time per event, p50 {p50:.2f}x"

    print(f"codec v1 vs raw v1 bytes: {cost('codec v1', 'raw v1')} (target <= +50%)")
    print(f"codec v2 vs raw v2 bytes: {cost('codec v2', 'raw v2')} (target <= +50%)")
    print(f"packed v2 vs raw v2 bytes: {cost('packed v2', 'raw v2')} (target <= +50%)")
    for half in ("producer half v2", "consumer half v2"):
        if half in med:
            print(f"{half} vs raw v2 bytes: {cost(half, 'raw v2')}")
    print(f"codec v2 vs raw v1 bytes: {cost('codec v2', 'raw v1')} (the v1 baseline)")
    speed = med["codec v2"]["events_s"] / med["codec v1"]["events_s"]
    print(f"codec v2 / codec v1 throughput: {speed:.2f}x")


if __name__ == "__main__":
    main()
