"""An unwritable state dir is one clear line naming the path, for every component."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.durable import writable_problem


@pytest.fixture
def readonly(tmp_path: Path) -> Path:
    if os.geteuid() == 0:  # root writes anywhere: use a path under a regular file instead
        blocker = tmp_path / "file"
        blocker.write_text("x")
        return blocker / "state"
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    return ro / "state"


def test_writable_problem_names_the_path(readonly: Path, tmp_path: Path) -> None:
    assert writable_problem(tmp_path / "fine") is None
    problem = writable_problem(readonly / "x")
    assert problem is not None and str(readonly / "x") in problem


@pytest.mark.parametrize("args", [["train"], ["workers"], ["up"]])
def test_components_refuse_an_unwritable_state_dir(readonly: Path, args: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL_")}
    env["LIVERL_STATE_DIR"] = str(readonly)
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert str(readonly) in proc.stderr and "not writable" in proc.stderr, proc.stderr[-800:]
