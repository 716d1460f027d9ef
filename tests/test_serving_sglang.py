"""SGLang backend against a small fake SGLang HTTP server started in the test."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pipeline.serving.app import Gateway, create_app
from pipeline.serving.backends.base import SamplingParams
from pipeline.serving.backends.sglang import SGLangBackend, SGLangError
from pipeline.serving.settings import ServeSettings
from pipeline.serving.threaded import running

from .test_serving_hf import FakeRecorder


def fake_sglang(tokenizer: Any) -> tuple[FastAPI, dict[str, Any]]:
    """Answers /generate with fixed tokens and the current weight version, like SGLang."""
    state: dict[str, Any] = {
        "version": "0",
        "requests": [],
        "reloads": [],
        "fail": False,
        "adapters": {},
        "lora_calls": [],
    }
    answer = tokenizer("Paris is the capital.", add_special_tokens=False)["input_ids"]
    answer = [*answer, tokenizer.eos_token_id]
    app = FastAPI()

    def event(out: list[int], start: int, finished: bool) -> dict[str, Any]:
        """SGLang's answer (or stream event) for tokens ``out[start:]``; ``start`` 0 is the
        cumulative form."""
        n = len(out)
        reason = None
        if finished:
            reason = {"type": "stop" if n == len(answer) else "length"}
        return {
            "text": tokenizer.decode(out[start:], skip_special_tokens=True),
            "output_ids": out[start:],
            "meta_info": {
                "finish_reason": reason,
                "output_token_logprobs": [[-0.5 - i / 10, t, None] for i, t in enumerate(out)][
                    start:
                ],
                "weight_version": state["version"],
            },
        }

    async def events(out: list[int]) -> Any:
        """One SSE event per token, as SGLang streams (``state["incremental"]``: only the new
        token in each; else all so far), then [DONE]. ``state["hold"]``: after the first
        event, wait until the test says it received it."""
        for k in range(1, len(out) + 1):
            start = k - 1 if state.get("incremental") else 0
            yield b"data: " + orjson.dumps(event(out[:k], start, k == len(out))) + b"\n\n"
            if k == 1 and state.get("hold") is not None:
                state["held"] = await asyncio.to_thread(state["hold"].wait, 10)
        if state.get("error_midway"):
            yield b'data: {"error": {"message": "CUDA out of memory"}}\n\n'
        yield b"data: [DONE]\n\n"

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        state["requests"].append(body)
        lora_name = body.get("lora_path")
        if lora_name is not None and lora_name not in state["adapters"]:
            return JSONResponse({"error": {"message": f"unknown lora {lora_name}"}}, 400)
        if state.get("slow"):
            await asyncio.sleep(state["slow"])
        n = min(len(answer), body["sampling_params"]["max_new_tokens"])
        out = answer[:n]
        if body.get("stream"):
            return StreamingResponse(events(out), media_type="text/event-stream")
        return event(out, 0, True)

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        state["info_calls"] = state.get("info_calls", 0) + 1
        return {"incremental_streaming_output": bool(state.get("incremental"))}

    @app.post("/update_weights_from_disk")
    async def update(request: Request) -> dict[str, Any]:
        body = await request.json()
        state["reloads"].append(body)
        if state["fail"]:
            return {"success": False, "message": "shape mismatch"}
        state["version"] = body["weight_version"]
        return {"success": True, "message": "ok"}

    @app.post("/load_lora_adapter")
    async def load_lora(request: Request) -> JSONResponse:
        body = await request.json()
        state["lora_calls"].append(("load", body))
        if state.get("lora_fail"):
            return JSONResponse({"success": False, "error_message": "rank 64 > max 16"}, 400)
        state["adapters"][body["lora_name"]] = body["lora_path"]
        return JSONResponse({"success": True, "loaded_adapters": state["adapters"]})

    @app.post("/unload_lora_adapter")
    async def unload_lora(request: Request) -> JSONResponse:
        body = await request.json()
        state["lora_calls"].append(("unload", body))
        state["adapters"].pop(body["lora_name"], None)
        return JSONResponse({"success": True, "loaded_adapters": state["adapters"]})

    return app, state


@pytest.fixture
def sglang():  # type: ignore[no-untyped-def]
    from pipeline.models.tiny import ensure_tiny_model

    path = ensure_tiny_model()
    from transformers import AutoTokenizer

    app, state = fake_sglang(AutoTokenizer.from_pretrained(path))
    with running(app) as url:
        yield url, path, state


def test_gateway_over_sglang_records_engine_tokens(sglang) -> None:  # type: ignore[no-untyped-def]
    """The engine's tokens reach the client and the record. A client that did not ask to
    stream gets one non-streaming /generate (no SSE event per token, no /server_info); a
    streaming client's request streams; the same text either way."""
    url, path, state = sglang
    backend = SGLangBackend(url, path, policy_id="pol")
    rec = FakeRecorder()
    gw = Gateway(ServeSettings(record=False, reload=False), backend, rec)  # type: ignore[arg-type]
    with running(create_app(gw)) as gw_url:
        body = {
            "model": "pol",
            "messages": [{"role": "user", "content": "capital of France?"}],
            "temperature": 0.6,
            "top_p": 0.9,
            "max_tokens": 50,
            "seed": 5,
            "stop": ["\n\n"],
        }
        resp = httpx.post(f"{gw_url}/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == "Paris is the capital."
        assert state["requests"][-1]["stream"] is False and "info_calls" not in state
        streamed = httpx.post(
            f"{gw_url}/v1/chat/completions", json={**body, "stream": True}, timeout=30
        )
        assert state["requests"][-1]["stream"] is True and state["info_calls"] == 1
        deltas = [
            orjson.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            for line in streamed.text.splitlines()
            if line.startswith("data: {")
        ]
        assert "".join(deltas) == "Paris is the capital."  # one token per chunk now
        assert streamed.text.rstrip().endswith("[DONE]")
    sent = state["requests"][0]
    assert sent["input_ids"] == rec.interactions()[0].prompt_token_ids
    assert sent["return_logprob"] is True
    assert sent["sampling_params"] == {
        "temperature": 0.6,
        "top_p": 0.9,
        "max_new_tokens": 50,
        "stop": ["\n\n"],
        "sampling_seed": 5,
    }
    inter = rec.interactions()[0]
    assert inter.response_logprobs[:2] == [-0.5, -0.6]
    assert (
        backend.tokenizer.decode(inter.response_token_ids, skip_special_tokens=True)
        == inter.response_text
    )


def test_reload_and_reported_version(sglang, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, path, state = sglang

    async def go() -> None:
        backend = SGLangBackend(url, path, policy_id="pol")
        await backend.reload(tmp_path, 3)
        assert state["reloads"][-1] == {
            "model_path": str(tmp_path),
            "weight_version": "3",
            "abort_all_requests": False,
        }
        items = [i async for i in backend.generate([1, 2, 3], SamplingParams(max_tokens=2))]
        assert items[-1].weight_version == 3 and items[-1].finish_reason == "length"
        state["fail"] = True
        with pytest.raises(SGLangError, match="shape mismatch"):
            await backend.reload(tmp_path, 4)
        assert backend.version == 3
        await backend.close()

    asyncio.run(go())


def test_unreachable_sglang_is_502_not_500(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.stack import free_port

    backend = SGLangBackend(f"http://127.0.0.1:{free_port()}", ensure_tiny_model(), policy_id="pol")
    gw = Gateway(ServeSettings(record=False, reload=False), backend)
    c = TestClient(create_app(gw), raise_server_exceptions=False)
    resp = c.post(
        "/v1/chat/completions",
        json={"model": "pol", "messages": [{"role": "user", "content": "x"}]},
    )
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "backend_error"


def test_lora_versions_use_dynamic_adapter_loading(sglang, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Adapter versions go through /load_lora_adapter; each request names the adapter that
    was live when it started; an adapter is unloaded only once no request runs on it."""
    url, path, state = sglang
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    for d in (v1, v2):
        d.mkdir()
        (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')

    async def go() -> None:
        backend = SGLangBackend(url, path, policy_id="pol")
        await backend.reload(v1, 1)
        assert state["lora_calls"] == [
            ("load", {"lora_name": "pol-v1", "lora_path": str(v1), "pinned": False})
        ]
        assert state["reloads"] == []  # not a full-weights update
        items = [i async for i in backend.generate([1, 2], SamplingParams(max_tokens=2))]
        assert state["requests"][-1]["lora_path"] == "pol-v1"
        assert items[-1].weight_version == 1

        state["slow"] = 0.5  # a request on v1 is running while v2 arrives

        async def on_v1() -> int:
            got = [i async for i in backend.generate([1, 2], SamplingParams(max_tokens=2))]
            return got[-1].weight_version  # type: ignore[union-attr]

        running = asyncio.create_task(on_v1())
        await asyncio.sleep(0.1)
        await backend.reload(v2, 2)
        assert "pol-v1" in state["adapters"]  # still in use: not unloaded yet
        assert await running == 1
        assert ("unload", {"lora_name": "pol-v1"}) in state["lora_calls"]
        assert set(state["adapters"]) == {"pol-v2"}
        state["slow"] = 0
        items = [i async for i in backend.generate([1, 2], SamplingParams(max_tokens=2))]
        assert state["requests"][-1]["lora_path"] == "pol-v2" and items[-1].weight_version == 2

        state["lora_fail"] = True
        with pytest.raises(SGLangError, match="load_lora_adapter failed: rank 64"):
            await backend.reload(v1, 3)
        assert backend.version == 2
        await backend.close()

    asyncio.run(go())


def test_env_proxy_is_read_once_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.serving.backends.sglang import env_proxy

    for name in (
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "all_proxy",
        "ALL_PROXY",
    ):
        monkeypatch.delenv(name, raising=False)
    assert env_proxy("http://sglang:30000") is None
    monkeypatch.setenv("http_proxy", "http://proxy.internal:3128")
    monkeypatch.setenv("no_proxy", "localhost,127.0.0.1")
    assert env_proxy("http://sglang:30000") == "http://proxy.internal:3128"
    assert env_proxy("https://sglang:30000") is None  # no https_proxy set
    assert env_proxy("http://127.0.0.1:30000") is None  # bypassed


# ---- streaming: token by token, as SGLang sends it ----------------------------------------------


def collect(backend: SGLangBackend, on_first: Any = None) -> list[Any]:
    async def go() -> list[Any]:
        got = []
        try:
            async for item in backend.generate([1, 2, 3], SamplingParams(max_tokens=50)):
                got.append(item)
                if on_first is not None and len(got) == 1:
                    on_first()
        finally:
            await backend.close()
        return got

    return asyncio.run(go())


@pytest.mark.parametrize("incremental", [False, True])
def test_answers_stream_one_token_per_event_with_the_same_ids_and_logprobs(
    sglang,
    incremental: bool,  # type: ignore[no-untyped-def]
) -> None:
    """Both of SGLang's streaming forms (cumulative by default, incremental with
    --incremental-streaming-output; "auto" asks /server_info once) give the tokens and
    log-probs of the one-call answer, one piece per event; the first piece arrives while the
    server still holds the rest (it waits until the test has it)."""
    import threading

    url, path, state = sglang
    whole = collect(SGLangBackend(url, path, policy_id="pol", stream="off"))
    assert state["requests"][-1]["stream"] is False
    state["incremental"] = incremental
    state["hold"] = threading.Event()
    backend = SGLangBackend(url, path, policy_id="pol")  # auto
    pieces = collect(backend, on_first=state["hold"].set)
    assert state["held"] is True  # the first token was ours before the server sent the second
    assert state["requests"][-1]["stream"] is True and state["info_calls"] == 1
    *tokens, done = pieces
    assert all(len(p.token_ids) == 1 for p in tokens) and len(tokens) == len(whole[0].token_ids)
    assert [t for p in tokens for t in p.token_ids] == whole[0].token_ids
    assert [x for p in tokens for x in p.logprobs] == pytest.approx(whole[0].logprobs)
    assert tokens[1].logprobs == [pytest.approx(-0.6)]
    assert (
        (done.finish_reason, done.weight_version)
        == ("stop", 0)
        == (whole[1].finish_reason, whole[1].weight_version)
    )
    collect(backend)
    assert state["info_calls"] == 1  # asked once per backend


@pytest.mark.parametrize("third", [[5, 7, 8], [9, 6, 8], [5]])
def test_a_cumulative_event_that_does_not_extend_the_tokens_so_far_is_an_error(
    third: list[int],
) -> None:
    """Events 1 and 2 give tokens 5 and 6; a third that changes the last one seen, the first,
    or has fewer tokens than were sent is refused (not read as new tokens)."""
    from pipeline.serving.backends.sglang import StreamDecoder

    def event(ids: list[int]) -> dict[str, Any]:
        return {
            "output_ids": ids,
            "meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids]},
        }

    decoder = StreamDecoder("cumulative")
    assert decoder.feed(event([5])).token_ids == [5]  # type: ignore[union-attr]
    assert decoder.feed(event([5, 6])).token_ids == [6]  # type: ignore[union-attr]
    with pytest.raises(SGLangError, match="do not repeat the tokens already sent"):
        decoder.feed(event(third))
    assert decoder.ids == [5, 6]


def test_a_cumulative_reader_of_an_incremental_server_says_what_to_set(sglang) -> None:  # type: ignore[no-untyped-def]
    url, path, state = sglang
    state["incremental"] = True
    with pytest.raises(SGLangError, match="incremental-streaming-output"):
        collect(SGLangBackend(url, path, policy_id="pol", stream="cumulative"))


def test_an_error_in_the_stream_is_an_sglang_error(sglang) -> None:  # type: ignore[no-untyped-def]
    url, path, state = sglang
    state["error_midway"] = True
    with pytest.raises(SGLangError, match="CUDA out of memory"):
        collect(SGLangBackend(url, path, policy_id="pol", stream="cumulative"))


def test_the_gateway_streams_sglang_tokens_to_the_client_as_they_come(sglang) -> None:  # type: ignore[no-untyped-def]
    """Through the gateway: the client's SSE stream has the first content chunk while the
    fake server still holds the rest of the answer."""
    import threading

    url, path, state = sglang
    state["hold"] = threading.Event()
    backend = SGLangBackend(url, path, policy_id="pol")
    rec = FakeRecorder()
    gw = Gateway(ServeSettings(record=False, reload=False), backend, rec)  # type: ignore[arg-type]
    body = {
        "model": "pol",
        "messages": [{"role": "user", "content": "capital?"}],
        "max_tokens": 50,
        "stream": True,
    }
    with (
        running(create_app(gw)) as gw_url,
        httpx.stream("POST", f"{gw_url}/v1/chat/completions", json=body, timeout=30) as resp,
    ):
        text = []
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                chunk = orjson.loads(line[6:])["choices"][0]["delta"].get("content")
                if chunk:
                    text.append(chunk)
                    state["hold"].set()
    assert state["held"] is True
    assert len(text) >= 2 and "".join(text) == "Paris is the capital."


def test_an_adapter_unloaded_while_a_rollback_loads_it_again_is_loaded_after(
    tmp_path: Path,
) -> None:
    """The unload of an unused adapter and a load of the same name (a rollback to it) run
    one after the other: before the lock the load was sent while the unload was in flight
    ("already loaded" on the server, or the arm naming an adapter the server then dropped)."""
    from pipeline.models.tiny import ensure_tiny_model

    backend = SGLangBackend("http://127.0.0.1:9", ensure_tiny_model(), policy_id="pol")
    calls: list[str] = []

    async def post(path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        calls.append(f"{path} {body['lora_name']} start")
        await asyncio.sleep(0.05)  # one HTTP round trip
        calls.append(f"{path} {body['lora_name']} end")
        return 200, b'{"success": true}'

    backend._post = post  # type: ignore[method-assign]
    backend._loaded = {"pol-v4"}  # loaded, no longer live on an arm, no request on it

    async def race() -> str:
        unload = asyncio.create_task(backend._unload_unused())
        await asyncio.sleep(0.01)  # the unload's request is in flight
        name = await backend._load_adapter(tmp_path, 4)
        await unload
        return name

    assert asyncio.run(race()) == "pol-v4"
    assert calls == [
        "/unload_lora_adapter pol-v4 start",
        "/unload_lora_adapter pol-v4 end",
        "/load_lora_adapter pol-v4 start",
        "/load_lora_adapter pol-v4 end",
    ]
    assert backend._loaded == {"pol-v4"}
