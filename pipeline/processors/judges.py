"""Judges, pluggable by name: the reply judge (default), rule verifiers and an LLM PRM behind an
OpenAI-compatible API.

A judge turns (turn context, next state) into a :class:`Verdict`: votes in {-1, 0, +1} (None for
an unparsable vote), their plurality, optional hint candidates and the error if it failed. A
judge never raises: a failure is a neutral verdict with the error recorded, so a worker is never
stuck or crashed by a judge.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import yaml
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from pipeline.events import Interaction, NextState
from pipeline.events.types import Vote
from pipeline.processors.gui import gui_vote

# The registry lives in judge_registry.py (light: loading the settings checks the judge's name
# and options without importing this module); re-exported here, where plug-ins look for it.
from pipeline.processors.judge_registry import JUDGES as JUDGES
from pipeline.processors.judge_registry import LlmJudgeOptions as LlmJudgeOptions
from pipeline.processors.judge_registry import register as register
from pipeline.processors.verification import no_outcome_reason

BOXED = re.compile(r"\\boxed\{\s*([+-]?\d+)\s*\}")
HINT = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.DOTALL)


@dataclass(frozen=True)
class TurnContext:
    """What a judge sees of the turn: the last user request and the answer (text, tool calls)."""

    session_id: str
    turn: int
    request: str
    answer: str

    @classmethod
    def from_interaction(cls, inter: Interaction) -> TurnContext:
        return cls(inter.session_id, inter.turn, last_user_text(inter.messages), answer_text(inter))


@dataclass
class Verdict:
    score: Vote
    votes: list[Vote | None]
    rationale: str = ""
    hints: list[str] = field(default_factory=list)
    error: str | None = None
    # A panel's members ({judge_id, judge_version, vote, weight}) and the version the verdict
    # was made under when it is not the judge's ``version`` now (weights read live).
    members: list[dict[str, Any]] | None = None
    version: str | None = None


class Judge(Protocol):
    """A judge may set ``inline = False`` (the LLM PRM does): the worker then runs it in its
    own agent, batched and concurrent, instead of awaiting it inside the session agent, which
    suits judges that answer in microseconds (rules, replies; the default when absent)."""

    judge_id: str
    version: str

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict: ...


def as_vote(value: object) -> Vote | None:
    """``value`` as a vote if it equals -1, 0 or 1, else None."""
    if value == 1:
        return 1
    if value == -1:
        return -1
    if value == 0:
        return 0
    return None


def sign(x: float) -> Vote:
    """-1, 0 or 1 as ``x`` is negative, zero or positive."""
    return 1 if x > 0 else -1 if x < 0 else 0


def plurality(votes: Sequence[Vote | None]) -> Vote:
    """Most common valid vote; a tie for first place or no valid vote gives 0."""
    counts = Counter(v for v in votes if v is not None).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return 0
    return counts[0][0]


def parse_vote(text: str | None) -> Vote | None:
    """The last ``\\boxed{1|-1|0}`` in a completion, else None (unparsable)."""
    found = BOXED.findall(text or "")
    if not found:
        return None
    return as_vote(int(found[-1]))


def select_hints(texts: Sequence[str | None], limit: int = 3, min_len: int = 11) -> list[str]:
    """Hints between the markers, longer than 10 characters, deduplicated, shortest first."""
    found: set[str] = set()
    for text in texts:
        for raw in HINT.findall(text or ""):
            hint = " ".join(raw.split())
            if len(hint) >= min_len:
                found.add(hint)
    return sorted(found, key=lambda h: (len(h), h))[:limit]


def last_user_text(messages: Sequence[dict[str, Any]]) -> str:
    for msg in reversed(messages):
        if msg.get("role") == "user":
            return content_text(msg.get("content"))
    return ""


def answer_text(inter: Interaction) -> str:
    calls = "".join(
        f"\n[tool call] {c.get('function', {}).get('name', '?')}"
        f"({c.get('function', {}).get('arguments', '')})"
        for c in inter.tool_calls
    )
    return (inter.response_text or "") + calls


def content_text(content: Any) -> str:
    """OpenAI message content as text (string, or list of parts with ``text``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def gui_verdict(state: NextState, request: str) -> Verdict | None:
    """A ``gui`` next state's vote from its screen diff (``processors/gui.py``): the goal is
    the one posted with it, else the turn's request; None for any other next state."""
    gui = state.detail.get("gui")
    if state.kind != "gui" or not isinstance(gui, Mapping):
        return None
    goal = gui.get("goal")
    r = gui_vote(gui, goal if isinstance(goal, str) and goal else request)
    return Verdict(r.score, [r.score], r.rationale, r.hints)


# ---- rule verifiers --------------------------------------------------------------------------

DEFAULT_CORRECTIONS = (
    "still fail",
    "still broken",
    "doesn't work",
    "does not work",
    "didn't work",
    "not working",
    "wrong",
    "that's not",
    "not what i",
    "undo",
    "revert",
    "try again",
    "no,",
)
DEFAULT_THANKS = ("thanks", "thank you", "perfect", "great, it works", "works now", "lgtm", "nice")


class RuleJudge:
    """Verifiable signals first (exit code, explicit score), then phrase lists on replies.

    Corrections beat thanks ("thanks, but it still fails" is a correction). Tool output and a
    bare session end carry no verdict (0): a rule judge must not guess.
    """

    judge_id = "rules"
    version = "rules-judge-2"  # 2: gui next states scored from their screen diff

    def __init__(
        self,
        corrections: Sequence[str] = DEFAULT_CORRECTIONS,
        thanks: Sequence[str] = DEFAULT_THANKS,
    ) -> None:
        self.corrections = tuple(p.lower() for p in corrections)
        self.thanks = tuple(p.lower() for p in thanks)

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        return self.verdict(state, ctx.request if ctx is not None else "")

    def verdict(self, state: NextState, request: str = "") -> Verdict:
        if (why := no_outcome_reason(state)) is not None:
            return Verdict(0, [0], f"no outcome: {why}")
        if state.score is not None:
            s = sign(state.score)
            return Verdict(s, [s], f"explicit score {state.score:g}")
        if (gui := gui_verdict(state, request)) is not None:
            return gui
        if state.exit_code is not None:
            s = 1 if state.exit_code == 0 else -1
            return Verdict(s, [s], f"exit code {state.exit_code}")
        if state.kind in ("user_reply", "feedback"):
            text = state.content.lower()
            hit = next((p for p in self.corrections if p in text), None)
            if hit:
                return Verdict(-1, [-1], f"correction phrase {hit!r}")
            hit = next((p for p in self.thanks if p in text), None)
            if hit:
                return Verdict(1, [1], f"thanks phrase {hit!r}")
        return Verdict(0, [0], f"no verifiable signal in {state.kind}")


# ---- reply judge (the default) -----------------------------------------------------------------

DEFAULT_REPLY_RULES = Path(__file__).with_name("rules") / "replies.yaml"
CJK = re.compile(r"[\u3000-\u303f\u3400-\u9fff\uf900-\ufaff\uff00-\uffef]")
QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})
SENTENCE = re.compile(r"(?<=[.!?])\s+|(?<=[。！？；;])|\n+")
CLAUSE = re.compile(r"[,;:，、；：]|\s[-\u2013\u2014]+\s|\u2014")
PLEASE = re.compile(r"[\s,]*\b(?:please|pls|plz)\b[\s,]*|请", re.IGNORECASE)
WORD = re.compile(r"[\w']+")
JUST = re.compile(r"\s*just\b", re.IGNORECASE)
TLDR = re.compile(r"\btl\s*;\s*dr\b", re.IGNORECASE)  # its ";" is no clause boundary
CONTRASTIVE_NOT = re.compile(r"\s*not (?:a|an|the)\b", re.IGNORECASE)


