"""Reward formula, masking with keep-at-least-one, z-scoring, and session assembly."""

from __future__ import annotations

import copy
import dataclasses

import orjson
import pytest

from pipeline import events
from pipeline.events import (
    Hint,
    PathPenalty,
    PrmScore,
    Producer,
    derive_event_id,
    examples,
    json_default,
)
from pipeline.processors import grouping
from pipeline.processors.grouping import GroupIndex
from pipeline.processors.outcomes import outcome_event
from pipeline.processors.rewards import (
    Assembler,
    AssemblyState,
    AssemblyTurn,
    KeptInteraction,
    TokenPayload,
    mask_turns,
    reward_parts,
    token_payload,
    zscore_by_group_step,
)
from pipeline.processors.state_json import StateJson

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


def sample(reward: float, group: str | None, step: int | None, penalty: float = 0.0, **kw):  # type: ignore[no-untyped-def]
    fields = dict(
        response_token_ids=[1, 2, 3, 4],
        loss_mask=[1, 1, 1, 1],
        behavior_logprobs=[-1.0] * 4,
        hints=[],
        opd_mask=[0, 0, 0, 0],
    )
    fields.update(kw)
    return dataclasses.replace(
        examples.examples()["sample"],
        reward=reward,
        group_id=group,
        step_index=step,
        penalty=penalty,
        **fields,
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


def test_zscore_keeps_real_zeros_and_uses_the_population_std():
    out = zscore_by_group_step([sample(r, "g", 0) for r in (0.0, 0.0, 0.0, -2.0)])
    # mean −0.5; population std sqrt((3 · 0.25 + 2.25) / 4) = sqrt(0.75) = 0.866025
    # z = 0.5 / 0.866025 = 0.577350, −1.5 / 0.866025 = −1.732051
    assert [s.reward for s in out] == pytest.approx([0.57735, 0.57735, 0.57735, -1.73205], abs=1e-5)
    assert all(s.loss_mask == [1, 1, 1, 1] and not s.masked for s in out)


def test_tied_bucket_is_dropped_not_turned_into_plus_minus_one():
    # outcome + PRM tie at 1.0; only the path part differs (0 vs beta * mu = 0.01). Before, this
    # became ±0.9998; now the bucket carries no RL signal and leaves the RL term entirely.
    hinted = sample(1.01, "g", 0, penalty=0.01, hints=["run pytest"], opd_mask=[1, 1, 1, 1])
    plain = sample(1.0, "g", 0, hints=[], opd_mask=[0, 0, 0, 0])
    other = sample(-1.0, "g", 1)
    out = zscore_by_group_step([hinted, plain, other])
    assert [s.reward for s in out] == [1.01, 1.0, -1.0]  # unchanged: no z-score of a tie
    assert [s.loss_mask for s in out[:2]] == [[0, 0, 0, 0], [0, 0, 0, 0]]
    assert [s.masked for s in out[:2]] == [False, True]  # the hinted one still trains OPD
    assert out[0].opd_token_mask() == [1, 1, 1, 1]
    assert out[2] == other  # bucket of one


def test_path_part_is_added_after_normalisation_on_a_bounded_scale():
    # outcome+PRM parts 1 and −1 (reward − penalty) → z = ±1 (std 1, eps 1e-6 → ±0.999999).
    # A = z + 0.25 · |z| · clip(path / 0.5, −1, 1):
    #   violation −0.1 on the good one:  1 + 0.25 · (−0.2) = 0.95
    #   bonus +0.02 on the bad one:     −1 + 0.25 · 0.04   = −0.99
    out = zscore_by_group_step(
        [sample(0.9, "g", 0, penalty=-0.1), sample(-0.98, "g", 0, penalty=0.02)]
    )
    assert [s.reward for s in out] == pytest.approx([0.95, -0.99], abs=1e-5)
    assert [s.reward - s.penalty for s in out] == pytest.approx([1.0, -1.0], abs=1e-5)
    # a path part beyond its scale is clipped: at most a quarter of |z|, never a sign flip
    worst = zscore_by_group_step(
        [sample(-9.0, "g", 0, penalty=-10.0), sample(9.0, "g", 0, penalty=10.0)]
    )
    assert [s.reward for s in worst] == pytest.approx([0.75, -0.75], abs=1e-5)


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
    assert r0.event_id == derive_event_id("reward", ["p0", "x0"], "reward-3")
    assert out.samples[0].parents == ["i0", r0.event_id]
    assert out.samples[0].behavior_logprobs == inter(0).response_logprobs
    assert out.samples[0].behavior_weight_version == 12
    assert not asm.ready(out.state, 2)  # done: never emitted twice


def test_hinted_zero_score_turn_trains_opd_only():
    asm = Assembler()
    state = feed(asm, [(1, [1], 0.0), (0, [0, 0, 0], 0.0)])
    hint = Hint(
        event_id="h1",
        producer=P,
        parents=["i1", "n1"],
        session_id="s",
        turn=1,
        hint="run pytest first",
        judge_id="j",
        rank=0,
    )
    out = asm.complete(asm.on_hint(state, hint), 1)
    got = [(s.turn, s.masked, s.loss_mask, s.opd_mask, s.hints) for s in out.samples]
    assert got == [
        (0, False, [1, 1], [0, 0], []),
        # reward 0: no RL signal, but the hint still teaches (OpenClaw-RL's OPD-only sample)
        (1, False, [0, 0], [1, 1], ["run pytest first"]),
    ]
    assert out.samples[1].reward == 0.0 and not out.samples[1].rl_trainable()


def test_total_of_zero_with_an_outcome_is_a_value_not_masked():
    asm = Assembler()
    state = feed(asm, [(-1, [-1], 0.0), (1, [1], 0.0)])
    state = asm.on_next_state(state, outcome_event("s", True, ts_ms=5), 10)
    out = asm.complete(state, 11)
    # turn 0: 1 + (−1) = 0 is a real value once an outcome exists; turn 1: 1 + 1 = 2
    assert [(s.reward, s.masked, s.loss_mask) for s in out.samples] == [
        (0.0, False, [1, 1]),
        (2.0, False, [1, 1]),
    ]
    assert [s.penalty for s in out.samples] == [0.0, 0.0]


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
    # no verdict and no outcome: nothing is known of the turn, so it is not kept for RL
    assert [(s.turn, s.masked, s.reward) for s in out.samples] == [(0, True, 0.0)]


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
    assert state.outcome is None  # not taken for the session's outcome
    assert len(state.turns[0].next_states) == 2


def test_tokens_kept_apart_are_taken_from_the_mapping_and_a_missing_one_changes_nothing():
    asm = Assembler()
    kept = feed(asm, [(1, [1], 0.0), (-1, [-1], 0.0)])
    state = None
    for t, score in enumerate((1, -1)):
        state = asm.on_interaction(state, inter(t), keep_tokens=False)
        state = asm.on_next_state(state, ns(t, "session_end" if t else "user_reply"), 0)
        state = asm.on_prm(state, prm(t, score, [score]))
        state = asm.on_penalty(state, pen(t, 0.0))
    assert state.turns[0].interaction.tokens is None
    assert kept.turns[0].interaction.tokens == token_payload(inter(0))
    before = copy.deepcopy(state)
    with pytest.raises(KeyError, match="turn 1 of session s"):
        asm.complete(state, 1, {0: token_payload(inter(0))})
    assert state == before  # untouched: the worker retries on its next sweep
    out = asm.complete(state, 1, {t: token_payload(inter(t)) for t in (0, 1)})
    assert out.samples == asm.complete(kept, 1).samples
    assert out.state is state and state.done and state.turns == {}


def test_assembly_state_round_trips_through_pydantic_json():
    asm = Assembler()
    state = feed(asm, [(1, [1, None, -1], 0.2), (0, [0], -0.1)])
    state = asm.on_interaction(state, inter(2, group_id="g"))  # tokens kept in the state
    hint = Hint(
        event_id="h1",
        producer=P,
        parents=["i1", "n1"],
        session_id="s",
        turn=1,
        hint="run pytest first",
        judge_id="j",
        rank=0,
    )
    state = asm.on_hint(state, hint)
    state = asm.on_next_state(state, outcome_event("s", True, ts_ms=5), 10)
    state.turns[3] = AssemblyTurn(skip=True)
    assert state.outcome is not None and state.group_id == "g" and state.last_turn == 1
    assert state.turns[1].hints == {"h1": (0, "run pytest first")}
    tokens = state.turns[2].interaction.tokens
    assert isinstance(tokens, TokenPayload) and tokens.response_logprobs
    ta = StateJson(AssemblyState)  # what the worker stores it with
    back = ta.load(ta.dump(state))
    assert back == state
    assert isinstance(back.turns[1].hints["h1"], tuple) and list(back.turns) == [0, 1, 2, 3]
    assert isinstance(back.turns[2].interaction, KeptInteraction)
    assert ta.load(ta.dump(AssemblyState())) == AssemblyState()


def test_group_index_membership_and_round_trip():
    index, action = grouping.on_session(None, "s1", 100)
    assert (index, action) == (GroupIndex(first_ms=100, members=["s1"]), "hold")
    assert grouping.on_session(index, "s1", 150)[1] == "duplicate"
    index, action = grouping.on_session(index, "s2", 200)
    assert action == "hold" and index.members == ["s1", "s2"] and index.first_ms == 100
    assert not grouping.is_complete(index, 3, 200, 1_000)
    assert grouping.is_complete(index, 2, 200, 1_000)
    assert grouping.is_complete(index, 3, 1_100, 1_000)  # timed out with what it has
    index.done, index.touched_ms = True, 1_100
    assert not grouping.is_complete(index, 2, 1_100, 1_000)
    assert grouping.on_session(index, "s3", 1_200)[1] == "late"
    ta = StateJson(GroupIndex)
    assert ta.load(ta.dump(index)) == index


def outside_hint(turn: int, event_id: str, component: str = "person") -> Hint:
    return Hint(
        event_id=event_id,
        producer=Producer(component=component, version="1"),
        parents=[f"i{turn}"],
        session_id="s",
        turn=turn,
        hint=f"hint {event_id}",
        judge_id="j",
        rank=0,
    )


def test_hint_wait_holds_a_closed_session_for_outside_hints():
    asm = Assembler(hint_wait_ms=2_000)
    state = feed(asm, [(1, [1], 0.0), (0, [0], 0.0)])  # closed at 0, everything judged
    assert not asm.ready(state, 1_999)
    state = asm.on_hint(state, outside_hint(0, "h0"))
    assert asm.ready(state, 2_000)
    out = asm.complete(state, 2_000)
    assert [s.hints for s in out.samples] == [["hint h0"], []]
    assert Assembler().ready(feed(Assembler(), [(1, [1], 0.0)]), 0)  # no wait by default


@pytest.mark.parametrize("inline", [True, False])
def test_session_stage_applies_hints_and_reports_late_ones(inline: bool):
    from pipeline.processors.config import DEFAULT_RULES
    from pipeline.processors.judging import JUDGE_COMPONENT
    from pipeline.processors.pairing import Pairer
    from pipeline.processors.penalties import load_rules
    from pipeline.processors.session import SessionStage, SessionState

    asm = Assembler()
    stage = SessionStage(Pairer(load_rules(DEFAULT_RULES)), asm, judge_inline=inline)
    state = SessionState(assembly=feed(asm, [(1, [1], 0.0), (0, [0], 0.0)]))
    assert stage.on_hint(state, outside_hint(0, "h0")) == "applied"
    assert stage.on_hint(state, outside_hint(0, "h0")) is None  # read again: nothing new
    state.assembly = asm.complete(state.assembly, 1).state
    assert state.assembly.done
    assert stage.on_hint(state, outside_hint(1, "h1")) == "late"
    judges_own = outside_hint(1, "h2", component=JUDGE_COMPONENT)
    # The inline judge's hints were applied before assembly and come back afterwards; an
    # LLM judge's hints are only applied from the topic, so after assembly they are late.
    assert stage.on_hint(state, judges_own) == (None if inline else "late")


def test_hint_wait_counts_from_the_latest_verdict():
    """A judge agent's hints travel beside its verdict on another topic: the session waits
    ``hint_wait_ms`` after the last verdict, not only after the close."""
    asm = Assembler(hint_wait_ms=1_000)
    state = asm.on_interaction(None, inter(0))
    state = asm.on_next_state(state, ns(0, "session_end"), now_ms=0)
    state = asm.on_penalty(state, pen(0, 0.0))
    assert not asm.ready(state, 5_000)  # the verdict is missing
    state = asm.on_prm(state, prm(0, 1, [1]), now_ms=5_000)
    assert state.verdict_at_ms == 5_000
    assert not asm.ready(state, 5_999)
    state = asm.on_hint(state, outside_hint(0, "judge-hint", component="judge"))
    assert asm.ready(state, 6_000)
    assert asm.complete(state, 6_000).samples[0].hints == ["hint judge-hint"]


def test_hint_wait_defaults_by_judge_kind():
    from pipeline.processors.config import JUDGE_AGENT_HINT_WAIT_S, ProcessorSettings

    assert ProcessorSettings().hint_wait(judge_inline=True) == 0.0
    assert ProcessorSettings().hint_wait(judge_inline=False) == JUDGE_AGENT_HINT_WAIT_S
    assert ProcessorSettings(hint_wait_s=3).hint_wait(judge_inline=True) == 3.0
    with pytest.raises(ValueError, match="retain_s"):
        ProcessorSettings(idle_timeout_s=10, grace_s=0, hint_wait_s=100, retain_s=50)


def test_token_payload_table_value_round_trips_and_reads_the_older_json() -> None:
    tokens = token_payload(examples.interaction(prompt_tokens=40, response_tokens=8))
    raw = tokens.to_bytes()
    # tag + three uint32 lengths, then 4 bytes per id and 8 per log-prob
    assert len(raw) == 16 + 4 * 40 + 4 * 8 + 8 * 8 and raw[:4] == b"LTP1"
    back = TokenPayload.from_bytes(raw)
    assert back == tokens and back.to_bytes() == raw
    older = orjson.dumps(tokens, default=json_default)  # what workers wrote before
    assert TokenPayload.from_bytes(older) == tokens
    with pytest.raises(ValueError, match="expected"):
        TokenPayload.from_bytes(raw[:-1])
    with pytest.raises(ValueError, match="not a token payload"):
        TokenPayload.from_bytes(b"XXXX" + raw[4:])
    empty = TokenPayload()
    assert TokenPayload.from_bytes(empty.to_bytes()) == empty


def test_assembly_state_dumps_packed_token_arrays_as_lists() -> None:
    tokens = token_payload(events.decode(events.encode(inter(0))))  # decoded: packed arrays
    assert type(tokens.prompt_token_ids) is events.U32Array
    ta = StateJson(TokenPayload)
    raw = ta.dump(tokens)
    assert raw.startswith(b'{"prompt_token_ids":[') and ta.load(raw) == tokens


# ---- issue 23: no failed session gets a positive advantage ----------------------------------


def grouped_session(
    sid: str, scores: list[int | None], outcome: bool | None = None, phis: list[float] | None = None
) -> list[events.Sample]:
    """One session of group ``g``: per turn a verdict score (None: the judge never answered),
    an optional session outcome and path Phi per turn."""
    asm = Assembler()
    state = None
    for t, score in enumerate(scores):
        i = dataclasses.replace(inter(t), event_id=f"{sid}-i{t}", session_id=sid, group_id="g")
        state = asm.on_interaction(state, i)
        kind = "session_end" if t == len(scores) - 1 else "user_reply"
        n = dataclasses.replace(ns(t, kind), event_id=f"{sid}-n{t}", session_id=sid)
        state = asm.on_next_state(state, n, 0)
        if score is not None:
            p = dataclasses.replace(
                prm(t, score, [score]),
                event_id=f"{sid}-p{t}",
                session_id=sid,
                parents=[i.event_id, n.event_id],
            )
            state = asm.on_prm(state, p)
        if phis is not None:
            state = asm.on_penalty(state, dataclasses.replace(pen(t, phis[t]), session_id=sid))
    if outcome is not None:
        o = dataclasses.replace(outcome_event(sid, outcome, ts_ms=5), event_id=f"{sid}-o")
        state = asm.on_next_state(state, o, 10)
    assert state is not None
    return asm.complete(state, 11).samples


def test_unjudged_failed_session_takes_its_outcome_and_never_a_positive_advantage():
    """Audit repro: a failed session whose judge never answered was kept at reward 0 and, in a
    group with a judged failed session (total -2), normalised to +1.0."""
    judged = grouped_session("a", [-1], outcome=False)  # -1 + (-1) = -2
    unjudged = grouped_session("b", [None], outcome=False)  # the outcome alone: -1
    assert [(s.reward, s.outcome, s.loss_mask) for s in unjudged] == [(-1.0, -1.0, [1, 1])]
    out = grouping.normalize("g", {"a": judged, "b": unjudged}, "samples-2")
    # z = (-2 + 1.5) / 0.5 = -1 for a; +1 for b, bounded to 0: a failure is never encouraged
    assert [s.reward for s in out] == pytest.approx([-1.0, 0.0], abs=1e-5)
    assert all(s.reward <= 0 for s in out)


def test_unjudged_session_without_outcome_is_masked_not_trained_at_zero():
    judged = grouped_session("a", [-1])
    unjudged = grouped_session("b", [None, None])
    assert [(s.masked, s.loss_mask) for s in unjudged] == [(True, [0, 0]), (True, [0, 0])]
    out = grouping.normalize("g", {"a": judged, "b": unjudged}, "samples-2")
    # a alone in its bucket keeps -1; b trains nothing
    assert [(s.session_id, s.reward, s.rl_trainable()) for s in out] == [
        ("a", -1.0, True),
        ("b", 0.0, False),
        ("b", 0.0, False),
    ]


def test_a_failed_session_with_a_bonus_is_bounded_at_zero():
    # outcome -1, vote +1, Phi +0.05 (beta 0.5): total = -1 + 1 + 0.025 = 0.025 -> sample 0;
    # the bound is kept out of the outcome+PRM part (reward - penalty = -1 + 1 = 0)
    (s,) = grouped_session("a", [1], outcome=False, phis=[0.05])
    assert s.reward == 0.0 and s.penalty == pytest.approx(-0.0) and s.outcome == -1.0
    assert s.reward - s.penalty == pytest.approx(0.0)


def test_group_of_failures_ranks_them_but_none_goes_above_zero():
    # outcome -1 for all; votes +1, 0, -1 -> totals 0, -1, -2 -> z = +1.22, 0, -1.22 -> bounded
    out = grouping.normalize(
        "g",
        {
            "a": grouped_session("a", [1], outcome=False),
            "b": grouped_session("b", [0], outcome=False),
            "c": grouped_session("c", [-1], outcome=False),
        },
        "samples-2",
    )
    assert [s.reward for s in out] == pytest.approx([0.0, 0.0, -1.224744], abs=1e-5)


def test_stepwise_zscore_without_outcome_keeps_zero_score_turns():
    """Audit repro: scores [1, 0, 0, -1] in one (group, step) bucket were z-scored as ±1 of two
    samples (zero-score turns masked at assembly); population z is [1.41, 0, 0, -1.41]."""
    members = {
        sid: grouped_session(sid, [score]) for sid, score in zip("abcd", [1, 0, 0, -1], strict=True)
    }
    out = grouping.normalize("g", members, "samples-2")
    # mean 0, population std sqrt(2/4) = 0.707107: z = ±1 / 0.707107 = ±1.414214
    assert [s.reward for s in out] == pytest.approx([1.414214, 0.0, 0.0, -1.414214], abs=1e-5)
    assert all(s.rl_trainable() for s in out)
    # a zero score alone in its bucket says nothing and leaves the RL term
    alone = grouping.normalize("g", {"a": grouped_session("a", [0])}, "samples-2")
    assert [s.rl_trainable() for s in alone] == [False]


# ---- explicit feedback: one vote per caller and turn -------------------------------------------


def vote(eid: str, ts_ms: int, score: float, key_id: str | None = None,
         source: str = "feedback"):  # type: ignore[no-untyped-def]  # fmt: skip
    """A feedback next state on turn 0, as ``POST /v1/feedback`` records it (or, without a
    key id, another producer)."""
    return dataclasses.replace(
        examples.examples()["next_state"], event_id=eid, session_id="s", turn=0,
        kind="feedback", ts_ms=ts_ms, score=score, source=source,
        detail={} if key_id is None else {"key_id": key_id},
    )  # fmt: skip


def verdict_on(n: events.NextState) -> PrmScore:
    """The verdict a judge gives an explicit score: its sign."""
    s = (n.score > 0) - (n.score < 0)  # type: ignore[operator]
    return dataclasses.replace(prm(0, s, [s]), event_id=f"p-{n.event_id}",
                               parents=["i0", n.event_id])  # fmt: skip


def feed_votes(asm: Assembler, votes: list[events.NextState]):  # type: ignore[no-untyped-def]
    """Turn 0 with the user's reply judged +1 and penalty 0.5 * 0.2, then ``votes`` in that
    order, each judged as soon as it counts. Returns the state and what was left out."""
    state = asm.on_interaction(None, inter(0))
    state = asm.on_next_state(state, ns(0), 0)
    state = asm.on_prm(state, prm(0, 1, [1]))
    state = asm.on_penalty(state, pen(0, 0.2))
    left = []
    for v in votes:
        state, out = asm.admit(state, v, 0)
        left += out
        if all(x.event is not v for x in out):
            state = asm.on_prm(state, verdict_on(v))
    end = dataclasses.replace(ns(0, "session_end"), event_id="n0-end")
    state = asm.on_next_state(state, end, 0)
    return asm.on_prm(state, dataclasses.replace(prm(0, 0, [0]), event_id="p-end",
                                                 parents=["i0", end.event_id])), left  # fmt: skip


def test_feedback_counts_once_per_caller_per_turn_and_the_latest_wins():
    """A: down (ts 1) then up (ts 3): up counts, down is replaced. B: up (ts 5), then an older
    down (ts 2) read after it: up counts, the older one is left out as it arrives. A review
    tool (no key id) votes as its source: -1. The session end is its own next state, 0.
    Without an outcome prm is the mean of the verdicts that count:
    (1 reply + 1 A + 1 B - 1 tool + 0 end) / 5 = 0.4; total = 0.4 + 0.5 * 0.2 = 0.5."""
    asm = Assembler()
    a_down, a_up = vote("a1", 1, -1.0, "ka"), vote("a2", 3, 1.0, "ka")
    b_up, b_old = vote("b1", 5, 1.0, "kb"), vote("b0", 2, -1.0, "kb")
    tool = vote("t1", 4, -1.0, source="review-tool")
    state, left = feed_votes(asm, [a_down, a_up, b_up, b_old, tool])
    out = asm.complete(state, 1, {0: token_payload(inter(0))})
    (reward,) = out.rewards
    assert (reward.prm, reward.penalty, reward.total) == pytest.approx((0.4, 0.1, 0.5))
    counted = {"p0", "p-a2", "p-b1", "p-t1", "p-end"}
    assert set(reward.parents) - {"x0"} == counted
    assert [(x.reason, x.event_id, x.event is not None) for x in left] == [
        ("superseded", "a1", False),  # replaced after it had counted: described
        ("superseded", "b0", True),  # older than the vote that counts: the record itself
    ]
    assert left[0].detail == {"session_id": "s", "turn": 0, "event_id": "a1", "ts_ms": 1,
                              "voter": "key:ka", "superseded_by": "a2"}  # fmt: skip
    assert "superseded by a later vote of the same caller (a2)" in left[0].why
    assert "superseded by a later vote of the same caller (b1)" in left[1].why


def test_votes_past_the_voter_cap_are_left_out_and_a_counted_caller_may_still_change():
    """voters_per_turn = 2: A and B count, C is left out; A's second vote still replaces
    A's first. prm = (1 reply - 1 A + 1 B + 0 end) / 4 = 0.25; total 0.25 + 0.1 = 0.35."""
    asm = Assembler(voters_per_turn=2)
    state, left = feed_votes(
        asm,
        [
            vote("a1", 1, 1.0, "ka"),
            vote("b1", 2, 1.0, "kb"),
            vote("c1", 3, -1.0, "kc"),
            vote("a2", 4, -1.0, "ka"),
        ],
    )
    assert set(state.turns[0].votes) == {"key:ka", "key:kb"}
    (reward,) = asm.complete(state, 1, {0: token_payload(inter(0))}).rewards
    assert (reward.prm, reward.total) == pytest.approx((0.25, 0.35))
    assert [(x.reason, x.event_id) for x in left] == [("voters_cap", "c1"),
                                                      ("superseded", "a1")]  # fmt: skip
    assert "already counts the votes of 2 callers" in left[0].why


def test_with_an_outcome_only_the_counted_votes_enter_the_mean():
    """With a session outcome prm is the mean of all valid votes: 1 (reply), -1 (A's latest;
    A's +1 was replaced), 0 (end): (1 - 1 + 0) / 3 = 0; total = 1 + 0 + 0.1 = 1.1."""
    asm = Assembler()
    state, _ = feed_votes(asm, [vote("a1", 1, 1.0, "ka"), vote("a2", 2, -1.0, "ka")])
    state = asm.on_next_state(state, outcome_event("s", True, ts_ms=5), 10)
    (reward,) = asm.complete(state, 11, {0: token_payload(inter(0))}).rewards
    assert (reward.outcome, reward.prm, reward.total) == pytest.approx((1.0, 0.0, 1.1))


def test_verdicts_of_replaced_votes_do_not_grow_the_state():
    """A judge agent's verdicts come on their own topic, here after the votes they judge were
    replaced: at most voters_per_turn of them are kept without their next state."""
    asm = Assembler(voters_per_turn=3)
    state = asm.on_interaction(None, inter(0))
    votes = [vote(f"a{i}", i, 1.0, "ka") for i in range(50)]
    for v in votes:
        state, _ = asm.admit(state, v, 0)
    for v in votes:
        state = asm.on_prm(state, verdict_on(v))
    info = state.turns[0]
    assert list(info.next_states) == ["a49"] and set(info.votes) == {"key:ka"}
    assert list(info.prm) == ["a46", "a47", "a48", "a49"]  # a49's own, and 3 orphans


def test_only_feedback_on_a_turn_is_a_vote():
    from pipeline.processors.rewards import voter_of

    assert voter_of(vote("a", 1, 1.0, "ka")) == "key:ka"
    assert voter_of(vote("a", 1, 1.0)) == "source:feedback"
    assert voter_of(ns(0)) is None  # the conversation's own next state
    session_wide = outcome_event("s", True, kind="feedback")
    assert voter_of(session_wide) is None  # a session outcome: the latest wins already


def test_an_actions_penalty_adds_to_its_turns_path_part():
    """Turn 0: judged +1, its own penalty 0.5 * -0.2 and a GUI action's 0.5 * -0.1 (a repeated
    no-op): penalty -0.15, total 0.85, both penalties among the reward's parents."""
    asm = Assembler()
    state = feed(asm, [(1, [1], -0.2)])
    action = dataclasses.replace(pen(0, -0.1), event_id="gui-x0", parents=["gui-n0"])
    state = asm.on_action_penalty(state, action)
    state = asm.on_action_penalty(state, action)  # redelivered: counted once
    (r,) = asm.complete(state, 1).rewards
    assert (r.prm, r.penalty, r.total) == pytest.approx((1.0, -0.15, 0.85))
    assert r.parents == ["p0", "x0", "gui-x0"]
    plain = feed(Assembler(), [(1, [1], -0.2)])
    (r,) = Assembler().complete(plain, 1).rewards  # without one: as before
    assert (r.penalty, r.total, r.parents) == (
        pytest.approx(-0.1),
        pytest.approx(0.9),
        ["p0", "x0"],
    )


# ---- issue 38: errored verdicts are no verdict; shaping alone is no signal -------------------


def errored(t: int, sid: str = "s") -> PrmScore:
    """A verdict whose judge failed (judging.judge_one): error set, no vote, score 0."""
    return dataclasses.replace(prm(t, 0, []), error="judge raised TimeoutError: read timed out",
                               event_id=f"{sid}-p{t}", session_id=sid,
                               parents=[f"{sid}-i{t}", f"{sid}-n{t}"])  # fmt: skip


def session_with(
    sid: str,
    verdicts: list[PrmScore | None],
    phis: list[float] | None = None,
    group: str | None = None,
    outcome: bool | None = None,
) -> list[events.Sample]:
    """One session, turn t judged by ``verdicts[t]`` (None: never answered), Phi ``phis[t]``
    (beta 0.5), in ``group`` if given, with an optional session outcome."""
    asm = Assembler()
    state = None
    for t, v in enumerate(verdicts):
        i = dataclasses.replace(inter(t), event_id=f"{sid}-i{t}", session_id=sid, group_id=group)
        state = asm.on_interaction(state, i)
        kind = "session_end" if t == len(verdicts) - 1 else "user_reply"
        state = asm.on_next_state(state, dataclasses.replace(
            ns(t, kind), event_id=f"{sid}-n{t}", session_id=sid), 0)  # fmt: skip
        if v is not None:
            state = asm.on_prm(state, v)
        phi = 0.0 if phis is None else phis[t]
        state = asm.on_penalty(state, dataclasses.replace(pen(t, phi), session_id=sid,
                                                          event_id=f"{sid}-x{t}"))  # fmt: skip
    if outcome is not None:
        o = dataclasses.replace(outcome_event(sid, outcome, ts_ms=5), event_id=f"{sid}-o")
        state = asm.on_next_state(state, o, 10)
    assert state is not None
    return asm.complete(state, 11).samples


def judged(t: int, score: int, sid: str = "s") -> PrmScore:
    return dataclasses.replace(prm(t, score, [score]), event_id=f"{sid}-p{t}", session_id=sid,
                               parents=[f"{sid}-i{t}", f"{sid}-n{t}"])  # fmt: skip


def test_an_errored_verdict_in_a_group_is_not_ranked_as_a_zero():
    """Issue 38 repro: PRM-only group, turn 0 of session a judged −1, of session b errored
    (score 0, no vote). Before, b's 0 was ranked: mean −0.5, std 0.5, z_b = +0.5 / 0.5 = +1.0.
    Now b is unjudged (no outcome: no reward, masked) and a is alone in its bucket (−1 kept,
    not normalised)."""
    a = session_with("a", [judged(0, -1, "a")], group="g")
    b = session_with("b", [errored(0, "b")], group="g")
    assert [(s.reward, s.loss_mask, s.masked) for s in b] == [(0.0, [0, 0], True)]
    out = grouping.normalize("g", {"a": a, "b": b}, "samples-2")
    assert [(s.session_id, s.reward, s.rl_trainable(), s.normalized) for s in out] == [
        ("a", -1.0, True, False),
        ("b", 0.0, False, False),
    ]


def test_an_errored_verdict_alone_is_not_trained_at_zero():
    """Issue 38 repro: one ungrouped turn, its verdict errored. Before it counted as judged:
    reward 0, kept trainable as the session's last judged turn. Now: no verdict, no outcome,
    no reward event, masked."""
    asm = Assembler()
    state = asm.on_interaction(None, inter(0))
    state = asm.on_next_state(state, ns(0, "session_end"), 0)
    state = asm.on_prm(state, dataclasses.replace(prm(0, 0, []), error="judge raised OSError"))
    state = asm.on_penalty(state, pen(0, 0.0))
    assert asm.ready(state, 1)  # the failed verdict still answers the turn: no waiting
    out = asm.complete(state, 1)
    assert out.rewards == []
    assert [(s.reward, s.loss_mask, s.masked) for s in out.samples] == [(0.0, [0, 0], True)]


def test_an_errored_verdict_with_an_outcome_takes_the_outcome_alone():
    # passed session: O = 1, the failed verdict adds no vote and is not a parent: total 1.0.
    # A multi-vote judge with an error but a vote cast (+1, None) has a verdict: 1 + 1 = 2.
    (s,) = session_with("a", [errored(0, "a")], outcome=True)
    assert (s.reward, s.loss_mask) == (1.0, [1, 1])
    partial = dataclasses.replace(judged(0, 1, "b"), votes=[1, None], error="1 of 2 timed out")
    (s,) = session_with("b", [partial], outcome=True)
    assert s.reward == 2.0


def test_path_shaping_alone_makes_no_reward_and_no_trainable_sample():
    """Issue 38 repro: turn 0 judged +1 (a real signal), turn 1 judged 0 with Phi +0.2 (beta
    0.5: +0.1) and no outcome, ungrouped. Before, turn 1 kept loss_mask 1 at reward +0.1 from
    the path part alone; now the path part is dropped (reward 0, penalty 0) and it is masked.
    A negative path part alone (Phi −0.2) trains nothing either."""
    for phi in (0.2, -0.2):
        s0, s1 = session_with("s", [judged(0, 1), judged(1, 0)], phis=[0.0, phi])
        assert (s0.reward, s0.loss_mask) == (1.0, [1, 1])
        assert (s1.reward, s1.penalty, s1.loss_mask, s1.masked) == (0.0, 0.0, [0, 0], True)
    # on a real signal the path part still applies: judged −1, Phi +0.2 → −1 + 0.1 = −0.9
    (s,) = session_with("t", [judged(0, -1, "t")], phis=[0.2])
    assert (s.reward, s.penalty) == (pytest.approx(-0.9), pytest.approx(0.1))


def test_path_shaping_alone_does_not_train_a_grouped_turn_alone_in_its_bucket():
    """A grouped judged-0 turn with Phi +0.2 alone in its bucket: before it kept reward +0.1
    (base 0, reward ≠ 0, so not taken out of RL); now its reward is 0 and it leaves RL, as
    does an older sample still carrying that path part (reward = penalty = +0.1)."""
    s = session_with("a", [judged(0, 0, "a")], phis=[0.2], group="g")
    (out,) = grouping.normalize("g", {"a": s}, "samples-2")
    assert (out.reward, out.rl_trainable()) == (0.0, False)
    older = zscore_by_group_step([sample(0.1, "g", 0, penalty=0.1)])
    assert [x.rl_trainable() for x in older] == [False]


def test_zscored_samples_are_marked_normalized_and_others_not():
    # [1, −1] in one bucket: z = ±1, both normalised; a bucket of one and an ungrouped sample
    # keep their raw reward and are not (the trainer re-centres those by the batch mean)
    out = zscore_by_group_step([sample(1.0, "g", 0), sample(-1.0, "g", 0),
                                sample(-1.0, "g", 1), sample(1.0, None, None)])  # fmt: skip
    assert [(round(s.reward, 5), s.normalized) for s in out] == [
        (1.0, True),
        (-1.0, True),
        (-1.0, False),
        (1.0, False),
    ]


def test_a_failed_verdict_round_trips_in_the_state_and_older_states_read_as_verdicts():
    asm = Assembler()
    state = asm.on_interaction(None, inter(0))
    state = asm.on_prm(state, dataclasses.replace(prm(0, 0, []), error="judge raised OSError"))
    assert state.turns[0].prm["n0"].no_verdict
    ta = StateJson(AssemblyState)
    raw = ta.dump(state)
    assert ta.load(raw) == state
    older = orjson.loads(raw)  # stored before the field: the entry has no "no_verdict"
    del older["turns"]["0"]["prm"]["n0"]["no_verdict"]
    assert not ta.load(orjson.dumps(older)).turns[0].prm["n0"].no_verdict


def test_a_huge_outcome_score_in_a_group_neither_raises_nor_trains():
    # Found by the property search: scores ±1e308 (valid JSON) in one bucket: mean 0, and
    # (1e308 − 0) ** 2 raised OverflowError in the group agent. Now the spread overflows to
    # inf and the bucket leaves the RL term, as a constant one does.
    out = zscore_by_group_step([sample(1e308, "g", 0), sample(-1e308, "g", 0)])
    assert [(s.reward, s.rl_trainable(), s.normalized) for s in out] == [
        (1e308, False, False),
        (-1e308, False, False),
    ]
