"""One session's judge and pairing state stays under the record limit whatever its turns carry
(issue 11): texts are cut, the oldest turns and commands dropped, and judging and path
penalties still work on what is kept."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orjson
import pytest
from pydantic import TypeAdapter, ValidationError

from pipeline.events import Interaction, NextState, examples
from pipeline.kafka import EventProducer, names
from pipeline.kafka.reader import read_to_end
from pipeline.processors import judging
from pipeline.processors.config import DEFAULT_RULES, ProcessorSettings
from pipeline.processors.judges import TurnContext, make_judge
from pipeline.processors.pairing import Pairer, PairingState
from pipeline.processors.penalties import load_rules
from pipeline.settings import Settings

from .test_processors_integration import (
    Collector,
    drop_internal_topics,
    high_watermarks,
    start_worker,
    stop,
)

BOUND = ProcessorSettings().state_max_bytes
RECORD_LIMIT = Settings().kafka.max_record_bytes
JUDGE_JSON = TypeAdapter(judging.JudgeState)
PAIRING_JSON = TypeAdapter(PairingState)


def judge_bytes(state: judging.JudgeState) -> int:
    """The state's size as the session table serialises it."""
    return len(JUDGE_JSON.dump_json(state))


def pairing_bytes(state: PairingState) -> int:
    return len(PAIRING_JSON.dump_json(state))


def big_turn(t: int, size: int, **kw: Any) -> Any:
    base = examples.interaction(prompt_tokens=4, response_tokens=2)
    request = f"request {t} " + "q" * size + f" please answer {t}"
    return dataclasses.replace(
        base,
        event_id=f"i{t}",
        session_id="long",
        turn=t,
        tool_calls=[],
        messages=[{"role": "user", "content": request}],
        response_text=f"answer {t} " + "a" * size + f" end {t}",
        **kw,
    )


def reply(t: int, text: str) -> NextState:
    return dataclasses.replace(
        examples.examples()["next_state"],
        event_id=f"ns{t}",
        session_id="long",
        turn=t,
        kind="user_reply",
        content=text,
        score=None,
        exit_code=None,
        scope=None,
    )


def test_judge_state_of_many_multi_mb_turns_stays_bounded() -> None:
    state: judging.JudgeState | None = None
    unbounded = 0
    for t in range(300):
        inter = big_turn(t, 200_000)  # 400 KB of text a turn: 120 MB for the session
        unbounded += 400_000
        state = judging.on_interaction(state, inter)
        assert judge_bytes(state) <= BOUND
    assert unbounded > 8 * RECORD_LIMIT, "the session crosses the record limit many times"
    assert state is not None
    kept = sorted(state.turns)
    assert kept == list(range(kept[0], 300)) and 50 < len(kept) < 300, "the newest that fit"
    # judging still works on the newest turn, with the end of its texts
    state, todo = judging.on_next_state(state, reply(299, "Thanks, that works"), 0)
    work = judging.take_ready(state, todo[0])
    assert work is not None and work.interaction_id == "i299"
    assert work.ctx.request.endswith("please answer 299") and work.ctx.answer.endswith("end 299")
    assert len(work.ctx.request) == ProcessorSettings().state_text_chars
    out = asyncio.run(judging.judge_one(make_judge("replies"), work))
    assert out.prm.score == 1 and out.prm.parents == ["i299", "ns299"]
    # a next state for a turn that was dropped waits (and is dead-lettered after grace_s)
    state, todo = judging.on_next_state(state, reply(0, "ok"), 0)
    assert judging.take_ready(state, todo[0]) is None and "ns0" in state.pending


