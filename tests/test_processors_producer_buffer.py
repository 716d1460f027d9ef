"""The producer's buffer of table writes: a flush returns only once every write is handed over
(Faust's returns after 0.1 s without progress: a commit then missed a session's state)."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
from faust.transport.producer import ProducerBuffer

from pipeline.processors.producer_buffer import DrainedBuffer


class SlowChannel:
    """Hands records to a pretend producer, each taking ``delay_s``."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.handed: list[int] = []

    async def publish_message(self, fut: Any, wait: bool = False) -> None:
        await asyncio.sleep(self.delay_s)
        self.handed.append(fut.n)


def write(channel: SlowChannel, n: int) -> Any:
    return SimpleNamespace(n=n, message=SimpleNamespace(channel=channel))


async def flushed(buffer_type: type[ProducerBuffer], delay_s: float, writes: int) -> list[int]:
    """What was handed over when ``flush`` returned."""
    buf = buffer_type()
    buf.app = SimpleNamespace(conf=SimpleNamespace(producer_threaded=False))  # type: ignore[assignment]
    channel = SlowChannel(delay_s)
    await buf.start()
    try:
        for n in range(writes):
            buf.put(write(channel, n))
        await buf.flush()
        return list(channel.handed)
    finally:
        with contextlib.suppress(RuntimeError):  # Faust's own stop flushes again, and refuses
            await buf.stop()


def test_faust_s_own_flush_returns_with_table_writes_still_queued() -> None:
    # The reason for DrainedBuffer: a slow hand-over (a loaded worker) and Faust's flush gives up.
    assert len(asyncio.run(flushed(ProducerBuffer, 0.15, 3))) < 3


def test_flush_returns_only_once_every_write_is_handed_over_in_order() -> None:
    assert asyncio.run(flushed(DrainedBuffer, 0.15, 3)) == [0, 1, 2]


async def _taken_by_the_task() -> None:
    buf = DrainedBuffer()
    buf.app = SimpleNamespace(conf=SimpleNamespace(producer_threaded=False))  # type: ignore[assignment]
    channel = SlowChannel(0.2)
    await buf.start()
    try:
        buf.put(write(channel, 7))
        await asyncio.sleep(0.05)  # the task has taken it: the queue is empty
        assert buf.size == 0 and buf.in_flight == 1
        await buf.flush()
        assert channel.handed == [7] and buf.in_flight == 0
    finally:
        await buf.stop()


def test_a_write_taken_by_the_sending_task_counts_until_handed_over() -> None:
    asyncio.run(_taken_by_the_task())


def test_a_flush_of_a_stopped_buffer_with_writes_says_so() -> None:
    buf = DrainedBuffer()
    buf.app = SimpleNamespace(conf=SimpleNamespace(producer_threaded=False))  # type: ignore[assignment]
    buf.put(write(SlowChannel(0.0), 1))  # never started: nothing would ever hand it over
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(buf.flush())
