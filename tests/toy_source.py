"""A next-state source defined outside the library (``[serve] plugins = ["tests.toy_source"]``).

A CI system posts ``{"session_id": ..., "turn": n, "status": "success" | "failure"}``; each
becomes a ``test_result`` next state scored +1, or ``failure_score`` on a failure. It exists to
prove that a source is one module owning its options: nothing in ``pipeline/`` names it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline import events
from pipeline.serving.protocol import validated
from pipeline.serving.sources import SourceRequest, register


class CiOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    failure_score: float = Field(default=-1.0, ge=-1, le=0)


class CiPost(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(min_length=1, max_length=256)
    turn: int = Field(ge=0)
    status: Literal["success", "failure"]


class CiSource:
    def __init__(self, options: CiOptions) -> None:
        self.options = options

    def next_states(self, request: SourceRequest) -> list[Any]:
        post = validated(CiPost, request.body)
        ok = post.status == "success"
        return [
            events.NextState(
                event_id=events.new_event_id(),
                producer=events.Producer(component="toy-ci", version="1"),
                session_id=post.session_id,
                turn=post.turn,
                kind="test_result",
                content=post.status,
                exit_code=0 if ok else 1,
                score=1.0 if ok else self.options.failure_score,
                source="toy-ci",
            )
        ]


register("toy-ci", CiSource, CiOptions)
