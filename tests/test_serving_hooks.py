"""POST /v1/hooks/<event>: Cursor-style harness hooks as next states, or a closed session."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline import events
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.settings import hash_key
from pipeline.settings import Settings
from tests.test_serving_feedback import (
    ListRecorder,
    chat,
    client,
    consume_session,
    err,
    gateway_app,
    next_states_from_now,
)


def payload(event: str, conversation: str, **fields: Any) -> dict[str, Any]:
    """A hook payload as Cursor sends it (common fields first)."""
    return {
        "hook_event_name": event,
        "conversation_id": conversation,
        "generation_id": "gen-1",
        "workspace_roots": ["/work/project"],
        "model": "liverl",
        "cursor_version": "1.7.0",
        "user_email": "dev@example.com",
        **fields,
    }


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    from pipeline.models.tiny import ensure_tiny_model

    return HFBackend(ensure_tiny_model(), workers=1, context_length=64)


def test_the_next_prompt_is_the_last_turns_user_reply(backend: HFBackend) -> None:
    rec = ListRecorder()
    c = client(backend, rec)
    first = c.post("/v1/hooks/beforeSubmitPrompt", json=payload("beforeSubmitPrompt", "h-1",
                                                                 prompt="write a haiku"))
    assert first.status_code == 200 and first.json() == {"continue": True}
    assert first.headers["x-liverl-recorded"] == "" and rec.records == []  # no turn before it
    chat(c, "h-1")
    rec.records.clear()  # the interaction
    resp = c.post("/v1/hooks/beforeSubmitPrompt", json=payload("beforeSubmitPrompt", "h-1",
                                                                prompt="shorter please"))
    assert resp.status_code == 200 and resp.json() == {"continue": True}
    ((topic, ns),) = rec.records
    assert topic == "liverl.next_states.v1" and isinstance(ns, events.NextState)
    assert (ns.session_id, ns.turn, ns.kind, ns.role, ns.content, ns.source) == (
        "h-1", 0, "user_reply", "user", "shorter please", "hook:beforeSubmitPrompt"
    )
    assert ns.detail == {"hook": "beforeSubmitPrompt", "conversation_id": "h-1",
                         "generation_id": "gen-1"}  # user_email & co are never recorded
    assert resp.headers["x-liverl-recorded"] == ns.event_id
    assert (resp.headers["x-session-id"], resp.headers["x-liverl-turn"]) == ("h-1", "0")


def test_after_agent_response_records_nothing(backend: HFBackend) -> None:
    rec = ListRecorder()
    c = client(backend, rec)
    chat(c, "h-2")
    rec.records.clear()
    resp = c.post("/v1/hooks/afterAgentResponse",
                  json=payload("afterAgentResponse", "h-2", text="Here it is."))
    assert resp.status_code == 200 and resp.json() == {}
    assert resp.headers["x-liverl-recorded"] == "" and rec.records == []


@pytest.mark.parametrize(("status", "score"), [("error", -1.0), ("aborted", -1.0),
                                               ("completed", None), (None, None)])
def test_stop_closes_the_session_with_a_status_outcome(
    backend: HFBackend, status: str | None, score: float | None
) -> None:
    rec = ListRecorder()
    c = client(backend, rec)
    assert [chat(c, "h-3") for _ in range(2)] == [0, 1]
    rec.records.clear()
    extra = {"status": status, "loop_count": 2} if status else {}
    resp = c.post("/v1/hooks/stop", json=payload("stop", "h-3", **extra))
    assert resp.status_code == 200 and resp.json() == {}
    ((_, ns),) = rec.records
    assert (ns.turn, ns.kind, ns.score, ns.source) == (1, "session_end", score, "hook:stop")
    assert ns.detail["reason"] == "hook_stop" and ns.detail.get("status") == status
    # closed: "last" is gone, a later stop has nothing to close, and turns start again
    err(c.post("/v1/feedback", json={"session_id": "h-3", "thumbs": "up"}), 400, "session_id")
    again = c.post("/v1/hooks/stop", json=payload("stop", "h-3"))
    assert again.status_code == 200 and again.headers["x-liverl-recorded"] == ""
    assert len(rec.records) == 1
    assert chat(c, "h-3") == 0


def test_stop_scores_are_configurable(backend: HFBackend) -> None:
    rec = ListRecorder()
    c = client(backend, rec, hook_stop_scores={"completed": 0.5})
    chat(c, "h-4")
    c.post("/v1/hooks/stop", json=payload("stop", "h-4", status="completed"))
    assert rec.records[-1][1].score == 0.5  # type: ignore[attr-defined]


def test_the_session_comes_from_the_body_the_header_or_the_conversation(
    backend: HFBackend,
) -> None:
    rec = ListRecorder()
    c = client(backend, rec)
    chat(c, "h-5")
    rec.records.clear()
    body = {"prompt": "next"}
    c.post("/v1/hooks/beforeSubmitPrompt", json={**body, "session_id": "h-5"})
    c.post("/v1/hooks/beforeSubmitPrompt", json=body, headers={"X-Session-Id": "h-5"})
    c.post("/v1/hooks/beforeSubmitPrompt", json={**body, "conversation_id": "h-5"})
    assert [ns.session_id for _, ns in rec.records] == ["h-5"] * 3
    err(c.post("/v1/hooks/beforeSubmitPrompt", json=body), 400, "session_id")


@pytest.mark.parametrize(
    ("event", "body", "status", "param"),
    [
        ("sessionStart", {"conversation_id": "h-6"}, 404, "event"),
        ("beforeSubmitPrompt", {"conversation_id": "h-6"}, 422, "prompt"),
        ("beforeSubmitPrompt", {"conversation_id": "h-6", "prompt": 5}, 422, "prompt"),
        ("beforeSubmitPrompt", {"conversation_id": "", "prompt": "x"}, 422, "conversation_id"),
        ("beforeSubmitPrompt", {"conversation_id": "c" * 257, "prompt": "x"}, 422,
         "conversation_id"),
        ("beforeSubmitPrompt", payload("stop", "h-6", prompt="x"), 400, "hook_event_name"),
        ("stop", {"conversation_id": "h-6", "status": "s" * 65}, 422, "status"),
        ("stop", {"conversation_id": "h-6", "loop_count": -1}, 422, "loop_count"),
        ("stop", {"conversation_id": "h-6", "loop_count": "2"}, 422, "loop_count"),
        ("stop", ["conversation_id", "h-6"], 400, None),
    ],
)
def test_bad_hooks_are_4xx_and_record_nothing(
    backend: HFBackend, event: str, body: Any, status: int, param: str | None
) -> None:
    rec = ListRecorder()
    c = client(backend, rec)
    chat(c, "h-6")
    rec.records.clear()
    e = err(c.post(f"/v1/hooks/{event}", json=body), status, param)
    if status == 404:
        assert e["code"] == "hook_not_found" and "beforeSubmitPrompt" in e["message"]
    assert rec.records == []
    assert chat(c, "h-6") == 1, "a refused stop closes nothing"


def test_each_limit_is_crossed_at_the_edge(backend: HFBackend) -> None:
    rec = ListRecorder()
    c = client(backend, rec, next_state_max_body_bytes=2048, next_state_max_chars=100,
               max_json_depth=4)
    chat(c, "h-7")
    rec.records.clear()
    url = "/v1/hooks/beforeSubmitPrompt"
    ok = {"conversation_id": "h-7", "prompt": "p" * 100}
    assert c.post(url, json=ok).status_code == 200
    assert err(c.post(url, json={**ok, "prompt": "p" * 101}), 400, "prompt")["code"] == (
        "text_too_long"
    )
    big = {**ok, "attachments": [{"type": "file", "file_path": "f" * 3000}]}
    assert err(c.post(url, json=big), 413)["code"] == "request_too_large"
    deep: Any = {}
    for _ in range(4):
        deep = {"a": deep}
    assert err(c.post(url, json={**ok, "attachments": deep}), 400)["code"] == "json_too_deep"
    assert len(rec.records) == 1


def test_hooks_are_authenticated_and_rate_limited_like_chat(backend: HFBackend) -> None:
    rec = ListRecorder()
    c = client(backend, rec, api_key_hashes=[hash_key("k1")], rate_limit_per_min=6,
               rate_limit_burst=2)
    good = {"Authorization": "Bearer k1"}
    chat(c, "h-8", **good)
    rec.records.clear()
    body = payload("beforeSubmitPrompt", "h-8", prompt="again")
    err(c.post("/v1/hooks/beforeSubmitPrompt", json=body), 401)
    err(c.post("/v1/hooks/nothing", json=body), 401)  # no key: nothing is revealed
    assert c.post("/v1/hooks/beforeSubmitPrompt", json=body, headers=good).status_code == 200
    err(c.post("/v1/hooks/beforeSubmitPrompt", json=body, headers=good), 429)
    assert len(rec.records) == 1


@pytest.mark.integration
def test_hooks_reach_next_states_on_the_broker(
    kafka_settings: Settings, unique: str, tmp_path: Path
) -> None:
    from pipeline.serving.threaded import running

    sid = f"hooks-e2e-{unique}"
    consumer = next_states_from_now(kafka_settings, f"hk-{unique}")
    app = gateway_app(tmp_path, kafka_settings)
    with running(app) as url, httpx.Client(timeout=60) as c:

        def hook(event: str, **fields: Any) -> httpx.Response:
            resp = c.post(f"{url}/v1/hooks/{event}", json=payload(event, sid, **fields))
            assert resp.status_code == 200, resp.text
            return resp

        assert hook("beforeSubmitPrompt", prompt="Explain DNS").headers["x-liverl-recorded"] == ""
        assert chat(c, sid, url) == 0
        hook("afterAgentResponse", text="DNS maps names to addresses.")
        reply = hook("beforeSubmitPrompt", prompt="Use simple steps please.")
        assert chat(c, sid, url) == 1
        end = hook("stop", status="error", loop_count=1)
        bad = c.post(f"{url}/v1/hooks/beforeSubmitPrompt", json=payload("beforeSubmitPrompt",
                                                                         sid, prompt=7))
        assert bad.status_code == 422
        assert c.post(f"{url}/v1/hooks/nope", json=payload("nope", sid)).status_code == 404
        deadline = time.monotonic() + 30
        while app.state.recorder.backlog and time.monotonic() < deadline:
            time.sleep(0.1)
    got = {ns.event_id: ns for ns in consume_session(consumer, sid, want=2)}
    ids = [reply.headers["x-liverl-recorded"], end.headers["x-liverl-recorded"]]
    assert sorted(got) == sorted(ids), "one user reply and one session end, nothing else"
    ns, stop = got[ids[0]], got[ids[1]]
    assert (ns.turn, ns.kind, ns.role, ns.content) == (0, "user_reply", "user",
                                                      "Use simple steps please.")
    assert ns.source == "hook:beforeSubmitPrompt"
    assert (stop.turn, stop.kind, stop.score, stop.content) == (1, "session_end", -1.0, "error")
    assert stop.detail == {"hook": "stop", "conversation_id": sid, "generation_id": "gen-1",
                           "reason": "hook_stop", "status": "error", "loop_count": 1}
