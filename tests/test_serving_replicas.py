"""Gateway replicas without sticky sessions: any replica serves any turn of a session.

Turn numbers are conversation positions (the answers a request already carries) and each turn
gets a per-session monotonic timestamp, so two replicas that share no memory number a
conversation alike, and pairing orders it by (ts_ms, turn, event id). The integration test runs
one conversation through one gateway and the same conversation through two replicas in turn, on
the real broker and the real worker, and compares what pairing and assembly made of each.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from confluent_kafka import Consumer, TopicPartition

from pipeline import events
from pipeline.events import examples
from pipeline.kafka import names
from pipeline.processors.config import DEFAULT_RULES
from pipeline.processors.pairing import Pairer
from pipeline.processors.penalties import load_rules
from pipeline.processors.rewards import Assembler
from pipeline.serving.sessions import Sessions, conversation_position
from pipeline.settings import Settings
from pipeline.stack import free_port, gateway_components

# ---- numbering and stamping (no broker) ---------------------------------------------------------


def test_two_replicas_number_a_conversation_like_one() -> None:
    one, a, b = Sessions(), Sessions(), Sessions()
    roles: list[str] = ["system", "user"]
    single, replicated = [], []
    for t in range(5):
        position = conversation_position(roles)
        single.append(one.next_turn("s", position))
        replicated.append((a if t % 2 == 0 else b).next_turn("s", position))
        roles += ["assistant", "user"]
    assert single == replicated == [0, 1, 2, 3, 4]


def test_one_replica_still_counts_when_the_history_does_not_grow() -> None:
    s = Sessions()
    # a client that resends no history, then a retry after an abort (same messages): a counter
    assert [s.next_turn("s", 0) for _ in range(3)] == [0, 1, 2]
    assert s.next_turn("s", 1) == 3  # compacted history: never back below what was given here
    assert s.next_turn("s", 7) == 7  # another replica served turns 4..6: the position says so


def test_stamps_are_monotonic_per_session_even_when_the_clock_steps_back() -> None:
    s = Sessions()
    assert s.stamp("s", now_ms=1_000) == 1_000
    assert s.stamp("s", now_ms=1_000) == 1_001  # same millisecond: still after
    assert s.stamp("s", now_ms=900) == 1_002  # the clock stepped back
    assert s.stamp("other", now_ms=900) == 900  # per session
    s.close("s")
    assert s.stamp("s", now_ms=950) == 950  # a closed session starts over


# ---- pairing orders by (ts_ms, turn, event id) ---------------------------------------------------

SYS = {"role": "system", "content": "sys"}


def inter(eid: str, turn: int, ts_ms: int, n_answers: int, **kw) -> events.Interaction:  # type: ignore[no-untyped-def]
    msgs: list[dict] = [SYS, {"role": "user", "content": "q0"}]
    for i in range(n_answers):
        msgs += [
            {"role": "assistant", "content": f"a{i}"},
            {"role": "user", "content": f"q{i + 1}"},
        ]
    base = examples.interaction(prompt_tokens=4, response_tokens=2)
    return dataclasses.replace(
        base,
        event_id=eid,
        session_id="s",
        turn=turn,
        ts_ms=ts_ms,
        messages=msgs,
        tool_calls=[],
        **kw,
    )


def pairer() -> Pairer:
    return Pairer(load_rules(DEFAULT_RULES), "pairing-1")


def test_pairing_follows_timestamps_and_drops_redeliveries() -> None:
    p = pairer()
    st = p.on_interaction(None, inter("z0", 0, 1_000, 0)).state
    out = p.on_interaction(st, inter("a1", 1, 2_000, 1))  # "a1" < "z0": ids do not decide
    assert [(n.turn, n.parents, n.content) for n in out.next_states] == [(0, ["z0", "a1"], "q1")]
    st = out.state
    for again in (inter("z0", 0, 1_000, 0), inter("a1", 1, 2_000, 1)):
        assert p.on_interaction(st, again).next_states == []  # redelivered: nothing new
    late = p.on_interaction(st, inter("late", 1, 1_500, 1))  # before the last turn: not paired
    assert late.next_states == [] and late.state == st


def test_pairing_takes_a_reused_number_that_comes_later() -> None:
    """An aborted turn retried on another replica: the same number, a later timestamp."""
    p = pairer()
    st = p.on_interaction(None, inter("i0", 0, 1_000, 0)).state
    st = p.on_interaction(
        st, inter("abort1", 1, 2_000, 1, train=False, finish_reason="abort")
    ).state
    retry = p.on_interaction(st, inter("retry1", 1, 3_000, 1))
    assert retry.next_states == []  # the aborted turn never pairs
    nxt = p.on_interaction(retry.state, inter("i2", 2, 4_000, 2, session_done=True))
    assert [(n.turn, n.kind, n.parents) for n in nxt.next_states] == [
        (1, "user_reply", ["retry1", "i2"]),
        (2, "session_end", ["i2"]),
    ]


def test_assembly_keeps_the_later_of_two_turns_with_one_number() -> None:
    asm = Assembler()
    retry = inter("retry", 0, 3_000, 0)
    aborted = inter("abort", 0, 2_000, 0, train=False, finish_reason="abort")
    for order in ([aborted, retry], [retry, aborted]):  # either arrival order
        state = None
        for i in order:
            state = asm.on_interaction(state, i)
        turn0 = state.turns[0]
        assert turn0.interaction.event_id == "retry" and not turn0.skip
    older = inter("older", 0, 1_000, 0)
    assert asm.on_interaction(state, older).turns[0].interaction.event_id == "retry"


def test_assembly_is_ready_with_turn_numbers_that_never_existed() -> None:
    """Turn 0 opted out of training (never recorded): turns 1 and 2 are the session."""
    asm = Assembler(grace_ms=60_000)
    state = None
    for t in (1, 2):
        state = asm.on_interaction(state, inter(f"i{t}", t, 1_000 * t, t))
        ns = dataclasses.replace(
            examples.examples()["next_state"],
            event_id=f"n{t}",
            session_id="s",
            turn=t,
            kind="session_end" if t == 2 else "user_reply",
        )
        state = asm.on_next_state(state, ns, now_ms=0)
        assert not asm.ready(state, 1)  # not judged yet
        prm = events.PrmScore(
            event_id=f"p{t}",
            producer=ns.producer,
            parents=[f"i{t}", f"n{t}"],
            session_id="s",
            turn=t,
            score=1,
            votes=[1],
            judge_id="j",
            judge_version="1",
        )
        pen = events.PathPenalty(
            event_id=f"x{t}",
            producer=ns.producer,
            parents=[f"i{t}"],
            session_id="s",
            turn=t,
            rule_ids=[],
            penalty=0.0,
            compliance_bonus=0.0,
            beta=0.5,
        )
        state = asm.on_penalty(asm.on_prm(state, prm), pen)
    assert asm.ready(state, 1)  # well before the grace period
    assert [s.turn for s in asm.complete(state, 1).samples] == [1, 2]


# ---- several processes on one port --------------------------------------------------------------


def test_up_runs_n_gateway_replicas_on_one_port() -> None:
    (one,) = gateway_components(1, "127.0.0.1", 8000, "p", [])
    assert one.name == "gateway" and "--reuse-port" not in one.args
    three = gateway_components(3, "127.0.0.1", 8000, "p", ["--model", "tiny"])
    assert [c.name for c in three] == ["gateway-0", "gateway-1", "gateway-2"]
    for i, c in enumerate(three):
        assert c.args[c.args.index("--port") + 1] == "8000"
        assert c.args[c.args.index("--replica-id") + 1] == f"gateway-{i}"
        assert "--reuse-port" in c.args and c.args[-5:-3] == ["--model", "tiny"]


@contextmanager
def serve_process(port: int, replica: str, tmp: Path) -> Iterator[subprocess.Popen]:
    env = {**os.environ, "LIVERL_STATE_DIR": str(tmp)}
    log = open(tmp / f"{replica}.log", "wb")  # noqa: SIM115 - closed once the process is
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "serve",
            "--port",
            str(port),
            "--model",
            "tiny",
            "--no-record",
            "--no-reload",
            "--workers",
            "1",
            "--replica-id",
            replica,
            "--reuse-port",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_two_serve_processes_share_one_port(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with ExitStack() as stack:
        procs = [stack.enter_context(serve_process(port, f"r{i}", tmp_path)) for i in range(2)]
        ready: set[str] = set()
        deadline = time.monotonic() + 180
        while len(ready) < 2:  # until both answer (the first one up takes every connection)
            logs = [(tmp_path / f"r{i}.log").read_text()[-2000:] for i in range(2)]
            assert time.monotonic() < deadline, logs
            assert all(p.poll() is None for p in procs), logs  # a second bind would fail
            try:
                with httpx.Client(timeout=10) as c:  # a new connection each time
                    ready.add(c.get(f"{url}/healthz").json()["replica_id"])
            except httpx.TransportError:
                time.sleep(0.2)
        # Both are up; fresh connections are spread over both (2**-39 to miss one by chance).
        seen = []
        for _ in range(40):
            with httpx.Client(timeout=10) as c:
                seen.append(c.get(f"{url}/healthz").json()["replica_id"])
        assert set(seen) == {"r0", "r1"}, seen


# ---- the real loop: one gateway vs two replicas in turn ------------------------------------------


def conversation() -> list[str]:
    """The user's side: what is sent after each answer (the rule judge scores replies)."""
    return ["Name a prime number.", "That's wrong", "Thanks, that works", "Thanks, bye"]


