"""The LLM PRM against a real local OpenAI-compatible HTTP endpoint (a scripted stub)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pipeline.events import examples
from pipeline.processors.judges import LlmJudge, TurnContext

HINT = "[HINT_START]Run the whole test suite before answering.[HINT_END] \\boxed{1}"
SCRIPTS = {  # case -> PRM answers in order (cycled)
    "majority": ["ok \\boxed{1}", "\\boxed{-1}", "fine \\boxed{1}"],
    "tie": ["\\boxed{1}", "\\boxed{-1}", "\\boxed{0}"],
    "malformed": ["looks good", "\\boxed{7}", "\\boxed{-1}"],
}
calls: dict[str, int] = defaultdict(int)


def make_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def complete(request: Request):  # type: ignore[no-untyped-def]
        body = await request.json()
        prompt = body["messages"][0]["content"]
        case = prompt.split("CASE:")[1].split()[0]
        is_hint = "[HINT_START]" in prompt
        n = calls[(case, is_hint)]
        calls[(case, is_hint)] += 1
        if case == "slow":
            await asyncio.sleep(2.0)
        if case == "flaky" and n == 0:
            return JSONResponse({"error": "overloaded"}, status_code=500)
        if case == "broken":
            return JSONResponse({"unexpected": True})
        if is_hint:
            text = HINT if case == "majority" else "nothing to add \\boxed{-1}"
        else:
            answers = SCRIPTS.get(case, ["\\boxed{1}"])
            text = answers[n % len(answers)]
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}

    return app


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(make_app(), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(10)


def run(endpoint: str, case: str, **kw):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        judge = LlmJudge(endpoint, "stub", backoff_s=0.01, **kw)
        state = dataclasses.replace(examples.examples()["next_state"], content=f"CASE:{case} x")
        try:
            return await judge.judge(TurnContext("s", 3, "fix it", "done"), state)
        finally:
            await judge.aclose()

    return asyncio.run(go())


def test_plurality_of_three_votes_and_hints(endpoint):
    v = run(endpoint, "majority")
    assert (v.score, sorted(v.votes)) == (1, [-1, 1, 1])
    assert v.hints == ["Run the whole test suite before answering."]  # 3 equal hints -> 1
    assert v.error is None


def test_tie_gives_zero(endpoint):
    v = run(endpoint, "tie", hints=False)
    assert (v.score, sorted(v.votes)) == (0, [-1, 0, 1])


def test_unparsable_votes_do_not_count(endpoint):
    v = run(endpoint, "malformed", hints=False)
    assert v.score == -1  # the only valid vote
    assert sorted(v.votes, key=str) == [-1, None, None]


def test_timeout_gives_neutral_score_with_error(endpoint):
    v = run(endpoint, "slow", timeout_s=0.3, retries=1, votes=2, hints=False)
    assert (v.score, v.votes, v.error) == (0, [None, None], "timeout")


def test_server_error_is_retried(endpoint):
    v = run(endpoint, "flaky", votes=1, hints=False)
    assert (v.score, v.votes, v.error) == (1, [1], None)
    assert calls[("flaky", False)] == 2


def test_malformed_response_is_recorded_not_raised(endpoint):
    v = run(endpoint, "broken", votes=1, hints=False)
    assert v.score == 0 and v.votes == [None]
    assert v.error.startswith("bad response")


def test_unreachable_endpoint_is_neutral():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    v = run(f"http://127.0.0.1:{port}/v1", "x", votes=1, retries=1, hints=False)
    assert v.score == 0 and v.error.startswith("transport")
