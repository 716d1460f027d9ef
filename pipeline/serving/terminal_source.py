"""The "terminal" next-state source: a harness posts a command's exit code and output.

For a sandbox that runs an agent's commands but cannot reach Kafka (``liverl record-outcome``
produces to Kafka itself): ``POST /v1/next_states/terminal`` with::

    {"session_id": "s1", "turn": 3 | "last", "command": "pytest -q", "exit_code": 1,
     "output": "2 failed, 10 passed"}

One ``terminal`` next state of that turn: ``exit_code`` kept, ``score`` +1 when the code is
one of ``passing_exit_codes`` (default ``[0]``), else -1, the output as its content; no score
for exit 124, 126, 127 or a read-only command (``ls``, ``git status``: no outcome).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline import __version__, events
from pipeline.processors.verification import exit_vote

from .errors import ApiError
from .protocol import validated
from .sessions import MAX_ID_CHARS
from .sources import SourceRequest, TerminalOptions, session_turn

MAX_TURN = 2**31 - 1
MAX_COMMAND_CHARS = 1000
PRODUCER = events.Producer(component="gateway", version=__version__)


class TerminalPost(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    turn: Annotated[int, Field(strict=True, ge=0, le=MAX_TURN)] | Literal["last"] = "last"
    command: str = Field(default="", max_length=MAX_COMMAND_CHARS)
    exit_code: Annotated[int, Field(strict=True, ge=-(2**31), le=2**31 - 1)]
    output: str = ""


class TerminalSource:
    def __init__(self, options: TerminalOptions) -> None:
        self.options = options

    def next_states(self, request: SourceRequest) -> list[Any]:
        post = validated(TerminalPost, request.body)
        if len(post.output) > request.max_chars:
            raise ApiError(
                400,
                f"output is longer than {request.max_chars} characters",
                param="output",
                code="text_too_long",
            )
        sid, turn = session_turn(request, post.session_id, post.turn)
        passed = post.exit_code in self.options.passing_exit_codes
        # No score where the code says nothing: timed out, not runnable, or a read-only
        # command (processors/verification.py), whatever passing_exit_codes says.
        says = exit_vote(post.exit_code, post.command or None) is not None
        return [
            events.NextState(
                event_id=events.new_event_id(),
                producer=PRODUCER,
                session_id=sid,
                turn=turn,
                kind="terminal",
                role="tool",
                content=post.output,
                exit_code=post.exit_code,
                score=(1.0 if passed else -1.0) if says else None,
                source=self.options.source,
                detail={"command": post.command, "key_id": request.key_id},
            )
        ]
