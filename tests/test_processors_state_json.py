"""The processors' state JSON (msgspec) writes the bytes pydantic's TypeAdapter wrote, so
states stored before the switch read back, and it refuses what is not a state."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from pipeline.events.arrays import F64Array, U32Array
from pipeline.processors import session
from pipeline.processors.grouping import GroupIndex
from pipeline.processors.judging import JudgeState, JudgeTurn, Pending
from pipeline.processors.pairing import PairingState, PrevTurn
from pipeline.processors.rewards import (
    AssemblyState,
    AssemblyTurn,
    KeptInteraction,
    Outcome,
    PenaltyEntry,
    PrmEntry,
    TokenPayload,
    VoteEntry,
)
from pipeline.processors.state_json import StateJson, StateUnreadable


def a_state() -> session.SessionState:
    turn = AssemblyTurn(
        interaction=KeptInteraction(
            event_id="i1",
            policy_id="p",
            weight_version=3,
            group_id=None,
            ts_ms=17,
            tokens=TokenPayload([1, 2], [3], [-0.5]),
        ),
        next_states={"n1": "user_reply"},
        prm={"replies": PrmEntry(event_id="s1", score=-1, votes=[-1, None, 1])},
        penalty=PenaltyEntry(event_id="pp", phi=0.25, beta=0.1),
        hints={"h1": (1, "Shorter.")},
        votes={"fb": VoteEntry(event_id="v", ts_ms=9)},
        action_penalties={"a": PenaltyEntry(event_id="ap", phi=1.0, beta=0.5)},
    )
    return session.SessionState(
        pairing=PairingState(
            session_id="s", last_seen_ms=5, closed=False, seen=["i1"],
            prev=PrevTurn(event_id="i1", turn=3, ts_ms=4, messages_len=2, trainable=True,
                          tool_calls=[["call_1", "ls"]]),
            history={"k": [1, "x"]},
        ),
        judging=JudgeState(turns={3: JudgeTurn("i1", "q", "a")},
                           pending={"n2": Pending(since_ms=1, turn=4)}),
        assembly=AssemblyState(session_id="s", turns={3: turn, 10: AssemblyTurn()},
                               outcome=Outcome(event_id="o", ts_ms=2, value=1.0)),
        touched_ms=99,
    )  # fmt: skip


def test_the_bytes_are_pydantics_and_read_both_ways() -> None:
    state = a_state()
    pydantic_bytes = TypeAdapter(session.SessionState).dump_json(state)
    assert session.dump(state) == pydantic_bytes
    assert session.load(pydantic_bytes) == state
    assert TypeAdapter(session.SessionState).validate_json(session.dump(state)) == state
    # int keys come back as ints, tuples as tuples
    loaded = session.load(session.dump(state))
    assert list(loaded.assembly.turns) == [3, 10]
    assert loaded.assembly.turns[3].hints["h1"] == (1, "Shorter.")


def test_packed_token_arrays_are_stored_as_lists() -> None:
    state = a_state()
    kept = state.assembly.turns[3].interaction
    assert kept is not None
    kept.tokens = TokenPayload(U32Array([7, 8]), U32Array([9]), F64Array([-0.25]))
    raw = session.dump(state)
    assert b'"prompt_token_ids":[7,8]' in raw and b'"response_logprobs":[-0.25]' in raw
    back = session.load(raw).assembly.turns[3].interaction
    assert back is not None and back.tokens == TokenPayload([7, 8], [9], [-0.25])


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"[]", b'{"touched_ms": "soon"}', b'{"pairing": {"session_id": 3}}', b"{"],
)
def test_what_is_not_a_state_is_unreadable(raw: bytes) -> None:
    with pytest.raises(StateUnreadable):
        session.load(raw)


def test_a_group_index_round_trips() -> None:
    codec = StateJson(GroupIndex)
    index = GroupIndex(first_ms=1, members=["a", "b"], done=True, touched_ms=4)
    assert codec.load(codec.dump(index)) == index
    assert codec.dump(index) == TypeAdapter(GroupIndex).dump_json(index)
