"""Follows ``liverl.weights.v1`` and moves the backend to newer weight versions.

It reads the topic from the beginning on every start (one partition, a handful of small
manifests) so a restarted gateway comes back on the version that should serve, not on the base
model. Which one that is, the log decides through the same fold ``liverl versions`` shows
(``pipeline/versions/table.py``): the newest servable version (only ``promoted`` ones when
gating is on), unless an operator pinned one or rolled back, and only once the reloader has
caught up with the log (a pin further on must not be preceded by a load of what it overrides).
If a load fails (files missing or not matching the manifest's sha256 and size, checked before
the backend sees them) the next one in the fold's order is tried, so a corrupt newest version
at start-up leaves the gateway on the newest valid one, not on v0; a pinned version that fails
is not replaced by another (the replica stays where it is and reports the failure).
Every attempt emits a ``ServingStatus``. A poll or load error is logged and the loop goes on:
the reloader stops only when closed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any, TypeGuard
from urllib.parse import unquote, urlparse

from pipeline import __version__, events
from pipeline.kafka import EventConsumer, EventProducer, names
from pipeline.kafka.connection import Connectable, connection_of
from pipeline.serving.errors import ManifestError
from pipeline.versions.table import VersionLog

from .backends.base import Backend
from .kafka_log import GATEWAY_KAFKA_LOG

log = logging.getLogger(__name__)
PRODUCER = events.Producer(component="reloader", version=__version__)
BATCH = 100  # records per poll; a shorter batch means the reloader has caught up


def local_dir(uri: str) -> Path:
    """``file:///a/b/`` or a plain path -> Path; other schemes are not fetched here."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(unquote(parsed.path if parsed.scheme else uri))
    raise ManifestError(f"weights uri {uri!r}: only local paths and file:// are supported")


def verify(event: events.WeightsPublished) -> Path:
    """Check every listed file's size and sha256; return the directory."""
    root = local_dir(event.uri)
    for f in event.files:
        path = root / f["path"]
        if not path.is_file():
            raise ManifestError(f"{path} listed in the manifest is missing")
        if path.stat().st_size != f["bytes"]:
            raise ManifestError(f"{path}: {path.stat().st_size} bytes, manifest says {f['bytes']}")
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
        if digest.hexdigest() != f["sha256"]:
            raise ManifestError(f"{path}: sha256 does not match the manifest")
    return root


class Reloader:
    def __init__(
        self,
        kafka: Connectable,
        backend: Backend,
        loop: asyncio.AbstractEventLoop,
        *,
        replica_id: str,
        require_promoted: bool = False,
        emit: object = None,
        topic: str = names.WEIGHTS,
        on_result: object = None,
        on_action: object = None,
    ) -> None:
        self.kafka = connection_of(kafka)
        self.backend = backend
        self.loop = loop
        self.replica_id = replica_id
        self.require_promoted = require_promoted
        self.topic = topic
        self.emit = emit  # callable(topic, event) or None
        self.on_result = on_result  # callable(ok: bool) or None
        self.on_action = on_action  # callable(kind: str) per operator action folded, or None
        self.failed: set[int] = set()
        self.candidates: dict[int, events.WeightsPublished] = {}  # seen, not yet folded
        self.log = VersionLog(backend.policy_id)  # this policy's weights log, folded
        self.error: str | None = None  # last poll error, for health
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="weights-reloader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def died(self) -> bool:
        """Started, not closed, and yet its thread is gone (health reports it)."""
        t = self._thread
        return t.ident is not None and not t.is_alive() and not self._stop.is_set()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout)

    def wanted(self, ev: events.Event) -> TypeGuard[events.WeightsPublished]:
        """Whether a trainer's event alone would move this replica forward (no operator
        action considered: ``load_newest`` asks the folded log)."""
        return (
            isinstance(ev, events.WeightsPublished)
            and ev.policy_id == self.backend.policy_id
            and ev.version > self.backend.version
            and ev.version not in self.failed
            and ev.status != "rejected"
            and (ev.status == "promoted" or not self.require_promoted)
        )

    def _loop(self) -> None:
        # librdkafka's dotted names pass through **extra (a dict, not keywords); its
        # reconnect lines (~20 a second while the broker is down) are folded, the dead-letter
        # producer's too (never polled until close, it printed them all at once then)
        quiet: dict[str, Any] = {"logger": GATEWAY_KAFKA_LOG}
        group = f"liverl-gateway-{self.replica_id}-{uuid.uuid4().hex[:8]}"
        consumer = EventConsumer(
            self.kafka,
            group_id=group,
            dlq=EventProducer(self.kafka, client_id=f"{group}-dlq", **quiet),
            topics=[self.topic],
            component="reloader",
            auto_offset_reset="earliest",
            **{"enable.auto.commit": False, **quiet},
        )
        try:
            while not self._stop.is_set():
                self._step(consumer)
        finally:
            consumer.close()

    def _step(self, consumer: EventConsumer) -> None:
        """One poll; never raises (a bad record or a broker error must not stop reloading)."""
        try:
            batch = consumer.poll_batch(max_records=BATCH, timeout=0.5)
            self.error = None
        except Exception as exc:  # noqa: BLE001
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("weights reloader poll failed; retrying")
            self._stop.wait(1.0)
            return
        for rec in batch.records:
            ev = rec.event
            if not isinstance(ev, events.WeightsPublished) or not self.log.add(ev):
                continue
            if ev.action is not None and callable(self.on_action):
                self.on_action(str(ev.action.get("kind")))  # the operator-actions counter
        if len(batch.records) < BATCH:  # caught up: act on the whole log, not a prefix
            self.load_newest()

    def load_newest(self) -> int | None:
        """Move to the version the folded log says should serve, trying the next in its order
        when one fails to verify or load; the version loaded (None if it already serves or
        none could be loaded)."""
        for ev in self.candidates.values():
            self.log.add(ev)
        self.candidates = {}
        order = self.log.preference(self.require_promoted, self.failed)
        for i, version in enumerate(order):
            if version == self.backend.version:
                return None
            if self.apply(self.log.manifests[version], cause=self.log.last_action_id):
                return version
            if i + 1 < len(order):
                log.warning("%s v%d is not usable; falling back to v%d",
                            self.log.policy_id, version, order[i + 1])
        return None

    def apply(self, ev: events.WeightsPublished, cause: str | None = None) -> bool:
        """Verify and load one version; never raises. ``cause``: the operator action that made
        it the choice, if any, so a version served again after a rollback reports a new
        ``serving_status`` rather than the id of its first load."""
        started = time.perf_counter()
        parents = [ev.event_id] if cause is None else [ev.event_id, cause]
        error: str | None = None
        try:
            path = verify(ev)
            fut = asyncio.run_coroutine_threadsafe(self.backend.reload(path, ev.version), self.loop)
            fut.result()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.failed.add(ev.version)
            log.error("reload of %s v%d failed: %s", ev.policy_id, ev.version, error)
        ms = (time.perf_counter() - started) * 1000
        status = events.ServingStatus(
            event_id=events.derive_event_id(
                "serving_status", parents, "serving-1", self.replica_id, ev.version
            ),
            producer=PRODUCER,
            parents=parents,
            replica_id=self.replica_id,
            policy_id=ev.policy_id,
            version=ev.version if error is None else self.backend.version,
            reload_ms=ms,
            ok=error is None,
            error=error,
        )
        if callable(self.emit):
            self.emit(names.SERVING_STATUS, status)
        if callable(self.on_result):
            self.on_result(error is None)
        return error is None
