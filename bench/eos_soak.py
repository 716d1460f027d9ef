"""Kill soak for the reward workers: SIGKILL and restart them while sessions flow, then count.

Starts ``--workers`` worker processes of one fresh consumer group (worker indexes 0..N-1; the
session topics have 6 partitions, so more partitions than workers). ``--clients`` producers
offer ``--sessions`` sessions of ``--turns`` turns, each spreading its turns over
``--send-s``. Every ``--kill-every-s`` (drawn within ±40 %) one worker (round robin) is
SIGKILLed and restarted ``--restart-after-s`` later; every ``--recovery-kill-every``-th
restart is killed again 1.5-8 s after it started (while it starts, joins or recovers its
tables) and restarted once more. Kills go on while the clients send (or until ``--kills``).
Then it reads the derived topics with a plain read_committed consumer and counts, from the raw
records: per topic the records and the event ids seen more than once; the turns without a
reward or a sample, with a second reward or sample id; the dead letters.

``tests/test_processors_eos_soak.py`` runs a short soak of this module in CI (issue 37: a
worker restart lost turns silently before the offset ledger). Longer runs:

    .venv/bin/python bench/eos_soak.py                                  # 300 s, exactly once
    .venv/bin/python bench/eos_soak.py --send-s 900 --sessions 600 --rounds 3
    .venv/bin/python bench/eos_soak.py --trees /tmp/before,. --rounds 2  # A/B with a checkout
    .venv/bin/python bench/eos_soak.py --guarantees at-least-once,exactly-once
    .venv/bin/python bench/eos_soak.py --sessions 100 --send-s 100 --slow-table-writes-s 0.12
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from pipeline import events
from pipeline.events import examples
from pipeline.kafka import EventProducer, names
from pipeline.processors.supervisor import _parent_death_signal
from pipeline.settings import Settings

# Injected into a worker by --slow-table-writes-s (the bench's fault, never the product's).
SLOW_TABLE_WRITES = """
import asyncio
from faust.transport.producer import ProducerBuffer
_send = ProducerBuffer._send_pending
async def _slow(self, fut):
    await asyncio.sleep(%r)
    await _send(self, fut)
