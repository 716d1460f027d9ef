"""`liverl up`'s supervisor (pipeline/stack.py): a component that exits starts again, with a
growing delay, in the same log; one that fails right after its start, or too often, stops
everything. Real child processes (small Python programs in place of liverl's commands)."""

from __future__ import annotations

import signal
import sys
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


# `liverl up` itself, in a process of its own: the test sends it SIGTERM as Ctrl-C would (a
# signal sent to the test process would reach whatever handlers earlier in-process tests left).
UP = """
import json, sys
from pathlib import Path
from pipeline import stack
stack.command = lambda comp: [sys.executable, '-c', *comp.args]
tmp, steady, flaky = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
running = stack.start(tmp, [stack.Component('steady', [steady]),
                            stack.Component('flaky', flaky)])
pids = [r.proc.pid for r in running]
seen = []
failed = stack.supervise(
    running, poll_s=0.05, policy=stack.RestartPolicy(startup_s=0.2, max_restarts=5, backoff_s=0.1),
    on_restart=lambda item, delay: seen.append([item.component.name, item.proc.returncode, delay]))
out = {'failed': failed is not None, 'seen': seen, 'restarts': len(running[1].restarts),
       'steady_same': running[0].proc.pid == pids[0],
       'alive': [r.proc.poll() is None for r in running]}
stack.stop(running, grace_s=5)
out['stopped'] = [r.proc.poll() is not None for r in running]
print(json.dumps(out), flush=True)
"""


def test_a_component_that_exits_starts_again_in_its_log_and_the_others_run_on(
    tmp_path: Path,
) -> None:
    """It exits (code 3) after its start-up window, twice, then keeps running; SIGTERM (what
    Ctrl-C does) ends the supervisor with every component still the one it started."""
    import json
    import subprocess

    flaky_args = flaky(tmp_path, 0.4, runs_from=3).args
    up = subprocess.Popen([sys.executable, "-c", UP, str(tmp_path), STEADY, *flaky_args],
                          stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while starts(tmp_path) < 3 and time.monotonic() < deadline and up.poll() is None:
            time.sleep(0.05)
        time.sleep(0.5)
        up.send_signal(signal.SIGTERM)
        out = json.loads(up.communicate(timeout=60)[0])
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert out["failed"] is False
    assert out["seen"] == [["flaky", 3, 0.1], ["flaky", 3, 0.2]]  # the delay doubles
    assert starts(tmp_path) == 3 and out["restarts"] == 2
    assert out["steady_same"] and out["alive"] == [True, True]  # the third start runs on
    assert out["stopped"] == [True, True]
    log = (tmp_path / "logs" / "flaky.log").read_text()
    assert log.splitlines() == ["start 1", "start 2", "start 3"]  # one log, appended


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
