"""RLVP path penalties as potential-based shaping: rules as YAML data, validated, evaluated per
turn (and per GUI action) in session order.

Each evaluation emits the shaping term of Ng, Harada & Russell (1999)::

    F = GAMMA * Phi(s') - Phi(s),        GAMMA = 1

over a bounded per-session potential computed from the session's path state (see
docs/architecture.md#path-penalties)::

    Phi(s) = P(s) - min(D(s), -phi_min)                  in [phi_min, phi_max]
    P(s)   = sum over required steps r of mu_r * ([r's requirement's last verified run passed]
                                                  + [r's trigger verifiably done while passing])
    D(s)   = sum over rules r of lambda_r * violations_r - mu_r * refunds_r
             (refunds_r <= violations_r)

So a session's shaping total telescopes to Phi(s_T) - Phi(s_0) = Phi(s_T), whatever its length,
and lies in [phi_min, phi_max]. Nothing is paid per turn, per call or per action key: a progress
fact is a state that holds or not; a compliance bonus (mu) only repays part of a violation of
the same rule (mu < lambda, so D >= 0), so without a verified test run that passed (exit code
0) no sequence of actions brings Phi above 0. Each violation counts once per rule and turn.

Command lines are read part by part (``&&``, ``||``, ``;``, ``|``, ``&``, new lines; quotes
respected), so ``pytest && git commit -m x`` is the two calls: a part verifiably passed when
the line's exit code is 0 and only ``&&`` follows it. Read-only parts (``echo pytest``) run
nothing. Repeated failures are keyed by the call's intent (:func:`intent_of`: the program, plus
the script or subcommand for interpreters and multi-command tools), not its exact arguments.
Exit codes 124, 126 and 127 (timeout, not executable, not found) are neither failure nor
success. Validation enforces RLVP's design rules (docs/architecture.md#path-penalties):
(1) only verifiable bad actions, never lack of progress; (2) the outcome stays the main driver;
(3) every penalty is paired with a compliance reward; (4) the compliant path is reachable and
the rule cannot be farmed.
"""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.events import RuleHit
from pipeline.processors.errors import RuleConfigError

from .terminal import parse_content
from .verification import READ_ONLY_PATTERNS, SEPARATORS

GAMMA = 1.0
"""The shaping discount. 1 makes a session's total telescope exactly to Phi(s_T) - Phi(s_0).
With GAMMA < 1 every step also pays (GAMMA - 1) * Phi(s'), which is positive while Phi < 0:
a long session in debt would earn a growing total, so the bound would not hold."""
NO_OUTCOME_CODES = frozenset({124, 126, 127})
"""Timeout, not executable, not found: the environment's result, not the agent's."""
VERIFIABLE_KINDS = (
    "repeated_failing_call",
    "forbidden_pattern",
    "required_step",
    "repeated_noop_action",
)
# Kinds people reach for that reward or punish (lack of) progress: rule (1) forbids them.
PROGRESS_KINDS = ("no_progress", "idle", "too_many_turns", "slow", "length", "inaction")
# Commands that change nothing: they never earn a refund nor run a required step (design rule
# 4). Matched at the start of each part of a command line; a line is read-only when every
# part is.
DEFAULT_READ_ONLY = READ_ONLY_PATTERNS  # the one list (verification.py)
_SEPARATORS = SEPARATORS
# Words that run the command after them (their own flags and a duration skipped).
_WRAPPERS = frozenset({"env", "time", "nice", "nohup", "sudo", "command", "exec", "timeout"})
_RUNNERS = frozenset({"uv", "poetry", "pipenv", "pdm", "hatch"})  # `<runner> run <command>`
# Programs whose first argument says what they do: a script, or a subcommand.
_INTERPRETERS = frozenset(
    {"python", "node", "bash", "sh", "zsh", "ruby", "perl", "php", "deno", "bun"}
)
_SUBCOMMANDS = frozenset(
    {
        "git",
        "npm",
        "yarn",
        "pnpm",
        "cargo",
        "go",
        "make",
        "docker",
        "pip",
        "uv",
        "poetry",
        "kubectl",
        "gh",
        "dotnet",
        "mvn",
        "gradle",
        "bundle",
        "rake",
        "just",
        "npx",
        "apt",
        "apt-get",
        "brew",
    }
)
_MAX_FAILURES, _MAX_PENALISED, _MAX_CREDITED = 200, 50, 200


class RuleSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    kind: str
    penalty: float = Field(description="lambda, > 0")
    compliance: float = Field(default=0.0, description="mu: a refund, or a progress fact's value")
    max_repeats: int | None = None
    patterns: list[str] = Field(default_factory=list)
    alternatives: list[str] = Field(
        default_factory=list,
        description="forbidden_pattern: the compliant forms of the forbidden action (e.g. "
        "--force-with-lease for --force); only these repay part of a violation.",
    )
    trigger: str | None = None
    requires: str | None = None
    within_turns: int | None = None


class RuleSetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str = Field(min_length=1)
    beta: float = Field(gt=0)
    outcome_scale: float = Field(default=1.0, gt=0)
    max_path_share: float = Field(default=0.5, gt=0, lt=1)
    phi_min: float | None = Field(
        default=None,
        description="The potential's floor (< 0): the most a session's violations can cost, "
        "in units of Phi. Default: minus the sum of the rules' penalties.",
    )
    failure_patterns: list[str] = Field(default_factory=list)
    read_only_patterns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_READ_ONLY),
        description="Commands that change nothing; they never earn a compliance bonus.",
    )
    rules: list[RuleSpec] = Field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a turn, with its result once the next turn revealed it."""

    call_id: str
    name: str
    arguments: str
    result: str | None = None

    @property
    def key(self) -> str:
        """Identity for 'identical call': name plus canonical arguments."""
        try:
            args = orjson.dumps(orjson.loads(self.arguments), option=orjson.OPT_SORT_KEYS).decode()
        except orjson.JSONDecodeError:
            args = self.arguments.strip()
        return f"{self.name}:{args}"

    @property
    def command(self) -> str:
        """Text that command patterns are matched against (a shell's cmd, else all arguments)."""
        try:
            args = orjson.loads(self.arguments)
        except orjson.JSONDecodeError:
            return self.arguments
        if isinstance(args, dict):
            for k in ("cmd", "command", "script"):
                if isinstance(args.get(k), str):
                    return args[k]
        return self.arguments


@dataclass
class PathHistory:
    """Per-session path state (JSON-able): what the potential is computed from, and what the
    rules need to see the next violation.

    ``failures``: failed calls per intent; ``penalised``: intents penalised for repeated
    failure, not yet recovered; ``ran``: the last turn each required step's requirement ran;
    ``passing``: required steps whose latest verified requirement run passed; ``done``: required
    steps whose trigger verifiably succeeded while it passed; ``debt``: per rule, [violations,
    refunds]; ``credited``: once-per-turn marks (``"<rule id> turn <t>"``); ``noops``: the GUI
    action that changed nothing, in a row ([action key, count], empty for none)."""

    failures: dict[str, int] = field(default_factory=dict)
    penalised: list[str] = field(default_factory=list)
    ran: dict[str, int] = field(default_factory=dict)
    passing: list[str] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    debt: dict[str, list[int]] = field(default_factory=dict)
    credited: list[str] = field(default_factory=list)
    noops: list[Any] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "failures": self.failures,
            "penalised": self.penalised,
            "ran": self.ran,
            "passing": self.passing,
            "done": self.done,
            "debt": {k: list(v) for k, v in self.debt.items()},
            "credited": self.credited,
            "noops": self.noops,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any] | None) -> PathHistory:
        """A stored history. One written before the potential (rules-2: failures keyed by the
        exact call, ``commands``, ``failed_goals``) starts the potential at 0: its counts
        cannot be read as intents, so only what happens next is shaped."""
        if not obj or "debt" not in obj:
            return cls(noops=list((obj or {}).get("noops", [])))
        return cls(
            {str(k): int(v) for k, v in obj["failures"].items()},
            [str(x) for x in obj["penalised"]],
            {str(k): int(v) for k, v in obj["ran"].items()},
            [str(x) for x in obj["passing"]],
            [str(x) for x in obj["done"]],
            {str(k): [int(v[0]), int(v[1])] for k, v in obj["debt"].items()},
            [str(x) for x in obj["credited"]],
            list(obj["noops"]),
        )


