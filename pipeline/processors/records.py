"""Table keys and values the agents share: where a key lives and how a kept record is stored.

Tables are keyed by session id, except the token and parked tables (``session\\0turn``,
``session\\0next-state id``) and the group tables; those composite keys are placed on their
session's partition (:func:`key_partition` of the session part), so one worker holds all of a
session's state.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import orjson
from aiokafka.partitioner import murmur2

from pipeline import events


def key_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default (murmur2) partitioner gives ``key``."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def token_key(session_key: bytes, turn: int) -> bytes:
    return session_key + b"\0" + str(turn).encode()


def parked_key(session_key: bytes, next_state_id: str) -> bytes:
    return session_key + b"\0" + next_state_id.encode()


def member_key(group_key: bytes, session_id: str) -> bytes:
    return group_key + b"\0" + session_id.encode()


def session_of(key: bytes) -> bytes:
    """The session (or group) part of a composite key."""
    return key.split(b"\0", 1)[0]


def member_session(key: bytes) -> bytes | None:
    """The session part of a :func:`member_key` (None: not one)."""
    return key.split(b"\0", 1)[1] if b"\0" in key else None


def _no_session(_key: bytes) -> bytes | None:
    return None


# The app's tables, by the names the agents declare them with (Runtime.table refuses any
# other, so a new table must say here how its key names a session: `liverl forget` finds a
# session's state, and Faust names each table's changelog, from this).
SESSIONS = "sessions"  # session id -> SessionState (session.py)
TOKENS = "tokens"  # token_key -> token payload
PARKED = "parked"  # parked_key -> a parked next state
JUDGING = "judging"  # session id -> JudgeAgentState (a judge that is not inline)
JUDGE_PARKED = "judge_parked"  # parked_key -> a next state the judge agent parked
GROUPS = "groups"  # group id -> GroupIndex: member ids, no session's content
GROUP_MEMBERS = "group_members"  # member_key -> the session's held samples
TABLE_SESSION: dict[str, Callable[[bytes], bytes | None]] = {
    SESSIONS: session_of,
    TOKENS: session_of,
    PARKED: session_of,
    JUDGING: session_of,
    JUDGE_PARKED: session_of,
    GROUPS: _no_session,
    GROUP_MEMBERS: member_session,
}


def park(msg: Any) -> bytes:
    """A consumed record as one table value: JSON coordinates, NUL, the value bytes verbatim
    (base64 would push an event near the codec limit over the record limit)."""
    meta = {
        "topic": msg.topic,
        "partition": msg.partition,
        "offset": msg.offset,
        "key": None if msg.key is None else base64.b64encode(msg.key).decode(),
        "headers": [[k, base64.b64encode(v or b"").decode()] for k, v in (msg.headers or [])],
    }
    return orjson.dumps(meta) + b"\0" + (msg.value or b"")


class Parked:
    """A record kept in a table: enough to decode it again or dead-letter it verbatim."""

    def __init__(self, raw: bytes) -> None:
        meta, self.value = raw.split(b"\0", 1)
        m = orjson.loads(meta)
        self.topic, self.partition, self.offset = m["topic"], m["partition"], m["offset"]
        self.key = None if m["key"] is None else base64.b64decode(m["key"])
        self.headers = [(k, base64.b64decode(v)) for k, v in m["headers"]]


def parked_next_state(raw: bytes) -> events.NextState:
    """The next state kept by :func:`park` (it was valid when parked)."""
    nxt = events.decode(Parked(raw).value)
    assert isinstance(nxt, events.NextState)  # only next states are parked
    return nxt


def touched(raw: bytes) -> int:
    """When a stored session or judge state was last written (0 if unreadable)."""
    try:
        return int(orjson.loads(raw).get("touched_ms", 0))
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return 0


def sample_of(doc: Any) -> events.Sample:
    """A held group member's sample document as its Sample (the group topic holds only
    samples, written by this app); EventValidationError for anything else, e.g. state written
    by another version of this code."""
    if not isinstance(doc, dict):
        raise events.EventValidationError(f"a held sample is {type(doc).__name__}, not a dict")
    ev = events.from_dict(doc)
    if not isinstance(ev, events.Sample):
        raise events.EventValidationError(f"a held sample is a {ev.type} event")
    return ev


def held_samples(raw: bytes) -> list[events.Sample]:
    """A group member's held samples (a JSON list of sample documents)."""
    try:
        docs = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise events.EventValidationError(f"held samples are not JSON: {exc}") from None
    if not isinstance(docs, list):
        raise events.EventValidationError("held samples are not a list")
    return [sample_of(d) for d in docs]
