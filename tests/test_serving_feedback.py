"""POST /v1/feedback: bounded, authenticated, and recorded as a ``feedback`` next state."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from confluent_kafka import Consumer, TopicPartition
from fastapi.testclient import TestClient

from pipeline import events
from pipeline.kafka import names
from pipeline.serving.app import Gateway, create_app
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.recorder import Recorder
from pipeline.serving.settings import ServeSettings, hash_key
from pipeline.serving.spool import Spool
from pipeline.settings import Settings

MODEL = "liverl-tiny-v1"
URL = "/v1/feedback"


class ListRecorder:
    """Stands in for the recorder: keeps what the gateway hands over."""

    backlog = 0

    def __init__(self) -> None:
        self.records: list[tuple[str, events.Event]] = []

    def record(self, topic: str, event: events.Event) -> None:
        self.records.append((topic, event))


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    from pipeline.models.tiny import ensure_tiny_model

    return HFBackend(ensure_tiny_model(), workers=1, context_length=64)


def client(backend: HFBackend, recorder: Any = None, **cfg: Any) -> TestClient:
    settings = ServeSettings(reload=False, **cfg)
    gateway = Gateway(settings, backend, recorder)
    return TestClient(create_app(gateway), raise_server_exceptions=False)


def chat(c: TestClient | httpx.Client, session: str, base: str = "", **headers: str) -> int:
    """One recorded turn of ``session``; returns its turn number."""
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    resp = c.post(
        f"{base}/v1/chat/completions", json=body, headers={"X-Session-Id": session, **headers}
    )
    assert resp.status_code == 200, resp.text
    return int(resp.headers["x-liverl-turn"])


def err(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    if param is not None:
        assert body["param"] == param, body
    return body


# ---- validation, limits and access: 4xx and nothing recorded ------------------------------------


def test_feedback_on_the_last_turn_and_on_a_numbered_one(backend: HFBackend) -> None:
    rec = ListRecorder()
    c = client(backend, rec)
    assert [chat(c, "fb-1") for _ in range(2)] == [0, 1]
    rec.records.clear()
    resp = c.post(URL, json={"session_id": "fb-1", "thumbs": "up"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body | {"id": "x"} == {
        "object": "feedback",
        "id": "x",
        "session_id": "fb-1",
        "turn": 1,
        "kind": "feedback",
        "score": 1.0,
        "recorded": True,
        "paired": True,
    }
    resp = c.post(URL, json={"session_id": "fb-1", "turn": 0, "score": -0.5, "text": "too long"})
    assert resp.status_code == 200, resp.text
    (t1, up), (t2, scored) = rec.records
    assert t1 == t2 == "liverl.next_states.v1"
    assert isinstance(up, events.NextState) and isinstance(scored, events.NextState)
    assert (up.kind, up.turn, up.score, up.content) == ("feedback", 1, 1.0, "")
    assert up.source == "feedback"
    assert up.event_id == body["id"] and up.detail["thumbs"] == "up"
    assert (scored.turn, scored.score, scored.content) == (0, -0.5, "too long")
    assert scored.scope == "turn"
    # text alone is feedback for the judges to read: no explicit score
    c.post(URL, json={"session_id": "fb-1", "text": "use bullet points"})
    assert rec.records[-1][1].score is None  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"turn": 0, "thumbs": "up"}, 422, "session_id"),
        ({"session_id": "", "thumbs": "up"}, 422, "session_id"),
        ({"session_id": "s" * 257, "thumbs": "up"}, 422, "session_id"),
        ({"session_id": "fb-2", "thumbs": "sideways"}, 422, "thumbs"),
        ({"session_id": "fb-2", "score": 1.5}, 422, "score"),
        ({"session_id": "fb-2", "score": -1.01}, 422, "score"),
        ({"session_id": "fb-2", "score": "1"}, 422, "score"),
        ({"session_id": "fb-2", "score": True}, 422, "score"),
        ({"session_id": "fb-2", "turn": -1, "thumbs": "up"}, 422, None),
        ({"session_id": "fb-2", "turn": "first", "thumbs": "up"}, 422, None),
        ({"session_id": "fb-2", "turn": 1.0, "thumbs": "up"}, 422, None),
        ({"session_id": "fb-2", "text": 3}, 422, "text"),
        ({"session_id": "fb-2", "thumbs": "up", "extra": 1}, 422, "extra"),
        ({"session_id": "fb-2"}, 400, None),  # nothing to say
        ({"session_id": "fb-2", "text": ""}, 400, None),
        ({"session_id": "fb-2", "thumbs": "up", "score": -0.5}, 400, "score"),  # contradiction
        ({"session_id": "fb-2", "turn": 5, "thumbs": "up"}, 400, "turn"),  # not recorded yet
        ({"session_id": "never-seen", "thumbs": "up"}, 400, "session_id"),  # "last" unknown
        (["not", "an", "object"], 400, None),
    ],
)
def test_bad_payloads_are_4xx_and_record_nothing(
    backend: HFBackend, body: Any, status: int, param: str | None
) -> None:
    rec = ListRecorder()
    c = client(backend, rec)
    chat(c, "fb-2")
    rec.records.clear()
    e = err(c.post(URL, json=body), status, param)
    if param == "session_id" and status == 400:
        assert e["code"] == "session_not_found"
    assert rec.records == []


def test_not_json_is_400(backend: HFBackend) -> None:
    rec = ListRecorder()
    c = client(backend, rec)
    err(c.post(URL, content=b"{nope", headers={"Content-Type": "application/json"}), 400)
    assert rec.records == []


def test_each_limit_is_crossed_at_the_edge(backend: HFBackend) -> None:
    rec = ListRecorder()
    c = client(
        backend, rec, next_state_max_body_bytes=2048, next_state_max_chars=100, max_json_depth=4
    )
    chat(c, "fb-3")
    rec.records.clear()
    ok = {"session_id": "fb-3", "text": "x" * 100}
    assert c.post(URL, json=ok).status_code == 200
    e = err(c.post(URL, json={**ok, "text": "x" * 101}), 400, "text")  # text length
    assert e["code"] == "text_too_long"
    e = err(c.post(URL, json={**ok, "text": "x" * 3000}), 413)  # body size, declared
    assert e["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield b'{"session_id": "fb-3", "text": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}'

    err(c.post(URL, content=chunks()), 413)
    deep: Any = "x"
    for _ in range(4):
        deep = [deep]
    e = err(c.post(URL, json={**ok, "text": deep}), 400)  # JSON depth (5 > 4)
    assert e["code"] == "json_too_deep"
    assert len(rec.records) == 1  # only the first, valid one


def test_authenticated_and_rate_limited_like_chat(backend: HFBackend) -> None:
    rec = ListRecorder()
    c = client(
        backend, rec, api_key_hashes=[hash_key("k1")], rate_limit_per_min=6, rate_limit_burst=2
    )
    good = {"Authorization": "Bearer k1"}
    chat(c, "fb-4", **good)
    rec.records.clear()
    body = {"session_id": "fb-4", "thumbs": "down"}
    err(c.post(URL, json=body), 401)
    err(c.post(URL, json=body, headers={"Authorization": "Bearer k2"}), 401)
    assert c.post(URL, json=body, headers=good).status_code == 200
    e = err(c.post(URL, json=body, headers=good), 429)  # burst of 2 spent (chat + feedback)
    assert e["code"] == "rate_limit_exceeded"
    assert len(rec.records) == 1


def test_feedback_for_a_session_this_gateway_never_saw_is_202_pending(
    backend: HFBackend,
) -> None:
    """Issue 25: it answered 200 ``recorded: true`` and was dead-lettered 30 s later (no
    interaction came); the gateway cannot know the turn, so it says the pairing is pending."""
    rec = ListRecorder()
    c = client(backend, rec)
    resp = c.post(URL, json={"session_id": "elsewhere", "turn": 3, "thumbs": "down"})
    assert resp.status_code == 202, resp.text
    assert resp.json()["recorded"] is True and resp.json()["paired"] == "pending"
    ((_, ns),) = rec.records
    assert (ns.session_id, ns.turn) == ("elsewhere", 3)  # type: ignore[attr-defined]
    chat(c, "here")
    known = c.post(URL, json={"session_id": "here", "turn": 0, "thumbs": "up"})
    assert known.status_code == 200 and known.json()["paired"] is True


def test_recording_off_accepts_and_says_so(backend: HFBackend) -> None:
    c = client(backend, None, record=False)
    chat(c, "fb-5")
    resp = c.post(URL, json={"session_id": "fb-5", "thumbs": "up"})
    assert resp.status_code == 200 and resp.json()["recorded"] is False


def test_lost_recording_is_503(backend: HFBackend, tmp_path: Path) -> None:
    rec = Recorder(Settings(), Spool(tmp_path / "spool"))
    c = client(backend, rec)
    chat(c, "fb-6")
    queued = rec.backlog  # the chat turn (the recorder is not started)
    rec.problem = "spool not writable and Kafka unreachable"
    e = err(c.post(URL, json={"session_id": "fb-6", "thumbs": "up"}), 503)
    assert e["code"] == "recording_unavailable"
    assert rec.backlog == queued


# ---- who may rate a session, and who a voter is (issue 37) ---------------------------------------

BOB, MALLORY, OPS = "sk-bob", "sk-mallory", "sk-ops"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def keyed(backend: HFBackend, recorder: Any = None, **cfg: Any) -> TestClient:
    """A gateway with three keys: bob's, mallory's (users) and a review tool's (operator)."""
    keys = [
        {"sha256": hash_key(BOB), "user": "bob"},
        {"sha256": hash_key(MALLORY), "user": "mallory"},
        {"sha256": hash_key(OPS), "user": "review-tool", "role": "operator"},
    ]
    return client(backend, recorder, keys=keys, **cfg)


