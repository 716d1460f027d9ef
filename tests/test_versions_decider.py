"""The canary runner's decisions over hand-built logs (pipeline/versions/decider.py,
runner.py): which arm is judged, the decision event and its id, FIFO canaries, the watch,
and a restart that sends nothing twice. No broker: the runner reads fake records and sends
to a fake producer. The logs use the canary interface of issue 39 (``canary_share`` on the
servable event, ``rollout``/``withdraw`` actions, ``VersionLog.canary``)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from pipeline import events
from pipeline.events.examples import examples
from pipeline.kafka import names
from pipeline.settings import Settings
from pipeline.versions.config import CanarySettings
from pipeline.versions.decider import Decider, arms, decision_event, decision_id
from pipeline.versions.metrics import DecisionMetrics
from pipeline.versions.runner import CanaryRunner

from .test_versions import weights

POLICY = "p"
CFG = CanarySettings(min_sessions=10, max_sessions=100, watch_min_sessions=10, watch_window=20)


def servable(
    version: int,
    share: float | None = 0.1,
    *,
    policy: str = POLICY,
    ts: int | None = None,
    parent: int | None = None,
) -> list[events.WeightsPublished]:
    """A version's candidate, then the gate's promotion carrying ``canary_share`` (the
    interface: the event that makes it servable)."""
    promoted = weights(version, "promoted", policy=policy, ts=ts, parent=parent)
    if share is not None:
        promoted = dataclasses.replace(promoted, canary_share=share)  # type: ignore[call-arg]
    return [weights(version, policy=policy, ts=ts, parent=parent), promoted]


def decider(*evs: events.WeightsPublished, cfg: CanarySettings = CFG) -> Decider:
    d = Decider(POLICY, cfg, require_promoted=True)
    for ev in evs:
        d.add_weights(ev)
    return d


def sessions(
    d: Decider, version: int, passed: int, failed: int, *, ts: int = 10_000, tag: str = ""
) -> None:
    for i in range(passed + failed):
        d.add_sample(version, f"v{version}{tag}-s{i}", 1.0 if i < passed else -1.0, ts + i)


def test_a_canary_that_fails_its_users_is_withdrawn_with_its_figures() -> None:
    d = decider(*servable(1, None), *servable(2))
    assert arms(d.log, True) == (1, (2, 0.1))
    sessions(d, 1, 0, 50, ts=0, tag="old")  # before the canary: not the same period
    sessions(d, 1, 18, 2)
    sessions(d, 2, 4, 5, ts=10_000)
    step = d.evaluate()
    assert (step.mode, step.version, step.reference, step.share) == ("canary", 2, 1, 0.1)
    assert step.verdict is not None and step.verdict.kind == "wait"  # 9 < 10 canary sessions
    # the stable arm counts its sessions since the canary became servable (v2's promoted
    # verdict at ts 2,000): 18/20, not 18/70
    assert (step.verdict.figures["stable_sessions"], step.verdict.figures["since_ms"]) == (
        20,
        2_000,
    )
    d.add_sample(2, "v2-s9", -1.0, 10_009)  # 4/10 against 18/20
    step = d.evaluate(ts_ms=5)
    assert step.verdict is not None and step.verdict.kind == "withdraw"
    ev = step.event
    assert ev is not None and ev.action is not None
    assert (ev.version, ev.action["kind"], ev.action["by"], ev.ts_ms) == (
        2,
        "withdraw",
        "canary",
        5,
    )
    f = ev.action["figures"]
    assert (
        f["canary_sessions"],
        f["canary_passed"],
        f["stable_sessions"],
        f["stable_passed"],
        f["canary_version"],
        f["stable_version"],
        f["canary_share"],
    ) == (10, 4, 20, 18, 2, 1, 0.1)
    assert f["p_worse"] >= CFG.withdraw_probability and f["rule"] == "withdraw_probability"
    assert ev.parents == [d.log.manifests[2].event_id] and ev.files == d.log.manifests[2].files
    assert events.decode(events.encode(ev, validate=True)) == ev  # the schema takes it
    d.add_weights(ev)
    assert arms(d.log, True) == (1, None) and 2 in d.log.withdrawn
    assert d.evaluate().mode == "watch"  # no canary left: the watch judges v1


def test_a_good_canary_is_rolled_out_and_the_next_pending_version_follows() -> None:
    """FIFO: v3 waits while v2 is the canary; v2's rollout makes v3 the canary."""
    d = decider(*servable(1, None), *servable(2), *servable(3, 0.2))
    assert arms(d.log, True) == (1, (2, 0.1))
    sessions(d, 1, 10, 10)
    sessions(d, 2, 48, 2)  # 96 % against 50 %
    step = d.evaluate()
    assert step.event is not None and step.event.action is not None
    assert step.event.action["kind"] == "rollout" and step.event.version == 2
    d.add_weights(step.event)
    assert arms(d.log, True) == (2, (3, 0.2))
    step = d.evaluate()  # v3 has no session yet, v2 is its reference now
    assert (step.mode, step.version, step.reference) == ("canary", 3, 2)
    assert step.verdict is not None and step.verdict.kind == "wait" and step.event is None


