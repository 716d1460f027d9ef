"""Append-only, fsynced local log of records on their way to Kafka (a write-ahead spool).

Every record is written here before it is produced, so a broker outage or a gateway crash
loses nothing; records leave in the order they were written, and the acknowledged position is
persisted (atomic rename) only after Kafka confirmed them. Frames are ``>II`` (length, crc32)
followed by the payload; a torn tail from a crash is cut off at start-up. Segment files are
named by the sequence number of their first record and deleted once fully acknowledged.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import orjson

from pipeline.durable import fsync_path

_FRAME = struct.Struct(">II")
_POS_FILE = "acked.json"


@dataclass(frozen=True, slots=True)
class Cursor:
    seq: int
    segment: int  # first seq of the segment file
    offset: int  # byte offset inside it


class Spool:
    def __init__(self, directory: Path, segment_bytes: int = 64 * 1024 * 1024) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._acked = self._load_cursor()
        segments = self._segments()
        if not segments:
            segments = [self._acked.segment]
            self._path(self._acked.segment).touch()
        last = segments[-1]
        count, valid_end = _scan(self._path(last))
        with open(self._path(last), "r+b") as fh:  # drop a torn tail left by a crash
            fh.truncate(valid_end)
        self._next_seq = last + count
        self._tail_first = last
        self._tail = open(self._path(last), "ab")  # noqa: SIM115 - kept open for appends

    # ---- writing ------------------------------------------------------------------------

    def append(self, payloads: list[bytes]) -> None:
        """Durably append records (one fsync for the whole batch)."""
        if not payloads:
            return
        with self._lock:
            buf = bytearray()
            for p in payloads:
                buf += _FRAME.pack(len(p), zlib.crc32(p))
                buf += p
            self._tail.write(buf)
            self._tail.flush()
            os.fsync(self._tail.fileno())
            self._next_seq += len(payloads)
            if self._tail.tell() >= self.segment_bytes:
                self._tail.close()
                self._tail_first = self._next_seq
                self._tail = open(self._path(self._next_seq), "ab")  # noqa: SIM115
                fsync_path(self.dir)

    # ---- reading ------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Records written but not yet acknowledged by Kafka."""
        return self._next_seq - self._acked.seq

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.glob("*.log"))

    def peek(self, max_records: int) -> tuple[list[bytes], Cursor]:
        """Up to ``max_records`` unacknowledged records, oldest first, and the cursor after them."""
        with self._lock:
            end_seq = self._next_seq
            tail_first = self._tail_first
        out: list[bytes] = []
        cur = self._acked
        while len(out) < max_records and cur.seq < end_seq:
            with open(self._path(cur.segment), "rb") as fh:
                fh.seek(cur.offset)
                while len(out) < max_records and cur.seq < end_seq:
                    head = fh.read(_FRAME.size)
                    if len(head) < _FRAME.size:
                        break
                    length, crc = _FRAME.unpack(head)
                    payload = fh.read(length)
                    if len(payload) < length or zlib.crc32(payload) != crc:
                        raise OSError(f"corrupt spool frame in {self._path(cur.segment)}")
                    out.append(payload)
                    cur = Cursor(cur.seq + 1, cur.segment, cur.offset + _FRAME.size + length)
            if len(out) < max_records and cur.seq < end_seq and cur.segment != tail_first:
                cur = Cursor(cur.seq, self._next_segment(cur.segment), 0)
        return out, cur

    def ack(self, cursor: Cursor) -> None:
        """Persist that everything before ``cursor`` reached Kafka; drop finished segments."""
        tmp = self.dir / (_POS_FILE + ".tmp")
        tmp.write_bytes(
            orjson.dumps({"seq": cursor.seq, "segment": cursor.segment, "offset": cursor.offset})
        )
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.dir / _POS_FILE)
        self._acked = cursor
        for first in self._segments():
            if first < cursor.segment:
                self._path(first).unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._tail.close()

    # ---- helpers ------------------------------------------------------------------------

    def _path(self, first_seq: int) -> Path:
        return self.dir / f"{first_seq:020d}.log"

    def _segments(self) -> list[int]:
        return sorted(int(p.stem) for p in self.dir.glob("*.log"))

    def _next_segment(self, first: int) -> int:
        later = [s for s in self._segments() if s > first]
        if not later:
            raise OSError(f"spool segment after {first} is missing")
        return later[0]

    def _load_cursor(self) -> Cursor:
        try:
            raw = orjson.loads((self.dir / _POS_FILE).read_bytes())
            return Cursor(int(raw["seq"]), int(raw["segment"]), int(raw["offset"]))
        except FileNotFoundError:
            segments = self._segments()
            return Cursor(segments[0] if segments else 0, segments[0] if segments else 0, 0)


def _scan(path: Path) -> tuple[int, int]:
    """Number of whole valid frames in a segment and where they end."""
    count = end = 0
    with open(path, "rb") as fh:
        while True:
            head = fh.read(_FRAME.size)
            if len(head) < _FRAME.size:
                break
            length, crc = _FRAME.unpack(head)
            payload = fh.read(length)
            if len(payload) < length or zlib.crc32(payload) != crc:
                break
            count += 1
            end += _FRAME.size + length
    return count, end