def test_only_the_sessions_owner_or_an_operator_rates_it(backend: HFBackend) -> None:
    """Issue 37: with keys, nothing checked that the caller owned the session: mallory's key
    rated bob's turns. Now bob's first turn makes the session his; another user's key gets an
    OpenAI-style 403 and records nothing, an operator key (a review tool) may rate it."""
    from types import SimpleNamespace

    rec = ListRecorder()
    rec.spool = SimpleNamespace(size_bytes=lambda: 0)  # type: ignore[attr-defined]  # /metrics
    c = keyed(backend, rec)
    assert chat(c, "bob-1", **bearer(BOB)) == 0
    rec.records.clear()
    body = {"session_id": "bob-1", "turn": 0, "thumbs": "down", "text": "awful"}
    for doc in (body, {**body, "turn": "last"}):
        e = err(c.post(URL, json=doc, headers=bearer(MALLORY)), 403, "session_id")
        assert (e["type"], e["code"]) == ("permission_error", "session_forbidden")
    assert rec.records == []
    assert (
        c.post(URL, json={**body, "thumbs": "up", "text": "great"}, headers=bearer(BOB)).status_code
        == 200
    )
    assert c.post(URL, json=body, headers=bearer(OPS)).status_code == 200
    (_, own), (_, review) = rec.records
    assert (own.detail["user_id"], review.detail["user_id"]) == ("bob", "review-tool")
    assert own.detail["key_id"] == hash_key(BOB)[:16] != review.detail["key_id"]
    # Nor may mallory take a turn in bob's session (its next state would be bob's turn's).
    msgs = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    e = err(
        c.post(
            "/v1/chat/completions", json=msgs, headers={"X-Session-Id": "bob-1", **bearer(MALLORY)}
        ),
        403,
        "session_id",
    )
    assert e["code"] == "session_forbidden"
    assert chat(c, "mallory-1", **bearer(MALLORY)) == 0  # her own sessions are hers
    assert (
        'liverl_gateway_posts_not_recorded_total{reason="forbidden"} 2.0' in c.get("/metrics").text
    )


