"""The local spool: durable order, acknowledgement, torn tails, segment rotation."""

from __future__ import annotations

import errno
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
    (tmp_path / "acked.json.tmp").mkdir()  # the position file cannot be written
    spool.ack(cur)
    assert spool.ack_error and spool.pending == 1 and spool.peek(10)[0] == [b"b"]
    (tmp_path / "acked.json.tmp").rmdir()
    spool.ack(spool.peek(10)[1])
    assert spool.ack_error is None and spool.pending == 0


def test_check_reports_an_unwritable_dir(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.check()
    (tmp_path / ".probe").mkdir()  # the probe file cannot be created
    with pytest.raises(OSError):
        spool.check()
