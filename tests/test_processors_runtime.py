"""``Runtime.units`` / ``unit_batches``: a unit that raised or was cancelled is never acked,
so the ledger's commit point stays before its record (issue 37: the ack used to sit in a
``finally`` and a failed unit counted as processed).

The stream here follows faust-streaming 0.15.3's protocol: ``Stream.ack(event)`` is
``event.ack()`` (Faust's own ``Event``/``ConsumerMessage``: a reference count whose last ack
calls ``Consumer.ack``), and ``take_events`` acks each event of a batch again in the
``finally`` that runs when the batch is given back or the generator is closed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import faust
import pytest
from faust.events import Event
from faust.types import TP
from faust.types.tuples import ConsumerMessage

from pipeline.processors import ledger_consumer
from pipeline.processors.runtime import Runtime

PART = TP("in", 0)


class Stream:
    def __init__(self, events: list[Event]) -> None:
        self._events = events
        self.enable_acks = True

    async def events(self) -> AsyncIterator[Event]:
        for ev in self._events:
            yield ev

    async def ack(self, event: Event) -> bool:
        return bool(event.ack())

    async def take_events(self, size: int, within: float) -> AsyncIterator[list[Event]]:
        for i in range(0, len(self._events), size):
            batch = self._events[i : i + size]
            try:
                yield list(batch)
            finally:
                for ev in batch:
                    await self.ack(ev)


def setup(n: int) -> tuple[Any, list[Event]]:
    app = faust.App("units", broker=f"{ledger_consumer.SCHEME}://127.0.0.1:1")
    consumer: Any = app.consumer
    app.topics.acks_enabled_for = lambda topic: True  # type: ignore[method-assign]
    events = []
    for offset in range(n):
        msg = ConsumerMessage(PART.topic, PART.partition, offset, 0.0, 0, None, b"k", b"v",
                              None)  # fmt: skip
        msg.refcount = 1  # one stream holds it
        assert consumer.ledger.hand(PART, offset, msg)
        events.append(Event(app, b"k", b"v", {}, msg))
    return consumer, events


def runtime() -> Any:
    return SimpleNamespace(unit=contextlib.nullcontext)


def test_a_unit_that_raises_is_not_acked_and_the_commit_stops_before_it() -> None:
    consumer, events = setup(4)

    async def agent() -> None:
        async for ev in Runtime.units(runtime(), Stream(events)):  # type: ignore[arg-type]
            if ev.message.offset == 2:
                raise RuntimeError("a bug in the unit")

    with pytest.raises(RuntimeError):
        asyncio.run(agent())
    assert [ev.message.acked for ev in events] == [True, True, False, False]
    assert consumer._new_offset(PART) == 2  # the failed record is the commit point


def test_a_cancelled_unit_is_not_acked() -> None:
    consumer, events = setup(3)
    reached = asyncio.Event()

    async def agent() -> None:
        async for ev in Runtime.units(runtime(), Stream(events)):  # type: ignore[arg-type]
            if ev.message.offset == 1:
                reached.set()
                await asyncio.sleep(60)  # cancelled here (a stop, a revoke)

    async def main() -> None:
        task = asyncio.ensure_future(agent())
        await reached.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # the generator's close, scheduled by the loop's hook

    asyncio.run(main())
    assert [ev.message.acked for ev in events] == [True, False, False]
    assert consumer._new_offset(PART) == 1


def test_a_batch_whose_unit_raised_is_acked_neither_by_the_unit_nor_by_take_events() -> None:
    consumer, events = setup(6)

    async def agent() -> None:
        batches = Runtime.unit_batches(runtime(), Stream(events), 2, 0.1)  # type: ignore[arg-type]
        async for evs in batches:
            if evs[0].message.offset == 2:
                raise RuntimeError("a bug in the unit")

    async def main() -> None:
        with pytest.raises(RuntimeError):
            await agent()
        await asyncio.sleep(0)  # the generators' close (take_events' finally acks)
        await asyncio.sleep(0)

    asyncio.run(main())
    assert [ev.message.acked for ev in events] == [True, True, False, False, False, False]
    assert consumer._new_offset(PART) == 2


def test_a_batch_that_completes_is_acked_once() -> None:
    consumer, events = setup(4)

    async def agent() -> None:
        async for _ in Runtime.unit_batches(runtime(), Stream(events), 2, 0.1):  # type: ignore[arg-type]
            pass

    asyncio.run(agent())
    assert all(ev.message.acked for ev in events)
    assert consumer._new_offset(PART) == 4