@dataclass(frozen=True)
class PathResult:
    """One evaluation's shaping: ``phi`` is F = GAMMA * Phi(s') - Phi(s) (the event's
    ``penalty``), ``compliance_bonus`` the part of it that progress and refunds raised,
    ``potential`` Phi(s'), and the hits that explain it."""

    phi: float
    compliance_bonus: float
    hits: list[RuleHit]
    potential: float = 0.0

    @property
    def rule_ids(self) -> list[str]:
        return sorted({h["rule_id"] for h in self.hits})


@dataclass(frozen=True)
class _Compiled:
    """One rule's patterns, compiled once."""

    patterns: list[re.Pattern[str]]
    alternatives: list[re.Pattern[str]]
    trigger: re.Pattern[str] | None
    requires: re.Pattern[str] | None


@dataclass(frozen=True)
class _Part:
    """One part of a command line and what the line's exit code verifies about it."""

    raw: str  # as written: what forbidden patterns search
    text: str  # as run (:func:`command_words`): what requirements and triggers match
    intent: str  # :func:`part_intent`
    read_only: bool
    passed: bool  # the line exited 0 and only `&&` follows this part
    failed: bool  # the line failed and its code is this (last) part's


class _Turn:
    """Violations and refunds of one evaluation, each violation once per rule."""

    def __init__(self, history: PathHistory) -> None:
        self.history = history
        self.violated: set[str] = set()
        self.hits: list[RuleHit] = []

    def violate(self, rule: RuleSpec, detail: str) -> None:
        if rule.id in self.violated:
            return
        self.violated.add(rule.id)
        self.history.debt.setdefault(rule.id, [0, 0])[0] += 1
        self.hits.append({"rule_id": rule.id, "detail": detail})

    def refund(self, rule: RuleSpec, detail: str) -> None:
        """Repay mu of one earlier violation of the same rule: never more refunds than
        violations, so the rule's debt stays >= (lambda - mu) * violations >= 0."""
        debt = self.history.debt.setdefault(rule.id, [0, 0])
        if debt[1] < debt[0]:
            debt[1] += 1
            self.hits.append({"rule_id": rule.id, "detail": f"compliance: {detail}"})


