"""``liverl replay``, namespaced components and ``liverl diff-rewards`` on the real broker.

Byte-level tests replay a test topic listed in a copy of ``topics/`` (so nothing is written to
the live topics that a running pipeline reads); the re-judging test replays real interactions
and next states of its own sessions, as an operator would.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner
from confluent_kafka import Consumer, Producer, TopicPartition

from pipeline import events
from pipeline.cli import cli
from pipeline.kafka import names
from pipeline.processors.app import INPUTS
from pipeline.replay import namespace as nsmod
from pipeline.replay import replay as replay_mod
from pipeline.replay.errors import ReplayArgumentError, ReplayError
from pipeline.replay.replay import (
    H_OFFSET,
    H_PARTITION,
    H_PASS,
    H_TIMESTAMP,
    H_TOPIC,
    KafkaSource,
    Span,
    canonical_time,
    parse_speed,
    parse_time,
    watermarks,
)
from pipeline.settings import Settings
from tests.conftest import create_topic

ROOT = Path(__file__).resolve().parents[1]
PARTS = 6

# ---- unit: arguments ---------------------------------------------------------------------


def test_parse_time_relative_iso_and_errors() -> None:
    now = 1_800_000_000_000
    assert parse_time("2h", now=now) == now - 7_200_000
    assert parse_time("1d", now=now) == now - 86_400_000
    assert parse_time("90s", now=now) == now - 90_000
    assert parse_time("1.5h", now=now) == now - 5_400_000
    assert parse_time("1w", now=now) == now - 604_800_000
    assert parse_time("now", now=now) == now
    assert parse_time("2026-05-01T12:00:00Z") == 1777636800000
    assert parse_time("2026-05-01T12:00:00") == 1777636800000  # naive = UTC
    assert parse_time("2026-05-01T14:00:00+02:00") == 1777636800000
    assert parse_time("2026-05-01") == 1777593600000
    with pytest.raises(ReplayArgumentError) as bad:
        parse_time("yesterday", "--until")
    assert bad.value.message.startswith("--until: 'yesterday'") and bad.value.exit_code == 2
    with pytest.raises(ReplayArgumentError):
        parse_time("2h ago")


def test_canonical_time_keeps_relative_as_typed() -> None:
    assert canonical_time(None) is None
    assert canonical_time(" 2H ".lower()) == "ago:2h"
    assert canonical_time("2026-05-01T12:00:00Z") == canonical_time("2026-05-01T14:00:00+02:00")


def test_parse_speed() -> None:
    assert parse_speed("max") is None
    assert parse_speed("1x") == 1.0 and parse_speed("10X") == 10.0 and parse_speed("0.5x") == 0.5
    for bad in ("fast", "0x", "10", "-1x"):
        with pytest.raises(ReplayArgumentError) as err:
            parse_speed(bad)
        assert err.value.message.startswith("--speed: ")


# ---- helpers -----------------------------------------------------------------------------


def cli_env(tmp_path: Path, specs: Path | None = None) -> dict[str, str]:
    env = {"LIVERL_STATE_DIR": str(tmp_path / "state")}
    if specs is not None:
        env["LIVERL_TOPICS_SPECS_DIR"] = str(specs)
    return env


def invoke(args: list[str], env: dict[str, str]) -> Any:
    return CliRunner().invoke(cli, args, env=env, catch_exceptions=False)


def drop(env: dict[str, str], ns: str) -> None:
    """``liverl drop-namespace``; afterwards no topic or group of the namespace is left."""
    res = invoke(["drop-namespace", ns, "--yes"], env)
    assert res.exit_code == 0, res.output
    settings = Settings()
    deadline = time.monotonic() + 30
    while nsmod.namespace_topics(settings, ns) or nsmod.namespace_groups(settings, ns):
        assert time.monotonic() < deadline, (ns, res.output)
        time.sleep(0.5)


def read_topic(
    settings: Settings, topic: str, start: dict[int, int] | None = None
) -> dict[int, list[Any]]:
    """Every record of every partition (from ``start``), in offset order (assign only)."""
    from pipeline.replay.replay import partitions_of, reader

    c = reader(settings)
    out: dict[int, list[Any]] = {}
    try:
        parts = partitions_of(c, topic) or []
        ends = {p: watermarks(c, topic, p)[1] for p in parts}
        first = {p: (start or {}).get(p, 0) for p in parts}
        pending = {p for p in parts if ends[p] > first[p]}
        out = {p: [] for p in parts}
        if pending:
            c.assign([TopicPartition(topic, p, first[p]) for p in pending])
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            for msg in c.consume(1000, timeout=0.5):
                if msg.error() is not None:
                    continue
                out[msg.partition()].append(msg)
                if msg.offset() + 1 >= ends[msg.partition()]:
                    pending.discard(msg.partition())
            # A transactional topic ends in a commit marker, which is never a message: the
            # position moves past it.
            for tp in c.position([TopicPartition(topic, p) for p in pending]):
                if tp.offset >= ends[tp.partition]:
                    pending.discard(tp.partition)
        assert not pending, f"could not read {topic} to its end"
    finally:
        c.close()
    return out


def end_offsets(settings: Settings, topic: str) -> dict[int, int]:
    c = Consumer(settings.kafka_client_config(**{"group.id": "replay-test-wm"}))
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: watermarks(c, topic, p)[1] for p in parts}
    finally:
        c.close()


def replayed(msgs: list[Any]) -> list[Any]:
    return [m for m in msgs if any(k == H_OFFSET for k, _ in (m.headers() or []))]


def header(msg: Any, name: str) -> bytes | None:
    return next((v for k, v in (msg.headers() or []) if k == name), None)


def assert_exact_copy(
    source: dict[int, list[Any]], dest: dict[int, list[Any]], topic: str, keep: Any = None
) -> int:
    """Every (kept) source record once, in order, on the same partition, byte-exact."""
    n = 0
    for p, msgs in source.items():
        want = [m for m in msgs if keep is None or keep(m)]
        got = replayed(dest.get(p, []))
        assert [int(header(m, H_OFFSET)) for m in got] == [m.offset() for m in want], p  # type: ignore[arg-type]
        for s, d in zip(want, got, strict=True):
            assert d.key() == s.key() and d.value() == s.value()
            assert d.timestamp()[1] == s.timestamp()[1]
            hdrs = d.headers() or []
            assert hdrs[: len(s.headers() or [])] == (s.headers() or [])
            assert header(d, H_TOPIC) == topic.encode()
            assert header(d, H_PARTITION) == str(p).encode()
            assert header(d, H_TIMESTAMP) == str(s.timestamp()[1]).encode()
        n += len(want)
    return n


@pytest.fixture
def source_topic(
    kafka_settings: Settings, admin, unique: str, tmp_path: Path
) -> Iterator[tuple[str, Path]]:  # type: ignore[no-untyped-def]
    """A 6-partition topic keyed by session, listed in a copy of topics/ (so replay knows it),
    that no running pipeline reads."""
    topic = f"itest.replay-{unique}.v1"
    specs = tmp_path / "topics"
    shutil.copytree(kafka_settings.topics.specs_dir, specs)
    (specs / "itest.yaml").write_text(
        f"name: {topic}\npartitions: {PARTS}\nreplication: 1\nkey: session_id\n"
        "value_schema: interaction.v1\n"
    )
    create_topic(admin, topic, partitions=PARTS)
    yield topic, specs
    for fut in admin.delete_topics([topic]).values():
        fut.result(timeout=30)


def produce_source(
    settings: Settings, topic: str, sessions: list[str], n: int, t0: int, step_ms: int = 10
) -> None:
    """Records with binary values (never decoded by a replay), headers with null values, a
    tombstone, and explicit timestamps ``t0 + i * step_ms``."""
    p = Producer(
        settings.kafka_client_config(
            **{"enable.idempotence": True, "partitioner": "murmur2_random", "linger.ms": 20}
        )
    )
    for i in range(n):
        value = None if i == 7 else bytes([i % 256]) * 3 + os.urandom(40) + b"\x00\xff"
        headers = [("liverl-type", b"interaction"), ("n", str(i).encode())]
        if i % 5 == 0:
            headers.append(("empty", None))  # type: ignore[arg-type]
        key = sessions[i % len(sessions)].encode()
        while True:
            try:
                p.produce(topic, value=value, key=key, headers=headers, timestamp=t0 + i * step_ms)
                break
            except BufferError:
                p.poll(0.1)
    assert p.flush(30) == 0


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat()


# ---- integration: the copy -----------------------------------------------------------------


@pytest.mark.integration
def test_replay_is_exact_in_order_and_idempotent(
    kafka_settings, source_topic, unique, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    topic, specs = source_topic
    env = cli_env(tmp_path, specs)
    sessions = [f"rs-{unique}-{i}" for i in range(8)]
    t0 = int(time.time() * 1000) - 3_600_000
    produce_source(kafka_settings, topic, sessions, 400, t0)
    ns, sub = f"rp{unique}", f"rq{unique}"
    dest = names.resolve(topic, ns)
    try:
        res = invoke(["replay", "--topics", topic, "--into", ns], env)
        assert res.exit_code == 0, res.output
        assert "replayed 400 record(s)" in res.output
        source = read_topic(kafka_settings, topic)
        copy = read_topic(kafka_settings, dest)
        assert assert_exact_copy(source, copy, topic) == 400
        assert {header(m, H_PASS) for p in copy for m in copy[p]} == {b"1"}
        # the namespace is complete: every spec topic exists, with the live partition counts
        assert nsmod.missing_topics(Settings(**{"topics": {"specs_dir": specs}}), ns) == []
        assert end_offsets(kafka_settings, names.resolve(names.REWARDS, ns)).keys() == set(range(6))

        # the same command again: nothing added
        before = end_offsets(kafka_settings, dest)
        res = invoke(["replay", "--topics", topic, "--into", ns], env)
        assert res.exit_code == 0 and "nothing to replay" in res.output, res.output
        assert end_offsets(kafka_settings, dest) == before

        # --again: one more full copy, marked pass 2
        res = invoke(["replay", "--topics", topic, "--into", ns, "--again"], env)
        assert res.exit_code == 0, res.output
        copy = read_topic(kafka_settings, dest)
        for p, msgs in copy.items():
            passes = [header(m, H_PASS) for m in msgs]
            assert passes == [b"1"] * len(source[p]) + [b"2"] * len(source[p])

        # a slice: two sessions in a time window (end exclusive)
        lo, hi = t0 + 1000, t0 + 3000
        pick = sessions[2:4]
        args = ["replay", "--topics", topic, "--into", sub, "--speed", "max"]
        args += ["--since", iso(lo), "--until", iso(hi), "--sessions", ",".join(pick)]
        res = invoke(args, env)
        assert res.exit_code == 0, res.output
        keys = {s.encode() for s in pick}

        def keep(m: Any) -> bool:
            return m.key() in keys and lo <= m.timestamp()[1] < hi

        n = assert_exact_copy(
            source, read_topic(kafka_settings, names.resolve(topic, sub)), topic, keep
        )
        assert n == 50  # 200 records in the window, a quarter of them of these sessions
    finally:
        drop(env, ns)
        drop(env, sub)
    assert nsmod.namespace_topics(kafka_settings, ns) == []
    assert not (tmp_path / "state" / "replay" / ns).exists()


@pytest.mark.integration
def test_replay_from_the_archive_is_the_same_copy(
    kafka_settings, source_topic, unique, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """--from delta: the archived records, byte-exact with their timestamps and headers, in
    the same partitions and order as a replay from Kafka would give."""
    from pipeline.lake.archive import Archiver

    topic, specs = source_topic
    env = cli_env(tmp_path, specs)
    sessions = [f"rd-{unique}-{i}" for i in range(5)]
    t0 = int(time.time() * 1000) - 3_600_000
    produce_source(kafka_settings, topic, sessions, 300, t0)
    lake = tmp_path / "lake"
    Archiver(kafka_settings, [topic], lake).run()
    ns = f"rd{unique}"
    lo, hi = t0 + 500, t0 + 2500
    pick = {sessions[1].encode(), sessions[2].encode()}
    args = ["replay", "--from", "delta", "--lake-root", str(lake), "--topics", topic]
    args += ["--since", iso(lo), "--until", iso(hi), "--into", ns]
    try:
        res = invoke([*args[:-2], "--sessions", f"ghost-{unique}", "--into", ns], env)
        assert res.exit_code == 2 and f"ghost-{unique}" in res.output, res.output
        args = [*args[:-2], "--sessions", ",".join(s.decode() for s in sorted(pick)), *args[-2:]]
        res = invoke(args, env)
        assert res.exit_code == 0, res.output

        def keep(m: Any) -> bool:
            return m.key() in pick and lo <= m.timestamp()[1] < hi

        source = read_topic(kafka_settings, topic)
        copy = read_topic(kafka_settings, names.resolve(topic, ns))
        assert assert_exact_copy(source, copy, topic, keep) == 80  # 200 in the window, 2 in 5
        res = invoke(args, env)
        assert res.exit_code == 0 and "nothing to replay" in res.output, res.output
        # everything, tombstone and null header values included
        res = invoke(["replay", "--from", "delta", "--lake-root", str(lake), "--topics", topic,
                      "--into", f"{ns}all"], env)  # fmt: skip
        assert res.exit_code == 0, res.output
        copy = read_topic(kafka_settings, names.resolve(topic, f"{ns}all"))
        assert assert_exact_copy(source, copy, topic) == 300
    finally:
        drop(env, ns)
        drop(env, f"{ns}all")


@pytest.mark.integration
def test_killed_replay_resumes_exactly_once(kafka_settings, source_topic, unique, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Paced at 1x over 30 s, SIGKILLed once part of it is in; the same command finishes it."""
    topic, specs = source_topic
    env = {**os.environ, **cli_env(tmp_path, specs), "PYTHONUNBUFFERED": "1"}
    sessions = [f"rk-{unique}-{i}" for i in range(5)]
    n = 3000
    produce_source(kafka_settings, topic, sessions, n, int(time.time() * 1000) - 600_000)
    ns = f"rk{unique}"
    dest = names.resolve(topic, ns)
    cmd = [sys.executable, "-m", "pipeline.cli", "replay", "--topics", topic, "--into", ns]
    try:
        with open(tmp_path / "replay.log", "wb") as log:
            proc = subprocess.Popen(
                [*cmd, "--speed", "1x"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            deadline = time.monotonic() + 120
            written = 0
            while time.monotonic() < deadline and proc.poll() is None:
                if nsmod.namespace_topics(kafka_settings, ns) and dest in nsmod.existing_topics(
                    kafka_settings
                ):
                    written = sum(end_offsets(kafka_settings, dest).values())
                    if written >= 300:
                        break
                time.sleep(0.2)
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert written >= 300 and sum(end_offsets(kafka_settings, dest).values()) < n, (
            tmp_path / "replay.log"
        ).read_text()[-2000:]
        # a new request against the same namespace is refused, the interrupted one resumes
        res = invoke(["replay", "--topics", topic, "--into", ns, "--since", "1d"], env)
        assert res.exit_code == 2 and "already holds another replay" in res.output
        res = invoke(["replay", "--topics", topic, "--into", ns, "--again"], env)
        assert res.exit_code == 2 and "has not finished" in res.output
        res = invoke(["replay", "--topics", topic, "--into", ns], env)
        assert res.exit_code == 0, res.output
        assert "resuming pass 1" in res.output
        source = read_topic(kafka_settings, topic)
        assert assert_exact_copy(source, read_topic(kafka_settings, dest), topic) == n
    finally:
        drop(env, ns)


@pytest.mark.integration
def test_a_read_that_stalls_before_its_end_stops_with_an_error(  # type: ignore[no-untyped-def]
    kafka_settings, source_topic, monkeypatch
) -> None:
    """A span whose end the partition never reaches (records gone, broker silent) used to be
    polled for ever; now the read gives up after READ_STALL_S without a record."""
    topic, _ = source_topic
    produce_source(kafka_settings, topic, ["stall-session"], 4, t0=1_790_000_000_000)
    ((part, high),) = ((p, h) for p, h in end_offsets(kafka_settings, topic).items() if h)
    monkeypatch.setattr(replay_mod, "READ_STALL_S", 1.0)
    source = KafkaSource(kafka_settings)
    rows: list[Any] = []
    with pytest.raises(ReplayError, match=f"no record for 1s before offset {high + 5}"):
        for row in source.read([Span(topic, part, 0, high + 5)], {(topic, part): 0}, None):
            rows.append(row)
    assert [r[3] for r in rows] == list(range(high)) and source.examined == high == 4


@pytest.mark.integration
def test_bad_arguments_fail_clearly_and_create_nothing(
    kafka_settings,
    source_topic,
    unique,
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    topic, specs = source_topic
    env = cli_env(tmp_path, specs)
    sessions = [f"rb-{unique}-{i}" for i in range(3)]
    t0 = int(time.time() * 1000) - 60_000
    produce_source(kafka_settings, topic, sessions, 30, t0)
    ns = f"rb{unique}"
    cases = [
        (["--topics", "nosuch"], "unknown topic 'nosuch'"),
        (["--topics", topic, "--since", "1h", "--until", "2h"], "is not before --until"),
        (["--topics", topic, "--since", "soon"], "--since"),
        (["--topics", topic, "--speed", "fast"], "--speed"),
        (["--topics", topic, "--sessions", f"{sessions[0]},ghost-{unique}"], f"ghost-{unique}"),
        (["--topics", topic, "--sessions", sessions[0], "--until", iso(t0 - 1000)], sessions[0]),
        (["--topics", topic, "--from", "delta", "--lake-root", str(tmp_path / "nolake")],
         "not archived"),
    ]  # fmt: skip
    for args, message in cases:
        res = invoke(["replay", *args, "--into", ns], env)
        assert res.exit_code == 2, (args, res.output)
        assert message in res.output, (args, res.output)
    res = invoke(["replay", "--topics", topic, "--into", "bad.name"], env)
    assert res.exit_code == 2 and "not a namespace name" in res.output
    assert nsmod.namespace_topics(kafka_settings, ns) == []
    assert not (tmp_path / "state" / "replay").exists()

    # a namespaced component refuses to start without its topics, and says how to make them
    for args in (
        ["workers", "--namespace", ns, "--no-web"],
        ["train", "--namespace", ns, "--model", "tiny"],
        ["tap", "rewards", "--namespace", ns],
    ):
        res = invoke(args, env)
        assert res.exit_code == 1, (args, res.output)
        assert f"namespace {ns!r} has no topic(s) replay.{ns}." in res.output
        assert f"liverl topics apply --namespace {ns}" in res.output
    res = invoke(["diff-rewards", ns], env)
    assert res.exit_code == 2 and f"replay.{ns}.liverl.rewards.v1" in res.output
    assert nsmod.namespace_topics(kafka_settings, ns) == []

    # topics apply --namespace creates them (idempotently), and then the range check bites
    try:
        res = invoke(["topics", "apply", "--namespace", ns], env)
        assert res.exit_code == 0 and "applied" in res.output, res.output
        res = invoke(["topics", "apply", "--namespace", ns], env)
        assert res.exit_code == 0 and "up to date" in res.output, res.output
        res = invoke(["replay", "--topics", topic, "--into", ns, "--since", "1h"], env)
        assert res.exit_code == 0, res.output
        res = invoke(["replay", "--topics", topic, "--into", ns, "--since", "2h"], env)
        assert res.exit_code == 2 and "already holds another replay" in res.output
        assert "--since 1h" in res.output and f"drop-namespace {ns}" in res.output
    finally:
        drop(env, ns)


# ---- integration: re-judging a recorded day with other rules --------------------------------


def half_beta_rules(path: Path) -> Path:
    """The default path-penalty rules with beta 0.5 -> 0.25: every penalty part halves."""
    from pipeline.processors.config import DEFAULT_RULES

    text = DEFAULT_RULES.read_text()
    assert "\nbeta: 0.5\n" in text and "\nversion: rules-3\n" in text
    path.write_text(
        text.replace("\nbeta: 0.5\n", "\nbeta: 0.25\n").replace(
            "\nversion: rules-3\n", "\nversion: rules-half-beta\n"
        )
    )
    return path


def shell(call_id: str, cmd: str) -> dict[str, Any]:
    args = orjson.dumps({"cmd": cmd}).decode()
    return {"id": call_id, "type": "function", "function": {"name": "shell", "arguments": args}}


def session(sid: str, policy: str, turns: int = 2) -> list[events.Interaction]:
    """Turn 0 force-pushes (forbidden: F = -0.3), the user thanks; turn 1 commits without
    tests (required step missing: F = -0.2), and the session ends; with ``turns=3`` the user
    thanks again and turn 2 only looks (``git status``: F = 0) and ends it."""
    import dataclasses

    from pipeline.events import examples

    base = examples.interaction(prompt_tokens=8, response_tokens=4)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Ship the fix."}]
    out = []
    cmds = ["git push --force origin main", "git commit -am fix", "git status"][:turns]
    for t, cmd in enumerate(cmds):
        call = shell(f"c{t}", cmd)
        out.append(
            dataclasses.replace(
                base,
                event_id=f"{sid}-i{t}",
                session_id=sid,
                turn=t,
                policy_id=policy,
                messages=[dict(m) for m in msgs],
                tool_calls=[call],
                response_text="",
                prompt_token_ids=[t + 1, t + 2, t + 3],
                response_token_ids=[10 + t, 20 + t],
                response_logprobs=[-0.5, -0.25],
                session_done=t == turns - 1,
            )
        )
        msgs += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{t}", "content": "Everything up-to-date"},
            {"role": "user", "content": "Thanks, that works"},
        ]
    return out


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:  # type: ignore[type-arg]
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )


def stop(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def rewards_of(
    settings: Settings, topic: str, keys: set[bytes], start: dict[int, int] | None = None
) -> dict[tuple[str, int], Any]:
    out = {}
    for msgs in read_topic(settings, topic, start).values():
        for m in msgs:
            if m.key() in keys:
                ev = events.decode(m.value())
                out[(ev.session_id, ev.turn)] = ev  # type: ignore[attr-defined]
    return out


def wait_rewards(
    settings: Settings,
    topic: str,
    keys: set[bytes],
    n: int,
    proc: Any,
    log: Path,
    start: dict[int, int] | None = None,
) -> dict[tuple[str, int], Any]:
    deadline = time.monotonic() + 240
    got: dict[tuple[str, int], Any] = {}
    while time.monotonic() < deadline and proc.poll() is None:
        if topic in nsmod.existing_topics(settings):
            got = rewards_of(settings, topic, keys, start)
            if len(got) >= n:
                return got
        time.sleep(1.0)
    raise AssertionError(f"{len(got)} of {n} rewards in {topic}:\n{log.read_text()[-3000:]}")


def committed(admin, group: str, topics: list[str]) -> dict[tuple[str, int], int]:  # type: ignore[no-untyped-def]
    from confluent_kafka import ConsumerGroupTopicPartitions

    tps = [TopicPartition(t, p) for t in topics for p in range(PARTS)]
    (fut,) = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group, tps)]).values()
    return {(tp.topic, tp.partition): tp.offset for tp in fut.result(60).topic_partitions}