def interactions_end(settings: Settings) -> dict[int, int]:
    c = Consumer(settings.kafka_client_config(**{"group.id": "replicas-probe"}))
    parts = c.list_topics(names.INTERACTIONS, timeout=10).topics[names.INTERACTIONS].partitions
    ends = {
        p: c.get_watermark_offsets(TopicPartition(names.INTERACTIONS, p), timeout=10)[1]
        for p in parts
    }
    c.close()
    return ends


class Recorded:
    """Follows the interactions topic: waits until a session's turn is in the log."""

    def __init__(self, settings: Settings, start: dict[int, int]) -> None:
        self.c = Consumer(settings.kafka_client_config(**{"group.id": "replicas-recorded"}))
        self.c.assign([TopicPartition(names.INTERACTIONS, p, o) for p, o in start.items()])
        self.seen: dict[str, list[events.Interaction]] = {}

    def wait_for(self, session: str, count: int) -> list[events.Interaction]:
        deadline = time.monotonic() + 60
        while len(self.seen.get(session, [])) < count:
            assert time.monotonic() < deadline, f"{session}: {self.seen.get(session)}"
            for msg in self.c.consume(100, timeout=0.5):
                if msg.error() is None and msg.key() is not None:
                    ev = events.decode(msg.value())
                    if isinstance(ev, events.Interaction):
                        self.seen.setdefault(ev.session_id, []).append(ev)
        return self.seen[session]

    def close(self) -> None:
        self.c.close()