class RuleSet:
    """Validated, compiled rules. Build with :func:`load_rules` or :meth:`from_dict`."""

    def __init__(self, spec: RuleSetSpec) -> None:
        validate_spec(spec)
        self.spec = spec
        self.version = spec.version
        self.beta = spec.beta
        self.phi_min = phi_bounds(spec)[0]
        self.phi_max = phi_bounds(spec)[1]
        self._by_id = {r.id: r for r in spec.rules}
        self._failure = [re.compile(p) for p in spec.failure_patterns]
        self._read_only = [re.compile(p) for p in spec.read_only_patterns]
        self._compiled = {
            r.id: _Compiled(
                patterns=[re.compile(p) for p in r.patterns],
                alternatives=[re.compile(p) for p in r.alternatives],
                trigger=re.compile(r.trigger) if r.trigger else None,
                requires=re.compile(r.requires) if r.requires else None,
            )
            for r in spec.rules
        }

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> RuleSet:
        try:
            spec = RuleSetSpec.model_validate(obj)
        except ValidationError as exc:
            raise RuleConfigError(f"malformed rule set: {exc}") from exc
        return cls(spec)

    def is_failure(self, result: str | None) -> bool:
        """The call failed: its result reports an exit code other than 0 and the no-outcome
        codes, or (no code reported) matches a failure pattern."""
        if result is None:
            return False
        code = exit_code(result)
        if code is not None:
            return code != 0 and code not in NO_OUTCOME_CODES
        return any(p.search(result) for p in self._failure)

    def is_success(self, result: str | None) -> bool:
        """A result came back and it is neither a failure nor a no-outcome code. A call whose
        result never came (a session's last turn) is neither."""
        if result is None:
            return False
        code = exit_code(result)
        return code == 0 if code is not None else not self.is_failure(result)

    def is_read_only(self, command: str) -> bool:
        """Every part of the command line changes nothing (and none writes a file by ``>``)."""
        parts = [p for p in _SEPARATORS.split(command.strip()) if p]
        return bool(parts) and all(
            ">" not in p and any(rx.search(p) for rx in self._read_only) for p in parts
        )

    def potential(self, history: PathHistory) -> float:
        """Phi(s) = P(s) - min(D(s), -phi_min), in [phi_min, phi_max] (module doc)."""
        progress = sum(
            r.compliance * ((r.id in history.passing) + (r.id in history.done))
            for r in self.spec.rules
            if r.kind == "required_step"
        )
        return progress - min(self._debt(history), -self.phi_min)

    def _debt(self, history: PathHistory) -> float:
        return sum(
            r.penalty * v - r.compliance * min(f, v)
            for rid, (v, f) in history.debt.items()
            if (r := self._by_id.get(rid)) is not None
        )

    def _parts(self, call: ToolCall) -> list[_Part]:
        """The call's command line as parts, with what its exit code verifies about each (a
        call that is no shell command is one part, which runs no requirement or trigger)."""
        code = exit_code(call.result) if call.result is not None else None
        if call.command == call.arguments:
            return [
                _Part(
                    call.command,
                    "",
                    call.key,
                    False,
                    code == 0,
                    code is not None and code != 0 and code not in NO_OUTCOME_CODES,
                )
            ]
        pieces = shell_parts(call.command)
        out = []
        for i, (raw, _) in enumerate(pieces):
            after = [sep for _, sep in pieces[i:]]
            last = i == len(pieces) - 1
            passed = code == 0 and all(s == "&&" for s in after[:-1]) and after[-1] == ""
            failed = (
                code is not None
                and code != 0
                and code not in NO_OUTCOME_CODES
                and last
                and after[-1] == ""
                and (i == 0 or pieces[i - 1][1] != "&&")
            )
            words = command_words(raw)  # `env X=1 pytest` runs pytest: not read-only
            text = " ".join(words)
            read_only = not text or self.is_read_only(text)
            out.append(
                _Part(
                    raw,
                    text,
                    part_intent(call.name, raw, words, read_only),
                    read_only,
                    passed,
                    failed,
                )
            )
        return out

    def _succeeded(self, call: ToolCall, parts: list[_Part]) -> list[list[_Part]]:
        """What verifiably succeeded, as units that each count once: with an exit code, every
        part it verifies (so one line is its parts as separate calls); without one, a result
        that is no failure is the whole line, once."""
        if call.result is None:
            return []
        if exit_code(call.result) is not None:
            return [[p] for p in parts if p.passed]
        return [parts] if self.is_success(call.result) else []

    def evaluate(self, turn: int, calls: Sequence[ToolCall], history: PathHistory) -> PathResult:
        """Shape one turn's tool calls and update ``history`` (call once per turn, in order)."""
        before = self._state(history)
        t = _Turn(history)
        for call in calls:
            parts = self._parts(call)
            self._forbidden(call, parts, t)
            self._repeated_failure(call, parts, t)
            self._required_steps(turn, parts, t)
        del history.penalised[:-_MAX_PENALISED]
        return self._result(before, t)

    def evaluate_gui(
        self, turn: int, action_key: str, no_op: bool | None, history: PathHistory
    ) -> PathResult:
        """Shape one GUI action (a ``gui`` next state, in session order) and update
        ``history``. ``no_op``: the screen did not change; None when nothing is known (the
        session's first screen), which neither extends nor breaks a run of no-ops.

        ``repeated_noop_action``: the same action (type, target, text) that changed nothing
        more than ``max_repeats`` times in a row is a violation, once per turn; the action that
        changes the screen after such a run repays mu of one violation (never more refunds than
        violations, whatever the action keys)."""
        before = self._state(history)
        t = _Turn(history)
        key, count = (str(history.noops[0]), int(history.noops[1])) if history.noops else ("", 0)
        for rule in self.spec.rules:
            if rule.kind != "repeated_noop_action":
                continue
            assert rule.max_repeats is not None
            if no_op:
                run = count + 1 if key == action_key else 1
                tag = f"{rule.id} turn {turn}"
                if run > rule.max_repeats and tag not in history.credited:
                    history.credited.append(tag)
                    t.violate(rule, f"{action_key[:160]} changed nothing {run} times")
            elif no_op is False and count > rule.max_repeats:
                t.refund(
                    rule, f"after {key[:120]} changed nothing {count} times, {action_key[:120]} did"
                )
        if no_op:
            history.noops = [action_key, count + 1 if key == action_key else 1]
        elif no_op is False:
            history.noops = []
        return self._result(before, t)

    def _state(self, history: PathHistory) -> tuple[float, float, float]:
        """(Phi, progress, capped debt) of a history."""
        debt = min(self._debt(history), -self.phi_min)
        phi = self.potential(history)
        return phi, phi + debt, debt

    def _result(self, before: tuple[float, float, float], t: _Turn) -> PathResult:
        del t.history.credited[:-_MAX_CREDITED]
        after = self._state(t.history)
        shaping = GAMMA * after[0] - before[0]
        bonus = max(0.0, after[1] - before[1]) + max(0.0, before[2] - after[2])
        return PathResult(round(shaping, 10), round(bonus, 10), t.hits, round(after[0], 10))

    def _forbidden(self, call: ToolCall, parts: list[_Part], t: _Turn) -> None:
        """Part by part, in order: a forbidden pattern is a violation; a verified success of a
        compliant alternative (in a part that is not itself forbidden) repays part of an
        earlier violation of the rule. So the parts of one line count as separate calls."""
        units = self._succeeded(call, parts)
        unit_of = {id(p): i for i, unit in enumerate(units) for p in unit}
        for rule in self.spec.rules:
            if rule.kind != "forbidden_pattern":
                continue
            c = self._compiled[rule.id]
            repaid: set[int] = set()  # a unit refunds once (a line without an exit code is one)
            for p in parts:
                if any(rx.search(p.raw) for rx in c.patterns):
                    t.violate(rule, p.raw[:200])
                    continue
                unit = unit_of.get(id(p))
                if (
                    unit is not None
                    and unit not in repaid
                    and not p.read_only
                    and any(alt.search(p.raw) for alt in c.alternatives)
                ):
                    repaid.add(unit)
                    t.refund(rule, f"compliant alternative: {p.raw[:160]}")

    def _repeated_failure(self, call: ToolCall, parts: list[_Part], t: _Turn) -> None:
        """A failed line counts against its intent (its first part that is not a ``cd``); the
        same intent failing more than ``max_repeats`` times is a violation (once per turn).
        A verified success of a penalised intent repays part of one."""
        rules = [r for r in self.spec.rules if r.kind == "repeated_failing_call"]
        if not rules:
            return
        h = t.history
        if self.is_failure(call.result):
            intent = _line_intent(call, parts)
            count = h.failures.pop(intent, 0) + 1
            h.failures[intent] = count  # re-inserted: the oldest intents are dropped first
            del_oldest(h.failures, _MAX_FAILURES)
            for rule in rules:
                assert rule.max_repeats is not None
                if count > rule.max_repeats:
                    t.violate(rule, f"{intent[:160]} failed {count} times")
                    if intent not in h.penalised:
                        h.penalised.append(intent)
            return
        for unit in self._succeeded(call, parts):
            intent = _line_intent(call, unit)
            if intent in h.penalised:
                h.penalised.remove(intent)
                for rule in rules:
                    t.refund(rule, f"recovered: {intent[:160]} failed, then succeeded")

    def _required_steps(self, turn: int, parts: list[_Part], t: _Turn) -> None:
        """Part by part: a requirement run (not read-only, matched at the part's start)
        records its turn and, when its result is verified, whether it passed; a trigger with
        no requirement run within ``within_turns`` is a violation; a trigger that verifiably
        succeeded while the requirement's latest verified run passed is progress, once."""
        rules = [r for r in self.spec.rules if r.kind == "required_step"]
        if not rules:
            return
        h = t.history
        for part in parts:
            if part.read_only:
                continue
            for rule in rules:
                c = self._compiled[rule.id]
                assert c.trigger is not None and c.requires is not None
                if c.requires.match(part.text):
                    h.ran[rule.id] = turn
                    if part.passed and rule.id not in h.passing:
                        h.passing.append(rule.id)
                        t.hits.append(
                            {"rule_id": rule.id, "detail": f"compliance: passed: {part.text[:160]}"}
                        )
                    elif part.failed and rule.id in h.passing:
                        h.passing.remove(rule.id)
                        t.hits.append(
                            {"rule_id": rule.id, "detail": f"no longer passes: {part.text[:160]}"}
                        )
                elif c.trigger.match(part.text):
                    last = h.ran.get(rule.id)
                    window = rule.within_turns
                    if last is None or (window is not None and turn - last > window):
                        t.violate(rule, part.text[:200])
                    elif part.passed and rule.id in h.passing and rule.id not in h.done:
                        h.done.append(rule.id)
                        t.hits.append(
                            {
                                "rule_id": rule.id,
                                "detail": "compliance: done after "
                                f"a passing run: {part.text[:160]}",
                            }
                        )