def test_judge_state_worst_case_texts_and_ids() -> None:
    """Control characters take 6 bytes in JSON; an event id may be as long as an event."""
    state: judging.JudgeState | None = None
    for t in range(20):
        inter = dataclasses.replace(big_turn(t, 10), response_text="\x01" * 300_000)
        state = judging.on_interaction(state, inter, text_chars=8_192, max_bytes=200_000)
        assert judge_bytes(state) <= 200_000
    huge = dataclasses.replace(big_turn(20, 10), event_id="x" * 300_000)
    state = judging.on_interaction(state, huge, text_chars=8_192, max_bytes=200_000)
    assert judge_bytes(state) <= 200_000 and 20 not in state.turns


def test_judge_state_round_trips_through_its_json() -> None:
    """The session table serialises the state with pydantic: it must come back equal, turn
    numbers (JSON object keys) included."""
    state = None
    for t in (3, 12):
        inter = dataclasses.replace(big_turn(t, 50), response_text="é\x01 ok")
        state = judging.on_interaction(state, inter)
    state, _ = judging.on_next_state(state, reply(40, "later"), 1_000)
    assert sorted(state.turns) == [3, 12] and state.pending == {"ns40": judging.Pending(1_000, 40)}
    assert JUDGE_JSON.validate_json(JUDGE_JSON.dump_json(state)) == state
    empty = judging.JudgeState()
    assert JUDGE_JSON.validate_json(JUDGE_JSON.dump_json(empty)) == empty


def shell(call_id: str, cmd: str) -> dict[str, Any]:
    args = orjson.dumps({"cmd": cmd}).decode()
    return {"id": call_id, "type": "function", "function": {"name": "shell", "arguments": args}}


def tool_turn(t: int, calls: list[dict[str, Any]], result: str | None) -> Any:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    if result is not None:  # the previous turn's calls and their results
        msgs += [{"role": "assistant", "content": None}]
        msgs += [{"role": "tool", "tool_call_id": f"c{t - 1}", "content": result}]
    base = examples.interaction(prompt_tokens=4, response_tokens=2)
    return dataclasses.replace(
        base, event_id=f"i{t}", session_id="long", turn=t, messages=msgs, tool_calls=calls
    )


def test_pairing_state_of_many_huge_commands_stays_bounded() -> None:
    pairer = Pairer(load_rules(DEFAULT_RULES))
    state: PairingState | None = None
    penalties = []
    for t in range(120):  # a distinct 400 KB failing command each turn: 48 MB of history
        cmd = f"pytest {t} " + "-k x " * 80_000
        out = pairer.on_interaction(
            state, tool_turn(t, [shell(f"c{t}", cmd)], "error: boom" if t else None)
        )
        state = out.state
        penalties += out.penalties
        assert pairing_bytes(state) <= BOUND
    assert len(penalties) == 119
    # the same huge call failing over and over is still recognised as the same call
    same = "make build " + "--verbose " * 50_000
    for t in range(120, 125):
        out = pairer.on_interaction(state, tool_turn(t, [shell(f"c{t}", same)], "error: boom"))
        state = out.state
        penalties += out.penalties
        assert pairing_bytes(state) <= BOUND
    out = pairer.on_interaction(state, tool_turn(125, [], "error: boom"))
    assert pairing_bytes(out.state) <= BOUND
    last = [*penalties, *out.penalties][-3:]  # turns 122-124: that call's 3rd-5th failures
    assert all(p.rule_ids == ["repeated-failing-call"] for p in last), last


def test_pairing_keeps_what_fits_of_a_turn_with_thousands_of_calls() -> None:
    pairer = Pairer(load_rules(DEFAULT_RULES), max_bytes=200_000, text_chars=4_096)
    calls = [shell(f"c{i}", f"echo {i} " + "y" * 200) for i in range(5_000)]
    out = pairer.on_interaction(None, tool_turn(0, calls, None))
    assert pairing_bytes(out.state) <= 200_000
    assert out.state.prev is not None and 0 < len(out.state.prev.tool_calls) < 5_000