def _decap(text: str) -> str:
    """Lower-case the first letter unless the first word is "I" or an acronym."""
    word = text.split(" ", 1)[0]
    if word == "I" or word.startswith("I'") or (len(word) > 1 and word.isupper()):
        return text
    return text[:1].lower() + text[1:]


def _rx(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


def text_width(text: str) -> int:
    """Display columns: a CJK character counts two (select_hints' 11 characters are English)."""
    return sum(2 if CJK.match(ch) else 1 for ch in text)


@dataclass(frozen=True)
class ReplyRules:
    """The patterns of ``rules/replies.yaml`` (see the comments there), compiled."""

    version: str
    corrections: tuple[re.Pattern[str], ...]
    approvals: tuple[re.Pattern[str], ...]
    negation_en: re.Pattern[str]
    window_words: int
    negation_zh: re.Pattern[str]
    window_chars: int
    contrast: re.Pattern[str]
    lead: re.Pattern[str]
    tail: re.Pattern[str]
    marker: re.Pattern[str]
    verbs: re.Pattern[str]
    style_verbs: re.Pattern[str]
    style: re.Pattern[str]
    obj: re.Pattern[str]
    new_task: re.Pattern[str]
    not_directive: re.Pattern[str]
    not_noun_phrase: re.Pattern[str]
    noun_phrases: tuple[tuple[re.Pattern[str], str, bool], ...]
    chinese_verbs: re.Pattern[str]
    min_width: int
    max_chars: int
    positive: float
    negative: float
    question_negative: float
    implied: tuple[tuple[re.Pattern[str], str], ...] = ()
    factual: re.Pattern[str] = re.compile(r"(?!)")
    denial: re.Pattern[str] = re.compile(r"(?!)")
    fact: re.Pattern[str] = re.compile(r"(?!)")
    fact_hint: str = "Correction: {0}"
    factual_hint: str = ""
    sarcasm: re.Pattern[str] = re.compile(r"(?!)")

    @classmethod
    def load(cls, path: Path | str = DEFAULT_REPLY_RULES) -> ReplyRules:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        neg, d = raw["negation"], raw["directive"]
        imp, fx = raw.get("implied", []), raw.get("facts", {})
        # `LANGUAGES` in a directive pattern stands for the alternation of `languages`.
        langs = "|".join(raw.get("languages", ["english", "chinese"]))
        d = {k: v.replace("LANGUAGES", langs) if isinstance(v, str) else v for k, v in d.items()}
        d["noun_phrases"] = [
            {**n, "pattern": n["pattern"].replace("LANGUAGES", langs)} for n in d["noun_phrases"]
        ]
        never = "(?!)"
        return cls(
            version=str(raw["version"]),
            corrections=tuple(_rx(p) for p in raw["corrections"]),
            approvals=tuple(_rx(p) for p in raw["approvals"]),
            negation_en=_rx(f"^(?:{neg['english']})$"),
            window_words=int(neg["english_window_words"]),
            negation_zh=_rx(neg["chinese"]),
            window_chars=int(neg["chinese_window_chars"]),
            contrast=_rx(raw["contrast"]),
            lead=_rx(d["lead"]),
            tail=_rx(d["tail"]),
            marker=_rx(d["marker"]),
            verbs=_rx(d["verbs"]),
            style_verbs=_rx(d["style_verbs"]),
            style=_rx(d["style"]),
            obj=_rx(d["object"]),
            new_task=_rx(d["new_task"]),
            not_directive=_rx(d["not_directive"]),
            not_noun_phrase=_rx(d["not_noun_phrase"]),
            noun_phrases=tuple(
                (_rx(n["pattern"]), str(n["hint"]), bool(n.get("marker_only", False)))
                for n in d["noun_phrases"]
            ),
            chinese_verbs=_rx(d["chinese_verbs"]),
            min_width=int(raw["hint"]["min_width"]),
            max_chars=int(raw["hint"]["max_chars"]),
            positive=float(raw["sentiment"]["positive"]),
            negative=float(raw["sentiment"]["negative"]),
            question_negative=float(raw["sentiment"]["question_negative"]),
            implied=tuple((_rx(i["pattern"]), str(i["hint"])) for i in imp),
            factual=_rx(fx.get("factual", never)),
            denial=_rx(fx.get("denial", never)),
            fact=_rx(fx.get("statement", never)),
            fact_hint=str(fx.get("hint", "Correction: {0}")),
            factual_hint=str(fx.get("factual_hint", "")),
            sarcasm=_rx(raw.get("sarcasm", never)),
        )


def normalise_hint(text: str, *, min_width: int = 11, max_chars: int = 160) -> str | None:
    """A hint as the OPD teacher reads it: one instruction, capitalised, ending with a period
    (。 after Chinese), without "please", at most ``max_chars`` characters (cut at a word), and
    at least ``min_width`` columns wide (else None)."""
    text = " ".join(PLEASE.sub(" ", text.translate(QUOTES)).split())
    text = re.sub(r"\s+([,.;:!?])", r"\1", text).strip(" ,;:-\u2013\u2014")
    text = re.sub(r"[\s.!?,;:。！？，；]+$", "", text)
    if len(text) > max_chars - 1:
        text = text[: max_chars - 1].rsplit(" ", 1)[0].rstrip(" ,;:")
    if not text:
        return None
    text = re.sub(r"\bi(?=\b|')", "I", text)
    text = text[0].upper() + text[1:] + ("。" if CJK.match(text[-1]) else ".")
    return text if text_width(text) >= min_width else None


@dataclass(frozen=True)
class Reading:
    """What a reply says: a vote, why, and the hint of a directive correction (if any)."""

    score: Vote
    rationale: str
    hints: list[str]


class ReplyJudge:
    """The default judge: verifiable signals first, then the user's reply read by patterns.

    Explicit scores and exit codes decide as in :class:`RuleJudge`. A user reply or feedback
    text is read with the patterns of ``rules/replies.yaml``: a directive about the answer's
    form ("Use simple steps please.") is a correction whose directive becomes the hint ("Use
    simple steps."); otherwise correction and approval cues with negation and contrast ("thanks,
    but it still fails" is a correction); without any cue, vaderSentiment's compound score
    (a lexicon shipped in its wheel). Tool output and a bare session end carry no verdict.
    """

    judge_id = "replies"

    def __init__(self, rules: ReplyRules | Path | str | None = None) -> None:
        self.rules = (
            rules
            if isinstance(rules, ReplyRules)
            else ReplyRules.load(rules or DEFAULT_REPLY_RULES)
        )
        self.version = f"replies-judge-2/{self.rules.version}"  # 2: gui next states
        self._vader: Any = None

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        return self.verdict(state, ctx.request if ctx is not None else "")

    def verdict(self, state: NextState, request: str = "") -> Verdict:
        reply = state.kind in ("user_reply", "feedback") and bool(state.content.strip())
        if (why := no_outcome_reason(state)) is not None:
            return Verdict(0, [0], f"no outcome: {why}")
        if state.score is not None:
            s = sign(state.score)
            # A thumbs-down with a directive ("please answer in one sentence") keeps its hint.
            hints = self.read(state.content).hints if s < 0 and reply else []
            return Verdict(s, [s], f"explicit score {state.score:g}", hints)
        if (gui := gui_verdict(state, request)) is not None:
            return gui
        if state.exit_code is not None:
            s = 1 if state.exit_code == 0 else -1
            return Verdict(s, [s], f"exit code {state.exit_code}")
        if reply:
            r = self.read(state.content)
            return Verdict(r.score, [r.score], r.rationale, r.hints)
        return Verdict(0, [0], f"no verifiable signal in {state.kind}")

    # -- reading a reply -----------------------------------------------------------------------

    def read(self, text: str) -> Reading:
        text = TLDR.sub("tldr", " ".join(text.translate(QUOTES).split()))
        sentences = [s.strip() for s in SENTENCE.split(text) if s and s.strip()]
        fragments = self.directives(sentences)
        if fragments:
            # A directive too short to be a hint ("Summarize.") still names what it wants.
            hints = self._hint(fragments) or self._implied(fragments)
            return Reading(-1, f"directive {fragments[0]!r}", hints)
        found = self.cues(text, sentences)
        cut = max((m.start() for m in self.rules.contrast.finditer(text) if m.start()), default=0)
        late = [c for c in found if c[0] >= cut]
        used = late if cut and late else found
        bad = [(cue, hint) for _, pol, cue, hint in used if pol < 0]
        good = [cue for _, pol, cue, _ in used if pol > 0]
        if not bad and self.rules.sarcasm.search(text):
            return Reading(-1, "sarcasm: a closing 'not'", [])
        if bad:
            return Reading(-1, f"correction cue {bad[0][0]!r}", self._correction_hint(text, bad))
        if good:
            return Reading(1, f"approval cue {good[0]!r}", [])
        compound = self.sentiment(text)
        question = text.rstrip().endswith(("?", "？"))
        if compound <= (self.rules.question_negative if question else self.rules.negative):
            return Reading(-1, f"sentiment {compound:+.2f}", [])
        if compound >= self.rules.positive and not question:
            return Reading(1, f"sentiment {compound:+.2f}", [])
        return Reading(0, f"no cue, sentiment {compound:+.2f}", [])

    def cues(self, text: str, sentences: Sequence[str]) -> list[tuple[int, int, str, str | None]]:
        """(offset, polarity, cue, implied hint) of every cue, negation applied (a flipped cue
        implies no hint), cues inside longer cues dropped, approvals inside questions ignored.
        Implied cues are read per clause, lead and tail stripped, never in a new task."""
        r = self.rules
        spans: list[tuple[int, int, int, str | None]] = []
        for pol, patterns in ((-1, r.corrections), (1, r.approvals)):
            for pat in patterns:
                spans += [
                    (m.start(), m.end(), pol, None)
                    for m in pat.finditer(text)
                    if m.end() > m.start()
                ]
        for at, clause in self._clauses(text):
            if r.new_task.search(clause):
                continue
            for pat, template in r.implied:
                m = pat.search(clause)
                if m and m.end() > m.start():
                    parts = [_decap(p or "") for p in (m.group(0), *m.groups())]
                    spans.append((at + m.start(), at + m.end(), -1, template.format(*parts)))
        kept = [
            s
            for s in spans
            if not any(
                o != s and o[0] <= s[0] and s[1] <= o[1] and o[1] - o[0] > s[1] - s[0]
                for o in spans
            )
        ]
        questions, pos = [], 0
        for sent in sentences:
            start = text.find(sent, pos)
            pos = start + len(sent)
            if sent.endswith(("?", "？")):
                questions.append((start, pos))
        out = []
        for start, end, pol, hint in sorted(set(kept), key=lambda s: (s[0], s[1], s[2])):
            if self._negated(text, start, contrastive=hint is not None):
                pol, hint = -pol, None
            if pol > 0 and any(a <= start < b for a, b in questions):
                continue
            out.append((start, pol, text[start:end], hint))
        return out

    def _strip(self, clause: str) -> str:
        """The clause without its `lead` and `tail` (repeatedly)."""
        c = clause.strip()
        while True:
            stripped = self.rules.tail.sub("", self.rules.lead.sub("", c, count=1), count=1)
            if stripped.strip() == c:
                return c
            c = stripped.strip()

    def _clauses(self, text: str) -> list[tuple[int, str]]:
        """(offset in ``text``, clause without lead and tail) of every non-empty clause."""
        out, pos = [], 0
        for sentence in SENTENCE.split(text):
            for clause in CLAUSE.split(sentence or ""):
                start = text.find(clause, pos)
                if start < 0:
                    continue
                pos = start + len(clause)
                c = self._strip(clause)
                if c:
                    out.append((start + clause.find(c), c))
        return out

    def _implied(self, fragments: Sequence[str]) -> list[str]:
        """The hint an `implied` pattern gives the first fragment it matches (else none)."""
        for frag in fragments:
            for pat, template in self.rules.implied:
                m = pat.search(frag)
                if m:
                    parts = [_decap(p or "") for p in (m.group(0), *m.groups())]
                    return self._norm([template.format(*parts)])
        return []

    def _correction_hint(self, text: str, bad: Sequence[tuple[str, str | None]]) -> list[str]:
        """A correction's hint: what its first implying cue implies ("too wordy": keep it
        short); else, after a factual cue ("wrong", "no"), the user's statement of the fact
        ("wrong, it's 1945": correction: it's 1945), or without one a generic fact check."""
        r = self.rules
        implied = next((h for _, h in bad if h), None)
        if implied:
            return self._norm([implied])
        factual = bool(r.factual.search(text))
        if not factual and not any(r.denial.search(c) for c, _ in bad):
            return []
        for at, clause in self._clauses(text):
            if r.fact.match(clause) and not r.factual.search(clause):
                end = next((m.start() for m in SENTENCE.finditer(text, at)), len(text))
                return self._norm([r.fact_hint.format(text[at:end].strip())])
        return self._norm([r.factual_hint]) if factual and r.factual_hint else []

    def _norm(self, hints: Sequence[str]) -> list[str]:
        r = self.rules
        out = [normalise_hint(h, min_width=r.min_width, max_chars=r.max_chars) for h in hints]
        return [h for h in out if h]

    def _negated(self, text: str, start: int, contrastive: bool = False) -> bool:
        """A negator shortly before the cue in its clause; for an implied cue, not the
        contrastive "A, not B" ("a quick answer, not an essay" complains about the essay)."""
        sentence = re.split(r"[.!?。！？]", text[:start])[-1]
        before = CLAUSE.split(sentence)[-1]
        if CJK.search(text[start : start + 1]):
            return bool(self.rules.negation_zh.search(before[-self.rules.window_chars :]))
        if (
            contrastive
            and before != sentence
            and CONTRASTIVE_NOT.match(before + text[start : start + 4])
        ):
            return False
        words = WORD.findall(before)[-self.rules.window_words :]
        return any(self.rules.negation_en.match(w) for w in words)

    def directives(self, sentences: Sequence[str]) -> list[str]:
        """Every directive clause as an instruction; a later one keeps its "just"."""
        out: list[str] = []
        for sentence in sentences:
            for clause in CLAUSE.split(sentence):
                frag = self.directive(clause)
                if frag:
                    out.append(f"just {_decap(frag)}" if out and JUST.match(clause) else frag)
        return out

    def directive(self, clause: str) -> str | None:
        """The clause as an instruction if it is a directive about the answer's form."""
        r = self.rules
        marker = bool(r.marker.search(clause))
        c = self._strip(clause)
        if not c or r.new_task.search(c) or r.not_directive.search(c):
            return None
        if CJK.search(c):
            return c if r.chinese_verbs.match(c) else None
        verb = r.verbs.match(c)
        if verb:
            rest = c[verb.end() :]
            if r.style_verbs.match(c) or r.style.search(rest) or r.obj.match(c):
                return c
            return None
        if r.not_noun_phrase.search(c):
            return None
        for pat, template, marker_only in r.noun_phrases:
            m = pat.match(c)
            if m and (marker or (not marker_only and r.style.search(c))):
                parts = [_decap(p or "") for p in (m.group(0), *m.groups())]
                return template.format(*parts)
        return None

    def _hint(self, fragments: Sequence[str]) -> list[str]:
        """The directive clauses as one normalised instruction (clauses beyond the length
        bound are dropped)."""
        r = self.rules
        text = fragments[0]
        for f in fragments[1:]:
            more = f"{text}, {f[:1].lower()}{f[1:]}" if not CJK.match(f) else f"{text}，{f}"
            if len(more) >= r.max_chars:
                break
            text = more
        hint = normalise_hint(text, min_width=r.min_width, max_chars=r.max_chars)
        return [hint] if hint else []

    def sentiment(self, text: str) -> float:
        """vaderSentiment's compound score in [-1, 1]; 0 for Chinese (its lexicon is English)."""
        if CJK.search(text):
            return 0.0
        text = PLEASE.sub(" ", text)  # politeness, which VADER scores as positive
        if self._vader is None:
            from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

            self._vader = SentimentIntensityAnalyzer()
        return float(self._vader.polarity_scores(text)["compound"])


# ---- LLM PRM ---------------------------------------------------------------------------------

PRM_PROMPT = """You are a process reward model. Judge whether the assistant's answer was good, \
using what happened next (the user's reply, tool output, or environment result) as evidence.

## User request
{request}

## Assistant answer
{answer}

## What happened next ({kind})
{next_state}

Reason briefly. Then end with exactly one of \\boxed{{1}} (the answer helped or was \
accepted), \\boxed{{-1}} (it was wrong, rejected or caused an error) or \\boxed{{0}} (no \
evidence either way)."""

HINT_PROMPT = """You review an assistant's answer using what happened next as evidence.

## User request
{request}

## Assistant answer
{answer}

## What happened next ({kind})
{next_state}

Does what happened next reveal a concrete, actionable improvement the assistant should have \
made? If yes, state it as one instruction between [HINT_START] and [HINT_END] and end with \
\\boxed{{1}}. If not, end with \\boxed{{-1}}."""


class LlmJudge:
    """OpenClaw-style PRM: m votes (concurrently), plurality wins; optional hint extraction.

    Each request has a timeout and retries with exponential backoff on timeouts, connection
    errors, 429 and 5xx; a shared semaphore bounds concurrent requests across turns.
    """

    version = "prm-1"
    inline = False  # network calls: its own agent, batched (app.py)

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        votes: int = 3,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        concurrency: int = 8,
        hints: bool = True,
        temperature: float = 0.6,
        max_tokens: int = 512,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.judge_id = f"llm:{model}"
        self.model = model
        self.votes = votes
        self.retries = retries
        self.backoff_s = backoff_s
        self.hints = hints
        self.temperature = temperature
        self.max_tokens = max_tokens
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers
        )
        self._sem = asyncio.Semaphore(concurrency)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        fields = {
            "request": ctx.request[-4000:],
            "answer": ctx.answer[-4000:],
            "kind": state.kind,
            "next_state": state.content[-4000:],
        }
        prm = [self._complete(PRM_PROMPT.format(**fields)) for _ in range(self.votes)]
        hint = [
            self._complete(HINT_PROMPT.format(**fields))
            for _ in range(self.votes if self.hints else 0)
        ]
        results = await asyncio.gather(*prm, *hint)
        prm_out, hint_out = results[: self.votes], results[self.votes :]
        votes = [parse_vote(text) for text, _ in prm_out]
        errors = sorted({err for _, err in results if err})
        accepted = [text for text, _ in hint_out if parse_vote(text) == 1]
        rationale = next((t for t, _ in prm_out if t), "") or ""
        return Verdict(
            plurality(votes),
            votes,
            rationale[-1000:],
            select_hints(accepted),
            "; ".join(errors) if errors else None,
        )

    async def _complete(self, prompt: str) -> tuple[str | None, str | None]:
        """(text, error): never raises. Timeouts, connection errors, 429 and 5xx are retried
        with exponential backoff (tenacity); any other failure is final."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential(multiplier=self.backoff_s, exp_base=2),
            retry=retry_if_exception_type(_Transient),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._request(body)
        except _Transient as exc:
            return None, str(exc)
        except (httpx.HTTPStatusError, KeyError, IndexError, TypeError, ValueError) as exc:
            return None, f"bad response: {str(exc)[:200]}"
        return None, "no attempt"  # pragma: no cover - stop_after_attempt(>= 1) always tries

    async def _request(self, body: dict[str, Any]) -> tuple[str | None, str | None]:
        try:
            async with self._sem:
                resp = await self._client.post("/chat/completions", json=body)
        except httpx.TimeoutException:
            raise _Transient("timeout") from None
        except httpx.TransportError as exc:
            raise _Transient(f"transport: {type(exc).__name__}") from None
        if resp.status_code == 429 or resp.status_code >= 500:
            raise _Transient(f"HTTP {resp.status_code}")
        resp.raise_for_status()
        return resp.json()["choices"][0]["message"]["content"] or "", None


class _Transient(Exception):
    """A failure worth retrying; its message is the error reported when retries run out."""


def make_judge(name: str, options: Mapping[str, Any] | None = None, **kw: Any) -> Judge:
    """The judge ``name`` built from its options (a mapping, or keywords)."""
    judge: Judge = JUDGES.get(name).item(JUDGES.options(name, {**(options or {}), **kw}))
    return judge
