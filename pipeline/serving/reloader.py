"""Follows ``liverl.weights.v1`` and moves the backend to newer weight versions.

It reads the topic from the beginning on every start (one partition, a handful of small
manifests) so a restarted gateway comes back on the newest version, not on the base model.
Only this policy's versions newer than the live one are considered (only ``promoted`` ones when
gating is on); of a batch, only the newest is loaded. Files are checked against the manifest's
sha256 and size before the backend sees them; every attempt emits a ``ServingStatus``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import unquote, urlparse

from pipeline import __version__, events
from pipeline.kafka import EventConsumer, names
from pipeline.settings import Settings

from .backends.base import Backend

log = logging.getLogger(__name__)
PRODUCER = events.Producer(component="reloader", version=__version__)


class ManifestError(ValueError):
    """Weight files do not match their manifest."""


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
        kafka: Settings,
        backend: Backend,
        loop: asyncio.AbstractEventLoop,
        *,
        replica_id: str,
        require_promoted: bool = False,
        emit: object = None,
        topic: str = names.WEIGHTS,
        on_result: object = None,
    ) -> None:
        self.kafka = kafka
        self.backend = backend
        self.loop = loop
        self.replica_id = replica_id
        self.require_promoted = require_promoted
        self.topic = topic
        self.emit = emit  # callable(topic, event) or None
        self.on_result = on_result  # callable(ok: bool) or None
        self.failed: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="weights-reloader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def wanted(self, ev: events.Event) -> bool:
        return (
            isinstance(ev, events.WeightsPublished)
            and ev.policy_id == self.backend.policy_id
            and ev.version > self.backend.version
            and ev.version not in self.failed
            and ev.status != "rejected"
            and (ev.status == "promoted" or not self.require_promoted)
        )

    def _loop(self) -> None:
        consumer = EventConsumer(
            self.kafka,
            group_id=f"liverl-gateway-{self.replica_id}-{uuid.uuid4().hex[:8]}",
            topics=[self.topic],
            component="reloader",
            auto_offset_reset="earliest",
            **{"enable.auto.commit": False},
        )
        try:
            while not self._stop.is_set():
                batch = consumer.poll_batch(max_records=100, timeout=0.5)
                found = [r.event for r in batch.records if self.wanted(r.event)]
                if found:
                    newest = max(found, key=lambda e: e.version)  # type: ignore[attr-defined]
                    self.apply(newest)  # type: ignore[arg-type]
        except Exception:
            log.exception("weights reloader stopped")
        finally:
            consumer.close()

    def apply(self, ev: events.WeightsPublished) -> bool:
        """Verify and load one version; never raises."""
        started = time.perf_counter()
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
                "serving_status", [ev.event_id], "serving-1", self.replica_id, ev.version
            ),
            producer=PRODUCER,
            parents=[ev.event_id],
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