@functools.lru_cache(maxsize=8)  # a call's result is read several times in one evaluation
def exit_code(result: str) -> int | None:
    """The exit code a tool result reports (terminal adapter formats), else None."""
    found = parse_content(result, 0)
    return found.exit_code if found is not None else None


def del_oldest(items: dict[str, int], keep: int) -> None:
    """Drop the oldest entries (insertion order) beyond ``keep``."""
    for k in list(items)[: max(0, len(items) - keep)]:
        del items[k]


def shell_parts(command: str) -> list[tuple[str, str]]:
    """A command line as (part, separator after it): ``&&``, ``||``, ``|`` (also ``|&``),
    ``;`` (also a new line), ``&`` (background; not in ``2>&1`` or ``&>``), "" for the end.
    Quotes and backslash escapes are respected; empty parts are dropped."""
    parts: list[tuple[str, str]] = []
    buf: list[str] = []
    quote: str | None = None
    i, n = 0, len(command)

    def flush(sep: str) -> None:
        text = "".join(buf).strip()
        buf.clear()
        if text:  # an empty part (`a &&\n b`) keeps the separator before it
            parts.append((text, sep))

    while i < n:
        ch = command[i]
        if quote is not None:
            buf.append(ch)
            if ch == "\\" and quote == '"' and i + 1 < n:
                buf.append(command[i + 1])
                i += 1
            elif ch == quote:
                quote = None
            i += 1
            continue
        if ch in "'\"":
            quote = ch
        elif ch == "\\" and i + 1 < n:
            buf.append(ch + command[i + 1])
            i += 2
            continue
        two = command[i : i + 2]
        sep, width = "", 1
        if two in ("&&", "||"):
            sep, width = two, 2
        elif two == "|&":
            sep, width = "|", 2
        elif ch in ";\n":
            sep = ";"
        elif ch == "|":
            sep = "|"
        elif ch == "&" and (i == 0 or command[i - 1] not in "<>") and command[i + 1 : i + 2] != ">":
            sep = "&"
        if sep:
            flush(sep)
            i += width
            continue
        buf.append(ch)
        i += 1
    flush("")
    if parts and parts[-1][1] == ";":  # a trailing `;` ends the line like its end
        parts[-1] = (parts[-1][0], "")
    return parts


