"""Units of work ack only what they finished: an event whose unit failed or was cancelled
stays unacknowledged, so the committed offset never passes it (issue 37; the ledger hands
it again, ``ledger_consumer.py``). Before, both ``units`` and ``unit_batches`` acked in a
``finally``: a unit that raised counted as processed."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.processors.runtime import Runtime


class Msg:
    def __init__(self) -> None:
        self.refcount, self.acked = 1, False

    def incref(self, n: int = 1) -> None:
        self.refcount += n


class Stream:
    """What the two methods use of a Faust stream; ``take_events`` acks its batch again when
    it is closed, as Faust's does."""

    enable_acks = True

    def __init__(self, n: int) -> None:
        self.evs = [SimpleNamespace(message=Msg()) for _ in range(n)]

    async def events(self) -> Any:
        for ev in self.evs:
            yield ev

    async def ack(self, ev: Any) -> None:  # Faust's Message.ack: final at refcount 0
        if not ev.message.acked:
            ev.message.refcount -= 1
            ev.message.acked = ev.message.refcount <= 0

    def take_events(self, size: int, within: float) -> Any:
        async def batches() -> Any:
            batch = list(self.evs)
            try:
                yield batch
            finally:
                for ev in batch:
                    await self.ack(ev)

        return batches()


def runtime() -> Runtime:
    rt = object.__new__(Runtime)
    rt.app = SimpleNamespace()  # type: ignore[assignment]  # at least once: no transaction
    return rt


@pytest.mark.parametrize("fails", [False, True])
def test_units_ack_an_event_only_when_its_unit_finished(fails: bool) -> None:
    stream = Stream(2)

    async def run() -> None:
        async with contextlib.aclosing(runtime().units(stream)) as units:  # type: ignore[type-var]
            with contextlib.suppress(RuntimeError):
                async for _ev in units:
                    if fails:
                        raise RuntimeError("the unit failed")

    asyncio.run(run())
    assert [ev.message.acked for ev in stream.evs] == ([False, False] if fails else [True, True])


@pytest.mark.parametrize("fails", [False, True])
def test_unit_batches_ack_a_batch_only_when_its_unit_finished(fails: bool) -> None:
    stream = Stream(3)

    async def run() -> None:
        batches = runtime().unit_batches(stream, 3, 0.01)  # type: ignore[arg-type]
        async with contextlib.aclosing(batches) as units:  # type: ignore[type-var]
            with contextlib.suppress(RuntimeError):
                async for _batch in units:
                    if fails:
                        raise RuntimeError("the unit failed")

    asyncio.run(run())
    # take_events' own ack when closed is never the final one for a batch that failed.
    assert [ev.message.acked for ev in stream.evs] == [not fails] * 3
