"""Kill soak for the reward workers: SIGKILL them again and again under load, then count.

Starts ``--workers`` worker processes of one fresh consumer group (worker indexes 0..N-1),
offers ``--sessions`` sessions of ``--turns`` turns at ``--turn-rate`` turns/s, and every
``--kill-every-s`` SIGKILLs one worker (round robin) and restarts it with its index, until
``--kills`` kills are done. Then it waits for every turn's sample and reads the derived topics
with a plain read_committed consumer, counting raw records (no deduplication): per topic the
records, the event ids seen more than once, and the turns without a sample or a reward.
``--guarantees at-least-once,exactly-once`` runs the same soak once per guarantee, so the
duplicates at-least-once leaves behind sit next to exactly-once's in one run.

    .venv/bin/python bench/eos_soak.py                                  # 10 kills, exactly once
    .venv/bin/python bench/eos_soak.py --guarantees at-least-once,exactly-once --kills 6
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from typing import Any

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from pipeline import events
from pipeline.events import examples
from pipeline.kafka import EventProducer, names
from pipeline.settings import Settings

DERIVED = (names.NEXT_STATES, names.PRM_SCORES, names.REWARDS, names.SAMPLES)
INPUTS = (names.INTERACTIONS, names.NEXT_STATES, names.HINTS)


def ends(settings: Settings, topics: tuple[str, ...]) -> dict[tuple[str, int], int]:
    c = Consumer(settings.kafka_client_config(**{"group.id": "soak-probe"}))
    try:
        return {(t, p): c.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1]
                for t in topics for p in c.list_topics(t, timeout=10).topics[t].partitions}
    finally:
        c.close()


def session(sid: str, turns: int) -> list[events.Interaction]:
    """A conversation whose user replies the default reply judge scores."""
    base = examples.interaction(prompt_tokens=64, response_tokens=16)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Name a prime number."}]
    out = []
    for t in range(turns):
        out.append(dataclasses.replace(
            base, event_id=f"{sid}-i{t}", session_id=sid, turn=t, messages=list(msgs),
            tool_calls=[], response_text="7.", session_done=t == turns - 1, group_id=None,
        ))
        reply = "Thanks, that works" if t % 2 else "That's wrong"
        msgs += [{"role": "assistant", "content": "7."}, {"role": "user", "content": reply}]
    return out


def soak(args: argparse.Namespace, settings: Settings, guarantee: str) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    app_id = prefix = f"soak-{run}"
    admin = AdminClient(settings.kafka_client_config())
    start_in = ends(settings, INPUTS)
    tps = [TopicPartition(t, p, o) for (t, p), o in start_in.items()]
    group = [ConsumerGroupTopicPartitions(app_id, tps)]
    (fut,) = admin.alter_consumer_group_offsets(group).values()
    fut.result(60)
    start_out = ends(settings, DERIVED)
    state = tempfile.mkdtemp(prefix="liverl-soak-")
    env = dict(os.environ, LIVERL_PROCESSORS_SESSION_PREFIX=prefix, LIVERL_STATE_DIR=state,
               LIVERL_PROCESSORS_SESSION_TIMEOUT_S="6")
    log = open(os.path.join(state, "workers.log"), "ab")  # noqa: SIM115 - held by the workers

    def worker(i: int) -> subprocess.Popen[bytes]:
        code = "from pipeline.processors.commands import workers; workers()"
        return subprocess.Popen(
            [sys.executable, "-c", code, "--app-id", app_id, "--no-web", "-l", "warn",
             "--worker-index", str(i), f"--{guarantee}"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )

    sessions = [session(f"{prefix}-{k}", args.turns) for k in range(args.sessions)]
    want = {(i.session_id, i.turn) for s in sessions for i in s}
    procs = [worker(i) for i in range(args.workers)]
    time.sleep(8)  # joined and assigned before the load starts

    def offer() -> None:
        producer = EventProducer(settings, client_id="soak", partitioner="murmur2_random")
        gap = 1.0 / args.turn_rate
        for t in range(args.turns):  # every session's turn t, then turn t + 1
            for s in sessions:
                producer.send(names.INTERACTIONS, s[t])
                producer.poll(0)
                time.sleep(gap)
        producer.flush()

    sender = threading.Thread(target=offer, daemon=True)
    began = time.monotonic()
    sender.start()
    kills = 0
    while kills < args.kills:
        time.sleep(args.kill_every_s)
        victim = kills % args.workers
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(10)
        procs[victim] = worker(victim)
        kills += 1
        print(f"  kill {kills}/{args.kills}: worker {victim} at {time.monotonic() - began:.0f}s",
              flush=True)
    sender.join()

    c = Consumer(settings.kafka_client_config(**{"group.id": f"soak-read-{run}"}))
    c.assign([TopicPartition(t, p, o) for (t, p), o in start_out.items()])
    ids: dict[str, Counter[str]] = defaultdict(Counter)
    turns: dict[str, set[tuple[str, int]]] = defaultdict(set)
    deadline = time.monotonic() + args.limit_s
    quiet_until = None
    while time.monotonic() < deadline:
        for msg in c.consume(1000, timeout=0.5):
            if msg.error() is None and (msg.key() or b"").startswith(prefix.encode()):
                ev = events.decode(msg.value())
                ids[msg.topic()][ev.event_id] += 1
                if msg.topic() in (names.REWARDS, names.SAMPLES):
                    turns[msg.topic()].add((ev.session_id, ev.turn))  # type: ignore[attr-defined]
        if quiet_until is None and want <= turns[names.SAMPLES]:
            quiet_until = time.monotonic() + 5  # late duplicates, if any, arrive by then
        if quiet_until is not None and time.monotonic() > quiet_until:
            break
    wall = time.monotonic() - began
    c.close()
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    mine = [t for t in admin.list_topics(timeout=10).topics if t.startswith(f"{app_id}-")]
    if mine:
        admin.delete_topics(mine, operation_timeout=30)
    missing = {t: len(want - turns[t]) for t in (names.REWARDS, names.SAMPLES)}
    return {"guarantee": guarantee, "kills": kills, "turns": len(want), "wall_s": wall,
            "ids": ids, "missing": missing}


def report(r: dict[str, Any]) -> None:
    print(f"== {r['guarantee']}: {r['kills']} kills, {r['turns']} turns, {r['wall_s']:.0f} s")
    for topic in DERIVED:
        c = r["ids"].get(topic, Counter())
        extra = sum(n - 1 for n in c.values())
        print(f"  {topic:28s} records {sum(c.values()):6d}  ids {len(c):6d}  "
              f"duplicate records {extra:5d}")
    print(f"  turns without a reward {r['missing'][names.REWARDS]}, "
          f"without a sample {r['missing'][names.SAMPLES]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=60)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--turn-rate", type=float, default=10.0, help="turns/s offered")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--kill-every-s", type=float, default=3.0)
    ap.add_argument("--limit-s", type=float, default=300.0, help="wait for samples this long")
    ap.add_argument("--guarantees", default="exactly-once",
                    help="comma list of exactly-once and at-least-once, soaked in turn")
    args = ap.parse_args()
    chosen = [g.strip() for g in args.guarantees.split(",") if g.strip()]
    if not chosen or any(g not in ("exactly-once", "at-least-once") for g in chosen):
        ap.error("--guarantees: a comma list of exactly-once and at-least-once")
    if args.workers < 1 or args.kills < 0 or args.turn_rate <= 0:
        ap.error("--workers >= 1, --kills >= 0 and --turn-rate > 0")
    settings = Settings()
    for g in chosen:
        report(soak(args, settings, g))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
