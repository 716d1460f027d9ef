"""librdkafka's log lines for the gateway's Kafka clients, with repeats folded.

While the broker is down every client logs each reconnect attempt ("Connect to ... failed:
Connection refused"): the weights reloader's consumer about 20 lines a second, the recorder's
producer about 5, so the gateway's log took 1,367 such lines in 70 s (issue 37). Here a line
is logged the first time, then a repeat of it at most once per ``every_s``, as one line that
says how many repeats it stands for. Lines are the same when they differ in digits only
(ports, client numbers, timings); any other line is logged at once.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from pipeline.kafka.producer import LIBRDKAFKA_LOG

EVERY_S = 30.0  # a repeated line is logged at most this often
_DIGITS = re.compile(r"\d+")


class FoldedLog:
    """A ``logger`` for librdkafka clients (confluent-kafka calls its ``log(level, fmt,
    *args)``): the first line of a kind at once, then at most one line per ``every_s`` for its
    repeats, with their count. Thread-safe: each client's log queue is served by the thread
    that polls it."""

    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = EVERY_S,
        *,
        max_kinds: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.every_s = every_s
        self.max_kinds = max_kinds
        self.clock = clock
        self._next: dict[tuple[int, str], tuple[float, int]] = {}  # kind: (next line, folded)
        self._lock = threading.Lock()

    def log(self, level: int, msg: str, *args: Any) -> None:
        text = msg % args if args else msg
        kind = (level, _DIGITS.sub("#", text))
        now = self.clock()
        with self._lock:
            due, folded = self._next.get(kind, (now, 0))
            if now < due:
                self._next[kind] = (due, folded + 1)
                return
            self._next.pop(kind, None)  # re-inserted last: the oldest kind is evicted first
            if len(self._next) >= self.max_kinds:
                del self._next[next(iter(self._next))]
            self._next[kind] = (now + self.every_s, 0)
        if folded:
            text = f"{text} [repeated {folded} more time(s) since last logged]"
        self.logger.log(level, "%s", text)


# One for the whole process: a producer re-created after a failed round (or a consumer of
# another component of the gateway) repeats the same lines and is folded with them.
GATEWAY_KAFKA_LOG = FoldedLog(LIBRDKAFKA_LOG)
