"""A critic that keeps the simulated users where the learning signal is (RLAnything's
environment adaptation, ScaleCUA's frontier sampling), within stated bounds.

From the sessions it has seen (question, preference, phrasing level, satisfied?) it plans the
next round's sessions:

- **Questions** (``frontier=True``): all but ``explore`` of the sessions draw their question
  by frontier weight (``pipeline.curriculum``: tasks solved about half the time first); the
  rest uniformly, so a question that left the frontier is measured again. Without it every
  question is drawn uniformly (the demo's old behaviour).
- **Preferences**: with more than one, each session's by the same frontier weight over the
  preferences' success (a preference the policy has learned fades, one it fails comes back).
- **Phrasing** (``adapt=True``): one difficulty level for the round, moved by the success of
  the last ``window`` sessions: below ``target - band`` one level easier, above ``target +
  band`` one harder. Level 0 asks with the preference's hint in the prompt for at most
  ``max_easy`` of the sessions (told what is wanted, the policy can succeed and the
  preference's reward has a sign to learn from); level 1 asks plainly; level 2 uses a chattier
  phrasing that invites the long, formatted answers users dislike, for at most ``max_hard``.

Held-out evaluation never goes through the critic: its users ask plainly, so figures with
and without adaptation measure the same thing. Each plan records why each session was drawn
(:class:`Assignment`), which the demo writes per session.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.curriculum import TaskSuccess, frontier_weight

from .preferences import PREFERENCES
from .questions import Question

EASY, PLAIN, HARD = 0, 1, 2
LEVELS = ("easy", "plain", "hard")

# Level 2: the same question asked in a way that invites a long, formatted answer.
HARD_PHRASINGS: tuple[str, ...] = (
    "I've been wondering about this for a while and would love your thoughts. {q}",
    "{q} I'm curious about the background too.",
    "Tell me about it: {q}",
)


@dataclass(frozen=True)
class CriticBounds:
    """What the critic may do; every share is of a round's sessions."""

    target: float = 0.5  # success rate it steers toward
    band: float = 0.15  # no level change within target +- band
    window: int = 12  # recent sessions the level is judged on
    explore: float = 0.25  # at least this share of questions drawn uniformly
    max_easy: float = 0.5  # at most this share asked with the hint (level 0)
    max_hard: float = 0.5  # at most this share asked the chatty way (level 2)

    def __post_init__(self) -> None:
        for name in ("target", "band", "explore", "max_easy", "max_hard"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"critic bound {name} must be in [0, 1], not {value}")
        if self.window < 1:
            raise ValueError("critic window must be >= 1")


@dataclass(frozen=True)
class Assignment:
    """One planned session and why it was drawn."""

    question: Question
    preference: str
    level: int  # EASY | PLAIN | HARD: how this session's prompt is phrased
    prompt: str
    drawn: str  # frontier | explore | uniform
    question_rate: float  # the question's estimated success rate when drawn
    question_weight: float

    def record(self) -> dict[str, object]:
        return {
            "drawn": self.drawn, "preference": self.preference, "level": LEVELS[self.level],
            "question_rate": round(self.question_rate, 4),
            "question_weight": round(self.question_weight, 4),
        }  # fmt: skip


@dataclass
class Critic:
    questions: Sequence[Question]
    preferences: Sequence[str] = ("concise",)
    bounds: CriticBounds = field(default_factory=CriticBounds)
    seed: int = 0
    frontier: bool = True
    adapt: bool = True
    level: int = PLAIN
    by_question: dict[str, TaskSuccess] = field(default_factory=dict)
    by_preference: dict[str, TaskSuccess] = field(default_factory=dict)
    recent: deque[bool] = field(init=False)
    rng: random.Random = field(init=False, repr=False)
    levels: list[int] = field(default_factory=list)  # the level of each round planned

    def __post_init__(self) -> None:
        if not self.questions:
            raise ValueError("the critic needs questions")
        unknown = [p for p in self.preferences if p not in PREFERENCES]
        if not self.preferences or unknown:
            raise ValueError(f"unknown preferences {unknown}; known: {sorted(PREFERENCES)}")
        self.recent = deque(maxlen=self.bounds.window)
        self.rng = random.Random(self.seed * 7_919 + 1)

    def observe(self, assignment: Assignment, satisfied: bool) -> None:
        self.by_question.setdefault(assignment.question.text, TaskSuccess()).add(satisfied)
        self.by_preference.setdefault(assignment.preference, TaskSuccess()).add(satisfied)
        self.recent.append(satisfied)

    def _next_level(self) -> int:
        if not self.adapt or not self.recent:
            return self.level
        rate = sum(self.recent) / len(self.recent)
        b = self.bounds
        if rate < b.target - b.band:
            return max(EASY, self.level - 1)
        if rate > b.target + b.band:
            return min(HARD, self.level + 1)
        return self.level

    def _rate(self, table: dict[str, TaskSuccess], key: str) -> float:
        return table.get(key, TaskSuccess()).rate

    def plan(self, n: int) -> list[Assignment]:
        """``n`` sessions for the next round: distinct questions while there are enough."""
        self.level = self._next_level()
        self.levels.append(self.level)
        explore = round(n * self.bounds.explore) if self.frontier else n
        pool = list(self.questions)
        chosen: list[tuple[Question, str]] = []
        for i in range(n):
            if not pool:
                pool = list(self.questions)
            if i < n - explore:
                weights = [frontier_weight(self._rate(self.by_question, q.text)) for q in pool]
                q = self.rng.choices(pool, weights=weights)[0]
                chosen.append((q, "frontier"))
            else:
                q = self.rng.choice(pool)
                chosen.append((q, "explore" if self.frontier else "uniform"))
            pool.remove(q)
        special = {EASY: self.bounds.max_easy, HARD: self.bounds.max_hard}.get(self.level, 0.0)
        n_special = int(n * special) if self.adapt else 0
        marked = set(self.rng.sample(range(n), n_special))
        out = []
        for i, (q, drawn) in enumerate(chosen):
            pref = self._preference()
            level = self.level if i in marked else PLAIN
            rate = self._rate(self.by_question, q.text)
            out.append(Assignment(q, pref, level, self.phrase(q, pref, level), drawn, rate,
                                  frontier_weight(rate)))  # fmt: skip
        return out

    def _preference(self) -> str:
        if len(self.preferences) == 1:
            return self.preferences[0]
        weights = [frontier_weight(self._rate(self.by_preference, p)) for p in self.preferences]
        return self.rng.choices(list(self.preferences), weights=weights)[0]

    def phrase(self, question: Question, preference: str, level: int) -> str:
        if level == EASY:
            return f"{question.text} {PREFERENCES[preference].hint}"
        if level == HARD:
            return self.rng.choice(HARD_PHRASINGS).format(q=question.text)
        return question.text
