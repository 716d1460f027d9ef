"""Next-state sources by name (``[serve] sources``): what a harness posts to
``POST /v1/next_states/<name>``, turned into ``next_state`` events.

A source is one file: a class whose ``next_states(request)`` reads one bounded JSON body and
returns the events it means (or raises :class:`~pipeline.serving.errors.ApiError` for a 4xx),
registered here with its options model. The route (``source_route.py``) does what every
source needs the same way: the key check and rate limit of chat, the size and depth limit of
``next_state_max_body_bytes``, that only a session's owner (or an operator) posts for it, the
per-turn cap and repeats (``posted.py``), who posted (``detail.key_id``, ``detail.user_id``),
the 503 while events would be lost, and recording. A source that resolves its session with
:func:`session_turn` gets the owner and cap checks before it keeps any state of its own.

Light on purpose, like the judges' registry: the settings check ``serve.sources`` and
``serve.source_options`` when they load, so the built-ins are named by module and class and
imported only when a gateway builds them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from pipeline.registry import NoOptions, Registry


@dataclass(frozen=True)
class SourceRequest:
    """One post to a source: the parsed body and what the gateway knows around it."""

    body: Any  # parsed JSON, already bounded in size and depth
    session_header: str | None  # X-Session-Id, when the harness sends it there
    key_id: str  # the voter (auth.py: Caller.voter), the route sets it as detail.key_id
    max_chars: int  # longest text a next state may carry (serve.next_state_max_chars)
    last_turn: Callable[[str], int | None]  # the session's latest turn on this gateway
    # 403 unless the caller may post for the session; 429 when the turn is full
    check_owner: Callable[[str], None] = lambda _sid: None
    check_room: Callable[[str, int], None] = lambda _sid, _turn: None


def session_turn(
    request: SourceRequest, session_id: str | None, turn: int | Literal["last"]
) -> tuple[str, int]:
    """The post's session (its ``session_id``, else the header) and turn (a number, or the
    session's last one on this gateway); a 400 when either is unknown, a 403 when the caller
    may not post for the session, a 429 when the turn has its fill of this source's."""
    from .errors import ApiError  # light module: the settings import this one

    sid = session_id or request.session_header
    if not sid:
        raise ApiError(
            400,
            "give session_id (or the X-Session-Id header)",
            param="session_id",
            code="missing_session",
        )
    request.check_owner(sid)
    last = request.last_turn(sid)
    if turn == "last" and last is None:
        raise ApiError(
            400,
            f"session {sid!r} has no open turn on this gateway; pass the turn number",
            param="session_id",
            code="session_not_found",
        )
    number = last if turn == "last" else turn
    assert number is not None
    if last is not None and number > last:
        raise ApiError(
            400,
            f"turn {number} of session {sid!r} has not been recorded (last is {last})",
            param="turn",
            code="turn_not_found",
        )
    request.check_room(sid, number)
    return sid, number


class NextStateSource(Protocol):
    """Turns a harness's payload into next states (``pipeline.events.NextState``). A source
    whose equal posts are distinct observations sets ``repeats_count = True`` (the route then
    records each, within the turn's cap, instead of answering it as the first one)."""

    def next_states(self, request: SourceRequest) -> list[Any]: ...


# validated options -> the source
SourceFactory = Callable[[Any], NextStateSource]
SOURCES: Registry[SourceFactory] = Registry("next-state source", "serve.sources")


def register(name: str, factory: SourceFactory, options: type[BaseModel] = NoOptions) -> None:
    """Plug in a source: ``factory(options)`` builds it from its validated ``options``; it
    answers at ``POST /v1/next_states/<name>`` once ``[serve] sources`` lists it."""
    SOURCES.register(name, factory, options)


def build_sources(
    names: list[str], options: Mapping[str, Mapping[str, Any]]
) -> dict[str, NextStateSource]:
    """The enabled sources, each built from its ``[serve.source_options.<name>]`` table."""
    return {
        n: SOURCES.get(n).item(SOURCES.options(n, options.get(n), f"serve.source_options.{n}"))
        for n in names
    }


def _builtin(module: str, cls_name: str) -> SourceFactory:
    def build(options: BaseModel) -> NextStateSource:
        cls: Callable[[BaseModel], NextStateSource] = getattr(
            importlib.import_module(module), cls_name
        )
        return cls(options)

    return build


class TerminalOptions(BaseModel):
    """Options of the "terminal" source (``[serve.source_options.terminal]``)."""

    model_config = {"extra": "forbid"}

    passing_exit_codes: list[int] = [0]
    source: str = "terminal"  # the events' ``source`` field


class GuiOptions(BaseModel):
    """Options of the "gui" source (``[serve.source_options.gui]``): the limits a posted
    accessibility tree must keep (400 beyond; the body limit still applies first)."""

    model_config = {"extra": "forbid"}

    max_tree_bytes: int = Field(default=256 * 1024, ge=1)
    max_nodes: int = Field(default=5000, ge=1)
    max_depth: int = Field(default=24, ge=1)  # the body's JSON depth limit (64) allows ~31
    max_string_chars: int = Field(default=1000, ge=1)  # role, name, value, id of a node
    max_listed: int = Field(default=50, ge=1)  # entries kept per diff list in the event
    max_sessions: int = Field(default=256, ge=1)  # previous trees kept (LRU)
    source: str = "gui"


register(
    "terminal", _builtin("pipeline.serving.terminal_source", "TerminalSource"), TerminalOptions
)
register("gui", _builtin("pipeline.serving.gui_source", "GuiSource"), GuiOptions)
