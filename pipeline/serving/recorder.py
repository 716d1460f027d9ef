"""Asynchronous event recording: request path -> memory queue -> fsynced spool -> Kafka.

``record()`` never blocks on disk or Kafka. A writer thread appends batches to the spool (one
fsync per batch); a drainer thread sends spooled records in order and acknowledges them in the
spool only after Kafka confirmed every one. Each batch is one Kafka transaction
(``transactional_id``): a batch whose delivery failed (broker down, or a failover, past the
delivery timeout) is aborted and sent again, later records waiting behind it, so order is
kept and a read_committed consumer never reads a record twice. Without a transactional id
the producer is idempotent and re-created for the retry, which can double a record Kafka
already held. Consumers still deduplicate by ``event_id`` for the crash window between a
commit and the spool ack.

Nothing one event does can stop recording: an event that cannot be encoded, or is larger than
the codec limit, or that Kafka refuses for good (too large, invalid), is replaced by a bounded
dead letter on the DLQ topic and the rest flow on. If the spool cannot be written, a batch is
produced directly (only when no spooled record is waiting, so order is kept). An event that
can be neither spooled nor produced is held in memory when its sender was told it is recorded
(``promised``: the gateway decides that before an answer's headers, from :attr:`problem`),
and written, or produced, as soon as either works again (issue 37: the first failed batch,
answered 200 before the failure could be known, used to be dropped because older spooled
events waited); only a gateway that stops first, or more than ``HOLD_MAX_BYTES`` held, loses
one. An event whose sender was told it may not be recorded is counted as lost at once. From
the first failed append until a probe finds the spool writable again, :attr:`Recorder.problem`
says why, whether Kafka is up or not: with no spool, a turn answered now would be lost if
Kafka failed before delivering it (and "Kafka is up" is only as fresh as the last probe), so
the gateway refuses turns that would train and ``/healthz`` is degraded (see
``ServeSettings.serve_without_training``). The probe (every ``probe_every_s`` while idle, and
after each failed delivery round) repairs a torn spool tail and writes as many bytes as the
append that failed, so it clears the error, and ``spool_error``, once the disk is back and not
before; the writer tries held events again every ``probe_every_s``.

Nothing on disk can stop recording either: a spooled frame damaged by something outside
liverl is quarantined by the spool (``quarantine/`` next to the segments), replaced in the
stream by a dead letter that carries its bytes, counted (``on_quarantine``) and named by
:meth:`Recorder.quarantine_problem` (``/healthz`` degraded) until the file is removed; the
frames after it are delivered as usual. The same happens to a frame whose crc is right but
whose content cannot be read back.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import orjson
from confluent_kafka import KafkaError, KafkaException, Message

from pipeline import __version__, events
from pipeline.kafka import DeliveryError, EventProducer, names
from pipeline.kafka.connection import Connectable, connection_of

from .kafka_log import GATEWAY_KAFKA_LOG
from .spool import Quarantined, Spool

log = logging.getLogger(__name__)
PRODUCER = events.Producer(component="gateway-recorder", version=__version__)
DEAD_LETTER_KEEP_BYTES = 64 * 1024  # of the original value; its size and sha256 are kept too
PROBE_MAX_BYTES = 16 * 1024 * 1024  # the spool probe writes at most this much
HOLD_MAX_BYTES = 64 * 1024 * 1024  # promised events held while neither spool nor Kafka takes them
UNSPOOLED = "events go to Kafka unspooled, and would be lost if it failed before delivery"
KAFKA_DOWN = "Kafka is unreachable"
UNKNOWN_TOPIC = "unknown (corrupt spool frame)"
_FRAME_TOPIC = re.compile(rb'\{"t":"([A-Za-z0-9._-]{1,249})"')  # a damaged frame's topic
# Kafka refuses these records whatever the retry: dead-letter them instead of blocking.
_PERMANENT = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_MSG,
    KafkaError.INVALID_MSG_SIZE,
    KafkaError.INVALID_RECORD,
    KafkaError.RECORD_LIST_TOO_LARGE,
}


class Recorder:
    def __init__(
        self,
        kafka: Connectable,
        spool: Spool,
        *,
        delivery_timeout_s: float = 15.0,
        batch: int = 500,
        client_id: str = "liverl-gateway",
        probe_every_s: float = 2.0,
        dlq_topic: str = names.DLQ,
        ack_persist_s: float = 0.5,
        linger_s: float = 0.0,
        transactional_id: str | None = None,
    ) -> None:
        self.kafka = connection_of(kafka)
        self.spool = spool
        self.delivery_timeout_s = delivery_timeout_s
        self.batch = batch
        self.client_id = client_id
        self.probe_every_s = probe_every_s
        self.ack_persist_s = ack_persist_s  # how often a busy drainer persists the spool ack
        self.linger_s = linger_s  # a lone event waits this long for others to share its batch
        self.dlq_topic = dlq_topic
        # One transaction per delivered batch (None: an idempotent producer, re-created after
        # a failed round, which can double a record a failover outlasting the timeout kept).
        self.transactional_id = transactional_id
        self.transactional = transactional_id is not None
        self._txn_ready = False
        self.max_event_bytes = self.kafka.max_event_bytes
        self.delivered = 0
        self.redelivered = 0
        self.dead_lettered = 0
        self.lost = 0
        self.quarantined = 0  # damaged spool regions and unreadable frames set aside
        self.kafka_up = True
        self.started = False
        self.spool_error: str | None = None  # the spool's last failure, until it works again
        self.problem: str | None = None  # why an event recorded now could be lost; None: good
        self._failed_bytes = 0  # size of the append that failed (what the probe must write)
        self.on_lost: Callable[[int], None] = lambda _n: None
        self.on_dead_letter: Callable[[int], None] = lambda _n: None
        self.on_quarantine: Callable[[int], None] = lambda _n: None
        self._counted: set[str] = set()  # quarantine files already counted
        self._drain_failures = 0  # consecutive failures to read the spool
        self._drain_error = ""
        self._queue: queue.Queue[tuple[str, events.Event, bool] | None] = queue.Queue()
        # Handed over, not yet in the spool: the queue, the batch in the writer's hands (an
        # event taken off the queue is in neither the queue nor the spool until stored) and
        # the held frames.
        self._unspooled = 0
        # Frames of events handed over while recording looked sound (``promised``) that
        # neither the spool nor Kafka took yet, oldest first: kept and tried again, never
        # dropped while their answers said they were recorded (issue 37).
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._count_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="spool-writer", daemon=True)
        self._drainer = threading.Thread(target=self._drain_loop, name="spool-drain", daemon=True)
        self._producer: EventProducer | None = None
        self._direct: EventProducer | None = None

    # ---- API ----------------------------------------------------------------------------

    def start(self) -> None:
        self.started = True
        self._writer.start()
        self._drainer.start()

    def record(self, topic: str, event: events.Event, *, promised: bool | None = None) -> None:
        """Hand an event over; returns at once. ``promised``: its sender was told it is
        recorded (default: when :attr:`problem` is None now). A promised event that neither
        the spool nor Kafka can take is held in memory and tried again; one not promised is
        counted as lost at once (its sender was told it may not be recorded)."""
        if promised is None:
            promised = self.problem is None
        with self._count_lock:
            self._unspooled += 1
        self._queue.put((topic, event, promised))

    @property
    def backlog(self) -> int:
        """Events not yet confirmed by Kafka (in memory, in the writer's hands, held, or in
        the spool)."""
        return self._unspooled + self.spool.pending

    @property
    def held(self) -> int:
        """Promised events held in memory because neither the spool nor Kafka took them."""
        return len(self._held)

    def quarantine_problem(self) -> str | None:
        """Spooled records that were set aside undelivered, or a drainer that keeps failing
        on the spool itself (None: neither)."""
        if self._drain_failures >= 3:
            return f"spooled events are not being sent: {self._drain_error}"
        return self.spool.quarantine_problem()

    @property
    def alive(self) -> bool:
        """Both threads run (before start and after close they do not)."""
        return self._writer.is_alive() and self._drainer.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Spool everything queued, try to deliver until ``timeout``, then stop; whatever
        Kafka does, this returns within about ``timeout`` seconds (undelivered records stay in
        the spool for the next start)."""
        deadline = time.monotonic() + timeout
        self._queue.put(None)
        self._writer.join(timeout=max(0.1, deadline - time.monotonic()))
        while self.spool.pending and time.monotonic() < deadline and self._drainer.is_alive():
            self._wake.set()
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self._drainer.join(timeout=2.0)
        with contextlib.suppress(Exception):  # what was delivered need not be sent again
            self.spool.persist_ack()
        self._reset_producer()  # free the librdkafka handles now, not whenever GC runs
        if self._direct is not None:
            self._direct = None
        if not self._writer.is_alive():
            self.spool.close()

    # ---- writer ---------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            # Held frames are tried again every probe_every_s even when nothing new comes.
            items = self._take(self.probe_every_s if self._held else None)
            real = [it for it in items if it is not None]
            before = len(self._held)
            try:
                self._store([(self._frame_or_letter(t, ev), p) for t, ev, p in real])
            except Exception as exc:  # noqa: BLE001 - the writer must never die
                log.exception("spool writer failed on a batch")
                self._lose(len(real), f"recorder error: {type(exc).__name__}: {exc}")
            if None in items and self._held:  # stopping: nothing will try them again
                n, self._held, self._held_bytes = len(self._held), [], 0
                why = self.problem or self.spool_error or "not stored"
                self._lose(n, f"{why}; the gateway stopped", promised=True)
            # stored (spooled, produced directly or lost): not ours now; held ones still are
            gone = before + len(real) - len(self._held)
            with self._count_lock:
                self._unspooled -= gone
            self._wake.set()
            if None in items:
                return

    def _take(self, timeout: float | None) -> list[tuple[str, events.Event, bool] | None]:
        try:
            items = [self._queue.get(timeout=timeout)]
        except queue.Empty:
            return []
        # Sparse traffic (one turn every few ms) made every event a batch of one: a spool
        # fsync, a produce and four thread wake-ups each, ~1 ms of CPU per event on 2 cores,
        # more than the gateway's own work per request. A lone event waits ``linger_s`` for
        # company; under load the queue is never empty here and nothing waits.
        if self.linger_s > 0 and items[0] is not None and self._queue.empty():
            time.sleep(self.linger_s)
        while len(items) < self.batch:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return items

    def _frame_or_letter(self, topic: str, event: events.Event) -> bytes:
        """The event's spool frame, or a dead letter's when it cannot go to ``topic``."""
        try:
            v = self.kafka.codec_version
            value = events.encode(event, version=v)
            if len(value) <= self.max_event_bytes:
                hdrs = events.headers(event, version=v)
                return _frame_value(topic, value, events.key(event), hdrs)
            reason = f"value of {len(value)} bytes exceeds the codec limit {self.max_event_bytes}"
        except Exception as exc:  # noqa: BLE001 - any defect of one event
            reason = f"cannot encode: {type(exc).__name__}: {exc}"
        log.error("event %s for %s dead-lettered: %s", event.event_id, topic, reason)
        self.dead_lettered += 1
        self.on_dead_letter(1)
        key = events.key(event) if isinstance(event, events.TurnEvent) else None
        letter = dead_letter(_best_effort_bytes(event), topic, key, reason, event.event_id)
        return frame(self.dlq_topic, letter)

    def _store(self, new: list[tuple[bytes, bool]]) -> None:
        """Spool the held frames, then ``new`` (frame, promised), in order."""
        batch = [(raw, True) for raw in self._held] + new
        if not batch:
            return
        frames = [raw for raw, _ in batch]
        try:
            self.spool.append(frames)
        except OSError as exc:
            again = bool(self._held)  # the held frames' retries are not news
            self.spool_error = f"spool write failed in {self.spool.dir}: {exc}"
            self._failed_bytes = min(sum(map(len, frames)), PROBE_MAX_BYTES)
            (log.debug if again else log.error)(
                "%s; %d event(s) go to Kafka directly if they can", self.spool_error, len(frames)
            )
            self._bypass(batch)
            return
        if self._held:
            log.warning("%d held event(s) spooled", len(self._held))
        self._hold([])
        self.spool_error = None
        self.problem = None

    def _bypass(self, batch: list[tuple[bytes, bool]]) -> None:
        """Spool unusable: produce directly when nothing spooled waits (order) and Kafka is
        up. What that does not deliver is held when promised, else counted as lost."""
        why = self.spool_error
        if self.spool.pending:
            reason = f"{why}; older spooled events wait for Kafka (order)"
        elif not self.kafka_up:
            reason = f"{why}; {KAFKA_DOWN}"
        else:
            failed, refused, error = self._produce_directly([raw for raw, _ in batch])
            if refused:
                self._lose(len(refused), f"{why}; Kafka refused them for good: {error}")
            batch = [batch[i] for i in failed]
            if not batch:
                self._hold([])
                self.problem = f"{why}; {UNSPOOLED}"
                return
            reason = f"{why}; Kafka did not take them: {error}"
        keep = [raw for raw, promised in batch if promised]
        if len(keep) < len(batch):
            self._lose(len(batch) - len(keep), reason, promised=False)
        self._hold(keep)
        if self._held_bytes > HOLD_MAX_BYTES:  # memory must stay bounded, whatever comes
            over = 0
            while self._held_bytes > HOLD_MAX_BYTES and self._held:
                self._held_bytes -= len(self._held.pop())
                over += 1
            self._lose(over, f"{reason}; more than {HOLD_MAX_BYTES} bytes held", promised=True)
        if self._held:
            reason += f"; {len(self._held)} event(s) held in memory until one of them takes them"
        self.problem = reason

    def _produce_directly(self, frames: list[bytes]) -> tuple[list[int], list[int], str]:
        """Send ``frames`` with the direct producer: the indexes of those Kafka did not
        confirm (to try again; a record sent twice is dropped by its event id downstream),
        of those it refused for good, and the error."""
        if self._direct is None:
            self._direct = self._new_producer(f"{self.client_id}-direct")
        status: list[bool | None] = [None] * len(frames)
        refused: dict[int, str] = {}
        error = ""
        try:
            for i, raw in enumerate(frames):
                topic, key, value, hdrs = unframe(raw)
                self._direct.send_raw(
                    topic, value, key=key, headers=hdrs, on_delivery=_mark(status, refused, i)
                )
            self._direct.flush(self.delivery_timeout_s + 1)
        except (DeliveryError, KafkaException, BufferError) as exc:
            self._direct = None
            error = str(exc)
        failed = [i for i, ok in enumerate(status) if ok is not True and i not in refused]
        if failed:
            self.kafka_up = False
        self.delivered += status.count(True)
        return failed, sorted(refused), error

    def _hold(self, frames: list[bytes]) -> None:
        self._held = frames
        self._held_bytes = sum(map(len, frames))

    def _lose(self, n: int, reason: str, *, promised: bool | None = None) -> None:
        """Count ``n`` events as lost; ``promised``: whether their senders were told they
        were recorded (None: some may have been)."""
        self.lost += n
        self.problem = reason
        self.on_lost(n)
        if promised is not None:
            reason += " (answered as recorded)" if promised else " (answered as not recorded)"
        log.error("%d event(s) LOST: %s", n, reason)

    # ---- drainer --------------------------------------------------------------------------

    def _drain_loop(self) -> None:
        next_probe = next_persist = 0.0
        while not self._stop.is_set():
            try:
                records, cursor = self.spool.peek(self.batch)
                records = self._checked(records, self.spool.quarantined_now)
                self._drain_failures = 0  # the spool could be read (Kafka retries come next)
                if not records:
                    # Idle: the position on disk catches up, but no more often than when busy
                    # (sparse traffic idles between every batch: a persist each, ~0.7 ms of
                    # CPU, was most of recording's cost at one request in flight).
                    now = time.monotonic()
                    if now >= next_persist:
                        self.spool.persist_ack()
                        next_persist = now + self.ack_persist_s
                    if now >= next_probe:
                        self._probe()
                        next_probe = time.monotonic() + self.probe_every_s
                    self._wake.wait(min(0.5, max(0.01, next_persist - now)))
                    self._wake.clear()
                    continue
                if self._deliver(records):
                    now = time.monotonic()
                    self.spool.ack(cursor, persist=now >= next_persist)
                    if now >= next_persist:
                        next_persist = now + self.ack_persist_s
            except Exception as exc:  # noqa: BLE001 - the drainer must never die
                log.exception("spool drain failed; retrying")
                self._drain_failures += 1
                self._drain_error = f"{type(exc).__name__}: {exc}"[:500]
                self._stop.wait(1.0)

    def _checked(self, records: list[bytes], damaged: list[Quarantined]) -> list[bytes]:
        """The batch with each damaged region the spool skipped, and each frame that cannot be
        read back, replaced by a dead letter carrying its bytes (kept in quarantine/)."""
        out = list(records)
        for i, raw in enumerate(records):
            try:
                unframe(raw)
            except Exception as exc:  # noqa: BLE001 - whatever is wrong with the bytes
                digest = hashlib.sha256(raw).hexdigest()
                path = self.spool.quarantine_bytes(f"frame-{digest[:32]}.bad", raw)
                reason = f"unreadable spool frame ({type(exc).__name__}: {exc})"[:1000]
                log.error("%s: moved to %s, delivery goes on after it", reason, path)
                out[i] = self._quarantine_letter(raw, path.name, reason, digest)
        for region in sorted(damaged, key=lambda q: q.index, reverse=True):
            digest = hashlib.sha256(region.data).hexdigest()
            letter = self._quarantine_letter(region.data, region.path.name, region.reason, digest)
            out.insert(region.index, letter)
        return out

    def _quarantine_letter(self, data: bytes, name: str, reason: str, digest: str) -> bytes:
        """A dead-letter frame for bytes set aside in quarantine/ (counted once per file)."""
        if name not in self._counted:
            self._counted.add(name)
            self.quarantined += 1
            self.on_quarantine(1)
        found = _FRAME_TOPIC.match(data, 8) or _FRAME_TOPIC.match(data)
        topic = found.group(1).decode() if found else UNKNOWN_TOPIC
        error = f"{reason}; the bytes are in quarantine/{name} of the gateway's spool"
        return frame(self.dlq_topic, dead_letter(data, topic, None, error, digest))

    def _probe(self) -> None:
        """While idle: is Kafka reachable (metadata request), and is a lost state over?"""
        try:
            self._get_producer().raw.list_topics(timeout=min(2.0, self.delivery_timeout_s))
            self.kafka_up = True
        except KafkaException:
            self.kafka_up = False
        self._recheck()

    def _recheck(self) -> None:
        """Clear the lost state, and the spool error, once the spool takes a batch like the
        one that failed again (Kafka being up is not enough: it may fail before delivering)."""
        if self.problem is None and self.spool_error is None:
            return
        try:
            self.spool.check(self._failed_bytes)
        except OSError as exc:
            self.spool_error = f"spool not writable in {self.spool.dir}: {exc}"
            self.problem = f"{self.spool_error}; {UNSPOOLED if self.kafka_up else KAFKA_DOWN}"
            return
        log.warning("recording works again after: %s", self.problem or self.spool_error)
        self.problem = self.spool_error = None

    def _deliver(self, records: list[bytes]) -> bool:
        """Send every record until each is confirmed; False only when stopping. A record
        Kafka refuses for good is swapped for its dead letter, which is sent instead."""
        if self.transactional:
            return self._deliver_in_transactions(records)
        first = True
        status: list[bool | None] = [False] * len(records)  # False: to send, None: in flight
        while not all(s is True for s in status):
            producer = self._get_producer()
            if not first:
                self.redelivered += status.count(False)
            refused = self._send_round(producer, records, status)
            if refused is None:
                return False
            first = False
            failed = status.count(False) - refused
            self.kafka_up = failed == 0
            if failed:
                log.warning("%d event(s) not delivered; Kafka unreachable? retrying", failed)
                self._reset_producer()
                self._recheck()
                self._stop.wait(0.5)
        self.delivered += len(records)
        return True

    def _deliver_in_transactions(self, records: list[bytes]) -> bool:
        """One transaction per batch: committed once Kafka confirmed every record, aborted
        otherwise, and the whole batch sent again in the next one. A record of an aborted
        attempt is never read by a read_committed consumer, whatever the delivery timeout or
        the failover: no retry can double a record (issue 25, item 2)."""
        attempt = 0
        while not self._stop.is_set():
            producer = self._get_producer()
            step = self._txn(producer, "begin")
            if step == "ok":
                if attempt:
                    self.redelivered += len(records)
                status: list[bool | None] = [False] * len(records)
                refused = self._send_round(producer, records, status)
                if refused is None:
                    return False  # left open: the next producer with our id aborts it
                attempt += 1
                failed = status.count(False) - refused
                if not failed and not refused:
                    step = self._txn(producer, "commit")
                    if step == "ok":
                        self.kafka_up = True
                        self.delivered += len(records)
                        return True
                else:  # refused ones go as their letters, in the next transaction
                    if failed:
                        log.warning(
                            "%d event(s) not delivered; Kafka unreachable? the "
                            "batch's transaction is aborted and sent again",
                            failed,
                        )
                    step = self._txn(producer, "abort")
                    if step == "ok" and not failed:
                        continue  # only letters to swap in: at once
            if step == "abort":
                step = self._txn(producer, "abort")
            if step == "fatal":
                self._reset_producer()
            self.kafka_up = False
            self._recheck()
            self._stop.wait(0.5)
        return False

    def _txn(self, producer: EventProducer, what: str) -> str:
        """Begin, commit or abort the producer's transaction (initialising it first): "ok",
        "abort" (this attempt must be aborted), "fatal" (a new producer is needed) or "retry"
        (not yet: Kafka unreachable). Commit and abort are retried on the same producer while
        they are retriable, so an attempt whose outcome is unknown is never sent again by a
        producer that could not know it was committed."""
        raw = producer.raw
        timeout = max(1.0, min(self.delivery_timeout_s, 10.0))
        while True:
            try:
                if not self._txn_ready:
                    raw.init_transactions(timeout)
                    self._txn_ready = True
                if what == "begin":
                    raw.begin_transaction()
                elif what == "commit":
                    raw.commit_transaction(timeout)
                else:
                    raw.abort_transaction(timeout)
                return "ok"
            except KafkaException as exc:
                err = exc.args[0]
                log.warning("recorder transaction %s: %s", what, err)
                if err.fatal():
                    return "fatal"
                if err.txn_requires_abort():
                    return "abort"
                if not err.retriable() or self._stop.is_set():
                    return "fatal" if what != "begin" else "retry"
                if not self._txn_ready or what == "begin":
                    return "retry"  # nothing in flight: the drain loop waits and tries again
                self.kafka_up = False
                self._recheck()
                self._stop.wait(0.5)

    def _send_round(
        self, producer: EventProducer, records: list[bytes], status: list[bool | None]
    ) -> int | None:
        """Send the records whose status is False and wait for their reports. Records Kafka
        refuses for good become their dead letters (status False: sent next round); how many
        is returned. None only when stopping."""
        refused: dict[int, str] = {}
        if self._stop.is_set():
            return None
        for i, raw in enumerate(records):
            if status[i] is False:
                status[i] = None
                topic, key, value, hdrs = unframe(raw)
                try:
                    producer.send_raw(
                        topic,
                        value,
                        key=key,
                        headers=hdrs,
                        on_delivery=_mark(status, refused, i),
                    )
                except KafkaException as exc:
                    status[i] = False
                    if exc.args[0].code() in _PERMANENT:  # refused locally (e.g. too large)
                        refused[i] = str(exc.args[0])
                except BufferError:  # queue full: this one goes next round
                    status[i] = False
        while any(s is None for s in status):
            if self._stop.is_set():
                return None
            producer.poll(0.2)
        for i, reason in refused.items():
            records[i] = self._letter_for(records[i], reason)
        return len(refused)

    def _letter_for(self, raw: bytes, reason: str) -> bytes:
        topic, key, value, _hdrs = unframe(raw)
        log.error("Kafka refused a record for %s (%s): dead-lettered", topic, reason)
        self.dead_lettered += 1
        self.on_dead_letter(1)
        seed = hashlib.sha256(raw).hexdigest()
        return frame(self.dlq_topic, dead_letter(value, topic, key, reason, seed))

    def _get_producer(self) -> EventProducer:
        if self._producer is None:
            self._producer = self._new_producer(self.client_id, transactional=self.transactional)
            self._txn_ready = False
        return self._producer

    def _new_producer(self, client_id: str, *, transactional: bool = False) -> EventProducer:
        # librdkafka's dotted names pass through **extra (a dict, not keywords)
        timeout_ms = int(self.delivery_timeout_s * 1000)
        # librdkafka's reconnect lines folded: one per kind, then a count every 30 s
        extra: dict[str, Any] = {"message.timeout.ms": timeout_ms, "logger": GATEWAY_KAFKA_LOG}
        tid = None
        if transactional:
            tid = self.transactional_id
            # librdkafka wants message.timeout.ms <= transaction.timeout.ms; the broker's
            # transaction.max.timeout.ms is 15 min by default.
            extra["transaction.timeout.ms"] = min(max(60_000, 2 * timeout_ms), 900_000)
        return EventProducer(
            self.kafka,
            client_id=client_id,
            transactional_id=tid,
            error_cb=self._on_client_error,
            **extra,
        )

    def _on_client_error(self, err: KafkaError) -> None:
        """librdkafka says at once when every broker connection is down; health shows it."""
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self.kafka_up = False
        log.debug("recorder producer: %s", err)

    def _reset_producer(self) -> None:
        if self._producer is not None:
            # failures were recorded per record; a producer in a fatal state raises instead
            with contextlib.suppress(DeliveryError, KafkaException):
                self._producer.flush(0)
            self._producer = None