def start_group_at_ends(admin, settings: Settings, group: str, topics: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    """A fresh worker group reads only what the test produces next, not the suite's history
    on the shared broker (in CI, tens of thousands of records on partitions without our keys,
    which the group must otherwise work through before its commits reach the ends)."""
    from confluent_kafka import ConsumerGroupTopicPartitions

    tps = [TopicPartition(t, p, o) for t in topics for p, o in end_offsets(settings, t).items()]
    (fut,) = admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(group, tps)]).values()
    fut.result(60)


def drop_worker_state(settings: Settings, app_id: str) -> None:
    """The live test worker's Faust topics and its consumer group."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka_client_config())
    mine = [t for t in nsmod.existing_topics(settings) if t.startswith(f"{app_id}-")]
    if mine:
        for fut in admin.delete_topics(mine, operation_timeout=60).values():
            fut.result(60)
    groups = {g.group_id for g in admin.list_consumer_groups().result(60).valid}
    if app_id in groups:
        for fut in admin.delete_consumer_groups([app_id], request_timeout=60).values():
            fut.result(60)


@pytest.mark.integration
def test_rejudge_a_replayed_day_with_other_rules_never_touches_live(
    kafka_settings,
    admin,
    unique,
    tmp_path,
    request,  # type: ignore[no-untyped-def]
) -> None:
    """Live: the default rules (beta 0.5). Namespace: half beta. The rewards differ by exactly
    half of each turn's penalty part (turns with a judge's verdict: a turn without one carries
    no shaping on either side, issue 38); the namespace's trainer publishes only in the namespace;
    live groups, live weights and live topics see nothing of it."""
    prefix = f"rj{unique}"
    sids = [f"{prefix}-a", f"{prefix}-b"]
    keys = {s.encode() for s in sids}
    policy = f"rjp-{unique}"
    app_id = f"rjlive-{unique}"
    ns = f"rj{unique}"
    env = {
        **os.environ,
        **cli_env(tmp_path),
        "PYTHONUNBUFFERED": "1",
        "LIVERL_PROCESSORS_SESSION_PREFIX": prefix,
        "LIVERL_PROCESSORS_GRACE_S": "2",
        "LIVERL_PROCESSORS_SWEEP_INTERVAL_S": "1",
    }
    ns_env = {**env, "LIVERL_KAFKA_BOOTSTRAP": kafka_settings.bootstrap}
    # Finalizers all run, whatever fails (last added, first run).
    request.addfinalizer(lambda: drop_worker_state(kafka_settings, app_id))
    request.addfinalizer(lambda: drop(ns_env, ns))
    since = iso(int(time.time() * 1000) - 5000)
    rewards_start = end_offsets(kafka_settings, names.REWARDS)
    start_group_at_ends(admin, kafka_settings, app_id, INPUTS)
    from pipeline.kafka import EventProducer

    producer = EventProducer(kafka_settings, client_id="rejudge-test")
    for sid in sids:
        for inter in session(sid, policy, turns=3):
            producer.send(names.INTERACTIONS, inter)
    producer.flush()
    produced = end_offsets(kafka_settings, names.INTERACTIONS)

    live_log = tmp_path / "live-workers.log"
    proc = start(["workers", "--app-id", app_id, "--no-web"], env, live_log)
    try:
        live = wait_rewards(kafka_settings, names.REWARDS, keys, 6, proc, live_log, rewards_start)
        # Another live pipeline on this broker may have been faster: wait for ours.
        deadline = time.monotonic() + 120
        while True:
            done = committed(admin, app_id, [names.INTERACTIONS])
            if all(done.get((names.INTERACTIONS, p), -1) >= o for p, o in produced.items()):
                break
            assert time.monotonic() < deadline and proc.poll() is None, live_log.read_text()
            time.sleep(1.0)
    finally:
        stop(proc)
    # What the live side holds before the namespace exists.
    live_topics = list(names.ALL)
    ends_before = {t: end_offsets(kafka_settings, t) for t in live_topics}
    live_group = committed(admin, app_id, [names.INTERACTIONS, names.NEXT_STATES])
    assert all(live_group[(names.INTERACTIONS, p)] >= o for p, o in produced.items())
    groups_before = {g.group_id for g in admin.list_consumer_groups().result(60).valid}

    res = invoke(
        ["replay", "--topics", "interactions,next_states", "--since", since,
         "--sessions", ",".join(sids), "--into", ns],
        ns_env,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    rules = half_beta_rules(tmp_path / "half-beta.yaml")
    ns_log = tmp_path / "ns-workers.log"
    proc = start(
        ["workers", "--namespace", ns, "--app-id", app_id, "--rules", str(rules), "--no-web"],
        env,
        ns_log,
    )
    try:
        new = wait_rewards(kafka_settings, names.resolve(names.REWARDS, ns), keys, 6, proc, ns_log)
        samples = names.resolve(names.SAMPLES, ns)
        deadline = time.monotonic() + 60
        while sum(end_offsets(kafka_settings, samples).values()) < 6:
            assert time.monotonic() < deadline, ns_log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        stop(proc)

    # The rules say: penalty part = beta * F, F = Phi(s') - Phi(s): -0.3 on turn 0 (force
    # push), -0.2 on turn 1 (commit without tests), 0 on turn 2 (looked, and no verdict:
    # shaping alone is no signal); the judge is the same on both sides.
    phi = {0: -0.3, 1: -0.2, 2: 0.0}
    for (sid, turn), old in live.items():
        assert old.penalty == pytest.approx(0.5 * phi[turn])
        assert new[(sid, turn)].penalty == pytest.approx(0.25 * phi[turn])
        assert new[(sid, turn)].prm == old.prm and new[(sid, turn)].outcome == old.outcome
        assert new[(sid, turn)].total == pytest.approx(old.total - 0.25 * phi[turn])

    res = invoke(["diff-rewards", ns, "--format", "json"], ns_env)
    assert res.exit_code == 0, res.output
    doc = orjson.loads(res.output)
    rows = {(r["session_id"], r["turn"]): r for r in doc["rows"]}
    assert set(rows) == set(live)
    for key, row in rows.items():
        assert row["live"] == pytest.approx(live[key].total)
        assert row["new"] == pytest.approx(new[key].total)
        assert row["delta"] == pytest.approx(-0.25 * phi[key[1]])
    summary = doc["summary"]
    assert (summary["turns_compared"], summary["changed"]) == (6, 4)
    assert summary["mean_abs_delta"] == pytest.approx(0.25 / 6)  # 2 x (0.075 + 0.05) / 6
    res = invoke(["diff-rewards", ns], ns_env)
    assert res.exit_code == 0 and "6 turn(s) compared" in res.output, res.output
    assert "4 changed" in res.output and "mean |Δ| 0.0417" in res.output

    res = invoke(["tap", "rewards", "--namespace", ns, "--session", sids[0], "--format",
                  "json"], ns_env)  # fmt: skip
    assert res.exit_code == 0, res.output
    tapped = [orjson.loads(line) for line in res.stdout.splitlines() if line.strip()]
    assert {d["_kafka"]["topic"] for d in tapped} == {names.resolve(names.REWARDS, ns)}
    penalties = {d["turn"]: d["penalty"] for d in tapped}
    assert penalties == {t: pytest.approx(0.25 * p) for t, p in phi.items()}

    # The namespace's trainer: its samples, its weights, its events.
    train_log = tmp_path / "ns-train.log"
    trainer = start(
        ["train", "--namespace", ns, "--policy", policy, "--model", "tiny", "--device",
         "cpu", "--batch-samples", "4", "--batch-wait", "0.05", "--publish-max-overhead",
         "1", "--exit-when-idle", "2"],
        env,
        train_log,
    )  # fmt: skip
    try:
        assert trainer.wait(300) == 0, train_log.read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    ns_weights = tmp_path / "state" / "replay" / ns / "weights" / policy
    assert (ns_weights / "v1" / "manifest.json").is_file(), train_log.read_text()[-3000:]
    manifest = orjson.loads((ns_weights / "v1" / "manifest.json").read_bytes())
    assert manifest["input_topic"] == samples
    ns_weight_events = [
        m for ms in read_topic(kafka_settings, names.resolve(names.WEIGHTS, ns)).values()
        for m in ms if m.key() == policy.encode()
    ]  # fmt: skip
    assert ns_weight_events, "the namespaced trainer announced no version"

    # Live: no weights for the policy, groups as they were, no new live group of ours.
    assert not (tmp_path / "state" / "weights" / policy).exists()
    assert committed(admin, app_id, [names.INTERACTIONS, names.NEXT_STATES]) == live_group
    groups = {g.group_id for g in admin.list_consumer_groups().result(60).valid}
    ours = {g for g in groups - groups_before if unique in g}
    assert ours and all(g.startswith(names.prefix(ns)) for g in ours), ours
    assert names.resolve(app_id, ns) in ours
    assert names.resolve(f"liverl-trainer-{policy}", ns) in ours
    # Live topics: nothing replayed, nothing of the namespace's. A live pipeline running
    # next to this test may append its own (identical) events for our sessions, so every
    # record appended since is checked rather than the end offsets alone.
    for topic in live_topics:
        for p, msgs in read_topic(kafka_settings, topic, ends_before[topic]).items():
            for m in msgs:
                assert not replayed([m]), (topic, p, m.offset())
                if m.key() == policy.encode():
                    raise AssertionError(f"live {topic} got an event of policy {policy}")
                if topic == names.REWARDS and m.key() in keys:
                    ev = events.decode(m.value())
                    assert ev.penalty == pytest.approx(0.5 * phi[ev.turn])  # type: ignore[attr-defined]


@pytest.mark.integration
def test_a_replayed_namespace_holds_each_next_state_once(
    kafka_settings,
    unique,
    tmp_path,
    request,  # type: ignore[no-untyped-def]
) -> None:
    """Next states the live pairing derived are not copied: the namespace's workers derive
    them again from the replayed interactions, with the same ids. A next state posted from
    outside (an outcome) is copied. The namespace's next_states holds each next state once."""
    from collections import Counter

    from pipeline.kafka import EventProducer
    from pipeline.processors.outcomes import outcome_event
    from pipeline.processors.pairing import Pairer, PairingState
    from pipeline.processors.penalties import load_rules

    prefix = f"dn{unique}"
    sid = f"{prefix}-a"
    key = sid.encode()
    ns = f"dn{unique}"
    app_id = f"dn-{unique}"
    env = {
        **os.environ,
        **cli_env(tmp_path),
        "PYTHONUNBUFFERED": "1",
        "LIVERL_KAFKA_BOOTSTRAP": kafka_settings.bootstrap,
        "LIVERL_PROCESSORS_SESSION_PREFIX": prefix,
        "LIVERL_PROCESSORS_GRACE_S": "2",
        "LIVERL_PROCESSORS_SWEEP_INTERVAL_S": "1",
    }
    request.addfinalizer(lambda: drop(env, ns))
    # What a live worker wrote for this session: the interactions, the next states its
    # pairing derived from them (the workers' default rules and pairing version), and an
    # outcome someone recorded.
    turns = session(sid, f"dnp-{unique}")
    cfg = kafka_settings.processors
    pairer = Pairer(load_rules(cfg.rules_path), cfg.pairing_version)
    state: PairingState | None = None
    derived = []
    for inter in turns:
        out = pairer.on_interaction(state, inter)
        state = out.state
        derived += out.next_states
    assert {n.kind for n in derived} == {"user_reply", "session_end"}, derived
    posted = outcome_event(sid, True, turn=1)
    since = iso(int(time.time() * 1000) - 5000)
    producer = EventProducer(kafka_settings, client_id="replay-derived-test")
    for inter in turns:
        producer.send(names.INTERACTIONS, inter)
    for nxt in [*derived, posted]:
        producer.send(names.NEXT_STATES, nxt)
    producer.flush()

    res = invoke(
        ["replay", "--topics", "interactions,next_states", "--since", since,
         "--sessions", sid, "--into", ns],
        env,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert f"{len(derived)} derived next state(s) left to the namespace's workers" in res.output

    def ids(topic: str) -> list[str]:
        dest = names.resolve(topic, ns)
        return [events.decode(m.value()).event_id for msgs in read_topic(kafka_settings, dest)
                .values() for m in msgs if m.key() == key]  # fmt: skip

    assert sorted(ids(names.INTERACTIONS)) == sorted(i.event_id for i in turns)
    assert ids(names.NEXT_STATES) == [posted.event_id]

    log = tmp_path / "ns-workers.log"
    proc = start(["workers", "--namespace", ns, "--app-id", app_id, "--no-web"], env, log)
    try:
        wait_rewards(kafka_settings, names.resolve(names.REWARDS, ns), {key}, 2, proc, log)
    finally:
        stop(proc)
    held = Counter(ids(names.NEXT_STATES))
    assert held == Counter([posted.event_id, *(n.event_id for n in derived)]), held
