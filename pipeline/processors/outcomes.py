"""Quality-gate outcomes as ``next_states`` events: a pass/fail said by a person, or a gate
command run to its end (exit code and the ends of its output kept). ``liverl record-outcome``
and ``liverl gates run`` both build their events here, so a gate recorded either way is the
same event. A gate that timed out (124) or could not run (126, 127) is no outcome
(``score`` None), not the agent's failure; gates run together are one outcome, all must pass
(:func:`gates_event`)."""

from __future__ import annotations

import contextlib
import io
import os
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import click

from pipeline.events import NextState, Producer, new_event_id, now_ms
from pipeline.events.types import NextStateKind

from .terminal import TAIL_CHARS, tail
from .verification import NO_OUTCOME_EXIT_CODES, combine_signs, exit_vote


def outcome_event(
    session_id: str,
    passed: bool,
    *,
    turn: int | None = None,
    kind: NextStateKind = "test_result",
    detail: str = "",
    source: str = "record-outcome",
    ts_ms: int | None = None,
) -> NextState:
    """The next state for an outcome; without ``turn`` it is session-scoped: ``scope="session"``
    (``turn`` is then 0 only because the schema requires one). Random id: it is a root event."""
    return NextState(
        event_id=new_event_id(),
        ts_ms=ts_ms if ts_ms is not None else now_ms(),
        producer=Producer(component=source, version="1"),
        session_id=session_id,
        turn=0 if turn is None else turn,
        kind=kind,
        content=detail or ("passed" if passed else "failed"),
        exit_code=0 if passed else 1,
        score=1.0 if passed else -1.0,
        source=source,
        detail={"passed": passed},
        scope="session" if turn is None else "turn",
    )


# ---- quality gates: run a command, keep its exit code and the ends of its output --------------

# The producer of every gate outcome (``record-outcome -- CMD``, ``gates run``), whatever its
# ``source``: the mark of a command liverl ran itself. The gateway writes ``gateway``; a task's
# checker command is run again only from this producer (task_pool.ran_by_liverl).
GATE_RUNNER = "record-outcome"

TIMEOUT_EXIT = 124  # as GNU timeout
KILL_GRACE_S = 2.0  # a gate's tree gets SIGTERM, then SIGKILL after this
_REAPER = Path(__file__).with_name("gate_reaper.py")
MAX_COMMAND_CHARS = 1000  # of the command line kept in the event


@dataclass(frozen=True)
class GateResult:
    """How a gate command ended: shell-style exit code (128+N for signal N, 124 timed out,
    127 not found, 126 not runnable) and the ends of its output."""

    exit_code: int
    stdout_tail: str
    stderr_tail: str
    timed_out: bool
    duration_s: float


class _Tail:
    """Copies a stream through while keeping only its last bytes (bounded memory)."""

    def __init__(self, src: io.BufferedReader, dst: IO[bytes] | None, keep: int) -> None:
        self.keep = keep
        self.buf = bytearray()
        self.thread = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
        self.thread.start()

    def _pump(self, src: io.BufferedReader, dst: IO[bytes] | None) -> None:
        while chunk := src.read1(65536):
            if dst is not None:
                with contextlib.suppress(OSError, ValueError):
                    dst.write(chunk)
                    dst.flush()
            self.buf += chunk
            if len(self.buf) > 2 * self.keep:
                del self.buf[: len(self.buf) - self.keep]

    def wait(self, deadline: float) -> bool:
        """Whether the stream closed (every holder of its write end gone) by ``deadline``."""
        self.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return not self.thread.is_alive()

    def text(self, chars: int) -> str:
        self.thread.join(timeout=5)  # a grandchild may still hold the pipe: do not wait on it
        return tail(bytes(self.buf[-self.keep :]).decode("utf-8", "replace"), chars)


class _Status:
    """What the gate's reaper (``gate_reaper.py``) says on its status pipe: ``ready``, then
    ``exit N`` when the gate's own process ends."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.ready = False
        self.code: int | None = None
        self.closed = False

    def read_until(self, deadline: float, *, ready_only: bool = False) -> None:
        """Read lines until the exit code (or only ``ready``), the pipe's end or the deadline."""
        while not self.closed and self.code is None and not (ready_only and self.ready):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return
            chunk = os.read(self.fd, 4096)
            if not chunk:
                self.closed = True
                return
            self.buf += chunk
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                if line == b"ready":
                    self.ready = True
                elif line.startswith(b"exit "):
                    self.code = int(line[5:])


