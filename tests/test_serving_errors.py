"""Bad input and access control: always an OpenAI-shaped 4xx, never a 500."""

from __future__ import annotations

import pytest
from fastapi import Request, Response
from fastapi.testclient import TestClient

from pipeline.serving.app import Gateway, create_app
from pipeline.serving.auth import RateLimiter
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.errors import ApiError
from pipeline.serving.settings import ServeSettings, hash_key

MODEL = "liverl-tiny-v1"
URL = "/v1/chat/completions"
OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    from pipeline.models.tiny import ensure_tiny_model

    return HFBackend(ensure_tiny_model(), workers=1, context_length=64)


def client(backend: HFBackend, **cfg: object) -> TestClient:
    settings = ServeSettings(record=False, reload=False, **cfg)  # type: ignore[arg-type]
    return TestClient(create_app(Gateway(settings, backend)), raise_server_exceptions=False)


def _err(resp, status: int, param: str | None = None) -> dict:  # type: ignore[no-untyped-def]
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    return err


def test_keys_required_and_never_echoed(backend: HFBackend) -> None:
    c = client(backend, api_key_hashes=[hash_key("sekrit-key")])
    _err(c.post(URL, json=OK), 401)
    err = _err(c.post(URL, json=OK, headers={"Authorization": "Bearer wrong-key"}), 401)
    assert "wrong-key" not in err["message"]
    _err(c.get("/v1/models"), 401)
    assert c.post(URL, json=OK, headers={"Authorization": "Bearer sekrit-key"}).status_code == 200


def test_open_access_only_on_loopback() -> None:
    ServeSettings(host="127.0.0.1").check()
    with pytest.raises(ValueError, match="without API keys"):
        ServeSettings(host="0.0.0.0").check()
    ServeSettings(host="0.0.0.0", api_key_hashes=[hash_key("k")]).check()
    assert "k" not in ServeSettings(api_key_hashes=[hash_key("k")]).model_dump_json().split('"')


def test_rate_limit_429_with_retry_after(backend: HFBackend) -> None:
    c = client(backend, rate_limit_per_min=6, rate_limit_burst=2)
    auth = {"Authorization": "Bearer one"}
    assert [c.post(URL, json=OK, headers=auth).status_code for _ in range(2)] == [200, 200]
    resp = c.post(URL, json=OK, headers=auth)
    _err(resp, 429)
    assert int(resp.headers["retry-after"]) >= 1
    assert c.post(URL, json=OK, headers={"Authorization": "Bearer two"}).status_code == 200


def test_rate_limiter_refills() -> None:
    limiter = RateLimiter(per_min=60_000, burst=1)
    limiter.check("a")
    with pytest.raises(ApiError):
        limiter.check("a")
    import time

    time.sleep(0.01)
    limiter.check("a")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"\xff\xfe", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"model": "liverl-tiny-v1"}', 422, "messages"),
        (b'{"model": "liverl-tiny-v1", "messages": []}', 422, "messages"),
        (
            b'{"model": "liverl-tiny-v1", "messages": [{"role": "wizard", "content": "x"}]}',
            422,
            "messages.0.role",
        ),
        (b'{"model": "liverl-tiny-v1", "messages": [{"role": "user", "content": 5}]}', 422, None),
        (b'{"model": "liverl-tiny-v1", "messages": "hi"}', 422, "messages"),
        (
            b'{"model": "liverl-tiny-v1", "messages": [{"role": "user", "content": "x"}], '
            b'"temperature": "hot"}',
            422,
            "temperature",
        ),
        (
            b'{"model": "liverl-tiny-v1", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": 0}',
            422,
            "max_tokens",
        ),
        (
            b'{"model": "liverl-tiny-v1", "messages": [{"role": "user", "content": "x"}], "n": 2}',
            422,
            "n",
        ),
        (
            b'{"model": "liverl-tiny-v1", "messages": [{"role": "user", "content": "x"}], '
            b'"tools": [{"type": "function"}]}',
            422,
            "tools",
        ),
        (b'{"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    ],
)
def test_bad_requests(backend: HFBackend, body: bytes, status: int, param: str | None) -> None:
    resp = client(backend).post(URL, content=body, headers={"Content-Type": "application/json"})
    err = _err(resp, status, param)
    if status == 404:
        assert err["code"] == "model_not_found"


def test_body_too_large_413(backend: HFBackend) -> None:
    c = client(backend, max_body_bytes=1000)
    big = {**OK, "messages": [{"role": "user", "content": "x" * 2000}]}
    _err(c.post(URL, json=big), 413)

    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(10):
            yield b" " * 500  # no Content-Length: limit enforced while reading

    _err(c.post(URL, content=chunks()), 413)


def test_prompt_longer_than_context(backend: HFBackend) -> None:
    long = {**OK, "messages": [{"role": "user", "content": "word " * 200}]}
    err = _err(client(backend).post(URL, json=long), 400, "messages")
    assert "64" in err["message"] and err["code"] == "context_length_exceeded"
    # a large max_tokens is clamped to what fits rather than refused
    assert client(backend).post(URL, json={**OK, "max_tokens": 10_000}).status_code == 200


def test_unknown_route_and_method(backend: HFBackend) -> None:
    c = client(backend)
    _err(c.get("/v1/nothing"), 404)
    _err(c.get(URL), 405)


def test_chat_route_is_served_directly_and_stays_documented(backend: HFBackend) -> None:
    app = create_app(Gateway(ServeSettings(record=False, reload=False), backend))
    c = TestClient(app, raise_server_exceptions=False)
    spec = c.get("/openapi.json").json()
    assert "requestBody" in spec["paths"][URL]["post"]  # declared for clients and fuzzers
    assert c.post(URL, json=OK).status_code == 200
    _err(c.post(URL, content=b"{"), 400)
    _err(c.get(URL), 405)  # other methods go through FastAPI, still OpenAI-shaped
    seen: list[str] = []

    async def stub(request: Request) -> Response:
        seen.append(request.url.path)
        assert request.app is app  # handlers reach app.state as under FastAPI
        return Response(b"direct")

    app.fast_routes[("POST", URL)] = stub  # the dispatch, not FastAPI's router, picks it
    assert c.post(URL, json=OK).text == "direct" and seen == [URL]
    assert c.get("/v1/models").status_code == 200
