"""Faust's aiokafka consumer with the commit point taken from an :class:`OffsetLedger`.

Faust's own arithmetic (acked offsets plus inferred gaps) commits past records no unit
processed when a batch fetched before a re-seek is handed out after it (the reason, and the
rule that replaces it: ``offset_ledger.py``). Here:

- ``getmany`` hands every input record through the ledger; a record of a partition seeked
  since its batch was fetched is stale: it is not handed, and the partition is positioned again
  at the ledger's committable offset, so what the batch held is fetched again (nothing is left
  between the ledger's last record and the next fetched one). Faust's read offset is set to each
  handed record, so its own gap fill never runs and it never drops a record as already read;
- every seek (Faust's re-seek to the committed offsets at the end of recovery, a seek of one
  partition) starts the partition's epoch in the ledger; a partition that re-seek leaves where
  it is (never committed) is seeked to its first unacknowledged record;
- an ack counts in the ledger only for the message object handed in the current epoch;
- the offsets Faust commits are the ledger's (``_new_offset``), for every partition it tracks;
- a record handed and never acknowledged while later ones were (a queue cleared under it, say)
  is handed again after ``redeliver_after_s``, and one never acknowledged after twice that
  whatever followed (a partition's last records, then quiet), with a warning and a metric:
  never silence, never a wait for the next restart;
- a record fetched and never handed is fetched again: Faust's ``getmany`` stops handing a batch
  when the flow stops or the generation changes (a rebalance starting) and drops the rest,
  while the fetch position has already moved past it. A re-seek usually follows, but not
  always (Faust resumes the flow before the re-seek when no table needs recovery, and skips
  the re-seek when another rebalance has begun): the next batch's records would then be handed
  after a hole the ledger takes for offsets without records, and committed past. Each
  partition with such records is positioned again at its committable offset at once.

Changelog partitions (acks disabled: table recovery) pass through as Faust reads them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator, Mapping
from typing import Any, cast

from faust import Service
from faust.transport.drivers import TRANSPORTS
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from . import producer_buffer
from .offset_ledger import OffsetLedger

log = logging.getLogger(__name__)

SCHEME = "liverl-kafka"  # at least once through the ledger (processors/app.py)
REDELIVER_AFTER_S = 30.0  # default for ``app.liverl_redeliver_after_s``


def _offset(record: Any) -> int:
    return int(record.offset)


class LedgerConsumer(faust_aiokafka.Consumer):
    """See the module docstring."""

    ledger: OffsetLedger[TP]
    _fetched: Any = None  # the last fetch's records, by partition (``_wait_next_records``)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ledger = OffsetLedger()
        # Changelog partition -> the last offset handed to table recovery since its last seek
        # (transactions.Consumer._recover_past_markers: recovered only once that is applied).
        self.changelog_handed: dict[TP, int] = {}

    def _tracked(self, topic: str) -> bool:
        return bool(self.app.topics.acks_enabled_for(topic))

    async def _wait_next_records(self, timeout: float) -> tuple[Any, Any]:
        records, active = await super()._wait_next_records(timeout)
        self._fetched = records  # what getmany may drop unhanded (see the module docstring)
        return records, active

    async def getmany(self, timeout: float) -> AsyncIterator[tuple[TP, Any]]:
        ledger = self.ledger
        fetched_at = ledger.epoch  # before the fetch: a seek after it makes its records stale
        read_offset = self._read_offset
        self._fetched = None
        batch = cast(AsyncGenerator[tuple[TP, Any], None], super().getmany(timeout))
        repositioned: set[TP] = set()
        reached: dict[TP, int] = {}  # tracked partition -> the last offset Faust handed on
        try:
            async for tp, message in batch:
                if not self._tracked(tp.topic):
                    self.changelog_handed[tp] = message.offset
                    yield tp, message
                    continue
                reached[tp] = message.offset
                if ledger.seeked_since(tp, fetched_at):
                    # Stale, or fetched after a seek that ran while this batch was under
                    # way: either way it is fetched again from the committable offset.
                    ledger.stale_dropped += 1
                    if tp not in repositioned:
                        repositioned.add(tp)
                        self._reposition(tp)
                    continue
                if not ledger.hand(tp, message.offset, message):
                    continue  # handed already in this epoch (a refetch)
                read_offset[tp] = message.offset
                yield tp, message
        finally:
            await batch.aclose()
            self._refetch_dropped(reached, repositioned, fetched_at)

    def _refetch_dropped(self, reached: Mapping[TP, int], repositioned: set[TP],
                         fetched_at: int) -> None:  # fmt: skip
        """Position again every tracked partition of the last fetch whose records Faust did
        not all hand on (see the module docstring)."""
        fetched, self._fetched = self._fetched, None
        if not fetched:
            return
        assigned = self.assignment()
        for tp, records in fetched.items():
            if not records or tp in repositioned or not self._tracked(tp.topic):
                continue
            last = _offset(records[-1])
            done = reached.get(tp, -1)
            if done >= last or tp not in assigned or self.ledger.seeked_since(tp, fetched_at):
                continue  # all handed on, no longer ours, or seeked (fetched again) already
            dropped = [_offset(r) for r in records if _offset(r) > done]
            committable = self.ledger.committable(tp)
            position = dropped[0] if committable is None else min(committable, dropped[0])
            self.ledger.dropped_refetched += len(dropped)
            log.info("%s: %d fetched records from offset %d were not handed on (the flow "
                     "stopped or a rebalance began): fetching again from %d", tp,
                     len(dropped), dropped[0], position)  # fmt: skip
            self._seek_now(tp, position)

    def _reposition(self, tp: TP) -> None:
        """Fetch ``tp`` again from the ledger's committable offset (stale records dropped)."""
        position = self.ledger.committable(tp)
        if position is None:  # pragma: no cover - a seeked partition always has one
            return
        self._seek_now(tp, position)

    def _seek_now(self, tp: TP, offset: int) -> None:
        self._thread.seek(tp, offset)
        self._read_offset[tp] = offset if offset else None
        self.ledger.seek(tp, offset)

    async def seek(self, partition: TP, offset: int) -> None:
        self._seek_now(partition, offset)

    async def seek_to_committed(self) -> Mapping[TP, int]:
        committed = await super().seek_to_committed()
        for tp, offset in committed.items():
            if not self._tracked(tp.topic):
                continue
            if offset is not None and offset > 0:
                self.ledger.seek(tp, offset)
            elif self.ledger.waiting(tp):
                # aiokafka moves only partitions with a committed offset above 0; this one
                # reads on from where it is, past records handed and then cleared from the
                # queues with the flow. Read it again from its first unacknowledged record,
                # as the seek to a committed offset does for the others.
                self._reposition(tp)
        return committed

    async def seek_wait(self, partitions: Mapping[TP, int | None]) -> None:
        # Faust's table recovery seeks standby changelog partitions a rebalance added while
        # the actives were recovering before their start offsets were built: their offset is
        # still None, aiokafka refuses it, and the worker crashed. Faust reads a partition
        # without a known start (-1) from 0: so do these.
        unknown = [tp for tp, offset in partitions.items()
                   if not isinstance(offset, int) or offset < 0]  # fmt: skip
        if unknown:
            log.info(
                "seeking %s from the beginning: no start offset known",
                ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(unknown)),
            )
        known: dict[TP, int] = {tp: 0 if tp in unknown else cast(int, offset)
                                for tp, offset in partitions.items()}  # fmt: skip
        await super().seek_wait(known)
        for tp, offset in known.items():
            self.changelog_handed.pop(tp, None)
            if self._tracked(tp.topic):
                self.ledger.seek(tp, offset)

    def ack(self, message: Any) -> bool:
        done = bool(super().ack(message))
        tp = message.tp
        self.ledger.ack(tp, message.offset, message)
        # Faust's acked lists are not what commits read here: keep them from growing.
        self._acked.pop(tp, None)
        self._acked_index.pop(tp, None)
        return done

    def _filter_tps_with_pending_acks(self, topics: Any = None) -> Iterator[TP]:
        return (tp for tp in self.ledger.partitions()
                if topics is None or tp in topics or tp.topic in topics)  # fmt: skip

    def _new_offset(self, tp: TP) -> int | None:
        return self.ledger.committable(tp)

    async def on_partitions_revoked(self, revoked: set[TP]) -> None:
        # Faust's revoke runs the app's handler (the hand-over commit, which still reads the
        # ledger's offsets of these partitions) before the ledger forgets them.
        await super().on_partitions_revoked(revoked)
        for tp in revoked:
            self.ledger.forget(tp)

    def committed_now(self, offsets: Mapping[TP, int]) -> None:
        for tp, offset in offsets.items():
            self.ledger.committed(tp, offset)

    async def _commit(self, offsets: Mapping[TP, int]) -> bool:
        done = bool(await super()._commit(offsets))
        if done:
            self.committed_now(offsets)
        return done

    @Service.task
    async def _redeliver_stalled(self) -> None:
        after_s = float(getattr(self.app, "liverl_redeliver_after_s", REDELIVER_AFTER_S))
        while not self.should_stop:
            await self.sleep(min(5.0, after_s / 2))
            for stalled in self.ledger.stalled(after_s):
                log.warning(
                    "%s offset %d was handed %.0f s ago and no unit acknowledged it (while "
                    "later records were, or for twice processors.redeliver_after_s): handing "
                    "it again (liverl_workers_records_redelivered)",
                    stalled.tp,
                    stalled.offset,
                    stalled.waited_s,
                )
                self.ledger.redelivered += 1
                self._seek_now(stalled.tp, stalled.offset)


def watched(app: Any) -> Iterable[tuple[str, str, Any]]:
    """Gauges over the app's ledger (``runtime.WorkerMetrics``): name, help, reader."""

    def read(attr: str) -> Any:
        def value() -> float:
            ledger = getattr(getattr(app, "_consumer", None), "ledger", None)
            if ledger is None:
                return 0.0
            got = getattr(ledger, attr)
            return float(got() if callable(got) else got)

        return value

    return (
        (
            "liverl_workers_records_pending",
            "Input records handed to units, not acknowledged",
            read("pending"),
        ),
        (
            "liverl_workers_records_stale_dropped",
            "Records of a batch fetched before a seek, not handed (fetched again)",
            read("stale_dropped"),
        ),
        (
            "liverl_workers_records_redelivered",
            "Records no unit acknowledged while later ones were, handed again",
            read("redelivered"),
        ),
        (
            "liverl_workers_records_dropped_refetched",
            "Records fetched and not handed on (a rebalance began mid-batch), fetched again",
            read("dropped_refetched"),
        ),
    )


class Transport(faust_aiokafka.Transport):
    Consumer = LedgerConsumer
    Producer = producer_buffer.Producer


TRANSPORTS.aliases.setdefault(SCHEME, f"{__name__}:Transport")
