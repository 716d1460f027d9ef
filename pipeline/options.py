"""Command-line options override the settings file and environment only when given."""

from __future__ import annotations

from typing import Any, TypeVar

import click
from click.core import ParameterSource
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def explicit(ctx: click.Context, options: dict[str, Any]) -> dict[str, Any]:
    """The options the user actually typed (not click defaults)."""
    return {
        name: value
        for name, value in options.items()
        if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)
    }


def merged(section: M, ctx: click.Context, options: dict[str, Any], **forced: Any) -> M:
    """``section`` (from TOML/env) updated with explicit options and ``forced`` values,
    validated again so a bad combination still fails with the model's message."""
    values = {**section.model_dump(), **explicit(ctx, options), **forced}
    return type(section)(**values)
