"""``POST /v1/next_states/<source>``: what every next-state source shares (``sources.py``).

The caller is checked and rate-limited as for chat; the body is bounded by
``next_state_max_body_bytes`` (size and depth); the source turns it into next states or a
4xx, and nothing is recorded unless every event of the post can be. Response::

    {"object": "next_states", "source": "terminal", "recorded": true,
     "data": [{"id": "<event id>", "session_id": "s1", "turn": 3, "kind": "terminal",
               "score": -1.0}]}
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from .errors import ApiError
from .feedback import authorize, last_turn, record
from .gateway_api import GatewayApi
from .sessions import _header_text
from .sources import NextStateSource, SourceRequest


async def handle_source(
    gateway: GatewayApi, sources: dict[str, NextStateSource], name: str, request: Request
) -> JSONResponse:
    key_id = authorize(gateway, request)
    source = sources.get(name)
    if source is None:
        known = ", ".join(sorted(sources)) or "none ([serve] sources is empty)"
        raise ApiError(404, f"unknown next-state source {name[:64]!r}; enabled: {known}",
                       param="source", code="source_not_found")
    doc = await gateway.read_body(request, gateway.cfg.next_state_max_body_bytes)
    sr = SourceRequest(
        body=doc,
        session_header=_header_text("X-Session-Id", request.headers.get("x-session-id")),
        key_id=key_id,
        max_chars=gateway.cfg.next_state_max_chars,
        last_turn=lambda sid: last_turn(gateway.sessions, sid),
    )
    states = source.next_states(sr)
    if not states:
        raise ApiError(400, f"the {name} source found no next state in the body",
                       code="no_next_state")
    recorded = [record(gateway, ns) for ns in states]
    data = [{"id": ns.event_id, "session_id": ns.session_id, "turn": ns.turn,
             "kind": ns.kind, "score": ns.score} for ns in states]
    return JSONResponse(
        {"object": "next_states", "source": name, "recorded": all(recorded), "data": data}
    )