def test_forged_bearer_tokens_are_one_voter_without_keys(
    backend: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: without keys every bearer string was a voter and a feedback rate-limit
    bucket of its own: 100 forged tokens were 100 votes, none limited. On loopback a token
    names nobody: every caller is the one voter ``loopback``, with one bucket (burst 10)."""
    from pipeline.processors.rewards import voter_of
    from pipeline.serving import auth

    clock = [1_000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: clock[0])
    rec = ListRecorder()
    c = client(backend, rec)
    chat(c, "fb-forged")
    rec.records.clear()
    statuses = [
        c.post(
            URL,
            json={"session_id": "fb-forged", "turn": 0, "thumbs": "down"},
            headers=bearer(f"forged-{i}"),
        ).status_code
        for i in range(100)
    ]
    assert statuses == [200] * 10 + [429] * 90
    votes = [ns for _, ns in rec.records]
    assert len(votes) == 10
    assert {voter_of(ns) for ns in votes} == {"key:loopback"}  # type: ignore[arg-type]


# ---- end to end on the real broker -------------------------------------------------------------


def next_states_from_now(kafka: Settings, group: str) -> Consumer:
    """A consumer of next_states positioned at its current end (sees only what follows)."""
    c = Consumer(kafka.kafka_client_config(**{"group.id": group}))
    topic = names.NEXT_STATES
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    ends = [c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts]
    c.assign([TopicPartition(topic, p, end) for p, end in zip(parts, ends, strict=True)])
    return c


def consume_session(c: Consumer, session: str, want: int, settle_s: float = 3.0) -> list[Any]:
    """The session's next states: waits for ``want``, then ``settle_s`` more for extras."""
    got: list[Any] = []
    deadline = time.monotonic() + 60
    settle_until: float | None = None
    while time.monotonic() < deadline:
        for msg in c.consume(100, timeout=0.5):
            if msg.error() is None and msg.key() == session.encode():
                got.append(events.decode(msg.value(), "next_state"))
        if len(got) >= want and settle_until is None:
            settle_until = time.monotonic() + settle_s
        if settle_until is not None and time.monotonic() > settle_until:
            break
    c.close()
    return got


def gateway_app(tmp_path: Path, kafka: Settings):  # type: ignore[no-untyped-def]
    from pipeline.serving.build import build_app

    cfg = ServeSettings(
        model_path="tiny", spool_dir=tmp_path / "spool", reload=False, turn_recovery_s=0
    )
    return build_app(cfg, kafka)


@pytest.mark.integration
def test_feedback_reaches_next_states_on_the_broker(
    kafka_settings: Settings, unique: str, tmp_path: Path
) -> None:
    sid = f"fb-e2e-{unique}"
    consumer = next_states_from_now(kafka_settings, f"fb-{unique}")
    app = gateway_app(tmp_path, kafka_settings)
    from pipeline.serving.threaded import running

    with running(app) as url, httpx.Client(timeout=60) as c:
        assert [chat(c, sid, url) for _ in range(2)] == [0, 1]
        last = c.post(
            f"{url}{URL}",
            json={
                "session_id": sid,
                "thumbs": "down",
                "text": "Too formal. Use simple steps please.",
            },
        )
        assert last.status_code == 200, last.text
        first = c.post(f"{url}{URL}", json={"session_id": sid, "turn": 0, "score": 0.5})
        assert first.status_code == 200, first.text
        for bad in (
            {"session_id": sid, "score": 2},
            {"session_id": sid, "text": "x" * 20_000},
            {"session_id": sid, "turn": 9, "thumbs": "up"},
        ):
            assert 400 <= c.post(f"{url}{URL}", json=bad).status_code < 500
        deadline = time.monotonic() + 30
        while app.state.recorder.backlog and time.monotonic() < deadline:
            time.sleep(0.1)
    got = {ns.event_id: ns for ns in consume_session(consumer, sid, want=2)}
    assert set(got) == {last.json()["id"], first.json()["id"]}, "exactly the two good ones"
    down, half = got[last.json()["id"]], got[first.json()["id"]]
    assert (down.session_id, down.turn, down.kind, down.score, down.role, down.source) == (
        sid,
        1,
        "feedback",
        -1.0,
        "user",
        "feedback",
    )
    assert down.content == "Too formal. Use simple steps please."
    assert down.detail["thumbs"] == "down" and down.producer.component == "gateway"
    assert (half.turn, half.score, half.content, half.scope) == (0, 0.5, "", "turn")


def test_feedback_has_a_default_per_key_rate_limit(
    backend: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's flood: 1,000 feedbacks on turn 0 in a burst all answered 200 (no rate limit
    by default). Now serve.feedback_rate_limit_per_min (30/min, burst 10) applies per key, on
    its own bucket: with the clock held, the first 10 pass and 990 get an OpenAI-style 429 with
    Retry-After (1 token per 2 s: 2 s); 2 s later one more passes; another key and chat are not
    affected; every refusal is counted in /metrics."""
    from pipeline.serving import auth

    clock = [1_000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: clock[0])
    from types import SimpleNamespace

    rec = ListRecorder()
    rec.spool = SimpleNamespace(size_bytes=lambda: 0)  # type: ignore[attr-defined]  # /metrics
    c = keyed(backend, rec)  # keys: without them every loopback caller is one voter
    key = bearer(BOB)
    assert chat(c, "fb-flood", **key) == 0
    rec.records.clear()
    text = "x" * 2048
    statuses = []
    for i in range(1000):
        body = {
            "session_id": "fb-flood",
            "turn": 0,
            "thumbs": "down" if i % 10 == 0 else "up",
            "text": text,
        }
        resp = c.post(URL, json=body, headers=key)
        statuses.append(resp.status_code)
        if resp.status_code == 429:
            e = err(resp, 429)
            assert (e["type"], e["code"]) == ("rate_limit_error", "rate_limit_exceeded")
            assert e["message"] == (
                "Feedback rate limit (serve.feedback_rate_limit_per_min) "
                "reached for this key; retry in 2s."
            )
            assert resp.headers["retry-after"] == "2"
    assert statuses == [200] * 10 + [429] * 990
    assert len(rec.records) == 10
    clock[0] += 2.0
    assert (
        c.post(
            URL, json={"session_id": "fb-flood", "turn": 0, "thumbs": "up"}, headers=key
        ).status_code
        == 200
    )
    assert (
        c.post(
            URL, json={"session_id": "fb-flood", "turn": 0, "thumbs": "up"}, headers=bearer(OPS)
        ).status_code
        == 200
    )
    assert chat(c, "fb-flood", **key) == 1
    metrics = c.get("/metrics").text
    assert "liverl_gateway_feedback_rate_limited_total 990.0" in metrics, metrics
    off = client(backend, ListRecorder(), feedback_rate_limit_per_min=0)
    chat(off, "fb-off")
    assert all(
        off.post(URL, json={"session_id": "fb-off", "thumbs": "up"}).status_code == 200
        for _ in range(20)
    )
