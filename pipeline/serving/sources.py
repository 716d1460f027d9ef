"""Next-state sources by name (``[serve] sources``): what a harness posts to
``POST /v1/next_states/<name>``, turned into ``next_state`` events.

A source is one file: a class whose ``next_states(request)`` reads one bounded JSON body and
returns the events it means (or raises :class:`~pipeline.serving.errors.ApiError` for a 4xx),
registered here with its options model. The route (``source_route.py``) does what every
source needs the same way: the key check and rate limit of chat, the size and depth limit of
``next_state_max_body_bytes``, the 503 while events would be lost, and recording.

Light on purpose, like the judges' registry: the settings check ``serve.sources`` and
``serve.source_options`` when they load, so the built-ins are named by module and class and
imported only when a gateway builds them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from pipeline.registry import NoOptions, Registry


@dataclass(frozen=True)
class SourceRequest:
    """One post to a source: the parsed body and what the gateway knows around it."""

    body: Any  # parsed JSON, already bounded in size and depth
    session_header: str | None  # X-Session-Id, when the harness sends it there
    key_id: str  # the caller's API key id ("anonymous" without keys)
    max_chars: int  # longest text a next state may carry (serve.next_state_max_chars)
    last_turn: Callable[[str], int | None]  # the session's latest turn on this gateway


class NextStateSource(Protocol):
    """Turns a harness's payload into next states (``pipeline.events.NextState``)."""

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


register("terminal", _builtin("pipeline.serving.terminal_source", "TerminalSource"),
         TerminalOptions)
