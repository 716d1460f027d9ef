"""One simulated session through an OpenAI-compatible liverl gateway (no Kafka here).

Turn 0: the user asks the question; its answer is judged. Then the user's reply is sent as the
next user message in a second request with ``X-Session-Done: true``: the gateway records the
reply as the next state of turn 0 and closes the session. The second request's own answer is
not judged (``max_tokens=1``). ``train=False`` sends ``X-Liverl-Train: false`` on both
requests, so nothing is recorded (held-out evaluation). ``thumbs=True``: before replying, the
user also rates the answer through ``POST /v1/feedback`` (up when satisfied), the verifiable
outcome that ``liverl judges compare`` checks the judges against.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import httpx

from .questions import Question
from .users import Judgement, SimUser

_FINGERPRINT = re.compile(r"liverl-v(\d+)")


def weight_version(fingerprint: str | None) -> int | None:
    """``"liverl-v3"`` → 3; anything else → None."""
    match = _FINGERPRINT.search(fingerprint or "")
    return int(match.group(1)) if match else None


@dataclass
class TurnResult:
    user_id: str
    session_id: str
    question: Question
    answer: str
    judgement: Judgement
    reply: str
    weight_version: int | None  # from the answer's system_fingerprint "liverl-vN"
    latency_s: float  # the first request, sent to answer received
    prompt: str = ""  # the user message actually sent (the question, or question + hint)
    replied_at: float = 0.0  # time.time() when the reply was sent (0.0: not sent)
    thumbs: str | None = None  # "up" / "down" when the user rated the answer


def run_session(
    client: Any,
    model: str,
    user: SimUser,
    question: Question,
    *,
    session_id: str,
    max_tokens: int = 64,
    temperature: float = 0.7,
    train: bool = True,
    extra_headers: dict | None = None,
    prompt: str | None = None,
    send_reply: bool = True,
    thumbs: bool = False,
) -> TurnResult:
    """Ask, judge, reply. ``prompt`` overrides the user message (e.g. question + hint, to
    measure what the model does when told); ``send_reply=False`` skips the second request."""
    headers = {**(extra_headers or {}), "X-Session-Id": session_id}
    if not train:
        headers["X-Liverl-Train"] = "false"
    asked = prompt if prompt is not None else question.text
    messages = [{"role": "user", "content": asked}]
    started = time.monotonic()
    response = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        extra_headers=headers,
    )
    latency = time.monotonic() - started
    answer = response.choices[0].message.content or ""
    judgement = user.judge(question, answer)
    reply = user.reply(judgement)
    rated = None
    if thumbs and train:
        # while the session is open, so "last" names turn 0 and the reward waits for it
        rated = "up" if judgement.satisfied else "down"
        client.post(
            "/feedback",
            cast_to=httpx.Response,
            body={"session_id": session_id, "turn": "last", "thumbs": rated},
        )
    replied_at = 0.0
    if send_reply:
        replied_at = time.time()
        client.chat.completions.create(
            model=model,
            messages=[
                *messages,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": reply},
            ],
            max_tokens=1,
            temperature=temperature,
            extra_headers={**headers, "X-Session-Done": "true"},
        )
    return TurnResult(
        user_id=user.user_id,
        session_id=session_id,
        question=question,
        answer=answer,
        judgement=judgement,
        reply=reply,
        weight_version=weight_version(getattr(response, "system_fingerprint", None)),
        latency_s=latency,
        prompt=asked,
        replied_at=replied_at,
        thumbs=rated,
    )
