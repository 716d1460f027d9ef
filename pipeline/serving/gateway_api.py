"""What the feedback and hook routes need from the gateway.

The routes take this interface, not :class:`~pipeline.serving.app.Gateway`: the app imports
the routes, and nothing the routes import leads back to the app.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import Request

from .auth import Authenticator, RateLimiter
from .hook_replays import HookReplays
from .metrics import Metrics
from .posted import PostedStates
from .recorder import Recorder
from .sessions import Sessions
from .settings import ServeSettings


class GatewayApi(Protocol):
    cfg: ServeSettings
    auth: Authenticator
    limiter: RateLimiter
    feedback_limiter: RateLimiter  # /v1/feedback only, after ``limiter``
    sessions: Sessions
    recorder: Recorder | None
    hook_replays: HookReplays
    posted: PostedStates  # next states posted per turn (sources, hooks): cap, no repeats
    metrics: Metrics

    def recording_problem(self) -> str | None:
        """Why a turn recorded now would be lost (None: recording works or is off)."""
        ...

    async def read_body(self, request: Request, limit: int | None = None) -> Any:
        """The parsed body, bounded in size, time and depth."""
        ...

    def close_session(self, session_id: str) -> None: ...
