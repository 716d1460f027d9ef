"""A gateway spool's part of ``liverl forget``: find and remove sessions' frames on disk.

Beside :mod:`.spool`, whose on-disk format (segments, frames, the acknowledged position) it
reads through that module's helpers, and :mod:`.recorder`, whose frame payload names the
record's topic and key: a change to either is a change here, not a silent leftover.

Segments are rewritten only under the spool's lock taken exclusively (:func:`locks`), so
never under a running gateway: a gateway holds the lock shared for as long as its spool is
open (:class:`.spool.Spool`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from pipeline.durable import atomic_write, fsync_path

from .recorder import key_mark, unframe
from .spool import LOCK_FILE, QUARANTINE_DIR, acked_position, encode_frame, frames, segment_files


@dataclass
class SpoolHit:
    path: Path
    pending: int  # frames not yet delivered to Kafka
    delivered: int  # delivered frames whose segment is still on disk
    quarantined: list[Path]  # damaged regions that name the session
    live: bool  # a gateway holds the spool


def frame_session(payload: bytes) -> tuple[str, str | None, bytes]:
    """(topic, session, value) of a spooled record: its key, else the value's ``session_id``
    (a keyless record)."""
    topic, key, value, _ = unframe(payload)
    if key is not None:
        return topic, key.decode("utf-8", "replace"), value
    sid = None
    with contextlib.suppress(Exception):
        got = orjson.loads(value).get("session_id")
        sid = got if isinstance(got, str) else None
    return topic, sid, value


def _session(payload: bytes) -> str | None:
    """The session of a frame, None when the payload does not parse."""
    try:
        return frame_session(payload)[1]
    except Exception:  # noqa: BLE001 - a foreign payload is not any session's
        return None


def _acked(spool: Path) -> tuple[int, int]:
    """(segment, byte offset) of the first undelivered frame; (-1, 0): all are pending."""
    pos = acked_position(spool)
    return (-1, 0) if pos is None else (pos.segment, pos.offset)


def user_sessions(spool: Path, topic: str, user: str) -> set[str]:
    """Sessions whose records for ``topic`` (the interactions topic) carry ``user_id ==
    user``; the gateway spools records before Kafka has them."""
    needle = orjson.dumps(user)
    found: set[str] = set()
    for _first, seg in segment_files(spool):
        for _s, _e, payload in frames(seg.read_bytes()):
            if payload is None:
                continue
            with contextlib.suppress(Exception):  # the value is escaped inside the frame
                t, sid, value = frame_session(payload)
                if (
                    t == topic
                    and sid is not None
                    and needle in value
                    and orjson.loads(value).get("user_id") == user
                ):
                    found.add(sid)
    return found


def _quarantined(spool: Path, sessions: list[str]) -> list[Path]:
    marks = [key_mark(s) for s in sessions]
    out = []
    for bad in sorted((spool / QUARANTINE_DIR).glob("*.bad")):
        with contextlib.suppress(OSError):
            data = bad.read_bytes()
            if any(m in data for m in marks):
                out.append(bad)
    return out


def survey(spool: Path, sessions: list[str], live: bool) -> SpoolHit:
    """The sessions' frames in ``spool``, delivered or not, and the quarantine files that
    name them; ``live``: whether a gateway holds the spool (see :func:`locks`)."""
    wanted = set(sessions)
    cur_seg, cur_off = _acked(spool)
    pending = delivered = 0
    for first, seg in segment_files(spool):
        for _start, end, payload in frames(seg.read_bytes()):
            if payload is None or _session(payload) not in wanted:
                continue
            if first < cur_seg or (first == cur_seg and end <= cur_off):
                delivered += 1
            else:
                pending += 1
    return SpoolHit(spool, pending, delivered, _quarantined(spool, sessions), live)


def erase(hit: SpoolHit, sessions: list[str]) -> int:
    """Drop the sessions' undelivered frames and blank their delivered ones; returns how
    many frames. Call with the spool's lock held exclusively (no gateway running on it).

    Delivered frames keep their length, replaced by a frame of spaces with a valid crc, so
    the byte offset of the acknowledged position stays right and a segment's frame count is
    unchanged; undelivered frames are removed, so they are never sent. Each segment is
    replaced atomically (temp file, fsync, rename), so a crash leaves it old or new."""
    wanted = set(sessions)
    cur_seg, cur_off = _acked(hit.path)
    changed = 0
    for first, seg in segment_files(hit.path):
        data = seg.read_bytes()
        out = bytearray()
        touched = 0
        for start, end, payload in frames(data):
            if payload is None or _session(payload) not in wanted:
                out += data[start:end]
                continue
            touched += 1
            if first < cur_seg or (first == cur_seg and end <= cur_off):
                out += encode_frame(b" " * len(payload))
        if not touched:
            continue
        atomic_write(seg, bytes(out), sync_folder=False)  # one folder fsync at the end
        changed += touched
    for bad in hit.quarantined:
        bad.unlink(missing_ok=True)
    fsync_path(hit.path)
    return changed


@contextlib.contextmanager
def locks(dirs: list[Path]) -> Iterator[dict[Path, bool]]:
    """Try each spool's lock exclusively, holding those it gets until the block ends:
    path -> True when a gateway holds it (live)."""
    fds: list[int] = []
    live: dict[Path, bool] = {}
    try:
        for d in dirs:
            fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                live[d] = True
                continue
            fds.append(fd)
            live[d] = False
        yield live
    finally:
        for fd in fds:
            os.close(fd)


def held(spool: Path) -> bool:
    """Whether a gateway holds the spool, without keeping the lock."""
    with locks([spool]) as live:
        return live[spool]
