"""The consistency processor on the real broker: matches published as verdicts and outcomes
arrive, a judge flagged once when it falls below the threshold, nothing published twice."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

import pytest

from pipeline import events
from pipeline.events import NextState, PrmScore, Producer
from pipeline.kafka import EventProducer, names
from pipeline.processors.consistency import ConsistencyTracker, Match, Tally
from pipeline.processors.consistency_watch import (
    Change,
    ConsistencyWatcher,
    Flagger,
    match_event,
)
from pipeline.processors.outcomes import outcome_event
from pipeline.settings import Settings
from tests.test_replay import cli_env, drop, invoke, read_topic

P = Producer(component="judge", version="v1")


def verdict(sid: str, score: int, evidence: str) -> PrmScore:
    return PrmScore(
        event_id=f"prm-{sid}-{evidence}",
        producer=P,
        parents=[f"{sid}-i0", evidence],
        session_id=sid,
        turn=0,
        score=score,
        votes=[score],  # type: ignore[arg-type]
        judge_id="replies",
        judge_version="v1",
    )


def test_flagger_flags_once_after_the_minimum_and_again_only_after_recovering() -> None:
    """Fewer decided matches than the window (20): recent and cumulative are the same here.
    Recovery asks for flag_below + 0.05 = 0.55 (the rule's values are unchanged; the reason
    now names both figures and recovery is a change of its own)."""
    f = Flagger(flag_below=0.5, min_decided=4)
    key = ("j", "1")
    tally = Tally()

    def step(agrees: bool) -> Change | None:
        m = Match(key, "s", 0, 1, 1 if agrees else -1, f"v{tally.decided}", "o")
        tally.add(m)
        return f.check(dataclasses.replace(m, tally=tally.copy()))

    assert [step(False) for _ in range(3)] == [None] * 3  # 1/5: below, but 3 < 4 decided
    change = step(False)  # 4 decided, (0 + 1) / (4 + 2) = 0.167
    assert change is not None and change.kind == "flagged"
    assert change.reason == (
        "recent 0.167 over the last 4 decided (0 agree), cumulative "
        "0.167 after 4 (0 agree, 4 disagree); < 0.5"
    )
    assert step(False) is None  # already flagged
    for _ in range(6):
        assert step(True) is None  # 2/7 = 0.286 ... 7/13 = 0.538: not yet >= 0.55
    assert f.flagged == {key}
    change = step(True)  # 8/14 = 0.571 >= 0.55: recovered
    assert change is not None and change.kind == "recovered" and "; >= 0.55" in change.reason
    assert f.flagged == set()
    for _ in range(6):
        step(False)  # 8/20 = 0.4, flagged again on the way down
    assert f.flagged == {key}


def run_judge(watcher: ConsistencyWatcher, results: list[bool]) -> list[events.JudgeConsistency]:
    """One +1 verdict per session, each meeting a gate that passed (agree) or failed."""
    out = []
    for i, passed in enumerate(results):
        sid = f"s{i}"
        watcher.tracker.outcome(outcome_event(sid, passed, turn=0))
        out += watcher.match_events(watcher.tracker.verdict(verdict(sid, 1, f"{sid}-n0")))
    return out


def test_a_long_right_judge_that_turns_bad_is_flagged_within_the_window_and_recovers() -> None:
    """200 right, then wrong: the window of 20 holds 20 - k right and k wrong, recent
    (21 - k) / 22. k = 10: 11/22 = 0.5, not below; k = 11: 10/22 = 0.4545 < 0.5, flagged,
    while the cumulative figure is 201 / 213 = 0.9437. Then right again: the first 9 push out
    the window's 9 old right ones (still 9 right, 11 wrong); the 10th, 11th, 12th push out
    wrong ones: 11/22, 12/22 = 0.5455 < 0.55, 13/22 = 0.5909 >= 0.55: recovered at the 12th.
    One event says each change; every event in between says the judge is excluded."""
    watcher = ConsistencyWatcher(Settings(), flag_below=0.5, min_decided=10, window=20)
    evs = run_judge(watcher, [True] * 200 + [False] * 11 + [True] * 12)
    assert len(evs) == 223
    flags = [i for i, e in enumerate(evs) if e.flagged]
    recoveries = [i for i, e in enumerate(evs) if e.recovered]
    assert (flags, recoveries) == ([210], [222])  # the 11th wrong, the 12th right after
    flag, back = evs[210], evs[222]
    assert (flag.recent_agree, flag.recent_disagree, flag.window) == (9, 11, 20)
    assert flag.recent_consistency == pytest.approx(10 / 22)
    assert flag.consistency == pytest.approx(201 / 213)
    assert flag.reason == (
        "recent 0.455 over the last 20 decided (9 agree), cumulative 0.944 "
        "after 211 (200 agree, 11 disagree); < 0.5"
    )
    assert evs[209].recent_consistency == pytest.approx(0.5) and not evs[209].excluded
    assert (back.recent_agree, back.recent_disagree) == (12, 8)
    assert back.recent_consistency == pytest.approx(13 / 22)
    assert evs[221].recent_consistency == pytest.approx(12 / 22)
    assert [e.excluded for e in evs] == [False] * 210 + [True] * 12 + [False]
    assert not back.excluded and back.reason is not None and back.reason.endswith(">= 0.55")
    for ev in (flag, back):  # the schema takes the new fields
        assert events.decode(events.encode(ev)) == ev


def test_the_cumulative_figure_alone_waited_for_201_wrong_verdicts() -> None:
    """The issue's numbers: with a window as long as the history the recent figure is the
    cumulative one, (200 + 1) / (200 + k + 2) < 0.5 first at k = 201 (k = 200: exactly 0.5)."""
    watcher = ConsistencyWatcher(Settings(), flag_below=0.5, min_decided=10, window=10_000)
    evs = run_judge(watcher, [True] * 200 + [False] * 201)
    assert [i - 200 for i, e in enumerate(evs) if e.flagged] == [200]  # the 201st wrong one
    assert evs[-1].consistency == pytest.approx(201 / 403)


def test_each_match_carries_the_tally_as_it_stood_then() -> None:
    tr = ConsistencyTracker()
    tr.outcome(outcome_event("a", True, turn=0))
    tr.outcome(outcome_event("b", False, turn=0))
    m1, m2 = tr.feed([verdict("a", 1, "ra"), verdict("b", 1, "rb")], [])
    assert (m1.tally, m2.tally) == (Tally(1, 0), Tally(1, 1))
    ev = match_event(m2)
    assert (ev.agree, ev.disagree, ev.consistency) == (1, 1, 0.5)
    assert ev.parents == ["prm-b-rb", m2.outcome_id] and ev.judge_id == "replies"


def thumbs(sid: str, up: bool, ts_ms: int | None = None) -> NextState:
    """Thumbs feedback on turn 0, as ``POST /v1/feedback`` records it."""
    return NextState(
        event_id=events.new_event_id(),
        producer=P,
        ts_ms=ts_ms if ts_ms is not None else events.now_ms(),
        session_id=sid,
        turn=0,
        kind="feedback",
        content="",
        source="feedback",
        score=1.0 if up else -1.0,
        detail={"thumbs": "up" if up else "down"},
    )


def test_a_contradicted_verdict_is_one_event_whichever_outcome_contradicted_it() -> None:
    """Live, the match with the thumbs up is published, then taken back when the thumbs down
    comes; rebuilt at a restart, the verdict is contradicted at once and names the latest
    outcome. Both are one event (its id is the verdict's), so nothing is said twice."""
    up, down = thumbs("a", True, 1), thumbs("a", False, 2)
    v = verdict("a", 1, "a-reply")
    live = ConsistencyTracker()
    live.verdict(v)
    (agreed,) = live.outcome(up)
    (taken_back,) = live.outcome(down)
    rebuilt = ConsistencyTracker()
    (at_once,) = rebuilt.feed([v], [down, up])
    assert (taken_back.outcome_id, at_once.outcome_id) == (down.event_id, down.event_id)
    rebuilt = ConsistencyTracker()
    (at_once,) = rebuilt.feed([v], [thumbs("a", True, 3), down])  # a later thumbs up
    assert at_once.outcome_id != taken_back.outcome_id
    ev_agreed, ev_back, ev_once = (match_event(m) for m in (agreed, taken_back, at_once))
    assert ev_back.event_id == ev_once.event_id != ev_agreed.event_id
    assert (ev_agreed.agree, ev_agreed.contradicted, ev_agreed.contradictions) == (1, False, 0)
    for ev in (ev_back, ev_once):
        assert (ev.agree, ev.disagree, ev.abstain) == (0, 0, 0) and ev.consistency == 0.5
        assert (ev.contradicted, ev.contradictions) == (True, 1)
        assert events.decode(events.encode(ev)) == ev  # the schema takes the new fields


def published(settings: Settings, ns: str) -> list[events.JudgeConsistency]:
    topic = names.resolve(names.JUDGE_CONSISTENCY, ns)
    out = [events.decode(m.value()) for msgs in read_topic(settings, topic).values() for m in msgs]
    return out  # type: ignore[return-value]


@pytest.mark.integration
def test_watch_publishes_each_match_once_and_flags_a_judge_that_disagrees(
    kafka_settings,
    unique,
    tmp_path,
    request,  # type: ignore[no-untyped-def]
) -> None:
    ns = f"cw{unique}"
    env = {**os.environ, **cli_env(tmp_path), "LIVERL_KAFKA_BOOTSTRAP": kafka_settings.bootstrap}
    request.addfinalizer(lambda: drop(env, ns))
    assert invoke(["topics", "apply", "--namespace", ns], env).exit_code == 0
    producer = EventProducer(kafka_settings, client_id="consistency-watch-test")
    prm, nxt = (names.resolve(t, ns) for t in (names.PRM_SCORES, names.NEXT_STATES))

    def session(i: int, passed: bool, outcome_first: bool = False) -> None:
        sid = f"{ns}-s{i}"
        gate: NextState = outcome_event(sid, passed, turn=0)
        sends: list[tuple[str, Any]] = [
            (prm, verdict(sid, 1, f"{sid}-reply")),
            (prm, verdict(sid, -1 if not passed else 1, gate.event_id)),
        ]
        sends.insert(0 if outcome_first else 2, (nxt, gate))
        for topic, ev in sends:
            producer.send(topic, ev)
        producer.flush()

    for i in range(6):  # three approvals confirmed, three contradicted
        session(i, passed=i < 3)
    seen: list[events.JudgeConsistency] = []
    watcher = ConsistencyWatcher(
        kafka_settings, namespace=ns, flag_below=0.5, min_decided=10, on_event=seen.append
    )
    stop = threading.Event()
    thread = threading.Thread(target=watcher.run, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(seen) < 6:
            assert time.monotonic() < deadline and thread.is_alive(), len(seen)
            time.sleep(0.2)
        for i in range(6, 12):  # six more contradicted, while it follows
            session(i, passed=False, outcome_first=i % 2 == 0)
        while len(seen) < 12:
            assert time.monotonic() < deadline and thread.is_alive(), len(seen)
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join(30)
    got = published(kafka_settings, ns)
    assert len(got) == len({e.event_id for e in got}) == 12  # the gates' own verdicts: none
    last = max(got, key=lambda e: e.agree + e.disagree)
    assert (last.agree, last.disagree, last.abstain) == (3, 9, 0)
    assert last.consistency == pytest.approx(4 / 14)
    (flag,) = [e for e in got if e.flagged]
    assert flag.agree + flag.disagree == 10 and flag.reason
    # 3 agree, 7 disagree, all inside the window of 20: recent = cumulative = 4/12
    assert "recent 0.333 over the last 10 decided" in flag.reason
    assert flag.reason.endswith("< 0.5") and flag.excluded and last.excluded
    assert not any(e.recovered for e in got)
    # a second run rebuilds the join from history and publishes nothing again
    res = invoke(["judges", "watch", "--namespace", ns, "--once"], env)
    assert res.exit_code == 0 and "published 0 match(es)" in res.output, res.output
    assert len(published(kafka_settings, ns)) == 12


@pytest.mark.integration
def test_watch_takes_back_a_match_when_the_turns_outcomes_contradict_each_other(
    kafka_settings,
    unique,
    tmp_path,
    request,  # type: ignore[no-untyped-def]
) -> None:
    """Thumbs up, thumbs down, passed and failed on one turn: the judge's match with the
    thumbs up is published, then one contradicted event takes it back, and the tally ends as
    it was before that turn (one agreement of another session). A restart says nothing again."""
    ns = f"cc{unique}"
    env = {**os.environ, **cli_env(tmp_path), "LIVERL_KAFKA_BOOTSTRAP": kafka_settings.bootstrap}
    request.addfinalizer(lambda: drop(env, ns))
    assert invoke(["topics", "apply", "--namespace", ns], env).exit_code == 0
    producer = EventProducer(kafka_settings, client_id="consistency-contradiction-test")
    prm, nxt = (names.resolve(t, ns) for t in (names.PRM_SCORES, names.NEXT_STATES))
    sid, other = f"{ns}-s0", f"{ns}-s1"
    producer.send(prm, verdict(other, -1, f"{other}-reply"))
    producer.send(nxt, outcome_event(other, False, turn=0))  # agrees
    producer.send(prm, verdict(sid, 1, f"{sid}-reply"))
    producer.send(nxt, thumbs(sid, True))  # agrees, for now
    producer.flush()
    seen: list[events.JudgeConsistency] = []
    watcher = ConsistencyWatcher(kafka_settings, namespace=ns, on_event=seen.append)
    stop = threading.Event()
    thread = threading.Thread(target=watcher.run, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(seen) < 2:
            assert time.monotonic() < deadline and thread.is_alive(), len(seen)
            time.sleep(0.2)
        assert (seen[-1].agree, seen[-1].disagree) == (2, 0)
        for ev in (
            thumbs(sid, False),
            outcome_event(sid, True, turn=0),
            outcome_event(sid, False, turn=0),
        ):  # while it follows
            producer.send(nxt, ev)
        producer.flush()
        while len(seen) < 3:
            assert time.monotonic() < deadline and thread.is_alive(), len(seen)
            time.sleep(0.2)
        time.sleep(2.0)  # the last outcomes have been read too: nothing more comes of them
    finally:
        stop.set()
        thread.join(30)
    got = published(kafka_settings, ns)
    assert len(got) == len({e.event_id for e in got}) == 3, got
    (back,) = [e for e in got if e.contradicted]
    assert back.verdict_id == f"prm-{sid}-{sid}-reply"
    assert (back.agree, back.disagree, back.abstain, back.contradictions) == (1, 0, 0, 1)
    assert back.consistency == pytest.approx(2 / 3)  # as before the contradicted turn
    assert watcher.contradicted == 1 and watcher.tracker.contradictory == 1
    # a second run rebuilds the join (the verdict contradicted at once: the same event)
    res = invoke(["judges", "watch", "--namespace", ns, "--once"], env)
    assert res.exit_code == 0 and "published 0 match(es)" in res.output, res.output
    assert "1 turn(s) with contradictory outcomes" in res.output, res.output
    assert len(published(kafka_settings, ns)) == 3
