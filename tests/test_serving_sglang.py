"""SGLang backend against a small fake SGLang HTTP server started in the test."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pipeline.serving.app import Gateway, create_app
from pipeline.serving.backends.base import SamplingParams
from pipeline.serving.backends.sglang import SGLangBackend, SGLangError
from pipeline.serving.settings import ServeSettings
from pipeline.serving.threaded import running

from .test_serving_hf import FakeRecorder


def fake_sglang(tokenizer: Any) -> tuple[FastAPI, dict[str, Any]]:
    """Answers /generate with fixed tokens and the current weight version, like SGLang."""
    state: dict[str, Any] = {"version": "0", "requests": [], "reloads": [], "fail": False,
                             "adapters": {}, "lora_calls": []}
    answer = tokenizer("Paris is the capital.", add_special_tokens=False)["input_ids"]
    answer = [*answer, tokenizer.eos_token_id]
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> dict[str, Any]:
        body = await request.json()
        state["requests"].append(body)
        lora_name = body.get("lora_path")
        if lora_name is not None and lora_name not in state["adapters"]:
            return JSONResponse({"error": {"message": f"unknown lora {lora_name}"}}, 400)
        if state.get("slow"):
            await asyncio.sleep(state["slow"])
        n = min(len(answer), body["sampling_params"]["max_new_tokens"])
        out = answer[:n]
        return {
            "text": tokenizer.decode(out, skip_special_tokens=True),
            "output_ids": out,
            "meta_info": {
                "finish_reason": {"type": "stop" if n == len(answer) else "length"},
                "output_token_logprobs": [[-0.5 - i / 10, t, None] for i, t in enumerate(out)],
                "weight_version": state["version"],
            },
        }

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
        streamed = httpx.post(
            f"{gw_url}/v1/chat/completions", json={**body, "stream": True}, timeout=30
        )
        assert "Paris" in streamed.text and streamed.text.rstrip().endswith("[DONE]")
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

    for name in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                 "NO_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert env_proxy("http://sglang:30000") is None
    monkeypatch.setenv("http_proxy", "http://proxy.internal:3128")
    monkeypatch.setenv("no_proxy", "localhost,127.0.0.1")
    assert env_proxy("http://sglang:30000") == "http://proxy.internal:3128"
    assert env_proxy("https://sglang:30000") is None  # no https_proxy set
    assert env_proxy("http://127.0.0.1:30000") is None  # bypassed
