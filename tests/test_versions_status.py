"""``liverl status``'s per-policy lines (pipeline/versions/status.py): the version that serves
by the folded log (pin, withdrawn versions), and the trainer's state from its newest
trainer_status event; over hand-built events. The command itself reads them from the broker
(tests/test_trainer_follow_broker.py produces both kinds)."""

from __future__ import annotations

from typing import Any

from pipeline import events
from pipeline.versions.status import newest_by_policy, policy_lines, serving_line, trainer_line
from pipeline.versions.table import VersionLog

from .test_versions import POLICY, act, promoted, weights

NOW = 1_800_000_000_000
TRAINER = events.Producer(component="trainer", version="test")


def status(state: str, **kw: Any) -> events.TrainerStatus:
    base: dict[str, Any] = dict(
        event_id=f"s-{state}",
        ts_ms=NOW - 4_000,
        producer=TRAINER,
        policy_id=POLICY,
        state=state,
        version=3,
        step=40,
        samples=120,
    )
    return events.TrainerStatus(**{**base, **kw})


def folded(*evs: events.WeightsPublished) -> VersionLog:
    log = VersionLog(POLICY)
    for ev in evs:
        log.add(ev)
    return log


def test_the_serving_version_comes_from_the_fold_not_the_newest_event() -> None:
    log = folded(*promoted(1, 2, 3), weights(4))
    assert serving_line(log, True) == "policy p: v3 serves (newest v4 (candidate))"
    assert serving_line(log, False) == "policy p: v4 serves"
    act(log, "rollback", 1, by="alice")
    # v2..v4 withdrawn: v1 serves although v4 is the newest weights event
    assert serving_line(log, True) == (
        "policy p: v1 serves (withdrawn v2, v3, v4; newest v4 "
        "(candidate); last action rollback v1 by alice)"
    )
    act(log, "pin", 1, by="bob")
    assert serving_line(log, True).startswith("policy p: v1 serves (pinned by bob; withdrawn")


def test_nothing_published_serves_the_base() -> None:
    assert serving_line(VersionLog(POLICY), True) == "policy p: the base model serves"


def test_trainer_states_by_hand() -> None:
    training = status("training", last_step_ms=NOW - 3_000, loss=0.125)
    assert trainer_line(training, NOW) == (
        "  trainer: training on v3, step 40, last step 3 s "
        "ago, loss 0.1250, 120 samples since start "
        "(heard 4 s ago)"
    )
    # judging since 150 s before now: 2.5 min rounds to 2 (format .0f of 2.5 -> "2")
    judging = status(
        "judging",
        judging_version=4,
        judging_since_ms=NOW - 150_000,
        prompts_done=14,
        prompts_total=36,
        eta_s=40.4,
    )
    line = trainer_line(judging, NOW)
    assert line.startswith("  trainer: judging v4 since ")
    assert line.endswith("(2 min ago), prompt 14 of 36, ETA 40 s; on v3, step 40 (heard 4 s ago)")
    paused = status("paused", pinned_version=2)
    assert trainer_line(paused, NOW) == (
        "  trainer: paused while v2 is pinned; on v3, step 40 (heard 4 s ago)"
    )
    assert trainer_line(status("stopped", ts_ms=NOW - 3 * 3600_000), NOW) == (
        "  trainer: stopped at v3, step 40, 120 samples trained (heard 3.0 h ago)"
    )
    assert "no status yet" in trainer_line(None, NOW)


def test_policy_lines_carry_the_trainers_last_word() -> None:
    log = folded(*promoted(1, 2))
    detail = "v1 serves after rollback by alice: training goes on from v1"
    lines = policy_lines(log, status("training", detail=detail), require_promoted=True, now_ms=NOW)
    assert lines[0] == "policy p: v2 serves"
    assert lines[-1] == f"    {detail}"
    assert len(lines) == 3  # serving, trainer, its detail: no canary line yet


def test_newest_status_per_policy_in_log_order() -> None:
    a1, b1 = status("training"), status("judging", policy_id="q", event_id="q1")
    a2 = status("paused", event_id="a2", ts_ms=NOW - 10_000)  # an older clock, later in log
    got = newest_by_policy([a1, b1, a2])
    assert got == {"p": a2, "q": b1}


def test_a_running_canary_gets_its_line_with_the_deciders_figures() -> None:
    import dataclasses

    from pipeline.versions.status import canary_line

    def canary(v: int) -> list[events.WeightsPublished]:
        verdict = dataclasses.replace(weights(v, "promoted", ts=NOW - 120_000), canary_share=0.1)
        return [weights(v), verdict]

    log = folded(*promoted(1), *canary(2), *canary(3))
    assert canary_line(folded(*promoted(1, 2)), True, NOW) is None  # no canary, no line
    # v2 became servable (its promoted verdict) 2 minutes before NOW; v3 waits behind it
    line = canary_line(log, True, NOW)
    assert line is not None and line.startswith("  canary: v2 at 10% of users since ")
    assert line.endswith("(2 min ago); waiting behind it: v3")
    figures = {
        "canary_sessions": 7,
        "canary_passed": 3,
        "canary_rate": 3 / 7,
        "stable_sessions": 35,
        "stable_passed": 20,
        "stable_rate": 20 / 35,
        "p_worse": 0.6123,
        "rule": "min_sessions",
    }
    line = canary_line(log, True, NOW, figures)
    assert line is not None and line.endswith(
        "sessions with outcomes: canary 3/7 (43%), stable 20/35 (57%), P(canary worse) 0.61, "
        "min_sessions"
    )
    lines = policy_lines(log, None, require_promoted=True, now_ms=NOW, canary=figures)
    assert lines[0] == "policy p: v1 serves (newest v3 (promoted))"  # the stable arm
    assert lines[1] == line
