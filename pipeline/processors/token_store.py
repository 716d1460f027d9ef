"""Token payloads of the turns a worker holds: in memory, read back from ``interactions``.

A turn's token ids and log-probs are nearly all of its bytes, and the interactions topic has
them already. Workers used to write each payload to a changelogged table (``tokens``) and a
tombstone once the session was assembled: two of the ~8 records a turn cost, and most of
their bytes, to say again what one record said. Now the session state keeps where the
interaction lies (:class:`~.rewards.RecordAt`, committed with the state) and the worker holds
the payload in memory from reading the interaction to assembling its session. A worker that
lacks it (restarted, SIGKILLed, given the partition by a rebalance) reads the interaction
back at those coordinates and checks it is the same event. ``interactions`` must keep its
records longer than ``processors.retain_s`` (14 days against 6 hours by default; the worker
refuses to start otherwise).

The ``tokens`` table is still read: states written before this keep their payloads there.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Container, Mapping, MutableMapping
from typing import Any

from pipeline import events
from pipeline.kafka.connection import Connectable
from pipeline.kafka.reader import Coordinates, one_shot_reader, read_at

from .records import session_of, token_key
from .rewards import KeptInteraction, RecordAt, TokenPayload, token_payload

log = logging.getLogger(__name__)

# coordinates -> record value; what it cannot find it leaves out, a failed read raises
Fetch = Callable[[list[Coordinates]], dict[Coordinates, bytes]]
GROUP_PREFIX = "liverl-tokens-"  # the reader's throwaway group id (never joined)


def coordinates(at: RecordAt) -> Coordinates:
    return (at.topic, at.partition, at.offset)


class InteractionReader:
    """Reads records back by their coordinates for :class:`TokenStore`, one call at a time
    (a thread each, from the agent and its timers), with one reader kept open between calls:
    a worker that restarts mid-traffic reads back every open session's turns."""

    def __init__(self, connection: Connectable, timeout_s: float = 10.0) -> None:
        self.connection, self.timeout_s = connection, timeout_s
        self._consumer: Any = None
        self._lock = threading.Lock()

    def __call__(self, wanted: list[Coordinates]) -> dict[Coordinates, bytes]:
        with self._lock:
            if self._consumer is None:
                self._consumer = one_shot_reader(self.connection, GROUP_PREFIX)
            found = read_at(self._consumer, wanted, timeout_s=self.timeout_s)
            return {c: msg.value() for c, msg in found.items() if msg.value() is not None}

    def close(self) -> None:
        with self._lock:
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None


class TokenStore:
    """The payloads of the turns a worker holds (see the module docstring). ``legacy``: the
    ``tokens`` table of earlier workers; ``retry_s``: how long an interaction that could not
    be read back is left alone before the next try (the sweep retries assembly every
    ``sweep_interval_s``)."""

    def __init__(
        self,
        legacy: MutableMapping[bytes, Any],
        fetch: Fetch,
        *,
        retry_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.legacy, self.fetch, self.retry_s, self.clock = legacy, fetch, retry_s, clock
        self._held: dict[bytes, tuple[str, TokenPayload]] = {}  # token key -> (event id, ...)
        self._retry_at: dict[str, float] = {}  # event id -> when to try reading it again
        self.read_back = 0  # payloads read back from their interaction
        self.not_found = 0  # reads back that found no such interaction there

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, key: bytes, inter: events.Interaction) -> None:
        """Hold the payload of the turn the session state keeps (a retry of a turn number on
        another replica replaces it: the state keeps the later one)."""
        self._held[token_key(key, inter.turn)] = (inter.event_id, token_payload(inter))

    async def gather(
        self, key: bytes, kept: Mapping[int, KeptInteraction]
    ) -> dict[int, TokenPayload]:
        """The payloads of ``kept`` turns: held, in the legacy table, else read back (one read
        for the lot, in a thread). A turn whose interaction cannot be read is left out: the
        assembler then raises ``KeyError`` and the sweep tries again after ``retry_s``."""
        out: dict[int, TokenPayload] = {}
        missing: dict[int, KeptInteraction] = {}
        now = self.clock()
        for turn, k in kept.items():
            tkey = token_key(key, turn)
            held = self._held.get(tkey)
            if held is not None and held[0] == k.event_id:
                out[turn] = held[1]
            elif (raw := self.legacy.get(tkey)) is not None:
                out[turn] = TokenPayload.from_bytes(raw)
            elif k.at is not None and self._retry_at.get(k.event_id, 0.0) <= now:
                missing[turn] = k
        if missing:
            out.update(await self._read_back(key, missing))
        return out

    async def _read_back(
        self, key: bytes, missing: dict[int, KeptInteraction]
    ) -> dict[int, TokenPayload]:
        wanted = [coordinates(k.at) for k in missing.values() if k.at is not None]
        try:
            values = await asyncio.to_thread(self.fetch, wanted)
        except Exception as exc:  # a broker away: not a verdict on any record; try later
            log.warning("reading %d interaction(s) of session %r back failed: %s",
                        len(wanted), key, exc)  # fmt: skip
            retry_at = self.clock() + self.retry_s
            self._retry_at.update((k.event_id, retry_at) for k in missing.values())
            return {}
        out = {}
        for turn, k in missing.items():
            assert k.at is not None  # only those with coordinates are missing
            payload = self._payload(values.get(coordinates(k.at)), k.event_id)
            if payload is None:
                self.not_found += 1
                self._retry_at[k.event_id] = self.clock() + self.retry_s
                log.warning(
                    "interaction %s (turn %d of session %r) is not at %s[%d]@%d",
                    k.event_id, turn, key, k.at.topic, k.at.partition, k.at.offset,
                )  # fmt: skip
                continue
            self.read_back += 1
            self._retry_at.pop(k.event_id, None)
            self._held[token_key(key, turn)] = (k.event_id, payload)
            out[turn] = payload
        return out

    @staticmethod
    def _payload(raw: bytes | None, event_id: str) -> TokenPayload | None:
        if raw is None:
            return None
        try:
            inter = events.decode(raw, "interaction")
        except events.EventValidationError:
            return None
        if not isinstance(inter, events.Interaction) or inter.event_id != event_id:
            return None
        return token_payload(inter)

    def drop(self, key: bytes, turns: list[int]) -> None:
        """Forget the payloads of an assembled session's turns (held or in the legacy table)."""
        for turn in turns:
            tkey = token_key(key, turn)
            self._held.pop(tkey, None)
            if tkey in self.legacy:
                self.legacy.pop(tkey, None)

    def drop_orphans(self, sessions: Container[bytes]) -> None:
        """Forget the payloads of sessions no longer in ``sessions`` (expired, or another
        worker's now), and retry times that have passed."""
        for tkey in [k for k in self._held if session_of(k) not in sessions]:
            del self._held[tkey]
        now = self.clock()
        for eid in [e for e, at in self._retry_at.items() if at <= now]:
            del self._retry_at[eid]
