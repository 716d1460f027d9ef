"""RLVP path penalties: rules as YAML data, validated, evaluated per turn.

R = O + beta * Phi with Phi = -lambda per violated rule (at most once per rule and turn, so the
path part is bounded) + mu per verified compliance. A compliance bonus rewards the compliant
alternative to a specific violation, never mere absence of one (RLVP: avoiding the bad move must
not be worth more than the outcome): a forbidden pattern pays mu only for a call matching one of
its ``alternatives`` (each alternative once per session), a required step for the trigger done
after its requirement, and a repeated failing call for a *recovery*: a goal (program and first
argument, see :func:`goal_of`) that failed and then verifiably succeeded (a result that is not a
failure; no result is not a success), once per goal per session; a GUI action that changed
nothing repeated in a row (``repeated_noop_action``, read from ``gui`` next states:
:meth:`RuleSet.evaluate_gui`) for the action that changes the screen after it. Read-only
commands (``ls``, ``git stash list``, ...: ``read_only_patterns``) never earn a bonus: they cost
nothing, so a bonus for them could be farmed. Validation enforces RLVP's four design rules
(docs/architecture.md#path-penalties):
(1) only verifiable bad actions, never lack of progress; (2) the outcome stays the main driver;
(3) every penalty is paired with a compliance reward; (4) the compliant path is reachable and
the rule cannot be farmed.
"""

from __future__ import annotations

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

VERIFIABLE_KINDS = (
    "repeated_failing_call", "forbidden_pattern", "required_step", "repeated_noop_action"
)
# Kinds people reach for that reward or punish (lack of) progress: rule (1) forbids them.
PROGRESS_KINDS = ("no_progress", "idle", "too_many_turns", "slow", "length", "inaction")
# Commands that change nothing: no bonus may be paid for them (design rule 4). Matched at the
# start of each part of a command line (split on ;, &&, ||, |); a line is read-only when
# every part is.
DEFAULT_READ_ONLY = (
    r"^(ls|cat|head|tail|less|more|echo|printf|pwd|true|false|:|which|type|whoami|id|env"
    r"|printenv|grep|egrep|fgrep|rg|wc|stat|file|du|df|date|uname|tree|test|\[)(\s|$)",
    r"^git\s+(status|log|diff|show|blame|rev-parse|ls-files|describe|shortlog|reflog"
    r"|stash\s+(list|show)|branch(\s+(-a|-r|-v|-vv|--list))*\s*$|remote(\s+-v)?\s*$"
    r"|config\s+--get)(\s|$)",
)
_SEPARATORS = re.compile(r"\s*(?:;|&&|\|\||\|)\s*")


class RuleSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    kind: str
    penalty: float = Field(description="lambda, > 0")
    compliance: float = Field(default=0.0, description="mu, the paired compliance bonus")
    max_repeats: int | None = None
    patterns: list[str] = Field(default_factory=list)
    alternatives: list[str] = Field(
        default_factory=list,
        description="forbidden_pattern: the compliant forms of the forbidden action (e.g. "
        "--force-with-lease for --force); only these earn the compliance bonus.",
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
    """Per-session memory the rules need (JSON-able): failure counts, recent commands, the
    goals that failed and still await their recovery, the bonuses already credited
    (``"<rule id> <alternative index>"``, ``"<rule id> recovered <goal>"``), and the GUI
    action that changed nothing, in a row (``noops``: [action key, count], empty for none)."""

    failures: dict[str, int] = field(default_factory=dict)
    commands: list[tuple[int, str]] = field(default_factory=list)
    failed_goals: list[str] = field(default_factory=list)  # failed, not yet recovered
    credited: list[str] = field(default_factory=list)
    noops: list[Any] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "failures": self.failures,
            "commands": [list(c) for c in self.commands],
            "failed_goals": self.failed_goals,
            "credited": self.credited,
            "noops": self.noops,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any] | None) -> PathHistory:
        if not obj:
            return cls()
        return cls(
            dict(obj["failures"]),
            [(int(t), str(c)) for t, c in obj["commands"]],
            # States written before goals kept no goal (their "unrecovered" was a call key):
            # a recovery from them is not verifiable, so none is paid.
            list(obj.get("failed_goals", [])),
            list(obj.get("credited", [])),
            list(obj.get("noops", [])),  # states written before GUI next states: none
        )


@dataclass(frozen=True)
class PathResult:
    """Phi of one turn and what produced it."""

    phi: float
    compliance_bonus: float
    hits: list[RuleHit]

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


