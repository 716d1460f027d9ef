"""Each Faust agent of the reward pipeline through ``agent.test_context()``: events in, emitted
events out, no broker.

As the Faust testing docs suggest, sends to output topics are replaced by a recorder (here
``Runtime.produce``, through which every output goes, and ``Topic.send``, which none should
use), and so is the tables' changelog producer (``Collection.send_changelog``), so the
tests can also assert what each table write would put on its changelog. Tables use the memory
store. Timers are plain coroutines kept on ``app.liverl_timers``: the tests call them directly
with a patched clock (``test_context`` runs agents only, never timers).

``put`` waits until the value reaches the agent's stream, not until the agent has handled it;
for the sequential agents a second, ignored record ("flush") proves the first one is done. The
judge agent reads in batches (``take_events``) in a background task, so its tests poll.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import faust
import faust.tables.base
import faust.topics
import orjson
import pytest

from pipeline import events
from pipeline.events import PathPenalty, PrmScore, Producer, examples
from pipeline.kafka import names
from pipeline.processors import app as app_mod
from pipeline.processors import runtime
from pipeline.processors.config import ProcessorSettings
from pipeline.processors.outcomes import outcome_event
from pipeline.settings import Settings

SID = "t-s"
P = Producer(component="t", version="1")


class Harness:
    def __init__(self, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
        self.tmp_path = tmp_path
        self.sent: list[tuple[str, bytes, bytes]] = []
        self.changelog: list[tuple[str, bytes, bytes | None]] = []
        self.clock = 1_000_000
        self.hold: asyncio.Event | None = None
        harness = self

        async def fake_produce(self, topic, key, value, headers=None):  # type: ignore[no-untyped-def]
            if harness.hold is not None:  # the next send waits until the test sets it
                hold, harness.hold = harness.hold, None
                await hold.wait()
            harness.sent.append((topic, key, value))

        async def fake_send(self, *, key=None, value=None, **_: Any):  # type: ignore[no-untyped-def]
            harness.sent.append((self.get_topic_name(), key, value))
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut

        def fake_changelog(self, partition, key, value, **_: Any):  # type: ignore[no-untyped-def]
            harness.changelog.append((self.name, key, value))
            return SimpleNamespace(message=SimpleNamespace(partition=partition or 0))

        monkeypatch.setattr(runtime.Runtime, "produce", fake_produce)
        monkeypatch.setattr(faust.topics.Topic, "send", fake_send)  # none expected: caught
        monkeypatch.setattr(faust.tables.base.Collection, "send_changelog", fake_changelog)
        monkeypatch.setattr(runtime, "now_ms", lambda: harness.clock)

    def app(self, **overrides: Any) -> faust.App:
        cfg = ProcessorSettings(
            app_id=f"t-{uuid.uuid4().hex[:8]}",
            session_prefix="t-",
            web_enabled=False,
            grace_s=30,
            idle_timeout_s=60,
            **overrides,
        )
        app = app_mod.create_app(Settings(), cfg, self.tmp_path)
        app.finalize()
        return app

    def out(self, topic: str) -> list[events.Event]:
        return [events.decode(v) for t, _, v in self.sent if t == topic]

    def topics(self) -> list[str]:
        return [t for t, _, _ in self.sent]


@pytest.fixture
def h(tmp_path, monkeypatch) -> Harness:  # type: ignore[no-untyped-def]
    return Harness(tmp_path, monkeypatch)


async def put(agent: Any, topic: str, value: bytes | events.Event, key: bytes | None = None) -> Any:
    """Put one record as if read from ``topic`` (multi-topic agents cannot tell otherwise)."""
    if isinstance(value, events.Event):
        key = key if key is not None else events.key(value)
        value = events.encode(value)
    make = type(agent).to_message

    def to_message(k: Any, v: Any, **kw: Any) -> Any:
        msg = make(agent, k, v, **kw)
        msg.topic = topic
        return msg

    agent.to_message = to_message
    return await agent.put(value=value, key=key)


async def flush(agent: Any, topic: str) -> None:
    """A record the agent ignores (foreign session prefix): once it is handled, every record
    put before it has been. The session agent takes records in batches, so a record being
    taken says nothing: it names the last record of each batch it is done with. Other agents
    are sequential: taking the next record means the one before is done."""
    ev = await put(agent, topic, b"{}", b"flush")
    owner = getattr(agent.fun, "__self__", None)
    if hasattr(owner, "last_handled"):
        await eventually(lambda: owner.last_handled is ev.message)


async def eventually(cond: Callable[[], bool], limit_s: float = 20.0) -> None:
    for _ in range(int(limit_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def shell(call_id: str, cmd: str) -> dict:
    args = orjson.dumps({"cmd": cmd}).decode()
    return {"id": call_id, "type": "function", "function": {"name": "shell", "arguments": args}}


def inter(t: int, sid: str = SID, **kw: Any) -> events.Interaction:
    base = examples.interaction(prompt_tokens=3, response_tokens=2)
    msgs: list[dict] = [{"role": "user", "content": "fix it"}]
    for i in range(t):
        msgs += [
            {"role": "assistant", "content": None, "tool_calls": [shell(f"c{i}", "ls")]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i}"},
        ]
    fields: dict[str, Any] = {
        "event_id": f"{sid}-i{t}",
        "session_id": sid,
        "turn": t,
        "messages": msgs,
        "tool_calls": [shell(f"c{t}", "ls")],
        "prompt_token_ids": [t, t + 1, t + 2],
        "response_token_ids": [100 + t, 200 + t],
        "response_logprobs": [-0.5, -0.25],
    }
    return dataclasses.replace(base, **{**fields, **kw})


def next_state(t: int, kind: str = "user_reply", content: str = "", **kw: Any) -> events.NextState:
    return dataclasses.replace(
        examples.examples()["next_state"],
        event_id=f"{SID}-n{t}-{kind}",
        session_id=SID,
        turn=t,
        kind=kind,
        content=content,
        **kw,
    )


def prm(t: int, score: int, votes: list[int | None], ns_id: str) -> PrmScore:
    return PrmScore(
        event_id=f"p{t}",
        producer=P,
        parents=[f"{SID}-i{t}", ns_id],
        session_id=SID,
        turn=t,
        score=score,  # type: ignore[arg-type]
        votes=votes,
        judge_id="j",
        judge_version="1",
    )


def pen(t: int, phi: float) -> PathPenalty:
    return PathPenalty(
        event_id=f"x{t}",
        producer=P,
        parents=[f"{SID}-i{t}"],
        session_id=SID,
        turn=t,
        rule_ids=[],
        penalty=phi,
        compliance_bonus=0.0,
        beta=0.5,
    )


# ---- session: pairing, path penalties, judging, assembly -------------------------------------

EXT = Producer(component="feedback", version="1")  # a next state from outside the pipeline


def agent_named(app: Any, name: str) -> Any:
    (agent,) = [a for a in app.liverl_agents if a.name.endswith(name)]
    return agent


def external(t: int, content: str, kind: str = "user_reply", **kw: Any) -> events.NextState:
    return next_state(t, kind, content, producer=EXT, **kw)


def session_states(h: Harness) -> list[Any]:
    from pipeline.processors import session as session_mod

    return [session_mod.load(v) for t, _, v in h.changelog if t == "sessions" and v is not None]


def test_session_agent_pairs_judges_and_assembles_a_session(h: Harness) -> None:
    async def run() -> None:
        app = h.app()
        async with agent_named(app, "session").test_context() as agent:
            await put(agent, names.INTERACTIONS, inter(0))
            side = dataclasses.replace(inter(1), event_id="side", turn_type="side")
            await put(agent, names.INTERACTIONS, side)
            await put(agent, names.INTERACTIONS, inter(1, session_done=True))
            await put(agent, names.INTERACTIONS, b'{"type": "interaction"', SID.encode())
            await put(agent, names.INTERACTIONS, inter(0, sid="other-s"))  # not our prefix
            await flush(agent, names.INTERACTIONS)
            n_sent, n_log = len(h.sent), len(h.changelog)
            # What it published comes back on next_states and hints: applied already,
            # skipped, not even a state write.
            for ns in h.out(names.NEXT_STATES):
                await put(agent, names.NEXT_STATES, ns)
            for hint in h.out(names.HINTS):
                await put(agent, names.HINTS, hint)
            await flush(agent, names.INTERACTIONS)
            assert len(h.changelog) == n_log
            await put(agent, names.INTERACTIONS, inter(0))  # a redelivery after completion
            await flush(agent, names.INTERACTIONS)
            assert len(h.sent) == n_sent

    asyncio.run(run())
    # turn 1 pairs turn 0 and, being done, closes the session: both next states and both
    # penalties, both judged, then the session's rewards and samples; the side turn and the
    # foreign session emit nothing
    order = [names.NEXT_STATES] * 2 + [names.PATH_PENALTIES] * 2 + [names.PRM_SCORES] * 2
    assert h.topics()[:6] == order
    assert h.topics()[6:] == [names.REWARDS] * 2 + [names.SAMPLES] * 2 + [names.DLQ]
    ns = h.out(names.NEXT_STATES)
    assert [(e.turn, e.kind, e.content) for e in ns] == [  # type: ignore[attr-defined]
        (0, "tool_result", "out 0"),
        (1, "session_end", ""),
    ]
    assert ns[0].event_id == events.derive_event_id(
        "next_state", [f"{SID}-i0", f"{SID}-i1"], "pairing-1", "tool_result"
    )
    pens = h.out(names.PATH_PENALTIES)
    assert [e.turn for e in pens] == [0, 1]  # type: ignore[attr-defined]
    prms = h.out(names.PRM_SCORES)
    assert [(p.turn, p.parents) for p in prms] == [  # type: ignore[attr-defined]
        (t, [f"{SID}-i{t}", n.event_id]) for t, n in enumerate(ns)
    ]
    # R = prm + beta * Phi per turn, from the verdicts and penalties it published itself
    rewards = h.out(names.REWARDS)
    assert [r.total for r in rewards] == pytest.approx(  # type: ignore[attr-defined]
        [p.score + q.beta * q.penalty for p, q in zip(prms, pens, strict=True)]  # type: ignore[attr-defined]
    )
    samples = h.out(names.SAMPLES)
    assert [(s.prompt_token_ids, s.response_token_ids, s.behavior_logprobs) for s in samples] == [  # type: ignore[attr-defined]
        ([0, 1, 2], [100, 200], [-0.5, -0.25]),
        ([1, 2, 3], [101, 201], [-0.5, -0.25]),
    ]
    assert samples[0].parents == [f"{SID}-i0", rewards[0].event_id]
    (dlq,) = h.out(names.DLQ)
    assert "malformed JSON" in dlq.error and dlq.source_topic == names.INTERACTIONS  # type: ignore[attr-defined]
    assert all(k == SID.encode() for t, k, _ in h.sent if t != names.DLQ)
    # One typed state per session on one changelog; token payloads are in neither it nor any
    # other changelog: the state keeps where each interaction was read instead.
    states = session_states(h)
    assert states[-1].pairing.closed and states[-1].assembly.done
    assert not any(b"token_ids" in v for t, _, v in h.changelog if t == "sessions")
    assert [t for t, _, _ in h.changelog if t != "sessions"] == []


def test_a_restarted_worker_reads_the_tokens_back_at_the_kept_coordinates(h: Harness) -> None:
    """The state keeps where each interaction was read, not its tokens: a worker that does
    not hold them (a fresh token store, as after a restart) reads back exactly those records
    and trains on their tokens; what it still holds it never reads."""
    from pipeline.processors.token_store import TokenStore

    wire: dict[tuple[str, int, int], bytes] = {}
    asked: list[list[tuple[str, int, int]]] = []

    def fetch(wanted: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], bytes]:
        asked.append(sorted(wanted))
        return {c: wire[c] for c in wanted if c in wire}

    async def run() -> Any:
        app = h.app()
        session = agent_named(app, "session")
        async with session.test_context() as agent:
            owner = agent.fun.__self__
            for t in (0, 1):
                ev = await put(agent, names.INTERACTIONS, inter(t))
                m = ev.message
                wire[(m.topic, m.partition, m.offset)] = events.encode(inter(t))
            await flush(agent, names.INTERACTIONS)
            state = session_states(h)[-1]
            kept = [i.interaction.at for i in state.assembly.turns.values()]
            assert sorted((at.topic, at.partition, at.offset) for at in kept) == sorted(wire)
            owner.payloads = TokenStore(owner.tokens, fetch)  # nothing held: a restart
            await put(agent, names.INTERACTIONS, inter(2, session_done=True))
            await flush(agent, names.INTERACTIONS)
            return owner.rt.metrics

    metrics = asyncio.run(run())
    assert asked == [sorted(wire)]  # turns 0 and 1 read back in one call, turn 2 was held
    text = metrics.exposition().decode()
    assert "liverl_workers_token_payloads_read_back 2.0" in text
    assert "liverl_workers_token_payloads_held 0.0" in text  # dropped once assembled
    samples = h.out(names.SAMPLES)
    assert [(s.turn, list(s.prompt_token_ids), list(s.response_token_ids)) for s in samples] == [  # type: ignore[attr-defined]
        (t, [t, t + 1, t + 2], [100 + t, 200 + t]) for t in (0, 1, 2)
    ]


def test_session_sweep_closes_an_idle_session_and_assembles_it(h: Harness) -> None:
    async def run() -> None:
        app = h.app()
        async with agent_named(app, "session").test_context() as agent:
            await put(agent, names.INTERACTIONS, inter(0))
            await flush(agent, names.INTERACTIONS)
        await app.liverl_timers["session_sweep"]()
        assert h.sent == []  # not idle yet
        h.clock += 61_000
        await app.liverl_timers["session_sweep"]()

    asyncio.run(run())
    ((turn, kind, detail),) = [(e.turn, e.kind, e.detail) for e in h.out(names.NEXT_STATES)]  # type: ignore[attr-defined]
    assert (turn, kind, detail) == (0, "session_end", {"reason": "idle_timeout"})
    assert [s.turn for s in h.out(names.SAMPLES)] == [0]  # type: ignore[attr-defined]


def test_next_states_from_outside_are_judged_in_either_order_and_strays_expire(
    h: Harness,
) -> None:
    thanks = external(0, "Thanks, that works")
    early = external(1, "that's wrong, it still fails")  # before its interaction
    stray = external(9, "hello")

    async def run() -> None:
        app = h.app()
        async with agent_named(app, "session").test_context() as agent:
            await put(agent, names.INTERACTIONS, inter(0))
            await put(agent, names.NEXT_STATES, thanks)
            await put(agent, names.NEXT_STATES, early)
            await put(agent, names.NEXT_STATES, outcome_event(SID, True, ts_ms=1))  # no turn
            await put(agent, names.NEXT_STATES, stray)
            await put(agent, names.NEXT_STATES, b"not json", SID.encode())
            await put(agent, names.INTERACTIONS, inter(1))
            await flush(agent, names.INTERACTIONS)
        await app.liverl_timers["session_sweep"]()
        assert len(h.out(names.DLQ)) == 1  # the stray still waits for its turn
        h.clock += 31_000
        await app.liverl_timers["session_sweep"]()

    asyncio.run(run())
    scores = {e.parents[-1]: e for e in h.out(names.PRM_SCORES)}  # type: ignore[attr-defined]
    assert (
        scores[thanks.event_id].turn,
        scores[thanks.event_id].score,  # type: ignore[attr-defined]
        scores[thanks.event_id].votes,
    ) == (0, 1, [1])  # type: ignore[attr-defined]
    assert (
        scores[early.event_id].turn,
        scores[early.event_id].score,  # type: ignore[attr-defined]
        scores[early.event_id].votes,
    ) == (1, -1, [-1])  # type: ignore[attr-defined]
    assert scores[thanks.event_id].parents == [f"{SID}-i0", thanks.event_id]
    assert scores[early.event_id].parents == [f"{SID}-i1", early.event_id]
    errors = sorted(d.error for d in h.out(names.DLQ))  # type: ignore[attr-defined]
    assert len(errors) == 2
    assert "malformed JSON" in errors[0] and "unknown turn 9" in errors[1]
    parked = [k for t, k, v in h.changelog if t == "parked" and v is None]
    assert SID.encode() + b"\0" + stray.event_id.encode() in parked  # dropped once dead


def test_session_with_an_llm_judge_waits_for_verdicts_from_the_judge_agent(h: Harness) -> None:
    """A judge that is not inline runs in its own agent; the session agent then reads
    prm_scores and hints, and assembles once every next state has its verdict."""
    app = h.app(judge="llm")
    assert {a.name for a in app.liverl_agents} == {"session", "judge", "group"}
    assert {a.name for a in h.app().liverl_agents} == {"session", "group"}  # inline judge

    async def run() -> None:
        async with agent_named(app, "session").test_context() as agent:
            await put(agent, names.INTERACTIONS, inter(0))
            await put(agent, names.INTERACTIONS, inter(1, session_done=True))
            await flush(agent, names.INTERACTIONS)
            assert not h.out(names.PRM_SCORES) and not h.out(names.REWARDS)
            ns = h.out(names.NEXT_STATES)
            await put(agent, names.PRM_SCORES, prm(0, 1, [1, 1, 0], ns[0].event_id))
            await flush(agent, names.INTERACTIONS)
            assert not h.out(names.REWARDS)  # turn 1's session_end is not judged yet
            await put(agent, names.PRM_SCORES, prm(1, -1, [-1], ns[1].event_id))
            await flush(agent, names.INTERACTIONS)
            # The judge agent's hint for that verdict is read after it: the session waits.
            assert not h.out(names.REWARDS)
            await put(agent, names.HINTS, judge_hint)
            await flush(agent, names.INTERACTIONS)
        h.clock += 1_000  # JUDGE_AGENT_HINT_WAIT_S after the last verdict
        await app.liverl_timers["session_sweep"]()

    judge_hint = events.Hint(
        event_id="jh1",
        producer=events.Producer(component="judge", version="llm-1"),
        parents=[f"{SID}-i1"],
        session_id=SID,
        turn=1,
        hint="Say what you changed.",
        judge_id="llm",
        rank=0,
    )
    asyncio.run(run())
    assert [s.hints for s in h.out(names.SAMPLES)] == [[], ["Say what you changed."]]  # type: ignore[attr-defined]
    pens = h.out(names.PATH_PENALTIES)
    totals = [r.total for r in h.out(names.REWARDS)]  # type: ignore[attr-defined]
    assert totals == pytest.approx(
        [
            1 + pens[0].beta * pens[0].penalty,  # type: ignore[attr-defined]
            -1 + pens[1].beta * pens[1].penalty,
        ]
    )  # type: ignore[attr-defined]
    assert len(h.out(names.SAMPLES)) == 2


def test_closed_session_without_verdicts_is_assembled_after_the_grace_period(h: Harness) -> None:
    app = h.app(judge="llm")

    async def run() -> None:
        async with agent_named(app, "session").test_context() as agent:
            await put(agent, names.INTERACTIONS, inter(0, session_done=True))
            await flush(agent, names.INTERACTIONS)
        h.sent.clear()
        await app.liverl_timers["session_sweep"]()
        assert h.sent == []  # no verdict yet, grace not over
        h.clock += 30_000
        await app.liverl_timers["session_sweep"]()

    asyncio.run(run())
    assert h.out(names.REWARDS) == []  # never judged: no reward ...
    ((turn, masked, reward, ids),) = [
        (s.turn, s.masked, s.reward, s.response_token_ids)  # type: ignore[attr-defined]
        for s in h.out(names.SAMPLES)
    ]
    # ... and its sample is bookkeeping only: trained at a made-up 0 it would outrank a judged
    # failure of its group (issue 23)
    assert (turn, masked, reward, ids) == (0, True, 0.0, [100, 200])


def test_grouped_sessions_go_to_the_group_topic(h: Harness) -> None:
    app = h.app(group_size=2)
    groups = app.liverl_topics["groups"].get_topic_name()

    async def run() -> None:
        async with agent_named(app, "session").test_context() as agent:
            await put(agent, names.INTERACTIONS, inter(0, group_id="task-1", session_done=True))
            await flush(agent, names.INTERACTIONS)

    asyncio.run(run())
    assert h.topics()[-2:] == [names.REWARDS, groups]
    _, key, value = h.sent[-1]
    body = orjson.loads(value)
    assert key == b"task-1" and body["kind"] == "session" and body["session_id"] == SID
    assert [(s["turn"], s["group_id"]) for s in body["samples"]] == [(0, "task-1")]


def test_legacy_sampling_group_id_is_still_read(h: Harness) -> None:
    app = h.app(group_size=2)
    groups = app.liverl_topics["groups"].get_topic_name()
    legacy = {"temperature": 0.7, "group_id": "task-old"}

    async def run() -> None:
        async with agent_named(app, "session").test_context() as agent:
            await put(agent, names.INTERACTIONS, inter(0, sampling=legacy, session_done=True))
            await flush(agent, names.INTERACTIONS)

    asyncio.run(run())
    assert [(t, k) for t, k, _ in h.sent][-2:] == [
        (names.REWARDS, SID.encode()),
        (groups, b"task-old"),
    ]


# ---- group -----------------------------------------------------------------------------------


def grouped(sid: str, rewards: list[float], gid: str = "g") -> bytes:
    base = examples.examples()["sample"]
    samples = [
        dataclasses.replace(
            base,
            event_id=f"{sid}-s{t}",
            session_id=sid,
            turn=t,
            step_index=t,
            reward=r,
            group_id=gid,
            parents=[f"{sid}-i{t}", f"{sid}-r{t}"],
        )
        for t, r in enumerate(rewards)
    ]
    body = {"kind": "session", "session_id": sid, "samples": [events.to_dict(s) for s in samples]}
    return orjson.dumps(body)


def test_group_agent_zscores_within_group_and_step_once_complete(h: Harness) -> None:
    app = h.app(group_size=2)
    groups = app.liverl_topics["groups"].get_topic_name()

    async def run() -> None:
        async with agent_named(app, "group").test_context() as agent:
            await put(agent, groups, grouped("t-a", [1.0, -0.5]), b"g")
            await put(agent, groups, grouped("t-a", [1.0, -0.5]), b"g")  # redelivery
            await flush(agent, groups)
            assert h.sent == []  # held: 1 of 2 sessions
            await put(agent, groups, grouped("t-b", [0.0, 0.5]), b"g")
            await flush(agent, groups)
            assert len(h.out(names.SAMPLES)) == 4
            await put(agent, groups, grouped("t-c", [3.0]), b"g")  # too late
            await flush(agent, groups)

    asyncio.run(run())
    samples = h.out(names.SAMPLES)
    # step 0: rewards 1.0 (a), 0.0 (b): mean 0.5, std 0.5 -> +1, -1
    # step 1: rewards -0.5 (a), 0.5 (b): mean 0, std 0.5 -> -1, +1
    got = [(s.session_id, s.step_index, s.reward) for s in samples]  # type: ignore[attr-defined]
    assert got == [
        ("t-a", 0, pytest.approx(1.0, abs=1e-5)),
        ("t-a", 1, pytest.approx(-1.0, abs=1e-5)),
        ("t-b", 0, pytest.approx(-1.0, abs=1e-5)),
        ("t-b", 1, pytest.approx(1.0, abs=1e-5)),
        ("t-c", 0, 3.0),  # its group was already emitted: passed on unchanged
    ]
    assert samples[0].event_id == events.derive_event_id(
        "sample", ["t-a-i0", "t-a-r0"], "samples-3", False, "group", "g", ["t-a", "t-b"]
    )
    assert samples[4].event_id == "t-c-s0"
    members = [(k, v is None) for t, k, v in h.changelog if t == "group_members"]
    assert members == [(b"g\x00t-a", False), (b"g\x00t-b", False)] + [
        (b"g\x00t-a", True),
        (b"g\x00t-b", True),
    ]


def test_unreadable_held_member_is_dead_lettered_and_the_group_still_emits(h: Harness) -> None:
    """Seen on a dev broker: a member held by an earlier code version (v2 base64 arrays under a
    v1 label) crashed the group agent on every sweep for hours, and no grouped sample left."""
    app = h.app(group_size=3)
    groups = app.liverl_topics["groups"].get_topic_name()
    bad = orjson.loads(grouped("t-bad", [9.0]))
    bad["samples"][0]["prompt_token_ids"] = "AQAAAAIAAAA="  # v2 layout, schema_version 1

    async def run() -> None:
        async with agent_named(app, "group").test_context() as agent:
            await put(agent, groups, grouped("t-a", [1.0]), b"g")
            await put(agent, groups, orjson.dumps(bad), b"g")
            await put(agent, groups, grouped("t-b", [0.0]), b"g")
            await flush(agent, groups)

    asyncio.run(run())
    got = [(s.session_id, s.reward) for s in h.out(names.SAMPLES)]  # type: ignore[attr-defined]
    # the readable members are normalised between themselves: mean 0.5, std 0.5 -> +1, -1
    assert got == [("t-a", pytest.approx(1.0, abs=1e-5)), ("t-b", pytest.approx(-1.0, abs=1e-5))]
    (letter,) = h.out(names.DLQ)
    assert isinstance(letter, events.DeadLetter)
    assert letter.source_topic.endswith("-group_members-changelog")
    assert letter.original_key() == b"g\x00t-bad"
    assert "prompt_token_ids" in letter.error and "unreadable" in letter.error
    assert orjson.loads(letter.original()) == bad["samples"]
    members = [(k, v is None) for t, k, v in h.changelog if t == "group_members"]
    assert (b"g\x00t-bad", True) in members, "the unreadable member is dropped, not kept"


def test_group_timeout_emits_an_incomplete_group_through_a_sweep_message(h: Harness) -> None:
    app = h.app(group_size=3, group_timeout_s=10)
    groups = app.liverl_topics["groups"].get_topic_name()

    async def run() -> None:
        async with agent_named(app, "group").test_context() as agent:
            await put(agent, groups, grouped("t-a", [2.0]), b"g")
            await put(agent, groups, grouped("t-b", [4.0]), b"g")
            await flush(agent, groups)
            await app.liverl_timers["group_sweep"]()
            assert h.sent == []  # not due
            h.clock += 10_000
            await app.liverl_timers["group_sweep"]()
            assert [(t, k, v) for t, k, v in h.sent] == [(groups, b"g", b'{"kind":"sweep"}')]
            h.sent.clear()
            await put(agent, groups, b'{"kind":"sweep"}', b"g")
            await flush(agent, groups)

    asyncio.run(run())
    got = [(s.session_id, s.reward) for s in h.out(names.SAMPLES)]  # type: ignore[attr-defined]
    assert got == [("t-a", pytest.approx(-1.0, abs=1e-5)), ("t-b", pytest.approx(1.0, abs=1e-5))]


def test_keyless_records_are_dead_lettered_not_one_empty_key_session(h: Harness) -> None:
    """Every input topic is keyed by session: a keyless record would otherwise join one shared
    empty-key session state and produce nothing at all."""

    async def run() -> None:
        app = h.app()
        async with agent_named(app, "session").test_context() as agent:
            await put(agent, names.INTERACTIONS, events.encode(inter(0)), None)
            await put(agent, names.NEXT_STATES, events.encode(external(0, "ok")), None)
            await flush(agent, names.INTERACTIONS)

    asyncio.run(run())
    letters = h.out(names.DLQ)
    assert [d.source_topic for d in letters] == [names.INTERACTIONS, names.NEXT_STATES]  # type: ignore[attr-defined]
    assert all("no Kafka key" in d.error for d in letters)  # type: ignore[attr-defined]
    assert all(d.original_key() is None for d in letters)  # type: ignore[attr-defined]
    assert not h.out(names.NEXT_STATES) and not h.out(names.PRM_SCORES)


def test_early_next_states_are_parked_in_a_changelogged_table(h: Harness) -> None:
    """A next state read before its interaction is written to the ``parked`` table (its
    offset moves on, so the changelog is its only copy across a restart) and removed only once
    its verdict has been sent."""
    early = external(0, "Thanks, that works")

    async def run() -> None:
        app = h.app()
        async with agent_named(app, "session").test_context() as agent:
            await put(agent, names.NEXT_STATES, early)
            await flush(agent, names.INTERACTIONS)
            assert any(t == "parked" for t, _, _ in h.changelog)
            assert not h.out(names.PRM_SCORES)
            await put(agent, names.INTERACTIONS, inter(0))
            await flush(agent, names.INTERACTIONS)

    asyncio.run(run())
    parked = [(k, v) for t, k, v in h.changelog if t == "parked"]
    key = SID.encode() + b"\0" + early.event_id.encode()
    assert [k for k, _ in parked] == [key, key]
    assert parked[0][1].split(b"\0", 1)[1] == events.encode(early)  # the record, verbatim
    assert parked[1][1] is None  # released after the verdict
    (prm_ev,) = h.out(names.PRM_SCORES)
    assert prm_ev.parents == [f"{SID}-i0", early.event_id]  # type: ignore[attr-defined]
    assert session_states(h)[-1].judging.pending == {}


class BatchJudge:
    """A judge that is not inline, as the LLM PRM: its own agent judges in batches. Votes -1
    with a hint when the reply starts with "no", else +1."""

    inline = False
    judge_id = "fake-llm"
    version = "fake-llm-1"

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def judge(self, ctx: Any, state: events.NextState) -> Any:
        from pipeline.processors.judges import Verdict

        self.seen.append(state.event_id)
        if state.content.startswith("no"):
            return Verdict(-1, [-1], "complaint", ["Say what you changed."])
        return Verdict(1, [1], "thanks")


def test_judge_agent_judges_in_batches_parks_early_states_and_expires_strays(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The judge agent (a judge with ``inline = False``): a next state is judged once its
    turn is known, one that comes first waits in ``judge_parked`` and leaves it once its
    verdict is sent, and one whose turn never comes is dead-lettered after ``grace_s``."""
    judge = BatchJudge()
    monkeypatch.setattr(app_mod, "build_judge", lambda cfg: judge)
    app = h.app()
    early = external(1, "no, that is the wrong file")
    thanks = external(0, "thanks, works")
    stray = external(7, "what about turn seven")

    async def run() -> None:
        async with agent_named(app, "judge").test_context() as agent:
            await put(agent, names.NEXT_STATES, early)  # before its interaction
            await put(agent, names.INTERACTIONS, inter(0))
            await put(agent, names.NEXT_STATES, thanks)
            await put(agent, names.NEXT_STATES, stray)
            await put(agent, names.INTERACTIONS, inter(1))
            await eventually(lambda: len(h.out(names.PRM_SCORES)) == 2)
            await eventually(lambda: sum(t == "judge_parked" and v is None
                                         for t, _, v in h.changelog) == 1)  # fmt: skip
        await app.liverl_timers["judge_grace"]()
        assert not h.out(names.DLQ)  # the stray's grace is not over
        h.clock += 31_000
        await app.liverl_timers["judge_grace"]()

    asyncio.run(run())
    assert sorted(judge.seen) == sorted([early.event_id, thanks.event_id])
    scores = {e.parents[-1]: (e.turn, e.score, e.parents[0])  # type: ignore[attr-defined]
              for e in h.out(names.PRM_SCORES)}  # fmt: skip
    assert scores == {thanks.event_id: (0, 1, f"{SID}-i0"), early.event_id: (1, -1, f"{SID}-i1")}
    (hint,) = h.out(names.HINTS)
    assert (hint.turn, hint.hint, hint.parents) == (  # type: ignore[attr-defined]
        1,
        "Say what you changed.",
        [f"{SID}-i1", early.event_id],
    )
    (letter,) = h.out(names.DLQ)
    assert letter.error == (  # type: ignore[attr-defined]
        f"next state for unknown turn 7 of session {SID}: no interaction within 30s"
    )
    assert letter.original() == events.encode(stray)  # type: ignore[attr-defined]
    parked = [(k, v) for t, k, v in h.changelog if t == "judge_parked"]
    keys = {n: SID.encode() + b"\0" + n.encode() for n in (early.event_id, stray.event_id)}
    # Each was written once, then removed: after its verdict, or after its dead letter.
    assert [(k, v is None) for k, v in parked] == [
        (keys[early.event_id], False),
        (keys[stray.event_id], False),
        (keys[early.event_id], True),
        (keys[stray.event_id], True),
    ]


