"""Append-only, fsynced local log of records on their way to Kafka (a write-ahead spool).

Every record is written here before it is produced, so a broker outage or a gateway crash
loses nothing; records leave in the order they were written, and the acknowledged position is
persisted (atomic rename) only after Kafka confirmed them. Frames are ``>II`` (length, crc32)
followed by the payload; a torn tail from a crash is cut off at start-up. Segment files are
named by the sequence number of their first record and deleted once fully acknowledged.

A failed append (disk full, I/O error, read-only remount) is rolled back: the bytes written
are truncated away so the file and the sequence count stay in step, and the caller learns of
the failure. A rollback that fails too leaves the spool ``broken`` (torn tail), but not for
good: the next append or :meth:`Spool.check` cuts the tail again and, once that works (the
disk is back), clears ``broken``. A failed acknowledgement keeps the position in memory (the
records are not sent again by this process; after a crash they may be, and consumers
deduplicate by event id).

A frame damaged on disk by something outside liverl (bad crc, impossible length, empty) cannot
stop delivery: :meth:`Spool.peek` copies the damaged bytes to ``quarantine/<segment>-<offset>.bad``
(fsynced), skips to the next valid frame (the next frame when only the payload is damaged, else
a scan for the next frame whose crc matches) and reports the region in
:attr:`Spool.quarantined_now`, so the caller can dead-letter it and count it. The frames after
it are delivered as usual. A bad region at the very end of the newest segment with no valid
frame after it is a torn tail from a crash and is cut off at start-up, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from pipeline.durable import atomic_write, fsync_path

log = logging.getLogger(__name__)
_FRAME = struct.Struct(">II")
_POS_FILE = "acked.json"
# Held shared by every open Spool; `liverl forget` takes it exclusively (non-blocking) so it
# rewrites segments only when no gateway has them open (pipeline/forget.py).
LOCK_FILE = ".lock"
QUARANTINE_DIR = "quarantine"
# A resync scan checks candidate frames' crcs over at most this many bytes; past it, the rest
# of the segment is quarantined whole (random garbage would otherwise cost minutes).
_RESYNC_CRC_BUDGET = 256 * 1024 * 1024
# Candidate frame starts while resyncing: a length below 32 MiB begins with 0x00 or 0x01.
_HEADER_START = re.compile(rb"[\x00\x01]")


@dataclass(frozen=True, slots=True)
class Cursor:
    seq: int
    segment: int  # first seq of the segment file
    offset: int  # byte offset inside it


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A damaged region of a segment that :meth:`Spool.peek` skipped; its bytes are in ``path``."""

    path: Path
    segment: int
    offset: int
    data: bytes
    reason: str
    index: int  # position in the peeked batch where its records would have been


