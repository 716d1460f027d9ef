"""``POST /v1/feedback``: thumbs, a score or words about a turn, as a ``feedback`` next state.

Feedback often comes from outside the conversation (a thumbs button, a review tool), so it is
recorded on its own rather than waiting for a next turn. It goes through the gateway's
recorder (memory queue -> fsynced spool -> Kafka), like interactions, and is authenticated and
rate-limited like ``/v1/chat/completions``.

Request (JSON, at most ``next_state_max_body_bytes``; unknown fields are refused)::

    {"session_id": "s1", "turn": 3 | "last", "thumbs": "up" | "down",
     "score": -1.0..1.0, "text": "too long, use bullet points"}

At least one of ``thumbs``, ``score``, ``text``. ``score`` wins over ``thumbs`` (up = 1,
down = -1) but must not contradict it. ``"last"`` (the default) is the session's latest turn
recorded by this gateway while the session is open (400 ``session_not_found`` otherwise; pass
the turn number, from the ``X-Liverl-Turn`` response header, to rate a turn of a closed or
another replica's session). Response::

    {"object": "feedback", "id": "<event id>", "session_id": "s1", "turn": 3,
     "kind": "feedback", "score": 1.0, "recorded": true, "paired": true}

``paired`` is true when this gateway recorded the turn (its session is open here). For a
session it does not know (never seen, closed, another replica's), with a turn number, the
answer is 202 with ``"paired": "pending"``: the feedback is recorded, and the processors pair
it with the turn's interaction if that arrives within ``processors.grace_s`` (30 s), else
dead-letter it. ``recorded`` is false when the gateway runs with recording off. Bad payloads get an
OpenAI-style 4xx and nothing is recorded. With API keys only the session's owner or an operator
key may rate it (403 ``session_forbidden``; ``sessions.py``: checked where this replica knows
the owner). ``detail.key_id`` names the voter (``auth.py: Caller.voter``): the caller's key,
or without keys ``loopback`` whatever bearer string was sent; the reward workers count one
vote per voter and turn, the latest (docs/hooks.md). Besides the chat rate limit,
``serve.feedback_rate_limit_per_min`` (30, burst 10) limits each voter's feedback: 429.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pipeline import __version__, events

from .auth import Caller
from .errors import ApiError
from .gateway_api import GatewayApi
from .protocol import validated
from .sessions import MAX_ID_CHARS, Sessions

PRODUCER = events.Producer(component="gateway", version=__version__)
MAX_TURN = 2**31 - 1

Turn = Annotated[int, Field(strict=True, ge=0, le=MAX_TURN)]


class FeedbackRequest(BaseModel):
    """The body of ``POST /v1/feedback``."""

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    turn: Turn | Literal["last"] = "last"
    thumbs: Literal["up", "down"] | None = None
    score: float | None = Field(default=None, ge=-1, le=1, strict=True, allow_inf_nan=False)
    text: str | None = None

    def outcome(self) -> float | None:
        """The explicit score: ``score``, else the thumbs as +-1, else None (text only)."""
        if self.score is not None:
            return float(self.score)
        return None if self.thumbs is None else (1.0 if self.thumbs == "up" else -1.0)


# ---- shared by the feedback and hook routes ---------------------------------------------------


def authorize(gateway: GatewayApi, request: Request) -> Caller:
    """The caller, checked and rate-limited exactly as for chat completions."""
    caller = gateway.auth.caller(request.headers.get("authorization"))
    gateway.limiter.check(caller.key_id)
    return caller


def check_owner(gateway: GatewayApi, session_id: str, caller: Caller) -> None:
    """403 unless ``caller`` may post for the session (its owner or an operator; counted)."""
    try:
        gateway.sessions.check_owner(session_id, caller)
    except ApiError:
        gateway.metrics.posts_not_recorded.labels("forbidden").inc()
        raise


def poster(caller: Caller, route: str) -> dict[str, Any]:
    """Who posted a next state, for its ``detail``: the voter (``key_id``) and, with keys,
    the caller's user (``user_id``) and ``operator`` for an operator key: the reward workers
    leave out a keyed post whose user does not own the session (a replica that never saw the
    session cannot tell; ``rewards.poster_of``)."""
    out: dict[str, Any] = {"key_id": caller.voter(route)}
    if caller.keyed:
        out["user_id"] = caller.user
        if caller.operator:  # the reward workers accept it on any user's session
            out["operator"] = True
    return out


def check_text(value: str | None, limit: int, param: str) -> None:
    """400 when a text that would be recorded is longer than ``limit`` characters."""
    if value is not None and len(value) > limit:
        raise ApiError(
            400, f"{param} is longer than {limit} characters", param=param, code="text_too_long"
        )


def last_turn(sessions: Sessions, session_id: str) -> int | None:
    """The session's latest recorded main turn on this gateway; None when the session is
    unknown here (never seen, closed, or evicted). The registry keeps the next turn index."""
    nxt = sessions._turns.get(session_id)
    return None if not nxt else nxt - 1


def record(gateway: GatewayApi, event: events.NextState) -> bool:
    """Hand a next state to the recorder (False: recording is off). 503 while events would
    be lost, as for a chat turn that would train."""
    problem = gateway.recording_problem()
    if problem:
        raise ApiError(
            503,
            f"next states cannot be recorded right now ({problem}); retry later",
            type="server_error",
            code="recording_unavailable",
            headers={"Retry-After": "5"},
        )
    if gateway.recorder is None:
        return False
    gateway.recorder.record(gateway.cfg.next_states_topic, event)
    return True


def record_posted(
    gateway: GatewayApi, channel: str, states: list[events.NextState], *, dedupe: bool = True
) -> tuple[list[events.NextState], dict[str, str], bool]:
    """Record posted next states within the turn's cap (``posted.py``; 429 beyond): the ones
    recorded, each repeat's id -> the id recorded before (``dedupe``), and whether recording
    is on."""
    try:
        fresh, repeats = gateway.posted.split(channel, states, dedupe=dedupe)
    except ApiError:
        gateway.metrics.posts_not_recorded.labels("per_turn_cap").inc(len(states))
        raise
    if repeats:
        gateway.metrics.posts_not_recorded.labels("repeat").inc(len(repeats))
    recorded = all([record(gateway, ns) for ns in fresh])
    if recorded:
        gateway.posted.add(channel, fresh, dedupe=dedupe)
    return fresh, repeats, recorded


# ---- feedback -----------------------------------------------------------------------------------


def resolve_turn(sessions: Sessions, session_id: str, turn: int | str) -> int:
    """The turn a feedback is about: ``"last"`` must name an open session of this gateway; a
    number must not be ahead of what this gateway recorded for a session it knows."""
    last = last_turn(sessions, session_id)
    if turn == "last":
        if last is None:
            raise ApiError(
                400,
                f"session {session_id!r} has no open turn on this gateway; pass the turn number",
                param="session_id",
                code="session_not_found",
            )
        return last
    assert isinstance(turn, int)
    if last is not None and turn > last:
        raise ApiError(
            400,
            f"turn {turn} of session {session_id!r} has not been recorded (last is {last})",
            param="turn",
            code="turn_not_found",
        )
    return turn


def feedback_event(req: FeedbackRequest, turn: int, caller: Caller | str) -> events.NextState:
    """The ``feedback`` next state of one turn (a root event: random id), cast by ``caller``
    (or by a voter named by its key id)."""
    detail = {"key_id": caller} if isinstance(caller, str) else poster(caller, "feedback")
    if req.thumbs is not None:
        detail["thumbs"] = req.thumbs
    return events.NextState(
        event_id=events.new_event_id(),
        producer=PRODUCER,
        session_id=req.session_id,
        turn=turn,
        kind="feedback",
        content=req.text or "",
        role="user",
        source="feedback",
        score=req.outcome(),
        detail=detail,
    )


def parse_feedback(doc: Any, max_chars: int) -> FeedbackRequest:
    """A valid feedback request or the 4xx saying why not."""
    req = validated(FeedbackRequest, doc)
    check_text(req.text, max_chars, "text")
    if req.thumbs is None and req.score is None and not req.text:
        raise ApiError(400, "feedback needs thumbs, score or text", code="empty_feedback")
    sign = 1 if req.thumbs == "up" else -1
    if req.thumbs is not None and req.score is not None and req.score * sign < 0:
        raise ApiError(400, f"score {req.score:g} contradicts thumbs {req.thumbs!r}", param="score")
    return req


async def handle_feedback(gateway: GatewayApi, request: Request) -> JSONResponse:
    caller = authorize(gateway, request)
    # a vote per voter and turn counts: no floods (loopback callers are one voter)
    gateway.feedback_limiter.check(caller.voter("feedback"))
    doc = await gateway.read_body(request, gateway.cfg.next_state_max_body_bytes)
    req = parse_feedback(doc, gateway.cfg.next_state_max_chars)
    check_owner(gateway, req.session_id, caller)
    turn = resolve_turn(gateway.sessions, req.session_id, req.turn)
    known = last_turn(gateway.sessions, req.session_id) is not None
    event = feedback_event(req, turn, caller)
    recorded = record(gateway, event)
    return JSONResponse(
        {
            "object": "feedback",
            "id": event.event_id,
            "session_id": req.session_id,
            "turn": turn,
            "kind": event.kind,
            "score": event.score,
            "recorded": recorded,
            "paired": True if known else "pending",
        },
        status_code=200 if known or not recorded else 202,
    )
