"""Live consistency on the real broker: the watcher tallies a panel's members from its
verdicts as outcomes arrive, the topic reader follows, and the panel's weights move with them
until a split vote flips; the worker attaches the reader to a live panel."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline import events
from pipeline.events import NextState, Producer
from pipeline.kafka import EventProducer, names
from pipeline.processors import judging
from pipeline.processors.consistency_live import LiveConsistency
from pipeline.processors.consistency_watch import ConsistencyWatcher
from pipeline.processors.judges import RuleJudge, TurnContext, make_judge
from pipeline.processors.outcomes import outcome_event
from pipeline.settings import Settings
from tests.test_replay import cli_env, drop, invoke

P = Producer(component="test", version="1")
# The reply judge reads the directive (-1, with a hint), the rule judge the thanks (+1).
SPLIT = "Thanks, but answer in one sentence."


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def namespace(
    kafka_settings: Settings, unique: str, tmp_path: Path, request: pytest.FixtureRequest
) -> str:
    ns = f"cl{unique}"
    env = {**os.environ, **cli_env(tmp_path), "LIVERL_KAFKA_BOOTSTRAP": kafka_settings.bootstrap}
    request.addfinalizer(lambda: drop(env, ns))
    assert invoke(["topics", "apply", "--namespace", ns], env).exit_code == 0
    return ns


@pytest.mark.integration
def test_a_live_panel_reweights_as_its_members_meet_outcomes(
    kafka_settings: Settings, namespace: str
) -> None:
    ns = namespace
    producer = EventProducer(kafka_settings, client_id="consistency-live-test")
    prm_topic, nxt_topic = (names.resolve(t, ns) for t in (names.PRM_SCORES, names.NEXT_STATES))
    live = LiveConsistency(kafka_settings, ns).start(wait_s=30)
    assert live.ready.is_set() and live.rows() == []
    panel = make_judge("panel", {"judges": ["replies", "rules"], "live": True})
    panel.use_live(live)
    replies_v = make_judge("replies").version
    watcher = ConsistencyWatcher(kafka_settings, namespace=ns, min_decided=100)
    stop = threading.Event()
    thread = threading.Thread(target=watcher.run, args=(stop,), daemon=True)
    thread.start()

    def session(i: int, passed: bool) -> int:
        """The panel judges a split reply; then the session's gate passes or fails."""
        sid = f"{ns}-s{i}"
        state = NextState(
            event_id=f"{sid}-n0",
            producer=P,
            session_id=sid,
            turn=0,
            kind="user_reply",
            role="user",
            content=SPLIT,
            source="pairing",
        )
        work = judging.JudgeWork(
            TurnContext(sid, 0, "Explain it.", "It is like this."), f"{sid}-i0", state
        )
        prm = asyncio.run(judging.judge_one(panel, work)).prm
        producer.send(prm_topic, prm)
        producer.send(nxt_topic, outcome_event(sid, passed, turn=0))
        producer.flush()
        return prm.score

    def decided(judge_id: str, version: str, n: int) -> Callable[[], bool]:
        return lambda: (r := live.row(judge_id, version)) is not None and r.decided == n

    try:
        assert session(0, passed=True) == 0  # no evidence: log-odds of 0.5 is 0 for both
        for i in range(1, 4):  # the gates side with the thanks: rules right, replies wrong
            session(i, passed=True)
        wait_for(decided("rules", RuleJudge.version, 4), "four rules matches")
        wait_for(decided("replies", replies_v, 4), "four replies matches")
        # rules (4 + 1) / (4 + 2) = 0.83, log-odds log 5 = 1.61; replies 1 / 6 -> 0
        assert panel.weigh()[0] == [0.0, 1.61]
        assert session(4, passed=False) == 1  # and from now on the gates disagree with it
        for i in range(5, 12):
            session(i, passed=False)
        wait_for(decided("rules", RuleJudge.version, 12), "twelve rules matches")
        wait_for(decided("replies", replies_v, 12), "twelve replies matches")
        # rules 4 agree / 8 disagree: 5/14 -> 0; replies 8 / 4: 9/14, log(9/5) = 0.59
        assert panel.weigh()[0] == [0.59, 0.0]
        state = NextState(
            event_id="n",
            producer=P,
            session_id="x",
            turn=0,
            kind="user_reply",
            role="user",
            content=SPLIT,
            source="pairing",
        )
        v = asyncio.run(panel.judge(TurnContext("x", 0, "Explain it.", "Long."), state))
        assert v.score == -1 and v.hints == ["Answer in one sentence."]
    finally:
        stop.set()
        thread.join(30)
        live.stop()
    # the panel's own tally sits beside its members' on the topic
    assert any(r.judge_id == "panel" for r in live.rows())


