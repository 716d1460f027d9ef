"""The trainer's visible progress (pipeline/trainer/progress.py, metrics.py): a line per step,
the gate's "prompt i of n, ETA" at most every progress_every_s, the verdict with its reasons,
trainer_status events at each change of state, and the Prometheus metrics."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from pipeline import events
from pipeline.trainer.gate import verdict_line
from pipeline.trainer.metrics import TrainerMetrics
from pipeline.trainer.progress import Progress, eta_s


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def progress(clock: Clock, **kw: Any) -> tuple[Progress, list[str], list[events.TrainerStatus]]:
    lines: list[str] = []
    sent: list[events.TrainerStatus] = []
    p = Progress(
        "p",
        echo=lines.append,
        emit=sent.append,
        every_s=10.0,
        clock=clock,
        wall_ms=lambda: int(clock.t * 1000),
        **kw,
    )
    return p, lines, sent


def test_eta_by_hand() -> None:
    # 5 of 20 answered in 30 s: 6 s each, 15 left -> 90 s
    assert eta_s(30.0, 5, 20) == pytest.approx(90.0)
    assert eta_s(30.0, 0, 20) is None
    assert eta_s(30.0, 20, 20) == 0.0


@given(
    elapsed=st.one_of(st.just(0.0), st.floats(1e-3, 1e5)),
    done=st.integers(1, 500),
    extra=st.integers(0, 500),
)
def test_eta_is_never_negative_and_zero_when_done(elapsed: float, done: int, extra: int) -> None:
    eta = eta_s(elapsed, done, done + extra)
    assert eta is not None and eta >= 0.0
    assert (eta == 0.0) == (extra == 0 or elapsed == 0.0)


def test_each_step_is_a_line_and_events_are_rate_limited() -> None:
    clock = Clock()
    p, lines, sent = progress(clock)
    p.held(3, 40, announce=True)
    assert [(e.state, e.version, e.step) for e in sent] == [("training", 3, 40)]
    p.stepped(step=41, samples=8, loss=0.25, seconds=0.5, version=3)
    clock.t += 4.0
    p.stepped(step=42, samples=6, loss=0.125, seconds=0.75, version=3)
    assert lines == [
        "step 41: loss 0.2500, 8 samples, 0.50 s (on v3)",
        "step 42: loss 0.1250, 6 samples, 0.75 s (on v3)",
    ]
    assert len(sent) == 1  # the announcement 4 s ago: no event yet
    clock.t += 6.0  # 10 s since it
    p.stepped(step=43, samples=2, loss=0.5, seconds=0.25, version=3)
    assert len(sent) == 2
    ev = sent[-1]
    # 8 + 6 + 2 samples; the last step ended at t = 110 s
    assert (ev.step, ev.samples, ev.loss, ev.last_step_ms) == (43, 16, 0.5, 110_000)
    events.decode(events.encode(ev), expected_type="trainer_status")  # valid on the wire


def test_gate_progress_at_most_every_ten_seconds_then_the_verdict() -> None:
    clock = Clock()
    p, lines, sent = progress(clock)
    p.judging(5)
    assert lines[-1].startswith("gate v5: judging")
    assert sent[-1].state == "judging" and sent[-1].judging_since_ms == 100_000
    clock.t += 3.0
    p.answered(2, 12, "live")  # 3 s after the first line: not said
    clock.t += 9.0
    p.answered(4, 12, "candidate")  # 12 s in, 4 of 12: 3 s each, 8 left -> ETA 24 s
    assert lines[-1] == "gate v5: prompt 4 of 12 (candidate), ETA 24 s"
    assert (sent[-1].prompts_done, sent[-1].prompts_total, sent[-1].eta_s) == (4, 12, 24.0)
    n = len(lines)
    clock.t += 5.0
    p.answered(6, 12, "candidate")
    assert len(lines) == n  # 5 s after the last line
    verdict = {
        "status": "rejected",
        "metrics": {
            "gate_live_version": 4,
            "gate_won": 1,
            "gate_lost": 9,
            "gate_tied": 2,
            "gate_prompts": 12,
            "gate_probe_correct": 5,
            "gate_probe_n": 8,
            "gate_live_probe_correct": 7,
            "gate_fluency": -1.5,
            "gate_live_fluency": -1.25,
            "gate_eval_s": 20.0,
            "gate_reasons": ["live preferred on 9 of 12 prompts (candidate on 1)"],
        },
    }
    p.judged(5, verdict, None)
    assert lines[-1] == (
        "gate v5: rejected against live v4 (1 won, 9 lost, 2 tied of 12 prompts; probe 5/8 "
        "vs 7; fluency -1.50 vs -1.25) in 20.00 s: live preferred on 9 of 12 prompts "
        "(candidate on 1)"
    )
    last = sent[-1]
    assert last.state == "training" and last.judging_version is None
    assert last.detail == lines[-1]


def test_no_verdict_says_why() -> None:
    p, lines, _ = progress(Clock())
    p.judging(2)
    p.judged(2, None, "1 held-out prompt(s), fewer than gate_min_samples (2)")
    assert lines[-1] == (
        "gate v2: no verdict: 1 held-out prompt(s), fewer than gate_min_samples (2)"
    )


def test_no_decision_reason_in_the_verdict_line() -> None:
    line = verdict_line(
        3,
        {
            "status": "candidate",
            "metrics": {
                "gate_no_decision": "1 of 12 prompts decided, fewer than 6 (gate_min_decided)"
            },
        },
    )
    assert line.startswith("gate v3: candidate against live v0 (0 won")
    assert line.endswith(": 1 of 12 prompts decided, fewer than 6 (gate_min_decided)")


def test_pause_and_resume_are_events_with_the_pin() -> None:
    p, lines, sent = progress(Clock())
    p.paused(2, "p pinned at v2 after pin by alice: training paused")
    assert (sent[-1].state, sent[-1].pinned_version) == ("paused", 2)
    p.resumed("p unpinned: v4 serves; training resumes")
    assert (sent[-1].state, sent[-1].pinned_version) == ("training", None)
    assert lines == [
        "p pinned at v2 after pin by alice: training paused",
        "p unpinned: v4 serves; training resumes",
    ]


def test_a_failed_send_never_stops_the_trainer() -> None:
    def broken(_ev: events.TrainerStatus) -> None:
        raise BufferError("queue full")

    p = Progress("p", echo=lambda _l: None, emit=broken)
    p.held(1, 1, announce=True)  # logged, not raised
    assert p.state == "training"


def test_metrics_follow_the_state() -> None:
    clock = Clock()
    m = TrainerMetrics("p")
    p, _, _ = progress(clock, metrics=m)
    p.held(3, 40, announce=True)
    p.stepped(step=41, samples=8, loss=0.25, seconds=0.5, version=3)
    p.judging(4)
    clock.t += 12.0
    p.answered(3, 12, "candidate")  # 4 s each, 9 left: ETA 36 s
    text = generate_latest(m.registry).decode()
    assert 'liverl_trainer_state{policy="p",state="judging"} 1.0' in text
    assert 'liverl_trainer_state{policy="p",state="training"} 0.0' in text
    assert 'liverl_trainer_samples_total{policy="p"} 8.0' in text
    assert 'liverl_trainer_gate_prompts_done{policy="p"} 3.0' in text
    assert 'liverl_trainer_gate_eta_seconds{policy="p"} 36.0' in text
    p.judged(4, {"status": "promoted", "metrics": {}}, None)
    p.paused(2, "paused")
    text = generate_latest(m.registry).decode()
    assert 'liverl_trainer_gate_verdicts_total{policy="p",status="promoted"} 1.0' in text
    assert 'liverl_trainer_follows_total{kind="pause",policy="p"} 1.0' in text
    assert 'liverl_trainer_gate_prompts_done{policy="p"} 0.0' in text
    assert 'liverl_trainer_version{policy="p"} 3.0' in text