class Spool:
    def __init__(self, directory: Path, segment_bytes: int = 64 * 1024 * 1024) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._dir_lock = _shared_lock(self.dir / LOCK_FILE)
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._acked = self._load_cursor()
        self._persisted = self._acked  # the position on disk (``ack(persist=False)`` lags it)
        self._ack_lock = threading.Lock()
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
        self._tail_size = valid_end  # bytes of whole appended frames in the tail segment
        self._tail = self._open_tail(last)
        self.ack_error: str | None = None  # last failure to persist the position
        self.broken: str | None = None  # a failed append could not be rolled back
        self.quarantined_now: list[Quarantined] = []  # damaged regions met by the last peek
        self.quarantined_total = 0  # damaged regions met by this process, each counted once
        self._reported: set[tuple[int, int]] = set()

    # ---- writing ------------------------------------------------------------------------

    def append(self, payloads: list[bytes]) -> None:
        """Durably append records (one fsync for the whole batch); all or nothing."""
        if not payloads:
            return
        if not all(payloads):
            raise ValueError("empty spool records are not allowed (a zeroed page reads as them)")
        buf = bytearray()
        for p in payloads:
            buf += _FRAME.pack(len(p), zlib.crc32(p))
            buf += p
        with self._lock:
            self._require_whole()
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
            self._tail_size = start + len(buf)
            if start + len(buf) >= self.segment_bytes:
                self._rotate()

    def check(self, nbytes: int = 0) -> None:
        """Raise OSError if ``nbytes`` of records could not be written now: a torn tail is
        repaired first, then a probe file of that size (at least a few bytes) is written and
        fsynced in the spool dir. Sized like the append that failed, a probe does not pass on
        a disk that has room for it but not for the records."""
        with self._lock:
            self._require_whole()
        probe = self.dir / ".probe"
        data = memoryview(b"\0" * max(nbytes, 8))
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                while data:
                    data = data[os.write(fd, data) :]
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()

    def _require_whole(self) -> None:
        """Raise OSError while the tail is torn; first try to cut it again, since the failure
        that stopped the rollback (read-only remount, immutable file, I/O error) may be over.
        Holding ``_lock``."""
        if not self.broken:
            return
        try:
            os.ftruncate(self._tail, self._tail_size)
            os.fsync(self._tail)
        except OSError as exc:
            self.broken = f"spool segment {self._path(self._tail_first)} is torn: {exc}"
            raise OSError(self.broken) from exc
        log.warning("spool segment %s repaired: appending again", self._path(self._tail_first))
        self.broken = None

    def _rollback(self, size: int) -> None:
        """Cut a failed append off the tail so no partial frame or uncounted record stays;
        if even that fails, refuse appends until a later attempt succeeds
        (:meth:`_require_whole`; a restart cuts the torn tail too)."""
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
        self._tail_first, self._tail, self._tail_size = self._next_seq, fd, 0
        with contextlib.suppress(OSError):
            fsync_path(self.dir)

    def _open_tail(self, first_seq: int) -> int:
        return os.open(self._path(first_seq), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    # ---- reading ------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Records written but not yet acknowledged by Kafka."""
        return max(0, self._next_seq - self._acked.seq)

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.glob("*.log"))

    def peek(self, max_records: int) -> tuple[list[bytes], Cursor]:
        """Up to ``max_records`` unacknowledged records, oldest first, and the cursor after them.

        Damaged regions on the way are quarantined and skipped (:attr:`quarantined_now`). Reads
        stop at the bytes of whole appends, never at a record count, so a miscounted damaged
        region cannot hide later records; the count is exact again at each segment's end."""
        with self._lock:
            end_seq, tail_first, tail_end = self._next_seq, self._tail_first, self._tail_size
        out: list[bytes] = []
        self.quarantined_now = []
        cur = self._acked
        while len(out) < max_records:
            path = self._path(cur.segment)
            is_tail = cur.segment == tail_first
            limit = tail_end if is_tail else path.stat().st_size
            cur = self._read(path, cur, limit, max_records, out)
            if cur.offset < limit:
                break  # the batch is full
            if is_tail:
                cur = Cursor(end_seq, tail_first, tail_end)
                break
            nxt = self._next_segment(cur.segment)
            cur = Cursor(nxt, nxt, 0)
        return out, cur

    def _read(
        self, path: Path, cur: Cursor, limit: int, max_records: int, out: list[bytes]
    ) -> Cursor:
        """Whole frames of one segment from ``cur`` up to byte ``limit``, into ``out``."""
        with open(path, "rb") as fh:
            fh.seek(cur.offset)
            while len(out) < max_records and cur.offset < limit:
                head = fh.read(_FRAME.size)
                payload = b""
                ok = False
                if len(head) == _FRAME.size:
                    length, crc = _FRAME.unpack(head)
                    if 0 < length <= limit - cur.offset - _FRAME.size:
                        payload = fh.read(length)
                        ok = len(payload) == length and zlib.crc32(payload) == crc
                if ok:
                    out.append(payload)
                    cur = Cursor(cur.seq + 1, cur.segment, cur.offset + _FRAME.size + len(payload))
                    continue
                cur = self._quarantine_region(path, cur, limit, len(out))
                fh.seek(cur.offset)
        return cur

    def _quarantine_region(self, path: Path, cur: Cursor, limit: int, index: int) -> Cursor:
        """Copy the damaged bytes at ``cur`` (up to the next valid frame) to quarantine/ and
        return the cursor after them; counted as one record."""
        with open(path, "rb") as fh:
            fh.seek(cur.offset)
            data = fh.read(limit - cur.offset)
        skip = _resync(data)
        bad = data[:skip]
        where = f"{path.name} at byte {cur.offset}"
        reason = f"corrupt spool frame in {where} ({len(bad)} bytes)"
        target = self.quarantine_bytes(f"{cur.segment:020d}-{cur.offset:012d}.bad", bad)
        self.quarantined_now.append(
            Quarantined(target, cur.segment, cur.offset, bad, reason, index)
        )
        if (cur.segment, cur.offset) not in self._reported:
            self._reported.add((cur.segment, cur.offset))
            self.quarantined_total += 1
            log.error("%s: moved to %s, delivery goes on after it", reason, target)
        return Cursor(cur.seq + 1, cur.segment, cur.offset + skip)

    def quarantine_bytes(self, name: str, data: bytes) -> Path:
        """Keep ``data`` durably in ``quarantine/<name>`` (for records that cannot be sent)."""
        qdir = self.dir / QUARANTINE_DIR
        qdir.mkdir(exist_ok=True)
        target = qdir / name
        atomic_write(target, data)
        return target

    def quarantine_problem(self) -> str | None:
        """What ``quarantine/`` holds (None when empty): records that were never delivered
        and wait for someone to look at them (remove the files to clear this)."""
        try:
            files = [e for e in os.scandir(self.dir / QUARANTINE_DIR) if e.name.endswith(".bad")]
        except OSError:
            return None
        if not files:
            return None
        size = sum(e.stat().st_size for e in files)
        return (
            f"{len(files)} corrupt spool region(s) ({size} bytes) quarantined in "
            f"{self.dir / QUARANTINE_DIR}: their records were not delivered (dead letters name "
            "them); inspect, then remove the files"
        )

    def ack(self, cursor: Cursor, *, persist: bool = True) -> None:
        """Everything before ``cursor`` reached Kafka: persist that, drop finished segments.

        The position advances in memory even if persisting it fails (``ack_error`` says so):
        re-sending already delivered records forever would be worse than a duplicate after a
        crash. With ``persist=False`` it advances in memory only, until :meth:`persist_ack`
        (the recorder's drainer persists at most every ``ack_persist_s``: an fsync per small
        batch was most of recording's CPU; a crash re-sends at most that window, which
        consumers deduplicate by event id)."""
        self._acked = cursor
        if persist:
            self.persist_ack()

    def persist_ack(self) -> None:
        """Write the in-memory acknowledged position to disk (no-op when already there), then
        delete the segments wholly before it."""
        with self._ack_lock:
            cursor = self._acked
            if cursor == self._persisted:
                return
            try:
                self._persist(cursor)
                self.ack_error = None
            except OSError as exc:
                self.ack_error = f"cannot persist the spool position in {self.dir}: {exc}"
                log.error("%s", self.ack_error)
                return
            self._persisted = cursor
            for first in self._segments():
                if first < cursor.segment:
                    with contextlib.suppress(OSError):
                        self._path(first).unlink(missing_ok=True)

    def _persist(self, cursor: Cursor) -> None:
        # No folder fsync per ack: after a power cut an older position only re-sends records
        # that consumers drop by event id, and acks come once per delivered batch.
        atomic_write(
            self.dir / _POS_FILE,
            orjson.dumps({"seq": cursor.seq, "segment": cursor.segment, "offset": cursor.offset}),
            sync_folder=False,
        )

    def close(self) -> None:
        self.persist_ack()
        with self._lock, contextlib.suppress(OSError):
            os.close(self._tail)
        if self._dir_lock is not None:
            with contextlib.suppress(OSError):
                os.close(self._dir_lock)

    # ---- helpers ------------------------------------------------------------------------

    def _path(self, first_seq: int) -> Path:
        return self.dir / f"{first_seq:020d}.log"

    def _segments(self) -> list[int]:
        return [first for first, _ in segment_files(self.dir)]

    def _next_segment(self, first: int) -> int:
        later = [s for s in self._segments() if s > first]
        if not later:
            raise OSError(f"spool segment after {first} is missing")
        return later[0]

    def _load_cursor(self) -> Cursor:
        cursor = acked_position(self.dir)
        if cursor is None:
            segments = self._segments()
            return Cursor(segments[0] if segments else 0, segments[0] if segments else 0, 0)
        return cursor


