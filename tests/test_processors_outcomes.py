"""A gate command's whole process tree ends with it (processors/outcomes.py ``run_gate`` under
processors/gate_reaper.py): on its timeout, a descendant that left the process group with
setsid included; after it passes, what it left running; when liverl is interrupted or dies.
The basic exit code, tails and 127 cases are in test_processors_commands.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.processors.outcomes import TIMEOUT_EXIT, run_gate, verdict

PY = sys.executable

# A child that leaves the gate's process group and session, as `setsid CMD` does: the gate's
# own process exits 0 at once; the child keeps the output pipes and sleeps.
ESCAPES = """
import os, sys, time
if os.fork():
    sys.exit(0)
os.setsid()
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(300)
"""
# The same, but a daemon done right: its output let go, so the gate ends when its process does.
DETACHES = """
import os, sys, time
pid = os.fork()
if pid:
    open(sys.argv[1], "w").write(str(pid))
    print("ok")
    sys.exit(0)
os.setsid()
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
os.dup2(null, 2)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: only its exit status is left)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(b")") + 2 :].split()[0] not in (b"Z", b"X")


def pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()]


@pytest.fixture
def pidfile(tmp_path: Path) -> Iterator[Path]:
    """Where a gate writes the pids of its tree; whatever still runs at the end is killed
    (so that a failing test leaves nothing behind)."""
    path = tmp_path / "pids"
    yield path
    if path.exists():
        for pid in pids(path):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_child_that_left_with_setsid_is_the_gate_running_and_ends_at_its_timeout(pidfile):
    started = time.monotonic()
    gate = run_gate([PY, "-c", ESCAPES, str(pidfile)], 2.0, echo=False)
    took = time.monotonic() - started
    # its own process said 0 at once, but its child held the output: not passed, timed out
    assert (gate.exit_code, gate.timed_out) == (TIMEOUT_EXIT, True)
    assert 2.0 <= took < 8.0  # the timeout (and the SIGTERM's effect), not 10 s of joins
    (pid,) = pids(pidfile)
    assert not alive(pid)  # outside the gate's process group, and gone all the same
    assert verdict(gate, 2.0) == "timed out after 2 s (exit 124): no outcome"


def test_a_background_child_in_the_group_ends_at_the_timeout(pidfile):
    gate = run_gate(["sh", "-c", f"sleep 300 & echo $$ $! > {pidfile}; wait"], 1.0, echo=False)
    assert (gate.exit_code, gate.timed_out) == (TIMEOUT_EXIT, True)
    assert gate.duration_s < 7.0
    assert [alive(p) for p in pids(pidfile)] == [False, False]  # sh and its sleep


def test_a_tree_that_ignores_sigterm_gets_sigkill_after_the_grace(pidfile):
    script = f"trap '' TERM; sleep 300 & echo $$ $! > {pidfile}; wait"
    gate = run_gate(["sh", "-c", script], 1.0, echo=False, grace_s=0.5)
    assert (gate.exit_code, gate.timed_out) == (TIMEOUT_EXIT, True)
    assert 1.5 <= gate.duration_s < 8.0  # SIGTERM at 1 s, ignored; SIGKILL 0.5 s later
    assert [alive(p) for p in pids(pidfile)] == [False, False]


def test_what_a_passing_gate_left_running_ends_with_it(pidfile):
    gate = run_gate([PY, "-c", DETACHES, str(pidfile)], 30.0, echo=False)
    # its output closed when its process ended: it passed, without waiting for the timeout
    assert (gate.exit_code, gate.timed_out, gate.stdout_tail) == (0, False, "ok\n")
    assert gate.duration_s < 10.0 and verdict(gate, 30.0) == "passed"
    (pid,) = pids(pidfile)
    assert not alive(pid)


def test_an_interrupted_run_ends_the_gate_before_it_raises(pidfile):
    """Ctrl-C (here SIGUSR1 raising KeyboardInterrupt, sent by the gate once it runs)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGUSR1, interrupt)
    script = f"sleep 300 & echo $$ $! > {pidfile}; kill -USR1 {os.getpid()}; wait"
    try:
        with pytest.raises(KeyboardInterrupt):
            run_gate(["sh", "-c", script], 60.0, echo=False)
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert [alive(p) for p in pids(pidfile)] == [False, False]


def test_the_gate_ends_when_liverl_is_killed(pidfile):
    """SIGKILL to the process running run_gate: its reaper hears of it (PR_SET_PDEATHSIG)."""
    code = (
        "import sys; from pipeline.processors.outcomes import run_gate; "
        "run_gate(sys.argv[1:], 60.0, echo=False)"
    )
    script = f"sleep 300 & echo $$ $! > {pidfile}; wait"
    runner = subprocess.Popen(
        [PY, "-c", code, "sh", "-c", script], cwd=Path(__file__).resolve().parents[1]
    )
    try:
        for _ in range(300):
            if pidfile.exists() and len(pids(pidfile)) == 2:
                break
            time.sleep(0.05)
        tree = pids(pidfile)
        runner.kill()
        runner.wait()
        for _ in range(200):  # the reaper's SIGTERM reaches them at once; 10 s at most
            if not any(alive(p) for p in tree):
                break
            time.sleep(0.05)
        assert [alive(p) for p in tree] == [False, False]
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()


def test_exit_codes_as_a_shell_reports_them():
    assert run_gate(["sh", "-c", "exit 3"], 30.0, echo=False).exit_code == 3
    killed = run_gate(["sh", "-c", "kill -9 $$"], 30.0, echo=False)
    assert (killed.exit_code, killed.timed_out) == (128 + 9, False)
    assert verdict(killed, 30.0) == "failed (exit 137)"
    denied = run_gate([os.devnull], 30.0, echo=False)  # not executable
    assert denied.exit_code == 126 and os.devnull in denied.stderr_tail


@pytest.mark.parametrize(
    ("code", "timed_out", "why"),
    [(124, True, "timed out"), (126, False, "not executable"), (127, False, "command not found")],
)
def test_a_gate_that_timed_out_or_could_not_run_is_no_outcome(
    code: int, timed_out: bool, why: str
) -> None:
    """Issue 38: exit 124, 126 and 127 say the check never reached a verdict, not that the
    agent failed. On 7ed65b3 each was a failed outcome (score -1, judges -1, consistency -1)."""
    from pipeline.processors.consistency import outcome_vote
    from pipeline.processors.judges import ReplyJudge, RuleJudge
    from pipeline.processors.outcomes import GateResult, gate_event

    event = gate_event("s", ["pytest", "-q"], GateResult(code, "", "", timed_out, 1.0))
    assert (event.exit_code, event.score, event.detail["passed"]) == (code, None, None)
    assert event.detail["no_outcome"] == why
    assert outcome_vote(event) is None
    for judge in (RuleJudge(), ReplyJudge()):
        v = judge.verdict(event)
        assert (v.score, v.rationale) == (0, f"no outcome: {why} (exit {code})")
    # the same for a turn's gate, and for a gate that really is not there
    real = run_gate(["liverl-no-such-gate-38"], 10.0, echo=False)
    assert real.exit_code == 127 and gate_event("s", ["x"], real, turn=2).score is None
