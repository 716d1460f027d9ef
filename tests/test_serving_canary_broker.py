"""A canary on the broker, two gateway replicas under steady traffic: both follow a canary's
start and answer each session by its arm, a ``rollout`` moves everyone to it, a later
canary's ``withdraw`` moves its users back, and no request fails throughout."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from pipeline import events
from pipeline.kafka import EventProducer, names
from pipeline.serving.app import Gateway, create_app
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.reloader import Reloader
from pipeline.serving.settings import ServeSettings
from pipeline.serving.threaded import running
from pipeline.settings import Settings
from pipeline.versions.commands import versions
from pipeline.versions.table import arm_fraction

from .test_serving_hf import FakeRecorder
from .test_serving_reload import manifest

SHARE = 0.5
KEYS = [f"canary-session-{i}" for i in range(10)]


def wait_for(what: Callable[[], bool], timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while not what() and time.monotonic() < deadline:
        time.sleep(0.05)
    return what()


@pytest.mark.integration
def test_two_replicas_follow_canary_rollout_and_withdraw_without_a_failed_request(
    kafka_settings: Settings, unique: str, tmp_path: Path
) -> None:
    from pipeline.models.tiny import ensure_tiny_model

    policy = f"canary-{unique}"
    backends = [HFBackend(ensure_tiny_model(), policy_id=policy, workers=2) for _ in range(2)]
    recorders = [FakeRecorder() for _ in backends]
    reloaders: list[Reloader] = []

    def app_of(i: int):  # type: ignore[no-untyped-def]
        gw = Gateway(ServeSettings(record=False, reload=False), backends[i], recorders[i])  # type: ignore[arg-type]

        async def startup() -> None:
            r = Reloader(
                kafka_settings,
                backends[i],
                asyncio.get_running_loop(),
                replica_id=f"r{i}-{unique}",
                require_promoted=True,
                emit=recorders[i].record,
            )
            r.start()
            reloaders.append(r)

        async def shutdown() -> None:
            for r in reloaders:
                await asyncio.to_thread(r.close)

        return create_app(gw, startup, shutdown)

    def version(v: int, share: float | None) -> list[events.WeightsPublished]:
        """v's candidate and its promotion (stamped with ``share``), on disk."""
        verdict = manifest(backends[0], tmp_path, v, policy, "promoted")
        verdict.event_id += "-verdict"  # the helper derives one id per version
        verdict.canary_share = share
        return [manifest(backends[0], tmp_path, v, policy), verdict]

    producer = EventProducer(kafka_settings, client_id=f"test-canary-{unique}")

    def publish(evs: list[events.WeightsPublished]) -> None:
        for ev in evs:
            producer.send(names.WEIGHTS, ev, key=policy)
        producer.flush()

    publish(version(1, None))  # no share: everyone at once
    obj = {"settings": kafka_settings}
    errors: list[str] = []
    answers: list[tuple[str, int]] = []  # (key, version)
    stop = threading.Event()

    with running(app_of(0)) as url0, running(app_of(1)) as url1:
        urls = [url0, url1]
        assert wait_for(lambda: all(b.version == 1 for b in backends)), [
            b.version for b in backends
        ]

        def ask(c: httpx.Client, url: str, key: str) -> int | None:
            r = c.post(
                f"{url}/v1/chat/completions",
                headers={"X-Session-Id": key},
                json={
                    "model": policy,
                    "max_tokens": 3,
                    "messages": [{"role": "user", "content": f"hello {key}"}],
                },
            )
            if r.status_code != 200:
                errors.append(f"{r.status_code} {r.text}")
                return None
            version = int(r.headers["x-liverl-weight-version"])
            answers.append((key, version))
            return version

        def traffic(n: int) -> None:
            with httpx.Client(timeout=60) as c:
                i = n
                while not stop.is_set():
                    ask(c, urls[i % 2], KEYS[i % len(KEYS)])
                    i += 1

        threads = [threading.Thread(target=traffic, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        try:

            def by_key() -> dict[tuple[int, str], int | None]:
                with httpx.Client(timeout=60) as c:
                    return {(i, k): ask(c, u, k) for i, u in enumerate(urls) for k in KEYS}

            in_canary = {k for k in KEYS if arm_fraction(k) < SHARE}
            assert 0 < len(in_canary) < len(KEYS), "both arms have sessions in this key set"

            publish(version(2, SHARE))
            assert wait_for(lambda: all(b.canary == (2, SHARE) for b in backends))
            assert all(b.version == 1 for b in backends)
            assert by_key() == {
                (i, k): 2 if k in in_canary else 1 for i in range(2) for k in KEYS
            }, "each session by its arm"

            out = CliRunner().invoke(
                versions,
                ["rollout", "2", "--policy", policy, "--by", "it", "--reason", "won"],
                obj=obj,
            )
            assert out.exit_code == 0, out.output
            assert wait_for(lambda: all(b.version == 2 and b.canary is None for b in backends))
            assert set(by_key().values()) == {2}, "rolled out: everyone on v2"

            publish(version(3, SHARE))
            assert wait_for(lambda: all(b.canary == (3, SHARE) for b in backends))
            assert by_key() == {(i, k): 3 if k in in_canary else 2 for i in range(2) for k in KEYS}
            out = CliRunner().invoke(
                versions,
                ["withdraw", "3", "--policy", policy, "--by", "it", "--reason", "lost"],
                obj=obj,
            )
            assert out.exit_code == 0, out.output
            assert wait_for(lambda: all(b.canary is None for b in backends))
            assert set(by_key().values()) == {2}, "the canary's users are back on v2"
            assert all(b.version == 2 for b in backends)
        finally:
            stop.set()
            for t in threads:
                t.join()

    assert errors == []
    assert len(answers) > 100
    versions_seen = {v for _, v in answers}
    assert versions_seen == {1, 2, 3}
    for i, rec in enumerate(recorders):
        arms = [
            (s.arm, s.version)
            for _, s in rec.events
            if isinstance(s, events.ServingStatus) and s.ok
        ]
        assert arms == [
            ("stable", 1),
            ("canary", 2),
            ("stable", 2),
            ("canary", 2),
            ("canary", 3),
            ("canary", 2),
        ], (i, arms)
