"""The gate's LLM judge: an OpenAI-compatible chat model says which of two answers is better.

Optional (``trainer.gate_llm_url``). The two answers are shown in an order fixed by the
prompt's hash, so a judge that prefers "the first answer" does not always favour one side. A
judge that cannot be reached, or replies with anything but A, B or TIE, abstains (vote 0): the
gate never waits on it beyond its timeout, and never fails because of it.
"""

from __future__ import annotations

import hashlib
import logging
import re
import urllib.request
from typing import Any

import orjson

log = logging.getLogger(__name__)

PROMPT = (
    "You compare two answers of an assistant to the same user message.\n\n"
    "User message:\n{question}\n\nAnswer A:\n{a}\n\nAnswer B:\n{b}\n\n"
    "Which answer is better: correct, on topic, fluent, and following the user's request? "
    "Reply with exactly one word: A, B or TIE."
)
_WORD = re.compile(r"\b(A|B|TIE)\b")


class LlmJudge:
    def __init__(self, base_url: str, model: str, *, timeout_s: float = 30.0) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        if not base_url.rstrip("/").endswith("/v1"):
            self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.model = model
        self.timeout_s = timeout_s

    def compare(self, question: str, candidate: str, live: str) -> int:
        """+1 candidate better, −1 live better, 0 tie or no usable answer."""
        return self.judge(question, candidate, live) or 0

    def judge(self, question: str, candidate: str, live: str) -> int | None:
        """+1 candidate better, −1 live better, 0 a tie; None when it gave no usable answer
        (unreachable, or a reply that is not A, B or TIE): an abstention, which the gate
        does not count as a decided prompt."""
        flip = hashlib.sha256(question.encode()).digest()[0] & 1 == 1
        a, b = (live, candidate) if flip else (candidate, live)
        body = {
            "model": self.model,
            "temperature": 0,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": PROMPT.format(question=question, a=a, b=b)}],
        }
        try:
            reply = self._post(body)
        except Exception as exc:  # noqa: BLE001 - the judge abstains, the gate goes on
            log.warning("gate LLM judge unavailable (%s): abstaining", exc)
            return None
        found = _WORD.search(reply.upper())
        if found is None:
            return None
        if found.group(1) == "TIE":
            return 0
        first_wins = found.group(1) == "A"
        return 1 if first_wins != flip else -1

    def _post(self, body: dict[str, Any]) -> str:
        req = urllib.request.Request(
            self.url,
            data=orjson.dumps(body),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310
            doc = orjson.loads(resp.read(1 << 20))
        return str(doc["choices"][0]["message"]["content"] or "")
