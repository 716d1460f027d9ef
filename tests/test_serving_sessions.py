"""Session naming: headers first, body fallbacks, derived ids, groups."""

from __future__ import annotations

import pytest

from pipeline.serving.errors import ApiError
from pipeline.serving.sessions import Sessions

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_headers_win_over_body() -> None:
    info = Sessions().resolve(
        {"x-session-id": "h", "x-turn-type": "side", "x-liverl-group": "task-7"},
        {"session_id": "b", "turn_type": "main", "group_id": "other"},
        "key",
        MSGS,
    )
    assert (info.session_id, info.turn_type, info.group_id) == ("h", "side", "task-7")
    assert not info.recorded, "side turns are served, not recorded"


def test_body_fallbacks_and_group() -> None:
    info = Sessions().resolve({}, {"session_id": "b", "group_id": "g1"}, "key", MSGS)
    assert (info.session_id, info.group_id, info.recorded) == ("b", "g1", True)


def test_derived_session_depends_on_key_and_first_messages_only() -> None:
    sessions = Sessions(prefix_messages=2)
    a = sessions.resolve({}, {}, "key-a", MSGS).session_id
    later = MSGS + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}]
    assert sessions.resolve({}, {}, "key-a", later).session_id == a, "same conversation"
    assert sessions.resolve({}, {}, "key-b", MSGS).session_id != a, "another key"
    assert a.startswith("auto-") and len(a) == len("auto-") + 24


def test_bad_turn_type_and_group_are_400() -> None:
    with pytest.raises(ApiError) as bad_type:
        Sessions().resolve({"x-turn-type": "sideways"}, {}, "k", MSGS)
    assert bad_type.value.status == 400
    with pytest.raises(ApiError) as bad_group:
        Sessions().resolve({}, {"group_id": 5}, "k", MSGS)
    assert bad_group.value.status == 400