ProducerBuffer._send_pending = _slow
"""

TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "eos_trace.py")
DERIVED = (names.NEXT_STATES, names.PRM_SCORES, names.REWARDS, names.SAMPLES, names.DLQ)
INPUTS = (names.INTERACTIONS, names.NEXT_STATES, names.HINTS)


@dataclass
class SoakPlan:
    sessions: int = 100
    turns: int = 5
    clients: int = 4
    workers: int = 2
    send_s: float = 100.0  # each client spreads its sessions' turns over this long
    kill_every_s: float = 9.0
    restart_after_s: float = 3.0
    recovery_kill_every: int = 3  # every Nth restart is killed again while it starts/recovers
    recovery_kill_after_s: tuple[float, float] = (1.5, 8.0)
    kills: int | None = None  # stop killing after this many; None: while the clients send
    guarantee: str = "exactly-once"
    settle_s: float = 240.0  # after the kills, how long the outputs may take
    seed: int = 0
    tree: str | None = None  # run the workers from another checkout (an A/B with a commit)
    # Each table write Faust buffers waits this long before it is handed to the producer (a
    # loaded worker, made reproducible; 0: off): the fault producer_buffer.py guards against.
    slow_table_writes_s: float = 0.0
    # A folder for the workers' debug trace (bench/eos_trace.py) and the lost turns; None: off.
    trace_dir: str | None = None


@dataclass
class SoakResult:
    plan: SoakPlan
    turns: int
    kills: int = 0
    recovery_kills: int = 0
    crashes: int = 0  # workers that exited on their own (restarted, as a supervisor would)
    records: dict[str, int] = field(default_factory=dict)  # topic -> raw records
    repeated_ids: dict[str, int] = field(default_factory=dict)  # topic -> ids read twice+
    missing_reward: list[tuple[str, int]] = field(default_factory=list)
    missing_sample: list[tuple[str, int]] = field(default_factory=list)
    second_reward_id: list[tuple[str, int]] = field(default_factory=list)
    second_sample_id: list[tuple[str, int]] = field(default_factory=list)
    dead_letters: list[str] = field(default_factory=list)
    # topic -> turns without a reward whose records there were written and never committed
    uncommitted: dict[str, int] = field(default_factory=dict)
    # where the interactions of turns without a reward lie against the group's committed
    # offsets: "below commit" (committed past: skipped) or "not committed" (never passed)
    inputs_of_missing: dict[str, int] = field(default_factory=dict)
    workers_alive: bool = True
    seconds: float = 0.0
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        """Every turn one reward and one sample by id, nothing dead-lettered, workers up."""
        return self.workers_alive and not (
            self.missing_reward or self.missing_sample or self.second_reward_id
            or self.second_sample_id or self.dead_letters)  # fmt: skip

    def summary(self) -> str:
        return (
            f"{self.plan.guarantee}: {self.turns} turns, {self.kills} kills "
            f"({self.recovery_kills} while starting or recovering) in {self.seconds:.0f} s: "
            f"turns without a reward {len(self.missing_reward)}, without a sample "
            f"{len(self.missing_sample)}, with a second reward id {len(self.second_reward_id)},"
            f" a second sample id {len(self.second_sample_id)}; dead letters "
            f"{len(self.dead_letters)}; workers that stopped on their own {self.crashes}"
            + (
                f"; of the turns without a reward, records written and never committed, by "
                f"topic: {self.uncommitted}; their interactions {self.inputs_of_missing}"
                if self.missing_reward
                else ""
            )
        )


def _last_error(logpath: str) -> str:
    """The newest line of the workers' shared log that names an error (a fenced transaction
    is the expected one), so a worker's own exit is explained in the soak's output."""
    try:
        with open(logpath, "rb") as fh:
            fh.seek(max(0, os.path.getsize(logpath) - 20_000))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return "(log unreadable)"
    hits = [ln for ln in lines if re.search(r"error|exception|fenced|fatal", ln, re.I)]
    return hits[-1].strip()[:300] if hits else "(none in the log's tail)"


def ends(settings: Settings, topics: tuple[str, ...]) -> dict[tuple[str, int], int]:
    c = Consumer(settings.kafka_client_config(**{"group.id": "soak-probe"}))
    try:
        return {
            (t, p): c.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1]
            for t in topics
            for p in c.list_topics(t, timeout=10).topics[t].partitions
        }
    finally:
        c.close()


def session(sid: str, turns: int) -> list[events.Interaction]:
    """A conversation whose user replies the default reply judge scores."""
    base = examples.interaction(prompt_tokens=64, response_tokens=16)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Name a prime number."}]
    out = []
    for t in range(turns):
        out.append(
            dataclasses.replace(
                base,
                event_id=f"{sid}-i{t}",
                session_id=sid,
                turn=t,
                messages=list(msgs),
                tool_calls=[],
                response_text="7.",
                session_done=t == turns - 1,
                group_id=None,
            )
        )
        reply = "Thanks, that works" if t % 2 else "That's wrong"
        msgs += [{"role": "assistant", "content": "7."}, {"role": "user", "content": reply}]
    return out


def run_soak(settings: Settings, plan: SoakPlan, workdir: str | None = None,
             app_id: str | None = None, say: Any = None) -> SoakResult:  # fmt: skip
    """One soak (see the module docstring); ``say`` prints progress lines if given."""
    rng = random.Random(plan.seed)
    app_id = app_id or f"soak-{uuid.uuid4().hex[:8]}"
    state = workdir or tempfile.mkdtemp(prefix="liverl-soak-")
    admin = AdminClient(settings.kafka_client_config())
    tps = [TopicPartition(t, p, o) for (t, p), o in ends(settings, INPUTS).items()]
    group = [ConsumerGroupTopicPartitions(app_id, tps)]
    (fut,) = admin.alter_consumer_group_offsets(group).values()
    fut.result(60)
    start_out = ends(settings, DERIVED)
    env = dict(
        os.environ,
        LIVERL_PROCESSORS_SESSION_PREFIX=app_id,
        LIVERL_STATE_DIR=state,
        LIVERL_PROCESSORS_SESSION_TIMEOUT_S="6",
    )
    if plan.trace_dir:
        os.makedirs(plan.trace_dir, exist_ok=True)
        env["LIVERL_SOAK_TRACE"] = plan.trace_dir
    if plan.tree:
        env["PYTHONPATH"] = plan.tree  # its pipeline/ before the installed one
    logpath = os.path.join(state, f"{app_id}.log")
    log = open(logpath, "ab")  # noqa: SIM115 - held by the workers

    die_with_soak = _parent_death_signal()

    def worker(i: int) -> subprocess.Popen[bytes]:
        code = "from pipeline.processors.commands import workers; workers()"
        if plan.slow_table_writes_s:
            code = f"{SLOW_TABLE_WRITES % plan.slow_table_writes_s}\n{code}"
        if plan.trace_dir:
            code = f"exec(open({TRACE!r}).read())\n{code}"
        return subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                "--app-id",
                app_id,
                "--no-web",
                "-l",
                "warn",
                "--worker-index",
                str(i),
                f"--{plan.guarantee}",
            ],
            env=env,
            cwd=plan.tree,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_soak,  # noqa: PLW1509 - only prctl: a killed soak leaves none
        )

    sessions = [session(f"{app_id}-{k}", plan.turns) for k in range(plan.sessions)]
    result = SoakResult(plan, turns=plan.sessions * plan.turns)

    def client(k: int) -> None:
        producer = EventProducer(settings, client_id=f"soak-{k}", partitioner="murmur2_random")
        mine = sessions[k :: plan.clients]
        gap = plan.send_s / max(1, plan.turns * len(mine))
        for t in range(plan.turns):  # every session's turn t, then turn t + 1
            for s in mine:
                producer.send(names.INTERACTIONS, s[t])
                producer.poll(0)
                time.sleep(gap)
        producer.flush()

    began = time.monotonic()
    procs = [worker(i) for i in range(plan.workers)]
    clients = [threading.Thread(target=client, args=(k,), daemon=True)
               for k in range(plan.clients)]  # fmt: skip
    for th in clients:
        th.start()

    def kill(victim: int, during: str) -> None:
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(10)
        result.kills += 1
        if say:
            say(
                f"  kill {result.kills}: worker {victim} {during} at "
                f"{time.monotonic() - began:.0f} s"
            )
        time.sleep(plan.restart_after_s)
        procs[victim] = worker(victim)

    def restart_stopped() -> None:
        """A worker that exited by itself (a fenced transaction stops it) is restarted, as
        ``liverl workers --processes N`` or ``liverl up`` would; the count is reported."""
        for i, proc in enumerate(procs):
            if proc.poll() is not None:
                result.crashes += 1
                if say:
                    say(
                        f"  worker {i} stopped on its own (exit {proc.returncode}) at "
                        f"{time.monotonic() - began:.0f} s: restarted; last error logged: "
                        f"{_last_error(logpath)}"
                    )
                procs[i] = worker(i)

    def more() -> bool:
        restart_stopped()
        if plan.kills is not None:
            return result.kills < plan.kills
        return any(th.is_alive() for th in clients)

    try:
        restarts = 0
        time.sleep(plan.kill_every_s)
        while more():
            victim = restarts % plan.workers
            kill(victim, "while it works")
            restarts += 1
            if plan.recovery_kill_every and restarts % plan.recovery_kill_every == 0:
                time.sleep(rng.uniform(*plan.recovery_kill_after_s))
                kill(victim, "while it starts or recovers")
                result.recovery_kills += 1
            time.sleep(plan.kill_every_s * rng.uniform(0.6, 1.4))
        for th in clients:
            th.join()
        restart_stopped()
        _count(settings, start_out, app_id, sessions, plan.settle_s, restart_stopped, result)
        if result.missing_reward:
            result.inputs_of_missing = _inputs_of(settings, admin, app_id, tps,
                                                  set(result.missing_reward))  # fmt: skip
        result.workers_alive = all(p.poll() is None for p in procs)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
        mine = [t for t in admin.list_topics(timeout=10).topics if t.startswith(f"{app_id}-")]
        if mine:
            for f in admin.delete_topics(mine, operation_timeout=30).values():
                f.result()
    result.seconds = time.monotonic() - began
    if plan.trace_dir:
        with open(os.path.join(plan.trace_dir, "lost.json"), "w") as out:
            json.dump(
                {"missing_reward": result.missing_reward, "missing_sample": result.missing_sample},
                out,
            )
    with open(logpath, "rb") as fh:
        result.log_tail = fh.read().decode(errors="replace")[-3000:]
    return result


def _count(settings: Settings, start: dict[tuple[str, int], int], prefix: str,
           sessions: list[list[events.Interaction]], settle_s: float,
           restart_stopped: Callable[[], None], result: SoakResult) -> None:  # fmt: skip
    """Read the derived topics (read_committed, raw records) until every turn has a reward
    and a sample and 5 s more passed (a late repeat would show), or ``settle_s``."""
    want = {(i.session_id, i.turn) for s in sessions for i in s}
    ids: dict[str, Counter[str]] = defaultdict(Counter)
    per_turn: dict[str, dict[tuple[str, int], set[str]]] = {
        names.REWARDS: defaultdict(set),
        names.SAMPLES: defaultdict(set),
    }
    c = Consumer(settings.kafka_client_config(**{"group.id": f"soak-read-{prefix}"}))
    c.assign([TopicPartition(t, p, o) for (t, p), o in start.items()])
    deadline, quiet_until = time.monotonic() + settle_s, None
    try:
        while time.monotonic() < deadline:
            restart_stopped()
            for msg in c.consume(1000, timeout=0.5):
                if msg.error() is not None or not (msg.key() or b"").startswith(prefix.encode()):
                    continue
                ev = events.decode(msg.value())
                ids[msg.topic()][ev.event_id] += 1
                if isinstance(ev, events.DeadLetter) and ids[msg.topic()][ev.event_id] == 1:
                    result.dead_letters.append(ev.error)
                elif msg.topic() in per_turn:
                    per_turn[msg.topic()][(ev.session_id, ev.turn)].add(ev.event_id)  # type: ignore[attr-defined]
            if quiet_until is None and all(want <= set(p) for p in per_turn.values()):
                quiet_until = time.monotonic() + 5
            if quiet_until is not None and time.monotonic() > quiet_until:
                break
    finally:
        c.close()
    result.records = {t: sum(n.values()) for t, n in ids.items()}
    result.repeated_ids = {t: sum(1 for v in n.values() if v > 1) for t, n in ids.items()}
    rewards, samples = per_turn[names.REWARDS], per_turn[names.SAMPLES]
    result.missing_reward = sorted(want - set(rewards))
    result.missing_sample = sorted(want - set(samples))
    result.second_reward_id = sorted(k for k, v in rewards.items() if len(v) > 1)
    result.second_sample_id = sorted(k for k, v in samples.items() if len(v) > 1)
    if result.missing_reward:
        result.uncommitted = _uncommitted(settings, start, prefix, set(result.missing_reward))


def _turns_to_end(settings: Settings, group: str, tps: list[TopicPartition],
                  missing: set[tuple[str, int]], isolation: str = "read_committed",
                  key_prefix: bytes = b"") -> Iterator[tuple[Any, tuple[str, int]]]:  # fmt: skip
    """Each record of ``tps`` (from their offsets to their ends, at most 60 s) keyed with
    ``key_prefix`` whose event is one of the ``missing`` turns, with that turn (other runs'
    records on shared topics are not read)."""
    c = Consumer(
        settings.kafka_client_config(
            **{"group.id": group, "isolation.level": isolation, "enable.partition.eof": True}
        )
    )
    c.assign(tps)
    left = {(tp.topic, tp.partition) for tp in tps}
    deadline = time.monotonic() + 60
    try:
        while left and time.monotonic() < deadline:
            for msg in c.consume(1000, timeout=0.5):
                if msg.error() is not None:
                    left.discard((msg.topic(), msg.partition()))
                    continue
                if not (msg.key() or b"").startswith(key_prefix):
                    continue
                ev = events.decode(msg.value())
                at = (getattr(ev, "session_id", ""), getattr(ev, "turn", -1))
                if at in missing:
                    yield msg, at
    finally:
        c.close()


def _inputs_of(settings: Settings, admin: AdminClient, group: str, tps: list[TopicPartition],
               missing: set[tuple[str, int]]) -> dict[str, int]:  # fmt: skip
    """Where the interactions of ``missing`` turns lie against ``group``'s committed offsets,
    by partition: a skipped record is below the commit, a stuck one is not."""
    (fut,) = admin.list_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(group, [TopicPartition(t.topic, t.partition)
                                              for t in tps])]).values()  # fmt: skip
    committed = {(t.topic, t.partition): t.offset for t in fut.result(30).topic_partitions}
    inputs = [TopicPartition(t.topic, t.partition, t.offset) for t in tps
              if t.topic == names.INTERACTIONS]  # fmt: skip
    out: Counter[str] = Counter()
    for msg, _ in _turns_to_end(
        settings, f"soak-inputs-{group}", inputs, missing, key_prefix=group.encode()
    ):
        below = msg.offset() < committed.get((msg.topic(), msg.partition()), -1)
        out["below commit" if below else "not committed"] += 1
        out[f"partition {msg.partition()}"] += 1
    return dict(out)


def _uncommitted(settings: Settings, start: dict[tuple[str, int], int], prefix: str,
                 missing: set[tuple[str, int]]) -> dict[str, int]:  # fmt: skip
    """Of the turns without a reward, how many have records on each derived topic that only a
    read_uncommitted reader sees (written in a transaction that was aborted or is still open):
    processed and then not committed, rather than never processed."""
    seen: dict[str, set[tuple[str, int]]] = defaultdict(set)
    committed: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for isolation, into in (("read_uncommitted", seen), ("read_committed", committed)):
        tps = [TopicPartition(t, p, o) for (t, p), o in start.items()]
        for msg, at in _turns_to_end(
            settings, f"soak-audit-{prefix}", tps, missing, isolation, prefix.encode()
        ):
            into[msg.topic() or ""].add(at)
    return {t: len(seen[t] - committed[t]) for t in DERIVED if seen[t] - committed[t]}


def report(r: SoakResult, label: str) -> None:
    print(f"{label}: {'ok' if r.ok else 'LOST, DOUBLED OR DEAD-LETTERED'} - {r.summary()}")
    for topic in DERIVED:
        if topic in r.records:
            print(
                f"  {topic:28s} records {r.records[topic]:6d}   ids read more than once "
                f"{r.repeated_ids.get(topic, 0):5d}"
            )
    if r.missing_sample:
        print(f"  e.g. without a sample: {r.missing_sample[:5]}")
    if r.missing_reward:
        print(
            "  of the turns without a reward, written in a transaction never committed: "
            + (", ".join(f"{t} {n}" for t, n in r.uncommitted.items()) or "none")
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = SoakPlan()
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--turns", type=int, default=d.turns)
    ap.add_argument("--clients", type=int, default=d.clients)
    ap.add_argument("--workers", type=int, default=d.workers)
    ap.add_argument(
        "--send-s",
        type=float,
        default=300.0,
        help="each client spreads its turns over this long (the soak's length)",
    )
    ap.add_argument("--kill-every-s", type=float, default=d.kill_every_s)
    ap.add_argument("--restart-after-s", type=float, default=d.restart_after_s)
    ap.add_argument(
        "--recovery-kill-every",
        type=int,
        default=d.recovery_kill_every,
        help="every Nth restart is killed again while it starts (0: never)",
    )
    ap.add_argument("--kills", type=int, default=None, help="stop after this many kills")
    ap.add_argument(
        "--settle-s",
        type=float,
        default=d.settle_s,
        help="after the kills, wait this long for every sample",
    )
    ap.add_argument(
        "--guarantees",
        default="exactly-once",
        help="comma list of exactly-once and at-least-once, soaked in turn",
    )
    ap.add_argument(
        "--trees", default=".", help="comma list of checkouts whose workers run in turn (an A/B)"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--slow-table-writes-s",
        type=float,
        default=0.0,
        help="delay each buffered table write this long before the producer "
        "takes it (a loaded worker, reproducibly)",
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the kill schedule's seed of round 1 (round r uses seed + r - 1)",
    )
    ap.add_argument(
        "--trace",
        metavar="DIR",
        default=None,
        help="workers write a debug trace (bench/eos_trace.py) to DIR/round-N, "
        "with the lost turns in lost.json",
    )
    args = ap.parse_args()
    chosen = [g.strip() for g in args.guarantees.split(",") if g.strip()]
    if not chosen or any(g not in ("exactly-once", "at-least-once") for g in chosen):
        ap.error("--guarantees: a comma list of exactly-once and at-least-once")
    if args.workers < 1 or args.sessions < 1 or args.send_s <= 0 or args.rounds < 1:
        ap.error("--workers, --sessions, --rounds >= 1 and --send-s > 0")
    settings = Settings()
    here = os.path.abspath(".")
    for r in range(args.rounds):
        for tree in (os.path.abspath(t) for t in args.trees.split(",") if t.strip()):
            for g in chosen:
                plan = SoakPlan(
                    sessions=args.sessions,
                    turns=args.turns,
                    clients=args.clients,
                    workers=args.workers,
                    send_s=args.send_s,
                    kill_every_s=args.kill_every_s,
                    restart_after_s=args.restart_after_s,
                    recovery_kill_every=args.recovery_kill_every,
                    kills=args.kills,
                    guarantee=g,
                    settle_s=args.settle_s,
                    seed=args.seed + r,
                    tree=None if tree == here else tree,
                    slow_table_writes_s=args.slow_table_writes_s,
                    trace_dir=args.trace and os.path.join(args.trace, f"round-{r + 1}"),
                )
                res = run_soak(settings, plan, say=lambda line: print(line, flush=True))
                report(res, f"round {r + 1}, {tree}")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
