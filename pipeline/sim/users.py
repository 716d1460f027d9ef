"""Simulated users: a hidden preference, a judgement of each answer, and a reply in words.

A user is satisfied only by an answer that meets its preference *and* passes
:func:`.quality.check_quality` (on topic, not degenerate, not a repeat of its answer to another
question). Satisfied, it thanks; unhappy, it complains (about quality first, else about the
preference) and, with probability ``hint_rate``, adds a directive sentence containing the
preference's hint ("That's way too long. Please answer in one short sentence."). Those
replies are the next states the pipeline learns from.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from .preferences import PREFERENCES, Preference
from .quality import (
    ECHOES_HINT,
    ECHOES_QUESTION,
    EMPTY,
    OFF_TOPIC,
    REPEATS_EARLIER,
    Quality,
    check_quality,
)
from .questions import Question

THANKS: tuple[str, ...] = (
    "Thanks, that's exactly what I needed.",
    "Perfect, thank you!",
    "Great, thanks.",
    "That's just right, thanks.",
    "Nice, that works for me.",
    "Thank you, that's helpful.",
    "Exactly what I was looking for.",
    "Great answer, thanks!",
)

QUALITY_COMPLAINTS: dict[str, tuple[str, ...]] = {
    EMPTY: ("You didn't say anything.", "I got an empty answer."),
    "degenerate": (
        "That doesn't make any sense.",
        "That's gibberish.",
        "That's just noise, not an answer.",
    ),
    OFF_TOPIC: (
        "That doesn't answer my question.",
        "That has nothing to do with what I asked.",
        "That's off topic.",
    ),
    ECHOES_HINT: (
        "You just repeated what I asked for instead of answering.",
        "Don't repeat my instructions, answer the question.",
    ),
    ECHOES_QUESTION: (
        "You just repeated my question.",
        "That's my question, not an answer.",
    ),
    REPEATS_EARLIER: (
        "You said the same thing last time, and it doesn't answer my question.",
        "That's the same answer you gave before.",
    ),
}

# Directive sentences; ``{hint}`` is the hint with its first letter lowered and its final
# punctuation removed ("answer in one short sentence"), ``{Hint}`` the hint as written.
DIRECTIVES: tuple[str, ...] = (
    "{Hint}",
    "Please {hint}.",
    "Next time, {hint}.",
    "Could you {hint}?",
    "I'd like you to {hint}.",
    "Can you {hint}, please?",
    "Just {hint}.",
)


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


@dataclass(frozen=True)
class Judgement:
    satisfied: bool  # = meets_preference and quality.ok
    meets_preference: bool
    quality: Quality


@dataclass
class SimUser:
    user_id: str
    preference: Preference
    hint_rate: float = 1.0  # probability that a correction carries the hint sentence
    seed: int = 0
    memory: int = 200  # answers remembered for the repetition check
    history: list[tuple[str, str]] = field(default_factory=list, repr=False)  # (question, answer)
    rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.hint_rate <= 1.0:
            raise ValueError("hint_rate must be in [0, 1]")
        self.rng = random.Random(self.seed * 1_000_003 + _stable_hash(self.user_id))

    def judge(self, question: Question, answer: str) -> Judgement:
        """Judge ``answer``; remembers it for the repetition check of later questions."""
        earlier = [a for q, a in self.history if q != question.text]
        quality = check_quality(question, answer, earlier, hint=self.preference.hint)
        self.history.append((question.text, answer))
        del self.history[: -self.memory]
        meets = self.preference.met(answer)
        return Judgement(meets and quality.ok, meets, quality)

    def reply(self, judgement: Judgement) -> str:
        """The user's next message: thanks, or a complaint plus (at ``hint_rate``) the hint."""
        if judgement.satisfied:
            return self.rng.choice(THANKS + self.preference.praise)
        complaint = self._complaint(judgement)
        if self.rng.random() < self.hint_rate:
            return f"{complaint} {self.directive()}"
        return complaint

    def directive(self) -> str:
        """A sentence asking for the preference; always contains its key phrase."""
        hint = self.preference.hint.strip()
        body = hint.rstrip(".!? ")
        body = body[:1].lower() + body[1:]
        return self.rng.choice(DIRECTIVES).format(Hint=hint, hint=body)

    def _complaint(self, judgement: Judgement) -> str:
        for reason in judgement.quality.reasons:
            key = "degenerate" if reason.startswith("degenerate") else reason
            if key in QUALITY_COMPLAINTS:
                return self.rng.choice(QUALITY_COMPLAINTS[key])
        return self.rng.choice((self.preference.complaint, *self.preference.complaints))


def make_users(
    n: int,
    preferences: Sequence[str] = ("concise",),
    hint_rate: float = 1.0,
    seed: int = 0,
    *,
    shared_history: bool = False,
) -> list[SimUser]:
    """``n`` users ``user-0`` … with preferences assigned round-robin from ``preferences``.

    ``shared_history=True`` gives them one memory of (question, answer) pairs, so the
    repetition check spans all of them: use it when each user asks a single question (an
    evaluation), or the same stock answer to every question would never count as a repeat.
    """
    if not preferences:
        raise ValueError("at least one preference")
    unknown = [p for p in preferences if p not in PREFERENCES]
    if unknown:
        raise KeyError(f"unknown preferences {unknown}; known: {sorted(PREFERENCES)}")
    shared: list[tuple[str, str]] = []
    return [
        SimUser(
            user_id=f"user-{i}",
            preference=PREFERENCES[preferences[i % len(preferences)]],
            hint_rate=hint_rate,
            seed=seed,
            history=shared if shared_history else [],
        )
        for i in range(n)
    ]
