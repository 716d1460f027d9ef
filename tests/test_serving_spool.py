"""The local spool: durable order, acknowledgement, torn tails, segment rotation."""

from __future__ import annotations

from pathlib import Path

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