def test_withdrawing_the_canary_withdraws_the_versions_queued_behind_it() -> None:
    d = decider(*servable(1, None), *servable(2), *servable(3))
    sessions(d, 1, 20, 0)
    sessions(d, 2, 0, 20)
    step = d.evaluate()
    assert step.event is not None
    d.add_weights(step.event)
    assert arms(d.log, True) == (1, None) and {2, 3} <= d.log.withdrawn


def test_the_base_model_is_the_stable_arm_before_any_version_serves() -> None:
    d = decider(*servable(1))
    sessions(d, 0, 10, 10)  # the base's samples carry behavior_weight_version 0
    sessions(d, 1, 9, 1)
    step = d.evaluate()
    assert (step.mode, step.reference) == ("canary", 0)
    assert step.verdict is not None and step.verdict.figures["stable_sessions"] == 20


def test_a_decision_is_one_id_per_version_whenever_it_is_reached() -> None:
    """A restarted decider may decide at another session count (or even otherwise): the id
    is the same, so readers count it once; fed the log with the decision, it sends nothing."""
    first = decider(*servable(1, None), *servable(2))
    sessions(first, 1, 20, 0)
    sessions(first, 2, 2, 8)
    ev = first.evaluate().event
    later = decider(*servable(1, None), *servable(2))
    sessions(later, 1, 20, 0)
    sessions(later, 2, 2, 30)
    again = later.evaluate().event
    assert ev is not None and again is not None and ev.event_id == again.event_id
    assert ev.event_id == decision_id(POLICY, 2, "canary", [later.log.manifests[2].event_id])
    restarted = decider(*servable(1, None), *servable(2), ev)
    sessions(restarted, 1, 20, 0)
    sessions(restarted, 2, 2, 8)
    step = restarted.evaluate()
    assert step.event is None and step.mode == "watch"
    # the watch's decision on the same version is another decider's: another id
    watch_ev = decision_event(first.log, "withdraw", 2, by="watch", reason="r", figures={})
    assert watch_ev.event_id != ev.event_id


def test_an_operator_promote_of_a_pending_version_ends_its_canary() -> None:
    from pipeline.versions import actions

    d = decider(*servable(1, None), *servable(2))
    ev = actions.action_event(d.log, "promote", 2, by="alice", reason=None, require_promoted=True)
    assert ev is not None
    d.add_weights(ev)
    assert arms(d.log, True) == (2, None)


def test_the_watch_withdraws_a_serving_version_that_drops_against_its_parent() -> None:
    d = decider(*servable(1, None), *servable(2, None))  # v2 served at once (no canary)
    sessions(d, 1, 18, 2)
    sessions(d, 2, 3, 7)  # 10 sessions (watch_min_sessions): 30 % against 90 %
    step = d.evaluate()
    assert (step.mode, step.version, step.reference) == ("watch", 2, 1)
    assert step.event is not None and step.event.action is not None
    assert (step.event.action["kind"], step.event.action["by"]) == ("withdraw", "watch")
    assert step.event.action["figures"]["p_drop"] >= CFG.watch_probability
    d.add_weights(step.event)
    assert arms(d.log, True) == (1, None)