def test_unreadable_states_are_dead_lettered_dropped_and_started_over(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table value this code cannot read back (another version wrote it) goes to the DLQ
    with its changelog's name and is replaced: the session, the judge agent's state and the
    group index each start over instead of crashing the agent on every record."""
    monkeypatch.setattr(app_mod, "build_judge", lambda cfg: BatchJudge())
    app = h.app()
    old = {"sessions": b'{"pairing": 5}', "judging": b'{"judging": "?"}', "groups": b"[1]"}
    for name, raw in old.items():  # as restored from a changelog, not written by an agent
        app.tables[name].data[b"g" if name == "groups" else SID.encode()] = raw
    groups = app.liverl_topics["groups"].get_topic_name()

    async def run() -> None:
        async with agent_named(app, "judge").test_context() as agent:
            await put(agent, names.INTERACTIONS, inter(0))
            await eventually(lambda: len(h.out(names.DLQ)) == 1)
        async with agent_named(app, "session").test_context() as agent:
            await put(agent, names.INTERACTIONS, inter(0))
            await flush(agent, names.INTERACTIONS)
        async with agent_named(app, "group").test_context() as agent:
            await put(agent, groups, b'{"kind": "sweep"}', b"g")
            await put(agent, groups, b'{"kind": "sweep"}', b"flush")

    asyncio.run(run())
    letters = h.out(names.DLQ)
    what = {"judging": "judge state", "sessions": "session state", "groups": "group index"}
    assert [(d.source_topic, d.original()) for d in letters] == [  # type: ignore[attr-defined]
        (f"{app.conf.id}-{name}-changelog", old[name]) for name in what
    ]
    for letter, text in zip(letters, what.values(), strict=True):
        assert letter.error.startswith(f"{text} unreadable: ")  # type: ignore[attr-defined]
    # Replaced by a readable state (the judge's and the session's) or dropped (the group's).
    assert session_states(h)[-1].assembly.turns[0].interaction is not None
    assert "0" in orjson.loads(app.tables["judging"].data[SID.encode()])["judging"]["turns"]
    assert b"g" not in app.tables["groups"].data


def hint_for(t: int, text: str, sid: str = SID) -> events.Hint:
    return events.Hint(
        event_id=f"{sid}-h{t}",
        producer=EXT,
        session_id=sid,
        turn=t,
        hint=text,
        judge_id="person",
        rank=0,
    )


def test_hints_whose_turn_never_comes_are_dead_lettered_not_dropped(h: Harness) -> None:
    """A hint may arrive before its turn, so it waits in the state; if the session is
    assembled without that turn, or its state expires, the hint goes to the DLQ."""

    async def run() -> None:
        app = h.app(retain_s=7200)
        async with agent_named(app, "session").test_context() as agent:
            await put(agent, names.HINTS, hint_for(3, "run the tests first"))  # turn 3 never comes
            await put(agent, names.HINTS, hint_for(0, "read the error"))  # before its turn
            await put(agent, names.INTERACTIONS, inter(0))
            await put(agent, names.INTERACTIONS, inter(1, session_done=True))
            # a session that only ever got a hint (e.g. its state expired long ago)
            gone = hint_for(0, "check the logs first", sid="t-gone")
            await put(agent, names.HINTS, gone, b"t-gone")
            await flush(agent, names.INTERACTIONS)
        assert [d.error for d in h.out(names.DLQ)] == [  # type: ignore[attr-defined]
            f"hint {SID}-h3 for turn 3 of session {SID}: the session was assembled and that "
            "turn's interaction never arrived"
        ]
        h.clock += 7201 * 1000
        await app.liverl_timers["expire_state"]()

    asyncio.run(run())
    samples = h.out(names.SAMPLES)
    assert [(s.turn, s.hints) for s in samples] == [(0, ["read the error"]), (1, [])]  # type: ignore[attr-defined]
    first, gone = h.out(names.DLQ)
    assert orjson.loads(first.original()) == {  # type: ignore[attr-defined]
        "session_id": SID,
        "turn": 3,
        "hint_id": f"{SID}-h3",
        "rank": 0,
        "hint": "run the tests first",
    }
    assert first.source_topic == names.HINTS  # type: ignore[attr-defined]
    assert gone.error == (  # type: ignore[attr-defined]
        "hint t-gone-h0 for turn 0 of session t-gone: the session state expired "
        "(processors.retain_s 7200s) before that turn's interaction arrived"
    )


def feedback_vote(eid: str, thumbs: str, key_id: str, ts_ms: int) -> events.NextState:
    score = 1.0 if thumbs == "up" else -1.0
    return dataclasses.replace(
        next_state(0, "feedback", "", producer=EXT), event_id=eid, source="feedback",
        score=score, ts_ms=ts_ms, detail={"key_id": key_id, "thumbs": thumbs},
    )  # fmt: skip


def test_votes_that_do_not_count_are_dead_lettered_counted_and_not_judged(h: Harness) -> None:
    """Caller A votes up, then down: the down counts, the up is replaced (a letter that
    describes it). The session closes and is assembled: turn 0's prm is the mean of its
    tool result (0) and A's vote (-1), -0.5. Then B's vote arrives: too late, a letter with
    the record itself and no verdict. Both are counted by reason in the workers' metrics."""
    up, down = feedback_vote("fa1", "up", "ka", 1), feedback_vote("fa2", "down", "ka", 2)
    late = feedback_vote("fb1", "up", "kb", 3)

    async def run() -> Any:
        app = h.app()
        session = agent_named(app, "session")
        async with session.test_context() as agent:
            await put(agent, names.INTERACTIONS, inter(0))
            await put(agent, names.NEXT_STATES, up)
            await put(agent, names.NEXT_STATES, down)
            await put(agent, names.INTERACTIONS, inter(1, session_done=True))
            await put(agent, names.NEXT_STATES, late)
            await flush(agent, names.INTERACTIONS)
        return session.fun.__self__.rt.metrics

    metrics = asyncio.run(run())
    rewards = {r.turn: r for r in h.out(names.REWARDS)}  # type: ignore[attr-defined]
    assert rewards[0].prm == pytest.approx(-0.5)
    judged = {p.parents[-1] for p in h.out(names.PRM_SCORES)}  # type: ignore[attr-defined]
    assert {up.event_id, down.event_id} <= judged and late.event_id not in judged
    letters = {d.error.split(":")[0]: d for d in h.out(names.DLQ)}  # type: ignore[attr-defined]
    assert set(letters) == {"feedback fa1 on turn 0 of session t-s",
                            "next state fb1 (feedback) for turn 0 of session t-s arrived after "
                            "the session was assembled (its rewards have left; "
                            "processors.hint_wait_s holds closed sessions open)"}  # fmt: skip
    replaced = letters["feedback fa1 on turn 0 of session t-s"]
    assert "superseded by a later vote of the same caller (fa2)" in replaced.error
    assert orjson.loads(replaced.original())["event_id"] == "fa1"
    (too_late,) = (d for k, d in letters.items() if k.startswith("next state fb1"))
    assert events.decode(too_late.original()) == late
    assert all(d.source_topic == names.NEXT_STATES for d in letters.values())
    text = metrics.exposition().decode()
    assert 'liverl_workers_inputs_left_out_total{reason="superseded"} 1.0' in text
    assert 'liverl_workers_inputs_left_out_total{reason="late"} 1.0' in text
    assert "liverl_workers_dead_lettered_total 2.0" in text


def test_a_keyed_post_from_a_user_who_does_not_own_the_session_is_left_out(h: Harness) -> None:
    """Bob's session (his first interaction's user_id). Through a gateway replica that never
    saw it, mallory's key votes down and posts a GUI error dialog: both are dead-lettered
    (not_owner), neither judged nor penalised. Bob's own vote and an operator's count: prm is
    the mean of the tool result (0), bob's up (+1) and the operator's down (-1): 0."""

    def keyed(eid: str, thumbs: str, user: str, ts: int, **extra: Any) -> events.NextState:
        vote = feedback_vote(eid, thumbs, f"k-{user}", ts)
        return dataclasses.replace(vote, detail={**vote.detail, "user_id": user, **extra})

    forged = keyed("fm1", "down", "mallory", 1)
    gui = dataclasses.replace(
        next_state(0, "gui", "Error: permission denied", producer=EXT), event_id="gm1",
        source="gui", detail={"key_id": "k-mallory", "user_id": "mallory",
                              "action": {"kind": "click", "target": "OK"}, "screen": "error"},
    )  # fmt: skip
    own, operator = keyed("fb1", "up", "bob", 2), keyed("fo1", "down", "ops", 3, operator=True)

    async def run() -> Any:
        app = h.app()
        session = agent_named(app, "session")
        async with session.test_context() as agent:
            await put(agent, names.INTERACTIONS, inter(0, user_id="bob"))
            for ns in (forged, gui, own, operator):
                await put(agent, names.NEXT_STATES, ns)
            await put(agent, names.INTERACTIONS, inter(1, session_done=True, user_id="bob"))
            await flush(agent, names.INTERACTIONS)
        return session.fun.__self__.rt.metrics

    metrics = asyncio.run(run())
    rewards = {r.turn: r for r in h.out(names.REWARDS)}  # type: ignore[attr-defined]
    assert rewards[0].prm == pytest.approx(0.0)
    judged = {p.parents[-1] for p in h.out(names.PRM_SCORES)}  # type: ignore[attr-defined]
    assert {own.event_id, operator.event_id} <= judged
    assert not {forged.event_id, gui.event_id} & judged
    assert not [p for p in h.out(names.PATH_PENALTIES)
                if gui.event_id in p.parents]  # type: ignore[attr-defined]  # fmt: skip
    letters = {events.decode(d.original()).event_id: d  # type: ignore[attr-defined]
               for d in h.out(names.DLQ)}  # fmt: skip
    assert set(letters) == {forged.event_id, gui.event_id}
    assert "posted by user 'mallory', who does not own the session ('bob')" in (
        letters["fm1"].error
    )  # type: ignore[attr-defined]
    text = metrics.exposition().decode()
    assert 'liverl_workers_inputs_left_out_total{reason="not_owner"} 2.0' in text


def test_posted_next_states_count_at_most_posted_per_turn_per_source(h: Harness) -> None:
    """Behind several gateway replicas each caps a turn's posts on its own: the workers hold
    the cap for all of them. Six error dialogs posted on turn 0 (posted_per_turn 4): four are
    judged and penalised, two dead-lettered (posted_cap); a terminal post of the same turn
    has a cap of its own and counts."""

    def posted(i: int, kind: str, content: str, **detail: Any) -> events.NextState:
        ns = next_state(0, kind, content, producer=EXT)
        return dataclasses.replace(ns, event_id=f"p{kind}{i}", source=kind,
                                   detail={"key_id": f"replica-{i % 3}", **detail})  # fmt: skip

    dialogs = [posted(i, "gui", "Error: permission denied", screen="error",
                      action={"kind": "click", "target": f"OK {i}"}) for i in range(6)]  # fmt: skip
    term = posted(9, "terminal", "1 failed", exit_code=1, command="pytest -q")

    async def run() -> Any:
        app = h.app(posted_per_turn=4)
        session = agent_named(app, "session")
        async with session.test_context() as agent:
            await put(agent, names.INTERACTIONS, inter(0))
            for ns in (*dialogs, term):
                await put(agent, names.NEXT_STATES, ns)
            await put(agent, names.INTERACTIONS, inter(1, session_done=True))
            await flush(agent, names.INTERACTIONS)
        return session.fun.__self__.rt.metrics

    metrics = asyncio.run(run())
    judged = {p.parents[-1] for p in h.out(names.PRM_SCORES)}  # type: ignore[attr-defined]
    assert {d.event_id for d in dialogs[:4]} | {term.event_id} <= judged
    assert not {d.event_id for d in dialogs[4:]} & judged
    penalised = {p.parents[-1] for p in h.out(names.PATH_PENALTIES)}  # type: ignore[attr-defined]
    assert not {d.event_id for d in dialogs[4:]} & penalised
    letters = [events.decode(d.original()).event_id  # type: ignore[attr-defined]
               for d in h.out(names.DLQ)]  # fmt: skip
    assert sorted(letters) == ["pgui4", "pgui5"]
    text = metrics.exposition().decode()
    assert 'liverl_workers_inputs_left_out_total{reason="posted_cap"} 2.0' in text


def test_a_burst_of_a_sessions_records_is_one_state_write(h: Harness) -> None:
    """Records taken in one batch share a state read and write per session: three turns
    and another session's turn, taken together, write two sessions values, not four; the
    outputs are those of one record at a time."""

    async def run(app: faust.App, burst: bool) -> None:
        async with agent_named(app, "session").test_context() as agent:
            for t in range(3):
                await put(agent, names.INTERACTIONS, inter(t, session_done=t == 2))
            await put(agent, names.INTERACTIONS, inter(0, sid="t-s2"))
            if burst:
                await eventually(lambda: sum(t == "sessions" for t, _, _ in h.changelog) > 1)
            await flush(agent, names.INTERACTIONS)

    asyncio.run(run(h.app(session_batch=4, session_batch_s=1.0), burst=True))
    batched_writes = [k for t, k, _ in h.changelog if t == "sessions"]

    def outputs() -> list[tuple[str, str]]:  # event ids: deterministic, unlike ts_ms
        return [(t, events.decode(v).event_id) for t, _, v in h.sent]

    batched_out = outputs()
    h.sent.clear()
    h.changelog.clear()
    asyncio.run(run(h.app(session_batch=1), burst=False))
    single_writes = [k for t, k, _ in h.changelog if t == "sessions"]
    assert sorted(batched_writes) == sorted([b"t-s2", SID.encode()])
    assert sorted(single_writes) == sorted([b"t-s2"] + [SID.encode()] * 3)
    assert outputs() == batched_out and len(batched_out) >= 8  # the same events, same order


def test_the_idle_sweep_waits_for_a_batch_on_the_same_session(h: Harness) -> None:
    """A batch holds its session from its state read to its write, across its sends: a sweep
    in between would read the state before the batch's turn, close the session as idle, and
    then have that close overwritten by the batch's write (a session_end sent for an open
    session). The sweep waits, then reads the batch's state: the session is not idle."""

    async def run() -> None:
        app = h.app()
        async with agent_named(app, "session").test_context() as agent:
            await put(agent, names.INTERACTIONS, inter(0))
            await flush(agent, names.INTERACTIONS)
            h.clock += 61_000  # idle by the state in the table, until turn 1 is written
            hold = h.hold = asyncio.Event()
            await put(agent, names.INTERACTIONS, inter(1))
            await eventually(lambda: h.hold is None)  # the batch is in its first send
            sweep = asyncio.create_task(app.liverl_timers["session_sweep"]())
            await asyncio.sleep(0.05)
            assert not sweep.done()  # waiting for the session, not for a send
            hold.set()
            await asyncio.wait_for(sweep, 5)
            await flush(agent, names.INTERACTIONS)

    asyncio.run(run())
    assert [(e.turn, e.kind) for e in h.out(names.NEXT_STATES)] == [(0, "tool_result")]  # type: ignore[attr-defined]
    last = session_states(h)[-1]
    assert not last.pairing.closed and sorted(last.assembly.turns) == [0, 1]
