"""What the gateway needs from an engine: exact sampled token ids, their log-probs, the version.

Log-prob basis (both backends, and what the trainer recomputes as ℓ_cur): the log-probability
of each sampled token under the model's *raw* distribution, log_softmax(logits) at temperature
1 with no top-p truncation. It does not depend on the request's sampling knobs, so one forward
pass of the trainer's policy reproduces it; the sampling knobs are recorded next to it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

StopReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    # The caller reads pieces as they come (a streamed answer). False: it waits for the whole
    # answer, so an engine may send it at once (SGLang: one non-streaming call, not one event
    # per token, each repeating all tokens so far).
    incremental: bool = True


@dataclass(slots=True)
class Piece:
    """Newly generated tokens (usually one) and their log-probs."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass(slots=True)
class Done:
    """End of a generation: why it stopped and which weight version produced all of it."""

    finish_reason: StopReason
    weight_version: int


class Backend(Protocol):
    """An engine serving up to two weight versions at once: the stable arm (everyone) and,
    during a canary, the canary arm (the users the gateway routes there). Each request
    snapshots its arm's weights when it starts, so an arm can change under it safely."""

    policy_id: str
    tokenizer: Any
    context_length: int

    @property
    def version(self) -> int:
        """The stable arm's version."""
        ...

    @property
    def canary(self) -> tuple[int, float] | None:
        """(version, share of users) of the canary arm; None when there is none."""
        ...

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, canary: bool = False
    ) -> AsyncIterator[Piece | Done]:
        """Yield pieces as they are produced, then exactly one Done (with the version that
        produced them). ``canary``: on the canary arm, or the stable one if there is none."""
        ...

    async def reload(self, path: Path, version: int) -> None:
        """Serve weights from a verified local dir on the stable arm (a newer or an older
        version: the reloader decides); must not fail or block serving requests."""
        ...

    async def load_canary(self, path: Path, version: int, share: float) -> None:
        """Serve weights from a verified local dir on the canary arm."""
        ...

    async def drop_canary(self) -> None:
        """No canary arm any more (running requests finish on it)."""
        ...

    async def serve_base(self) -> None:
        """The stable arm back to the weights the backend started with."""
        ...

    async def close(self) -> None: ...
