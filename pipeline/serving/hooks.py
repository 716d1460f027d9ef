"""``POST /v1/hooks/<event>``: agent-harness hooks (Cursor's shape) as next states.

A harness runs a small command per hook that pipes the hook's JSON payload here (see
docs/hooks.md). Payloads follow Cursor's agent hooks: common fields ``hook_event_name``,
``conversation_id``, ``generation_id`` (others, such as ``user_email`` or
``workspace_roots``, are accepted and never recorded), plus per event:

- ``beforeSubmitPrompt`` ``{"prompt": ...}``: the user's next prompt is the next state of the
  session's last turn (``user_reply``). The first prompt of a session has no turn before it:
  nothing is recorded.
- ``afterAgentResponse`` ``{"text": ...}``: nothing is recorded. The answer is the action,
  not evidence about it, and the gateway already recorded it as the turn's interaction; a
  marker event would only be one more next state for the judges to score as neutral.
- ``stop`` ``{"status": "completed" | "aborted" | "error", "loop_count": n}``: closes the
  session like ``X-Session-Done``: a ``session_end`` next state for the last turn, scored by
  ``hook_stop_scores`` when the status is listed (default: error and aborted -> -1), and the
  gateway forgets the session's turn counter. Any other status (one not documented nor in
  ``hook_stop_scores``), and a missing or null one, is a 422 that closes nothing: a typo
  must not end a session, nor keep the genuine ``stop`` after it from being recorded.

The session is ``session_id`` in the payload, else the ``X-Session-Id`` header, else
``conversation_id``: the harness must send the same id with its chat requests. The response
body is what Cursor reads from a hook's stdout (``{"continue": true}`` for
``beforeSubmitPrompt``, ``{}`` otherwise) plus a ``liverl`` object Cursor ignores, so a hook
command can print it unchanged: ``{"recorded": true, "event_id", "turn"}``, or
``{"recorded": false, "reason"}`` saying why nothing was. The headers say the same:
``X-Liverl-Recorded`` (the event id, empty for none), ``X-Session-Id`` and ``X-Liverl-Turn``.
Hooks are authenticated and rate-limited like chat completions; an unknown event is a 404, a
bad payload a 4xx, and neither records anything. With API keys only the session's owner or an
operator key may post its hooks (403 ``session_forbidden``, nothing recorded or closed). What
a hook records carries who posted it (``detail.key_id``, ``detail.user_id``) and counts
against the turn's cap of ``serve.next_states_per_turn`` per hook event (429 beyond); one equal
to a next state already recorded for the turn (the same prompt again) records nothing
(``posted.py``).

A hook posted again with the same ``generation_id`` (a harness retry, a replayed transcript)
gets the first answer (``"replay": true``, header ``X-Liverl-Replay: true``) and records and
closes nothing: the gateway remembers the last ``hook_replay_entries`` answers. The event id
derives from (event, session, ``generation_id``), so a replay this gateway no longer
remembers (a restart) records the same id again, which consumers deduplicate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pipeline import events

from .errors import ApiError
from .feedback import (
    MAX_TURN,
    PRODUCER,
    authorize,
    check_owner,
    check_text,
    last_turn,
    poster,
    record_posted,
    validated,
)
from .gateway_api import GatewayApi
from .hook_replays import HookAnswer
from .sessions import MAX_ID_CHARS, _header_text

STOP_STATUSES = ("completed", "aborted", "error")  # Cursor's documented stop statuses
HOOK_IDS = "hook-v1"  # the version of the derived event ids below: change it, ids change


def hook_event_id(event: str, sid: str, p: HookPayload) -> str:
    """Derived from the harness's ``generation_id`` when there is one (a replay gets the same
    id, whichever gateway or restart records it), else random."""
    if p.generation_id is None:
        return events.new_event_id()
    return events.derive_event_id("next_state", [], HOOK_IDS, "hook", event, sid, p.generation_id)


def no_turn(sid: str, what: str) -> str:
    return (
        f"session {sid!r} has no open turn on this gateway ({what}, or a session this gateway "
        "never saw or already closed: send the same X-Session-Id with the chat requests)"
    )


class HookPayload(BaseModel):
    """The fields of a hook payload that liverl reads; other fields are allowed, not kept."""

    model_config = ConfigDict(extra="allow")

    hook_event_name: str | None = Field(default=None, max_length=64)
    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    conversation_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    generation_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    prompt: str | None = None
    text: str | None = None
    status: str | None = Field(default=None, max_length=64)
    loop_count: int | None = Field(default=None, ge=0, le=MAX_TURN, strict=True)


def _origin(event: str, p: HookPayload) -> dict[str, Any]:
    detail: dict[str, Any] = {"hook": event}
    for name in ("conversation_id", "generation_id"):
        if getattr(p, name) is not None:
            detail[name] = getattr(p, name)
    return detail


def before_submit_prompt(gateway: GatewayApi, sid: str, p: HookPayload) -> HookAnswer:
    body = {"continue": True}
    if p.prompt is None:
        raise ApiError(
            422, "beforeSubmitPrompt needs a prompt", param="prompt", code="invalid_value"
        )
    check_text(p.prompt, gateway.cfg.next_state_max_chars, "prompt")
    turn = last_turn(gateway.sessions, sid)
    if turn is None:  # the session's first prompt follows no turn
        return HookAnswer(body, sid, reason=no_turn(sid, "its first prompt follows no turn"))
    event = events.NextState(
        event_id=hook_event_id("beforeSubmitPrompt", sid, p),
        producer=PRODUCER,
        session_id=sid,
        turn=turn,
        kind="user_reply",
        role="user",
        content=p.prompt,
        source="hook:beforeSubmitPrompt",
        detail=_origin("beforeSubmitPrompt", p),
    )
    return HookAnswer(body, sid, event)


def after_agent_response(gateway: GatewayApi, sid: str, p: HookPayload) -> HookAnswer:
    # the answer is already the turn's interaction (see the module doc)
    return HookAnswer(
        {},
        sid,
        reason="afterAgentResponse records nothing: the answer is already the turn's interaction",
    )


def stop(gateway: GatewayApi, sid: str, p: HookPayload) -> HookAnswer:
    scores = gateway.cfg.hook_stop_scores
    if p.status is None or (p.status not in STOP_STATUSES and p.status not in scores):
        known = ", ".join(dict.fromkeys([*STOP_STATUSES, *scores]))
        what = "a stop needs a status" if p.status is None else f"unknown stop status {p.status!r}"
        raise ApiError(
            422,
            f"{what}; known: {known} (nothing recorded or closed)",
            param="status",
            code="invalid_value",
        )
    turn = last_turn(gateway.sessions, sid)
    if turn is None:
        return HookAnswer({}, sid, reason=no_turn(sid, "nothing to close"))
    detail = {**_origin("stop", p), "reason": "hook_stop", "status": p.status}
    if p.loop_count is not None:
        detail["loop_count"] = p.loop_count
    event = events.NextState(
        event_id=hook_event_id("stop", sid, p),
        producer=PRODUCER,
        session_id=sid,
        turn=turn,
        kind="session_end",
        content=p.status,
        source="hook:stop",
        score=scores.get(p.status),
        detail=detail,
    )
    return HookAnswer({}, sid, event)


Handler = Callable[["GatewayApi", str, HookPayload], HookAnswer]
HOOKS: dict[str, Handler] = {
    "beforeSubmitPrompt": before_submit_prompt,
    "afterAgentResponse": after_agent_response,
    "stop": stop,
}


def session_of(request: Request, p: HookPayload) -> str:
    sid = p.session_id or _header_text("X-Session-Id", request.headers.get("x-session-id"))
    sid = sid or p.conversation_id
    if not sid:
        raise ApiError(
            400,
            "a hook needs its session: session_id or conversation_id in the payload, or the "
            "X-Session-Id header",
            param="session_id",
        )
    return sid


async def handle_hook(gateway: GatewayApi, event: str, request: Request) -> JSONResponse:
    caller = authorize(gateway, request)
    handler = HOOKS.get(event)
    if handler is None:
        raise ApiError(
            404,
            f"unknown hook event {event[:64]!r}; known: {', '.join(HOOKS)}",
            param="event",
            code="hook_not_found",
        )
    doc = await gateway.read_body(request, gateway.cfg.next_state_max_body_bytes)
    payload = validated(HookPayload, doc)
    if payload.hook_event_name not in (None, event):
        raise ApiError(
            400,
            f"hook_event_name {payload.hook_event_name!r} does not match the path's {event!r}",
            param="hook_event_name",
        )
    sid = session_of(request, payload)
    check_owner(gateway, sid, caller)
    key = None if payload.generation_id is None else (sid, event, payload.generation_id)
    if key is not None and (seen := gateway.hook_replays.get(key)) is not None:
        return replace(seen, replay=True).response()
    answer = handler(gateway, sid, payload)
    if answer.event is not None:
        ns = replace(answer.event, detail={**answer.event.detail, **poster(caller, "hooks")})
        _fresh, repeats, recorded = record_posted(gateway, f"hook:{event}", [ns])
        if repeats:
            answer = replace(
                answer,
                event=None,
                reason=f"equal to next state {repeats[ns.event_id]} already recorded for this turn",
            )
        elif not recorded:
            answer = replace(answer, event=None, reason="recording is off (record: false)")
        else:
            answer = replace(answer, event=ns)
    if event == "stop":
        gateway.close_session(sid)
    if key is not None:
        gateway.hook_replays.put(key, answer)
    return answer.response()
