"""OpenAI-style errors: every failure leaves as ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from pipeline.errors import LiverlError

from .responses import JsonResponse


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


class ManifestError(LiverlError, ValueError):
    """Weight files do not match their manifest."""


class SGLangError(LiverlError, RuntimeError):
    """The SGLang server failed or answered something we cannot use."""
