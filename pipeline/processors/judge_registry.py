"""Judges by name (``[processors] judge``), each with its options model.

Light on purpose: the settings check ``processors.judge`` and its options when they load, for
every command, so this module imports no judge. The built-in judges are named by module and
class and imported only when one is built; a plug-in module (``[processors] plugins``) calls
:func:`register` on import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.registry import NoOptions, Registry


class LlmJudgeOptions(BaseModel):
    """Options of the "llm" judge (``[processors] llm_*``, or ``judge_options``); their names
    are ``LlmJudge``'s keyword parameters."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = "judge"
    api_key: str | None = None
    votes: int = Field(default=3, ge=1)
    timeout_s: float = Field(default=30.0, gt=0)
    retries: int = Field(default=2, ge=0)
    concurrency: int = Field(default=8, ge=1)
    hints: bool = True


# validated options -> the judge (a ``pipeline.processors.judges.Judge``; typed there, in
# make_judge, since this module must not import that one)
JudgeFactory = Callable[[Any], Any]
JUDGES: Registry[JudgeFactory] = Registry("judge", "processors.judge")


def register(name: str, factory: JudgeFactory, options: type[BaseModel] = NoOptions) -> None:
    """Plug in a judge: ``factory(options)`` builds it from its validated ``options``."""
    JUDGES.register(name, factory, options)


def _builtin(cls_name: str, keywords: bool) -> JudgeFactory:
    """A factory for ``pipeline.processors.judges.<cls_name>``, imported when called."""

    def build(options: BaseModel) -> Any:
        cls = getattr(importlib.import_module("pipeline.processors.judges"), cls_name)
        return cls(**options.model_dump()) if keywords else cls()

    return build


register("replies", _builtin("ReplyJudge", keywords=False))
register("rules", _builtin("RuleJudge", keywords=False))
register("llm", _builtin("LlmJudge", keywords=True), LlmJudgeOptions)
