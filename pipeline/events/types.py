"""Typed events: one dataclass per event type, mirroring `schemas/<type>.v1.json`.

Token ids, log-probs and masks are ``Sequence`` fields: writers pass lists (or anything the
codec can pack), decoding gives the packed arrays of `arrays.py`.

Field names and optionality match the schema files exactly (a test checks it):
fields without a default are required by the schema; `type` and
`schema_version` are fixed per class and filled in automatically.
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypedDict

from .ids import derive_event_id, now_ms
from .validation import SCHEMA_VERSION

FinishReason = Literal["stop", "length", "tool_calls", "abort"]
NextStateKind = Literal[
    "user_reply", "tool_result", "terminal", "gui", "test_result", "feedback", "session_end"
]
WeightsStatus = Literal["candidate", "promoted", "rejected"]
Vote = Literal[-1, 0, 1]  # a PRM score: bad, neutral, good
GateVoteSource = Literal["held_out", "probe"]
TaskStatus = Literal["accepted", "rejected", "withdrawn"]
TrainerState = Literal["training", "judging", "paused", "stopped"]


class WeightFile(TypedDict):
    """One file of a published weight version (path relative to the manifest's uri)."""

    path: str
    sha256: str
    bytes: int


class RuleHit(TypedDict, total=False):
    """One path-penalty rule that fired on a turn."""

    rule_id: str
    detail: str


@dataclass(slots=True, kw_only=True, frozen=True)
class Producer:
    """Which component (and config version) wrote an event."""

    component: str
    version: str


@dataclass(slots=True, kw_only=True)
class Event:
    """Envelope shared by every event; not an event type by itself."""

    event_id: str
    type: str = field(default="", init=False)
    schema_version: int = field(default=SCHEMA_VERSION, init=False)
    ts_ms: int = field(default_factory=now_ms)
    producer: Producer
    parents: list[str] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class TurnEvent(Event):
    """Envelope of session- and turn-scoped events; `session_id` is the Kafka key."""

    session_id: str
    turn: int


@dataclass(slots=True, kw_only=True)
class Interaction(TurnEvent):
    """A main-line model call with the engine's exact tokens and log-probs."""

    type: str = field(default="interaction", init=False)
    policy_id: str
    weight_version: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    prompt_token_ids: Sequence[int]
    response_token_ids: Sequence[int]
    response_logprobs: Sequence[float]
    response_text: str
    sampling: dict[str, Any] = field(default_factory=dict)
    finish_reason: FinishReason
    latency_ms: float
    train: bool = True
    turn_type: Literal["main", "side"] = "main"
    session_done: bool = False
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    group_id: str | None = None  # sessions attempting the same task (GRPO-style group)
    # Added to v1 (optional): whose turn this is (X-Liverl-User, else the API key's id), so
    # `liverl forget --user` can find a user's sessions; None in older events.
    user_id: str | None = None


@dataclass(slots=True, kw_only=True)
class NextState(TurnEvent):
    """What followed a turn; the evidence the judges score it against."""

    type: str = field(default="next_state", init=False)
    kind: NextStateKind
    content: str
    role: str | None = None
    exit_code: int | None = None
    source: str
    score: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    scope: Literal["turn", "session"] = "turn"  # session: an outcome of the whole session


@dataclass(slots=True, kw_only=True)
class PrmScore(TurnEvent):
    """Judge verdict on a turn: plurality of votes in {-1, 0, +1}."""

    type: str = field(default="prm_score", init=False)
    score: Vote
    votes: list[Vote | None]
    judge_id: str
    judge_version: str
    rationale: str = ""
    error: str | None = None
    # A panel's members in vote order: {judge_id, judge_version, vote, weight} each, so the
    # consistency processor can tally every member by its own verdicts.
    members: list[dict[str, Any]] | None = None


@dataclass(slots=True, kw_only=True)
class Hint(TurnEvent):
    """An accepted hint candidate for on-policy distillation."""

    type: str = field(default="hint", init=False)
    hint: str
    judge_id: str
    rank: int


@dataclass(slots=True, kw_only=True)
class PathPenalty(TurnEvent):
    """A turn's (or GUI action's) path shaping, R = O + beta * penalty: since rules-3 penalty
    is F = Phi(s') - Phi(s) over a bounded per-session potential, so a session's penalties sum
    to Phi(s_T) (processors/penalties.py); hits are the rules behind it."""

    type: str = field(default="path_penalty", init=False)
    rule_ids: list[str]
    penalty: float
    compliance_bonus: float
    beta: float
    hits: list[RuleHit] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class Reward(TurnEvent):
    """A turn's reward by part, and the formula version that combined them."""

    type: str = field(default="reward", init=False)
    outcome: float
    prm: float
    penalty: float
    total: float
    formula_version: str


@dataclass(slots=True, kw_only=True)
class Sample(TurnEvent):
    """A trainable sample: what the trainer consumes."""

    type: str = field(default="sample", init=False)
    policy_id: str
    prompt_token_ids: Sequence[int]
    response_token_ids: Sequence[int]
    loss_mask: Sequence[int]
    behavior_logprobs: Sequence[float]
    reward: float
    hints: list[str] = field(default_factory=list)
    behavior_weight_version: int
    masked: bool = False
    group_id: str | None = None
    step_index: int | None = None
    # Added to v1 (optional): the OPD mask apart from the RL one, so a hinted turn with a
    # neutral score still trains through its hint; empty = the loss mask (older events).
    opd_mask: Sequence[int] = field(default_factory=list)
    # The path part (RLVP beta * Phi) contained in ``reward``; group normalisation scales it
    # on its own (0 in older events: the whole reward is normalised, as before).
    penalty: float = 0.0
    # The session's verified outcome, if any: a failed session's sample never carries a
    # positive reward or advantage (see processors/rewards.py: outcome_bound).
    outcome: float | None = None
    # The reward is a group-normalised advantage (z-scored in its group and step): the trainer
    # subtracts no batch baseline from it. False in events written before this field (their
    # rewards are re-centred by the batch mean, as they were).
    normalized: bool = False

    def opd_token_mask(self) -> Sequence[int]:
        """Per response token, 1 where the OPD term may train: ``opd_mask``, or ``loss_mask``
        for events written before the field (OPD then followed the RL mask)."""
        return self.opd_mask if self.opd_mask else self.loss_mask

    def rl_trainable(self) -> bool:
        """Whether the RL term has any token to train (and the sample is not bookkeeping)."""
        return not self.masked and any(self.loss_mask)

    def outcome_failed(self) -> bool:
        """Whether the session's outcome failed (< 0; a NaN one counts too, erring on the side
        of never encouraging it): its RL advantage is never positive."""
        return self.outcome is not None and not self.outcome >= 0


@dataclass(slots=True, kw_only=True)
class GradientStep(Event):
    """One optimizer step and the sample offsets it consumed."""

    type: str = field(default="gradient_step", init=False)
    policy_id: str
    step: int
    losses: dict[str, float]
    kl: float
    clip_fraction: float
    grad_norm: float | None
    consumed_offsets: dict[str, int]
    samples: int
    tokens: int
    weight_version: int


@dataclass(slots=True, kw_only=True)
class WeightsPublished(Event):
    """Manifest of a weight version; the weights themselves live at `uri`."""

    type: str = field(default="weights", init=False)
    policy_id: str
    version: int
    parent: int | None
    uri: str
    files: list[WeightFile]
    step: int
    status: WeightsStatus
    consumed_offsets: dict[str, int]
    metrics: dict[str, Any] = field(default_factory=dict)
    # An operator's command or an automatic decision (kind promote|pin|unpin|rollback|
    # rollout|withdraw, by, reason, figures); None on the trainer's own events. Riding on this
    # topic keeps the audit trail in the log the gateways already follow (pipeline/versions).
    action: dict[str, Any] | None = None
    # The trainer's, on the event that makes the version servable: the share of users it
    # serves first, as a canary (None or 0: everyone at once; pipeline/versions/table.py).
    canary_share: float | None = None


@dataclass(slots=True, kw_only=True)
class ServingStatus(Event):
    """Result of a weight reload on one serving replica."""

    type: str = field(default="serving_status", init=False)
    replica_id: str
    policy_id: str
    version: int
    reload_ms: float
    ok: bool
    error: str | None = None
    # stable: everyone outside the canary; canary: the users routed to the canary version
    arm: Literal["stable", "canary"] = "stable"


@dataclass(slots=True, kw_only=True)
class TrainerStatus(Event):
    """What one policy's trainer is doing now; the newest per policy is its state (the
    topic is compacted by policy). ``liverl status`` shows it."""

    type: str = field(default="trainer_status", init=False)
    policy_id: str
    state: TrainerState
    version: int  # the weights it holds and trains on from (0: the base)
    step: int
    samples: int  # trained by this process since it started
    last_step_ms: int | None = None
    loss: float | None = None
    judging_version: int | None = None
    judging_since_ms: int | None = None
    prompts_done: int | None = None
    prompts_total: int | None = None
    eta_s: float | None = None
    pinned_version: int | None = None
    detail: str | None = None


@dataclass(slots=True, kw_only=True)
class GateVote(Event):
    """One judge's vote on one prompt: the candidate version's fresh answer against the live
    one's. Every vote is its own event so a gate verdict can be recomputed and audited."""

    type: str = field(default="gate_vote", init=False)
    policy_id: str
    version: int  # the candidate
    live_version: int  # what it is compared with (newest promoted, 0 = base)
    prompt_id: str  # stable id of the prompt (hex digest), the same for every version
    source: GateVoteSource  # held_out (a recorded prompt never trained on) | probe
    judge: str  # capability | fluency | hint | reward | llm | ...
    vote: int  # +1 candidate better, -1 live better, 0 tie or abstain (schema: enum)
    candidate_score: float | None = None
    live_score: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class JudgeConsistency(Event):
    """A judge's verdict joined to the verifiable outcome of its turn, with the judge's
    running tally (RLAnything's reward-model consistency; processors/consistency.py). No
    session data: verdict and outcome are named by event id, as a gate vote names a prompt
    by digest, so forgetting a session leaves nothing here to delete."""

    type: str = field(default="judge_consistency", init=False)
    judge_id: str
    judge_version: str
    verdict: Vote
    outcome: int  # -1 | +1
    verdict_id: str
    outcome_id: str
    agree: int
    disagree: int
    abstain: int
    consistency: float
    flagged: bool = False
    reason: str | None = None
    # The outcomes of the verdict's turn disagree with each other: counted neither way (a match
    # of it published before is out of this tally); ``contradictions`` counts such verdicts.
    contradicted: bool = False
    contradictions: int = 0
    # The same over the judge's last ``window`` decided matches: what flagging reads, so a
    # judge right for long that turns bad is flagged within about ``window`` verdicts. None
    # (and 0s): published before the window existed.
    recent_agree: int = 0
    recent_disagree: int = 0
    recent_consistency: float | None = None
    window: int = 0
    # ``flagged`` marks the match that took the judge out of panels and the promotion gate,
    # ``recovered`` the one that brought it back; ``excluded`` is where it stands after this
    # match, so the newest event of a judge is enough to weigh it.
    recovered: bool = False
    excluded: bool = False


@dataclass(slots=True, kw_only=True)
class VerifiedTask(Event):
    """A session whose outcome was verified (a gate passed, a test run green, positive
    feedback), kept as a task: its prompt, the checker that verified it, where it came from in
    the log, and the votes of the k judges that validated it (processors/task_pool.py; ScaleCUA's
    VeriGen from real traffic). Rejected tasks are events too, so every decision is auditable.
    Keyed by ``task_id``, derived from the session and the outcome event: a rerun is the same
    record of a compacted topic."""

    type: str = field(default="verified_task", init=False)
    task_id: str
    status: TaskStatus
    k: int
    prompt: str
    answer: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    checker: dict[str, Any]
    provenance: dict[str, Any]
    votes: list[dict[str, Any]]
    # Added to v1 (optional): the session's outcomes from the verifying one on (newest last,
    # bounded), each with the policy version that produced its turn; a failure among them
    # withdraws an accepted task. Empty in older events.
    outcomes: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class DeadLetter(Event):
    """A record that failed processing, kept byte-exact for inspection or replay."""

    type: str = field(default="dlq", init=False)
    source_topic: str
    source_partition: int
    source_offset: int
    error: str
    original_b64: str
    original_key_b64: str | None = None
    original_headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def wrap(
        cls,
        value: bytes | None,
        *,
        topic: str,
        partition: int,
        offset: int,
        error: str,
        producer: Producer,
        key: bytes | None = None,
        headers: Iterable[tuple[str, bytes | None]] | Mapping[str, bytes | None] = (),
    ) -> DeadLetter:
        """Build the DLQ event for a failed record; the id is derived from its coordinates,
        so re-processing the same record yields the same DLQ event."""
        items = headers.items() if isinstance(headers, Mapping) else headers
        return cls(
            event_id=derive_event_id("dlq", [], producer.version, topic, partition, offset),
            producer=producer,
            source_topic=topic,
            source_partition=partition,
            source_offset=offset,
            error=error,
            original_b64=base64.b64encode(value or b"").decode("ascii"),
            original_key_b64=None if key is None else base64.b64encode(key).decode("ascii"),
            original_headers={k: (v or b"").decode("utf-8", "backslashreplace") for k, v in items},
        )

    def original(self) -> bytes:
        """The failed record's value bytes."""
        return base64.b64decode(self.original_b64)

    def original_key(self) -> bytes | None:
        """The failed record's key bytes, if it had a key."""
        return None if self.original_key_b64 is None else base64.b64decode(self.original_key_b64)


def _type_name(cls: type[Event]) -> str | None:
    """The ``type`` a concrete event class writes; None for an envelope (Event, TurnEvent)."""
    name = next((f.default for f in fields(cls) if f.name == "type"), None)
    return name if isinstance(name, str) and name else None


def _defined(cls: type) -> bool:
    """The class its module names (``slots=True`` leaves the pre-slots class behind, a
    subclass of the base until collected)."""
    return getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls


def event_types() -> dict[str, type[Event]]:
    """Every concrete event class by its ``type``, found from the classes themselves: a new
    event type is its dataclass (plus its topic and schema files), not an entry in a list."""
    found: dict[str, type[Event]] = {}
    todo: list[type[Event]] = [Event]
    while todo:
        cls = todo.pop()
        todo.extend(c for c in cls.__subclasses__() if _defined(c))
        name = _type_name(cls)
        if name is not None:
            if name in found and found[name] is not cls:
                raise TypeError(f"event type {name!r} is declared twice: {found[name]}, {cls}")
            found[name] = cls
    return dict(sorted(found.items()))


EVENT_TYPES: dict[str, type[Event]] = event_types()
