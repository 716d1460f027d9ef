"""Hidden preferences of simulated users: checkable by code, followable by a model when told.

Each preference has a ``hint`` (an imperative sentence the model can follow when it is put in
the prompt), a ``key_phrase`` contained in that hint (a correction "carries the hint" when it
contains the key phrase), complaints an unhappy user opens with, and ``met(answer)``.

Definitions (all on the answer text as returned by the model, surrounding whitespace ignored):

``concise``
    at most one sentence and at most 25 words. Sentences are the non-empty pieces of the text
    split at line breaks and at ``.``, ``!`` or ``?`` followed by whitespace (so "3.5" and
    "e.g." inside a sentence do not split it); a piece counts only if it has a letter or digit.
``plain``
    no word from :data:`JARGON`, and at most 10 % of the words have 11 or more letters
    (counted only when the answer has 10 words or more; a shorter answer may have one).
``numbered``
    at least two lines that start with a number, a dot and a space ("1. ..."), the first of
    them numbered 1.
``lowercase``
    has at least one letter and no uppercase letter.
``bulleted``
    at least two lines that start with "- ", "* " or "• ".
``no_list``
    no numbered or bulleted lines at all (plain prose).
``english``
    has a word, and fewer than two French markers: words from :data:`FRENCH_WORDS` (French
    words that are not English words) and words with a French accent
    (:data:`FRENCH_LETTERS`), so an English answer with one French word ("café") passes.
    The canary drill's users (pipeline/demo/canary_drill.py) hold it against a version that
    replies in French.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+|\n+")
_NUMBERED_LINE = re.compile(r"^\s*(?:\*\*)?(\d{1,2})\.\s+\S", re.MULTILINE)
_BULLET_LINE = re.compile(r"^\s*[-*•]\s+\S", re.MULTILINE)

# Words a user asking for plain language objects to: corporate, academic and technical filler
# that has an everyday equivalent. Matched on whole lowercase words (inflections listed).
_JARGON_WORDS = """
    utilize utilise utilizes utilizing utilization leverage leverages leveraging optimize
    optimise optimizes optimizing optimization optimal facilitate facilitates facilitating
    paradigm synergy synergies methodology methodologies implement implements implementing
    implementation comprehensive furthermore additionally consequently nevertheless
    subsequently approximately numerous commence commences commencing endeavor endeavour
    endeavors ascertain ascertaining mitigate mitigates mitigating mitigation enhance enhances
    enhancing enhancement holistic robust streamline streamlining incorporate incorporates
    incorporating incorporation prioritize prioritise prioritizing prioritization
    functionality parameters parameter framework frameworks paradigms scalable scalability
    aforementioned henceforth thereby therein wherein whereby notwithstanding moreover
    demonstrate demonstrates demonstrating cognitive physiological psychological
    cardiovascular metabolic metabolism circadian neurotransmitters hydration nutritional
    nutrients optimum efficacy efficacious proficiency proficient
"""
JARGON: frozenset[str] = frozenset(_JARGON_WORDS.split())
# French words that are not English words (whole lowercase words; homographs such as "pour",
# "son", "ton", "par", "pas", "est", "tout", "la" left out): two in one answer make it French
# for the ``english`` preference.
_FRENCH_WORDS = """
    le les un une des du au aux et sont vous nous je tu il elle ils elles avec dans sur votre
    vos notre nos mes tes sa ses ce cette ces qui que quoi ne bien chaque fois heure soir
    jour tous toutes très aussi mais donc trois dix semaine eau
