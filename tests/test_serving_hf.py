"""Gateway + embedded transformers backend: exact tokens/log-probs, OpenAI SDK, sessions."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from pipeline import events
from pipeline.serving.app import Gateway, create_app
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.settings import ServeSettings
from pipeline.serving.threaded import running

MODEL = "liverl-tiny-v1"


class FakeRecorder:
    """Captures what the gateway hands over, instead of spooling to Kafka."""

    def __init__(self) -> None:
        self.events: list[tuple[str, events.Event]] = []
        self.backlog = 0
        self.kafka_up = True
        self.spool = SimpleNamespace(size_bytes=lambda: 0)

    def record(self, topic: str, event: events.Event) -> None:
        self.events.append((topic, event))

    def interactions(self) -> list[events.Interaction]:
        return [e for _, e in self.events if isinstance(e, events.Interaction)]


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    from pipeline.models.tiny import ensure_tiny_model

    return HFBackend(ensure_tiny_model(), workers=2)


@pytest.fixture
def served(backend: HFBackend):  # type: ignore[no-untyped-def]
    rec = FakeRecorder()
    gw = Gateway(ServeSettings(record=False, reload=False), backend, rec)  # type: ignore[arg-type]
    app = create_app(gw)
    with running(app) as url:
        yield url, rec


def _recompute(backend: HFBackend, prompt: list[int], response: list[int]) -> list[float]:
    import torch

    model, *_ = backend._live
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [float(logp[start + i, t]) for i, t in enumerate(response)]


def test_tokens_and_logprobs_are_exact(served, backend: HFBackend) -> None:  # type: ignore[no-untyped-def]
    import httpx

    url, rec = served
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to five"}],
        "max_tokens": 40,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 7,
    }
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    text = resp.json()["choices"][0]["message"]["content"]
    (inter,) = rec.interactions()
    assert len(inter.response_token_ids) == resp.json()["usage"]["completion_tokens"] > 0
    assert backend.tokenizer.decode(inter.response_token_ids, skip_special_tokens=True) == text
    assert inter.response_text == text
    again = _recompute(backend, inter.prompt_token_ids, inter.response_token_ids)
    assert inter.response_logprobs == pytest.approx(again, abs=1e-4)
    assert inter.sampling["temperature"] == 0.8 and inter.sampling["seed"] == 7
    events.decode(events.encode(inter), expected_type="interaction")  # schema-valid


def test_same_seed_same_answer(served) -> None:  # type: ignore[no-untyped-def]
    import httpx

    url, _ = served
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 12,
        "seed": 3,
    }
    a = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    b = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


def test_openai_sdk_plain_and_streaming(served, backend: HFBackend) -> None:  # type: ignore[no-untyped-def]
    from openai import OpenAI

    url, rec = served
    client = OpenAI(base_url=f"{url}/v1", api_key="anything")
    assert [m.id for m in client.models.list()] == [MODEL]
    msgs: list[Any] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    headers = {"X-Session-Id": "sdk-1", "X-Turn-Type": "main"}
    for seed in range(50):  # an untrained model often stops at once; find a longer answer
        quiet = {**headers, "X-Liverl-Train": "false"}
        out = client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=16, seed=seed, extra_headers=quiet
        )
        if out.usage is not None and out.usage.completion_tokens >= 6:
            break
    out = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, seed=seed, extra_headers=headers
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=16,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=headers,
    )
    deltas, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            deltas.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert len([d for d in deltas if d]) > 1, "tokens must arrive one by one"
    streamed = "".join(deltas)
    assert streamed == out.choices[0].message.content, "same seed, same text either way"
    assert finish == out.choices[0].finish_reason and usage is not None
    turns = rec.interactions()
    assert [(i.session_id, i.turn) for i in turns] == [("sdk-1", 0), ("sdk-1", 1)]
    assert turns[1].response_token_ids == turns[0].response_token_ids


def test_tools_reach_the_prompt_and_tool_calls_parsed(backend: HFBackend) -> None:
    """The tiny model's template ignores ``tools``, so the gateway writes them into a system
    message (Hermes style) instead of dropping them; a template that renders tools gets them
    as the ``tools`` argument (tests/test_serving_chat.py)."""
    from openai import OpenAI

    rec = FakeRecorder()
    gw = Gateway(ServeSettings(record=False, reload=False), backend, rec)  # type: ignore[arg-type]
    seen: dict[str, Any] = {}
    real = backend.tokenizer.apply_chat_template

    def spy(messages: Any, **kw: Any) -> Any:
        seen["tools"] = kw.get("tools")
        seen["messages"] = messages
        return real(messages, **kw)

    call = '<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>'
    gw.text_of = lambda turn: "Let me look. " + call  # type: ignore[method-assign]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "shell",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
            },
        }
    ]
    backend.tokenizer.apply_chat_template = spy
    try:
        with running(create_app(gw)) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="k")
            msgs: Any = [{"role": "user", "content": "list files"}]
            out = client.chat.completions.create(
                model=MODEL, messages=msgs, tools=tools, max_tokens=3
            )
            stream = client.chat.completions.create(
                model=MODEL, messages=msgs, tools=tools, max_tokens=3, stream=True
            )
            chunks = list(stream)
    finally:
        backend.tokenizer.apply_chat_template = real
    assert seen["tools"] is None
    system = seen["messages"][0]
    assert system["role"] == "system" and "<tools>" in system["content"]
    assert json.dumps(tools[0], ensure_ascii=False) in system["content"]
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me look."
    assert msg.tool_calls[0].function.name == "shell"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"cmd": "ls"}
    streamed_calls = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert streamed_calls[0].function.name == "shell"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert rec.interactions()[0].tool_calls[0]["function"]["name"] == "shell"


def test_sessions_side_turns_opt_out_and_done(served) -> None:  # type: ignore[no-untyped-def]
    import httpx

    url, rec = served
    post = lambda body, **h: httpx.post(  # noqa: E731
        f"{url}/v1/chat/completions", json=body, headers=h, timeout=60
    )
    base = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}],
    }
    r0 = post(base, authorization="Bearer key-A")
    longer = {
        **base,
        "messages": base["messages"]
        + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "b"}],
    }
    r1 = post(longer, authorization="Bearer key-A")
    other_key = post(base, authorization="Bearer key-B")
    assert r0.headers["x-session-id"] == r1.headers["x-session-id"]
    assert r0.headers["x-session-id"].startswith("auto-")
    assert other_key.headers["x-session-id"] != r0.headers["x-session-id"]
    assert "key-A" not in r0.headers["x-session-id"]
    post(base, **{"X-Session-Id": "s2", "X-Turn-Type": "side"})
    post(base, **{"X-Session-Id": "s2", "X-Liverl-Train": "false"})
    post({**base, "session_id": "s2", "session_done": True})
    post(base, **{"X-Session-Id": "s2"})
    bad = post(base, **{"X-Session-Id": "s2", "X-Turn-Type": "bogus"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Turn-Type"
    got = [(i.session_id, i.turn, i.session_done) for i in rec.interactions()]
    auto = r0.headers["x-session-id"]
    other = other_key.headers["x-session-id"]
    assert got == [
        (auto, 0, False),
        (auto, 1, False),
        (other, 0, False),
        ("s2", 0, True),
        ("s2", 0, False),
    ]


def test_reload_swaps_between_requests(tmp_path: Path, backend: HFBackend) -> None:
    import asyncio

    from pipeline.models.tiny import ensure_tiny_model

    fresh = HFBackend(ensure_tiny_model(), workers=1)
    weights = write_version(tmp_path, fresh, 1, scale=0.0)
    asyncio.run(fresh.reload(weights, 1))
    assert fresh.version == 1
    model, *_ = fresh._live
    params = [p for n, p in model.named_parameters() if "norm" not in n]
    assert all(float(p.abs().sum()) == 0 for p in params)
    old_model, *_ = backend._live
    assert old_model is not model


def write_version(root: Path, backend: HFBackend, version: int, scale: float = 1.0) -> Path:
    """A weight dir as the trainer writes it: safetensors of the model (scaled) + config."""
    from safetensors.torch import save_file

    model, *_ = backend._live
    state = {
        k: (v * scale if "norm" not in k else v).contiguous().clone()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    out = root / f"v{version}"
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("client_gone", [False, True])
def test_turn_is_recorded_after_its_answer_even_when_sending_fails(
    backend: HFBackend, stream: bool, client_gone: bool
) -> None:
    """The recorder gets the turn once the answer is out (its threads then cost the next
    request, not this one), and still gets it when the last send fails."""
    import asyncio

    sent: list[dict[str, Any]] = []
    sent_when_recorded: list[int] = []

    class Ordered(FakeRecorder):
        def record(self, topic: str, event: events.Event) -> None:
            sent_when_recorded.append(len(sent))
            super().record(topic, event)

    rec = Ordered()
    app = create_app(Gateway(ServeSettings(record=False, reload=False), backend, rec))  # type: ignore[arg-type]
    body = json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "stream": stream,
    }).encode()  # fmt: skip
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions", "root_path": "", "query_string": b"",
        "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }  # fmt: skip

    async def drive() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.sleep(3600)  # the client stays
            return {"type": "http.disconnect"}

        async def send(msg: dict[str, Any]) -> None:
            last = msg["type"] == "http.response.body" and not msg.get("more_body", False)
            if client_gone and last:
                raise OSError("connection reset by peer")
            sent.append(msg)

        with contextlib.suppress(OSError, ClientDisconnect):
            await app(scope, receive, send)

    asyncio.run(drive())
    assert len(rec.interactions()) == 1 and rec.interactions()[0].response_token_ids
    # every part of the answer was out before the recorder saw the turn (a stream's closing
    # empty message may follow: it is sent once the generator, which hands over, is done)
    with_data = [i for i, m in enumerate(sent) if m.get("body")]
    assert len(sent_when_recorded) == 1 and sent_when_recorded[0] > max(with_data, default=-1)
    assert sent[0]["status"] == 200
