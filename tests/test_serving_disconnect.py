"""A client that disconnects before a non-streamed answer (issue 11): the turn is recorded as
aborted and never trained on, as for streams, and the generation stops early."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.serving.app import Gateway, create_app
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.build import build_app
from pipeline.serving.settings import ServeSettings
from pipeline.serving.threaded import running
from pipeline.settings import Settings

from .conftest import create_topic
from .test_serving_hf import FakeRecorder
from .test_serving_robustness import body, consume_all, metric, wait

MAX_TOKENS = 400


class SlowBackend:
    """The tiny model at one token per 50 ms; ``started`` is set once a few tokens are out."""

    def __init__(self, inner: HFBackend) -> None:
        self.inner = inner
        self.started = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, prompt_ids: list[int], params: Any) -> Any:
        n = 0
        async for item in self.inner.generate(prompt_ids, params):
            await asyncio.sleep(0.05)
            n += 1
            if n == 5:
                self.started.set()
            yield item


@pytest.fixture(scope="module")
def tiny() -> HFBackend:
    from pipeline.models.tiny import ensure_tiny_model

    return HFBackend(ensure_tiny_model(), workers=2)


def ask_and_hang_up(url: str, backend: SlowBackend, session: str) -> bytes:
    """POST a long non-streamed request, close the connection mid-generation; what came back
    before the close (nothing: the answer was not ready)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body(max_tokens=MAX_TOKENS, seed=3)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        f"X-Session-Id: {session}\r\n\r\n"
    ).encode()
    sock = socket.create_connection((host, int(port)))
    try:
        sock.sendall(head + payload)
        assert backend.started.wait(60), "generation never started"
        sock.setblocking(False)
        try:
            return sock.recv(65536)
        except BlockingIOError:
            return b""
    finally:
        sock.close()


def test_non_streamed_disconnect_is_recorded_as_aborted(tiny: HFBackend) -> None:
    rec = FakeRecorder()
    backend = SlowBackend(tiny)
    gw = Gateway(ServeSettings(), backend, rec)  # type: ignore[arg-type]
    with running(create_app(gw)) as url, httpx.Client(timeout=60) as c:
        assert ask_and_hang_up(url, backend, "hangs-up") == b""
        assert wait(lambda: bool(rec.interactions()), 10), "the partial turn is recorded"
        [aborted] = rec.interactions()
        assert aborted.finish_reason == "abort" and aborted.train is False
        assert aborted.turn == 0
        assert 0 < len(aborted.response_token_ids) < MAX_TOKENS, "generation was stopped"
        assert len(aborted.response_logprobs) == len(aborted.response_token_ids)
        assert metric(url, "liverl_gateway_turns_aborted_total") == 1
        assert metric(url, 'liverl_gateway_requests_total{status="499"}') == 1
        retry = c.post(
            f"{url}/v1/chat/completions", json=body(), headers={"X-Session-Id": "hangs-up"}
        )
        assert retry.status_code == 200 and retry.headers["x-liverl-turn"] == "1"
    assert [i.train for i in rec.interactions()] == [False, True]


@pytest.mark.integration
def test_non_streamed_disconnect_reaches_kafka_as_aborted(
    kafka_settings: Settings, admin: Any, unique: str, tmp_path: Path, tiny: HFBackend
) -> None:
    topic = f"test.interactions.{unique}"
    create_topic(admin, topic)
    cfg = ServeSettings(
        model_path="tiny",
        spool_dir=tmp_path / "spool",
        reload=False,
        turn_recovery_s=0,
        interactions_topic=topic,
    )
    backend = SlowBackend(tiny)
    app = build_app(cfg, kafka_settings, backend=backend)  # type: ignore[arg-type]
    with running(app) as url, httpx.Client(timeout=60) as c:
        ask_and_hang_up(url, backend, f"leaver-{unique}")
        r = c.post(
            f"{url}/v1/chat/completions", json=body(), headers={"X-Session-Id": f"leaver-{unique}"}
        )
        assert r.status_code == 200
        assert wait(lambda: app.state.recorder.backlog == 0, 30)
        assert metric(url, "liverl_gateway_turns_aborted_total") == 1
    got = sorted(consume_all(kafka_settings, topic, 2), key=lambda e: e.turn)
    assert [(e.turn, e.finish_reason, e.train) for e in got] == [
        (0, "abort", False),
        (1, got[1].finish_reason, True),
    ]
    assert got[1].finish_reason != "abort"
    assert 0 < len(got[0].response_token_ids) < MAX_TOKENS
