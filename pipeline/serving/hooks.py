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
  gateway forgets the session's turn counter.

The session is ``session_id`` in the payload, else the ``X-Session-Id`` header, else
``conversation_id``: the harness must send the same id with its chat requests. The response
body is what Cursor reads from a hook's stdout (``{"continue": true}`` for
``beforeSubmitPrompt``, ``{}`` otherwise), so a hook command can print it unchanged; what was
recorded is in the headers ``X-Liverl-Recorded`` (event ids, comma-separated, empty for none),
``X-Session-Id`` and ``X-Liverl-Turn``. Hooks are authenticated and rate-limited like chat
completions; an unknown event is a 404, a bad payload a 4xx, and neither records anything.
"""

from __future__ import annotations

from collections.abc import Callable
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
    check_text,
    last_turn,
    record,
    validated,
)
from .gateway_api import GatewayApi
from .responses import header_safe
from .sessions import MAX_ID_CHARS, _header_text


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


def before_submit_prompt(
    gateway: GatewayApi, sid: str, p: HookPayload
) -> tuple[dict[str, Any], events.NextState | None]:
    if p.prompt is None:
        raise ApiError(422, "beforeSubmitPrompt needs a prompt", param="prompt",
                       code="invalid_value")
    check_text(p.prompt, gateway.cfg.next_state_max_chars, "prompt")
    turn = last_turn(gateway.sessions, sid)
    if turn is None:
        return {"continue": True}, None  # the session's first prompt follows no turn
    event = events.NextState(
        event_id=events.new_event_id(),
        producer=PRODUCER,
        session_id=sid,
        turn=turn,
        kind="user_reply",
        role="user",
        content=p.prompt,
        source="hook:beforeSubmitPrompt",
        detail=_origin("beforeSubmitPrompt", p),
    )
    return {"continue": True}, event


def after_agent_response(
    gateway: GatewayApi, sid: str, p: HookPayload
) -> tuple[dict[str, Any], events.NextState | None]:
    return {}, None  # the answer is already the turn's interaction (see the module doc)


def stop(
    gateway: GatewayApi, sid: str, p: HookPayload
) -> tuple[dict[str, Any], events.NextState | None]:
    turn = last_turn(gateway.sessions, sid)
    if turn is None:
        return {}, None  # nothing open to close
    detail = {**_origin("stop", p), "reason": "hook_stop"}
    if p.status is not None:
        detail["status"] = p.status
    if p.loop_count is not None:
        detail["loop_count"] = p.loop_count
    score = gateway.cfg.hook_stop_scores.get(p.status) if p.status is not None else None
    event = events.NextState(
        event_id=events.new_event_id(),
        producer=PRODUCER,
        session_id=sid,
        turn=turn,
        kind="session_end",
        content=p.status or "",
        source="hook:stop",
        score=score,
        detail=detail,
    )
    return {}, event


Handler = Callable[
    ["GatewayApi", str, HookPayload], tuple[dict[str, Any], events.NextState | None]
]
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
    authorize(gateway, request)
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
    body, ns = handler(gateway, sid, payload)
    recorded = record(gateway, ns) if ns is not None else False
    if event == "stop":
        gateway.close_session(sid)

    headers = {
        "X-Session-Id": header_safe(sid),
        "X-Liverl-Recorded": ns.event_id if ns is not None and recorded else "",
    }
    if ns is not None:
        headers["X-Liverl-Turn"] = str(ns.turn)
    return JSONResponse(body, headers=headers)