def _shell_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # signal N: 128 + N, as sh


def _end_tree(proc: subprocess.Popen[bytes], status: _Status, grace_s: float) -> None:
    """Have the reaper end the gate's whole tree (SIGTERM, SIGKILL after ``grace_s``) and
    wait for it; if it does not end, SIGKILL its process group."""
    if proc.poll() is not None:
        return
    if not status.ready:  # its SIGTERM handler is not in place before it says so
        status.read_until(time.monotonic() + 5.0, ready_only=True)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s + 15.0)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def workspace_of(directory: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Where a gate runs (default: here): the absolute directory and, inside a git work tree,
    its HEAD commit (None otherwise). Kept in the outcome so ``liverl tasks check`` can run the
    command again where it ran, on the code it ran on."""
    where = Path(directory or os.getcwd()).resolve()
    commit: str | None = None
    try:
        res = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--verify", "-q", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        commit = (res.stdout.strip() or None) if res.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        commit = None  # no git here: the directory alone
    return {"dir": str(where), "commit": commit}


def run_gate(
    argv: list[str],
    timeout_s: float,
    tail_chars: int = TAIL_CHARS,
    echo: bool = True,
    grace_s: float = KILL_GRACE_S,
    cwd: str | os.PathLike[str] | None = None,
) -> GateResult:
    """Run ``argv`` (no shell), its output passing through to ours when ``echo``, until its
    process has ended *and* its output is closed (a descendant that holds it is still the
    gate running), or ``timeout_s``: then it failed with 124, whatever its process said.

    The gate runs under ``gate_reaper.py`` in a session of its own; at the end, on the
    timeout or on an exception here (Ctrl-C), every process the gate started, one that
    left with ``setsid`` included, gets SIGTERM, then SIGKILL after ``grace_s``: nothing it
    started outlives the call."""
    started = time.monotonic()
    deadline = started + timeout_s
    status_r, status_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(_REAPER), str(status_w), repr(float(grace_s)),
             str(os.getpid()), "--", *argv],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,),
            start_new_session=True, cwd=cwd,
        )  # fmt: skip
    except OSError as exc:
        os.close(status_r)
        return GateResult(126, "", tail(str(exc), tail_chars), False, 0.0)
    finally:
        os.close(status_w)
    # Binary pipes with the default buffering: BufferedReaders (read1 returns what is there).
    assert isinstance(proc.stdout, io.BufferedReader)
    assert isinstance(proc.stderr, io.BufferedReader)
    keep = 4 * tail_chars  # bytes: UTF-8 needs at most 4 a character
    out = _Tail(proc.stdout, click.get_binary_stream("stdout") if echo else None, keep)
    err = _Tail(proc.stderr, click.get_binary_stream("stderr") if echo else None, keep)
    status = _Status(status_r)
    try:
        status.read_until(deadline)
        if status.code is None and status.closed:  # the reaper itself ended early
            code, timed_out = _shell_code(proc.wait()), False
        elif status.code is None or not (out.wait(deadline) and err.wait(deadline)):
            code, timed_out = TIMEOUT_EXIT, True
        else:
            code, timed_out = status.code, False
    finally:  # leftovers (and, on a timeout or Ctrl-C, the gate itself) end here
        _end_tree(proc, status, grace_s)
        os.close(status_r)
    return GateResult(
        code,
        out.text(tail_chars),
        err.text(tail_chars),
        timed_out,
        round(time.monotonic() - started, 3),
    )


def verdict(gate: GateResult, timeout_s: float) -> str:
    """How a gate ended, for people: passed, failed (exit N), timed out after N s, or no
    outcome (exit 126, 127: it could not run)."""
    if gate.timed_out:
        return f"timed out after {timeout_s:g} s (exit {gate.exit_code}): no outcome"
    if gate.exit_code in NO_OUTCOME_EXIT_CODES:
        return f"{NO_OUTCOME_EXIT_CODES[gate.exit_code]} (exit {gate.exit_code}): no outcome"
    return "passed" if gate.exit_code == 0 else f"failed (exit {gate.exit_code})"


def _command(argv: list[str]) -> str:
    cmd = shlex.join(argv)
    return cmd if len(cmd) <= MAX_COMMAND_CHARS else cmd[: MAX_COMMAND_CHARS - 1] + "…"


def gate_record(argv: list[str], gate: GateResult, name: str | None = None) -> dict[str, Any]:
    """One gate's own result, as kept in its outcome's ``detail`` (``passed`` None: no
    outcome, with ``no_outcome`` saying why)."""
    sign = exit_vote(gate.exit_code)
    out: dict[str, Any] = {
        "passed": None if sign is None else sign == 1,
        "command": _command(argv),
        "exit_code": gate.exit_code,
        "stdout_tail": gate.stdout_tail,
        "stderr_tail": gate.stderr_tail,
        "timed_out": gate.timed_out,
        "duration_s": gate.duration_s,
    }
    if sign is None:
        out["no_outcome"] = NO_OUTCOME_EXIT_CODES[gate.exit_code]
    if name:
        out["gate"] = name
    return out


def _text(record: dict[str, Any]) -> str:
    text = f"$ {record['command']}\n{record['stdout_tail']}"
    if record["stderr_tail"]:
        text += f"\n[stderr]\n{record['stderr_tail']}"
    if record["timed_out"]:
        text += "\n[timed out]"
    return text


def gates_event(
    session_id: str,
    gates: list[tuple[list[str], GateResult, str | None]],
    *,
    turn: int | None = None,
    kind: NextStateKind = "test_result",
    detail: str = "",
    source: str = "record-outcome",
    workspace: dict[str, Any] | None = None,
) -> NextState:
    """One outcome for gates run together (argv, result, name each), all must pass: failed
    when any failed (``exit_code`` the first failure's), else no outcome when any could not
    say (124, 126, 127: ``score`` None), else passed. Each gate's own result is kept in
    ``detail.gates``; one gate's is ``detail`` itself, as ``record-outcome -- CMD`` has always
    written it. ``workspace`` (:func:`workspace_of`: where they ran) goes in
    ``detail.workspace``."""
    records = [gate_record(argv, g, name) for argv, g, name in gates]
    signs = [exit_vote(g.exit_code) for _, g, _ in gates]
    sign = combine_signs(signs)
    codes = [g.exit_code for _, g, _ in gates]
    failed = [c for c, v in zip(codes, signs, strict=True) if v == -1]
    silent = [c for c, v in zip(codes, signs, strict=True) if v is None]
    code = failed[0] if failed else silent[0] if silent else 0
    text = "\n\n".join(_text(r) for r in records)
    event = outcome_event(
        session_id, sign == 1, turn=turn, kind=kind, detail=detail or text, source=source
    )
    event.producer = Producer(component=GATE_RUNNER, version="1")
    event.exit_code = code
    event.score = None if sign is None else float(sign)
    if sign is None:
        event.content = detail or f"no outcome\n{text}"
    top: dict[str, Any] = (
        dict(records[0])
        if len(records) == 1
        else {
            "passed": None if sign is None else sign == 1,
            "exit_code": code,
            "timed_out": any(g.timed_out for _, g, _ in gates),
            "duration_s": round(sum(g.duration_s for _, g, _ in gates), 3),
        }
    )
    top["passed"] = None if sign is None else sign == 1
    if len(records) > 1:
        top["gates"] = records
        top["rule"] = "all_must_pass"
    if workspace is not None:
        top["workspace"] = workspace
    event.detail = top
    return event


def gate_event(
    session_id: str,
    argv: list[str],
    gate: GateResult,
    *,
    turn: int | None = None,
    kind: NextStateKind = "test_result",
    detail: str = "",
    source: str = "record-outcome",
    workspace: dict[str, Any] | None = None,
) -> NextState:
    """The outcome of a gate command: pass/fail from its exit code (no outcome for 124, 126,
    127), the judges' text from the ends of its output (or ``detail`` when given), the rest in
    ``detail``."""
    return gates_event(
        session_id,
        [(argv, gate, None)],
        turn=turn,
        kind=kind,
        detail=detail,
        source=source,
        workspace=workspace,
    )