def test_with_alert_the_watch_reports_a_drop_once_and_sends_nothing() -> None:
    d = decider(
        *servable(1, None), *servable(2, None), cfg=CFG.model_copy(update={"watch_action": "alert"})
    )
    sessions(d, 1, 18, 2)
    sessions(d, 2, 3, 7)
    first, second = d.evaluate(), d.evaluate()
    assert (first.alert, first.event) == (True, None)
    assert (second.alert, second.event) == (False, None)
    assert second.verdict is not None and second.verdict.kind == "withdraw"


def test_nothing_is_decided_while_pinned_or_with_the_base_alone() -> None:
    from pipeline.versions import actions

    assert decider().evaluate().mode == "idle"
    d = decider(*servable(1, None), *servable(2))
    pin = actions.action_event(d.log, "pin", 1, by="alice", reason=None, require_promoted=True)
    assert pin is not None
    d.add_weights(pin)
    sessions(d, 1, 20, 0)
    sessions(d, 2, 0, 20)
    step = d.evaluate()
    assert (step.mode, step.version, step.event) == ("pinned", 1, None)


# ---- the runner, with fake records and a fake producer --------------------------------------


class Record:
    def __init__(self, topic: str, value: bytes) -> None:
        self._topic, self._value = topic, value

    def topic(self) -> str:
        return self._topic

    def value(self) -> bytes:
        return self._value


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, events.WeightsPublished, str]] = []

    def send(self, topic: str, ev: events.WeightsPublished, key: str) -> None:
        self.sent.append((topic, ev, key))

    def flush(self) -> None:
        pass


SAMPLE: events.Sample = examples()["sample"]  # type: ignore[assignment]


def sample(
    version: int,
    session: str,
    outcome: float | None,
    ts: int,
    policy: str = POLICY,
    reward: float = 0.0,
    penalty: float = 0.0,
    normalized: bool = False,
    turn: int = 0,
) -> events.Sample:
    """A sample whose judged score (reward - penalty) is 0 unless given: only its verified
    outcome counts then."""
    return dataclasses.replace(
        SAMPLE,
        event_id=f"{session}-{version}-{ts}",
        policy_id=policy,
        session_id=session,
        behavior_weight_version=version,
        outcome=outcome,
        ts_ms=ts,
        reward=reward,
        penalty=penalty,
        normalized=normalized,
        turn=turn,
    )


def runner(cfg: CanarySettings = CFG) -> tuple[CanaryRunner, FakeProducer, CollectorRegistry]:
    registry = CollectorRegistry()
    r = CanaryRunner(
        Settings(), cfg, policy_id=POLICY, require_promoted=True, metrics=DecisionMetrics(registry)
    )
    fake = FakeProducer()
    r._producer = fake
    return r, fake, registry


def feed(r: CanaryRunner, *evs: events.Event) -> int:
    topic = {"weights": names.WEIGHTS, "sample": names.SAMPLES}
    return sum(r.handle(Record(topic[ev.type], events.encode(ev))) for ev in evs)


