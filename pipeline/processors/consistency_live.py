"""Judges' consistency as it stands now, read from ``liverl.judge_consistency.v1``.

``liverl judges watch`` publishes every match with the judge's running tally; the newest
event of a (judge id, version) is its consistency now, and whether it stands flagged
(``excluded``: weight 0 until it recovers). :class:`LiveConsistency` keeps those in
memory for the components that weight judges by them while they run: the panel judge in the
reward workers (``judge_options.live = true``) and the trainer's promotion gate
(``trainer.gate_consistency_live``). A weight read this way moves as outcomes arrive, where a
``judges compare`` file is a snapshot taken once.

A background thread reads the topic from its beginning (one partition, keyed by judge, so a
judge's tallies arrive in order), marks itself ready when it has reached the ends it saw at
start, then follows. It never joins a group or commits, never raises into its user, and
retries a missing topic or a broker that is down every ``retry_s``; until it has read
anything, every lookup answers None and the caller falls back to its static weights.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pipeline import events
from pipeline.kafka import names
from pipeline.kafka.connection import Connectable, connection_of

from .consistency_file import JudgeRow
from .consistency_watch import decode_or_none

log = logging.getLogger(__name__)


class LiveConsistency:
    """The newest tally of every judge (and version) on the consistency topic."""

    def __init__(
        self, settings: Connectable, namespace: str | None = None, *, retry_s: float = 10.0
    ) -> None:
        self.settings = settings
        if namespace is None:  # the connection's own (a replay namespace's trainer)
            namespace = connection_of(settings).namespace
        self.topic = names.resolve(names.JUDGE_CONSISTENCY, namespace)
        self.retry_s = retry_s
        self.ready = threading.Event()  # set once the history seen at start has been read
        self.error: str | None = None  # the last read failure, for status and logs
        self._rows: dict[tuple[str, str], JudgeRow] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lookups (any thread) ----------------------------------------------------------------

    def apply(self, ev: events.JudgeConsistency) -> None:
        """Take one published match: its tally is the judge's newest."""
        recent = None if ev.recent_consistency is None else float(ev.recent_consistency)
        row = JudgeRow(
            ev.judge_id,
            ev.judge_version,
            float(ev.consistency),
            int(ev.agree) + int(ev.disagree),
            bool(ev.excluded),
            recent,
        )
        with self._lock:
            self._rows[(ev.judge_id, ev.judge_version)] = row

    def row(self, judge_id: str, judge_version: str) -> JudgeRow | None:
        with self._lock:
            return self._rows.get((judge_id, judge_version))

    def consistency(self, judge_id: str, judge_version: str) -> float | None:
        """The judge version's consistency now; None when the topic has no tally of it."""
        r = self.row(judge_id, judge_version)
        return None if r is None else r.consistency

    def excluded(self, judge_id: str, judge_version: str) -> bool:
        """Whether the judge version stands flagged now (out of panels and the gate)."""
        r = self.row(judge_id, judge_version)
        return r is not None and r.excluded

    def rows(self) -> list[JudgeRow]:
        with self._lock:
            return list(self._rows.values())

    # -- reading ---------------------------------------------------------------------------

    def start(self, wait_s: float = 0.0) -> LiveConsistency:
        """Start reading; wait up to ``wait_s`` for the catch-up (a verdict made before it
        uses the caller's static weights)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="liverl-consistency-live", daemon=True
            )
            self._thread.start()
        if wait_s > 0 and not self.ready.wait(wait_s):
            log.warning(
                "live consistency: %s not read within %.0f s (%s); static weights until it is",
                self.topic,
                wait_s,
                self.error or "still reading",
            )
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _take(self, msgs: list[Any]) -> None:
        for msg in msgs:
            ev = decode_or_none(msg.value())  # another component's bad record is theirs
            if isinstance(ev, events.JudgeConsistency):
                self.apply(ev)

    def _run(self) -> None:
        from pipeline.kafka.reader import end_offsets, follow, read_to_end

        while not self._stop.is_set():
            try:
                ends = end_offsets(
                    self.settings,
                    [self.topic],
                    group_prefix="liverl-consistency-live",
                    hint="liverl topics apply",
                )
                read_to_end(
                    self.settings,
                    [self.topic],
                    lambda m: self._take([m]),
                    group_prefix="liverl-consistency-live",
                )
                self.error = None
                self.ready.set()
                log.info(
                    "live consistency: %d judge version(s) read from %s",
                    len(self._rows),
                    self.topic,
                )
                follow(
                    self.settings,
                    ends,
                    self._take,
                    self._stop,
                    group_prefix="liverl-consistency-live",
                    label="live consistency",
                )
                return
            except Exception as exc:  # noqa: BLE001 - weights fall back; never kill the user
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "live consistency: cannot read %s (%s); retrying in %.0f s",
                    self.topic,
                    self.error,
                    self.retry_s,
                )
                self._stop.wait(self.retry_s)
