"""JSON answers: rendered by orjson, optionally followed by work that must not delay them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import orjson
from fastapi.responses import JSONResponse


class JsonResponse(JSONResponse):
    """A JSON answer rendered by orjson (Starlette's stdlib ``json.dumps`` costs more per
    answer than the rest of building it)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class AfterSend(JsonResponse):
    """A JSON answer that runs ``after`` once it is sent, or once sending failed (a client
    gone at the last byte): unlike Starlette's background tasks, which a failed send skips,
    ``after`` always runs, so work handed to it (recording a turn) cannot be lost that way."""

    def __init__(self, content: Any, *, after: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.after = after

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.after()


def header_safe(value: str) -> str:
    """HTTP header values are latin-1: a body-supplied session id may not be (found by the
    fuzzer as a 500), so echo it percent-encoded when it is not plain printable ASCII."""
    if value.isascii() and value.isprintable():
        return value
    return quote(value, safe="")
