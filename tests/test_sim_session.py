"""run_session against a tiny fake OpenAI-compatible server: two requests, headers, versions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request

from pipeline.serving.threaded import running
from pipeline.sim import PREFERENCES, QUESTIONS, SimUser, run_session, weight_version

SLEEP = next(q for q in QUESTIONS if "sleeping" in q.text)
ANSWER = "Go to bed at the same time every night."


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, list[dict[str, Any]], dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    state: dict[str, Any] = {"answer": ANSWER, "fingerprint": "liverl-v3"}
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        seen.append({"headers": dict(request.headers), "body": await request.json()})
        response: dict[str, Any] = {
            "id": f"chatcmpl-{len(seen)}",
            "object": "chat.completion",
            "created": 0,
            "model": "fake",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": state["answer"]},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        if state["fingerprint"] is not None:
            response["system_fingerprint"] = state["fingerprint"]
        return response

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> dict[str, Any]:
        seen.append(
            {"headers": dict(request.headers), "body": await request.json(), "path": "/v1/feedback"}
        )
        return {"object": "feedback", "recorded": True, "paired": True}

    with running(app) as url:
        yield url, seen, state


def _client(url: str) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=30)


def test_session_is_two_requests_with_the_reply_as_next_state(fake) -> None:
    url, seen, state = fake
    seen.clear()
    state.update(answer=ANSWER, fingerprint="liverl-v3")
    user = SimUser("u1", PREFERENCES["concise"])
    result = run_session(
        _client(url), "m", user, SLEEP, session_id="s-1", extra_headers={"X-Extra": "x"}
    )
    assert len(seen) == 2
    first, second = seen
    assert first["headers"]["x-session-id"] == second["headers"]["x-session-id"] == "s-1"
    assert first["headers"]["x-extra"] == "x"
    assert "x-session-done" not in first["headers"]
    assert second["headers"]["x-session-done"] == "true"
    assert "x-liverl-train" not in first["headers"] and "x-liverl-train" not in second["headers"]
    assert first["body"]["messages"] == [{"role": "user", "content": SLEEP.text}]
    assert first["body"]["max_tokens"] == 64 and first["body"]["temperature"] == 0.7
    assert first["body"]["model"] == "m"
    assert second["body"]["max_tokens"] == 1
    assert second["body"]["messages"] == [
        {"role": "user", "content": SLEEP.text},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": result.reply},
    ]
    assert result.answer == ANSWER and result.judgement.satisfied
    assert result.weight_version == 3
    assert (result.user_id, result.session_id, result.question) == ("u1", "s-1", SLEEP)
    assert result.latency_s > 0 and result.replied_at > 0 and result.prompt == SLEEP.text


def test_held_out_session_is_not_trained_and_corrections_are_sent(fake) -> None:
    url, seen, state = fake
    seen.clear()
    state.update(answer="You are a helpful AI, trained by Hugging Face", fingerprint=None)
    user = SimUser("u2", PREFERENCES["concise"], hint_rate=1.0)
    result = run_session(
        _client(url),
        "m",
        user,
        SLEEP,
        session_id="s-2",
        train=False,
        max_tokens=16,
        temperature=0.0,
    )
    assert [s["headers"]["x-liverl-train"] for s in seen] == ["false", "false"]
    assert seen[0]["body"]["max_tokens"] == 16 and seen[0]["body"]["temperature"] == 0.0
    assert not result.judgement.satisfied and "off topic" in result.judgement.quality.reasons
    assert PREFERENCES["concise"].carries_hint(result.reply)
    assert seen[1]["body"]["messages"][-1]["content"] == result.reply
    assert result.weight_version is None


def test_prompt_override_and_no_reply(fake) -> None:
    url, seen, state = fake
    seen.clear()
    state.update(answer=ANSWER, fingerprint="liverl-v0")
    pref = PREFERENCES["concise"]
    result = run_session(
        _client(url),
        "m",
        SimUser("u3", pref),
        SLEEP,
        session_id="s-3",
        prompt=f"{SLEEP.text} {pref.hint}",
        send_reply=False,
    )
    assert len(seen) == 1
    assert seen[0]["body"]["messages"][0]["content"] == f"{SLEEP.text} {pref.hint}"
    assert result.weight_version == 0 and result.replied_at == 0.0


def test_weight_version_parsing() -> None:
    assert weight_version("liverl-v3") == 3
    assert weight_version("liverl-v12") == 12
    assert weight_version(None) is None
    assert weight_version("fp_44709d6fcb") is None


def test_thumbs_rate_the_answer_before_the_closing_reply(fake) -> None:
    url, seen, state = fake
    user = SimUser("u4", PREFERENCES["concise"])
    for answer, thumbs in (
        (ANSWER, "up"),
        ("You are a helpful AI, trained by Hugging Face", "down"),
    ):
        seen.clear()
        state.update(answer=answer, fingerprint="liverl-v1")
        result = run_session(_client(url), "m", user, SLEEP, session_id="s-4", thumbs=True)
        assert [s.get("path") for s in seen] == [None, "/v1/feedback", None]
        assert seen[1]["body"] == {"session_id": "s-4", "turn": "last", "thumbs": thumbs}
        assert seen[1]["headers"]["authorization"] == "Bearer k"
        assert result.thumbs == thumbs and result.judgement.satisfied is (thumbs == "up")
        assert "x-session-done" not in seen[0]["headers"]
        assert seen[2]["headers"]["x-session-done"] == "true"


def test_held_out_users_never_rate(fake) -> None:
    url, seen, state = fake
    seen.clear()
    state.update(answer=ANSWER, fingerprint="liverl-v1")
    result = run_session(
        _client(url),
        "m",
        SimUser("u5", PREFERENCES["concise"]),
        SLEEP,
        session_id="s-5",
        train=False,
        thumbs=True,
    )
    assert all(s.get("path") is None for s in seen) and len(seen) == 2
    assert result.thumbs is None
