"""Requests captured from the real OpenClaw client, replayed through the gateway and the real
default model (SmolLM2-135M-Instruct).

The fixtures under ``tests/fixtures/openclaw_*.json`` were captured from OpenClaw 2026.9.6
(``openclaw agent --local``) configured with a custom ``openai-completions`` provider; each
holds the OpenClaw config used and the request(s) verbatim (see docs/openclaw.md):

- ``openclaw_lean_request.json``: the lean setup that fits the 8192-token model (minimal tool
  profile, short workspace files), two turns of one OpenClaw session;
- ``openclaw_lean_messaging_request.json``: the same with the ``messaging`` tool profile, where
  OpenClaw adds a user message whose content is an array of text parts;
- ``openclaw_default_request.json``: the default onboarded setup (39 KB system prompt,
  12 tools), which does not fit and must get an OpenAI-style ``context_length_exceeded``.

Only ``max_completion_tokens`` (16, so this runs in seconds on two cores) and ``seed`` are
changed before replaying.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.models import store
from pipeline.serving.app import Gateway, create_app
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.settings import ServeSettings
from pipeline.serving.threaded import running

from .test_serving_hf import FakeRecorder

FIXTURES = Path(__file__).parent / "fixtures"
MAX_NEW = 16
SEED = 1
# transport headers are left to httpx; everything else OpenClaw sent is replayed
_SKIP_HEADERS = {"host", "content-length", "connection", "accept-encoding", "traceparent"}


def _load(name: str) -> dict[str, Any]:
    doc = json.loads((FIXTURES / name).read_text())
    assert doc["openclaw_version"] == "2026.9.6"
    return doc


def _headers(req: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in req["headers"].items() if k.lower() not in _SKIP_HEADERS}


def _texts(body: dict[str, Any]) -> list[str]:
    """Every text a message carries, content-part arrays flattened."""
    out = []
    for m in body["messages"]:
        c = m["content"]
        out.extend([c] if isinstance(c, str) else [p["text"] for p in c])
    return out


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(store.resolve(None), workers=2)


@pytest.fixture
def served(backend: HFBackend):  # type: ignore[no-untyped-def]
    rec = FakeRecorder()
    gw = Gateway(ServeSettings(record=False, reload=False), backend, rec)  # type: ignore[arg-type]
    with running(create_app(gw)) as url:
        yield url, rec


def _replay(url: str, req: dict[str, Any], **override: Any) -> tuple[int, Any]:
    """POST one captured request; a stream comes back as its parsed ``data:`` events."""
    import httpx

    body = {**copy.deepcopy(req["body"]), **override}
    with httpx.stream(
        req["method"], url + req["path"], json=body, headers=_headers(req), timeout=300
    ) as resp:
        raw = resp.read().decode()
        if resp.status_code != 200 or not body.get("stream"):
            return resp.status_code, json.loads(raw)
        assert resp.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in raw.split("\n") if line.startswith("data: ")]
    return 200, events


def _check_stream(events: list[str], backend: HFBackend) -> tuple[str, dict[str, int]]:
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == 1, "stream_options.include_usage must add exactly one usage chunk"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage[0]
    content = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finish and finish[-1] in ("stop", "length")
    assert content.strip(), "the model must answer with text"
    used = usage[0]
    assert 0 < used["completion_tokens"] <= MAX_NEW, "max_completion_tokens not honoured"
    assert len(backend.tokenizer(content, add_special_tokens=False)["input_ids"]) <= MAX_NEW
    return content, used


def _check_recorded(
    inter: Any, req: dict[str, Any], content: str, used: dict[str, int], backend: HFBackend
) -> None:
    assert len(inter.prompt_token_ids) == used["prompt_tokens"] < backend.context_length
    assert len(inter.response_token_ids) == used["completion_tokens"]
    assert inter.response_text == content
    prompt = backend.tokenizer.decode(inter.prompt_token_ids)
    for text in _texts(req["body"]):
        assert text in prompt, f"message text missing from the rendered prompt: {text[:80]!r}"
    for tool in req["body"]["tools"]:  # this template ignores tools: written into the system
        assert f'"name": "{tool["function"]["name"]}"' in prompt


def test_fixtures_keep_openclaw_request_shape() -> None:
    """What the captures pin down about OpenClaw's requests (and the replays rely on)."""
    for name in (
        "openclaw_lean_request.json",
        "openclaw_lean_messaging_request.json",
        "openclaw_default_request.json",
    ):
        for req in _load(name)["requests"]:
            body = req["body"]
            assert (req["method"], req["path"]) == ("POST", "/v1/chat/completions")
            assert req["headers"]["authorization"].startswith("Bearer ")
            assert set(body) == {
                "model",
                "messages",
                "stream",
                "stream_options",
                "tools",
                "tool_choice",
                "max_completion_tokens",
            }, name
            assert body["model"] == "smollm2-135m-instruct"
            assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
            assert body["tools"] and body["tool_choice"] == "auto"
            assert body["messages"][0]["role"] == "system"
    messaging = _load("openclaw_lean_messaging_request.json")["requests"][0]["body"]
    assert any(isinstance(m["content"], list) for m in messaging["messages"])
    default = _load("openclaw_default_request.json")["requests"][0]["body"]
    assert len(default["tools"]) == 12 and len(default["messages"][0]["content"]) > 30_000
    assert any(isinstance(m["content"], list) for m in default["messages"])


def test_lean_two_turns_stream_and_share_a_derived_session(served, backend: HFBackend) -> None:  # type: ignore[no-untyped-def]
    url, rec = served
    reqs = _load("openclaw_lean_request.json")["requests"]
    assert len(reqs) == 2 and reqs[1]["body"]["messages"][:2] == reqs[0]["body"]["messages"][:2]
    for req in reqs:
        status, events = _replay(url, req, max_completion_tokens=MAX_NEW, seed=SEED)
        assert status == 200, events
        content, used = _check_stream(events, backend)
        inter = rec.interactions()[-1]
        _check_recorded(inter, req, content, used, backend)
    turns = rec.interactions()
    assert len(turns) == 2
    # OpenClaw sends no session header: the gateway derives one from key + first messages
    assert turns[0].session_id == turns[1].session_id
    assert turns[0].session_id.startswith("auto-")
    assert [t.turn for t in turns] == [0, 1]


def test_lean_content_part_arrays_are_flattened(served, backend: HFBackend) -> None:  # type: ignore[no-untyped-def]
    url, rec = served
    (req,) = _load("openclaw_lean_messaging_request.json")["requests"]
    status, events = _replay(url, req, max_completion_tokens=MAX_NEW, seed=SEED)
    assert status == 200, events
    content, used = _check_stream(events, backend)
    (inter,) = rec.interactions()
    _check_recorded(inter, req, content, used, backend)
    assert any(isinstance(m["content"], list) for m in req["body"]["messages"])
    assert _texts({"messages": inter.messages}) == _texts(req["body"])  # no text part lost


def test_default_prompt_exceeds_context_with_openai_error(served, backend: HFBackend) -> None:  # type: ignore[no-untyped-def]
    url, rec = served
    (req,) = _load("openclaw_default_request.json")["requests"]
    status, body = _replay(url, req)  # as captured: OpenClaw clamped max_completion_tokens to 1
    assert status == 400, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "context_length_exceeded"
    assert err["type"] == "invalid_request_error" and err["param"] == "messages"
    assert f"maximum context length is {backend.context_length} tokens" in err["message"]
    assert backend.context_length == 8192
    assert rec.interactions() == []
