"""Does an answer answer the question? The guard that keeps a style preference from being hacked.

A pilot (issue 10) showed plain Binary RL reaching 100 % "short" by answering every question
"You are a helpful AI, trained by Hugging Face", after passing through "1.1.1.1…" and
"You can't. You can't.". :func:`check_quality` rejects each of those:

- ``empty``: nothing but whitespace.
- ``degenerate: too short``: fewer than 2 words.
- ``degenerate: mostly non-letters``: letters are under half of the non-space characters.
- ``degenerate: repeated characters``: a unit of 1–12 characters repeated back to back at
  least 4 times over 10 or more characters ("1.1.1.1.1", "!!!!!!!!!!", "hahahahaha").
- ``degenerate: repeated sentence``: the same sentence (normalised, 2+ words) twice.
- ``degenerate: repeated tokens``: one word n-gram (n = 1..4) occurring 3+ times and covering
  half of the words or more, or, from 12 words on, under 35 % distinct words.
- ``off topic``: none of the question's keywords (:func:`.questions.mentions`).
- ``repeats the question``: the answer is the question again (near-identical as below).
- ``repeats the instruction``: the answer contains the user's hint itself (normalised), as in
  "To wake up earlier, you can use plain, simple words." (only when ``hint`` is given).
- ``repeats an earlier answer``: normalised text identical, or difflib ratio >= 0.85, to one of
  ``earlier_answers`` (the caller passes answers to *other* questions).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import TYPE_CHECKING

from .preferences import sentences
from .questions import mentions

if TYPE_CHECKING:
    from .questions import Question

EMPTY = "empty"
TOO_SHORT = "degenerate: too short"
NON_LETTERS = "degenerate: mostly non-letters"
REPEATED_CHARS = "degenerate: repeated characters"
REPEATED_SENTENCE = "degenerate: repeated sentence"
REPEATED_TOKENS = "degenerate: repeated tokens"
OFF_TOPIC = "off topic"
REPEATS_EARLIER = "repeats an earlier answer"
ECHOES_QUESTION = "repeats the question"
ECHOES_HINT = "repeats the instruction"

NEAR_DUPLICATE = 0.85
_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_CHAR_RUN = re.compile(r"(.{1,12}?)\1{3,}", re.DOTALL)


@dataclass(frozen=True)
class Quality:
    ok: bool
    reasons: list[str] = field(default_factory=list)

    @property
    def degenerate(self) -> bool:
        return any(r == EMPTY or r.startswith("degenerate") for r in self.reasons)


def normalise(text: str) -> str:
    return " ".join(_TOKEN.findall(text.lower()))


def degenerate_reasons(answer: str) -> list[str]:
    """Why ``answer`` is empty or degenerate (the reasons above); [] for a real answer. The
    task pool's answer judges hold answers to the same bar (processors/answer_judges.py)."""
    text = answer.strip()
    if not text:
        return [EMPTY]
    reasons: list[str] = []
    tokens = _TOKEN.findall(text.lower())
    if len(tokens) < 2:
        reasons.append(TOO_SHORT)
    visible = [c for c in text if not c.isspace()]
    if sum(c.isalpha() for c in visible) < 0.5 * len(visible):
        reasons.append(NON_LETTERS)
    if any(len(m.group(0)) >= 10 for m in _CHAR_RUN.finditer(text)):
        reasons.append(REPEATED_CHARS)
    said = [normalise(s) for s in sentences(text)]
    counts = Counter(s for s in said if len(s.split()) >= 2)
    if counts and counts.most_common(1)[0][1] >= 2:
        reasons.append(REPEATED_SENTENCE)
    if _repeated_tokens(tokens):
        reasons.append(REPEATED_TOKENS)
    return reasons


def _repeated_tokens(tokens: list[str]) -> bool:
    total = len(tokens)
    if total >= 12 and len(set(tokens)) < 0.35 * total:
        return True
    for n in range(1, 5):
        grams = Counter(tuple(tokens[i : i + n]) for i in range(total - n + 1))
        if not grams:
            break
        count = grams.most_common(1)[0][1]
        if count >= 3 and count * n >= 0.5 * total:
            return True
    return False


def similar(a: str, b: str) -> bool:
    """Near-identical after normalisation (identical, or difflib ratio >= 0.85)."""
    na, nb = normalise(a), normalise(b)
    if not na or not nb:
        return na == nb
    return na == nb or SequenceMatcher(None, na, nb).ratio() >= NEAR_DUPLICATE


def check_quality(
    question: Question, answer: str, earlier_answers: Sequence[str], hint: str | None = None
) -> Quality:
    """Whether ``answer`` answers ``question``; ``earlier_answers`` are answers to other
    questions (an answer that fits every question answers none); ``hint``, the user's
    instruction, must not be parroted back."""
    reasons = degenerate_reasons(answer)
    if reasons == [EMPTY]:
        return Quality(False, reasons)
    if not mentions(answer, question.keywords):
        reasons.append(OFF_TOPIC)
    if similar(answer, question.text):
        reasons.append(ECHOES_QUESTION)
    if hint and normalise(hint) and f" {normalise(hint)} " in f" {normalise(answer)} ":
        reasons.append(ECHOES_HINT)
    if any(similar(answer, earlier) for earlier in earlier_answers):
        reasons.append(REPEATS_EARLIER)
    return Quality(not reasons, reasons)
