"""The local spool: durable order, acknowledgement, torn tails, segment rotation."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

from pipeline.serving.spool import Spool


def test_order_ack_and_reopen(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.append([b"a", b"b", b"c"])
    got, cur = spool.peek(2)
    assert got == [b"a", b"b"] and spool.pending == 3
    spool.ack(cur)
    spool.append([b"d"])
    spool.close()
    again = Spool(tmp_path)
    assert again.pending == 2
    assert again.peek(10)[0] == [b"c", b"d"]


def reopened_pending(path: Path) -> int:
    """What a gateway restarted after a crash now would find unacknowledged."""
    other = Spool(path)
    try:
        return other.pending
    finally:
        other.close()


def test_ack_without_persist_lags_on_disk_until_persisted(tmp_path: Path) -> None:
    """The drainer's coalesced acks: a crash before the position is persisted re-sends the
    delivered records (consumers deduplicate by event id) and never loses one; persist_ack and
    close write the position, and finished segments go only once it is on disk."""
    spool = Spool(tmp_path, segment_bytes=10)
    spool.append([b"a" * 12])
    spool.append([b"b" * 12])  # a segment per record
    spool.append([b"c" * 12])
    segments = len(list(tmp_path.glob("*.log")))
    _, cur = spool.peek(2)
    spool.ack(cur, persist=False)
    assert spool.pending == 1 and spool.peek(10)[0] == [b"c" * 12]
    assert reopened_pending(tmp_path) == 3
    assert len(list(tmp_path.glob("*.log"))) == segments  # none deleted before it is on disk
    spool.persist_ack()
    assert reopened_pending(tmp_path) == 1
    assert len(list(tmp_path.glob("*.log"))) == segments - 2
    spool.ack(spool.peek(1)[1], persist=False)
    spool.close()
    assert reopened_pending(tmp_path) == 0


def test_torn_tail_is_dropped(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.append([b"whole"])
    spool.close()
    seg = next(tmp_path.glob("*.log"))
    with open(seg, "ab") as fh:
        fh.write(b"\x00\x00\x00\x10abc")  # a crash in the middle of a frame
    again = Spool(tmp_path)
    assert again.peek(10)[0] == [b"whole"]
    again.append([b"next"])
    assert again.peek(10)[0] == [b"whole", b"next"]


def test_segments_rotate_and_are_deleted(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=50)
    records = [f"record-{i:03d}".encode() * 2 for i in range(20)]
    for r in records:
        spool.append([r])
    assert len(list(tmp_path.glob("*.log"))) > 3
    out: list[bytes] = []
    while spool.pending:
        got, cur = spool.peek(3)
        out += got
        spool.ack(cur)
    assert out == records
    assert len(list(tmp_path.glob("*.log"))) <= 2
    spool.close()
    assert Spool(tmp_path, segment_bytes=50).pending == 0


def test_failed_append_is_rolled_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails midway (disk full at fsync) must leave neither a partial frame nor
    an uncounted record behind: that made later records arrive late and counts go wrong."""
    import pipeline.serving.spool as spool_mod

    spool = Spool(tmp_path)
    spool.append([b"a"])
    seg = next(tmp_path.glob("*.log"))
    size = seg.stat().st_size
    real_fsync = spool_mod.os.fsync

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_mod.os, "fsync", full)
    with pytest.raises(OSError):
        spool.append([b"lost-1", b"lost-2"])
    monkeypatch.setattr(spool_mod.os, "fsync", real_fsync)
    assert seg.stat().st_size == size and spool.pending == 1
    spool.append([b"b"])
    assert spool.peek(10)[0] == [b"a", b"b"] and spool.pending == 2
    spool.close()
    assert Spool(tmp_path).peek(10)[0] == [b"a", b"b"]