# ---- the on-disk format, for readers of a spool that is not open (liverl forget) ------------


def segment_files(directory: Path) -> list[tuple[int, Path]]:
    """(first sequence number, path) of each segment file, oldest first."""
    return sorted((int(p.stem), p) for p in Path(directory).glob("*.log") if p.stem.isdigit())


def acked_position(directory: Path) -> Cursor | None:
    """The persisted acknowledged position (every frame before it reached Kafka); None when
    nothing was ever acknowledged."""
    try:
        raw = orjson.loads((Path(directory) / _POS_FILE).read_bytes())
    except FileNotFoundError:
        return None
    return Cursor(int(raw["seq"]), int(raw["segment"]), int(raw["offset"]))


def encode_frame(payload: bytes) -> bytes:
    """One frame: ``>II`` (length, crc32), then the payload."""
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def frames(data: bytes) -> Iterator[tuple[int, int, bytes | None]]:
    """(start, end, payload) of each whole frame of a segment's bytes, in order. A damaged
    region is one ``(start, end, None)`` reaching to the next valid frame, found by the same
    resync as :meth:`Spool.peek`'s, so a reader (forget) sees every frame the gateway will
    deliver after it; a torn tail reaches to the end."""
    pos = 0
    while pos < len(data):
        if not _valid_at(data, pos):
            skip = _resync(data[pos:])
            yield pos, pos + skip, None
            pos += skip
            continue
        end = pos + _FRAME.size + _FRAME.unpack_from(data, pos)[0]
        yield pos, end, data[pos + _FRAME.size : end]
        pos = end