def test_the_bound_must_hold_two_full_turns() -> None:
    with pytest.raises(ValidationError, match="state_max_bytes"):
        ProcessorSettings(state_text_chars=100_000, state_max_bytes=1 << 20)
    assert ProcessorSettings().state_max_bytes < Settings().kafka.max_event_bytes


# ---- the real worker on the real broker -------------------------------------------------------


@pytest.mark.integration
def test_worker_keeps_rewarding_a_long_session_of_large_turns(
    kafka_settings: Settings, unique: str, tmp_path: Any
) -> None:
    """24 turns of ~800 KB (request, answer, a shell command): ~19 MB of judge state and
    ~7 MB of command history unbounded, past the 9 MiB record limit of a changelog value."""
    sid, n = f"bound-{unique}", 24
    turns: list[Interaction] = []
    for t in range(n):
        inter = big_turn(t, 250_000, session_done=t == n - 1)
        cmd = f"pytest -k case{t} " + "-v " * 100_000
        turns.append(
            dataclasses.replace(
                inter,
                event_id=f"{sid}-i{t}",
                session_id=sid,
                ts_ms=1_790_000_000_000 + t,
                tool_calls=[shell(f"c{t}", cmd)],
            )
        )
    unbounded = [TurnContext.from_interaction(i) for i in turns]
    assert sum(len(c.request) + len(c.answer) for c in unbounded) > 2 * RECORD_LIMIT
    rules = tmp_path / "rules.yaml"
    rules.write_text(DEFAULT_RULES.read_text())
    start = high_watermarks(kafka_settings)
    producer = EventProducer(kafka_settings, client_id="bound", partitioner="murmur2_random")
    for inter in turns:
        producer.send(names.INTERACTIONS, inter)
    producer.flush()

    def done(by_topic: Any) -> bool:
        return all(len({e.turn for e in by_topic[t]}) >= n for t in (names.REWARDS, names.SAMPLES))

    app_id = f"bound-{unique}"
    col = Collector(kafka_settings, sid, start)
    proc = start_worker(app_id, sid, rules, tmp_path, state_text_chars=str(CHARS))
    try:
        col.poll_until(done, proc, limit_s=240)
        alive = proc.poll() is None
        stop(proc)
        sizes = changelog_sizes(kafka_settings, f"{app_id}-sessions-changelog", sid)
    finally:
        stop(proc)
        col.close()
        drop_internal_topics(kafka_settings, app_id)
    log = (tmp_path / f"{app_id}.log").read_text(errors="replace")
    assert alive, log[-3000:]
    counts = {t: len({e.event_id for e in v}) for t, v in col.by_topic.items()}
    assert counts.get(names.PRM_SCORES, 0) >= n, (counts, log[-3000:])
    assert counts.get(names.PATH_PENALTIES, 0) >= n, counts
    rewards = {e.turn for e in col.by_topic[names.REWARDS]}
    samples = {e.turn for e in col.by_topic[names.SAMPLES]}
    assert rewards == samples == set(range(n)), counts
    assert "TooLarge" not in log and "too large" not in log.lower(), log[-3000:]
    # the setting is what bounds the session's value: every turn's texts cut to CHARS
    # characters (judge: request and answer; pairing: the command, and the command history),
    # plus ids and votes (assembly), against ~26 MB unbounded
    assert max(sizes) < n * (2 * CHARS + 200) + n * (CHARS + 200) + 4 * CHARS + n * 1_000, sizes[
        -3:
    ]


CHARS = 1_000


def changelog_sizes(settings: Settings, topic: str, sid: str) -> list[int]:
    """Sizes of the session's values in a table's changelog, oldest first (read to each
    partition's end: a transactional changelog ends in a commit marker)."""
    sizes: list[int] = []

    def note(msg: Any) -> None:
        if msg.key() == sid.encode() and msg.value():
            sizes.append(len(msg.value()))

    read_to_end(settings, [topic], note, group_prefix=f"sizes-{topic}-")
    assert sizes, f"no changelog values of {sid} in {topic}"
    return sizes
