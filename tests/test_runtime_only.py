"""The README's install (``pip install -e .``, no extras) runs every command.

CI installs ``.[dev]``, so a module only a dev extra brings would pass every other test; here
``tests/support/runtime_only.py`` refuses any such import (pytest is refused as a control),
which is what a newcomer's environment does. deptry checks the same statically in
``.ci/test.sh``; this proves it at run time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.stack import free_port

SCRIPT = Path(__file__).parent / "support" / "runtime_only.py"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    return {**env, **extra}


def test_every_module_and_every_help_loads_with_runtime_dependencies_only(
    tmp_path: Path,
) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--check-all"],
        capture_output=True,
        text=True,
        env=_env(LIVERL_STATE_DIR=str(tmp_path)),
        timeout=300,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "No module named 'pytest'" in got["control"]  # the hook refuses dev-only modules
    assert got["broken"] == {}
    assert got["modules"] > 100
    # every command and group of liverl answered --help
    assert {
        "liverl",
        "demo",
        "up",
        "serve",
        "train",
        "workers",
        "tap",
        "sql",
        "report",
        "forget",
        "replay",
        "broker up",
        "topics apply",
    } <= set(got["helps"])
    assert set(got["helps"].values()) == {0}


@pytest.mark.integration
def test_demo_runs_with_runtime_dependencies_only(tmp_path: Path) -> None:
    """The demo's start-up and one session end to end (tiny model, own embedded broker)."""
    env = _env(
        LIVERL_STATE_DIR=str(tmp_path / "state"),
        LIVERL_BROKER_PORT=str(free_port()),
        LIVERL_BROKER_CONTROLLER_PORT=str(free_port()),
        LIVERL_PROCESSORS_WEB_PORT=str(free_port()),
    )
    out = tmp_path / "out"
    res = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "demo",
            "--model",
            "tiny",
            "--rounds",
            "1",
            "--users",
            "1",
            "--eval-questions",
            "1",
            "--no-probe",
            "--no-pace",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sessions"] == 1
    assert (out / "learning_curve.png").stat().st_size > 0
