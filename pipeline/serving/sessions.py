"""Which session and turn a request belongs to.

Precedence: headers (``X-Session-Id``, ``X-Turn-Type``, ``X-Session-Done``, ``X-Liverl-Train``)
then body fields (``session_id``, ``turn_type``, ``session_done``, ``train``). A client that
names no session gets ``auto-<hash>``: sha256 over the caller's key id and the first
``prefix_messages`` messages (canonical JSON), so a growing conversation from one key keeps
one session while different conversations or keys never share one.

Turn numbers need no sticky sessions: a main turn's number is its position in the conversation,
the number of assistant messages its request carries (each earlier turn's answer), which every
replica reads the same from the request itself. Within one replica it is never less than one
more than the last number this replica gave the session (a retry after an abort, a client that
resends no history, a harness that compacted it), so one replica numbers exactly as a counter
would. Each turn is also stamped with a per-session monotonic timestamp (wall-clock ms, at least
1 ms after the last this replica stamped for the session); downstream, pairing orders a
session's turns by (timestamp, event id), not by which replica served them (see
``pipeline/processors/pairing.py``).
``X-Liverl-User`` names whose turn it is (else the key's user); recorded as the interaction's
``user_id`` so that ``liverl forget --user`` can find a user's sessions. With API keys a ``user``
key may name only its own user (403 otherwise); an operator key, or any loopback caller
without keys, may name any.

Ownership: the user of a session's first turn here owns it (``owner``), and with API keys only
that user or an operator may take more turns or post next states for it (``check_owner``: 403).
The table is this replica's, bounded like the turn counters but kept after a session closes
(feedback on its turns still comes), and seeded at start from the ``user_id`` of the
interactions in the log (``turns.py``); a session this replica has no owner for is not checked.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from pipeline import events

from .auth import Caller, forbidden, open_caller
from .errors import ApiError

MAX_ID_CHARS = 256  # session and group ids, header or body (the body fields say the same)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True, slots=True)
class TurnInfo:
    session_id: str
    turn_type: Literal["main", "side"]
    done: bool
    train: bool
    # Sessions that are attempts at the same task (GRPO-style); rewards are z-scored per group.
    group_id: str | None = None
    # Whose turn it is (X-Liverl-User, else the key id): what `liverl forget --user` looks for.
    user_id: str | None = None
    # A user named by the request (X-Liverl-User, or an API key's user), not a key id
    # standing in for one: without keys every caller of a gateway shares that key id.
    named_user: str | None = None

    @property
    def arm_key(self) -> str:
        """What picks the request's arm during a canary (``versions.table.arm_fraction``):
        its user, so a user stays on one version across sessions, else its session."""
        return self.named_user or self.session_id

    @property
    def recorded(self) -> bool:
        """Only main turns that did not opt out of training are recorded."""
        return self.turn_type == "main" and self.train


def _flag(name: str, header: str | None, body: Any, default: bool) -> bool:
    if header is not None:
        value = header.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ApiError(400, f"header {name} must be true or false", param=name)
    return default if body is None else bool(body)


def _header_text(name: str, value: str | None) -> str | None:
    """A header value as the client's UTF-8 text: ASGI servers hand headers over as latin-1,
    so undo that and refuse bytes that are not UTF-8 (they would be stored as mojibake) and
    ids longer than the body fields allow (a 60 KB id would become a Kafka key)."""
    if value is None:
        return None
    try:
        text = value.encode("latin-1").decode("utf-8")
    except UnicodeEncodeError:  # already text (a Mapping from a test or another server)
        text = value
    except UnicodeDecodeError:
        raise ApiError(400, f"header {name} is not valid UTF-8", param=name) from None
    if len(text) > MAX_ID_CHARS:
        raise ApiError(400, f"header {name} is longer than {MAX_ID_CHARS} characters", param=name)
    return text


def conversation_position(roles: Iterable[str | None]) -> int:
    """How many answers a conversation already holds: its assistant messages (by role)."""
    return sum(1 for role in roles if role == "assistant")


class Sessions:
    def __init__(self, prefix_messages: int = 2, max_sessions: int = 100_000) -> None:
        self.prefix_messages = prefix_messages
        self.max_sessions = max_sessions
        self._turns: OrderedDict[str, int] = OrderedDict()
        self._stamps: dict[str, int] = {}  # last timestamp given to each session here
        self._owners: OrderedDict[str, str] = OrderedDict()  # session -> its first user here

    def resolve(
        self,
        headers: Mapping[str, str],
        body: Mapping[str, Any],
        caller: Caller | str,
        messages: list[dict[str, Any]],
    ) -> TurnInfo:
        """The request's session and turn; ``caller`` (a key id: a loopback caller) names
        auto sessions and, without ``X-Liverl-User``, the user."""
        if isinstance(caller, str):
            caller = open_caller(caller)
        key_id = caller.key_id
        session = _header_text("X-Session-Id", headers.get("x-session-id")) or body.get(
            "session_id"
        )
        if not session:
            prefix = orjson.dumps(messages[: self.prefix_messages], option=orjson.OPT_SORT_KEYS)
            session = "auto-" + hashlib.sha256(key_id.encode() + b"\n" + prefix).hexdigest()[:24]
        given = (headers.get("x-turn-type") or body.get("turn_type") or "main").lower()
        if given not in ("main", "side"):
            raise ApiError(400, "X-Turn-Type must be 'main' or 'side'", param="X-Turn-Type")
        turn_type: Literal["main", "side"] = "main" if given == "main" else "side"
        done = _flag(
            "X-Session-Done", headers.get("x-session-done"), body.get("session_done"), False
        )
        train = _flag("X-Liverl-Train", headers.get("x-liverl-train"), body.get("train"), True)
        group = _header_text("X-Liverl-Group", headers.get("x-liverl-group")) or body.get(
            "group_id"
        )
        if group is not None and (not isinstance(group, str) or not 0 < len(group) <= MAX_ID_CHARS):
            raise ApiError(
                400,
                "X-Liverl-Group / group_id must be a non-empty string of at most 256 characters",
                param="group_id",
            )
        user = _header_text("X-Liverl-User", headers.get("x-liverl-user"))
        if user is not None and not (user.strip() and user.isprintable()):
            raise ApiError(
                400,
                "header X-Liverl-User must be a non-empty printable id of at "
                f"most {MAX_ID_CHARS} characters",
                param="X-Liverl-User",
            )
        if user is not None and user != caller.user and not caller.operator:
            raise forbidden(
                "X-Liverl-User names another user than this API key's; only an "
                "operator key may speak for other users",
                "X-Liverl-User",
                "user_mismatch",
            )
        named = user if user is not None else (caller.user if caller.keyed else None)
        return TurnInfo(str(session), turn_type, done, train, group, user or caller.user, named)

    def owner(self, session_id: str) -> str | None:
        """The user who owns the session on this replica (None: unknown here)."""
        return self._owners.get(session_id)

    def check_owner(self, session_id: str, caller: Caller) -> None:
        """403 unless ``caller`` may act on the session: its owner, an operator, any
        loopback caller without keys, or anyone for a session this replica has no owner for."""
        if not caller.may_act_for(self._owners.get(session_id)):
            raise forbidden(
                f"session {session_id!r} belongs to another user; only its owner "
                "or an operator key may use it",
                "session_id",
                "session_forbidden",
            )

    def claim(self, session_id: str, user: str | None) -> None:
        """``user`` owns the session unless someone already does (its first turn opens it)."""
        if user is None:
            return
        self._owners.setdefault(session_id, user)
        self._owners.move_to_end(session_id)
        while len(self._owners) > self.max_sessions:
            self._owners.popitem(last=False)

    def next_turn(self, session_id: str, position: int = 0) -> int:
        """Claim a main-turn number: the request's conversation ``position`` (see
        :func:`conversation_position`), but at least one more than the last number this
        replica gave the session."""
        floor = self._turns.pop(session_id, 0)
        turn = max(floor, position)
        self._turns[session_id] = turn + 1
        self._evict()
        return turn

    def stamp(self, session_id: str, now_ms: int | None = None) -> int:
        """A timestamp for the session's next event: the wall clock, but strictly after the
        last one this replica stamped for it (a clock stepped back cannot reorder its turns)."""
        now = events.now_ms() if now_ms is None else now_ms
        ts = max(now, self._stamps.get(session_id, now - 1) + 1)
        self._stamps[session_id] = ts
        return ts

    def _evict(self) -> None:
        while len(self._turns) > self.max_sessions:
            gone, _ = self._turns.popitem(last=False)
            self._stamps.pop(gone, None)
        while len(self._stamps) > self.max_sessions:  # stamped but never numbered (aborted)
            self._stamps.pop(next(iter(self._stamps)))

    def seed(self, next_turns: dict[str, int], owners: Mapping[str, str] | None = None) -> None:
        """Continue sessions recovered from the log (see ``turns.py``) where they left off,
        owned by the users recorded on them."""
        for session_id, turn in next_turns.items():
            self._turns[session_id] = max(self._turns.get(session_id, 0), turn)
        self._evict()
        for session_id, user in (owners or {}).items():
            self.claim(session_id, user)

    def close(self, session_id: str) -> None:
        self._turns.pop(session_id, None)
        self._stamps.pop(session_id, None)