def _mark(status: list[bool | None], refused: dict[int, str], i: int) -> Any:
    def report(err: KafkaError | None, _msg: Message) -> None:
        if err is not None and err.code() in _PERMANENT:
            refused[i] = str(err)
        status[i] = err is None

    return report


def dead_letter(
    value: bytes, topic: str, key: bytes | None, error: str, seed: str
) -> events.DeadLetter:
    """A dead letter that stays small whatever the event: the original value is cut to
    ``DEAD_LETTER_KEEP_BYTES`` with its full size and sha256 named in ``error``. It was never
    produced, so it has no offset: partition and offset are 0 and ``error`` says so."""
    kept = value[:DEAD_LETTER_KEEP_BYTES]
    if len(kept) < len(value):
        digest = hashlib.sha256(value).hexdigest()
        error += f" [value {len(value)} bytes, sha256 {digest}, first {len(kept)} kept]"
    letter = events.DeadLetter.wrap(
        kept,
        topic=topic,
        partition=0,
        offset=0,
        error=f"gateway: not produced to {topic}: {error}"[:4096],
        producer=PRODUCER,
        key=None if key is None else key[:1024],
    )
    letter.event_id = events.derive_event_id("dlq", [seed], __version__, "gateway", topic)
    return letter


def _best_effort_bytes(event: events.Event) -> bytes:
    """Some bytes of an event that cannot be encoded, for its dead letter."""
    with contextlib.suppress(Exception):
        return events.encode(event)
    return repr(event)[: DEAD_LETTER_KEEP_BYTES * 2].encode("utf-8", "backslashreplace")