class RuleSet:
    """Validated, compiled rules. Build with :func:`load_rules` or :meth:`from_dict`."""

    def __init__(self, spec: RuleSetSpec) -> None:
        validate_spec(spec)
        self.spec = spec
        self.version = spec.version
        self.beta = spec.beta
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
        return result is not None and any(p.search(result) for p in self._failure)

    def is_success(self, result: str | None) -> bool:
        """Verified success: a result came back and it is not a failure. A call whose result
        never came (a session's last turn) is neither."""
        return result is not None and not self.is_failure(result)

    def is_read_only(self, command: str) -> bool:
        """Every part of the command line changes nothing (and none writes a file by ``>``)."""
        parts = [p for p in _SEPARATORS.split(command.strip()) if p]
        return bool(parts) and all(
            ">" not in p and any(rx.search(p) for rx in self._read_only) for p in parts
        )

    def evaluate(self, turn: int, calls: Sequence[ToolCall], history: PathHistory) -> PathResult:
        """Score one turn's tool calls and update ``history`` (call once per turn, in order)."""
        hits: list[RuleHit] = []
        phi = bonus = 0.0
        recovery = self._recovery(calls, history)
        for rule in self.spec.rules:
            outcome = self._apply(rule, turn, calls, history, recovery)
            if outcome is None:
                continue
            violated, detail = outcome
            if violated:
                phi -= rule.penalty
                hits.append({"rule_id": rule.id, "detail": detail})
            elif rule.compliance > 0:
                phi += rule.compliance
                bonus += rule.compliance
                hits.append({"rule_id": rule.id, "detail": f"compliance: {detail}"})
        for call in calls:  # history after the rules, so a turn is judged on what came before
            history.commands.append((turn, call.command))
            if self.is_failure(call.result):
                history.failures[call.key] = history.failures.get(call.key, 0) + 1
        del history.commands[:-200]
        del history.credited[:-200]
        del history.failed_goals[:-50]
        return PathResult(round(phi, 10), round(bonus, 10), hits)

    def evaluate_gui(
        self, turn: int, action_key: str, no_op: bool | None, history: PathHistory
    ) -> PathResult:
        """Score one GUI action (a ``gui`` next state, in session order) and update
        ``history``. ``no_op``: the screen did not change; None when nothing is known (the
        session's first screen), which neither extends nor breaks a run of no-ops.

        ``repeated_noop_action``: the same action (type, target, text) that changed nothing
        more than ``max_repeats`` times in a row is penalised, once per turn; its bonus pays
        for the action that changes the screen after such a penalised run, once per action
        key and session (the run cost more than the bonus pays: it cannot be farmed)."""
        key, count = (str(history.noops[0]), int(history.noops[1])) if history.noops else ("", 0)
        hits: list[RuleHit] = []
        phi = bonus = 0.0
        for rule in self.spec.rules:
            if rule.kind != "repeated_noop_action":
                continue
            assert rule.max_repeats is not None
            if no_op:
                run = count + 1 if key == action_key else 1
                tag = f"{rule.id} turn {turn}"
                if run > rule.max_repeats and tag not in history.credited:
                    history.credited.append(tag)
                    phi -= rule.penalty
                    hits.append({"rule_id": rule.id,
                                 "detail": f"{action_key[:160]} changed nothing {run} times"})
            elif no_op is False and count > rule.max_repeats:
                tag = f"{rule.id} recovered {key}"
                if tag not in history.credited:
                    history.credited.append(tag)
                    phi += rule.compliance
                    bonus += rule.compliance
                    hits.append({"rule_id": rule.id, "detail": f"compliance: after {key[:120]} "
                                 f"changed nothing {count} times, {action_key[:120]} did"})
        if no_op:
            history.noops = [action_key, count + 1 if key == action_key else 1]
        elif no_op is False:
            history.noops = []
        del history.credited[:-200]
        return PathResult(round(phi, 10), round(bonus, 10), hits)

    def _recovery(self, calls: Sequence[ToolCall], history: PathHistory) -> str | None:
        """The goal this turn recovered (if any), updating the goals still failed. Calls are
        taken in order: a failing call's goal becomes failed; a later call of a failed goal
        that verifiably succeeds recovers it. Read-only calls are neither."""
        recovered = None
        for call in calls:
            if self.is_read_only(call.command):
                continue
            goal = goal_of(call)
            if self.is_failure(call.result):
                if goal not in history.failed_goals:
                    history.failed_goals.append(goal)
            elif self.is_success(call.result) and goal in history.failed_goals:
                history.failed_goals.remove(goal)
                recovered = recovered or goal
        return recovered

    def _apply(
        self,
        rule: RuleSpec,
        turn: int,
        calls: Sequence[ToolCall],
        history: PathHistory,
        recovery: str | None = None,
    ) -> tuple[bool, str] | None:
        """(violated, detail), (False, detail) for a verified compliance, or None when the
        rule does not apply to this turn."""
        c = self._compiled[rule.id]
        if rule.kind == "forbidden_pattern":
            for call in calls:
                if any(p.search(call.command) for p in c.patterns):
                    return True, call.command[:200]
            # The compliant alternative, each one credited once per session (variants of one
            # call are still one alternative) and never for a read-only command.
            for call in calls:
                if self.is_read_only(call.command):
                    continue
                for i, alt in enumerate(c.alternatives):
                    tag = f"{rule.id} {i}"
                    if tag not in history.credited and alt.search(call.command):
                        history.credited.append(tag)
                        return False, f"compliant alternative: {call.command[:160]}"
            return None
        if rule.kind == "repeated_failing_call":
            assert rule.max_repeats is not None
            for call in calls:
                before = history.failures.get(call.key, 0)
                if before >= rule.max_repeats and self.is_failure(call.result):
                    return True, f"{call.key[:160]} failed {before + 1} times"
            tag = f"{rule.id} recovered {recovery}"
            if recovery is not None and tag not in history.credited:
                history.credited.append(tag)
                return False, f"recovered: {recovery[:160]} failed, then succeeded"
            return None
        if rule.kind == "repeated_noop_action":
            return None  # GUI actions come as next states: evaluate_gui
        if rule.kind == "required_step":
            trigger, requires = c.trigger, c.requires
            assert trigger is not None and requires is not None  # validate_spec checks both
            for at, call in enumerate(calls):
                if trigger.search(call.command):
                    window = rule.within_turns
                    runs = [
                        f"{t} {cmd[:80]}" for t, cmd in history.commands
                        if requires.search(cmd) and (window is None or turn - t <= window)
                    ] + [f"{turn} {x.command[:80]}" for x in calls[:at]
                         if requires.search(x.command)]
                    if not runs:
                        return True, call.command[:200]
                    # One bonus per run of the requirement: committing twice after one test
                    # run pays once (design rule 4), and the second commit is not a violation.
                    tag = f"{rule.id} after {runs[-1]}"
                    if tag in history.credited:
                        return None
                    history.credited.append(tag)
                    return False, call.command[:200]
            return None
        raise RuleConfigError(f"rule {rule.id}: unknown kind {rule.kind!r}")


