"""A judge defined outside the library (loaded with ``[processors] plugins = ["tests.toy_judge"]``).

It votes on the length of the next state's text: +1 at most ``max_chars`` characters, else -1,
with the hint ``hint`` on a -1. It exists to prove that a judge is one module owning its
options: nothing in ``pipeline/`` names it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pipeline.events import NextState
from pipeline.processors.judges import TurnContext, Verdict, register


class LengthOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_chars: int = Field(default=40, ge=1)
    hint: str = "Answer in one short sentence."


class LengthJudge:
    judge_id = "toy-length"
    version = "toy-length-1"

    def __init__(self, options: LengthOptions) -> None:
        self.options = options

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        if len(state.content) <= self.options.max_chars:
            return Verdict(1, [1], f"{len(state.content)} chars")
        return Verdict(-1, [-1], f"{len(state.content)} chars", hints=[self.options.hint])


register("toy-length", LengthJudge, LengthOptions)
