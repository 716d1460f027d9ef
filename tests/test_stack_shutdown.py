"""What ``liverl up`` runs stops within 10 s of its SIGTERM even with the broker gone
(issue 37: ``liverl up`` took 17.5 s, the archive ~15 s and the trainer its 10 s watchdog).

The components are the real ``liverl`` commands, started and stopped by ``pipeline/stack.py``
as ``liverl up`` does, against a broker of the test's own (the shared one is never stopped).
The requirement is itself a time bound, so the test measures each component's exit."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline import stack
from pipeline.kafka import names
from pipeline.kafka.broker import LocalBroker
from pipeline.models.tiny import ensure_tiny_model
from pipeline.settings import BrokerSettings, Settings
from pipeline.stack import free_port

from .test_trainer_exactly_once import make_sample, produce
from .test_trainer_shutdown import dead_letter_arrived

STOP_S = 10.0  # every component, from the SIGTERM to its exit

pytestmark = pytest.mark.integration


def wait_for_line(item: stack.Running, text: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while text.encode() not in item.log.read_bytes():
        assert item.proc.poll() is None, stack.tail(item.log, 40)
        assert time.monotonic() < deadline, stack.tail(item.log, 40)
        time.sleep(0.5)


def kill_broker_then_stop(local: LocalBroker, running: list[stack.Running]) -> None:
    """SIGKILL the test's broker, then stop everything as ``liverl up`` does: each component
    exits within STOP_S of its SIGTERM."""
    os.kill(local.pid(), signal.SIGKILL)  # type: ignore[arg-type]
    time.sleep(2)
    took = stop_timed(running)
    print(f"exits after SIGTERM with the broker gone: {took}")
    for item in running:
        name = item.component.name
        assert took[name] < STOP_S, f"{name}: {took[name]:.1f}s\n{stack.tail(item.log, 20)}"


def stop_timed(running: list[stack.Running]) -> dict[str, float]:
    """``stack.stop`` as ``liverl up`` calls it; seconds from its start to each exit."""
    started = time.monotonic()
    took: dict[str, float] = {}

    def watch(item: stack.Running) -> None:
        item.proc.wait()
        took[item.component.name] = time.monotonic() - started

    watchers = [threading.Thread(target=watch, args=(item,)) for item in running]
    for w in watchers:
        w.start()
    stack.stop(running)
    for w in watchers:
        w.join()
    return took


@pytest.fixture
def own_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Settings, LocalBroker]]:
    """A broker of the test's own (it is killed; the shared one never is), its topics, and
    the environment the components read: no LIVERL_* from outside (the default shutdown
    bounds), this state dir and broker."""
    broker = BrokerSettings(port=free_port(), controller_port=free_port())
    settings = Settings(state_dir=tmp_path / "state", broker=broker)
    settings.kafka.bootstrap = None  # this test's own broker, even under LIVERL_KAFKA_BOOTSTRAP
    local = LocalBroker(settings)
    local.up(quiet=True)
    try:
        for name in [k for k in os.environ if k.startswith("LIVERL_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("LIVERL_STATE_DIR", str(tmp_path / "state"))
        monkeypatch.setenv("LIVERL_KAFKA_BOOTSTRAP", settings.bootstrap)
        monkeypatch.setenv("PYTHONUNBUFFERED", "1")
        subprocess.run([sys.executable, "-m", "pipeline.cli", "topics", "apply"], check=True,
                       capture_output=True, timeout=120)  # fmt: skip
        yield settings, local
    finally:
        local.down(quiet=True)


def test_archive_and_trainer_stop_within_10s_with_the_broker_gone(
    tmp_path: Path, own_broker: tuple[Settings, LocalBroker]
) -> None:
    settings, local = own_broker
    running: list[stack.Running] = []
    try:
        tiny = ensure_tiny_model(tmp_path / "tiny")
        # The trainer holds a trained step it has not published (the stop publishes it and
        # waits on Kafka): three samples make one batch, and the fourth, dead-lettered, says
        # that batch was admitted, so trained (tests/test_trainer_shutdown.py).
        rng = random.Random(3)
        good = [make_sample(i, "p", rng, session_id="one") for i in range(3)]
        bad = dataclasses.replace(good[0], event_id="bad", response_token_ids=[10**9] * 4)
        produce(settings, names.SAMPLES, [*good, bad])
        running = stack.start(tmp_path / "state", [
            stack.archive_component(),
            stack.Component("trainer", [
                "train", "--policy", "p", "--method", "rl", "--model", str(tiny), "--device",
                "cpu", "--batch-samples", "3", "--batch-wait", "0.05", "--lr", "1e-3",
                "--publish-every-steps", "1000", "--publish-every-s", "1000"]),
        ])  # fmt: skip
        archive, trainer = running
        wait_for_line(archive, "archiving")
        wait_for_line(trainer, "trainer ready")
        assert dead_letter_arrived(settings, 60), stack.tail(trainer.log, 40)

        kill_broker_then_stop(local, running)
        for item in running:
            name = item.component.name
            assert item.proc.returncode == 0, (name, stack.tail(item.log, 20))
            assert b"Traceback" not in item.log.read_bytes(), stack.tail(item.log, 40)
    finally:
        stack.stop(running, grace_s=1)


def test_an_archive_waiting_for_a_broker_that_is_gone_stops_within_10s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started while the broker is away (``liverl up`` starts it again after an exit): its
    first metadata request waits up to 15 s, and the signal handler only ran after it."""
    for name in [k for k in os.environ if k.startswith("LIVERL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LIVERL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("LIVERL_KAFKA_BOOTSTRAP", f"127.0.0.1:{free_port()}")  # nobody there
    running = stack.start(tmp_path / "state", [stack.archive_component()])
    try:
        wait_for_line(running[0], "Connection refused")  # its consumer asks the broker
        took = stop_timed(running)["archive"]
        print(f"archive exit {took:.1f}s after SIGTERM")
        assert took < STOP_S, stack.tail(running[0].log, 20)
        assert running[0].proc.returncode == 0, stack.tail(running[0].log, 20)
    finally:
        stack.stop(running, grace_s=1)


def test_gateway_workers_and_judges_stop_within_10s_with_the_broker_gone(
    tmp_path: Path, own_broker: tuple[Settings, LocalBroker]
) -> None:
    """The rest of what ``liverl up`` runs: the gateway (tiny model, a turn recorded), the
    reward workers and the consistency watcher, each within 10 s of SIGTERM once the broker
    is killed."""
    import httpx

    settings, local = own_broker
    running: list[stack.Running] = []
    try:
        tiny = ensure_tiny_model(tmp_path / "tiny")
        port = free_port()
        running = stack.start(tmp_path / "state", [
            stack.Component("workers", ["workers"]),
            stack.Component("judges", ["judges", "watch"]),
            *stack.gateway_components(1, "127.0.0.1", port, "p", ["--model", str(tiny)]),
        ])  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert all(r.proc.poll() is None for r in running), [
                stack.tail(r.log, 20) for r in running
            ]
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, stack.tail(running[-1].log, 40)
            time.sleep(0.5)
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=60,
            json={"model": "p", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert answer.status_code == 200, answer.text
        time.sleep(5)  # the workers and the watcher joined and read
        kill_broker_then_stop(local, running)
        for item in running:
            name = item.component.name
            # uvicorn ends by raising the SIGTERM it handled again: -15 is its clean stop.
            assert item.proc.returncode in (0, -signal.SIGTERM), (name, stack.tail(item.log, 20))
        # (The workers' log holds aiokafka's own traceback of a fetch cancelled at the stop.)
        for item in running[1:]:
            assert b"Traceback" not in item.log.read_bytes(), stack.tail(item.log, 40)
    finally:
        stack.stop(running, grace_s=1)