def frame(topic: str, event: events.Event) -> bytes:
    return _frame_value(topic, events.encode(event), events.key(event), events.headers(event))


def _frame_value(
    topic: str, value: bytes, key: bytes | None, hdrs: list[tuple[str, bytes]]
) -> bytes:
    return orjson.dumps(
        {
            "t": topic,
            "k": None if key is None else key.decode(),
            "h": [[k, v.decode()] for k, v in hdrs],
            "v": value.decode(),
        }
    )


def key_mark(key: str) -> bytes:
    """Bytes that every frame of a record keyed ``key`` contains (:func:`_frame_value` writes
    compact JSON), so they can be found even in a damaged frame that no longer parses."""
    return b'"k":' + orjson.dumps(key)


def spooled_values(frames: Iterable[bytes]) -> Iterator[bytes]:
    """The event values of spooled frames; unreadable frames are skipped here (the drainer
    quarantines and dead-letters them)."""
    for raw in frames:
        try:
            yield unframe(raw)[2]
        except Exception:  # noqa: BLE001, S112 - any damage: not this reader's job
            continue


def unframe(raw: bytes) -> tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]:
    doc = orjson.loads(raw)
    hdrs = [(k, v.encode()) for k, v in doc["h"]]
    return doc["t"], None if doc["k"] is None else doc["k"].encode(), doc["v"].encode(), hdrs
