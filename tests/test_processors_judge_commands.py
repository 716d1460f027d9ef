"""``liverl judges compare`` on the real broker: a namespace's workers judge users' replies,
gates record outcomes, and the judge's consistency moves when its verdicts meet failures."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from pipeline import events
from pipeline.events import NextState, Producer, examples
from pipeline.events.types import Vote
from pipeline.kafka import EventProducer, names
from pipeline.processors.outcomes import outcome_event
from tests.test_replay import cli_env, drop, invoke, read_topic, start, stop

P = Producer(component="test", version="1")


def listeners(port: int) -> list[str]:
    """The addresses TCP sockets listen on at ``port`` (Linux: /proc/net/tcp and tcp6)."""
    found = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/self/net") / name
        for line in path.read_text().splitlines()[1:] if path.exists() else []:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(addr)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(socket.inet_ntop(family, raw))
    return found


def test_watch_serves_its_metrics_on_loopback_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: ``--metrics-port`` listened on 0.0.0.0, without authentication. Now on the
    workers' ``processors.web_host`` (127.0.0.1), or ``--metrics-host``; closed at the end."""
    from pipeline.processors.config import free_port
    from pipeline.processors.consistency_watch import ConsistencyWatcher

    seen: list[list[str]] = []
    monkeypatch.setattr(
        ConsistencyWatcher, "run", lambda self, stop=None, once=False: seen.append(listeners(port))
    )
    port = free_port("127.0.0.1")
    res = invoke(["judges", "watch", "--metrics-port", str(port), "--once"], cli_env(tmp_path))
    assert res.exit_code == 0, res.output
    assert seen == [["127.0.0.1"]] and listeners(port) == []
    port = free_port("127.0.0.1")
    res = invoke(
        ["judges", "watch", "--metrics-port", str(port), "--metrics-host", "127.0.0.2", "--once"],
        cli_env(tmp_path),
    )
    assert res.exit_code == 0, res.output
    assert seen[-1] == ["127.0.0.2"]
    with socket.socket() as held:  # a port in use: one line, not a traceback
        held.bind(("127.0.0.1", port))
        held.listen()
        res = invoke(["judges", "watch", "--metrics-port", str(port), "--once"], cli_env(tmp_path))
    assert res.exit_code == 1 and len(seen) == 2
    assert res.output.strip().splitlines() == [
        f"Error: metrics server: cannot listen on 127.0.0.1:{port} (Address already in use); "
        "pass another --metrics-port"
    ]


def turn_of(sid: str) -> tuple[events.Interaction, NextState]:
    """One trainable turn and the user's approving reply (the reply judge votes +1)."""
    base = examples.interaction(prompt_tokens=8, response_tokens=4)
    inter = dataclasses.replace(
        base,
        event_id=f"{sid}-i0",
        session_id=sid,
        turn=0,
        policy_id="jc",
        messages=[{"role": "user", "content": "Fix the failing test."}],
        response_text="Done: the off-by-one in the loop is fixed.",
        tool_calls=[],
        session_done=False,
    )
    reply = NextState(
        event_id=f"{sid}-reply",
        producer=P,
        session_id=sid,
        turn=0,
        kind="user_reply",
        role="user",
        content="Thanks, perfect!",
        source="pairing",
    )
    return inter, reply


def verdicts(settings: Any, ns: str, sids: set[str]) -> int:
    topic = names.resolve(names.PRM_SCORES, ns)
    return sum(
        1
        for msgs in read_topic(settings, topic).values()
        for m in msgs
        if m.key()
        and m.key().decode() in sids
        and events.decode(m.value()).parents[-1].endswith("-reply")  # type: ignore[attr-defined]
    )


def wait_verdicts(settings: Any, ns: str, sids: set[str], proc: Any, log: Path) -> None:
    deadline = time.monotonic() + 180
    while verdicts(settings, ns, sids) < len(sids):
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
        time.sleep(1.0)


def compare(env: dict[str, str], ns: str) -> dict[str, Any]:
    res = invoke(["judges", "compare", ns, "--format", "json"], env)
    assert res.exit_code == 0, res.output
    doc: dict[str, Any] = orjson.loads(res.output)
    return doc


