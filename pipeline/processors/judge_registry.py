"""Judges by name (``[processors] judge``), each with its options model.

Light on purpose: the settings check ``processors.judge`` and its options when they load, for
every command, so this module imports no judge. The built-in judges are named by module and
class and imported only when one is built; a plug-in module (``[processors] plugins``) calls
:func:`register` on import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

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


class PanelOptions(BaseModel):
    """Options of the "panel" judge (``pipeline/processors/panel_judge.py``): its members,
    their fixed weights, a ``liverl judges compare --format json`` file whose consistencies
    weigh them instead, and ``live``: weigh them by the consistency topic as it moves."""

    model_config = ConfigDict(extra="forbid")

    judges: list[str] = Field(min_length=1, max_length=16)
    weights: dict[str, float] = Field(default_factory=dict)
    consistency_file: Path | None = None
    # Weight by the consistency topic as `liverl judges watch` keeps it (the worker reads it).
    live: bool = False
    member_options: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("judges")
    @classmethod
    def _members(cls, names: list[str]) -> list[str]:
        if "panel" in names:
            raise ValueError("a panel cannot hold a panel")
        if len(set(names)) != len(names):
            raise ValueError(f"a judge is named twice in {names}")
        unknown = [n for n in names if n not in JUDGES]
        if unknown:
            raise ValueError(f"unknown judge {unknown[0]!r} (known: {', '.join(JUDGES.names())})")
        return names


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


def _answer_reader(cls_name: str) -> JudgeFactory:
    def build(options: BaseModel) -> Any:
        return getattr(importlib.import_module("pipeline.processors.answer_judges"), cls_name)()

    return build


# Judges of the answer alone (the task pool's default voters; answer_judges.py).
register("answer", _answer_reader("AnswerJudge"))
register("on_topic", _answer_reader("OnTopicJudge"))


def _panel(options: BaseModel) -> Any:
    return importlib.import_module("pipeline.processors.panel_judge").PanelJudge(options)


register("panel", _panel, PanelOptions)
