"""OpenAI-style errors: every failure leaves as ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import JSONResponse


class JsonResponse(JSONResponse):
    """A JSON answer rendered by orjson (Starlette's stdlib ``json.dumps`` costs more per
    answer than the rest of building it)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JsonResponse(self.body(), status_code=self.status, headers=self.headers)