@pytest.mark.integration
def test_consistency_falls_when_the_judge_approves_what_gates_fail(
    kafka_settings,
    unique,
    tmp_path,
    request,  # type: ignore[no-untyped-def]
) -> None:
    ns = f"jc{unique}"
    env = {
        **os.environ,
        **cli_env(tmp_path),
        "PYTHONUNBUFFERED": "1",
        "LIVERL_KAFKA_BOOTSTRAP": kafka_settings.bootstrap,
    }
    request.addfinalizer(lambda: drop(env, ns))
    res = invoke(["judges", "compare", ns], env)
    assert res.exit_code != 0 and "no verdicts topic" in res.output  # before any replay
    assert invoke(["topics", "apply", "--namespace", ns], env).exit_code == 0
    producer = EventProducer(kafka_settings, client_id="judges-compare-test")

    def send(sid: str, passed: bool) -> None:
        inter, reply = turn_of(sid)
        producer.send(names.resolve(names.INTERACTIONS, ns), inter)
        producer.send(names.resolve(names.NEXT_STATES, ns), reply)
        # the gate's outcome of the same turn: what the judge is checked against
        gate = outcome_event(sid, passed, turn=0)
        producer.send(names.resolve(names.NEXT_STATES, ns), gate)

    first = {f"{ns}-p{i}" for i in range(3)} | {f"{ns}-f0"}
    for sid in sorted(first):
        send(sid, passed="-p" in sid)
    producer.flush()
    log = tmp_path / "workers.log"
    proc = start(["workers", "--namespace", ns, "--app-id", f"jcapp{unique}", "--no-web"], env, log)
    try:
        wait_verdicts(kafka_settings, ns, first, proc, log)
        doc = compare(env, ns)
        (row,) = [r for r in doc["judges"] if r["judge_id"] == "replies"]
        # three approvals met passing gates, one a failing gate; the judge's verdicts on the
        # gates' own records (exit codes) are not counted
        assert (row["agree"], row["disagree"], row["abstain"]) == (3, 1, 0)
        assert row["consistency"] == pytest.approx(4 / 6, abs=1e-6)
        second = {f"{ns}-f{i}" for i in range(1, 3)}
        for sid in sorted(second):
            send(sid, passed=False)
        producer.flush()
        wait_verdicts(kafka_settings, ns, first | second, proc, log)
        (row,) = [r for r in compare(env, ns)["judges"] if r["judge_id"] == "replies"]
        assert (row["agree"], row["disagree"]) == (3, 3)
        assert row["consistency"] == pytest.approx(0.5, abs=1e-6)
    finally:
        stop(proc)
    res = invoke(["judges", "compare", ns], env)
    assert res.exit_code == 0 and "replies" in res.output and "0.500" in res.output


# ---- one matching rule: compare and watch count the same events the same way (issue 38) ----


def _verdict(sid: str, turn: int, score: Vote) -> events.PrmScore:
    return events.PrmScore(
        event_id=f"prm-{sid}-{turn}",
        producer=P,
        ts_ms=10,
        parents=[f"{sid}-i{turn}", f"{sid}-reply{turn}"],
        session_id=sid,
        turn=turn,
        score=score,
        votes=[score],
        judge_id="replies",
        judge_version="v1",
    )


def _outcome(sid: str, passed: bool, ts: int, turn: int | None = None) -> NextState:
    ev = outcome_event(sid, passed, turn=turn, ts_ms=ts)
    return dataclasses.replace(ev, event_id=f"out-{sid}-{turn}-{passed}-{ts}")


