"""Exactly-once processing: one Kafka transaction per worker holds a unit's outputs, its state
(changelog) writes and its input offset, so they are committed together or not at all.

Faust's own ``processing_guarantee="exactly_once"`` picks a transactional producer by the
*output* record's partition, which breaks for any output that is not co-partitioned with its
input (rewards, samples and dead letters are only written, never read, by this app; the group
topic is keyed by group id): sends fail outside a transaction or fence another worker's
producer (faust-streaming issues 177, 323, 440, 517). Here instead, as in Kafka Streams:

- every worker process has **one** transactional producer, ``transactional.id =
  <app id>-eos-<host>-<worker index>`` (:func:`transactional_id`); the supervisor gives each
  child its index, so a restarted child fences its killed predecessor and the broker aborts
  what that one left open;
- a **unit** of work (one input record of an agent, one timer run) holds a shared lock from
  its first read to its ack; a **commit** takes the lock exclusively, so it always falls
  between units: flush the producer's buffer (changelog writes), add the acked offsets
  (``send_offsets_to_transaction``), commit, begin the next transaction. A unit's outputs and
  its offset are therefore in the same transaction. Commits run every
  ``broker_commit_interval`` (``[processors] commit_interval_s``), also without new offsets,
  when only timers wrote, and as soon as no unit has run for ``commit_idle_s`` (a quiet
  worker's records are visible at once);
- a unit that raises or is cancelled is not acked (``runtime.Runtime.units``), and its
  partial outputs are in the open transaction: that transaction is never committed. The
  next commit raises :class:`UnitFailed`, which stops the worker; the broker aborts what it
  wrote and its restart reads the records from the last commit again;
- the offsets committed are those of the consumer's ledger (``offset_ledger.py``): contiguous
  from the last commit through records a unit acknowledged and offsets that hold no record,
  never past a record no unit handled, whatever Faust's own gap arithmetic says;
- the worker's consumer reads ``read_committed`` (its inputs, and the changelogs it recovers
  state from: an aborted state write is never restored).

Derived records become visible to ``read_committed`` consumers when their transaction
commits: at most one commit interval later.

Commit ordering, per commit (the exclusive section)::

    wait until no unit runs  -> no output or state write is half done
    producer.flush()         -> changelog writes buffered by Faust are in the transaction
                                (all of them: producer_buffer.py)
    send_offsets_to_transaction(acked offsets, group id)
    commit_transaction()     -> outputs + state + offsets, atomically
    begin_transaction()      -> the next units write into the next one
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import socket
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

from faust import Service
from faust.exceptions import ProducerSendError
from faust.transport.drivers import TRANSPORTS
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from . import producer_buffer
from .ledger_consumer import LedgerConsumer

log = logging.getLogger(__name__)

SCHEME = "liverl-eos"  # broker URL scheme selecting this transport (processors/app.py)

_IN_UNIT: contextvars.ContextVar[bool] = contextvars.ContextVar("liverl_in_unit", default=False)


class UnitLock:
    """Shared for units, exclusive for commits; a waiting commit holds new units back, so a
    busy stream cannot starve it. Re-entrant for units (a timer that calls a send)."""

    def __init__(self) -> None:
        self._units = 0
        self._committing = False
        self._cond = asyncio.Condition()
        self.last_end = 0.0  # monotonic time the last unit ended
        self.failed: str | None = None  # the first unit that raised or was cancelled

    def idle_for(self) -> float:
        """Seconds since the last unit ended; 0 while one runs or a commit does."""
        if self._units or self._committing:
            return 0.0
        return time.monotonic() - self.last_end

    @contextlib.asynccontextmanager
    async def unit(self) -> AsyncIterator[None]:
        if _IN_UNIT.get():
            yield
            return
        async with self._cond:
            await self._cond.wait_for(lambda: not self._committing)
            self._units += 1
        token = _IN_UNIT.set(True)
        try:
            yield
        except BaseException as exc:
            # Its outputs and state writes so far are in the open transaction, its input is
            # not acked: committing would keep half a unit. Nothing is committed any more.
            if self.failed is None:
                self.failed = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise
        finally:
            _IN_UNIT.reset(token)
            async with self._cond:
                self._units -= 1
                self.last_end = time.monotonic()
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._committing)
            self._committing = True
            await self._cond.wait_for(lambda: self._units == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._committing = False
                self._cond.notify_all()


class UnitFailed(RuntimeError):
    """A unit raised or was cancelled: the open transaction holds half of it."""


class Transaction:
    """The worker's transaction: its id, the lock units and commits share, and whether
    anything was written since the last commit."""

    def __init__(self, transactional_id: str, group_id: str, timeout_s: float,
                 idle_commit_s: float = 0.0) -> None:  # fmt: skip
        self.transactional_id = transactional_id
        self.idle_commit_s = idle_commit_s
        self.group_id = group_id
        self.timeout_ms = int(timeout_s * 1000)
        self.lock = UnitLock()
        self.producer: Any = None  # the aiokafka producer, set when the worker's starts
        self.dirty = False
        self.commits = 0

    def unit(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.lock.unit()

    async def commit(self, offsets: Mapping[TP, int]) -> None:
        """Inside the exclusive section: offsets (next to read) + everything sent, at once."""
        from aiokafka.errors import ProducerFenced
        from aiokafka.structs import OffsetAndMetadata
        from aiokafka.structs import TopicPartition as AioTP

        producer = self.producer
        if producer is None:
            raise RuntimeError("the worker's transactional producer has not started")
        if self.lock.failed is not None:
            raise UnitFailed(
                f"a unit of work failed ({self.lock.failed}): what this worker wrote since "
                "its last commit is left uncommitted (the broker aborts it, or the restart "
                "fences it) and the worker stops; its restart reads those records again"
            )
        try:
            if offsets:
                await producer.send_offsets_to_transaction(
                    {
                        AioTP(tp.topic, tp.partition): OffsetAndMetadata(o, "")
                        for tp, o in offsets.items()
                    },
                    self.group_id,
                )
            await producer.commit_transaction()
        except ProducerFenced:
            # Its uncommitted work is aborted by the broker; a restart reads it again.
            log.error(
                "the broker fenced transactional id %s at commit: the transaction stayed open "
                "longer than [processors] transaction_timeout_s (%g s), or another worker "
                "started with this id (give each worker of app %s on one machine its own "
                "--worker-index; liverl workers --processes N numbers its children)",
                self.transactional_id,
                self.timeout_ms / 1000,
                self.group_id,
            )
            raise
        await producer.begin_transaction()
        self.dirty = False
        self.commits += 1


def transactional_id(app_id: str, worker_index: int) -> str:
    """``<app id>-eos-<host>-<worker index>``: stable for a worker restarted on its machine
    (it fences its killed predecessor at once), distinct across machines and across the
    children of ``liverl workers --processes N`` (numbered by the supervisor)."""
    host = "".join(c if c.isalnum() or c in "._-" else "_" for c in socket.gethostname())
    return f"{app_id}-eos-{host[:64] or 'host'}-{worker_index}"


def transaction_of(app: Any) -> Transaction:
    txn = getattr(app, "liverl_transaction", None)
    if not isinstance(txn, Transaction):
        raise RuntimeError(f"{SCHEME}:// needs app.liverl_transaction (processors/app.py)")
    return txn


def is_fenced(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it wraps) says the broker fenced the transactional producer."""
    from aiokafka.errors import ProducerFenced

    while exc is not None:
        if isinstance(exc, ProducerFenced):
            return True
        exc = exc.__cause__
    return False


