"""Judges for the task pool's tests, plugged in through the registry
(``[processors] plugins = ["tests.toy_task_judges"]``): ``word-a``, ``word-b`` and ``word-c``
each vote +1 when the answer holds their ``word`` option, else -1, so three of them disagree
deterministically on the same session."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from pipeline.events import NextState
from pipeline.processors.judges import TurnContext, Verdict, register


class WordOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    word: str = "fixed"


class WordJudge:
    def __init__(self, options: WordOptions) -> None:
        self.word = options.word.lower()
        self.judge_id = f"word-{self.word}"
        self.version = f"word-1/{self.word}"

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        if self.word in ctx.answer.lower():
            return Verdict(1, [1], f"answer says {self.word!r}")
        return Verdict(-1, [-1], f"answer never says {self.word!r}")


for _name in ("word-a", "word-b", "word-c"):
    register(_name, WordJudge, WordOptions)
