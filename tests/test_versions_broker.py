"""``liverl versions`` on the broker: an action is one event on liverl.weights.v1, read back
whole, not sent again on a retry, and followed by every gateway replica within a second."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest
from click.testing import CliRunner

from pipeline import events
from pipeline.kafka import EventProducer, names
from pipeline.settings import Settings
from pipeline.versions import reading
from pipeline.versions.commands import versions

from .test_versions import FakeBackend, on_disk, weights

if TYPE_CHECKING:
    from pipeline.serving.backends.base import Backend


@pytest.mark.integration
def test_pin_is_one_event_followed_by_every_replica(
    kafka_settings: Settings, unique: str, tmp_path: Path
) -> None:
    from pipeline.serving.reloader import Reloader

    policy = f"versions-{unique}"
    producer = EventProducer(kafka_settings, client_id=f"test-versions-{unique}")
    for v in (1, 2):
        for status in ("candidate", "promoted"):
            producer.send(
                names.WEIGHTS, on_disk(tmp_path, weights(v, status, policy=policy)), key=policy
            )
    producer.flush()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    replicas = []
    try:
        for i in range(2):
            backend = FakeBackend()
            backend.policy_id = policy
            r = Reloader(
                kafka_settings,
                cast("Backend", backend),
                loop,
                replica_id=f"r{i}-{unique}",
                require_promoted=True,
            )
            r.start()
            replicas.append((r, backend))
        deadline = time.monotonic() + 60
        while any(b.version != 2 for _, b in replicas) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [b.version for _, b in replicas] == [2, 2]

        args = ["pin", "1", "--policy", policy, "--by", "it", "--reason", "regressed"]
        obj = {"settings": kafka_settings}
        out = CliRunner().invoke(versions, args, obj=obj)
        assert out.exit_code == 0, out.output
        sent = time.monotonic()
        while any(b.version != 1 for _, b in replicas) and time.monotonic() < sent + 5:
            time.sleep(0.01)
        followed = time.monotonic() - sent
        assert [b.version for _, b in replicas] == [1, 1]
        assert followed < 1.0, f"replicas followed the pin in {followed:.2f}s"

        again = CliRunner().invoke(versions, args, obj=obj)
        assert again.exit_code == 0 and "already in the log" in again.output, again.output
        log = reading.weights_log(kafka_settings, policy)
        assert [(a.kind, a.version, a.by, a.reason) for a in log.actions] == [
            ("pin", 1, "it", "regressed")
        ]
        pin = next(e for e in log.events if e.action is not None)
        assert pin.event_id in out.output and pin.files == log.manifests[1].files
        assert isinstance(pin, events.WeightsPublished) and pin.producer.component == "versions"

        out = CliRunner().invoke(versions, ["unpin", "--policy", policy, "--by", "it"], obj=obj)
        assert out.exit_code == 0, out.output
        deadline = time.monotonic() + 5
        while any(b.version != 2 for _, b in replicas) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [b.version for _, b in replicas] == [2, 2]
        listed = CliRunner().invoke(
            versions, ["list", "--policy", policy, "--format", "json", "--no-outcomes"], obj=obj
        )
        assert listed.exit_code == 0, listed.output
        assert '"pinned": true' not in listed.output and '"version": 2' in listed.output
    finally:
        for r, _ in replicas:
            r.close()
        loop.call_soon_threadsafe(loop.stop)
