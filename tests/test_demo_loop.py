"""`running_loop`: a SIGTERM to the bench or demo stops the `up` it started (which runs in its
own session and would otherwise keep serving, then stop the broker under the next run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.demo import loop

STAND_IN = (
    "import pathlib, signal, sys, time; signal.signal(signal.SIGINT, signal.default_int_handler);"
    " pathlib.Path(sys.argv[1]).touch(); time.sleep(60)"
)


def test_sigterm_inside_the_loop_stops_up_and_restores_the_handler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in for `liverl up`: a process in its own session that waits for a signal and,
    # like `up`, handles SIGINT itself (a background shell starts children with it ignored).
    started: list[subprocess.Popen[bytes]] = []
    ready = tmp_path / "ready"
    real_popen = subprocess.Popen

    def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = real_popen([sys.executable, "-c", STAND_IN, str(ready)], **kwargs)
        started.append(proc)
        return proc

    monkeypatch.setattr(loop.subprocess, "Popen", popen)
    monkeypatch.setattr(loop, "_wait_ready", lambda *a, **k: None)
    before = signal.getsignal(signal.SIGTERM)
    cfg = loop.LoopConfig(policy="p", method="opd", state_dir=tmp_path, port=1)
    with pytest.raises(SystemExit) as exited, loop.running_loop(cfg):
        assert signal.getsignal(signal.SIGTERM) is loop._exit_on_sigterm
        for _ in range(200):  # until the stand-in handles SIGINT
            if ready.exists():
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
    assert exited.value.code == 128 + signal.SIGTERM
    (proc,) = started
    assert proc.poll() is not None  # stopped (SIGINT to its group), not left running
    assert signal.getsignal(signal.SIGTERM) is before
