"""The worker's transaction: after a unit failed nothing may be committed any more (half a
unit's outputs are in the open transaction and its record is not acked,
``test_processors_runtime.py``: the commit raises, the worker stops, the broker aborts, the
restart reads the records again); a fenced producer stops the worker; table recovery past the
changelog's closing marker waits for what was handed to it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import faust
import pytest
from faust.types import TP

from pipeline.processors.transactions import Transaction, UnitFailed


class Producer:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def send_offsets_to_transaction(self, offsets: Any, group_id: str) -> None:
        self.calls.append("offsets")

    async def commit_transaction(self) -> None:
        self.calls.append("commit")

    async def begin_transaction(self) -> None:
        self.calls.append("begin")


def txn() -> tuple[Transaction, Producer]:
    t = Transaction("app-eos-host-0", "app", timeout_s=60)
    t.producer = producer = Producer()
    return t, producer


def test_a_unit_that_raised_stops_every_later_commit() -> None:
    t, producer = txn()

    async def main() -> None:
        async with t.unit():
            pass  # a unit that completed
        await t.commit({TP("in", 0): 1})
        with pytest.raises(KeyError):
            async with t.unit():
                raise KeyError("half done")
        async with t.unit():
            pass  # later units run (their outputs are aborted with the rest)
        with pytest.raises(UnitFailed, match="KeyError"):
            await t.commit({TP("in", 0): 3})

    asyncio.run(main())
    assert producer.calls == ["offsets", "commit", "begin"]  # only the first commit
    assert t.commits == 1


def test_a_cancelled_unit_stops_commits_and_an_inner_failure_caught_by_its_unit_does_not() -> None:
    t, producer = txn()

    async def main() -> None:
        async with t.unit():
            try:
                async with t.unit():  # re-entrant: a timer's send inside its unit
                    raise ValueError("handled by the outer unit")
            except ValueError:
                pass
        await t.commit({})
        assert t.commits == 1

        async def cut_short() -> None:
            async with t.unit():
                await asyncio.sleep(60)

        task = asyncio.ensure_future(cut_short())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(UnitFailed, match="CancelledError"):
            await t.commit({})

    asyncio.run(main())
    assert producer.calls == ["commit", "begin"]


def test_a_fenced_send_stops_the_worker_once_and_other_errors_do_not() -> None:
    """A transaction the broker aborted (open past its timeout under load) fences the
    producer: every later write fails, yet the worker held its partitions for minutes and
    processed nothing durable (a soak lost 805 of 1,500 turns to it). It must stop."""
    from aiokafka.errors import KafkaTimeoutError, ProducerFenced
    from faust.exceptions import ProducerSendError

    from pipeline.processors.transactions import Producer, is_fenced

    crashed: list[BaseException] = []

    async def crash(exc: BaseException) -> None:
        crashed.append(exc)

    async def main() -> None:
        producer = Producer.__new__(Producer)
        producer.app = SimpleNamespace(crash=crash, liverl_transaction=Transaction(
            "app-eos-host-0", "app", timeout_s=60))  # fmt: skip
        loop = asyncio.get_running_loop()
        for exc in (KafkaTimeoutError(), ProducerFenced(), ProducerFenced()):
            fut: asyncio.Future[Any] = loop.create_future()
            fut.add_done_callback(producer._delivered)
            fut.set_exception(exc)
        wrapped = ProducerSendError("Error while sending")
        wrapped.__cause__ = ProducerFenced()
        producer._on_fenced(wrapped)
        await asyncio.sleep(0.01)

    asyncio.run(main())
    assert len(crashed) == 1 and is_fenced(crashed[0])  # once, whichever came first
    wrapped = ProducerSendError("x")
    wrapped.__cause__ = ProducerFenced()
    assert is_fenced(wrapped) and not is_fenced(ProducerSendError("x")) and not is_fenced(None)


def test_recovery_past_markers_waits_for_what_was_fetched_to_be_applied() -> None:
    """Past the changelog's last offset (a commit marker read_committed never hands over),
    recovery is declared done after a round without progress, but only once every record
    handed to it was taken: a starved recovery loop with records in its queue made no
    progress for a round, was declared done, and dropped those records (the newest sessions'
    state) because recovery skips offsets at or below the one it is told."""
    from pipeline.processors import transactions

    app = faust.App("markers", broker=f"{transactions.SCHEME}://127.0.0.1:1")
    app.liverl_transaction = Transaction("t", "g", 10)  # type: ignore[attr-defined]
    consumer: Any = app.consumer
    tp = TP("markers-sessions-changelog", 0)
    recovery = SimpleNamespace(in_recovery=True, active_offsets={tp: 7},
                               active_highwaters={tp: 10})  # fmt: skip
    app.tables._recovery = recovery  # type: ignore[attr-defined]
    consumer.changelog_handed = {tp: 9}  # fetched up to 9; 8 and 9 wait in recovery's queue
    rounds: list[int] = []

    async def sleep(_: float) -> None:
        rounds.append(recovery.active_offsets[tp])
        if len(rounds) == 4:  # recovery takes 8 and 9 while it was declared nothing
            recovery.active_offsets[tp] = 9
        if len(rounds) > 7:
            raise asyncio.CancelledError

    async def position(_: TP) -> int:
        return 11  # past the last offset: 10 is the marker

    consumer.sleep = sleep
    consumer.position = position

    async def main() -> None:
        with pytest.raises(asyncio.CancelledError):
            await type(consumer)._recover_past_markers(consumer)

    asyncio.run(main())
    # Rounds 1-4: 7 < 9 handed: never declared. Then 9 in two rounds alike: declared (10).
    assert rounds[:4] == [7, 7, 7, 7]
    assert recovery.active_offsets[tp] == 10
