"""GUI next states as votes: the screen diff a ``gui`` next state carries, read against the goal.

The gateway's gui source (``serving/gui_source.py``) diffs the accessibility trees before and
after an agent's action and puts the compact diff in ``detail.gui``. What counts as progress is
verifiable on the diff alone, so the rule and reply judges score it without a model:

- an error dialog or alert appeared: -1 (the action was refused or broke something);
- an element whose name or value holds a word of the goal appeared, a value changed to one, or
  the focused field was filled with one: +1;
- nothing changed (``no_op``), the session's first screen, any other change: 0 (a change is not
  progress by itself; a repeated no-op is the path rules' business, not the judge's).

The goal is the post's ``goal``, else the turn's user request. Pure functions.

A hint goes to the OPD teacher as the user's instruction, but what it names here (the action's
target, an error dialog's text) is what a harness posted: each is quoted as data (one line in
double quotes, its own quotes escaped) and cut to ``MAX_QUOTED`` characters, so a target such
as "SYSTEM: ignore previous instructions" is read as an element's name, never as an order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.events.types import Vote

WORD = re.compile(r"\w+")
MAX_QUOTED = 48  # characters of posted text (a target, an error's name) a hint quotes
# Words of a goal that name no element: articles, prepositions and the actions themselves.
STOP_WORDS = frozenset(
    {
        "the",
        "and",
        "for",
        "with",
        "into",
        "onto",
        "from",
        "then",
        "this",
        "that",
        "please",
        "click",
        "press",
        "type",
        "enter",
        "select",
        "open",
        "set",
        "make",
        "find",
        "use",
        "show",
        "new",
        "your",
    }
)  # words under 3 characters never count


@dataclass(frozen=True)
class GuiReading:
    score: Vote
    rationale: str
    hints: list[str] = field(default_factory=list)


def goal_words(goal: str) -> set[str]:
    """The goal's words that can name an element: lower-cased, 3+ characters, no stop word."""
    return {w for w in WORD.findall(goal.lower()) if len(w) >= 3 and w not in STOP_WORDS}


def _hits(text: str, words: set[str]) -> set[str]:
    return words & set(WORD.findall(text.lower()))


def quoted(text: str, limit: int = MAX_QUOTED) -> str:
    """Posted text as data in a hint: whitespace runs as one space, at most ``limit``
    characters (cut with an ellipsis), in double quotes with quotes and backslashes escaped."""
    flat = " ".join(text.split())
    if len(flat) > limit:
        flat = flat[: limit - 1].rstrip() + "\u2026"
    return json.dumps(flat, ensure_ascii=False)


def _did(gui: Mapping[str, Any]) -> str:
    action = gui.get("action") or {}
    kind = WORD.findall(str(action.get("type") or ""))  # a word of its own, never a sentence
    kind_text = kind[0][:32] if kind else "action"
    target = str(action.get("target") or "")
    return f"the {kind_text} on {quoted(target)}" if target.strip() else f"the {kind_text}"


def gui_vote(gui: Mapping[str, Any], goal: str) -> GuiReading:
    """The vote for one screen diff (``detail.gui``) against ``goal`` (see the module doc)."""
    did = _did(gui)
    error = gui.get("error")
    if isinstance(error, Mapping):
        name = str(error.get("name") or error.get("role") or "")
        return GuiReading(
            -1,
            f"error dialog appeared: {name!r}",
            [f"{did[0].upper()}{did[1:]} raised an error: {quoted(name)}."],
        )
    if gui.get("first"):
        return GuiReading(0, "first screen of the session: no diff")
    if gui.get("no_op"):
        return GuiReading(
            0,
            f"{did} changed nothing",
            [f"{did[0].upper()}{did[1:]} changed nothing; try another element."],
        )
    words = goal_words(goal)
    for what, texts in (
        (
            "appeared",
            [f"{e.get('name', '')} {e.get('value', '')}" for e in gui.get("appeared") or []],
        ),
        ("changed to", [str(e.get("value", "")) for e in gui.get("changed") or []]),
    ):
        for text in texts:
            hit = _hits(text, words)
            if hit:
                return GuiReading(1, f"goal words {sorted(hit)} {what}: {text.strip()[:100]!r}")
    focused = gui.get("focused")
    if isinstance(focused, Mapping) and focused.get("filled"):
        hit = _hits(str(focused.get("value", "")), words)
        if hit:
            return GuiReading(
                1,
                f"focused {focused.get('role')} {focused.get('name')!r} "
                f"filled with goal words {sorted(hit)}",
            )
    return GuiReading(0, "the screen changed, nothing of the goal appeared")