def test_ack_that_cannot_be_persisted_still_advances(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.append([b"a", b"b"])
    _, cur = spool.peek(1)
    (tmp_path / "acked.json" / "x").mkdir(parents=True)  # the position cannot be replaced
    spool.ack(cur)
    assert spool.ack_error and spool.pending == 1 and spool.peek(10)[0] == [b"b"]
    assert not list(tmp_path.glob(".acked.json.*"))  # the failed write left no temp file
    shutil.rmtree(tmp_path / "acked.json")
    spool.ack(spool.peek(10)[1])
    assert spool.ack_error is None and spool.pending == 0


def test_check_reports_an_unwritable_dir(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.check()
    (tmp_path / ".probe").mkdir()  # the probe file cannot be created
    with pytest.raises(OSError):
        spool.check()


def _denied(*_args: object) -> None:
    raise PermissionError(errno.EPERM, "Operation not permitted")


def test_a_torn_tail_is_repaired_once_the_disk_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25: an append whose rollback failed too (``chattr +i``) left the spool refusing
    every append for good; once the disk takes writes again the torn bytes are cut and the
    spool appends as before, with nothing of the failed batch left in it."""
    import pipeline.serving.spool as spool_mod

    spool = Spool(tmp_path)
    spool.append([b"a"])
    monkeypatch.setattr(spool_mod.os, "fsync", _denied)
    monkeypatch.setattr(spool_mod.os, "ftruncate", _denied)
    with pytest.raises(OSError):
        spool.append([b"torn"])  # written, not synced, and cannot be cut off
    assert spool.broken is not None and "Operation not permitted" in spool.broken
    with pytest.raises(OSError, match="torn"):
        spool.check()
    with pytest.raises(OSError, match="torn"):
        spool.append([b"refused"])
    monkeypatch.undo()  # the disk is back
    spool.check()
    assert spool.broken is None
    spool.append([b"b"])
    assert spool.peek(10)[0] == [b"a", b"b"] and spool.pending == 2
    spool.close()
    assert Spool(tmp_path).peek(10)[0] == [b"a", b"b"]


def test_check_writes_as_many_bytes_as_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk with room for a tiny probe but not for the records must fail the probe."""
    import pipeline.serving.spool as spool_mod

    spool = Spool(tmp_path)
    real_write = spool_mod.os.write

    def nearly_full(fd: int, data: bytes) -> int:
        if len(data) > 100:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(spool_mod.os, "write", nearly_full)
    spool.check()
    with pytest.raises(OSError, match="No space"):
        spool.check(1000)
    assert not (tmp_path / ".probe").exists()


# ---- frames damaged on disk by something outside liverl (issue 11) --------------------------


def _frames(seg: Path) -> list[tuple[int, int]]:
    """(offset, size) of each frame of an undamaged segment."""
    data, out, pos = seg.read_bytes(), [], 0
    while pos < len(data):
        size = 8 + int.from_bytes(data[pos : pos + 4], "big")
        out.append((pos, size))
        pos += size
    return out


def _damage(seg: Path, at: int, new: bytes) -> bytes:
    data = bytearray(seg.read_bytes())
    old = bytes(data[at : at + len(new)])
    data[at : at + len(new)] = new
    seg.write_bytes(bytes(data))
    return old


def test_a_flipped_byte_in_the_middle_frame_is_quarantined(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.append([b"first", b"middle-record", b"last"])
    seg = next(tmp_path.glob("*.log"))
    offset, size = _frames(seg)[1]
    _damage(seg, offset + 12, b"X")  # inside the middle payload: its crc no longer matches
    bad = seg.read_bytes()[offset : offset + size]

    got, cur = spool.peek(10)
    assert got == [b"first", b"last"], "the frames after the damaged one are still delivered"
    [region] = spool.quarantined_now
    assert region.index == 1 and region.offset == offset
    assert region.path.parent == tmp_path / "quarantine"
    assert region.path.read_bytes() == bad, "the damaged frame is kept byte for byte"
    assert spool.quarantined_total == 1
    problem = spool.quarantine_problem()
    assert problem and "1 corrupt spool region" in problem and str(tmp_path) in problem
    spool.ack(cur)
    assert spool.pending == 0
    spool.append([b"after"])
    assert spool.peek(10)[0] == [b"after"] and spool.quarantined_total == 1
    region.path.unlink()  # someone looked at it
    assert spool.quarantine_problem() is None


def test_a_damaged_frame_is_not_taken_for_a_torn_tail_at_start(tmp_path: Path) -> None:
    """The failure: start-up cut the newest segment at the first bad frame, silently dropping
    every whole frame after it."""
    spool = Spool(tmp_path)
    spool.append([b"a" * 20, b"b" * 20, b"c" * 20, b"d" * 20])
    spool.close()
    seg = next(tmp_path.glob("*.log"))
    offset, _ = _frames(seg)[1]
    _damage(seg, offset, b"\x7f\xff")  # the length field: where the frame ends is unknown
    again = Spool(tmp_path)
    assert again.pending == 4  # the damaged region counts as one record
    got, cur = again.peek(10)
    assert got == [b"a" * 20, b"c" * 20, b"d" * 20]
    assert len(again.quarantined_now) == 1
    assert again.quarantined_now[0].path.read_bytes()[:2] == b"\x7f\xff"
    again.ack(cur)
    assert again.pending == 0
    again.close()
    assert Spool(tmp_path).pending == 0


def test_a_zeroed_page_across_segments_is_skipped(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=200)
    records = [f"record-{i:03d}".encode() * 3 for i in range(30)]
    for r in records:
        spool.append([r])
    segs = sorted(tmp_path.glob("*.log"))
    assert len(segs) > 3
    frames = _frames(segs[1])
    start = frames[1][0]
    _damage(segs[1], start, bytes(frames[1][1] + 5))  # a zeroed block, ending mid-frame
    out: list[bytes] = []
    regions = 0
    while spool.pending:
        got, cur = spool.peek(4)
        out += got
        regions += len(spool.quarantined_now)
        spool.ack(cur)
    lost = [r for r in records if r not in out]
    assert len(lost) == 2, "the zeroed frame and the one whose header it ran into"
    assert [r for r in records if r not in lost] == out, "everything else, in order"
    assert regions == 1 and spool.quarantined_total == 1
    kept = next((tmp_path / "quarantine").glob("*.bad")).read_bytes()
    assert kept.startswith(bytes(frames[1][1] + 5)) and kept.endswith(lost[1])


def test_a_segment_cut_short_does_not_hold_up_the_next(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=60)
    records = [f"r{i:02d}".encode() * 8 for i in range(8)]
    for r in records:
        spool.append([r])
    first = sorted(tmp_path.glob("*.log"))[0]
    n_first = len(_frames(first))
    with open(first, "r+b") as fh:  # lose the end of its last frame
        fh.truncate(first.stat().st_size - 3)
    got, cur = spool.peek(100)
    assert got == records[: n_first - 1] + records[n_first:]
    spool.ack(cur)
    assert spool.pending == 0 and spool.quarantined_total == 1


def test_empty_records_are_refused(tmp_path: Path) -> None:
    """A zeroed header reads as an empty frame with a valid crc: none may be written."""
    with pytest.raises(ValueError):
        Spool(tmp_path).append([b"a", b""])
