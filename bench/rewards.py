"""Reward pipeline benchmark: turns/s through real workers and interaction->sample latency.

Starts ``liverl workers --processes N`` (rule judge; N=1 is the plain single worker) against
the configured broker, waits until every process holds partitions and a warm-up batch has come
back, then produces ``--sessions`` sessions of ``--turns`` turns each (the last one
``session_done``) and reads the samples back. Latency is measured per turn from the moment its
interaction was handed to the producer to the moment the worker produced its sample (record
timestamp), and to the moment this script's read_committed consumer received it (exactly
once: at the worker's next commit); samples are assembled per session, so both include the
session's later turns.
``--processes 1,2`` measures each count in turn (a fresh consumer group each) and prints the
turns/s ratio against the first.

    .venv/bin/python bench/rewards.py --sessions 200 --turns 5
    .venv/bin/python bench/rewards.py --processes 1,2 --sessions 2000   # scaling, max rate
    .venv/bin/python bench/rewards.py --processes 1,2 --turn-rate 500 --sessions 2000
    .venv/bin/python bench/rewards.py --group-size 4           # sessions in groups of 4
    .venv/bin/python bench/rewards.py --profile /tmp/w.prof    # cProfile (processes=1 only)
    .venv/bin/python bench/rewards.py --guarantees at-least-once,exactly-once  # cost of EOS
    .venv/bin/python bench/rewards.py --session-batch 1,256 --sessions 1000  # batching's gain
    .venv/bin/python bench/rewards.py --trees /tmp/before,. --rounds 2 --sessions 2000  # A/B

Offered load: ``--rate`` is sessions/s, ``--turn-rate`` turns/s (= ``--rate`` x ``--turns``;
a session's turns are sent together, so 500 turns/s with 5 turns is 100 bursts of 5 a
second); without either, everything is sent at once (throughput). For the p50/p99 latency at
500 turns/s, send enough for tens of seconds: ``--turn-rate 500 --sessions 2000`` (20 s).

The workers start at the end of the topics (``LIVERL_PROCESSORS_AUTO_OFFSET_RESET=latest``):
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
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition

from pipeline import events
from pipeline.events import examples
from pipeline.kafka import EventProducer, names
from pipeline.settings import Settings


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


@dataclass
class Result:
    processes: int
    guarantee: str
    batch: int | None  # the session agent's batch size (None: the configured one)
    tree: str | None  # the checkout the workers ran from (None: this one)
    sessions: int
    sent: int
    received: int
    produce_rate: float
    pipeline_rate: float
    latency_ms: list[float]
    visible_ms: list[float]  # to the moment a read_committed consumer had it


def group_split(settings: Settings, group: str) -> list[int]:
    """Partitions of ``interactions`` held by each member of consumer group ``group``."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka_client_config())
    try:
        desc = admin.describe_consumer_groups([group])[group].result(timeout=10)
    except Exception:  # noqa: BLE001 - not there yet
        return []
    return [
        sum(tp.topic == names.INTERACTIONS for tp in m.assignment.topic_partitions)
        for m in desc.members
    ]


