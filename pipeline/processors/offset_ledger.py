"""Which input offset a worker may commit: never past a record no unit handled.

Faust computes the committable offset from its acked offsets plus *gaps* it infers from the
offsets it reads (transaction markers, aborted or compacted records have offsets no reader is
handed). After a re-seek a batch fetched before it may still be handed out, and Faust takes
the distance from the seek position to that stale record for a gap: in faust-streaming 0.15.3
the records in between — some of them handed to a stream whose queue recovery then cleared —
were counted as acknowledged and committed unprocessed (issue 37: 6 to 37 turns of 500 lost to
restarts, silently). This ledger replaces that arithmetic.

Per input partition, since the last seek (an *epoch*):

- ``start``: the position reading restarted at (the committed offset, after a seek);
- the records handed out in this epoch, in offset order; a record is handed once, and a record
  at an offset below the last handed one (a stale batch, a re-fetch) is refused, so offsets
  between two handed records of one epoch were never records a ``read_committed`` reader is
  given (markers, aborted or compacted): aiokafka's fetch position only moves forward within
  an epoch;
- ``pending``: the handed records no unit has acknowledged yet.

The committable offset is the first pending record's, else the offset after the last handed
record: contiguous from ``start`` through records a unit acknowledged and offsets that hold no
record. A seek starts a new epoch: what was pending is handed again from the new position, and
an acknowledgement of a message handed before it counts for nothing (it is the message object
of *this* epoch that must be acknowledged).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass
class _Partition:
    start: int | None = None  # position of the last seek; None: not known (no committed offset)
    mark: int = 0  # the ledger's epoch when this partition was last seeked
    end: int | None = None  # offset after the last record handed in this epoch
    pending: dict[int, tuple[object, float]] = field(default_factory=dict)  # offset -> (msg, at)
    last_acked: int = -1  # the highest offset a unit acknowledged in this epoch

    def committable(self) -> int | None:
        if self.pending:
            return next(iter(self.pending))
        return self.end if self.end is not None else self.start


@dataclass(frozen=True)
class Stalled(Generic[K]):
    """A handed record that no unit acknowledged while later ones were."""

    tp: K
    offset: int
    waited_s: float


class OffsetLedger(Generic[K]):
    """The ledger of one consumer: see the module docstring. ``K`` is the partition key
    (Faust's ``TP``)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._parts: dict[K, _Partition] = {}
        self._clock = clock
        self.epoch = 0  # bumped by every seek: a batch remembers the epoch it was fetched in
        self.stale_dropped = 0  # handed out of order (a stale batch, a re-fetch): not handed
        self.redelivered = 0  # stalled records handed again (see :meth:`stalled`)
        self.dropped_refetched = 0  # fetched, dropped by Faust unhanded, fetched again

    def seek(self, tp: K, position: int | None) -> None:
        """Reading of ``tp`` restarts at ``position``: pending records will be handed again."""
        self.epoch += 1
        self._parts[tp] = _Partition(start=position, mark=self.epoch)

    def seeked_since(self, tp: K, epoch: int) -> bool:
        """Whether ``tp`` was seeked after the ledger's epoch was ``epoch``: a record of it
        fetched before then is stale."""
        part = self._parts.get(tp)
        return part is not None and part.mark > epoch

    def hand(self, tp: K, offset: int, message: object) -> bool:
        """Record ``message`` at ``offset`` as handed to the units; False: refuse it (stale)."""
        part = self._parts.get(tp)
        if part is None:
            part = self._parts[tp] = _Partition()
        floor = part.end if part.end is not None else part.start
        if floor is not None and offset < floor:
            self.stale_dropped += 1
            return False
        part.pending[offset] = (message, self._clock())
        part.end = offset + 1
        return True

    def ack(self, tp: K, offset: int, message: object) -> None:
        """A unit finished ``message``; only the message handed in this epoch counts."""
        part = self._parts.get(tp)
        if part is None:
            return
        held = part.pending.get(offset)
        if held is None or held[0] is not message:
            return
        del part.pending[offset]
        part.last_acked = max(part.last_acked, offset)

    def committable(self, tp: K) -> int | None:
        """The offset to commit for ``tp`` (next to read), or None when nothing is known."""
        part = self._parts.get(tp)
        return part.committable() if part is not None else None

    def committed(self, tp: K, offset: int) -> None:
        """``offset`` was committed: it is where a restart reads from."""
        part = self._parts.get(tp)
        if part is not None and (part.start is None or offset > part.start):
            part.start = offset

    def forget(self, tp: K) -> None:
        """``tp`` was revoked (after its hand-over commit)."""
        self._parts.pop(tp, None)

    def waiting(self, tp: K) -> bool:
        """Whether ``tp`` has handed records no unit acknowledged yet."""
        part = self._parts.get(tp)
        return part is not None and bool(part.pending)

    def partitions(self) -> Iterator[K]:
        return iter(list(self._parts))

    def pending(self) -> int:
        return sum(len(p.pending) for p in self._parts.values())

    def stalled(self, after_s: float) -> list[Stalled[K]]:
        """Partitions whose first pending record has waited over ``after_s`` while a later
        record was acknowledged (a unit skipped it: Faust dropped it from a queue, say, and
        waiting longer will not help), or over twice ``after_s`` whatever else happened (the
        last records of a partition that then went quiet have no later record to be passed
        by: dropped, they would wait for the next restart). The caller hands it again (a seek
        to it); a record a slow unit still holds is then read twice, and the second reading
        finds the turn applied already."""
        now, out = self._clock(), []
        for tp, part in self._parts.items():
            if not part.pending:
                continue
            offset, (_, at) = next(iter(part.pending.items()))
            waited = now - at
            if (offset < part.last_acked and waited > after_s) or waited > 2 * after_s:
                out.append(Stalled(tp, offset, waited))
        return out
