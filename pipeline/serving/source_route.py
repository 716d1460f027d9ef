"""``POST /v1/next_states/<source>``: what every next-state source shares (``sources.py``).

The caller is checked and rate-limited as for chat; the body is bounded by
``next_state_max_body_bytes`` (size and depth); the source turns it into next states or a
4xx. With API keys only a session's owner or an operator key posts for it (403
``session_forbidden``); each next state carries who posted it (``detail.key_id``: the voter,
``detail.user_id``: the key's user), whatever the source put there. A turn takes at most
``serve.next_states_per_turn`` of one source's next states (429 ``next_states_per_turn``) and a
post equal to one already recorded for the turn records nothing (``posted.py``; unless the
source's ``repeats_count``: a repeated gui action is an observation). Nothing is
recorded unless every event of the post can be. Response::

    {"object": "next_states", "source": "terminal", "recorded": true,
     "data": [{"id": "<event id>", "session_id": "s1", "turn": 3, "kind": "terminal",
               "score": -1.0}]}

with ``"repeat": true`` on each entry that was recorded before (its ``id`` is that one's).
"""

from __future__ import annotations

from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse

from .errors import ApiError
from .feedback import authorize, check_owner, last_turn, poster, record_posted
from .gateway_api import GatewayApi
from .sessions import _header_text
from .sources import NextStateSource, SourceRequest


async def handle_source(
    gateway: GatewayApi, sources: dict[str, NextStateSource], name: str, request: Request
) -> JSONResponse:
    caller = authorize(gateway, request)
    source = sources.get(name)
    if source is None:
        known = ", ".join(sorted(sources)) or "none ([serve] sources is empty)"
        raise ApiError(
            404,
            f"unknown next-state source {name[:64]!r}; enabled: {known}",
            param="source",
            code="source_not_found",
        )
    doc = await gateway.read_body(request, gateway.cfg.next_state_max_body_bytes)
    channel = f"source:{name}"
    sr = SourceRequest(
        body=doc,
        session_header=_header_text("X-Session-Id", request.headers.get("x-session-id")),
        key_id=caller.voter(name),
        max_chars=gateway.cfg.next_state_max_chars,
        last_turn=lambda sid: last_turn(gateway.sessions, sid),
        check_owner=lambda sid: check_owner(gateway, sid, caller),
        check_room=lambda sid, turn: gateway.posted.check_room(sid, turn, channel),
    )
    states = source.next_states(sr)
    if not states:
        raise ApiError(
            400, f"the {name} source found no next state in the body", code="no_next_state"
        )
    who = poster(caller, name)
    for sid in dict.fromkeys(ns.session_id for ns in states):  # a plug-in's own sessions too
        check_owner(gateway, sid, caller)
    states = [replace(ns, detail={**ns.detail, **who}) for ns in states]
    dedupe = not getattr(source, "repeats_count", False)
    _fresh, repeats, recorded = record_posted(gateway, channel, states, dedupe=dedupe)
    data = []
    for ns in states:
        entry = {
            "id": repeats.get(ns.event_id, ns.event_id),
            "session_id": ns.session_id,
            "turn": ns.turn,
            "kind": ns.kind,
            "score": ns.score,
        }
        if ns.event_id in repeats:
            entry["repeat"] = True
        data.append(entry)
    return JSONResponse(
        {"object": "next_states", "source": name, "recorded": recorded, "data": data}
    )
