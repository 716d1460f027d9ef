"""`liverl up`'s supervisor (pipeline/stack.py): a component that exits starts again, with a
growing delay, in the same log; one that fails right after its start, or too often, stops
everything. Real child processes (small Python programs in place of liverl's commands)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline import stack

# Each start appends a line to its file, then it exits 3 (or runs on after N starts).
FLAKY = """
import sys, time
path, exit_after_s, runs_from = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
with open(path, 'a') as f:
    f.write('start\\n')
n = len(open(path).read().splitlines())
print(f'start {n}', flush=True)
if runs_from and n >= runs_from:
    time.sleep(120)
time.sleep(exit_after_s)
sys.exit(3)
"""
STEADY = "import time; time.sleep(120)"


@pytest.fixture(autouse=True)
def python_components(monkeypatch: pytest.MonkeyPatch) -> None:
    """A component's args are a Python program and its arguments, not a liverl command."""
    monkeypatch.setattr(stack, "command", lambda comp: [sys.executable, "-c", *comp.args])


def flaky(tmp_path: Path, exit_after_s: float, runs_from: int = 0) -> stack.Component:
    return stack.Component("flaky", [FLAKY, str(tmp_path / "starts"), str(exit_after_s),
                                     str(runs_from)])  # fmt: skip


def starts(tmp_path: Path) -> int:
    path = tmp_path / "starts"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_backoff_doubles_per_recent_restart_and_stops_a_crash_loop() -> None:
    policy = stack.RestartPolicy(startup_s=10, max_restarts=3, window_s=100, backoff_s=1,
                                 max_backoff_s=3)  # fmt: skip
    item = stack.Running(stack.Component("c", []), proc=None, log=Path("x"),  # type: ignore[arg-type]
                         started_at=0.0)  # fmt: skip
    assert policy.delay(item, now=5.0) is None  # in its first 10 s: a start-up failure
    assert policy.delay(item, now=10.0) == 1
    item.restarts = [10.0]
    assert policy.delay(item, now=20.0) == 2
    item.restarts = [10.0, 20.0]
    assert policy.delay(item, now=30.0) == 3  # 4, capped at max_backoff_s
    item.restarts = [10.0, 20.0, 30.0]
    assert policy.delay(item, now=40.0) is None  # a 4th restart within 100 s: a crash loop
    assert policy.delay(item, now=111.0) == 3  # 10 is out of the window: 2 recent, capped
    assert policy.delay(item, now=125.0) == 2  # 20 too: 1 recent
    item.restarts = []
    assert policy.delay(item, now=9.9) is None


def test_a_component_that_exits_starts_again_in_its_log_and_the_others_run_on(
    tmp_path: Path,
) -> None:
    """It exits (code 3) after its start-up window, twice, then keeps running; Ctrl-C
    (SIGTERM here) ends the supervisor with every component still the one it started."""
    running = stack.start(tmp_path, [stack.Component("steady", [STEADY]),
                                     flaky(tmp_path, 0.4, runs_from=3)])  # fmt: skip
    steady_pid = running[0].proc.pid
    seen: list[tuple[str, int | None, float]] = []
    policy = stack.RestartPolicy(startup_s=0.2, max_restarts=5, backoff_s=0.1)

    def interrupt_once_running_again() -> None:
        deadline = time.monotonic() + 30
        while starts(tmp_path) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=interrupt_once_running_again, daemon=True).start()
    try:
        failed = stack.supervise(
            running, poll_s=0.05, policy=policy,
            on_restart=lambda item, delay: seen.append(
                (item.component.name, item.proc.returncode, delay)),
        )  # fmt: skip
        assert failed is None
        assert seen == [("flaky", 3, 0.1), ("flaky", 3, 0.2)]  # the delay doubles
        assert starts(tmp_path) == 3 and len(running[1].restarts) == 2
        assert running[0].proc.pid == steady_pid and running[0].proc.poll() is None
        assert running[1].proc.poll() is None  # the third start runs on
        log = (tmp_path / "logs" / "flaky.log").read_text()
        assert log.splitlines() == ["start 1", "start 2", "start 3"]  # one log, appended
    finally:
        stack.stop(running, grace_s=5)
    assert all(item.proc.poll() is not None for item in running)


def test_a_crash_loop_stops_everything_after_max_restarts(tmp_path: Path) -> None:
    running = stack.start(tmp_path, [stack.Component("steady", [STEADY]), flaky(tmp_path, 0.3)])
    policy = stack.RestartPolicy(startup_s=0.1, max_restarts=2, window_s=60, backoff_s=0.05)
    try:
        failed = stack.supervise(running, poll_s=0.05, policy=policy)
        assert failed is running[1] and failed.proc.returncode == 3
        assert starts(tmp_path) == 3 and len(failed.restarts) == 2  # started, then 2 restarts
    finally:
        stack.stop(running, grace_s=5)


def test_a_component_that_fails_right_after_its_start_is_not_retried(tmp_path: Path) -> None:
    """A configuration error fails every start the same way: reported at once."""
    running = stack.start(tmp_path, [stack.Component("steady", [STEADY]), flaky(tmp_path, 0.0)])
    restarted: list[str] = []
    try:
        failed = stack.supervise(
            running, poll_s=0.05, policy=stack.RestartPolicy(startup_s=30),
            on_restart=lambda item, _d: restarted.append(item.component.name),
        )  # fmt: skip
        assert failed is running[1] and restarted == [] and starts(tmp_path) == 1
    finally:
        stack.stop(running, grace_s=5)
