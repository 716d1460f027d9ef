"""Command-line options override the settings file and environment only when given.

The one way an option reaches settings (docs/architecture.md, Settings): the option is
declared with :func:`field_option`, named after its settings field, so its default (shown
in ``--help``) and its choices are read from the model and stated nowhere else; the command
then builds its section with :func:`merged`, which takes only the options the user typed
over the section read from the TOML file and ``LIVERL_*`` environment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar, get_args, get_origin

import click
from click.core import ParameterSource
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)
FC = TypeVar("FC", bound=Callable[..., Any])


def field_option(
    model: type[BaseModel], field: str, *param_decls: str, **attrs: Any
) -> Callable[[FC], FC]:
    """``click.option(*param_decls, field, ...)`` for ``model.field``: the parameter is named
    after the field (so :func:`merged` maps it), its default is the field's default and a
    ``Literal`` field's values are its choices, unless ``attrs`` says otherwise. A negating
    flag (``--no-record`` for ``record``) is ``is_flag=True, flag_value=False``."""
    info = model.model_fields[field]
    attrs.setdefault("default", info.get_default(call_default_factory=True))
    if attrs.get("is_flag") and attrs.get("flag_value") is False:
        attrs.setdefault("show_default", False)  # "--no-x [default: True]" would read wrongly
    elif attrs["default"] is not None:
        attrs.setdefault("show_default", True)
    if "type" not in attrs and get_origin(info.annotation) is Literal:
        attrs["type"] = click.Choice([str(v) for v in get_args(info.annotation)])
    return click.option(*param_decls, field, **attrs)


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
