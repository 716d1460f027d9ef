"""The worker's token store (processors/token_store.py): held payloads, the legacy table, and
reading interactions back at their coordinates, once per try and not again until retry_s."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from pipeline import events
from pipeline.events import examples
from pipeline.processors.app import check_retention
from pipeline.processors.errors import RetentionError
from pipeline.processors.records import token_key
from pipeline.processors.rewards import KeptInteraction, RecordAt, TokenPayload, token_payload
from pipeline.processors.token_store import TokenStore

KEY = b"s1"


def inter(turn: int, event_id: str | None = None) -> events.Interaction:
    base = examples.interaction(prompt_tokens=3, response_tokens=2)
    return dataclasses.replace(
        base, event_id=event_id or f"i{turn}", session_id="s1", turn=turn,
        prompt_token_ids=[turn, turn + 1, turn + 2], response_token_ids=[100 + turn, 7],
        response_logprobs=[-0.5, -0.25],
    )  # fmt: skip


def kept(turn: int, offset: int | None, event_id: str | None = None) -> KeptInteraction:
    at = None if offset is None else RecordAt("liverl.interactions.v1", 0, offset)
    return KeptInteraction(event_id or f"i{turn}", "p", 1, None, 0, at=at)


class Wire:
    """A fake interactions topic: offset -> value, and every read asked of it."""

    def __init__(self, **values: bytes) -> None:
        self.values = {("liverl.interactions.v1", 0, int(k[1:])): v for k, v in values.items()}
        self.asked: list[list[tuple[str, int, int]]] = []
        self.fail = False

    def __call__(self, wanted: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], bytes]:
        self.asked.append(sorted(wanted))
        if self.fail:
            raise OSError("broker away")
        return {c: self.values[c] for c in wanted if c in self.values}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gather(store: TokenStore, wanted: dict[int, KeptInteraction]) -> dict[int, TokenPayload]:
    return asyncio.run(store.gather(KEY, wanted))


def test_held_payloads_are_used_and_only_the_rest_is_read_back_in_one_call() -> None:
    wire = Wire(o5=events.encode(inter(1)), o9=events.encode(inter(2)))
    store = TokenStore({}, wire)
    store.keep(KEY, inter(0))
    got = gather(store, {0: kept(0, 4), 1: kept(1, 5), 2: kept(2, 9)})
    assert got == {t: token_payload(inter(t)) for t in (0, 1, 2)}
    assert wire.asked == [[("liverl.interactions.v1", 0, 5), ("liverl.interactions.v1", 0, 9)]]
    assert (store.read_back, store.not_found, len(store)) == (2, 0, 3)
    assert gather(store, {1: kept(1, 5)}) == {1: token_payload(inter(1))}
    assert len(wire.asked) == 1  # read back once, held since


def test_a_held_payload_of_another_interaction_is_not_used() -> None:
    """A retry of turn 0 on another replica replaced the one held: the state names which."""
    wire = Wire(o3=events.encode(inter(0, "retry")))
    store = TokenStore({}, wire)
    store.keep(KEY, inter(0))
    assert gather(store, {0: kept(0, 3, "retry")}) == {0: token_payload(inter(0, "retry"))}
    assert wire.asked == [[("liverl.interactions.v1", 0, 3)]]


def test_a_record_that_is_not_the_kept_interaction_counts_as_not_found_until_retry_s() -> None:
    wrong = events.encode(inter(0, "someone-else"))
    wire = Wire(o3=wrong, o4=b'{"not": "an event"}')
    clock = Clock()
    store = TokenStore({}, wire, retry_s=30.0, clock=clock)
    wanted = {0: kept(0, 3), 1: kept(1, 4), 2: kept(2, 8)}
    assert gather(store, wanted) == {}
    assert (store.not_found, len(wire.asked)) == (3, 1)
    clock.now += 29.0
    assert gather(store, wanted) == {}
    assert len(wire.asked) == 1  # not asked again before retry_s
    clock.now += 1.0
    wire.values[("liverl.interactions.v1", 0, 8)] = events.encode(inter(2))
    assert gather(store, wanted) == {2: token_payload(inter(2))}
    assert len(wire.asked) == 2 and store.read_back == 1


def test_a_failed_read_leaves_the_turns_out_and_is_tried_again_after_retry_s() -> None:
    wire = Wire(o3=events.encode(inter(0)))
    wire.fail = True
    clock = Clock()
    store = TokenStore({}, wire, retry_s=10.0, clock=clock)
    assert gather(store, {0: kept(0, 3)}) == {}
    assert store.not_found == 0  # a failed read says nothing about the record
    wire.fail = False
    clock.now += 9.0
    assert gather(store, {0: kept(0, 3)}) == {} and len(wire.asked) == 1  # not before retry_s
    clock.now += 1.0
    assert gather(store, {0: kept(0, 3)}) == {0: token_payload(inter(0))}


def test_payloads_written_by_earlier_workers_are_read_from_the_legacy_table_and_dropped() -> None:
    """A state written before coordinates were kept has neither `at` nor a held payload."""
    legacy: dict[bytes, Any] = {token_key(KEY, 0): token_payload(inter(0)).to_bytes()}
    wire = Wire()
    store = TokenStore(legacy, wire)
    assert gather(store, {0: kept(0, None), 1: kept(1, None)}) == {0: token_payload(inter(0))}
    assert wire.asked == []  # no coordinates: nothing to read back
    store.drop(KEY, [0, 1])
    assert legacy == {}


def test_drop_and_drop_orphans_forget_what_no_session_needs() -> None:
    clock = Clock()
    store = TokenStore({}, Wire(), retry_s=5.0, clock=clock)
    store.keep(KEY, inter(0))
    store.keep(KEY, inter(1))
    store.keep(b"s2", inter(0))
    store.drop(KEY, [0])
    assert len(store) == 2
    store.drop_orphans({b"s2"})
    assert len(store) == 1
    assert gather(store, {1: kept(1, 4)}) == {}  # s1's turn 1 was dropped: read back, not found
    assert store._retry_at  # noqa: SLF001 (the retry time is forgotten once it has passed)
    clock.now += 5.0
    store.drop_orphans({b"s2"})
    assert not store._retry_at  # noqa: SLF001


@pytest.mark.parametrize(
    ("retention_ms", "retain_s", "refused"),
    [("1209600000", 6 * 3600.0, False), ("3600000", 3600.0, True), ("3600000", 7200.0, True),
     ("-1", 1e9, False)],
)  # fmt: skip
def test_a_worker_refuses_a_state_that_outlives_its_interactions(
    retention_ms: str, retain_s: float, refused: bool
) -> None:
    from pipeline.kafka.topics import TopicSpec

    spec = TopicSpec("liverl.interactions.v1", 6, 1, "session_id", "interaction.v1.json",
                     config={"retention.ms": retention_ms})  # fmt: skip
    if refused:
        with pytest.raises(RetentionError, match=r"keeps records for 1 h .* lower retain_s"):
            check_retention([spec], retain_s)
    else:
        check_retention([spec], retain_s)
