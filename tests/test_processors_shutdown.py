"""A worker asked to stop while its broker is gone exits within a few seconds (issue 11)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.kafka.broker import LocalBroker
from pipeline.settings import BrokerSettings, Settings
from pipeline.stack import free_port

pytestmark = pytest.mark.integration


def test_sigterm_with_the_broker_gone_exits_within_seconds(tmp_path: Path) -> None:
    _run(tmp_path, {})


def _run(tmp_path: Path, extra_env: dict[str, str]) -> None:
    broker = BrokerSettings(port=free_port(), controller_port=free_port())
    settings = Settings(state_dir=tmp_path / "state", broker=broker)
    local = LocalBroker(settings)
    local.up(quiet=True)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LIVERL_")},
        "LIVERL_STATE_DIR": str(tmp_path / "state"),
        "LIVERL_BROKER_PORT": str(broker.port),
        "LIVERL_BROKER_CONTROLLER_PORT": str(broker.controller_port),
        "LIVERL_PROCESSORS_WEB_PORT": str(free_port()),
        **extra_env,
    }
    subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "topics", "apply"],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    log = tmp_path / "workers.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "workers", "-l", "info"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and b"Ready" not in log.read_bytes():
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        assert b"Ready" in log.read_bytes(), log.read_text()[-3000:]
        os.kill(local.pid(), signal.SIGKILL)  # type: ignore[arg-type]
        time.sleep(2)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - started
        # liverl up expects each component gone within 10 s (issue 37); measured 8.1 s
        assert took < 10, f"{took:.1f}s"
        # a thread that dies while stopping is one record, not one WARNING per token (#25)
        out = log.read_bytes()
        assert b"[WARNING] ^" not in out and b"[WARNING] Exception in thread" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        local.down(quiet=True)
