"""Judges, pluggable by name: rule verifiers and an LLM PRM behind an OpenAI-compatible API.

A judge turns (turn context, next state) into a :class:`Verdict`: votes in {-1, 0, +1} (None for
an unparsable vote), their plurality, optional hint candidates and the error if it failed. A
judge never raises: a failure is a neutral verdict with the error recorded, so a worker is never
stuck or crashed by a judge.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from pipeline.events import Interaction, NextState

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
    score: int
    votes: list[int | None]
    rationale: str = ""
    hints: list[str] = field(default_factory=list)
    error: str | None = None


class Judge(Protocol):
    judge_id: str
    version: str

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict: ...


def plurality(votes: Sequence[int | None]) -> int:
    """Most common valid vote; a tie for first place or no valid vote gives 0."""
    counts = Counter(v for v in votes if v in (-1, 0, 1)).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return 0
    return counts[0][0]


def parse_vote(text: str | None) -> int | None:
    """The last ``\\boxed{1|-1|0}`` in a completion, else None (unparsable)."""
    found = BOXED.findall(text or "")
    if not found:
        return None
    value = int(found[-1])
    return value if value in (-1, 0, 1) else None


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
    version = "rules-judge-1"

    def __init__(
        self,
        corrections: Sequence[str] = DEFAULT_CORRECTIONS,
        thanks: Sequence[str] = DEFAULT_THANKS,
    ) -> None:
        self.corrections = tuple(p.lower() for p in corrections)
        self.thanks = tuple(p.lower() for p in thanks)

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        return self.verdict(state)

    def verdict(self, state: NextState) -> Verdict:
        if state.score is not None:
            s = (state.score > 0) - (state.score < 0)
            return Verdict(s, [s], f"explicit score {state.score:g}")
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
        """(text, error): never raises."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        error = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._sem:
                    resp = await self._client.post("/chat/completions", json=body)
                if resp.status_code == 429 or resp.status_code >= 500:
                    error = f"HTTP {resp.status_code}"
                    continue
                resp.raise_for_status()
                return resp.json()["choices"][0]["message"]["content"] or "", None
            except httpx.TimeoutException:
                error = "timeout"
            except httpx.TransportError as exc:
                error = f"transport: {type(exc).__name__}"
            except (httpx.HTTPStatusError, KeyError, IndexError, TypeError, ValueError) as exc:
                return None, f"bad response: {str(exc)[:200]}"
        return None, error


JudgeFactory = Callable[..., Judge]
REGISTRY: dict[str, JudgeFactory] = {}


def register(name: str, factory: JudgeFactory) -> None:
    """Plug in a judge by name (``LIVERL_PROCESSORS_JUDGE=<name>``)."""
    REGISTRY[name] = factory


def make_judge(name: str, **kwargs: Any) -> Judge:
    if name not in REGISTRY:
        raise ValueError(f"unknown judge {name!r}; known: {sorted(REGISTRY)}")
    return REGISTRY[name](**kwargs)


register("rules", lambda **_: RuleJudge())
register(
    "llm",
    lambda **kw: LlmJudge(
        kw["base_url"],
        kw["model"],
        api_key=kw.get("api_key"),
        votes=kw.get("votes", 3),
        timeout_s=kw.get("timeout_s", 30.0),
        retries=kw.get("retries", 2),
        concurrency=kw.get("concurrency", 8),
        hints=kw.get("hints", True),
    ),
)
