"""POST /v1/next_states/<source>: next-state sources by name, each one file owning its options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from pipeline.serving.app import Gateway, create_app
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.settings import ServeSettings, hash_key
from pipeline.serving.sources import SOURCES
from pipeline.settings import Settings, load_settings
from tests.test_serving_feedback import (
    ListRecorder,
    chat,
    consume_session,
    err,
    next_states_from_now,
)

URL = "/v1/next_states"


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    from pipeline.models.tiny import ensure_tiny_model

    return HFBackend(ensure_tiny_model(), workers=1, context_length=64)


def client(backend: HFBackend, recorder: Any = None, **cfg: Any) -> TestClient:
    gateway = Gateway(ServeSettings(reload=False, **cfg), backend, recorder)
    return TestClient(create_app(gateway), raise_server_exceptions=False)


def test_the_terminal_source_records_an_exit_code_on_the_last_turn(backend: HFBackend) -> None:
    rec = ListRecorder()
    c = client(backend, rec, source_options={"terminal": {"passing_exit_codes": [0, 5]}})
    assert [chat(c, "t-1") for _ in range(2)] == [0, 1]
    rec.records.clear()
    failed = c.post(
        f"{URL}/terminal",
        json={"session_id": "t-1", "command": "pytest -q", "exit_code": 1, "output": "2 failed"},
    )
    assert failed.status_code == 200, failed.text
    passed = c.post(
        f"{URL}/terminal", json={"turn": 0, "exit_code": 5}, headers={"X-Session-Id": "t-1"}
    )
    assert passed.status_code == 200, passed.text
    (_, a), (_, b) = rec.records
    assert (a.kind, a.turn, a.exit_code, a.score, a.content, a.role) == (
        "terminal",
        1,
        1,
        -1.0,
        "2 failed",
        "tool",
    )
    assert a.detail == {"command": "pytest -q", "key_id": "loopback:terminal"}
    assert (b.turn, b.exit_code, b.score) == (0, 5, 1.0)  # 5 passes by the source's options
    body = failed.json()
    assert body["recorded"] is True and body["data"][0] == {
        "id": a.event_id,
        "session_id": "t-1",
        "turn": 1,
        "kind": "terminal",
        "score": -1.0,
    }


def test_bad_posts_are_4xx_and_record_nothing(backend: HFBackend) -> None:
    rec = ListRecorder()
    c = client(backend, rec, next_state_max_chars=100, next_state_max_body_bytes=4096)
    chat(c, "t-2")
    rec.records.clear()
    err(c.post(f"{URL}/nope", json={}), 404, "source")
    err(c.post(f"{URL}/terminal", json={"session_id": "t-2"}), 422, "exit_code")
    err(c.post(f"{URL}/terminal", json={"session_id": "t-2", "exit_code": "1"}), 422)
    err(c.post(f"{URL}/terminal", json={"exit_code": 0}), 400, "session_id")
    err(c.post(f"{URL}/terminal", json={"session_id": "t-9", "exit_code": 0}), 400)
    err(
        c.post(f"{URL}/terminal", json={"session_id": "t-2", "turn": 3, "exit_code": 0}),
        400,
        "turn",
    )
    err(
        c.post(f"{URL}/terminal", json={"session_id": "t-2", "exit_code": 0, "output": "x" * 101}),
        400,
        "output",
    )
    err(
        c.post(
            f"{URL}/terminal", json={"session_id": "t-2", "exit_code": 0, "command": "y" * 1001}
        ),
        422,
        "command",
    )
    err(
        c.post(f"{URL}/terminal", json={"session_id": "t-2", "exit_code": 0, "output": "z" * 5000}),
        413,
    )  # over the body limit
    deep: Any = 0
    for _ in range(200):
        deep = [deep]
    assert (
        400
        <= c.post(
            f"{URL}/terminal", json={"session_id": "t-2", "exit_code": 0, "x": deep}
        ).status_code
        < 500
    )
    assert rec.records == []
    off = client(backend, rec, sources=[])
    err(off.post(f"{URL}/terminal", json={"session_id": "t-2", "exit_code": 0}), 404, "source")


def test_only_the_sessions_owner_or_an_operator_posts_its_outcomes(backend: HFBackend) -> None:
    """Issue 37: any key could post an exit code for any session. Now another user's key
    gets a 403 and nothing is recorded; the owner and an operator may post."""
    from tests.test_serving_feedback import BOB, MALLORY, OPS, bearer, keyed

    rec = ListRecorder()
    c = keyed(backend, rec)
    chat(c, "t-bob", **bearer(BOB))
    rec.records.clear()
    post = {"session_id": "t-bob", "exit_code": 1, "output": "2 failed"}
    for doc in (post, {**post, "turn": 0}):
        e = err(c.post(f"{URL}/terminal", json=doc, headers=bearer(MALLORY)), 403, "session_id")
        assert e["code"] == "session_forbidden"
    assert rec.records == []
    assert c.post(f"{URL}/terminal", json=post, headers=bearer(BOB)).status_code == 200
    assert (
        c.post(f"{URL}/terminal", json={**post, "exit_code": 0}, headers=bearer(OPS)).status_code
        == 200
    )
    assert [ns.detail["user_id"] for _, ns in rec.records] == ["bob", "review-tool"]  # type: ignore[attr-defined]


class EchoVote:
    """A plug-in source that turns a post into a ``feedback`` vote named by its ``source``
    field and says nothing of who posted it."""

    def __init__(self, _options: Any) -> None:
        pass

    def next_states(self, request: Any) -> list[Any]:
        from pipeline import events

        b = request.body
        return [
            events.NextState(
                event_id=events.new_event_id(),
                producer=events.Producer(component="echo-vote", version="1"),
                session_id=b["session_id"],
                turn=b["turn"],
                kind="feedback",
                content=b["text"],
                score=-1.0,
                source=b["source"],
            )
        ]


def test_a_source_cannot_multiply_a_callers_votes(backend: HFBackend) -> None:
    """Issue 37: 32 posts with different ``source`` values counted as 32 voters (a next state
    without ``detail.key_id`` votes as its source). The route now stamps who posted every
    next state, so they are one voter; and past the turn's cap (8) nothing more is recorded,
    and a post equal to one recorded counts once."""
    from pipeline.processors.rewards import voter_of
    from pipeline.serving.sources import register
    from tests.test_serving_feedback import BOB, bearer

    register("echo-vote", EchoVote)
    for keys, who in (([], {"key:loopback:echo-vote"}), ([BOB], {f"key:{hash_key(BOB)[:16]}"})):
        rec = ListRecorder()
        cfg = {"keys": [{"sha256": hash_key(k), "user": "bob"} for k in keys]}
        c = client(backend, rec, sources=["echo-vote"], **cfg)
        auth = bearer(BOB)
        chat(c, "v-1", **auth)
        rec.records.clear()
        statuses = [
            c.post(
                f"{URL}/echo-vote",
                headers=auth,
                json={"session_id": "v-1", "turn": 0, "source": f"src-{i}", "text": f"bad {i}"},
            ).status_code
            for i in range(32)
        ]
        assert statuses == [200] * 8 + [429] * 24
        votes = [ns for _, ns in rec.records]
        assert len(votes) == 8 and {voter_of(ns) for ns in votes} == who  # type: ignore[arg-type]
        repeat = c.post(
            f"{URL}/echo-vote",
            headers=auth,
            json={"session_id": "v-1", "turn": 0, "source": "src-99", "text": "bad 0"},
        )
        assert repeat.status_code == 200 and repeat.json()["data"][0]["repeat"] is True
        assert repeat.json()["data"][0]["id"] == votes[0].event_id and len(rec.records) == 8


def test_sources_and_their_options_are_checked_when_settings_load() -> None:
    with pytest.raises(ValueError, match=r"unknown next-state source 'termnal'"):
        ServeSettings(sources=["termnal"])
    with pytest.raises(ValueError, match=r"serve.source_options.terminal.passing_exit_code"):
        ServeSettings(source_options={"terminal": {"passing_exit_code": [1]}})
    with pytest.raises(ValueError, match=r"source 'terminal' is not enabled"):
        ServeSettings(sources=[], source_options={"terminal": {}})
    with pytest.raises(ValueError, match=r"serve plugin 'no.such' cannot be imported"):
        ServeSettings(plugins=["no.such"])


def test_a_source_plugin_is_configured_from_toml(tmp_path: Path, backend: HFBackend) -> None:
    path = tmp_path / "liverl.toml"
    path.write_text(
        '[serve]\nplugins = ["tests.toy_source"]\nsources = ["terminal", "toy-ci"]\n'
        "[serve.source_options.toy-ci]\nfailure_score = -0.5\n"
    )
    cfg = load_settings(path).serve
    assert "toy-ci" in SOURCES and cfg.sources == ["terminal", "toy-ci"]
    rec = ListRecorder()
    c = TestClient(
        create_app(Gateway(cfg.model_copy(update={"reload": False}), backend, rec)),
        raise_server_exceptions=False,
    )
    resp = c.post(f"{URL}/toy-ci", json={"session_id": "ci-1", "turn": 4, "status": "failure"})
    assert resp.status_code == 200, resp.text
    [(_, ns)] = rec.records
    assert (ns.kind, ns.turn, ns.score, ns.source) == ("test_result", 4, -0.5, "toy-ci")
    err(c.post(f"{URL}/toy-ci", json={"session_id": "ci-1", "turn": 4, "status": "maybe"}), 422)
    with pytest.raises(ValueError, match=r"serve.source_options.toy-ci.failure_score"):
        ServeSettings(
            plugins=["tests.toy_source"],
            sources=["toy-ci"],
            source_options={"toy-ci": {"failure_score": 0.5}},
        )


@pytest.mark.integration
def test_a_plugin_source_reaches_next_states_on_the_broker(
    kafka_settings: Settings, unique: str, tmp_path: Path
) -> None:
    from pipeline.serving.build import build_app
    from pipeline.serving.threaded import running

    sid = f"ci-e2e-{unique}"
    consumer = next_states_from_now(kafka_settings, f"src-{unique}")
    cfg = ServeSettings(
        model_path="tiny",
        spool_dir=tmp_path / "spool",
        reload=False,
        turn_recovery_s=0,
        plugins=["tests.toy_source"],
        sources=["terminal", "toy-ci"],
    )
    app = build_app(cfg, kafka_settings)
    with running(app) as url, httpx.Client(timeout=60) as c:
        assert chat(c, sid, url) == 0
        ci = c.post(f"{url}{URL}/toy-ci", json={"session_id": sid, "turn": 0, "status": "success"})
        term = c.post(f"{url}{URL}/terminal", json={"session_id": sid, "exit_code": 2})
        assert ci.status_code == term.status_code == 200, (ci.text, term.text)
        assert c.post(f"{url}{URL}/toy-ci", json={"session_id": sid}).status_code == 422
    got = {ns.event_id: ns for ns in consume_session(consumer, sid, want=2)}
    ids = {ci.json()["data"][0]["id"], term.json()["data"][0]["id"]}
    assert set(got) == ids, "exactly the two good posts"
    kinds = sorted((ns.kind, ns.score, ns.source) for ns in got.values())
    assert kinds == [("terminal", -1.0, "terminal"), ("test_result", 1.0, "toy-ci")]
