"""What an outcome says, in one place: which exit codes are no outcome, which terminal
commands verify nothing, and how a session's gates combine.

Every reader of a next state's pass/fail (the rule and reply judges, judge consistency, the
task pool; the reward assembly through :func:`outcome_value`) goes through
:func:`outcome_sign`, so they cannot disagree:

- **No outcome.** Exit codes 124 (timed out, as GNU timeout and ``run_gate``), 126 (not
  executable) and 127 (not found) say the check did not run to a verdict, not that the agent
  failed: they are no outcome, whatever score the event carries.
- **Read-only commands verify nothing.** A ``terminal`` next state (a command the agent ran)
  whose commands all change nothing (``ls``, ``cat``, ``echo``, ``git status``, ...:
  :data:`READ_ONLY_PATTERNS`) is no outcome either way: its exit 0 is not a success, and a
  ``grep`` that found nothing (exit 1) is not a failure. Gates are the operator's and count
  whatever their command. Only gates, test runs and explicit feedback verify a session.
- **All must pass.** A session's outcome combines its checks (:func:`outcome_key`: each gate
  command, each gates-file run, each caller's verdict) by their latest results: failed when any
  failed, passed only when all passed (:func:`all_must_pass`); no longer the last recorded one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, MutableMapping, Sequence
from typing import Protocol, TypeVar

from pipeline.events import NextState
from pipeline.events.types import Vote

NO_OUTCOME_EXIT_CODES: dict[int, str] = {
    124: "timed out",
    126: "not executable",
    127: "command not found",
}

# Commands that change nothing, matched at the start of each part of a command line (split on
# ;, &&, ||, |); a line is read-only when every part is and none writes a file with ``>``.
# The one list: the path penalties' bonus rule reads the same patterns.
READ_ONLY_PATTERNS: tuple[str, ...] = (
    r"^(ls|cat|head|tail|less|more|echo|printf|pwd|true|false|:|which|type|whoami|id|env"
    r"|printenv|grep|egrep|fgrep|rg|wc|stat|file|du|df|date|uname|tree|test|\[)(\s|$)",
    r"^git\s+(status|log|diff|show|blame|rev-parse|ls-files|describe|shortlog|reflog"
    r"|stash\s+(list|show)|branch(\s+(-a|-r|-v|-vv|--list))*\s*$|remote(\s+-v)?\s*$"
    r"|config\s+--get)(\s|$)",
)
SEPARATORS = re.compile(r"\s*(?:;|&&|\|\||\|)\s*")
_READ_ONLY = tuple(re.compile(p) for p in READ_ONLY_PATTERNS)


def is_read_only(command: str, patterns: Sequence[re.Pattern[str]] = _READ_ONLY) -> bool:
    """Every part of the command line changes nothing (and none writes a file by ``>``)."""
    parts = [p for p in SEPARATORS.split(command.strip()) if p]
    return bool(parts) and all(">" not in p and any(rx.search(p) for rx in patterns) for p in parts)


def exit_vote(code: int, command: str | None = None) -> Vote | None:
    """What one command's exit code says: +1 passed, -1 failed, None no outcome (a code of
    :data:`NO_OUTCOME_EXIT_CODES`, or a read-only ``command``)."""
    if code in NO_OUTCOME_EXIT_CODES:
        return None
    if command and is_read_only(command):
        return None
    return 1 if code == 0 else -1


def commands_of(state: NextState) -> list[str | None]:
    """The commands a next state reports: ``detail.command`` (a gate, a posted terminal
    result), else each entry of ``detail.terminal`` (pairing; None where not known)."""
    detail = state.detail if isinstance(state.detail, dict) else {}
    command = detail.get("command")
    if isinstance(command, str) and command:
        return [command]
    entries = detail.get("terminal")
    if isinstance(entries, list):
        return [
            e.get("command") if isinstance(e, dict) and isinstance(e.get("command"), str) else None
            for e in entries
        ]
    return []


def no_outcome_reason(state: NextState) -> str | None:
    """Why a next state with an exit code carries no outcome (None: it does, or has no exit
    code): a no-outcome code, or a ``terminal`` state whose commands are all read-only."""
    if state.exit_code is None:
        return None
    if state.exit_code in NO_OUTCOME_EXIT_CODES:
        return f"{NO_OUTCOME_EXIT_CODES[state.exit_code]} (exit {state.exit_code})"
    if state.kind == "terminal":
        commands = commands_of(state)
        if commands and all(c is not None and is_read_only(c) for c in commands):
            return "read-only command"
    return None


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def outcome_sign(state: NextState) -> Vote | None:
    """The pass/fail a next state verifies: None when its exit code is no outcome
    (:func:`no_outcome_reason`, over any score the source derived from it), else the sign of
    its explicit score, else +1 for exit 0 and -1 for any other code, else None."""
    if no_outcome_reason(state) is not None:
        return None
    if state.score is not None:
        s = _sign(state.score)
        return s if s != 0 else None  # type: ignore[return-value]
    if state.exit_code is not None:
        return 1 if state.exit_code == 0 else -1
    return None


def outcome_value(state: NextState) -> float | None:
    """A session outcome's value for the reward: its explicit score (a NaN is none, an
    infinite one its sign), else ±1 from its exit code; None when it carries no outcome (then
    it must not be recorded as one)."""
    if no_outcome_reason(state) is not None:
        return None
    if state.score is not None and not math.isnan(state.score):
        # Non-finite only from an in-process producer (JSON has none): its sign.
        v = float(state.score)
        return v if math.isfinite(v) else math.copysign(1.0, v)
    if state.exit_code is not None:
        return 1.0 if state.exit_code == 0 else -1.0
    return None


def combine_signs(signs: Iterable[Vote | None]) -> Vote | None:
    """All must pass: -1 when any failed; else None when any said nothing (or there are
    none); else +1."""
    seen = list(signs)
    if any(s == -1 for s in seen):
        return -1
    if not seen or any(s is None for s in seen):
        return None
    return 1


def outcome_key(state: NextState) -> str:
    """Which check a session outcome is the result of, so that a check's later result replaces
    its earlier one while different checks combine: a gates-file run by its gates' commands, a
    gate by its command, anything else (a person's or a client's verdict) by its source."""
    detail = state.detail if isinstance(state.detail, dict) else {}
    gates = detail.get("gates")
    if isinstance(gates, list) and len(gates) > 1:
        names = sorted(str(g.get("command")) for g in gates if isinstance(g, dict))
        return "gates:" + "\x1f".join(names)
    command = detail.get("command")
    if isinstance(command, str) and command:
        return "command:" + command
    return f"said:{state.source or state.producer.component}"


class Recorded(Protocol):
    """An outcome as assembly keeps it (``rewards.Outcome``)."""

    event_id: str
    ts_ms: int
    value: float


R = TypeVar("R", bound=Recorded)


def keep_latest(entries: MutableMapping[str, R], key: str, entry: R) -> None:
    """``entry`` becomes ``key``'s result unless a later one (by ts_ms, then event id) is."""
    prev = entries.get(key)
    if prev is None or (entry.ts_ms, entry.event_id) > (prev.ts_ms, prev.event_id):
        entries[key] = entry


def all_must_pass(entries: Iterable[R]) -> R | None:
    """The session's outcome from its checks' latest results: the worst one (a failure when
    any failed), the latest of equals; None without any."""
    best: R | None = None
    for e in entries:
        if best is None or (e.value, -e.ts_ms, e.event_id) < (
            best.value,
            -best.ts_ms,
            best.event_id,
        ):
            best = e
    return best
