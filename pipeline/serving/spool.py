"""Append-only, fsynced local log of records on their way to Kafka (a write-ahead spool).

Every record is written here before it is produced, so a broker outage or a gateway crash
loses nothing; records leave in the order they were written, and the acknowledged position is
persisted (atomic rename) only after Kafka confirmed them. Frames are ``>II`` (length, crc32)
followed by the payload; a torn tail from a crash is cut off at start-up. Segment files are
named by the sequence number of their first record and deleted once fully acknowledged.

A failed append (disk full, I/O error, read-only remount) is rolled back: the bytes written
are truncated away so the file and the sequence count stay in step, and the caller learns of
the failure. A failed acknowledgement keeps the position in memory (the records are not sent
again by this process; after a crash they may be, and consumers deduplicate by event id).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import orjson

from pipeline.durable import fsync_path

log = logging.getLogger(__name__)
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
        self._tail = self._open_tail(last)
        self.ack_error: str | None = None  # last failure to persist the position
        self.broken: str | None = None  # a failed append could not be rolled back

    # ---- writing ------------------------------------------------------------------------

    def append(self, payloads: list[bytes]) -> None:
        """Durably append records (one fsync for the whole batch); all or nothing."""
        if not payloads:
            return
        buf = bytearray()
        for p in payloads:
            buf += _FRAME.pack(len(p), zlib.crc32(p))
            buf += p
        with self._lock:
            if self.broken:
                raise OSError(self.broken)
            start = os.fstat(self._tail).st_size
            try:
                view = memoryview(buf)
                while view:
                    view = view[os.write(self._tail, view) :]
                os.fsync(self._tail)
            except OSError:
                self._rollback(start)
                raise
            self._next_seq += len(payloads)
            if start + len(buf) >= self.segment_bytes:
                self._rotate()

    def check(self) -> None:
        """Raise OSError if a record could not be written now (probe file in the spool dir)."""
        if self.broken:
            raise OSError(self.broken)
        probe = self.dir / ".probe"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"probe")
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()

    def _rollback(self, size: int) -> None:
        """Cut a failed append off the tail so no partial frame or uncounted record stays;
        if even that fails, refuse further appends (a restart cuts the torn tail)."""
        try:
            os.ftruncate(self._tail, size)
        except OSError as exc:
            self.broken = f"spool segment {self._path(self._tail_first)} is torn: {exc}"
            log.error("%s", self.broken)

    def _rotate(self) -> None:
        try:
            fd = self._open_tail(self._next_seq)
        except OSError:
            log.exception("spool segment rotation failed; appending to the current one")
            return
        os.close(self._tail)
        self._tail_first, self._tail = self._next_seq, fd
        with contextlib.suppress(OSError):
            fsync_path(self.dir)

    def _open_tail(self, first_seq: int) -> int:
        return os.open(self._path(first_seq), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

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
        """Everything before ``cursor`` reached Kafka: persist that, drop finished segments.

        The position advances in memory even if persisting it fails (``ack_error`` says so):
        re-sending already delivered records forever would be worse than a duplicate after a
        crash."""
        self._acked = cursor
        try:
            self._persist(cursor)
            self.ack_error = None
        except OSError as exc:
            self.ack_error = f"cannot persist the spool position in {self.dir}: {exc}"
            log.error("%s", self.ack_error)
            return
        for first in self._segments():
            if first < cursor.segment:
                with contextlib.suppress(OSError):
                    self._path(first).unlink(missing_ok=True)

    def _persist(self, cursor: Cursor) -> None:
        tmp = self.dir / (_POS_FILE + ".tmp")
        tmp.write_bytes(
            orjson.dumps({"seq": cursor.seq, "segment": cursor.segment, "offset": cursor.offset})
        )
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.dir / _POS_FILE)

    def close(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            os.close(self._tail)

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


