"""`liverl up`: the embedded default runs every component and stops them all on Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children_alive(pid: int) -> list[str]:
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


def test_up_serves_openai_clients_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    from openai import OpenAI

    gateway = _free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LIVERL_")},
        "LIVERL_STATE_DIR": str(tmp_path / "state"),
        "LIVERL_BROKER_PORT": str(_free_port()),
        "LIVERL_BROKER_CONTROLLER_PORT": str(_free_port()),
    }
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "up", "--port", str(gateway)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        ready = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"http://127.0.0.1:{gateway}/healthz", timeout=1).is_success
            except httpx.HTTPError:
                ready = False
            if ready:
                break
            time.sleep(1)
        assert ready, log.read_text()
        text = log.read_text()
        assert f"OpenAI base URL: http://127.0.0.1:{gateway}/v1" in text

        client = OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="local")
        reply = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=4,
            extra_headers={"X-Session-Id": "stack-test"},
        )
        assert reply.choices[0].message.content is not None
        children = _children_alive(proc.pid)
        assert any(" serve " in c for c in children), children
        assert any(" train " in c for c in children), children

        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()
        child_pids = [int(c.split()[0]) for c in children]
        for pid in child_pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert "Kafka stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
