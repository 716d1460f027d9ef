"""The accepted subset of OpenAI's chat-completions request, validated strictly enough that a
bad request is a 4xx with the offending parameter named, never a crash later."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ApiError


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def to_record(self) -> dict[str, Any]:
        """As recorded in the interaction event (the schema requires `content`)."""
        out = self.model_dump(exclude_none=True)
        out.setdefault("content", None)
        return out


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # liverl fallbacks for clients that cannot set headers
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    turn_type: Literal["main", "side"] | None = None
    session_done: bool | None = None
    train: bool | None = None
    group_id: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        if isinstance(v, list) and any(not s for s in v) or v == "":
            raise ValueError("stop sequences must be non-empty")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in v or []:
            fn = tool.get("function")
            if (
                tool.get("type") != "function"
                or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
            ):
                raise ValueError("each tool must be {'type': 'function', 'function': {'name'}}")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def check_depth(doc: Any, limit: int) -> None:
    """400 if objects/arrays nest deeper than ``limit`` (iterative: no recursion to exhaust).

    Deep input is refused before it is served because the recorded event could not be
    encoded (orjson stops at 254 levels), and bounded well below that because no chat request
    needs it."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise ApiError(
                400,
                f"request JSON nests deeper than {limit} levels",
                code="json_too_deep",
            )
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))


M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], doc: Any) -> M:
    """``doc`` as ``model``, or the OpenAI-style 4xx naming the offending field."""
    if not isinstance(doc, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise ApiError(
            422, f"invalid value for {param}: {err['msg']}", param=param, code="invalid_value"
        ) from None


def parse_request(doc: Any) -> ChatRequest:
    return validated(ChatRequest, doc)
