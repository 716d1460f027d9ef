"""The spool's part of forget (serving/spool_forget.py) over frames the real Spool.append
wrote: survey counts a session's delivered and undelivered frames, erase removes exactly
those (blanking delivered ones in place), and the gateway's spool reads on after it."""

from __future__ import annotations

from pathlib import Path

import orjson

from pipeline.events import examples
from pipeline.serving import spool_forget
from pipeline.serving.recorder import frame, unframe
from pipeline.serving.spool import QUARANTINE_DIR, Spool

TOPIC = "liverl.interactions.v1"


def turn(session: str, n: int, user: str = "u") -> bytes:
    ev = examples.interaction()
    ev.event_id, ev.session_id, ev.turn, ev.user_id = f"{session}-{n}", session, n, user
    ev.response_text = f"secret of {session}"
    return frame(TOPIC, ev)


def event_ids(frames: list[bytes]) -> list[str]:
    return [orjson.loads(unframe(f)[2])["event_id"] for f in frames]


def spool_with_two_sessions(path: Path) -> int:
    """a-0, b-0 delivered; a-1, b-1, a-2 pending, in one segment; returns the acked offset."""
    spool = Spool(path)
    spool.append([turn("a", 0, "alice"), turn("b", 0, "bob")])
    _, cursor = spool.peek(2)
    spool.ack(cursor)
    spool.append([turn("a", 1, "alice"), turn("b", 1, "bob"), turn("a", 2, "alice")])
    spool.close()
    return cursor.offset


def test_survey_counts_the_sessions_frames_and_erase_removes_only_them(tmp_path: Path) -> None:
    path = tmp_path / "spool"
    acked = spool_with_two_sessions(path)
    q = path / QUARANTINE_DIR
    q.mkdir()
    (q / "1.bad").write_bytes(b'garbage {"t":"x","k":"a","v":"...')
    (q / "2.bad").write_bytes(b'garbage {"t":"x","k":"b","v":"...')
    (seg,) = path.glob("*.log")
    before = seg.read_bytes()
    a0_end = 8 + len(turn("a", 0, "alice"))

    hit = spool_forget.survey(path, ["a"], live=False)
    assert (hit.pending, hit.delivered, hit.quarantined, hit.live) == (2, 1, [q / "1.bad"], False)
    b = spool_forget.survey(path, ["b"], live=True)
    assert (b.pending, b.delivered, b.live) == (1, 1, True)
    assert spool_forget.survey(path, ["nobody"], live=False).pending == 0

    assert spool_forget.erase(hit, ["a"]) == 3
    after = seg.read_bytes()
    assert b'"a-' not in after and b"secret of a" not in after
    assert after.count(b"secret of b") == 2
    assert sorted(p.name for p in q.iterdir()) == ["2.bad"]
    # a-0, delivered, is a blank frame of its length: the acked byte offset stays right
    assert after[8:a0_end] == b" " * (a0_end - 8)
    assert after[a0_end:acked] == before[a0_end:acked]  # b-0 where it was
    after_a = spool_forget.survey(path, ["a"], live=False)
    assert (after_a.pending, after_a.delivered, after_a.quarantined) == (0, 0, [])
    b = spool_forget.survey(path, ["b"], live=False)
    assert (b.pending, b.delivered) == (1, 1)

    reopened = Spool(path)  # the gateway starts again: only b's undelivered frame is sent
    assert reopened.pending == 1
    frames, _ = reopened.peek(10)
    assert event_ids(frames) == ["b-1"] and reopened.quarantined_now == []
    reopened.close()


def test_user_sessions_reads_the_users_interactions(tmp_path: Path) -> None:
    path = tmp_path / "spool"
    spool_with_two_sessions(path)
    assert spool_forget.user_sessions(path, TOPIC, "alice") == {"a"}
    assert spool_forget.user_sessions(path, TOPIC, "bob") == {"b"}
    assert spool_forget.user_sessions(path, "other.topic", "alice") == set()


def test_frames_after_a_damaged_region_are_found_and_erased(tmp_path: Path) -> None:
    # a-0, then b-0 with a damaged payload, then a-1 and c-0: the gateway quarantines b-0 and
    # delivers a-1 and c-0, so forget must find a-1 past the damage and keep c-0.
    path = tmp_path / "spool"
    spool = Spool(path)
    spool.append([turn("a", 0), turn("b", 0), turn("a", 1), turn("c", 0)])
    spool.close()
    (seg,) = path.glob("*.log")
    data = seg.read_bytes()
    first_end = 8 + int.from_bytes(data[:4], "big")
    second_end = first_end + 8 + int.from_bytes(data[first_end : first_end + 4], "big")
    damaged = data[: first_end + 9] + b"\xff" + data[first_end + 10 :]  # b's payload
    seg.write_bytes(damaged)
    hit = spool_forget.survey(path, ["a"], live=False)
    assert (hit.pending, hit.delivered) == (2, 0)
    assert spool_forget.survey(path, ["c"], live=False).pending == 1
    assert spool_forget.erase(hit, ["a"]) == 2
    after = seg.read_bytes()
    assert b"secret of a" not in after
    assert after.startswith(damaged[first_end:second_end])  # the damage kept verbatim
    reopened = Spool(path)
    frames, _ = reopened.peek(10)
    assert event_ids(frames) == ["c-0"] and len(reopened.quarantined_now) == 1
    reopened.close()


def test_locks_tell_a_running_gateway(tmp_path: Path) -> None:
    path = tmp_path / "spool"
    spool = Spool(path)
    assert spool_forget.held(path)
    with spool_forget.locks([path]) as live:
        assert live == {path: True}
    spool.close()
    assert not spool_forget.held(path)
    with spool_forget.locks([path]) as live:
        assert live == {path: False}
        assert spool_forget.held(path)  # forget holds it now: a gateway would wait