"""
FRENCH_WORDS: frozenset[str] = frozenset(_FRENCH_WORDS.split())
FRENCH_LETTERS = frozenset("àâæçéèêëîïôœùûüÿ")
LONG_WORD = 11  # letters; "comfortable" (11) counts as long, "vegetables" (10) does not
LONG_SHARE = 0.10


def words(text: str) -> list[str]:
    return WORD.findall(text)


def sentences(text: str) -> list[str]:
    pieces = _SENTENCE_SPLIT.split(text.strip())
    return [p for p in pieces if any(c.isalnum() for c in p)]


def is_concise(answer: str) -> bool:
    return len(sentences(answer)) <= 1 and 0 < len(words(answer)) <= 25


def is_plain(answer: str) -> bool:
    found = [w.lower() for w in words(answer)]
    if not found or any(w in JARGON for w in found):
        return False
    long = sum(len(w) >= LONG_WORD for w in found)
    if len(found) < 10:
        return long <= 1
    return long <= LONG_SHARE * len(found)


def is_numbered(answer: str) -> bool:
    numbers = [int(m) for m in _NUMBERED_LINE.findall(answer)]
    return len(numbers) >= 2 and numbers[0] == 1


def is_lowercase(answer: str) -> bool:
    return any(c.isalpha() for c in answer) and not any(c.isupper() for c in answer)


def is_bulleted(answer: str) -> bool:
    return len(_BULLET_LINE.findall(answer)) >= 2


def is_english(answer: str) -> bool:
    found = [w.lower() for w in re.findall(r"[^\W\d_]+", answer)]
    markers = sum(w in FRENCH_WORDS or not FRENCH_LETTERS.isdisjoint(w) for w in found)
    return bool(found) and markers < 2


def has_no_list(answer: str) -> bool:
    return (
        bool(words(answer))
        and not _NUMBERED_LINE.search(answer)
        and not _BULLET_LINE.search(answer)
    )


@dataclass(frozen=True)
class Preference:
    """A hidden preference: ``met`` checks an answer; ``hint`` is what the user can ask for."""

    name: str
    hint: str  # an imperative sentence, e.g. "Answer in one short sentence."
    complaint: str  # what an unhappy user says first, e.g. "That's way too long."
    key_phrase: str = ""  # contained in ``hint`` (case-insensitive); defaults to the hint
    check: Callable[[str], bool] = field(default=lambda _answer: True, repr=False, compare=False)
    complaints: tuple[str, ...] = ()  # other ways to say ``complaint``; never carry the hint
    praise: tuple[str, ...] = ()  # preference-specific thanks, mixed with the generic ones

    def __post_init__(self) -> None:
        if not self.key_phrase:
            object.__setattr__(self, "key_phrase", self.hint.rstrip(".!?").lower())
        if self.key_phrase.lower() not in self.hint.lower():
            raise ValueError(f"{self.name}: key phrase {self.key_phrase!r} not in the hint")

    def met(self, answer: str) -> bool:
        return bool(self.check(answer))

    def carries_hint(self, text: str) -> bool:
        """Whether ``text`` (a user's reply) contains this preference's key phrase."""
        return self.key_phrase.lower() in text.lower()


PREFERENCES: dict[str, Preference] = {
    p.name: p
    for p in (
        Preference(
            name="concise",
            hint="Answer in one short sentence.",
            key_phrase="one short sentence",
            complaint="That's way too long.",
            complaints=(
                "Way too much text for me.",
                "Too long, I just wanted the gist.",
                "That's a lot to read.",
                "Too wordy.",
            ),
            praise=("Great, short and sweet.", "Perfect, nice and brief."),
            check=is_concise,
        ),
        Preference(
            name="plain",
            hint="Use plain, simple words.",
            key_phrase="simple words",
            complaint="That's too technical for me.",
            complaints=(
                "Too many big words.",
                "I don't understand half of those words.",
                "That sounds like a textbook.",
            ),
            praise=("Great, easy to understand.", "Thanks, that's clear."),
            check=is_plain,
        ),
        Preference(
            name="numbered",
            hint="Give the steps as a numbered list.",
            key_phrase="numbered list",
            complaint="That's hard to follow.",
            complaints=(
                "I can't follow that.",
                "It's all one block, hard to follow.",
                "I lost track of the steps.",
            ),
            praise=("Great, easy to follow step by step.", "Thanks, clear steps."),
            check=is_numbered,
        ),
        Preference(
            name="lowercase",
            hint="Write in lowercase only.",
            key_phrase="lowercase",
            complaint="Why all the capital letters?",
            complaints=(
                "The capitals feel like shouting.",
                "I don't like capital letters.",
                "Too many capitals.",
            ),
            praise=("Great, that looks nice and calm.",),
            check=is_lowercase,
        ),
        Preference(
            name="bulleted",
            hint="Use bullet points.",
            key_phrase="bullet points",
            complaint="That's a wall of text.",
            complaints=("Hard to scan.", "Too dense to read."),
            praise=("Great, easy to scan.",),
            check=is_bulleted,
        ),
        Preference(
            name="no_list",
            hint="Write it as normal sentences, not a list.",
            key_phrase="not a list",
            complaint="I don't like all those lists.",
            complaints=("Too choppy.", "That reads like a form."),
            praise=("Thanks, that reads nicely.",),
            check=has_no_list,
        ),
        Preference(
            name="english",
            hint="Reply in English.",
            key_phrase="in english",
            complaint="That's not English, I can't read it.",
            complaints=("No, I don't speak French.", "That's not a language I read."),
            praise=("Thanks, clear English.",),
            check=is_english,
        ),
    )
}