def command_words(part: str) -> list[str]:
    """The words of one part of a command line, as what runs: ``VAR=`` assignments, wrappers
    (``env``, ``timeout 60``, ``nice -n 5``, ``sudo``, ...), ``uv run`` and the like dropped,
    ``python -m X`` read as ``X``, the program's path dropped (``/usr/bin/make`` is ``make``)."""
    try:
        words = shlex.split(part)
    except ValueError:
        words = part.split()
    while True:
        before = len(words)
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        if not words:
            return []
        prog = words[0].rsplit("/", 1)[-1]
        if prog in _WRAPPERS:
            words = words[1:]
            while words and (words[0].startswith("-") or re.fullmatch(r"[\d.]+[smhd]?", words[0])):
                words = words[1:]
        elif (prog in _RUNNERS and words[1:2] == ["run"]) or (
            re.fullmatch(r"python[\d.]*", prog) and len(words) > 2 and words[1] == "-m"
        ):
            words = words[2:]
        if len(words) == before:
            break
    if words:
        words[0] = words[0].rsplit("/", 1)[-1]
    return words


def part_intent(name: str, raw: str, words: list[str], read_only: bool) -> str:
    """What one part of a command line tries to do, so that a retry with other arguments is
    the same intent: the tool and the program (:func:`command_words`), plus the script of an
    interpreter (``python step1.py``) or the subcommand of a multi-command tool (``git
    commit``, ``make test``); ``pytest -k case1`` and ``pytest -x`` are one intent. A read-only
    part (whose failures are exploration: ``grep`` exits 1 on no match): the part itself."""
    if read_only or not words:
        return f"{name}:{raw}"
    program = "python" if re.fullmatch(r"python[\d.]*", words[0]) else words[0]
    if program in _INTERPRETERS or program in _SUBCOMMANDS:
        first = next((w for w in words[1:] if not w.startswith("-")), "")
        return f"{name}:{program} {first}".rstrip()
    return f"{name}:{program}"


