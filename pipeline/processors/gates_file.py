"""A gates file: a coding agent's quality gates as configuration (the seed's loop-engineering
recipe), so a harness wires its tests to rewards with one file::

    gates:
      - command: "pytest -q"        # split like a shell would; never run through a shell
        record_outcome: true        # the default: a next_states outcome, as record-outcome
      - name: lint
        command: ["ruff", "check", "."]
        timeout_s: 120
        record_outcome: false       # gates the exit code, teaches nothing

``liverl gates run --session S`` runs each gate, then records one outcome for them, all must
pass (``outcomes.gates_event``: failed when any gate failed, passed only when all passed, no
outcome when one timed out or could not run), each gate's own result in ``detail.gates``; a
file of one gate records exactly what ``liverl record-outcome --session S -- CMD`` would. The
file is checked whole before anything runs: a typo is an error naming the field, not a gate skipped.
YAML anchors and aliases are refused as they are read: a kilobyte of nested aliases names
billions of values (every check that walks them would run for minutes).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeline.events import NextState

from .outcomes import MAX_COMMAND_CHARS, GateResult, gates_event, run_gate, workspace_of
from .terminal import TAIL_CHARS

MAX_FILE_BYTES = 64 * 1024
MAX_GATES = 32
MAX_ARGS = 256
MAX_DEPTH = 6  # gates file -> gates list -> gate -> env/command -> value
MAX_TIMEOUT_S = 24 * 3600.0
DEFAULT_FILE = "gates.yaml"


class GatesFileError(ValueError):
    """A gates file that cannot be used, with the path and what is wrong."""


class _AnchorRefused(yaml.YAMLError):
    def __init__(self, what: str, mark: Any) -> None:
        super().__init__(what)
        self.what = what
        self.line: int | None = None if mark is None else int(mark.line) + 1


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses an anchor or an alias when it composes one, before anything
    is built or walked: a gates file writes each value out."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _AnchorRefused(f"alias *{event.anchor}", event.start_mark)
        if getattr(event, "anchor", None) is not None:
            raise _AnchorRefused(f"anchor &{event.anchor}", event.start_mark)
        return super().compose_node(parent, index)


def _load_yaml(text: str) -> Any:
    loader = _NoAliasLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class Gate(BaseModel):
    """One gate: a command whose exit code passes (0) or fails the session."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: str | list[str] = Field(description="The command; a string is split as by sh.")
    name: str | None = Field(default=None, max_length=100)
    record_outcome: bool = True
    timeout_s: float = Field(default=1800.0, gt=0, le=MAX_TIMEOUT_S)
    kind: Literal["test_result", "feedback"] = "test_result"
    turn: int | None = Field(default=None, ge=0, description="Attach to one turn, not the session.")
    source: str = Field(default="record-outcome", min_length=1, max_length=100)
    detail: str = Field(default="", max_length=10_000)

    @field_validator("command")
    @classmethod
    def _command(cls, v: str | list[str]) -> str | list[str]:
        text = v if isinstance(v, str) else shlex.join(v)
        if len(text) > MAX_COMMAND_CHARS:
            raise ValueError(f"longer than {MAX_COMMAND_CHARS} characters")
        argv = _split(v)
        if not argv or not argv[0]:
            raise ValueError("empty command")
        if len(argv) > MAX_ARGS:
            raise ValueError(f"more than {MAX_ARGS} arguments")
        return v

    @property
    def argv(self) -> list[str]:
        return _split(self.command)

    @property
    def label(self) -> str:
        return self.name or shlex.join(self.argv)


class GatesFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gates: list[Gate] = Field(min_length=1, max_length=MAX_GATES)
    fail_fast: bool = Field(default=False, description="Stop at the first failing gate.")


def _split(command: str | list[str]) -> list[str]:
    if isinstance(command, list):
        return command
    try:
        return shlex.split(command)
    except ValueError as exc:  # unbalanced quotes
        raise ValueError(f"cannot split {command!r}: {exc}") from exc


