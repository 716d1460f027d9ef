"""Next-state pairing as a pure state machine."""

from __future__ import annotations

import dataclasses

import orjson
import pytest
from pydantic import TypeAdapter

from pipeline.events import derive_event_id, examples
from pipeline.processors.config import DEFAULT_RULES
from pipeline.processors.pairing import (
    Pairer,
    PairingState,
    PrevTurn,
    added_messages,
    repeats_question,
)
from pipeline.processors.penalties import load_rules

SYS = {"role": "system", "content": "sys"}
U0 = {"role": "user", "content": "do it"}


def turn(t: int, messages: list[dict], **kw):  # type: ignore[no-untyped-def]
    base = examples.interaction(prompt_tokens=4, response_tokens=2)
    return dataclasses.replace(
        base, event_id=f"i{t}", session_id="s", turn=t, messages=messages, tool_calls=[], **kw
    )


def pairer() -> Pairer:
    return Pairer(load_rules(DEFAULT_RULES), "pairing-1")


def test_turn_t_plus_one_gives_turn_t_its_next_state():
    p = pairer()
    out0 = p.on_interaction(None, turn(0, [SYS, U0]))
    assert out0.next_states == [] and out0.penalties == []
    msgs1 = [
        SYS,
        U0,
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "No, wrong"},
    ]
    out1 = p.on_interaction(out0.state, turn(1, msgs1))
    (ns,) = out1.next_states
    assert (ns.turn, ns.kind, ns.role, ns.content, ns.source) == (
        0,
        "user_reply",
        "user",
        "No, wrong",
        "pairing",
    )
    assert ns.parents == ["i0", "i1"]
    assert ns.event_id == derive_event_id("next_state", ["i0", "i1"], "pairing-1", "user_reply")
    assert ns.detail == {"messages": [{"role": "user", "content": "No, wrong"}]}
    assert [pen.turn for pen in out1.penalties] == [0]


def test_tool_results_are_a_tool_result_next_state():
    msgs = [
        SYS,
        U0,
        {"role": "assistant", "content": None},
        {"role": "tool", "tool_call_id": "a", "content": "out1"},
        {"role": "tool", "tool_call_id": "b", "content": "out2"},
    ]
    p = pairer()
    st = p.on_interaction(None, turn(0, [SYS, U0])).state
    (ns,) = p.on_interaction(st, turn(1, msgs)).next_states
    assert (ns.kind, ns.role, ns.content) == ("tool_result", "tool", "out1\nout2")


def test_session_done_closes_with_session_end_and_replay_is_idempotent():
    p = pairer()
    st = p.on_interaction(None, turn(0, [SYS, U0], session_done=True))
    (end,) = st.next_states
    assert (end.turn, end.kind, end.content) == (0, "session_end", "")
    assert end.event_id == derive_event_id("next_state", ["i0"], "pairing-1", "session_end")
    assert st.state.closed is True
    again = p.on_interaction(st.state, turn(0, [SYS, U0], session_done=True))
    assert again.next_states == []  # redelivered turn: nothing new


def test_side_turns_and_opt_outs_never_pair():
    p = pairer()
    st = p.on_interaction(None, turn(0, [SYS, U0])).state
    side = p.on_interaction(st, turn(1, [SYS], turn_type="side"))
    assert side.next_states == [] and side.state == st
    msgs = [SYS, U0, {"role": "assistant", "content": "a"}, {"role": "user", "content": "ok"}]
    opt = p.on_interaction(st, turn(1, msgs, train=False))
    assert [n.turn for n in opt.next_states] == [0]  # turn 0 pairs with the opted-out turn 1
    msgs2 = msgs + [{"role": "assistant", "content": "b"}, {"role": "user", "content": "k"}]
    nxt = p.on_interaction(opt.state, turn(2, msgs2, session_done=True))
    assert [n.kind for n in nxt.next_states] == ["session_end"]  # turn 1 never pairs
    assert nxt.next_states[0].turn == 2


def test_idle_timeout_closes_once():
    p = pairer()
    st = p.on_interaction(None, turn(0, [SYS, U0], ts_ms=1_000)).state
    assert p.on_idle(st, 1_500, 1_000).next_states == []
    closed = p.on_idle(st, 2_001, 1_000)
    assert [(n.kind, n.detail) for n in closed.next_states] == [
        ("session_end", {"reason": "idle_timeout"})
    ]
    assert p.on_idle(closed.state, 9_999, 1_000).next_states == []


def test_pairing_state_round_trips_through_its_json():
    """The session table serialises the state with pydantic: it must come back equal."""
    p = pairer()
    call = {
        "id": "c0",
        "type": "function",
        "function": {"name": "shell", "arguments": orjson.dumps({"cmd": "pytest"}).decode()},
    }
    first = dataclasses.replace(turn(0, [SYS, U0], ts_ms=1_000), tool_calls=[call])
    st = p.on_interaction(None, first).state
    msgs = [
        SYS,
        U0,
        {"role": "assistant", "content": None},
        {"role": "tool", "tool_call_id": "c0", "content": "error: boom\nexit code: 1"},
    ]
    second = dataclasses.replace(turn(1, msgs, ts_ms=2_000), tool_calls=[{**call, "id": "c1"}])
    st = p.on_interaction(st, second).state
    assert isinstance(st.prev, PrevTurn) and st.prev.tool_calls and st.seen == ["i0", "i1"]
    assert st.history is not None and st.history["ran"] == {"tests-before-commit": 0}
    assert st.history["failures"] == {"shell:pytest": 1}
    adapter = TypeAdapter(PairingState)
    assert adapter.validate_json(adapter.dump_json(st)) == st
    assert adapter.validate_json(adapter.dump_json(PairingState())) == PairingState()


def test_added_messages_falls_back_after_history_rewrite():
    msgs = [SYS, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    assert added_messages(5, msgs) == [{"role": "user", "content": "y"}]
    assert added_messages(1, msgs) == [{"role": "user", "content": "y"}]


@pytest.mark.parametrize(
    ("question", "reply", "repeats"),
    [
        ("How do I boil an egg?", "How do I boil an egg??", True),
        ("How do I boil an egg?", "I asked: how do I boil an egg?", True),  # contained
        ("How do I boil an egg?", "how do i boil eggs", True),  # ratio 0.89 >= 0.85
        ("How do I boil an egg?", "Thanks, that worked.", False),
        ("How do I boil an egg?", "How do I fry an egg?", False),  # 0.82: another question
        ("Why?", "Why?", False),  # under three words: never a repeat
    ],
)
def test_repeats_question(question: str, reply: str, repeats: bool) -> None:
    assert repeats_question(question, reply) is repeats


def test_a_reply_asking_the_question_again_is_marked_for_the_judges_consistency():
    p = pairer()
    q = {"role": "user", "content": "How do I boil an egg?"}
    out0 = p.on_interaction(None, turn(0, [SYS, q]))
    msgs1 = [SYS, q, {"role": "assistant", "content": "Eggs are nice."},
             {"role": "user", "content": "How do I boil an egg?"}]  # fmt: skip
    (ns,) = p.on_interaction(out0.state, turn(1, msgs1)).next_states
    assert ns.kind == "user_reply" and ns.detail["repeats_question"] is True
    thanks = [*msgs1[:3], {"role": "user", "content": "Thanks!"}]
    fresh = p.on_interaction(None, turn(0, [SYS, q])).state
    (ok,) = p.on_interaction(fresh, turn(1, thanks)).next_states
    assert "repeats_question" not in ok.detail