def test_the_runner_sends_one_decision_and_serves_its_figures_as_metrics(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r, fake, reg = runner()
    assert feed(r, *servable(1, None), *servable(2, 0.25)) == 4
    stable = [sample(1, f"a{i}", 1.0 if i % 2 else -1.0, 10_000 + i) for i in range(20)]
    other = sample(2, "x", 1.0, 10_000, policy="q")  # another policy's: not counted
    # c0: no verified outcome and a neutral judged score: nothing to count
    assert feed(r, *stable, other, sample(2, "c0", None, 10_000)) == 20
    with caplog.at_level(logging.INFO, logger="pipeline.versions.runner"):
        steps = r.evaluate()
    assert [s.verdict.kind for s in steps if s.verdict] == ["wait"] and fake.sent == []
    assert "canary v2 of p: wait" in caplog.text
    assert reg.get_sample_value("liverl_canary_share", {"policy": POLICY}) == 0.25
    assert reg.get_sample_value("liverl_canary_version", {"policy": POLICY}) == 2
    # the stable arm counts from v2's promoted verdict (ts 2,000): all 20, before any canary
    # session
    assert reg.get_sample_value("liverl_canary_sessions", {"policy": POLICY, "arm": "stable"}) == 20
    # the canary's 12 sessions, all failed, against the stable arm's 20 (10 passed)
    feed(r, *[sample(2, f"c{i}", -1.0, 10_010 + i) for i in range(12)])
    steps = r.evaluate()
    assert [s.mode for s in steps] == ["canary"]  # decided and sent, not folded yet
    ((topic, ev, key),) = fake.sent
    assert [s.event for s in r.evaluate()] == [None]  # not sent twice before it is read back
    feed(r, ev)  # read back from the topic: folded in log order, then the watch on v1
    assert [s.mode for s in r.evaluate()] == ["watch"]
    assert (topic, key, ev.version) == (names.WEIGHTS, POLICY, 2)
    assert ev.action is not None and ev.action["kind"] == "withdraw"
    assert (ev.action["figures"]["stable_sessions"], ev.action["figures"]["stable_passed"]) == (
        20,
        10,
    )
    assert r.sent == [ev]
    assert (
        reg.get_sample_value(
            "liverl_canary_decisions_total", {"policy": POLICY, "kind": "withdraw"}
        )
        == 1
    )
    assert (
        reg.get_sample_value("liverl_canary_decisions_total", {"policy": POLICY, "kind": "wait"})
        == 1
    )
    assert reg.get_sample_value("liverl_canary_share", {"policy": POLICY}) == 0
    assert r.evaluate() and len(fake.sent) == 1  # nothing more to decide
    # a restart folds the log with the decision in it and sends nothing
    again, fake2, _ = runner()
    feed(
        again,
        *servable(1, None),
        *servable(2, 0.25),
        ev,
        *stable,
        *[sample(2, f"c{i}", -1.0, 10_010 + i) for i in range(12)],
    )
    again.evaluate()
    assert fake2.sent == []


def test_the_runner_counts_watch_withdrawals_and_alerts(caplog: pytest.LogCaptureFixture) -> None:
    for action in ("withdraw", "alert"):
        r, fake, reg = runner(CFG.model_copy(update={"watch_action": action}))
        feed(
            r,
            *servable(1, None),
            *servable(2, None),
            *[sample(1, f"a{i}", 1.0, 1_000 + i) for i in range(10)],
            *[sample(2, f"b{i}", -1.0, 2_000 + i) for i in range(10)],
        )
        with caplog.at_level(logging.WARNING, logger="pipeline.versions.runner"):
            r.evaluate()
            for _topic, ev, _key in fake.sent:  # the decision, read back from the topic
                feed(r, ev)
            r.evaluate()
        labels = {"policy": POLICY}
        assert reg.get_sample_value("liverl_watch_withdrawals_total", labels) == (
            1 if action == "withdraw" else None
        )
        assert reg.get_sample_value("liverl_watch_alerts_total", labels) == (
            1 if action == "alert" else None
        )
        assert len(fake.sent) == (1 if action == "withdraw" else 0)
        # alert: v2 still serves (0 of 10) against v1 (10 of 10); withdraw: v1 serves now,
        # judged against the base, which has no session (NaN)
        rates = [
            reg.get_sample_value("liverl_watch_outcome_rate", {"policy": POLICY, "side": side})
            for side in ("serving", "parent")
        ]
        assert rates == [0.0, 1.0] if action == "alert" else rates[0] == 1.0 and rates[1] != 1.0
    assert "alert only" in caplog.text and "watch withdraw v2" in caplog.text


def test_the_canary_command_refuses_bad_settings_with_exit_2() -> None:
    from pipeline.versions.commands import versions

    obj = {"settings": Settings()}
    out = CliRunner().invoke(versions, ["canary", "--metrics-port", "70000"], obj=obj)
    assert out.exit_code == 2 and "70000" in out.output
    out = CliRunner().invoke(versions, ["canary", "--watch-action", "page"], obj=obj)
    assert out.exit_code == 2 and "page" in out.output
    out = CliRunner().invoke(versions, ["canary", "--metrics-host", ""], obj=obj)
    assert out.exit_code == 2 and "at least 1 character" in out.output  # the model's check


def test_up_starts_the_canary_command_unless_left_out() -> None:
    from pipeline import stack
    from pipeline.cli import cli, up

    args = stack.canary_component("pol").args
    group = cli.commands[args[0]]
    command = group.commands[args[1]]  # type: ignore[attr-defined]
    ctx = command.make_context("canary", args[2:])
    assert ctx.params["policy"] == "pol"
    without = next(p for p in up.params if p.name == "without")
    assert "canary" in without.type.choices  # type: ignore[attr-defined]


def test_a_session_without_a_verified_outcome_counts_by_its_judged_turns() -> None:
    """Chat-only traffic still compares arms: a session's outcome is its verified one, else
    the mean of its turns' judged scores (reward - penalty, unnormalised rewards only)."""
    r, _fake, _reg = runner()
    feed(r, *servable(1, None))
    evs = [
        # verified wins over the judged turns: +1 although the turns read 0.9 - 1.0 = -0.1
        sample(1, "v", None, 1, reward=0.9, penalty=1.0),
        sample(1, "v", 1.0, 2),
        # judged only: (0.5 + (-0.2)) / 2 = 0.15 > 0, passed
        sample(1, "j", None, 3, reward=0.5),
        sample(1, "j", None, 4, reward=-0.2, turn=1),
        # judged only: 0.3 - 0.7 = -0.4, failed
        sample(1, "f", None, 5, reward=0.3, penalty=0.7),
        # a neutral session (mean 0) and a normalised advantage: no outcome
        sample(1, "n", None, 6, reward=0.0),
        sample(1, "z", None, 7, reward=2.0, normalized=True),
    ]
    feed(r, *evs)
    book = r.decider.book
    # (first counted sample's time, outcome)
    assert {sid: (t, round(o, 9)) for sid, (t, o) in book.by_version[1].items()} == {
        "v": (1, 1.0),
        "j": (3, 0.15),
        "f": (5, -0.4),
    }
    rate = book.rate(1)
    assert (rate.passed, rate.total) == (2, 3)  # v and j passed, f failed
    # a sample read twice (the catch-up overlapping the follow) counts its turn once: j's
    # turn 1 again leaves the mean at 0.15, where counting it twice gave (0.5 - 0.4) / 3
    feed(r, sample(1, "j", None, 4, reward=-0.2, turn=1))
    assert round(book.by_version[1]["j"][1], 9) == 0.15


def test_sessions_served_while_the_canary_was_pinned_belong_to_no_arm() -> None:
    from pipeline.versions import actions as A
    from pipeline.versions.decider import pinned_periods

    d = decider(*servable(1, None), *servable(2))
    sessions(d, 2, 3, 0, ts=10_000)  # the canary's own 3 sessions
    sessions(d, 1, 20, 7, ts=10_000, tag="s")  # the stable arm's 27
    for kind, asked, ts in (("pin", 2, 20_000), ("unpin", None, 30_000)):
        ev = A.action_event(
            d.log, kind, asked, by="op", reason=None, require_promoted=True, ts_ms=ts
        )
        assert ev is not None
        d.add_weights(ev)
    assert pinned_periods(d.log) == [(20_000, 30_000)]
    # while pinned every user met v2: 400 sessions tagged v2 between 20,000 and 29,999
    for i in range(400):
        d.add_sample(2, f"pinned-{i}", 1.0, 20_000 + i * 20)
    step = d.evaluate()
    assert step.verdict is not None
    f = step.verdict.figures
    # 3 canary sessions, not 403 (which reached max_sessions 100 and rolled it out at once)
    assert (f["canary_sessions"], f["stable_sessions"], step.verdict.kind) == (3, 27, "wait")
    d.add_sample(2, "after", 1.0, 30_000)  # after the unpin: the canary's again
    assert d.evaluate().verdict.figures["canary_sessions"] == 4  # type: ignore[union-attr]


def test_the_book_forgets_versions_no_evaluation_looks_at_again() -> None:
    d = decider(
        *servable(1, None), *servable(2, None), *servable(3, None), *servable(4), *servable(5)
    )
    for v in (1, 2, 3, 4, 5, 9):  # 9: its samples came before its weights event
        sessions(d, v, 2, 1, ts=10_000 * v)
    assert arms(d.log, True) == (3, (4, 0.1))
    # kept: the base (0), stable v3, its parent v2, the canary v4, v5 waiting, unannounced v9;
    # forgotten: v1's 3 sessions
    assert d.prune() == 3
    assert sorted(d.book.by_version) == [2, 3, 4, 5, 9]
    assert d.evaluate().mode == "canary" and d.prune() == 0
