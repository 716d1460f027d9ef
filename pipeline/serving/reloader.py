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

Two arms (issue 39, a canary): the stable arm follows :meth:`VersionLog.live` as above; the
canary arm holds the version :meth:`VersionLog.canary` names, with its share, while there is
one (the gateway routes each request by ``arm_fraction`` of its user or session id). Each
arm changes by one swap in the backend that no running request sees (they snapshot their
arm's weights when they start): the stable arm first, then the canary, so a rollout moves the
canary's loaded weights to everyone before the canary arm is dropped. A version the canary
arm could not load is not tried there again (its users stay on the stable version); the
stable arm may still load it once it is rolled out. When every version the replica could
serve is withdrawn, the stable arm goes back to the weights it started with (the base).
Every attempt, and every canary dropped, emits a ``ServingStatus`` naming its arm. A poll or
load error is logged and the loop goes on: the reloader stops only when closed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal, TypeGuard
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
        self.canary_failed: set[int] = set()  # versions the canary arm could not load
        self.base_version = backend.version  # what the stable arm serves with no version
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
        """Move the stable arm to the version the folded log says should serve, trying the
        next in its order when one fails to verify or load, then the canary arm to the
        canary it names (or none); the stable version loaded (None if it already serves or
        none could be loaded)."""
        for ev in self.candidates.values():
            self.log.add(ev)
        self.candidates = {}
        loaded = self._load_stable()
        self._follow_canary()
        return loaded

    def _load_stable(self) -> int | None:
        order = self.log.preference(self.require_promoted, self.failed)
        for i, version in enumerate(order):
            if version == self.backend.version:
                return None
            if self.apply(self.log.manifests[version], cause=self.log.last_action_id):
                return version
            if i + 1 < len(order):
                log.warning(
                    "%s v%d is not usable; falling back to v%d",
                    self.log.policy_id,
                    version,
                    order[i + 1],
                )
        if (
            not order
            and self.log.pinned is None
            and self.log.live(self.require_promoted) is None
            and self.backend.version != self.base_version
            and self.backend.version in self.log.manifests
        ):
            self._serve_base()  # what this replica serves was withdrawn, and all before it
        return None

    def _follow_canary(self) -> None:
        want = self.log.canary(self.require_promoted)
        if want is not None and (want[0] in self.failed or want[0] in self.canary_failed):
            want = None  # its users stay on the stable version
        have = getattr(self.backend, "canary", None)
        if want == have:
            return
        if want is None:
            self._drop_canary()
        else:  # a backend given the version it holds only takes the new share
            self.apply(
                self.log.manifests[want[0]],
                cause=self.log.last_action_id,
                arm="canary",
                share=want[1],
            )

    def _call(self, coro: Any) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _drop_canary(self) -> None:
        started = time.perf_counter()
        error: str | None = None
        try:
            self._call(self.backend.drop_canary())
        except Exception as exc:  # noqa: BLE001 - reported, the loop goes on
            error = f"{type(exc).__name__}: {exc}"
            log.error("dropping the canary of %s failed: %s", self.log.policy_id, error)
        self._report(self.backend.version, "canary", "drop", started, error)

    def _serve_base(self) -> None:
        started = time.perf_counter()
        error: str | None = None
        try:
            self._call(self.backend.serve_base())
        except Exception as exc:  # noqa: BLE001 - reported, the loop goes on
            error = f"{type(exc).__name__}: {exc}"
            log.error("going back to the base of %s failed: %s", self.log.policy_id, error)
        self._report(self.backend.version, "stable", "base", started, error)

    def _report(
        self,
        version: int,
        arm: Literal["stable", "canary"],
        what: str,
        started: float,
        error: str | None,
    ) -> None:
        """The ``serving_status`` of a change that loads no manifest (a canary dropped, the
        base served again), caused by the newest operator action."""
        cause = self.log.last_action_id
        parents = [cause] if cause is not None else []
        self._emit(
            events.ServingStatus(
                event_id=events.derive_event_id(
                    "serving_status", parents, "serving-1", self.replica_id, version, arm, what
                ),
                producer=PRODUCER,
                parents=parents,
                replica_id=self.replica_id,
                policy_id=self.log.policy_id,
                version=version,
                reload_ms=(time.perf_counter() - started) * 1000,
                ok=error is None,
                error=error,
                arm=arm,
            )
        )

    def _emit(self, status: events.ServingStatus) -> None:
        if callable(self.emit):
            self.emit(names.SERVING_STATUS, status)
        if callable(self.on_result):
            self.on_result(status.ok)

    def apply(
        self,
        ev: events.WeightsPublished,
        cause: str | None = None,
        *,
        arm: Literal["stable", "canary"] = "stable",
        share: float = 0.0,
    ) -> bool:
        """Verify and load one version on an arm (the canary's with ``share``); never raises.
        ``cause``: the operator action that made it the choice, if any, so a version served
        again after a rollback reports a new ``serving_status`` rather than the id of its
        first load."""
        started = time.perf_counter()
        parents = [ev.event_id] if cause is None else [ev.event_id, cause]
        error: str | None = None
        try:
            path = verify(ev)
            if arm == "canary":
                self._call(self.backend.load_canary(path, ev.version, share))
            else:
                self._call(self.backend.reload(path, ev.version))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            (self.canary_failed if arm == "canary" else self.failed).add(ev.version)
            log.error("reload of %s v%d (%s) failed: %s", ev.policy_id, ev.version, arm, error)
        ms = (time.perf_counter() - started) * 1000
        now = self.backend.version
        if arm == "canary":
            have = getattr(self.backend, "canary", None)
            now = have[0] if have is not None else now
        # the stable arm's ids are what they were before arms existed
        id_parts: tuple[Any, ...] = (ev.version,) if arm == "stable" else (ev.version, arm)
        self._emit(
            events.ServingStatus(
                event_id=events.derive_event_id(
                    "serving_status", parents, "serving-1", self.replica_id, *id_parts
                ),
                producer=PRODUCER,
                parents=parents,
                replica_id=self.replica_id,
                policy_id=ev.policy_id,
                version=ev.version if error is None else now,
                reload_ms=ms,
                ok=error is None,
                error=error,
                arm=arm,
            )
        )
        return error is None