def goal_of(call: ToolCall) -> str:
    """What a call tries to do, so a retry with other flags is the same goal: for a command,
    the tool, the program (path and ``VAR=`` assignments dropped) and its first argument that
    is not a flag (``pytest -x`` and ``pytest`` are one goal, ``nosuchcmd`` and ``true`` two);
    the first part of a command line that is not a ``cd``; for other calls, the call itself."""
    command = call.command
    if command == call.arguments:  # not a shell call: only an identical call is a retry
        return call.key
    parts = [p for p in _SEPARATORS.split(command.strip()) if p]
    line = next((p for p in parts if not re.match(r"^cd(\s|$)", p)), command)
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    words = [w for w in words if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w)] or words
    if not words:
        return call.key
    program = words[0].rsplit("/", 1)[-1]
    first = next((w for w in words[1:] if not w.startswith("-")), "")
    return f"{call.name}:{program} {first}".rstrip()


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
    worst = spec.beta * sum(r.penalty for r in spec.rules if r.penalty > 0)
    best = spec.beta * sum(r.compliance for r in spec.rules if r.compliance > 0)
    limit = spec.max_path_share * spec.outcome_scale
    if worst >= limit:
        problems.append(
            f"inaction trap: the path part can reach beta * sum(lambda) = {worst:g}, not below "
            f"{limit:g} (max_path_share {spec.max_path_share:g} x outcome scale "
            f"{spec.outcome_scale:g}). When penalties can outweigh the outcome, an agent learns "
            "that doing nothing (no tool calls, no risk) beats trying to succeed (design rule 2: "
            "the outcome must stay the main driver); lower beta or the penalties"
        )
    if best >= limit:
        problems.append(
            f"compliance bonuses can reach beta * sum(mu) = {best:g}, not below {limit:g}: the "
            "agent could earn more by ticking rules than by succeeding (design rule 2)"
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
