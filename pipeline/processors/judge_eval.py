"""How well a reply judge reads labelled replies: vote precision and recall per class, the
confusion matrix, and how often its hint carries the directive the user gave.

Two labelled sets ship with the tests (``tests/data/replies.jsonl``, the patterns' own, and
``tests/data/replies_independent.jsonl``, written before the patterns were read and split into
a tune half and a report half); the loaders take their path. ``tests/`` holds the floors,
``bench/judge.py`` prints the figures.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.processors.judges import ReplyJudge

STOP = set(
    [
        "a",
        "an",
        "the",
        "in",
        "to",
        "of",
        "as",
        "it",
        "me",
        "my",
        "for",
        "with",
        "and",
        "or",
        "be",
        "is",
        "use",
        "give",
        "answer",
        "write",
        "make",
        "just",
        "only",
        "please",
        "your",
        "that",
        "this",
    ]
)


def load_rows(path: Path, split: str | None = None) -> list[dict[str, Any]]:
    """The JSON lines of a labelled set, those of ``split`` only when given."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return [r for r in rows if split is None or r["split"] == split]


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.casefold()).split())


def _key_tokens(text: str) -> set[str]:
    norm = _norm(text)
    if re.search(r"[\u4e00-\u9fff]", norm):
        return set(norm.replace(" ", "")) - set("用请的")
    return {w for w in norm.split() if w not in STOP}


def key_match(gold: str, got: str | None) -> bool:
    """The extracted hint carries the key phrase: at least 60 % of the gold hint's content
    words (characters for Chinese) appear in it."""
    if not got:
        return False
    want = _key_tokens(gold)
    return not want or len(want & _key_tokens(got)) / len(want) >= 0.6