class Producer(producer_buffer.Producer):
    """Faust's producer over one transactional aiokafka producer, open from start to stop
    (its flush waits for every table write: ``producer_buffer.py``)."""

    _fenced = False

    def _settings_extra(self) -> Mapping[str, Any]:
        return {
            "acks": "all",
            "enable_idempotence": True,
            "transaction_timeout_ms": transaction_of(self.app).timeout_ms,
        }

    def _new_producer(self, transactional_id: str | None = None) -> Any:
        return super()._new_producer(transactional_id or transaction_of(self.app).transactional_id)

    async def on_start(self) -> None:
        await super().on_start()
        txn = transaction_of(self.app)
        txn.producer = self._producer
        await self._producer.begin_transaction()  # type: ignore[union-attr]

    async def on_stop(self) -> None:
        # What the last units wrote since the last commit is left open: the broker aborts it
        # (or the next start fences it); the consumer's final commit has run by now.
        transaction_of(self.app).producer = None
        await super().on_stop()

    async def send(self, *args: Any, **kwargs: Any) -> Any:
        transaction_of(self.app).dirty = True
        try:
            fut = await super().send(*args, **kwargs)
        except ProducerSendError as exc:
            self._on_fenced(exc.__cause__)
            raise
        if isinstance(fut, asyncio.Future):
            fut.add_done_callback(self._delivered)
        return fut

    def _delivered(self, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled():
            self._on_fenced(fut.exception())

    def _on_fenced(self, exc: BaseException | None) -> None:
        """A fenced producer writes nothing any more, but the worker would go on holding its
        partitions and processing records whose outputs can never be committed (a worker
        whose transaction stayed open past its timeout under load did, for minutes): stop it,
        so its partitions move and its restart reads from the last commit."""
        if not is_fenced(exc) or self._fenced:
            return
        self._fenced = True
        txn = transaction_of(self.app)
        log.error(
            "the broker fenced this worker's transaction (%s): it stayed open longer than "
            "[processors] transaction_timeout_s (%g s), or another worker started with "
            "transactional id %s. The worker stops; the broker aborts what it wrote since its "
            "last commit and its restart reads those records again",
            exc,
            txn.timeout_ms / 1000,
            txn.transactional_id,
        )
        asyncio.ensure_future(self.app.crash(cast(BaseException, exc)))


class ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> Any:
        # Faust reads this flag only here to pick isolation.level: read_committed.
        flag = self.consumer.in_transaction
        self.consumer.in_transaction = True
        try:
            return super()._create_worker_consumer(transport)
        finally:
            self.consumer.in_transaction = flag


class Consumer(LedgerConsumer):
    """Faust's consumer whose commit is the transaction's (see the module docstring), at the
    offsets its ledger allows (``ledger_consumer.py``)."""

    _handing_over: frozenset[TP] = frozenset()  # revoked, being committed before they go

    def _new_consumer_thread(self) -> ConsumerThread:
        return ConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def force_commit(self, topics: Any = None, start_new_transaction: bool = True) -> bool:
        txn = transaction_of(self.app)
        async with txn.lock.exclusive():
            did = await super().force_commit(topics, start_new_transaction=start_new_transaction)
            if not did and txn.dirty and txn.producer is not None:
                await self.app.producer.flush()
                await txn.commit({})  # only timers wrote: their outputs must not wait
                did = True
            return bool(did)

    @Service.task
    async def _commit_when_idle(self) -> None:
        """Commit once no unit has run for ``idle_commit_s``: a quiet worker's records are
        visible at once; a busy one commits every ``commit_interval_s`` (Faust's loop)."""
        txn = transaction_of(self.app)
        if txn.idle_commit_s <= 0:
            return
        while not self.should_stop:
            await self.sleep(txn.idle_commit_s / 2)
            if txn.dirty and txn.producer is not None and txn.lock.idle_for() >= txn.idle_commit_s:
                await self.force_commit()

    @Service.task
    async def _recover_past_markers(self) -> None:
        """Table recovery reads a changelog up to its last offset, but read_committed never
        hands over that offset when it is a transaction marker (every commit writes one; a
        killed predecessor's open transaction ends in an abort marker once fenced): recovery
        would wait forever. A partition whose position has passed its last offset, with no
        progress for a whole round (what was fetched has been applied), is recovered. Faust's
        own exactly-once mode does the same (``detect_aborted_tx``). Only once every
        changelog record handed to recovery has been taken by it: a round without progress
        is no proof when records wait in its queue."""
        stalled: dict[TP, int] = {}  # partition -> applied offset seen past the end last round
        while not self.should_stop:
            await self.sleep(1.0)
            recovery = getattr(self.app.tables, "recovery", None)
            if recovery is None or not recovery.in_recovery:
                stalled.clear()
                continue
            offsets, now = recovery.active_offsets, {}
            for tp, last in list(recovery.active_highwaters.items()):
                done = offsets.get(tp)
                if last is None or done is None or done >= last:
                    continue
                if done < self.changelog_handed.get(tp, -1):
                    # Fetched, not yet taken by recovery (a starved loop, a full queue): that
                    # is no stall. Declaring the partition recovered now would drop those
                    # records (recovery skips offsets at or below the one it is told), and
                    # the state they hold, the newest sessions', would be missing.
                    continue
                with contextlib.suppress(Exception):  # a partition just revoked: next round
                    position = await self.position(tp)
                    if position is None or position <= last:
                        continue
                    if stalled.get(tp) == done:
                        offsets[tp] = last
                    else:
                        now[tp] = done
            stalled = now

    async def commit_handed_over(self, revoked: set[TP]) -> None:
        """Commit before revoked partitions go to another worker: their units' outputs,
        state and offsets must be committed (or aborted) before the new owner restores the
        state and reads on from the committed offset, or it would miss state this worker
        wrote and re-read inputs whose outputs are committed. The app calls this from its
        revoke handler, after Faust has drained the agents and flushed the producer."""
        self._handing_over = frozenset(revoked)
        try:
            await self.force_commit()
        finally:
            self._handing_over = frozenset()

    async def _commit(self, offsets: Mapping[TP, int]) -> bool:
        # Offsets of partitions this worker no longer owns would move another owner's
        # committed position back; those being handed over are still this worker's.
        owned = set(self.assignment()) | self._handing_over
        mine = {tp: o for tp, o in offsets.items() if tp in owned}
        try:
            await transaction_of(self.app).commit(mine)
        except UnitFailed as exc:
            log.error("%s", exc)
            await self.crash(exc)  # as Faust's consumer does with a commit it cannot make
            return False
        except Exception as exc:
            if not is_fenced(exc):
                raise
            await self.app.crash(exc)  # stop: the partitions move, the restart reads again
            return False
        self.committed_now(mine)
        return True


def commit_on_revoke(app: Any) -> None:
    """Wire :meth:`Consumer.commit_handed_over` into the app's rebalance (exactly-once)."""

    @app.on_partitions_revoked.connect
    async def _hand_over(sender: Any, revoked: set[TP], **_: Any) -> None:
        consumer = app.consumer
        if isinstance(consumer, Consumer) and revoked:
            await consumer.commit_handed_over(revoked)


class Transport(faust_aiokafka.Transport):
    Consumer = Consumer
    Producer = Producer


TRANSPORTS.aliases.setdefault(SCHEME, f"{__name__}:Transport")
