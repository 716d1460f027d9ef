"""Sample checks and batch assembly bounded by samples, padded tokens and wait time.

The buffer keeps arrival order; a batch is always a prefix of it, so per partition the
trained records are a prefix too, and the next offset to consume is simply the first
record still buffered (or the poll position when none is).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.events import Sample
from pipeline.kafka import Record


def check_sample(sample: Sample, vocab_size: int, max_tokens: int) -> str | None:
    """Why this sample cannot be trained (None when it can). Such samples go to the DLQ."""
    n = len(sample.response_token_ids)
    if n == 0:
        return "empty response"
    if not sample.prompt_token_ids:
        return "empty prompt"
    if len(sample.loss_mask) != n or len(sample.behavior_logprobs) != n:
        return (
            f"lengths disagree: response_token_ids {n}, loss_mask {len(sample.loss_mask)}, "
            f"behavior_logprobs {len(sample.behavior_logprobs)}"
        )
    top = max(max(sample.prompt_token_ids), max(sample.response_token_ids))
    if top >= vocab_size:
        return f"token id {top} exceeds the vocabulary (size {vocab_size})"
    if not all(math.isfinite(x) for x in sample.behavior_logprobs):
        return "behavior_logprobs not finite"
    total = len(sample.prompt_token_ids) + n
    if total > max_tokens:
        return f"sequence of {total} tokens exceeds the batch token bound {max_tokens}"
    if not math.isfinite(sample.reward):
        return "reward not finite"
    return None


def seq_len(sample: Sample) -> int:
    return len(sample.prompt_token_ids) + len(sample.response_token_ids)


@dataclass
class Buffered:
    record: Record[Sample]
    arrived: float


@dataclass
class Batcher:
    """Buffer of checked samples; :meth:`take` hands out batches within every bound."""

    max_samples: int
    max_tokens: int
    max_wait_s: float
    clock: Callable[[], float] = time.monotonic
    buffer: deque[Buffered] = field(default_factory=deque)
    # Train what is buffered once no sample arrived for this long (0: off). Under load samples
    # keep arriving, so batches still fill; when traffic is light the last sample of a burst
    # is trained after idle_s instead of max_wait_s.
    idle_s: float = 0.0

    def add(self, record: Record[Sample]) -> None:
        self.buffer.append(Buffered(record, self.clock()))

    def __len__(self) -> int:
        return len(self.buffer)

    def _prefix_size(self) -> tuple[int, bool]:
        """How many head items fit, and whether a bound (not the buffer's end) stopped it."""
        count, longest = 0, 0
        for item in self.buffer:
            n = seq_len(item.record.event)
            longest_next = max(longest, n)
            if count == self.max_samples or longest_next * (count + 1) > self.max_tokens:
                return count, True
            count, longest = count + 1, longest_next
        return count, count == self.max_samples

    def ready(self, publish_now: bool = True) -> bool:
        """A full batch is available, the oldest sample waited long enough, or the input has
        been idle for ``idle_s``. The idle trigger only serves freshness, so it applies only
        when the step's version could be published at once (``publish_now``): while the
        publish budget holds versions back, an early partial batch would make nothing fresher
        and would spend steps (measured: under load it doubled freshness, 7.7 -> 13 s p50)."""
        if not self.buffer:
            return False
        _, full = self._prefix_size()
        now = self.clock()
        idle = publish_now and self.idle_s > 0 and now - self.buffer[-1].arrived >= self.idle_s
        return full or idle or now - self.buffer[0].arrived >= self.max_wait_s

    def take(self) -> list[Record[Sample]]:
        """Remove and return the largest head prefix within the bounds (at least one)."""
        count, _ = self._prefix_size()
        count = max(count, 1)  # a single sample always fits: check_sample bounds its length
        return [self.buffer.popleft().record for _ in range(min(count, len(self.buffer)))]

    def next_offsets(self, polled: dict[int, int]) -> dict[int, int]:
        """Next offset to consume per partition: first still-buffered record, else poll position."""
        out = dict(polled)
        seen: set[int] = set()
        for item in self.buffer:
            p = item.record.partition
            if p not in seen:
                seen.add(p)
                out[p] = item.record.offset
        return out
