"""Hot weight reload: versions published on Kafka are loaded with no failed or waiting request."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from pathlib import Path

import httpx
import pytest

from pipeline import events
from pipeline.kafka import EventProducer, names
from pipeline.serving.app import Gateway, create_app
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.reloader import Reloader, local_dir
from pipeline.serving.settings import ServeSettings
from pipeline.serving.threaded import running
from pipeline.settings import Settings

from .test_serving_hf import FakeRecorder, write_version

TRAINER = events.Producer(component="trainer", version="test")


def manifest(
    backend: HFBackend, root: Path, version: int, policy: str, status: str = "candidate"
) -> events.WeightsPublished:
    folder = write_version(root, backend, version, scale=1.0 + version / 100)
    files = [
        {
            "path": p.name,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            "bytes": p.stat().st_size,
        }
        for p in sorted(folder.iterdir())
    ]
    return events.WeightsPublished(
        event_id=events.derive_event_id("weights", [], "test", policy, version),
        producer=TRAINER,
        policy_id=policy,
        version=version,
        parent=version - 1,
        uri=folder.as_uri() + "/",
        files=files,
        step=version * 10,  # type: ignore[arg-type]
        status=status,
        consumed_offsets={},  # type: ignore[arg-type]
    )


@pytest.fixture
def tiny_backend(unique: str) -> HFBackend:
    from pipeline.models.tiny import ensure_tiny_model

    return HFBackend(ensure_tiny_model(), policy_id=f"policy-{unique}", workers=4)


def test_filters_and_manifest_check(tmp_path: Path, tiny_backend: HFBackend) -> None:
    rec = FakeRecorder()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        policy = tiny_backend.policy_id
        r = Reloader(
            Settings(), tiny_backend, loop, replica_id="r0", require_promoted=True, emit=rec.record
        )
        v1 = manifest(tiny_backend, tmp_path, 1, policy)
        assert not r.wanted(v1), "candidate while gating on promoted"
        assert not r.wanted(manifest(tiny_backend, tmp_path, 2, "other-policy", "promoted"))
        bad = manifest(tiny_backend, tmp_path, 3, policy, "promoted")
        bad.files[0]["sha256"] = "0" * 64
        assert r.wanted(bad)
        assert r.apply(bad) is False
        assert tiny_backend.version == 0 and not r.wanted(bad), "failed version not retried"
        good = manifest(tiny_backend, tmp_path, 4, policy, "promoted")
        assert r.apply(good) is True and tiny_backend.version == 4
        assert not r.wanted(manifest(tiny_backend, tmp_path, 4, policy, "promoted"))
        statuses = [e for _, e in rec.events if isinstance(e, events.ServingStatus)]
        assert [(s.ok, s.version) for s in statuses] == [(False, 0), (True, 4)]
        assert "sha256" in (statuses[0].error or "")
        for s in statuses:
            events.decode(events.encode(s), expected_type="serving_status")
    finally:
        loop.call_soon_threadsafe(loop.stop)


@pytest.mark.integration
def test_five_versions_under_concurrent_traffic(
    kafka_settings: Settings, tmp_path: Path, tiny_backend: HFBackend
) -> None:
    policy = tiny_backend.policy_id
    rec = FakeRecorder()
    gateway = Gateway(ServeSettings(record=False, reload=False), tiny_backend, rec)  # type: ignore[arg-type]
    reloader: list[Reloader] = []

    async def startup() -> None:
        r = Reloader(
            kafka_settings,
            tiny_backend,
            asyncio.get_running_loop(),
            replica_id="r-test",
            emit=rec.record,
        )
        r.start()
        reloader.append(r)

    async def shutdown() -> None:
        await asyncio.to_thread(reloader[0].close)

    versions = [manifest(tiny_backend, tmp_path, v, policy) for v in range(1, 6)]
    errors: list[str] = []
    seen: dict[str, list[int]] = {}
    stop = threading.Event()

    def session(name: str, url: str) -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                body = {
                    "model": policy,
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"hello {name}"}],
                }
                resp = c.post(
                    f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": name}
                )
                if resp.status_code != 200:
                    errors.append(f"{resp.status_code} {resp.text}")
                    continue
                seen.setdefault(name, []).append(int(resp.headers["x-liverl-weight-version"]))

    with running(create_app(gateway, startup, shutdown)) as url:
        threads = [threading.Thread(target=session, args=(f"s{i}", url)) for i in range(6)]
        for t in threads:
            t.start()
        producer = EventProducer(kafka_settings)
        for ev in versions:
            time.sleep(0.4)
            producer.send(names.WEIGHTS, ev)
            producer.flush()
        deadline = time.monotonic() + 60
        while tiny_backend.version < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # a few requests on the last version
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert tiny_backend.version == 5
    for name, vs in seen.items():
        assert vs == sorted(vs), f"{name} went back in version: {vs}"
    assert max(v for vs in seen.values() for v in vs) == 5
    by_session: dict[str, list[int]] = {}
    for inter in rec.interactions():
        by_session.setdefault(inter.session_id, []).append(inter.weight_version)
    assert by_session == seen, "each interaction records the version that answered it"
    ok = [e.version for _, e in rec.events if isinstance(e, events.ServingStatus) and e.ok]
    assert ok == sorted(ok) and ok[-1] == 5


def _corrupt(ev: events.WeightsPublished) -> None:
    """Flip bytes of a published file, keeping its size (a disk or copy error)."""
    path = local_dir(ev.uri) / ev.files[0]["path"]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 8] = b"\xff" * 8
    path.write_bytes(bytes(raw))


def test_corrupt_newest_falls_back_to_newest_valid(tmp_path: Path, tiny_backend: HFBackend) -> None:
    """Before: the newest of a batch failed and the older ones were forgotten (served v0)."""
    rec = FakeRecorder()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        policy = tiny_backend.policy_id
        r = Reloader(Settings(), tiny_backend, loop, replica_id="r0", emit=rec.record)
        found = [manifest(tiny_backend, tmp_path, v, policy) for v in (1, 2, 3)]
        _corrupt(found[2])
        r.candidates = {ev.version: ev for ev in found}
        assert r.load_newest() == 2 and tiny_backend.version == 2
        statuses = [(s.ok, s.version) for _, s in rec.events if isinstance(s, events.ServingStatus)]
        assert statuses == [(False, 0), (True, 2)]
        assert r.candidates == {} and 3 in r.failed
    finally:
        loop.call_soon_threadsafe(loop.stop)


@pytest.mark.integration
def test_restarted_gateway_serves_newest_valid_version(
    kafka_settings: Settings,
    admin,
    unique: str,
    tmp_path: Path,
    tiny_backend: HFBackend,  # type: ignore[no-untyped-def]
) -> None:
    from .conftest import create_topic

    topic, policy = f"test.weights.{unique}", tiny_backend.policy_id
    create_topic(admin, topic)
    found = [manifest(tiny_backend, tmp_path, v, policy) for v in (1, 2, 3)]
    _corrupt(found[2])
    producer = EventProducer(kafka_settings)
    for ev in found:
        producer.send(topic, ev)
    producer.flush()
    rec = FakeRecorder()
    gateway = Gateway(ServeSettings(record=False, reload=False), tiny_backend, rec)  # type: ignore[arg-type]
    reloader: list[Reloader] = []

    async def startup() -> None:
        r = Reloader(
            kafka_settings,
            tiny_backend,
            asyncio.get_running_loop(),
            replica_id="r-restart",
            emit=rec.record,
            topic=topic,
        )
        r.start()
        reloader.append(r)

    async def shutdown() -> None:
        await asyncio.to_thread(reloader[0].close)

    with running(create_app(gateway, startup, shutdown)) as url:
        deadline = time.monotonic() + 30
        while tiny_backend.version < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # and it stays there
        body = {"model": policy, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200
    assert resp.headers["x-liverl-weight-version"] == "2", "newest valid, not v0"
    failed = [s for _, s in rec.events if isinstance(s, events.ServingStatus) and not s.ok]
    assert len(failed) == 1 and "sha256" in (failed[0].error or "")
