"""Judges with known flaws, to check that consistency weighting finds them (RLAnything).

A reward model's usual failures, made deterministic: ``verbose`` prefers long answers (the
length bias of learned reward models) and ``agreeable`` approves of everything (sycophancy).
Put them in a panel beside a sound judge and the panel's plain plurality reinforces what the
users dislike; weighted by each member's consistency with the outcomes the users give
(thumbs feedback: ``liverl demo --feedback``), the sound judge decides. Loaded as a plug-in
(``[processors] plugins = ["pipeline.sim.flawed_judges"]``); not for production.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pipeline.events import NextState
from pipeline.processors.judge_registry import register
from pipeline.processors.judges import TurnContext, Verdict


class VerboseOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_words: int = Field(default=26, ge=1, le=10_000)  # concise: at most 25


class VerboseJudge:
    """+1 for an answer of at least ``min_words`` words, else -1: whatever the user said."""

    judge_id = "verbose"
    inline = True

    def __init__(self, options: VerboseOptions) -> None:
        self.min_words = options.min_words
        self.version = f"verbose-1/{self.min_words}"

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        words = len(ctx.answer.split())
        if words >= self.min_words:
            return Verdict(1, [1], f"{words} words (long from {self.min_words})")
        return Verdict(-1, [-1], f"{words} words (long from {self.min_words})")


class AgreeableJudge:
    """+1 for every turn."""

    judge_id = "agreeable"
    version = "agreeable-1"
    inline = True

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        return Verdict(1, [1], "every answer is a good answer")


register("verbose", VerboseJudge, VerboseOptions)
register("agreeable", lambda _options: AgreeableJudge())
