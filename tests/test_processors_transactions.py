"""The worker's transactional producer once the broker fenced it: it must stop the worker."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from pipeline.processors.transactions import Transaction


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