def measure(
    args: argparse.Namespace,
    processes: int,
    settings: Settings,
    guarantee: str,
    session_batch: int | None = None,
    tree: str | None = None,
) -> Result:
    """One run: ``processes`` workers in a fresh group, warm-up, then the measured load."""
    run = uuid.uuid4().hex[:8]
    prefix = f"bench-{run}-"
    app_id = f"bench-{run}"
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
    if session_batch is not None:
        env["LIVERL_PROCESSORS_SESSION_BATCH"] = str(session_batch)
    env.setdefault("LIVERL_STATE_DIR", tempfile.mkdtemp(prefix="liverl-bench-"))
    code = "from pipeline.processors.commands import workers; workers()"
    if args.profile and processes == 1:
        code = (
            "import atexit, cProfile; from pipeline.processors.commands import workers; "
            "p = cProfile.Profile(); "
            f"atexit.register(lambda: (p.disable(), p.dump_stats({args.profile!r}))); "
            "p.enable(); workers()"
        )
    log_path = os.path.join(env["LIVERL_STATE_DIR"], f"worker-{processes}.log")
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                "--app-id",
                app_id,
                "--no-web",
                "--processes",
                str(processes),
                f"--{guarantee}",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            # "-c" code imports from the working directory first: a checkout of another
            # commit runs its own pipeline package (the editable install is this one)
            cwd=tree,
        )
    producer = EventProducer(settings, client_id="bench", partitioner="murmur2_random")
    tokens = (args.prompt_tokens, args.response_tokens)
    sent: dict[tuple[str, int], float] = {}
    got: dict[tuple[str, int], float] = {}
    seen: dict[tuple[str, int], float] = {}

    def drain(until: int, deadline: float, warmup: str = "", wait_s: float = 0.2) -> None:
        """Collect samples: the measured sessions', or those of warm-up batch ``warmup``."""
        while len(got) < until and time.monotonic() < deadline and worker.poll() is None:
            left = max(0.0, min(wait_s, deadline - time.monotonic()))
            for msg in consumer.consume(1000, timeout=left):
                if msg.error() is None and (msg.key() or b"").startswith(prefix.encode()):
                    s = events.decode(msg.value())
                    assert isinstance(s, events.Sample)
                    is_warmup = s.session_id.startswith(f"{prefix}warmup")
                    if is_warmup != bool(warmup) or not s.session_id.startswith(warmup or prefix):
                        continue
                    # When the worker produced the sample (broker CreateTime, same host clock).
                    got.setdefault((s.session_id, s.turn), msg.timestamp()[1] / 1000)
                    # When this read_committed consumer got it: exactly once, at the commit.
                    seen.setdefault((s.session_id, s.turn), time.time())

    try:
        up_deadline = time.monotonic() + 180
        # Every process must hold its partitions first: a rebalance inside the measurement
        # would stall it (and with one process there is nothing to wait for but the join).
        while time.monotonic() < up_deadline and worker.poll() is None:
            split = group_split(settings, app_id)
            if len(split) == processes and all(split):
                break
            time.sleep(1)
        else:
            sys.exit(f"{processes} workers did not all join group {app_id} (see {log_path})")
        # The workers read from the end, so warm-up sessions sent before they have their
        # partitions are never seen: offer a batch every few seconds until one comes back
        # whole. A batch of 4 per partition-holder reaches every process with high odds.
        batch = 4 * processes
        attempt = 0
        while time.monotonic() < up_deadline and worker.poll() is None:
            got.clear()
            warmup = f"{prefix}warmup{attempt}-"
            for k in range(batch):
                for inter in session(f"{warmup}{k}", 2, tokens):
                    producer.send(names.INTERACTIONS, inter)
            producer.flush()
            attempt += 1
            drain(2 * batch, min(up_deadline, time.monotonic() + 5), warmup=warmup)
            if len(got) >= 2 * batch:
                break
        if len(got) < 2 * batch:
            sys.exit(f"workers did not come up (see {log_path})")
        got.clear()
        seen.clear()
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
            if args.rate:  # read while pacing: the visible latency is not the script's own
                drain(1 << 62, start + i / args.rate, wait_s=0.01)
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
            worker.wait(30)  # the supervisor waits up to LIVERL_PROCESSORS_SHUTDOWN_S + 5
        except subprocess.TimeoutExpired:
            worker.kill()
        consumer.close()
        from confluent_kafka.admin import AdminClient  # drop this run's Faust internal topics

        admin = AdminClient(settings.kafka_client_config())
        mine = [t for t in admin.list_topics(timeout=10).topics if t.startswith(f"{app_id}-")]
        if mine:
            admin.delete_topics(mine, operation_timeout=30)

    lat = sorted((got[k] - sent[k]) * 1000 for k in got if k in sent)
    return Result(
        processes=processes,
        guarantee=guarantee,
        batch=session_batch,
        tree=tree,
        sessions=args.sessions,
        sent=len(sent),
        received=len(lat),
        produce_rate=len(sent) / max(produced - start, 1e-9),
        pipeline_rate=len(lat) / max(end - start, 1e-9),
        latency_ms=lat,
        visible_ms=sorted((seen[k] - sent[k]) * 1000 for k in seen if k in sent),
    )


