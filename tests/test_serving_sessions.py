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


# ---- whose turn it is, and who owns a session (issue 37) ----------------------------------------


def test_a_user_key_cannot_speak_for_another_user() -> None:
    """Issue 37: key ``mallory`` sent ``X-Liverl-User: bob`` and was recorded as bob, so
    ``liverl forget --user bob`` listed mallory's session. A user key names only its own user
    (403); an operator key (a proxy serving many users) and loopback callers name anyone."""
    from pipeline.serving.auth import Caller

    mallory = Caller("k-mallory", "mallory", operator=False, keyed=True)
    proxy = Caller("k-proxy", "proxy", operator=True, keyed=True)
    bob_header = {"x-session-id": "s", "x-liverl-user": "bob"}
    with pytest.raises(ApiError) as refused:
        Sessions().resolve(bob_header, {}, mallory, MSGS)
    assert (refused.value.status, refused.value.param) == (403, "X-Liverl-User")
    assert refused.value.type == "permission_error"
    own = Sessions().resolve({**bob_header, "x-liverl-user": "mallory"}, {}, mallory, MSGS)
    assert own.user_id == "mallory"
    assert Sessions().resolve({"x-session-id": "s"}, {}, mallory, MSGS).user_id == "mallory"
    assert Sessions().resolve(bob_header, {}, proxy, MSGS).user_id == "bob"
    assert Sessions().resolve(bob_header, {}, "k-loopback", MSGS).user_id == "bob"


def test_the_first_user_owns_a_session_and_keeps_it_after_close() -> None:
    from pipeline.serving.auth import Caller

    bob = Caller("kb", "bob", operator=False, keyed=True)
    mallory = Caller("km", "mallory", operator=False, keyed=True)
    ops = Caller("ko", "ops", operator=True, keyed=True)
    s = Sessions(max_sessions=2)
    s.claim("s1", "bob")
    s.claim("s1", "mallory")  # taken: the first turn opened it
    assert s.owner("s1") == "bob"
    s.check_owner("s1", bob)
    s.check_owner("s1", ops)
    s.check_owner("unknown", mallory)  # no owner here: not checked (another replica's)
    s.close("s1")  # feedback on a closed session's turns still comes
    with pytest.raises(ApiError) as refused:
        s.check_owner("s1", mallory)
    assert (refused.value.status, refused.value.code) == (403, "session_forbidden")
    s.claim("s2", "x")
    s.claim("s3", "y")
    assert s.owner("s1") is None and s.owner("s3") == "y"  # bounded like the turn counters
    s.seed({"s4": 3}, {"s4": "bob", "s5": "carol"})  # recovered from the log at start
    assert (s.owner("s4"), s.owner("s5")) == ("bob", "carol")


def test_mallorys_key_is_refused_as_bob_and_forget_finds_only_bobs_turns() -> None:
    """Through the gateway: the 403 is OpenAI-shaped and records nothing; the operator's turn
    for bob is recorded as bob's, and makes the session bob's."""
    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.serving.backends.hf import HFBackend
    from tests.test_serving_feedback import (
        BOB,
        MALLORY,
        OPS,
        ListRecorder,
        bearer,
        chat,
        err,
        keyed,
    )

    backend = HFBackend(ensure_tiny_model(), workers=1, context_length=64)
    rec = ListRecorder()
    c = keyed(backend, rec)
    body = {
        "model": "liverl-tiny-v1",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
    }
    e = err(
        c.post(
            "/v1/chat/completions",
            json=body,
            headers={"X-Session-Id": "m-1", "X-Liverl-User": "bob", **bearer(MALLORY)},
        ),
        403,
        "X-Liverl-User",
    )
    assert e["code"] == "user_mismatch" and rec.records == []
    chat(c, "p-1", **{"X-Liverl-User": "bob", **bearer(OPS)})
    chat(c, "m-2", **bearer(MALLORY))
    users = {ev.session_id: ev.user_id for _, ev in rec.records}  # type: ignore[attr-defined]
    assert users == {"p-1": "bob", "m-2": "mallory"}
    assert (
        c.post(
            "/v1/feedback", json={"session_id": "p-1", "thumbs": "up"}, headers=bearer(BOB)
        ).status_code
        == 200
    )
    err(
        c.post("/v1/feedback", json={"session_id": "p-1", "thumbs": "up"}, headers=bearer(MALLORY)),
        403,
        "session_id",
    )