def same_events() -> list[events.PrmScore | NextState]:
    """In the order the watcher reads them live: each verdict before its session's outcomes."""
    return [
        # a: the session passes, then fails: its outcomes contradict, the verdict counts
        # neither way (was: agree live, disagree in compare)
        _verdict("a", 0, 1),
        _outcome("a", True, 1),
        _outcome("a", False, 2),
        # b: turn-level outcomes name their turn; each verdict meets its own turn's only
        _verdict("b", 1, 1),
        _verdict("b", 2, 1),
        _outcome("b", True, 3, turn=1),
        _outcome("b", False, 4, turn=2),
        # c: a session pass read first, then turn 1's own failure: the turn's decides
        # (was: disagree live, from the session's pass; agree in compare)
        _verdict("c", 1, -1),
        _outcome("c", True, 5),
        _outcome("c", False, 6, turn=1),
        # d: the session's outcomes contradict, then turn 0's own pass decides
        # (was: contradicted live, agree in compare)
        _verdict("d", 0, 1),
        _outcome("d", True, 7),
        _outcome("d", False, 8),
        _outcome("d", True, 9, turn=0),
        # e: an abstention on a failed turn
        _verdict("e", 0, 0),
        _outcome("e", False, 10, turn=0),
    ]


# By hand: a contradicted; b turn 1 agrees, turn 2 disagrees; c agrees (-1 vs turn 1 failed);
# d agrees (+1 vs turn 0 passed); e abstains.
EXPECTED = {"agree": 3, "disagree": 1, "abstain": 1, "contradicted": 1}


class _Sent:
    """The watcher's producer, keeping what it sends (no broker)."""

    def __init__(self) -> None:
        self.sent: list[events.JudgeConsistency] = []

    def send(self, topic: str, ev: events.JudgeConsistency, key: str) -> None:
        self.sent.append(ev)

    def flush(self) -> None:
        pass


def _history(evs: list[events.PrmScore | NextState]) -> Any:
    from pipeline.processors.consistency_watch import History

    return History(
        [e for e in evs if isinstance(e, events.PrmScore)],
        [e for e in evs if isinstance(e, NextState)],
    )


def _newest(sent: list[events.JudgeConsistency]) -> dict[str, int]:
    """The judge's tally as consumers read it: the newest event on the topic."""
    ev = sent[-1]
    return {
        "agree": ev.agree,
        "disagree": ev.disagree,
        "abstain": ev.abstain,
        "contradicted": ev.contradictions,
    }


def test_compare_and_watch_count_the_same_events_the_same_way(monkeypatch: Any) -> None:
    """``judges compare`` (one batch read), ``judges watch`` following the events one by one,
    and ``judges watch`` rebuilt at a restart all end with the same tally."""
    from pipeline.kafka import reader
    from pipeline.processors import consistency_watch, judge_commands
    from pipeline.settings import Settings

    evs = same_events()
    monkeypatch.setattr(consistency_watch, "read_history", lambda *a, **k: _history(evs))
    result = judge_commands.compare(Settings(), "ns")
    (row,) = result.rows()
    assert {k: row[k] for k in EXPECTED} == EXPECTED
    assert row["consistency"] == round((3 + 1) / (4 + 2), 6)
    assert (result.verdicts, result.outcomes, result.contradictory) == (6, 10, 2)

    # watch, restarted: the catch-up reads the same history
    monkeypatch.setattr(reader, "read_to_end", lambda *a, **k: None)  # nothing published yet
    monkeypatch.setattr(consistency_watch.ConsistencyWatcher, "_ends", lambda self: {})
    rebuilt = consistency_watch.ConsistencyWatcher(Settings(), namespace="ns")
    rebuilt._producer = _Sent()
    rebuilt.catch_up()
    assert _newest(rebuilt._producer.sent) == EXPECTED

    # watch, live: an empty history, then each event as it arrives
    monkeypatch.setattr(consistency_watch, "read_history", lambda *a, **k: _history([]))
    live = consistency_watch.ConsistencyWatcher(Settings(), namespace="ns")
    live._producer = _Sent()
    live.catch_up()
    for ev in evs:
        live._publish(live.handle(ev))
    assert _newest(live._producer.sent) == EXPECTED
    t = live.tracker.tallies[("replies", "v1")]
    assert (t.agree, t.disagree, t.abstain, t.contradicted) == (3, 1, 1, 1)
    # the re-matches of c and d are new events: c's verdict named the session's pass, then
    # turn 1's failure
    c = [
        (e.outcome_id, e.verdict * e.outcome)
        for e in live._producer.sent
        if e.verdict_id == "prm-c-1"
    ]
    assert c == [("out-c-None-True-5", -1), ("out-c-1-False-6", 1)]