def _depth(value: Any, level: int = 1) -> int:
    if level > MAX_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level)
    return level


def load_gates(path: Path) -> GatesFile:
    """The gates file at ``path``, checked whole (size, depth, fields)."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise GatesFileError(f"{path}: cannot read the gates file ({exc.strerror})") from exc
    if size > MAX_FILE_BYTES:
        raise GatesFileError(f"{path}: {size} bytes, more than the {MAX_FILE_BYTES} allowed")
    try:
        doc = _load_yaml(path.read_text("utf-8"))
    except _AnchorRefused as exc:
        at = f"line {exc.line}: " if exc.line else ""
        raise GatesFileError(
            f"{path}: {at}{exc.what}: YAML anchors and aliases are not "
            "allowed in a gates file (write each value out)"
        ) from exc
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as exc:
        raise GatesFileError(f"{path}: not valid YAML: {exc}") from exc
    if _depth(doc) > MAX_DEPTH:
        raise GatesFileError(f"{path}: nested deeper than {MAX_DEPTH} levels")
    if not isinstance(doc, dict):
        raise GatesFileError(f"{path}: expected a mapping with a 'gates' list")
    try:
        return GatesFile.model_validate(doc)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}" for e in exc.errors()
        )
        raise GatesFileError(f"{path}: {problems}") from exc


@dataclass(frozen=True)
class GateRun:
    """A gate that ran: its result and, when recorded, the outcome it is part of (one event
    for the gates run together, see :func:`run_gates`; ``error`` when it could not be sent)."""

    gate: Gate
    result: GateResult
    event: NextState | None
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.result.exit_code == 0


def run_gates(
    gates: GatesFile,
    session_id: str,
    record: Callable[[NextState], None],
    *,
    turn: int | None = None,
    tail_chars: int = TAIL_CHARS,
    echo: bool = True,
    on_start: Callable[[int, Gate], None] | None = None,
) -> list[GateRun]:
    """Run the gates in order, then record one outcome for them (``outcomes.gates_event``):
    all must pass, each gate's own result in its ``detail.gates``. Gates that name another
    turn, kind or source than the others are a separate outcome each such group (a
    session's outcome and a turn's are different things). Recording a gate's result as it
    ended made the last one the session's reward: a failing pytest then a passing lint read
    +1. ``record`` raising is kept as the run's error. ``turn`` applies to gates that name
    none."""
    ran: list[tuple[Gate, GateResult]] = []
    for i, gate in enumerate(gates.gates):
        if on_start is not None:
            on_start(i, gate)
        result = run_gate(gate.argv, gate.timeout_s, tail_chars, echo=echo)
        ran.append((gate, result))
        if gates.fail_fast and result.exit_code != 0:
            break
    groups: dict[tuple[int | None, str, str], list[tuple[Gate, GateResult]]] = {}
    for gate, result in ran:
        if gate.record_outcome:
            at = gate.turn if gate.turn is not None else turn
            groups.setdefault((at, gate.kind, gate.source), []).append((gate, result))
    sent: dict[int, tuple[NextState, str | None]] = {}
    for (at, kind, source), members in groups.items():
        detail = "\n\n".join(g.detail for g, _ in members if g.detail)
        event = gates_event(
            session_id,
            [(g.argv, r, g.name) for g, r in members],
            turn=at,
            kind=kind,  # type: ignore[arg-type]
            detail=detail,
            source=source,
            workspace=workspace_of(),
        )
        error = None
        try:
            record(event)
        except Exception as exc:  # noqa: BLE001 - Kafka's: the gates' verdict still stands
            error = str(exc)
        for g, _ in members:
            sent[id(g)] = (event, error)
    return [GateRun(g, r, *sent.get(id(g), (None, None))) for g, r in ran]


def exit_code(runs: list[GateRun]) -> int:
    """The first failing gate's exit code; 1 when all passed but one was not recorded."""
    for run in runs:
        if not run.passed:
            return run.result.exit_code
    return 1 if any(run.error for run in runs) else 0
