"""Plug-ins by name, each with its own validated options: one pattern for judges and methods.

A plug-in module registers itself on import (``REGISTRY.register("name", factory, Options)``);
``load_plugins`` imports the modules a settings file names (``plugins = ["my.module"]``), so a
new judge or method is one file plus its test. Each plug-in owns its options: a pydantic model
that validates the ``<section>.<kind>_options`` table, so a typo is an error naming the key,
not a silently ignored setting.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

T = TypeVar("T")


class NoOptions(BaseModel):
    """A plug-in without options: any key given is refused."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    item: T  # what was registered: a judge's factory, a training method
    options: type[BaseModel]


class Registry(Generic[T]):
    """``name -> (item, options model)`` for one kind of plug-in (``kind``: "judge")."""

    def __init__(self, kind: str, setting: str) -> None:
        self.kind = kind
        self.setting = setting  # where the name is set, for errors: "processors.judge"
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, item: T, options: type[BaseModel] = NoOptions) -> None:
        """Plug in ``item`` as ``name``; a later registration replaces it."""
        self._entries[name] = Entry(name, item, options)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names())} "
                f"({self.setting}; a plug-in module registers more: plugins = [...])"
            ) from None

    def options(
        self, name: str, raw: Mapping[str, Any] | BaseModel | None, where: str | None = None
    ) -> BaseModel:
        """``raw`` validated by ``name``'s options model; errors name the offending key under
        ``where`` (default ``<setting>_options``: one active plug-in, one table)."""
        entry = self.get(name)
        if isinstance(raw, entry.options):
            return raw
        try:
            return entry.options.model_validate(dict(raw or {}))
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            key = ".".join(str(p) for p in err["loc"])
            table = where or f"{self.setting}_options"
            raise ValueError(
                f"{table}.{key}: {err['msg']} ({self.kind} {name!r} takes "
                f"{', '.join(entry.options.model_fields) or 'no options'})"
            ) from None


def load_plugins(modules: Sequence[str], section: str) -> None:
    """Import the modules that register plug-ins (``[<section>] plugins``)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(
                f"{section} plugin {module!r} cannot be imported: {exc} ({section}.plugins)"
            ) from None
