"""Judges that read the answer, not the next state: the verified-task pool's default voters.

A verified session already passed its checker (a gate's exit code 0, a green test run,
positive feedback); a judge that reads that outcome again (``replies``, ``rules``) can only
confirm it. These two read what the task would train on, the request and the final answer,
with the simulated users' quality rules (``pipeline/sim/quality.py``) so a task is held to
the bar the demo holds answers to:

- ``answer`` (well-formed): -1 for an empty or degenerate answer (repeated characters,
  tokens or sentences, mostly non-letters, under 2 words), an answer that repeats the request,
  or a refusal (:data:`REFUSALS`); else +1.
- ``on_topic`` (relevant): -1 for an answer that mentions none of the request's content
  words (:func:`content_words`: 4+ letters, not a stop word, stems matched as the simulated
  users match them), or that adds nothing to the request (degenerate, or no content word of
  its own); +1 otherwise, and +1 for a request without content words (nothing to check).

``tasks.judges`` defaults to ``["answer", "on_topic", "replies"]``: an answer that is empty,
degenerate, an echo or a refusal fails both answer readers and is rejected 2 to 1 whatever
the checker said; a fluent answer off the request's topic fails one and enters on the
checker's vote (add ``llm`` to read meaning). Both ignore the next state: as a reward
pipeline's judge they would score every turn by its answer alone.
"""

from __future__ import annotations

import re

from pipeline.events import NextState
from pipeline.sim.quality import TOO_SHORT, degenerate_reasons, normalise, similar
from pipeline.sim.questions import mentions

from .judges import TurnContext, Verdict

REFUSALS = (
    "i'm sorry, but i can",
    "i am sorry, but i can",
    "i cannot help",
    "i can't help",
    "as an ai language model",
    "i'm unable to",
    "i am unable to",
)
STOP = frozenset(
    {
        "about",
        "above",
        "after",
        "again",
        "also",
        "because",
        "been",
        "before",
        "being",
        "below",
        "between",
        "both",
        "could",
        "does",
        "doing",
        "down",
        "during",
        "each",
        "from",
        "further",
        "have",
        "having",
        "here",
        "into",
        "just",
        "more",
        "most",
        "much",
        "once",
        "only",
        "other",
        "over",
        "same",
        "should",
        "some",
        "such",
        "than",
        "that",
        "their",
        "them",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "through",
        "under",
        "until",
        "very",
        "what",
        "when",
        "where",
        "which",
        "while",
        "will",
        "with",
        "would",
        "your",
        "yours",
        "please",
        "thanks",
        "thank",
        "help",
        "tell",
        "explain",
        "give",
        "want",
        "need",
        "know",
        "make",
        "like",
    }
)
_WORD = re.compile(r"[a-z][a-z0-9']+")


def content_words(text: str) -> list[str]:
    """The request's words that say what it is about: 4+ letters, not stop words, in order."""
    seen: list[str] = []
    for w in _WORD.findall(text.lower()):
        w = w.strip("'")
        if len(w) >= 4 and w not in STOP and w not in seen:
            seen.append(w)
    return seen


def _degenerate(answer: str) -> list[str]:
    """The quality rules' reasons, less "too short" for an answer in a script their word
    pattern (Latin letters and digits) cannot count: a Chinese sentence has no such words."""
    reasons = degenerate_reasons(answer)
    if not normalise(answer) and any(c.isalpha() for c in answer):
        reasons = [r for r in reasons if r != TOO_SHORT]
    return reasons


def _echoes(answer: str, request: str) -> bool:
    """The answer repeats the request: near-identical words, or, where neither has words the
    rules can read, the same text."""
    if normalise(answer) and normalise(request):
        return similar(answer, request)
    return " ".join(answer.split()) == " ".join(request.split())


def _verdict(reasons: list[str], ok: str) -> Verdict:
    if reasons:
        return Verdict(-1, [-1], "; ".join(reasons)[:500])
    return Verdict(1, [1], ok)


class AnswerJudge:
    """Is the answer a well-formed answer at all?"""

    judge_id = "answer"
    version = "answer-judge-1"

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        answer = ctx.answer.strip()
        reasons = _degenerate(answer)
        if answer and ctx.request.strip() and _echoes(answer, ctx.request):
            reasons.append("repeats the request")
        low = " ".join(answer.lower().split()).replace("\u2019", "'")
        hit = next((r for r in REFUSALS if r in low), None)
        if hit:
            reasons.append(f"a refusal ({hit!r})")
        return _verdict(reasons, "well-formed answer")


def off_topic_reasons(request: str, answer: str) -> list[str] | None:
    """Why ``answer`` is off ``request``'s topic ([]: on topic; None: the request has no
    content words to check against). The ``on_topic`` judge's rule, and the promotion gate's
    relevance judge's (``pipeline/trainer/gate.py``), so both hold answers to one bar."""
    words = content_words(request)
    if not words:
        return None
    reasons = []
    if not mentions(answer, words):
        reasons.append(f"mentions none of {', '.join(words[:8])}")
    if _degenerate(answer):
        reasons.append("no substance (degenerate)")
    elif not set(content_words(answer)) - set(words) and normalise(answer):
        reasons.append("adds nothing to the request")
    return reasons


class OnTopicJudge:
    """Does the answer speak to the request, and say something of its own?"""

    judge_id = "on_topic"
    version = "on-topic-judge-1"

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        reasons = off_topic_reasons(ctx.request, ctx.answer)
        if reasons is None:
            return Verdict(1, [1], "no content words in the request to check against")
        words = content_words(ctx.request)
        return _verdict(reasons, f"on topic ({', '.join(words[:4])})")
