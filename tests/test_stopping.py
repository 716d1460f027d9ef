"""The stop watchdog (``pipeline/stopping.py``) in real processes: a stop that hangs in a
blocking call ends at the bound; a disarmed watchdog (a command run in-process that returned)
never ends its process."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HANGS = """
import signal, sys, time
from pipeline import stopping

signal.signal(signal.SIGTERM, lambda *_: None)
stopping.arm(float(sys.argv[1]), "test: not stopped after {why}")
print("ready", flush=True)
time.sleep(600)  # one blocking call: the Python handler only runs when it returns
"""

DISARMED = """
import os, signal, time
from pipeline import stopping

signal.signal(signal.SIGTERM, lambda *_: None)
disarm = stopping.arm(0.5, "test: not stopped after {why}")
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.1)
disarm()
time.sleep(1.5)  # three bounds later
print("alive", flush=True)
"""


def test_a_stop_that_hangs_in_a_blocking_call_ends_at_the_bound() -> None:
    proc = subprocess.Popen([sys.executable, "-c", HANGS, "1"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    took = time.monotonic() - started
    assert proc.returncode == 0 and "test: not stopped after 1s" in err, err
    assert 1.0 <= took < 5.0, took


def test_a_disarmed_watchdog_leaves_its_process_alone() -> None:
    out = subprocess.run([sys.executable, "-c", DISARMED], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    assert out.returncode == 0 and out.stdout == "alive\n", out.stderr
    assert "not stopped" not in out.stderr