@pytest.mark.integration
def test_two_replicas_in_turn_pair_and_sample_like_one_gateway(
    kafka_settings: Settings, unique: str, tmp_path: Path
) -> None:
    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.serving.backends.hf import HFBackend
    from pipeline.serving.build import build_app
    from pipeline.serving.settings import ServeSettings
    from pipeline.serving.threaded import running

    from .test_processors_integration import (
        RULES,
        drop_internal_topics,
        high_watermarks,
        start_worker,
        stop,
    )

    prefix = f"replicas-{unique}-"
    single, replicated = prefix + "one", prefix + "two"
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    start_out, start_in = high_watermarks(kafka_settings), interactions_end(kafka_settings)
    tiny = ensure_tiny_model(tmp_path / "tiny")

    def gateway(replica: str):  # type: ignore[no-untyped-def]
        cfg = ServeSettings(
            reload=False,
            replica_id=replica,
            spool_dir=tmp_path / replica,
            delivery_timeout_s=5.0,
            turn_recovery_s=0,
        )
        backend = HFBackend(tiny, policy_id="liverl-tiny-v1", workers=1)
        return build_app(cfg, kafka_settings, backend)

    recorded = Recorded(kafka_settings, start_in)
    served: dict[str, list[tuple[str, str]]] = {single: [], replicated: []}
    with ExitStack() as stack:
        urls = [stack.enter_context(running(gateway(r))) for r in ("solo", "r0", "r1")]
        client = stack.enter_context(httpx.Client(timeout=120))
        for session, replicas in ((single, [urls[0]]), (replicated, urls[1:])):
            messages = [{"role": "system", "content": "You are terse."}]
            for t, text in enumerate(conversation()):
                messages.append({"role": "user", "content": text})
                last = t == len(conversation()) - 1
                resp = client.post(
                    f"{replicas[t % len(replicas)]}/v1/chat/completions",
                    json={
                        "model": "liverl-tiny-v1",
                        "messages": messages,
                        "max_tokens": 4,
                        "temperature": 0,
                    },
                    headers={
                        "X-Session-Id": session,
                        **({"X-Session-Done": "true"} if last else {}),
                    },
                )
                assert resp.status_code == 200, resp.text
                served[session].append(
                    (resp.headers["X-Liverl-Replica"], resp.headers["X-Liverl-Turn"])
                )
                messages.append(resp.json()["choices"][0]["message"])
                # A real client's next turn comes after a model's generation at least, by which
                # time this one is in the log; the tiny model answers in milliseconds, so wait
                # for that here (a turn recorded after a later one is not paired: see the docs).
                recorded.wait_for(session, t + 1)
    recorded.close()

    # Each replica numbered only the turns it served, from the conversation alone.
    assert served[single] == [("solo", str(t)) for t in range(4)]
    assert served[replicated] == [("r0", "0"), ("r1", "1"), ("r0", "2"), ("r1", "3")]
    logged = {s: recorded.seen[s] for s in (single, replicated)}
    for evs in logged.values():
        assert [e.turn for e in evs] == [0, 1, 2, 3]
        assert [e.ts_ms for e in evs] == sorted(e.ts_ms for e in evs)

    def complete(by_topic) -> bool:  # type: ignore[no-untyped-def]
        samples = {(e.session_id, e.turn) for e in by_topic[names.SAMPLES]}
        return len(samples) == 8

    out = Consumer(kafka_settings.kafka_client_config(**{"group.id": f"collect-{prefix}"}))
    out.assign([TopicPartition(t, p, o) for (t, p), o in start_out.items()])
    by_topic: dict[str, list] = defaultdict(list)
    app_id = f"replicas-{unique}"
    proc = start_worker(app_id, prefix, rules, tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not complete(by_topic) and time.monotonic() < deadline and proc.poll() is None:
            for msg in out.consume(500, timeout=0.5):
                if msg.error() is None and (msg.key() or b"").startswith(prefix.encode()):
                    by_topic[msg.topic()].append(events.decode(msg.value()))
    finally:
        stop(proc)
        out.close()
        drop_internal_topics(kafka_settings, app_id)
    log = (tmp_path / f"{app_id}.log").read_text()[-3000:]
    assert complete(by_topic), f"{ {t: len(v) for t, v in by_topic.items()} }\n{log}"

    ids = {s: [e.event_id for e in evs] for s, evs in logged.items()}

    def pairing(session: str) -> list[tuple]:
        out = {
            e.event_id: e
            for e in by_topic[names.NEXT_STATES]
            if e.session_id == session and e.source == "pairing"
        }
        pos = {eid: i for i, eid in enumerate(ids[session])}
        return sorted(
            (e.turn, e.kind, e.role, e.content, [pos[p] for p in e.parents]) for e in out.values()
        )

    def samples(session: str) -> list[tuple]:
        out = {e.event_id: e for e in by_topic[names.SAMPLES] if e.session_id == session}
        return sorted(
            (
                s.turn,
                s.step_index,
                s.prompt_token_ids,
                s.response_token_ids,
                s.loss_mask,
                s.opd_mask,
                s.masked,
                s.reward,
                s.penalty,
                [round(x, 5) for x in s.behavior_logprobs],
                s.parents[0] == ids[session][s.turn],
            )
            for s in out.values()
        )

    assert pairing(replicated) == pairing(single)
    assert [p[:2] for p in pairing(single)] == [
        (0, "user_reply"),
        (1, "user_reply"),
        (2, "user_reply"),
        (3, "session_end"),
    ]
    assert [p[4] for p in pairing(single)] == [[0, 1], [1, 2], [2, 3], [3]]
    assert samples(replicated) == samples(single)
    assert [s[0] for s in samples(single)] == [0, 1, 2, 3]
    assert all(s[-1] for s in samples(single))  # each sample comes from its own turn
