"""Reward formula, masking with keep-at-least-one, z-scoring, and session assembly."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.events import PathPenalty, PrmScore, Producer, derive_event_id, examples
from pipeline.processors.commands import outcome_event
from pipeline.processors.rewards import (
    Assembler,
    mask_turns,
    reward_parts,
    zscore_by_group_step,
)

P = Producer(component="t", version="1")


def test_reward_formula_without_outcome():
    # R = prm + beta * Phi = -1 + 0.5 * (-0.3 + 0.1)
    assert reward_parts([-1], [-1, -1, None], None, 0.5, -0.2) == pytest.approx(
        (0.0, -1.0, -0.1, -1.1)
    )


def test_step_reward_with_outcome_uses_mean_of_votes():
    # r_step = outcome + mean(valid votes) + beta * Phi = 1 + (1 - 1 + 1) / 3 + 0.5 * 0.1
    assert reward_parts([1], [1, -1, 1, None], 1.0, 0.5, 0.1) == pytest.approx(
        (1.0, 1 / 3, 0.05, 1 + 1 / 3 + 0.05)
    )
    assert reward_parts([0], [None], -1.0, 0.5, 0.0) == (-1.0, 0.0, 0.0, -1.0)


def test_masking_keeps_at_least_one_sample_per_session():
    assert mask_turns({0: True, 1: False, 2: True}) == {0: False, 1: True, 2: False}
    assert mask_turns({0: False, 1: False, 2: False}) == {0: True, 1: True, 2: False}
    assert mask_turns({}) == {}


def sample(reward: float, group: str | None, step: int | None):  # type: ignore[no-untyped-def]
    return dataclasses.replace(
        examples.examples()["sample"], reward=reward, group_id=group, step_index=step
    )


def test_zscore_within_group_and_step():
    out = zscore_by_group_step(
        [
            sample(1.0, "g", 0),
            sample(3.0, "g", 0),
            sample(5.0, "g", 1),
            sample(7.0, None, 0),
            sample(2.0, "g", 1),
            sample(4.0, "h", 0),
        ]
    )
    # (g, 0): mean 2, std 1 -> -1, +1; (g, 1): mean 3.5, std 1.5 -> +1, -1; singletons unchanged
    assert [s.reward for s in out] == pytest.approx([-1.0, 1.0, 1.0, 7.0, -1.0, 4.0], abs=1e-5)


def inter(t: int, **kw):  # type: ignore[no-untyped-def]
    base = examples.interaction(prompt_tokens=3, response_tokens=2)
    return dataclasses.replace(base, event_id=f"i{t}", session_id="s", turn=t, **kw)


def ns(t: int, kind: str = "user_reply"):  # type: ignore[no-untyped-def]
    return dataclasses.replace(
        examples.examples()["next_state"], event_id=f"n{t}", session_id="s", turn=t, kind=kind
    )


def prm(t: int, score: int, votes: list[int | None]) -> PrmScore:
    return PrmScore(
        event_id=f"p{t}",
        producer=P,
        parents=[f"i{t}", f"n{t}"],
        session_id="s",
        turn=t,
        score=score,
        votes=votes,
        judge_id="j",
        judge_version="1",
    )  # type: ignore[arg-type]


def pen(t: int, phi: float) -> PathPenalty:
    return PathPenalty(
        event_id=f"x{t}",
        producer=P,
        parents=[f"i{t}"],
        session_id="s",
        turn=t,
        rule_ids=[],
        penalty=phi,
        compliance_bonus=0.0,
        beta=0.5,
    )


def feed(asm: Assembler, turns: list[tuple[int, list[int | None], float]], last_kind="session_end"):
    state = None
    for t, (score, votes, phi) in enumerate(turns):
        state = asm.on_interaction(state, inter(t))
        state = asm.on_next_state(
            state, ns(t, last_kind if t == len(turns) - 1 else "user_reply"), 0
        )
        state = asm.on_prm(state, prm(t, score, votes))
        state = asm.on_penalty(state, pen(t, phi))
    return state


def test_session_assembly_masks_zero_reward_turns():
    asm = Assembler()
    state = feed(asm, [(1, [1, 1, 0], 0.0), (0, [0, 1, -1], 0.0), (-1, [-1], 0.2)])
    assert asm.ready(state, 1)
    out = asm.complete(state, 1)
    assert [r.total for r in out.rewards] == pytest.approx([1.0, 0.0, -0.9])
    assert [(s.turn, s.masked, s.loss_mask, s.reward) for s in out.samples] == [
        (0, False, [1, 1], 1.0),
        (1, True, [0, 0], 0.0),
        (2, False, [1, 1], pytest.approx(-0.9)),
    ]
    r0 = out.rewards[0]
    assert r0.event_id == derive_event_id("reward", ["p0", "x0"], "reward-1")
    assert out.samples[0].parents == ["i0", r0.event_id]
    assert out.samples[0].behavior_logprobs == inter(0).response_logprobs
    assert out.samples[0].behavior_weight_version == 12
    assert not asm.ready(out.state, 2)  # done: never emitted twice


def test_all_zero_session_keeps_its_last_turn():
    asm = Assembler()
    out = asm.complete(feed(asm, [(0, [0], 0.0), (0, [None], 0.0)]), 1)
    assert [(s.turn, s.masked) for s in out.samples] == [(0, True), (1, False)]


def test_not_ready_until_every_turn_is_in_then_grace():
    asm = Assembler(grace_ms=1_000)
    state = asm.on_interaction(None, inter(0))
    state = asm.on_next_state(state, ns(1, "session_end"), now_ms=0)  # turn 1 not read yet
    assert not asm.ready(state, 10)
    assert asm.ready(state, 1_000)  # grace over: assemble what exists
    out = asm.complete(state, 1_000)
    assert [(s.turn, s.masked, s.reward) for s in out.samples] == [(0, False, 0.0)]


def test_session_outcome_applies_rlanything_step_reward():
    asm = Assembler(outcome_wait_ms=5_000)
    state = feed(asm, [(1, [1, 1, -1], 0.0), (0, [0, None, None], 0.0)])
    assert not asm.ready(state, 10)  # waiting for the quality gate
    state = asm.on_next_state(state, outcome_event("s", False, ts_ms=5), 10)
    assert asm.ready(state, 11)
    out = asm.complete(state, 11)
    # turn 0: -1 + (1 + 1 - 1) / 3; turn 1: -1 + 0
    got = [x for r in out.rewards for x in (r.outcome, r.prm, r.total)]
    assert got == pytest.approx([-1.0, 1 / 3, -2 / 3, -1.0, 0.0, -1.0])


def test_record_outcome_event():
    ev = outcome_event("s", True, detail="ci green", ts_ms=1)
    assert (ev.kind, ev.exit_code, ev.score, ev.content, ev.turn) == (
        "test_result",
        0,
        1.0,
        "ci green",
        0,
    )
    assert (ev.scope, ev.detail) == ("session", {"passed": True})
    assert outcome_event("s", False, turn=3).scope == "turn"


def test_session_outcome_is_recognised_by_scope_and_legacy_detail():
    from pipeline.processors.rewards import is_session_outcome

    base = examples.examples()["next_state"]
    assert is_session_outcome(outcome_event("s", True))
    assert not is_session_outcome(outcome_event("s", True, turn=0))  # a turn-0 outcome
    # written before the scope field existed: detail.scope, outcome kinds only
    legacy = dataclasses.replace(base, kind="test_result", detail={"scope": "session"})
    assert is_session_outcome(legacy)
    assert not is_session_outcome(dataclasses.replace(legacy, kind="user_reply"))
    assert not is_session_outcome(base)


def test_turn_scoped_outcome_on_turn_0_is_judged_as_that_turn():
    asm = Assembler()
    state = feed(asm, [(1, [1], 0.0)])
    state = asm.on_next_state(state, outcome_event("s", False, turn=0, ts_ms=5), 10)
    assert "outcome" not in state  # not taken for the session's outcome
    assert len(state["turns"]["0"]["next_states"]) == 2
