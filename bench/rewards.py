"""Reward pipeline benchmark: turns/s through a real worker and interaction->sample latency.

Starts one ``liverl workers`` process (rule judge) against the configured broker, waits for a
warm-up session, then produces ``--sessions`` sessions of ``--turns`` turns each (the last one
``session_done``) and reads the samples back. Latency is measured per turn from the moment its
interaction was handed to the producer to the moment the worker produced its sample (record
timestamp); samples are assembled per session, so it includes the session's later turns.

    .venv/bin/python bench/rewards.py --sessions 200 --turns 5
    .venv/bin/python bench/rewards.py --group-size 4           # sessions in groups of 4
    .venv/bin/python bench/rewards.py --profile /tmp/w.prof    # cProfile of the worker

The worker starts at the end of the topics (``LIVERL_PROCESSORS_AUTO_OFFSET_RESET=latest``):
history on a shared broker is not part of the measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import _support  # noqa: F401  (puts tests/support on the path)
from confluent_kafka import Consumer, TopicPartition

from pipeline import events
from pipeline.kafka import EventProducer, names
from pipeline.settings import Settings
from tests.support import examples


def session(
    sid: str, turns: int, tokens: tuple[int, int], group_id: str | None = None
) -> list[events.Interaction]:
    base = examples.interaction(prompt_tokens=tokens[0], response_tokens=tokens[1])
    msgs: list[dict] = [{"role": "user", "content": "start"}]
    out = []
    for t in range(turns):
        out.append(
            dataclasses.replace(
                base,
                event_id=uuid.uuid4().hex,
                session_id=sid,
                turn=t,
                messages=list(msgs),
                tool_calls=[],
                session_done=t == turns - 1,
                group_id=group_id,
            )
        )
        msgs += [
            {"role": "assistant", "content": "answer"},
            {"role": "user", "content": "thanks" if t % 2 else "that's wrong"},
        ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--response-tokens", type=int, default=128)
    ap.add_argument("--limit-s", type=float, default=180.0)
    ap.add_argument("--rate", type=float, default=0.0, help="sessions/s to offer (0: all at once)")
    ap.add_argument("--group-size", type=int, default=0, help="sessions per group_id (0: none)")
    ap.add_argument("--profile", default="", help="write the worker's cProfile stats here")
    args = ap.parse_args()

    settings = Settings()
    run = uuid.uuid4().hex[:8]
    prefix = f"bench-{run}-"
    consumer = Consumer(settings.kafka_client_config(**{"group.id": f"bench-{run}"}))
    meta = consumer.list_topics(names.SAMPLES, timeout=10).topics[names.SAMPLES]
    consumer.assign(
        [
            TopicPartition(
                names.SAMPLES,
                p,
                consumer.get_watermark_offsets(TopicPartition(names.SAMPLES, p), timeout=10)[1],
            )
            for p in meta.partitions
        ]
    )
    # The worker starts at the end of the topics: history left by earlier runs and tests
    # (thousands of events on a shared broker) must not count against this run.
    env = dict(
        os.environ,
        LIVERL_PROCESSORS_SESSION_PREFIX=prefix,
        LIVERL_PROCESSORS_AUTO_OFFSET_RESET="latest",
    )
    if args.group_size:
        env["LIVERL_PROCESSORS_GROUP_SIZE"] = str(args.group_size)
    env.setdefault("LIVERL_STATE_DIR", tempfile.mkdtemp(prefix="liverl-bench-"))
    code = "from pipeline.processors.commands import workers; workers()"
    if args.profile:
        code = (
            "import atexit, cProfile; from pipeline.processors.commands import workers; "
            "p = cProfile.Profile(); "
            f"atexit.register(lambda: (p.disable(), p.dump_stats({args.profile!r}))); "
            "p.enable(); workers()"
        )
    with open(os.path.join(env["LIVERL_STATE_DIR"], "worker.log"), "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-c", code, "--app-id", f"bench-{run}", "--no-web"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    producer = EventProducer(settings, client_id="bench", partitioner="murmur2_random")
    tokens = (args.prompt_tokens, args.response_tokens)
    sent: dict[tuple[str, int], float] = {}
    got: dict[tuple[str, int], float] = {}

    def drain(until: int, deadline: float, warmup: bool = False) -> None:
        while len(got) < until and time.monotonic() < deadline and worker.poll() is None:
            for msg in consumer.consume(1000, timeout=0.2):
                if msg.error() is None and (msg.key() or b"").startswith(prefix.encode()):
                    s = events.decode(msg.value())
                    if warmup != s.session_id.startswith(f"{prefix}warmup"):
                        continue
                    # When the worker produced the sample (broker CreateTime, same host clock).
                    got.setdefault((s.session_id, s.turn), msg.timestamp()[1] / 1000)

    try:
        # The worker reads from the end, so warm-up sessions sent before it has its partitions
        # are never seen: offer one every few seconds until one comes back.
        up_deadline = time.monotonic() + 120
        attempt = 0
        while len(got) < 2 and time.monotonic() < up_deadline and worker.poll() is None:
            for inter in session(f"{prefix}warmup{attempt}", 2, tokens):
                producer.send(names.INTERACTIONS, inter)
            producer.flush()
            attempt += 1
            drain(2, min(up_deadline, time.monotonic() + 5), warmup=True)
        if len(got) < 2:
            sys.exit("worker did not come up (see worker.log in the state dir)")
        got.clear()
        sessions = [
            session(
                f"{prefix}{i}",
                args.turns,
                tokens,
                f"{prefix}g{i // args.group_size}" if args.group_size else None,
            )
            for i in range(args.sessions)
        ]
        start, wall0 = time.monotonic(), time.time()
        for i, sess in enumerate(sessions):
            if args.rate:
                time.sleep(max(0.0, start + i / args.rate - time.monotonic()))
                producer.poll(0)
            for inter in sess:
                sent[(inter.session_id, inter.turn)] = time.time()
                producer.send(names.INTERACTIONS, inter)
        producer.flush()
        produced = time.monotonic()
        drain(len(sent), produced + args.limit_s)
        end = max(got.values(), default=wall0) - wall0 + start
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()
        consumer.close()
        from confluent_kafka.admin import AdminClient  # drop this run's Faust internal topics

        admin = AdminClient(settings.kafka_client_config())
        mine = [t for t in admin.list_topics(timeout=10).topics if t.startswith(f"bench-{run}-")]
        if mine:
            admin.delete_topics(mine, operation_timeout=30)

    lat = sorted((got[k] - sent[k]) * 1000 for k in got if k in sent)
    n = len(lat)
    print(
        f"turns produced {len(sent)}, samples received {n} "
        f"({args.sessions} sessions x {args.turns} turns, "
        f"{args.prompt_tokens}/{args.response_tokens} tokens)"
    )
    print(f"produce rate      {len(sent) / max(produced - start, 1e-9):10.1f} turns/s")
    print(f"pipeline rate     {n / max(end - start, 1e-9):10.1f} turns/s (interaction -> sample)")
    if n:
        p99 = lat[min(n - 1, int(0.99 * n))]
        p50 = statistics.median(lat)
        print(f"latency p50 {p50:8.1f} ms   p99 {p99:8.1f} ms   max {lat[-1]:.1f} ms")


if __name__ == "__main__":
    main()
