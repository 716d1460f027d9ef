"""What the hook routes answered, remembered so a replayed hook gets the same answer.

Apart from ``hooks.py`` so that the gateway (``gateway_api.py``) can hold the memory without
an import cycle through the routes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from pipeline import events

from .responses import header_safe

__all__ = ["HookAnswer", "HookReplays"]


@dataclass(frozen=True, slots=True)
class HookAnswer:
    """What a hook answered: the body for the harness, and what was recorded (or why not)."""

    body: dict[str, Any]
    session_id: str
    event: events.NextState | None = None
    reason: str | None = None  # why nothing was recorded
    replay: bool = False

    def response(self) -> JSONResponse:
        info: dict[str, Any] = {"recorded": self.event is not None}
        if self.event is not None:
            info |= {"event_id": self.event.event_id, "turn": self.event.turn}
        else:
            info["reason"] = self.reason
        headers = {
            "X-Session-Id": header_safe(self.session_id),
            "X-Liverl-Recorded": self.event.event_id if self.event is not None else "",
        }
        if self.event is not None:
            headers["X-Liverl-Turn"] = str(self.event.turn)
        if self.replay:
            info["replay"] = True
            headers["X-Liverl-Replay"] = "true"
        return JSONResponse({**self.body, "liverl": info}, headers=headers)


class HookReplays:
    """The answers to recent hooks by (session, event, generation_id), at most ``size``, the
    least recently used forgotten first: a harness that posts a hook twice must not record it
    twice (three ``beforeSubmitPrompt`` replays were three user replies)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._answers: OrderedDict[tuple[str, str, str], HookAnswer] = OrderedDict()

    def get(self, key: tuple[str, str, str]) -> HookAnswer | None:
        answer = self._answers.get(key)
        if answer is not None:
            self._answers.move_to_end(key)
        return answer

    def put(self, key: tuple[str, str, str], answer: HookAnswer) -> None:
        if self.size <= 0:
            return
        self._answers[key] = answer
        self._answers.move_to_end(key)
        while len(self._answers) > self.size:
            self._answers.popitem(last=False)

    def __len__(self) -> int:
        return len(self._answers)
