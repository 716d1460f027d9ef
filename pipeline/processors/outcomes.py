"""Quality-gate outcomes as ``next_states`` events: a pass/fail said by a person, or a gate
command run to its end (exit code and the ends of its output kept). ``liverl record-outcome``
and ``liverl gates run`` both build their events here, so a gate recorded either way is the
same event."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import IO

import click

from pipeline.events import NextState, Producer, new_event_id, now_ms
from pipeline.events.types import NextStateKind

from .terminal import TAIL_CHARS, tail


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

TIMEOUT_EXIT = 124  # as GNU timeout
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

    def text(self, chars: int) -> str:
        self.thread.join(timeout=5)  # a grandchild may still hold the pipe: do not wait on it
        return tail(bytes(self.buf[-self.keep :]).decode("utf-8", "replace"), chars)


def run_gate(
    argv: list[str], timeout_s: float, tail_chars: int = TAIL_CHARS, echo: bool = True
) -> GateResult:
    """Run ``argv`` (no shell) to its end or the timeout, its output passing through to ours
    when ``echo``; the whole process group is killed at the timeout."""
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
    except OSError as exc:
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        return GateResult(code, "", tail(str(exc), tail_chars), False, 0.0)
    # Binary pipes with the default buffering: BufferedReaders (read1 returns what is there).
    assert isinstance(proc.stdout, io.BufferedReader)
    assert isinstance(proc.stderr, io.BufferedReader)
    keep = 4 * tail_chars  # bytes: UTF-8 needs at most 4 a character
    out = _Tail(proc.stdout, click.get_binary_stream("stdout") if echo else None, keep)
    err = _Tail(proc.stderr, click.get_binary_stream("stderr") if echo else None, keep)
    timed_out = False
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = TIMEOUT_EXIT
    if code < 0:
        code = 128 - code  # killed by signal N: 128 + N, as a shell reports it
    return GateResult(
        code,
        out.text(tail_chars),
        err.text(tail_chars),
        timed_out,
        round(time.monotonic() - started, 3),
    )


def gate_event(
    session_id: str,
    argv: list[str],
    gate: GateResult,
    *,
    turn: int | None = None,
    kind: NextStateKind = "test_result",
    detail: str = "",
    source: str = "record-outcome",
) -> NextState:
    """The outcome of a gate command: pass/fail from its exit code, the judges' text from the
    ends of its output (or ``detail`` when given), the rest in ``detail``."""
    cmd = shlex.join(argv)
    if len(cmd) > MAX_COMMAND_CHARS:
        cmd = cmd[: MAX_COMMAND_CHARS - 1] + "…"
    passed = gate.exit_code == 0
    text = f"$ {cmd}\n{gate.stdout_tail}"
    if gate.stderr_tail:
        text += f"\n[stderr]\n{gate.stderr_tail}"
    if gate.timed_out:
        text += "\n[timed out]"
    event = outcome_event(session_id, passed, turn=turn, kind=kind, detail=detail or text,
                          source=source)
    event.exit_code = gate.exit_code
    event.detail = {
        "passed": passed,
        "command": cmd,
        "exit_code": gate.exit_code,
        "stdout_tail": gate.stdout_tail,
        "stderr_tail": gate.stderr_tail,
        "timed_out": gate.timed_out,
        "duration_s": gate.duration_s,
    }
    return event