def evaluate(judge: ReplyJudge, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Vote precision and recall per class, accuracy, and hint extraction figures."""
    pred = [judge.read(r["text"]) for r in rows]
    out: dict[str, Any] = {"n": len(rows), "labels": dict(Counter(r["label"] for r in rows))}
    out["precision"], out["recall"] = {}, {}
    for c in (-1, 0, 1):
        said = [r for r, p in zip(rows, pred, strict=True) if p.score == c]
        is_c = [(r, p) for r, p in zip(rows, pred, strict=True) if r["label"] == c]
        out["precision"][c] = sum(r["label"] == c for r in said) / len(said) if said else 1.0
        out["recall"][c] = sum(p.score == c for _, p in is_c) / len(is_c) if is_c else 1.0
    out["accuracy"] = sum(r["label"] == p.score for r, p in zip(rows, pred, strict=True)) / len(
        rows
    )
    hinted = [(r, p.hints[0] if p.hints else None) for r, p in zip(rows, pred, strict=True)]
    gold = [(r["hint"], h) for r, h in hinted if r["hint"]]
    out["hint_n"] = len(gold)
    out["hint_yield"] = sum(h is not None for _, h in gold) / len(gold)
    out["hint_exact"] = sum(h is not None and _norm(g) == _norm(h) for g, h in gold) / len(gold)
    out["hint_key"] = sum(key_match(g, h) for g, h in gold) / len(gold)
    out["spurious_hints"] = sum(h is not None for r, h in hinted if r["label"] != -1)
    out["implied_hints"] = sum(
        h is not None for r, h in hinted if r["label"] == -1 and not r["hint"]
    )
    out["misses"] = [
        (r["text"], r["label"], p.score, r["hint"], p.hints)
        for r, p in zip(rows, pred, strict=True)
        if p.score != r["label"] or (r["hint"] and not key_match(r["hint"], (p.hints or [""])[0]))
    ]
    return out


# ---- the independent labelled set -------------------------------------------------------------
#
# ``replies_independent.jsonl``: 227 replies written before the patterns were read,
# ``{"text", "label": -1|0|1, "hint": category|null, "split": "tune"|"report"}``. The category
# names the directive the answer should have followed (shorter, longer, simpler, language,
# format, correction, tone); the split is stratified by (label, category) and fixed by a hash of
# the text. Patterns may be tuned on "tune" only; "report" is what the docs quote.

CATEGORIES = ("shorter", "longer", "simpler", "language", "format", "correction", "tone")
# A hint's category: the first rule whose keywords occur in it (case-insensitive). The order
# settles overlaps: "Answer in French as a list" is language, "Answer in one line" and "Give
# only the answer" shorter (but "only the code" format),
# "Use plain text" format before "plain words" is simpler, "plain English" simpler, not language.
HINT_CATEGORY: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern, re.IGNORECASE))
    for name, pattern in (
        (
            "language",
            r"\b(language|(?<!plain )(?<!simple )english|french|fran[cç]ais|spanish|espa[ñn]ol"
            r"|german|deutsch|italian|japanese|chinese|portuguese|dutch|hindi|korean|russian|arabic)\b|中文|英文",
        ),
        ("correction", r"\b(correct(ion|ly)?|fact|facts|accurate|actually|wrong|mistake)\b"),
        (
            "shorter",
            r"\b(short|shorter|brief|briefly|concise|succinct|summar\w*|gist|tl;?dr|trim|cut"
            r"|condense\w*|one (sentence|line)|(two|three|\d+) (sentences|lines|words)"
            r"|fewer words|to the point|bottom line|less (text|detail|rambling)"
            r"|(only|just) the answer|answer (only|first))\b|简短|一句话",
        ),
        (
            "longer",
            r"\b(more (detail|details|depth|context|thorough\w*)|in (more )?(detail|depth)"
            r"|elaborate|expand|longer|thorough\w*|flesh)\b",
        ),
        (
            "format",
            r"\b(list|bullets?|bullet points|table|json|yaml|csv|markdown|code block|the code"
            r"|numbered|step[- ]by[- ]step|headings?|sections?|checklist|per line|plain text"
            r"|bold|format\w*)\b",
        ),
        (
            "simpler",
            r"\b(simple|simpler|simply|plain|jargon|technical|five|beginner|layman\W?s?|easy"
            r"|everyday)\b",
        ),
        ("tone", r"\b(formal|casual|polite|apolog\w*|direct|directly|emojis?|tone|friendly)\b"),
    )
)


def hint_category(hint: str | None) -> str | None:
    """The category of a hint the judge produced, by :data:`HINT_CATEGORY`; None if none."""
    if not hint:
        return None
    return next((name for name, rx in HINT_CATEGORY if rx.search(hint)), "other")


def evaluate_categories(judge: ReplyJudge, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Vote precision and recall per class, the confusion matrix (gold label -> judged vote),
    hint recall (share of rows with a gold category whose first hint falls in that category)
    and spurious hints (hints on rows without a category)."""
    pred = [judge.read(r["text"]) for r in rows]
    pairs = list(zip(rows, pred, strict=True))
    out: dict[str, Any] = {"n": len(rows), "precision": {}, "recall": {}, "said": {}}
    out["confusion"] = {g: {p: 0 for p in (-1, 0, 1)} for g in (-1, 0, 1)}
    for r, p in pairs:
        out["confusion"][r["label"]][p.score] += 1
    for c in (-1, 0, 1):
        said = [r for r, p in pairs if p.score == c]
        gold = [p for r, p in pairs if r["label"] == c]
        out["said"][c] = len(said)
        out["precision"][c] = sum(r["label"] == c for r in said) / len(said) if said else 1.0
        out["recall"][c] = sum(p.score == c for p in gold) / len(gold) if gold else 1.0
    out["accuracy"] = sum(r["label"] == p.score for r, p in pairs) / len(rows)
    directed = [(r, hint_category(p.hints[0] if p.hints else None)) for r, p in pairs if r["hint"]]
    out["hint_n"] = len(directed)
    out["hint_recall"] = sum(r["hint"] == got for r, got in directed) / len(directed)
    out["hint_by_category"] = {
        c: (
            sum(r["hint"] == got for r, got in directed if r["hint"] == c),
            sum(r["hint"] == c for r, _ in directed),
        )
        for c in CATEGORIES
    }
    out["spurious_hints"] = sum(bool(p.hints) for r, p in pairs if not r["hint"])
    out["misses"] = [
        (r["text"], r["label"], p.score, r["hint"], p.hints)
        for r, p in pairs
        if p.score != r["label"]
        or (r["hint"] and hint_category(p.hints[0] if p.hints else None) != r["hint"])
        or (p.hints and not r["hint"])
    ]
    return out