def report(r: Result, args: argparse.Namespace, base: Result | None) -> None:
    print(f"== processes {r.processes}, {r.guarantee}{label(r)}")
    print(
        f"turns produced {r.sent}, samples received {r.received} "
        f"({args.sessions} sessions x {args.turns} turns, "
        f"{args.prompt_tokens}/{args.response_tokens} tokens)"
    )
    print(f"produce rate      {r.produce_rate:10.1f} turns/s")
    ratio = (
        (
            f"   x{r.pipeline_rate / base.pipeline_rate:.2f} vs processes={base.processes}, "
            f"{base.guarantee}{label(base)}"
        )
        if base is not None and base is not r and base.pipeline_rate
        else ""
    )
    print(f"pipeline rate     {r.pipeline_rate:10.1f} turns/s (interaction -> sample){ratio}")
    lat, n = r.latency_ms, r.received
    if n:
        p99 = lat[min(n - 1, int(0.99 * n))]
        p50 = statistics.median(lat)
        print(
            f"latency p50 {p50:8.1f} ms   p99 {p99:8.1f} ms   max {lat[-1]:.1f} ms"
            "   (to the sample's write)"
        )
        vis = r.visible_ms
        if vis:
            v99 = vis[min(len(vis) - 1, int(0.99 * len(vis)))]
            print(
                f"visible p50 {statistics.median(vis):8.1f} ms   p99 {v99:8.1f} ms   "
                f"max {vis[-1]:.1f} ms   (to a read_committed reader)"
            )


def label(r: Result) -> str:
    out = "" if r.batch is None else f", session batch {r.batch}"
    return out if r.tree is None else f"{out}, workers from {r.tree}"


def process_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected counts >= 1, got {text!r}")
    return counts


def guarantees(text: str) -> list[str]:
    names_ = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names_ if x not in ("exactly-once", "at-least-once")]
    if not names_ or bad:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of exactly-once and at-least-once, got {text!r}"
        )
    return names_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--response-tokens", type=int, default=128)
    ap.add_argument("--limit-s", type=float, default=180.0)
    load = ap.add_mutually_exclusive_group()
    load.add_argument(
        "--rate", type=float, default=0.0, help="sessions/s to offer (0: all at once)"
    )
    load.add_argument(
        "--turn-rate", type=float, default=0.0, help="turns/s to offer: --rate = this / --turns"
    )
    ap.add_argument("--group-size", type=int, default=0, help="sessions per group_id (0: none)")
    ap.add_argument(
        "--processes",
        type=process_counts,
        default=[1],
        help="worker process counts to measure in turn, e.g. 1,2 (default 1)",
    )
    ap.add_argument(
        "--guarantees",
        type=guarantees,
        default=["exactly-once"],
        help="processing guarantees to measure in turn, e.g. "
        "at-least-once,exactly-once (the cost of transactions; default exactly-once)",
    )
    ap.add_argument(
        "--session-batch",
        type=process_counts,
        default=None,
        help="session agent batch sizes to measure in turn, e.g. 1,256 (1: one "
        "record per unit, as before batching; default: the configured one)",
    )
    ap.add_argument(
        "--trees",
        default="",
        help="comma list of checkouts whose workers to measure in turn, '.' for "
        "this one: an A/B against another commit in one run (git worktree add "
        "/tmp/before HEAD~1; --trees /tmp/before,.), alternated with --rounds",
    )
    ap.add_argument("--rounds", type=int, default=1, help="repeat every measurement, in turn")
    ap.add_argument(
        "--profile", default="", help="write the processes=1 worker's cProfile stats here"
    )
    args = ap.parse_args()
    if args.turn_rate:
        args.rate = args.turn_rate / args.turns
    if args.profile and 1 not in args.processes:
        ap.error("--profile profiles the processes=1 run: include 1 in --processes")
    if args.rate:
        print(f"offered load {args.rate:.1f} sessions/s = {args.rate * args.turns:.1f} turns/s")

    settings = Settings()
    results: list[Result] = []
    trees = (
        [None if t in (".", "") else os.path.abspath(t) for t in args.trees.split(",")]
        if args.trees
        else [None]
    )
    for _round in range(args.rounds):
        for guarantee in args.guarantees:
            for batch in args.session_batch or [None]:
                for tree in trees:
                    for n in args.processes:
                        results.append(measure(args, n, settings, guarantee, batch, tree))
                        report(results[-1], args, results[0])
                        sys.stdout.flush()
    if len(results) > 1 and results[0].pipeline_rate:
        first = results[0]
        print(
            f"== turns/s vs processes={first.processes}, {first.guarantee}: "
            + ", ".join(
                f"{r.processes} {r.guarantee}{label(r)}: "
                f"x{r.pipeline_rate / first.pipeline_rate:.2f}"
                for r in results
            )
        )


if __name__ == "__main__":
    main()
