"""The offset ledger: what a worker may commit (hand-computed cases and a hypothesis search
of the invariant: never past a record no unit acknowledged)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.processors.offset_ledger import OffsetLedger

TP = "in-0"


def test_gaps_between_handed_records_are_committed_through_unacked_ones_are_not() -> None:
    ledger: OffsetLedger[str] = OffsetLedger()
    ledger.seek(TP, 10)
    assert ledger.committable(TP) == 10
    msgs = {o: object() for o in (10, 11, 14, 15)}  # 12, 13: transaction markers
    for offset, msg in msgs.items():
        assert ledger.hand(TP, offset, msg)
    assert ledger.committable(TP) == 10
    ledger.ack(TP, 10, msgs[10])
    ledger.ack(TP, 14, msgs[14])
    assert ledger.committable(TP) == 11  # 11 is handed and not acknowledged
    ledger.ack(TP, 11, msgs[11])
    assert ledger.committable(TP) == 15  # through 12-13 (no records) and 14, up to 15
    ledger.ack(TP, 15, msgs[15])
    assert ledger.committable(TP) == 16
    assert ledger.pending() == 0


def test_a_seek_starts_an_epoch_whose_acks_only_count_for_its_own_messages() -> None:
    ledger: OffsetLedger[str] = OffsetLedger()
    ledger.seek(TP, 280)
    old = {o: object() for o in range(280, 298)}
    for offset, msg in old.items():
        ledger.hand(TP, offset, msg)
    before = ledger.epoch
    ledger.seek(TP, 280)  # the re-seek at the end of recovery
    assert ledger.seeked_since(TP, before - 1) and not ledger.seeked_since(TP, ledger.epoch)
    assert ledger.committable(TP) == 280
    ledger.ack(TP, 297, old[297])  # a message of the old epoch: counts for nothing
    assert ledger.committable(TP) == 280
    new = object()
    assert ledger.hand(TP, 280, new)
    assert not ledger.hand(TP, 280, object())  # handed already in this epoch
    assert not ledger.hand(TP, 279, object())  # below the seek position
    assert ledger.stale_dropped == 2
    ledger.ack(TP, 280, new)
    assert ledger.committable(TP) == 281


def test_a_record_skipped_while_later_ones_are_acknowledged_is_reported_as_stalled() -> None:
    now = [0.0]
    ledger: OffsetLedger[str] = OffsetLedger(clock=lambda: now[0])
    ledger.seek(TP, 0)
    msgs = [object() for _ in range(3)]
    for offset, msg in enumerate(msgs):
        ledger.hand(TP, offset, msg)
    now[0] = 50.0
    assert ledger.stalled(30) == []  # nothing later acknowledged: it may just be queued
    ledger.ack(TP, 2, msgs[2])
    (stalled,) = ledger.stalled(30)
    assert (stalled.tp, stalled.offset, stalled.waited_s) == (TP, 0, 50.0)
    assert ledger.stalled(200) == []
    ledger.ack(TP, 0, msgs[0])
    assert [s.offset for s in ledger.stalled(30)] == [1]  # 2 was acknowledged past it too
    ledger.ack(TP, 1, msgs[1])
    assert ledger.stalled(30) == [] and ledger.committable(TP) == 3
    ledger.forget(TP)
    assert ledger.committable(TP) is None and list(ledger.partitions()) == []


def test_a_partitions_last_records_pending_twice_the_wait_are_stalled_though_none_follows() -> None:
    """Traffic stopped after them: no later record will be acknowledged past them, and a
    dropped one would wait for the next restart."""
    now = [0.0]
    ledger: OffsetLedger[str] = OffsetLedger(clock=lambda: now[0])
    ledger.seek(TP, 10)
    ledger.hand(TP, 10, object())
    ledger.hand(TP, 11, object())
    now[0] = 60.0
    assert ledger.stalled(30) == []  # 60 s is not over twice 30 s
    now[0] = 60.5
    (stalled,) = ledger.stalled(30)
    assert (stalled.offset, stalled.waited_s) == (10, 60.5)
    assert ledger.committable(TP) == 10  # never committed past, meanwhile


def test_a_commit_moves_the_start_forward_only() -> None:
    ledger: OffsetLedger[str] = OffsetLedger()
    ledger.seek(TP, 5)
    ledger.committed(TP, 9)
    ledger.committed(TP, 7)
    assert ledger.committable(TP) == 9


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hand", "ack", "seek"]), st.integers(0, 40)),
                max_size=80))  # fmt: skip
def test_the_committable_offset_never_passes_an_unacknowledged_record(ops: list) -> None:
    """Whatever the order of hands, acks (of any message, of any epoch) and seeks: every
    record handed in the current epoch below the committable offset was acknowledged, and
    the committable offset never moves below the current epoch's start."""
    ledger: OffsetLedger[str] = OffsetLedger()
    start = 0
    ledger.seek(TP, start)
    handed: dict[int, object] = {}  # this epoch
    every: list[tuple[int, object]] = []  # every message ever handed
    acked: set[int] = set()
    for op, n in ops:
        if op == "seek":
            start = n
            ledger.seek(TP, start)
            handed, acked = {}, set()
        elif op == "hand":
            msg = object()
            end = max(handed, default=start - 1) + 1
            offset = end + n % 4  # forward, with gaps of no records
            assert ledger.hand(TP, offset, msg)
            handed[offset] = msg
            every.append((offset, msg))
        elif every:
            offset, msg = every[n % len(every)]
            ledger.ack(TP, offset, msg)
            if handed.get(offset) is msg:
                acked.add(offset)
        commit = ledger.committable(TP)
        assert commit is not None and commit >= start
        assert all(o in acked for o in handed if o < commit), (commit, handed, acked)
        if handed and set(handed) <= acked:
            assert commit == max(handed) + 1