def _shared_lock(path: Path) -> int | None:
    """Hold ``path`` locked shared (waiting while a forget holds it exclusively); None when it
    cannot be opened (a read-only spool still reports its own errors as before)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _scan(path: Path) -> tuple[int, int]:
    """Number of records in a segment and where its last whole frame ends. A damaged region
    with valid frames after it counts as one record (peek quarantines it); one with none after
    it is a torn tail from a crash."""
    data = path.read_bytes()
    count = pos = end = 0
    while pos < len(data):
        if _valid_at(data, pos):
            pos += _FRAME.size + _FRAME.unpack_from(data, pos)[0]
            count, end = count + 1, pos
            continue
        skip = _resync(data[pos:])
        if pos + skip >= len(data):
            break  # nothing valid after it: a torn tail
        count, pos = count + 1, pos + skip
    return count, end


def _valid_at(data: bytes, pos: int) -> bool:
    """A whole, non-empty frame with a matching crc starts at ``pos``."""
    if len(data) - pos < _FRAME.size:
        return False
    length, crc = _FRAME.unpack_from(data, pos)
    start = pos + _FRAME.size
    if not 0 < length <= len(data) - start:
        return False
    return zlib.crc32(memoryview(data)[start : start + length]) == crc


def _resync(data: bytes) -> int:
    """Bytes to skip at the start of ``data`` (a damaged frame) to reach the next valid frame,
    or ``len(data)`` when none follows. A frame whose header is intact but whose payload is
    damaged is exactly one frame long when a valid frame (or the end) follows it; otherwise
    candidate frame starts are tried in order, within a crc budget."""
    if len(data) >= _FRAME.size:
        length = _FRAME.unpack_from(data, 0)[0]
        after = _FRAME.size + length
        if length > 0 and (after == len(data) or (after < len(data) and _valid_at(data, after))):
            return after
    budget = _RESYNC_CRC_BUDGET
    for m in _HEADER_START.finditer(data, 1):
        pos = m.start()
        if len(data) - pos < _FRAME.size:
            break
        length = _FRAME.unpack_from(data, pos)[0]
        if not 0 < length <= len(data) - pos - _FRAME.size:
            continue
        budget -= length
        if budget < 0:
            break
        if _valid_at(data, pos):
            return pos
    return len(data)
