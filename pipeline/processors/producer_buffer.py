"""Faust's producer with a flush that waits for every table write, not for 0.1 s.

A table write (``table[key] = value``) is synchronous, so Faust queues its changelog record in
a :class:`~faust.transport.producer.ProducerBuffer` that a background task hands to the
producer. ``Producer.flush()`` drains that buffer with ``flush_atmost(None)``, and in
faust-streaming 0.15.3 that returns as soon as no record moved for 0.1 s, and counts neither a
record the task has taken but not yet handed over. Every commit flushes before it commits
(``transactions.py``: a unit's changelog writes must be in the transaction that holds its
outputs and its input offset). On a loaded worker the flush returned with a session's state
write still queued: the transaction committed the turn's next state and offset without it,
the write went into the next transaction, and a kill before that one committed lost the
session's state (a soak with slowed table writes lost 339 of 500 turns as whole sessions:
next states derived, offsets committed, no reward ever, nothing dead-lettered).

Here ``flush`` returns only once every record put before it has been handed to the aiokafka
producer (it then belongs to the open transaction; aiokafka's own flush waits for delivery),
in the order they were put (a key's changelog records stay in order).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.transport.producer import ProducerBuffer

log = logging.getLogger(__name__)

STALL_WARN_S = 10.0  # a flush waiting this long with no record handed over says so


class DrainedBuffer(ProducerBuffer):
    """See the module docstring."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.in_flight = 0  # taken off the queue by the sending task, not yet handed over
        self._moved = asyncio.Event()

    async def _send_pending(self, fut: Any) -> None:
        # The sending task calls this right after taking ``fut`` off the queue, with no await
        # in between: a record is always either queued or counted here.
        self.in_flight += 1
        try:
            await super()._send_pending(fut)
        finally:
            self.in_flight -= 1
            self._moved.set()

    async def flush(self) -> None:
        """Return once every record put before the call is handed to the producer."""
        waited = 0.0
        while self.size or self.in_flight:
            if self.state != "running":
                raise RuntimeError(
                    f"cannot flush {self.size + self.in_flight} table write(s): the producer's "
                    "buffer is not running"
                )
            self._moved.clear()
            try:
                await asyncio.wait_for(self._moved.wait(), timeout=STALL_WARN_S)
                waited = 0.0
            except TimeoutError:
                waited += STALL_WARN_S
                log.warning(
                    "%d table write(s) not handed to the producer after %.0f s: the "
                    "commit waits for them",
                    self.size + self.in_flight,
                    waited,
                )


class Producer(faust_aiokafka.Producer):
    """Faust's aiokafka producer over a :class:`DrainedBuffer`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.app.conf.producer_threaded:  # pragma: no cover - processors/app.py never sets it
            raise ValueError("liverl's workers need producer_threaded=False")
        self.buffer = DrainedBuffer(loop=self.loop, beacon=self.beacon)
        self.buffer.app = self.app