@pytest.mark.integration
def test_the_reader_takes_the_newest_tally_and_survives_a_missing_topic(
    kafka_settings: Settings, namespace: str, unique: str
) -> None:
    topic = names.resolve(names.JUDGE_CONSISTENCY, namespace)
    producer = EventProducer(kafka_settings, client_id="consistency-live-test")

    def tally(agree: int, disagree: int, version: str = "v1") -> events.JudgeConsistency:
        return events.JudgeConsistency(
            event_id=f"m-{version}-{agree}-{disagree}",
            producer=P,
            parents=["p", "o"],
            judge_id="llm",
            judge_version=version,
            verdict=1,
            outcome=1,
            verdict_id="p",
            outcome_id="o",
            agree=agree,
            disagree=disagree,
            abstain=0,
            consistency=(agree + 1) / (agree + disagree + 2),
            flagged=False,
            reason=None,
        )

    for ev in (tally(1, 0), tally(1, 1), tally(2, 1, "v2")):
        producer.send(topic, ev, key="llm")
    producer.flush()
    live = LiveConsistency(kafka_settings, namespace).start(wait_s=30)
    try:
        assert live.consistency("llm", "v1") == pytest.approx(2 / 4)  # history: the newest
        producer.send(topic, tally(5, 1), key="llm")
        producer.flush()
        wait_for(lambda: live.consistency("llm", "v1") == pytest.approx(6 / 8), "a followed tally")
        assert live.consistency("llm", "v2") == pytest.approx(3 / 5)
        assert live.consistency("llm", "v3") is None
    finally:
        live.stop()
    absent = LiveConsistency(kafka_settings, f"none{unique}", retry_s=0.2).start(wait_s=1)
    try:
        assert not absent.ready.is_set() and absent.consistency("llm", "v1") is None
        wait_for(lambda: absent.error is not None, "the reader's error")
        assert "liverl topics apply" in (absent.error or "")
    finally:
        absent.stop()


@pytest.mark.integration
def test_a_worker_attaches_the_topic_reader_to_a_live_panel(
    kafka_settings: Settings, namespace: str, tmp_path: Path
) -> None:
    from pipeline.processors.app import create_app
    from pipeline.processors.config import ProcessorSettings
    from pipeline.replay import namespace as nsmod

    settings = nsmod.enter(kafka_settings, namespace)
    cfg = ProcessorSettings(
        web_enabled=False,
        judge="panel",
        judge_options={"judges": ["replies", "rules"], "live": True},
    )
    app = create_app(settings, cfg, tmp_path)
    try:
        live = app.liverl_consistency
        assert live is not None and live.ready.is_set()
        assert live.topic == names.resolve(names.JUDGE_CONSISTENCY, namespace)
        static = create_app(
            settings,
            cfg.model_copy(update={"judge_options": {"judges": ["replies", "rules"]}}),
            tmp_path / "static",
        )
        assert static.liverl_consistency is None
    finally:
        if live is not None:
            live.stop()


def test_the_reader_keeps_whether_a_judge_stands_flagged() -> None:
    """No broker: the newest event of a judge version says whether it is excluded, and its
    row's weight is 0 while it is (the log-odds of its consistency otherwise)."""
    live = LiveConsistency(Settings(), "unit")

    def ev(n: int, excluded: bool) -> events.JudgeConsistency:
        return events.JudgeConsistency(
            event_id=f"m{n}",
            producer=P,
            parents=["p", "o"],
            judge_id="llm",
            judge_version="v1",
            verdict=1,
            outcome=1,
            verdict_id="p",
            outcome_id="o",
            agree=8,
            disagree=n,
            abstain=0,
            consistency=9 / (10 + n),
            recent_agree=8,
            recent_disagree=n,
            recent_consistency=9 / (10 + n),
            window=20,
            excluded=excluded,
        )

    assert live.excluded("llm", "v1") is False  # nothing read: not excluded
    live.apply(ev(0, False))
    row = live.row("llm", "v1")
    assert row is not None and row.weight == pytest.approx(2.1972, abs=1e-4)  # log 9
    live.apply(ev(1, True))
    row = live.row("llm", "v1")
    assert live.excluded("llm", "v1") and row is not None and row.weight == 0.0
    assert row.recent == pytest.approx(9 / 11) and row.decided == 9
    live.apply(ev(2, False))
    assert not live.excluded("llm", "v1")