def _line_intent(call: ToolCall, parts: list[_Part]) -> str:
    """The intent of a line (or unit): that of its first part that is not a ``cd``."""
    return next(
        (p.intent for p in parts if not re.match(r"^cd(\s|$)", p.text)),
        parts[0].intent if parts else call.key,
    )


def intent_of(call: ToolCall, rules: RuleSet | None = None) -> str:
    """The intent a failure of ``call`` counts against (:func:`part_intent` of its first part
    that is not a ``cd``; a call that is no shell command: the call itself). ``rules`` says
    what is read-only (default: the built-in read-only commands)."""
    rs = rules if rules is not None else _DEFAULT_READ_ONLY_RULES
    return _line_intent(call, rs._parts(call))


def phi_bounds(spec: RuleSetSpec) -> tuple[float, float]:
    """(phi_min, phi_max) of a rule set: the floor (``phi_min``, default minus the sum of the
    penalties) and the sum of the progress facts (two per required step: mu each)."""
    floor = (
        spec.phi_min if spec.phi_min is not None else -sum(max(r.penalty, 0.0) for r in spec.rules)
    )
    top = sum(2 * max(r.compliance, 0.0) for r in spec.rules if r.kind == "required_step")
    return round(floor, 10), round(top, 10)


def validate_spec(spec: RuleSetSpec) -> None:
    """Reject rule sets that break RLVP's design rules, saying which and why."""
    problems: list[str] = []
    ids = [r.id for r in spec.rules]
    if len(set(ids)) != len(ids):
        problems.append("rule ids must be unique")
    for p in spec.failure_patterns:
        _compile(p, "failure_patterns", problems)
    for p in spec.read_only_patterns:
        rx = _compile(p, "read_only_patterns", problems)
        if rx is not None and rx.search("") is not None:
            problems.append(f"read_only_patterns: {p!r} matches every command")
    for r in spec.rules:
        where = f"rule {r.id!r}"
        if r.kind in PROGRESS_KINDS:
            problems.append(
                f"{where}: kind {r.kind!r} penalizes lack of progress, which is not a verifiable "
                "bad action (design rule 1: penalize only verifiable bad actions)"
            )
            continue
        if r.kind not in VERIFIABLE_KINDS:
            problems.append(f"{where}: unknown kind {r.kind!r}; use one of {VERIFIABLE_KINDS}")
            continue
        if r.penalty <= 0:
            problems.append(f"{where}: penalty (lambda) must be > 0")
        if r.compliance <= 0:
            problems.append(
                f"{where}: needs a compliance bonus mu > 0 (design rule 3: pair each penalty "
                "with a compliance reward, so the agent learns what to do, not only what to avoid)"
            )
        elif r.compliance >= r.penalty:
            problems.append(
                f"{where}: compliance bonus {r.compliance} must be below its penalty "
                f"{r.penalty} (design rule 4: the bonus must not be farmable)"
            )
        if r.kind == "forbidden_pattern":
            if not r.patterns:
                problems.append(f"{where}: needs at least one pattern")
            for p in r.patterns:
                rx = _compile(p, where, problems)
                if rx is not None and rx.search("") is not None:
                    problems.append(
                        f"{where}: pattern {p!r} matches the empty command, so no compliant "
                        "path exists (design rule 4: the compliant path must be reachable)"
                    )
            for p in r.alternatives:
                rx = _compile(p, where, problems)
                if rx is not None and rx.search("") is not None:
                    problems.append(
                        f"{where}: alternative {p!r} matches every command, so its bonus is "
                        "farmable (design rule 4)"
                    )
        elif r.kind in ("repeated_failing_call", "repeated_noop_action"):
            if r.max_repeats is None or r.max_repeats < 1:
                problems.append(f"{where}: max_repeats (N) must be >= 1")
        elif r.kind == "required_step":
            if not r.trigger or not r.requires:
                problems.append(f"{where}: needs both trigger and requires patterns")
            else:
                trig = _compile(r.trigger, where, problems)
                req = _compile(r.requires, where, problems)
                if trig is not None and trig.search("") is not None:
                    problems.append(f"{where}: trigger matches every command")
                if req is not None and req.search("") is not None:
                    problems.append(
                        f"{where}: requires matches every command, so the rule is gameable "
                        "(design rule 4)"
                    )
            if r.within_turns is not None and r.within_turns < 1:
                problems.append(f"{where}: within_turns must be >= 1")
    if spec.phi_min is not None and spec.phi_min >= 0:
        problems.append(f"phi_min {spec.phi_min:g} must be below 0 (the potential's floor)")
    floor, top = phi_bounds(spec)
    limit = spec.max_path_share * spec.outcome_scale
    if spec.beta * (top - floor) >= limit:
        problems.append(
            f"inaction trap: the path part spans beta * (phi_max - phi_min) = "
            f"{spec.beta * (top - floor):g}, not below {limit:g} (max_path_share "
            f"{spec.max_path_share:g} x outcome scale {spec.outcome_scale:g}). When penalties "
            "can outweigh the outcome, an agent learns that doing nothing (no tool calls, no "
            "risk) beats trying to succeed, and bonuses that can outweigh it are earned instead "
            "of succeeding (design rule 2: the outcome must stay the main driver); lower beta, "
            "the penalties or phi_min's size"
        )
    if problems:
        raise RuleConfigError("invalid path-penalty rules:\n- " + "\n- ".join(problems))


def load_rules(path: str | Path) -> RuleSet:
    """Load and validate a YAML rule set."""
    with open(path) as fh:
        obj = yaml.safe_load(fh)
    if not isinstance(obj, dict):
        raise RuleConfigError(f"{path}: expected a mapping at the top level")
    return RuleSet.from_dict(obj)


def _compile(pattern: str, where: str, problems: list[str]) -> re.Pattern[str] | None:
    try:
        return re.compile(pattern)
    except re.error as exc:
        problems.append(f"{where}: bad regex {pattern!r}: {exc}")
        return None


_DEFAULT_READ_ONLY_RULES = RuleSet(RuleSetSpec(version="read-only", beta=0.1))
