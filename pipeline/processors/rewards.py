"""Rewards and training samples, assembled per session once it closes.

Why per session: "each session keeps at least one sample" and the step-wise outcome reward
(RLAnything: r_step = outcome + mean(judge votes)) both need the whole session. A slow judge
therefore delays a session's samples, never a user's answer.

Per turn: O = session outcome (0 when none), prm = mean of the turn's judge scores, or with an
outcome the mean of all valid votes; penalty = beta * Phi (plus beta * Phi of the turn's
GUI actions' own penalties, ``action_penalties``); total = O + prm + penalty. A turn the
judge never scored takes the session's outcome alone (prm 0); without an outcome it has no
reward. The RL mask (``loss_mask``) and the OPD mask (``opd_mask``) are separate: a turn with no
reward, or a prm of 0 without a session outcome outside a group, has no RL signal (RL-masked,
except that the session's last *judged* turn is kept when every turn would be); a total of 0
*with* an outcome, or in a group, is a real value and stays (it is ranked when the group is
z-scored). The path part never decides it: a real signal that shaping brings to a total of
exactly 0 stays, or the session's last turn, judged 0, would be kept in its place, trained
because of shaping alone (a search counter-example: prm 0.2 and a path part of -0.2). A
failed session (outcome < 0) never carries a positive reward or advantage
(:func:`outcome_bound`, here and after z-scoring). A turn with an accepted hint trains OPD
whatever its score (OpenClaw-RL's OPD-only samples); ``masked`` means neither term trains.

A judge verdict that failed (``PrmScore.error`` set and no vote cast) is no verdict: the turn
counts as unjudged (:attr:`PrmEntry.no_verdict`), so a failure is never trained, or ranked in a
group, as if the judge had said 0. Path shaping only modifies a real signal (a verdict whose
mean is not 0, or a session outcome; :func:`has_real_signal`): a turn without one carries no
path part, so shaping alone never makes a reward, positive or negative, nor a trainable
sample. Its path part is carried to the session's next turn with a real signal, so a session's
path parts still telescope, to beta * Phi after its last turn with one, within beta *
[phi_min, phi_max]. Dropped instead, they let a session hide its violations on turns the judge
cannot score (failures that report no exit code are judged 0) and be paid the refunds and
progress that follow: pytest failing nine times without an exit code and passing twice paid
+0.075 of path part for a Phi of -0.75 (bench/reward_fuzz.py's search). A non-finite part (an
overflowing beta * Phi) is dropped.

Groups (RLAnything): sessions whose interactions carry a ``group_id`` are attempts at the same
task; their samples' rewards are z-scored within (group, step index) by :func:`zscore_by_group_step`
once the group is complete (the worker's group stage, keyed by group id, does the waiting).
The path part is kept out of that z-score and added back on its own bounded scale (RLVP: it must
stay a small share of the outcome, never flip it).

Explicit feedback (``kind: feedback`` about a turn: ``POST /v1/feedback``) is a vote, and a turn
counts one vote per caller: the caller is the API key the gateway recorded (``detail.key_id``),
else the producing source. A caller's later vote (by ``ts_ms``, then event id) replaces their
earlier one, and a turn keeps the votes of at most ``voters_per_turn`` callers, so no client can
outvote the conversation or the other callers by repeating itself. :meth:`Assembler.admit`
returns what it leaves out (:class:`LeftOut`: a replaced vote, one over the cap); the worker
dead-letters and counts each.

Token payloads (prompt/response ids, log-probs) are the bulk of a session; the worker keeps them
out of the per-session state (``on_interaction(..., keep_tokens=False)``, which keeps where the
interaction lies instead) and hands them to :meth:`Assembler.complete` (`token_store.py`).

State: a session's :class:`AssemblyState` is a typed dataclass (turn numbers are ``int`` keys)
that round-trips exactly through its JSON (`state_json.py`), so the worker can store it as
part of a table value. The ``Assembler.on_*`` methods and :meth:`Assembler.complete` update
the state they are given in place and return it (``None`` starts an empty one); callers always
use the returned object.
"""

from __future__ import annotations

import math
import struct
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from pipeline.events import (
    F64Array,
    Hint,
    Interaction,
    NextState,
    PathPenalty,
    PrmScore,
    Producer,
    Reward,
    Sample,
    U32Array,
    derive_event_id,
)

from . import verification

OUTCOME_KINDS = ("test_result", "feedback")
MAX_OUTCOME_CHECKS = 16  # distinct checks (gates, sources) whose results a session combines


def is_session_outcome(ns: NextState) -> bool:
    """A session-scoped outcome (``liverl record-outcome`` without ``--turn``): ``scope`` is
    ``session``; events written before that field existed said so in ``detail.scope``."""
    if ns.scope == "session":
        return True
    return ns.detail.get("scope") == "session" and ns.kind in OUTCOME_KINDS


def group_of(inter: Interaction) -> str | None:
    """The interaction's group: the ``group_id`` field, else the older ``sampling.group_id``."""
    if inter.group_id is not None:
        return inter.group_id
    legacy = inter.sampling.get("group_id")
    return legacy if isinstance(legacy, str) and legacy else None


@dataclass(slots=True)
class TokenPayload:
    """What a sample needs of an interaction's tokens: the bulk of a session, so the worker
    stores it once per turn outside the session state (see :func:`token_payload`)."""

    # Lists or packed arrays; a state kept with its tokens stores them as JSON lists.
    prompt_token_ids: Sequence[int] = field(default_factory=list)
    response_token_ids: Sequence[int] = field(default_factory=list)
    response_logprobs: Sequence[float] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        """The table value: a tag, the three lengths, then the little-endian arrays (a copy
        each way, where JSON numbers cost ~100 µs a turn to write and read back)."""
        parts = (
            _packed(U32Array, self.prompt_token_ids),
            _packed(U32Array, self.response_token_ids),
            _packed(F64Array, self.response_logprobs),
        )
        head = _PAYLOAD_HEAD.pack(_PAYLOAD_TAG, *(len(p) for p in parts))
        return b"".join((head, *(p.le_bytes() for p in parts)))

    @classmethod
    def from_bytes(cls, raw: bytes) -> TokenPayload:
        """Read :meth:`to_bytes`, or the JSON object that workers wrote before it (a changelog
        keeps values across upgrades)."""
        if raw[:1] == b"{":
            return cls(**orjson.loads(raw))
        tag, n_prompt, n_response, n_logprobs = _PAYLOAD_HEAD.unpack_from(raw)
        if tag != _PAYLOAD_TAG:
            raise ValueError(f"not a token payload (tag {tag!r})")
        at, ids, lps = _PAYLOAD_HEAD.size, U32Array.ITEMSIZE, F64Array.ITEMSIZE
        ends = (at + ids * n_prompt, at + ids * (n_prompt + n_response))
        end = ends[1] + lps * n_logprobs
        if end != len(raw):
            raise ValueError(f"token payload of {len(raw)} bytes, expected {end}")
        return cls(
            prompt_token_ids=U32Array.from_le_bytes(raw[at : ends[0]]),
            response_token_ids=U32Array.from_le_bytes(raw[ends[0] : ends[1]]),
            response_logprobs=F64Array.from_le_bytes(raw[ends[1] :]),
        )


_PAYLOAD_TAG = b"LTP1"
_PAYLOAD_HEAD = struct.Struct("<4sIII")


def _packed(kind: type[Any], values: Sequence[Any]) -> Any:
    return values if type(values) is kind else kind(values)


def token_payload(inter: Interaction) -> TokenPayload:
    """What a sample needs of an interaction's tokens (stored once per turn by the worker)."""
    return TokenPayload(
        prompt_token_ids=inter.prompt_token_ids,
        response_token_ids=inter.response_token_ids,
        response_logprobs=inter.response_logprobs,
    )


def reward_parts(
    scores: Sequence[int],
    votes: Sequence[int | None],
    outcome: float | None,
    beta: float,
    phi: float,
) -> tuple[float, float, float, float]:
    """(outcome, prm, penalty, total) of one turn: R = O + prm + beta * Phi."""
    if outcome is None:
        prm = sum(scores) / len(scores) if scores else 0.0
        o = 0.0
    else:
        valid = [v for v in votes if v is not None]
        prm = sum(valid) / len(valid) if valid else 0.0
        o = outcome
    pen = beta * phi
    return o, prm, pen, o + prm + pen


def has_real_signal(prm: float, outcome: float | None) -> bool:
    """Whether a turn's reward rests on something verified: a session outcome, or verdicts
    whose mean is not 0. Path shaping may only modify such a reward (see the module
    docstring), never make one."""
    return outcome is not None or prm != 0


def mask_turns(has_signal: dict[int, bool], keepable: set[int] | None = None) -> dict[int, bool]:
    """turn -> masked. Turns without signal are masked; if all are, the last ``keepable`` one
    (default: any) is kept. Only a judged turn is keepable: an unjudged one has no reward, and
    training it at 0 would rank it above a judged failure in its group."""
    masked = {t: not ok for t, ok in has_signal.items()}
    if masked and all(masked.values()):
        candidates = [t for t in masked if keepable is None or t in keepable]
        if candidates:
            masked[max(candidates)] = False
    return masked


def outcome_bound(value: float, outcome: float | None) -> float:
    """A failed session (outcome < 0) never gets a positive reward or advantage: the judge's
    votes, a bonus or the group's z-score may rank its turns, never above zero. A successful
    session is not bounded (a worse turn of a success may still be discouraged)."""
    if outcome is not None and outcome < 0:
        return min(value, 0.0)
    return value


PATH_SHARE = 0.25
"""Largest relative change the path part can make to a normalised advantage."""
PATH_SCALE = 0.5
"""beta * Phi at which the path part reaches its bound: the rule validator keeps |beta * Phi|
below max_path_share * outcome_scale (0.5 * 1.0 in the default rules)."""


def path_adjusted(
    z: float, path: float, share: float = PATH_SHARE, scale: float = PATH_SCALE
) -> float:
    """``A = z + share * |z| * clip(path / scale, -1, 1)``: the path part moves a normalised
    advantage by at most ``share`` of its own size, in the path part's direction, so it can
    neither flip its sign nor dominate it (RLVP's design rule 2 after group normalisation)."""
    return z + share * abs(z) * max(-1.0, min(1.0, path / scale))


def zscore_by_group_step(
    samples: Sequence[Sample],
    eps: float = 1e-6,
    path_share: float = PATH_SHARE,
    path_scale: float = PATH_SCALE,
) -> list[Sample]:
    """Z-score the outcome+PRM part (``reward - penalty``) within (group_id, step_index) with the
    population std, then add the path part by :func:`path_adjusted`. The z-scored samples are
    marked ``normalized``: their reward is an advantage already centred in its group, so the
    trainer subtracts no batch baseline from it.

    Only RL-trainable samples take part (RL-masked ones carry no signal and would drag the mean
    to 0). Samples without a group and buckets of one are returned unchanged (a single sample
    has no spread). A constant bucket (no spread in outcome+PRM) is dropped from training the RL
    term instead of being kept at advantage 0: its members get a zero ``loss_mask`` (and are
    ``masked`` unless their OPD mask still trains), so they neither dilute the token count of
    the informative samples nor let a path-part difference alone become a ±1 advantage; so is
    a bucket whose spread overflows (no sound advantage to give it)."""
    groups: dict[tuple[str, int | None], list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        if s.group_id is not None and s.rl_trainable():
            groups[(s.group_id, s.step_index)].append(i)
    out = list(samples)
    for idx in groups.values():
        base = [samples[i].reward - samples[i].penalty for i in idx]
        if len(idx) < 2:
            # No spread to rank against: a zero score without an outcome says nothing (it
            # takes part only to be ranked in a group), so it leaves the RL term, whatever
            # path part it carries (shaping alone is no signal).
            s = samples[idx[0]]
            if base[0] == 0 and s.outcome is None:
                out[idx[0]] = _without_rl(s)
            continue
        mean = sum(base) / len(base)
        # (products, not ** 2: a huge outcome score overflows to inf instead of raising)
        std = math.sqrt(sum((r - mean) * (r - mean) for r in base) / len(base))
        if not math.isfinite(std) or std <= 1e-9 * max(1.0, abs(mean)):
            for i in idx:
                out[i] = _without_rl(samples[i])
            continue
        for i, b in zip(idx, base, strict=True):
            z = (b - mean) / (std + eps)
            adv = path_adjusted(z, samples[i].penalty, path_share, path_scale)
            adv = outcome_bound(adv, samples[i].outcome)
            if not math.isfinite(adv):  # an overflowing spread: nothing sound to train on
                out[i] = _without_rl(samples[i])
                continue
            out[i] = replace(samples[i], reward=adv, penalty=adv - z, normalized=True)
    return out


def _carried(path: float, ids: list[str]) -> tuple[float, list[str]]:
    """What a turn passes on to the next one of its session: its path part (its own and
    what it took on) while no reward carried it, with the penalty ids behind it; nothing
    once a reward did, for a part of 0, or for one that overflowed (dropped, as ever)."""
    return (path, ids) if path != 0 and math.isfinite(path) else (0.0, [])


def _without_rl(s: Sample) -> Sample:
    """The sample out of the RL term; it still trains OPD where it has hints."""
    opd = list(s.opd_token_mask()) if s.hints else [0] * len(s.loss_mask)
    return replace(s, loss_mask=[0] * len(s.loss_mask), opd_mask=opd, masked=not any(opd))


# ---- session state ---------------------------------------------------------------------------


@dataclass(slots=True)
class RecordAt:
    """Where a consumed record lies: the worker keeps an interaction's coordinates in the
    session state instead of its tokens, and reads it back when it no longer holds them."""

    topic: str
    partition: int
    offset: int


@dataclass(slots=True)
class KeptInteraction:
    """What assembly keeps of a turn's interaction; ``tokens`` only with ``keep_tokens=True``,
    else ``at``: where the interaction lies (the worker holds the tokens apart, see
    `token_store.py`)."""

    event_id: str
    policy_id: str
    weight_version: int
    group_id: str | None
    ts_ms: int
    tokens: TokenPayload | None = None
    at: RecordAt | None = None


@dataclass(slots=True)
class PrmEntry:
    """A judge verdict on one next state of a turn."""

    event_id: str
    score: int
    votes: list[int | None] = field(default_factory=list)
    # The judge failed (error set, no vote cast): the entry answers the turn (readiness) but
    # is no verdict, so the turn counts as unjudged. False in states stored before the field.
    no_verdict: bool = False


def is_no_verdict(prm: PrmScore) -> bool:
    """A verdict that errored: ``error`` set and no vote cast (its score 0 is no judgement).
    A panel or multi-vote judge with some votes despite an error has a verdict."""
    return prm.error is not None and all(v is None for v in prm.votes)


@dataclass(slots=True)
class PenaltyEntry:
    """A turn's path penalty: ``phi`` is Phi and ``beta`` its weight in R = O + beta * Phi."""

    event_id: str
    phi: float
    beta: float


@dataclass(slots=True)
class Outcome:
    """The session's outcome; the latest by (ts_ms, event id) wins."""

    event_id: str
    ts_ms: int
    value: float


@dataclass(slots=True)
class VoteEntry:
    """The vote of a caller that counts for a turn: its next state, and when it was cast."""

    event_id: str
    ts_ms: int


@dataclass(frozen=True, slots=True)
class LeftOut:
    """An input that counts in no reward, and why (the worker dead-letters and counts it).
    ``event``: the record itself; None for a vote replaced after it had counted, whose record
    is gone (``detail`` then describes it)."""

    reason: str  # a metric label: superseded, voters_cap, late, not_owner, posted_cap
    event_id: str
    turn: int
    why: str
    event: NextState | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def voter_of(ns: NextState) -> str | None:
    """Who cast ``ns`` if it is a vote (explicit feedback on one turn): the gateway's key id,
    else its source; None for any other next state."""
    if ns.kind != "feedback" or ns.scope != "turn":
        return None
    key_id = ns.detail.get("key_id")
    return f"key:{key_id}" if isinstance(key_id, str) and key_id else f"source:{ns.source}"


def foreign_poster(ns: NextState, owner: str | None) -> str | None:
    """The user who posted ``ns`` through a gateway with API keys when that user does not own
    the session (its first interaction's ``user_id``) and is no operator; None otherwise.
    The gateway refuses such posts for the sessions it has seen; this catches a replica that
    never saw the session. Unkeyed posts (loopback, trusted) and records written to Kafka
    directly (``record-outcome``, gates) carry no ``user_id`` and are not checked."""
    user = ns.detail.get("user_id")
    if owner is None or not isinstance(user, str) or ns.detail.get("operator") is True:
        return None
    return user if user != owner else None


@dataclass(slots=True)
class AssemblyTurn:
    """Everything recorded for one turn number. ``next_states``: next-state id -> kind;
    ``prm``: verdicts keyed by the next-state id they judge; ``hints``: hint id -> (rank, hint);
    ``skip``: the turn opted out of training (never a sample, but it does not hold the session
    back); ``votes``: the feedback that counts, one per caller (their other votes are in
    neither ``next_states`` nor ``prm``)."""

    interaction: KeptInteraction | None = None
    next_states: dict[str, str] = field(default_factory=dict)
    prm: dict[str, PrmEntry] = field(default_factory=dict)
    penalty: PenaltyEntry | None = None
    hints: dict[str, tuple[int, str]] = field(default_factory=dict)
    skip: bool = False
    votes: dict[str, VoteEntry] = field(default_factory=dict)  # caller -> the vote that counts
    # Penalties of the actions a harness reported for the turn (gui next states), by event
    # id, beside the turn's own ``penalty``; their Phi adds to it.
    action_penalties: dict[str, PenaltyEntry] = field(default_factory=dict)
    # Next states posted through a gateway that count, by source (Assembler.posted_per_turn).
    posted: dict[str, int] = field(default_factory=dict)


def posted_source(ns: NextState) -> str | None:
    """The source of a next state a gateway recorded for a caller (it carries
    ``detail.key_id``) that is not a vote; None for anything else (votes have their own cap,
    derived and directly written next states none)."""
    if "key_id" not in ns.detail or voter_of(ns) is not None:
        return None
    return ns.source or ns.kind


@dataclass(slots=True)
class AssemblyState:
    """One session's assembly state. ``closed_at_ms``/``last_turn`` are set by its
    ``session_end``; ``done`` marks a tombstone (turns emptied, stragglers ignored)."""

    session_id: str = ""
    turns: dict[int, AssemblyTurn] = field(default_factory=dict)
    outcome: Outcome | None = None
    # Each check's latest result (verification.outcome_key); ``outcome`` is all_must_pass of them.
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    closed_at_ms: int | None = None
    last_turn: int | None = None
    done: bool = False
    group_id: str | None = None
    # When the latest verdict was applied (processing time): a judge that is not inline
    # sends a verdict's hints beside it on another topic, so they may be read just after it.
    verdict_at_ms: int = 0
    # Who owns the session: the user_id of its first interaction read (foreign_poster).
    owner: str | None = None


@dataclass
class Assembly:
    state: AssemblyState
    rewards: list[Reward] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    # Hints held for turns whose interaction never came: no sample can carry them.
    unmatched_hints: list[UnmatchedHint] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class UnmatchedHint:
    turn: int
    hint_id: str
    rank: int
    hint: str


def unmatched_hints(state: AssemblyState) -> list[UnmatchedHint]:
    """Hints of turns without an interaction, in turn and id order. A hint may come before
    its turn (topics are read in no fixed order), so it waits in the state; when the session
    is assembled or expires without that turn, the worker dead-letters these."""
    return [
        UnmatchedHint(t, hid, rank, text)
        for t, info in sorted(state.turns.items())
        if info.interaction is None
        for hid, (rank, text) in sorted(info.hints.items())
    ]


@dataclass(eq=False)
class Assembler:
    """Collects a session's turn events (typed state, updated in place) and emits rewards and
    samples."""

    reward_version: str = "reward-3"
    sample_version: str = "samples-3"
    grace_ms: int = 30_000
    outcome_wait_ms: int = 0
    hint_wait_ms: int = 0
    voters_per_turn: int = 32
    posted_per_turn: int = 8
    reward_producer: Producer = field(init=False)
    sample_producer: Producer = field(init=False)

    def __post_init__(self) -> None:
        self.reward_producer = Producer(component="rewards", version=self.reward_version)
        self.sample_producer = Producer(component="samples", version=self.sample_version)

    # ---- inputs (each returns the state; idempotent on redelivery) ---------------------------

    @staticmethod
    def _turn(state: AssemblyState, session_id: str, turn: int) -> AssemblyTurn:
        if not state.session_id:
            state.session_id = session_id
        info = state.turns.get(turn)
        if info is None:
            info = state.turns[turn] = AssemblyTurn()
        return info

    def on_interaction(
        self,
        state: AssemblyState | None,
        inter: Interaction,
        keep_tokens: bool = True,
        at: RecordAt | None = None,
    ) -> AssemblyState:
        """Record a main-line turn; with ``keep_tokens=False`` its token payload is left out of
        the state (the caller holds :func:`token_payload` and passes it to :meth:`complete`),
        and ``at`` (where the interaction was read) is kept instead."""
        state = state if state is not None else AssemblyState()
        if state.owner is None and inter.user_id:
            state.owner = inter.user_id
        if inter.turn_type == "side" or state.done:
            return state
        turn = self._turn(state, inter.session_id, inter.turn)
        kept = turn.interaction
        if not inter.train:
            if kept is None:  # opted out (aborted): never a sample, but accounted for
                turn.skip = True
            return state
        if kept is not None and (kept.ts_ms, kept.event_id) > (inter.ts_ms, inter.event_id):
            return state  # a number used twice (a retry on another replica): the later turn
        turn.skip = False
        turn.interaction = KeptInteraction(
            event_id=inter.event_id,
            policy_id=inter.policy_id,
            weight_version=inter.weight_version,
            group_id=group_of(inter),
            ts_ms=inter.ts_ms,
            tokens=token_payload(inter) if keep_tokens else None,
            at=None if keep_tokens else at,
        )
        if turn.interaction.group_id is not None:
            state.group_id = turn.interaction.group_id
        return state

    def on_next_state(
        self, state: AssemblyState | None, ns: NextState, now_ms: int
    ) -> AssemblyState:
        """:meth:`admit`, for callers that feed no votes (what it left out is not returned)."""
        return self.admit(state, ns, now_ms)[0]

    def admit(
        self, state: AssemblyState | None, ns: NextState, now_ms: int
    ) -> tuple[AssemblyState, list[LeftOut]]:
        """Record a next state; a vote only as its caller's latest within the voter cap (see
        the module docstring). Returns the state and the votes that no longer count: ``ns``
        itself, or the caller's earlier vote that it replaces."""
        state = state if state is not None else AssemblyState()
        if not state.session_id:
            state.session_id = ns.session_id
        refused = self.refusal(state, ns)
        if refused is not None:
            return state, [refused]
        source = posted_source(ns)
        if source is not None and not state.done:
            counts = self._turn(state, ns.session_id, ns.turn).posted
            counts[source] = counts.get(source, 0) + 1
        voter = voter_of(ns)
        if voter is not None and not state.done:
            info = self._turn(state, ns.session_id, ns.turn)
            left = self._vote(info, voter, ns)
            if left is not None and left.event is ns:
                return state, [left]
            self._record(state, ns, now_ms)
            return state, [] if left is None else [left]
        self._record(state, ns, now_ms)
        return state, []

    def refusal(self, state: AssemblyState, ns: NextState) -> LeftOut | None:
        """Why a posted next state does not count at all, before anything of it is applied
        (its GUI penalty included): a keyed post from a user who does not own the session
        (:func:`foreign_poster`), or one over the turn's cap for its source. None: it may."""
        if state.done:
            return None
        where = (
            f"next state {ns.event_id} ({ns.kind}) for turn {ns.turn} of session {ns.session_id}"
        )
        foreign = foreign_poster(ns, state.owner)
        if foreign is not None:
            return LeftOut(
                "not_owner", ns.event_id, ns.turn,
                f"{where} was posted by user {foreign!r}, who does not own the session "
                f"({state.owner!r}) and is no operator", ns,
            )  # fmt: skip
        source = posted_source(ns)
        turn = state.turns.get(ns.turn)
        if source is not None and turn is not None \
                and turn.posted.get(source, 0) >= self.posted_per_turn:  # fmt: skip
            return LeftOut(
                "posted_cap", ns.event_id, ns.turn,
                f"{where}: the turn already counts {self.posted_per_turn} next states posted "
                f"from source {source!r} (processors.posted_per_turn)", ns,
            )  # fmt: skip
        return None

    def _vote(self, info: AssemblyTurn, voter: str, ns: NextState) -> LeftOut | None:
        """Make ``ns`` the vote of ``voter`` for its turn unless it is older than theirs or
        the turn is full; what is left out, if anything."""
        where = f"turn {ns.turn} of session {ns.session_id}"
        prev = info.votes.get(voter)
        if prev is None and len(info.votes) >= self.voters_per_turn:
            return LeftOut(
                "voters_cap", ns.event_id, ns.turn,
                f"feedback {ns.event_id} on {where}: the turn already counts the votes of "
                f"{len(info.votes)} callers (processors.feedback_voters_per_turn)", ns,
            )  # fmt: skip
        if prev is not None and (prev.ts_ms, prev.event_id) > (ns.ts_ms, ns.event_id):
            return LeftOut(
                "superseded", ns.event_id, ns.turn,
                f"feedback {ns.event_id} on {where}: superseded by a later vote of the same "
                f"caller ({prev.event_id}); a caller's latest vote per turn counts", ns,
            )  # fmt: skip
        info.votes[voter] = VoteEntry(ns.event_id, ns.ts_ms)
        if prev is None:
            return None
        info.next_states.pop(prev.event_id, None)
        info.prm.pop(prev.event_id, None)
        return LeftOut(
            "superseded", prev.event_id, ns.turn,
            f"feedback {prev.event_id} on {where}: superseded by a later vote of the same "
            f"caller ({ns.event_id}); a caller's latest vote per turn counts",
            detail={"session_id": ns.session_id, "turn": ns.turn, "event_id": prev.event_id,
                    "ts_ms": prev.ts_ms, "voter": voter, "superseded_by": ns.event_id},
        )  # fmt: skip

    def _record(self, state: AssemblyState, ns: NextState, now_ms: int) -> None:
        if is_session_outcome(ns):
            value = verification.outcome_value(ns)
            if value is None:  # timed out, not found, read-only: no outcome
                return
            key = verification.outcome_key(ns)
            if key not in state.outcomes and len(state.outcomes) >= MAX_OUTCOME_CHECKS:
                return  # a client names its check (its source): their number is bounded
            verification.keep_latest(
                state.outcomes, key, Outcome(event_id=ns.event_id, ts_ms=ns.ts_ms, value=value)
            )
            state.outcome = verification.all_must_pass(state.outcomes.values())
            return
        if state.done:
            return
        self._turn(state, ns.session_id, ns.turn).next_states[ns.event_id] = ns.kind
        if ns.kind == "session_end" and state.closed_at_ms is None:
            state.closed_at_ms = now_ms
            state.last_turn = ns.turn

    def on_prm(self, state: AssemblyState | None, prm: PrmScore, now_ms: int = 0) -> AssemblyState:
        state = state if state is not None else AssemblyState()
        if state.done:
            return state
        state.verdict_at_ms = max(state.verdict_at_ms, now_ms)
        # parents are [interaction id, next state id]: key the verdict by its next state.
        info = self._turn(state, prm.session_id, prm.turn)
        info.prm[prm.parents[-1]] = PrmEntry(
            event_id=prm.event_id,
            score=prm.score,
            votes=list(prm.votes),
            no_verdict=is_no_verdict(prm),
        )
        # A judge agent's verdict may come before its next state, so one without its next
        # state is kept; but it is more often the verdict of a replaced vote. The oldest go
        # first beyond voters_per_turn, so repeated votes cannot grow the state.
        orphans = [n for n in info.prm if n not in info.next_states]
        for n in orphans[: max(0, len(orphans) - self.voters_per_turn)]:
            del info.prm[n]
        return state

    def on_penalty(self, state: AssemblyState | None, pen: PathPenalty) -> AssemblyState:
        state = state if state is not None else AssemblyState()
        self._turn(state, pen.session_id, pen.turn).penalty = PenaltyEntry(
            event_id=pen.event_id, phi=pen.penalty, beta=pen.beta
        )
        return state

    def on_action_penalty(self, state: AssemblyState | None, pen: PathPenalty) -> AssemblyState:
        """An action's penalty (a gui next state's), added to its turn's path part."""
        state = state if state is not None else AssemblyState()
        self._turn(state, pen.session_id, pen.turn).action_penalties[pen.event_id] = PenaltyEntry(
            event_id=pen.event_id, phi=pen.penalty, beta=pen.beta
        )
        return state

    def on_hint(self, state: AssemblyState | None, hint: Hint) -> AssemblyState:
        state = state if state is not None else AssemblyState()
        self._turn(state, hint.session_id, hint.turn).hints[hint.event_id] = (
            hint.rank,
            hint.hint,
        )
        return state

    # ---- completion --------------------------------------------------------------------------

    def ready(self, state: AssemblyState, now_ms: int) -> bool:
        """Closed, every turn judged and penalised (or the grace period is over), the outcome
        is in (or no outcome is awaited / the wait is over) and the hint wait, counted from the
        close or the latest verdict, is over."""
        closed = state.closed_at_ms
        if state.done or closed is None or state.last_turn is None:
            return False  # last_turn is set with closed_at_ms
        if (
            self.outcome_wait_ms
            and state.outcome is None
            and now_ms - closed < self.outcome_wait_ms
        ):
            return False
        if now_ms - max(closed, state.verdict_at_ms) < self.hint_wait_ms:
            return False  # hints may still come: from outside, or the judge's own
        if now_ms - closed >= self.grace_ms:
            return True
        # Topics are read interleaved, so a replay may deliver a turn's verdicts before its
        # interaction: every main-line turn up to the last must be complete. Turn numbers are
        # conversation positions, so some may never exist (a turn that opted out of training,
        # assistant messages in the first prompt); a trainable one cannot be missing
        # altogether: pairing wrote its next state before the session_end, on this partition.
        for t in range(state.last_turn + 1):
            info = state.turns.get(t)
            if info is None:
                continue
            if info.skip:
                continue
            if info.interaction is None or info.penalty is None or not info.next_states:
                return False
            if any(ns not in info.prm for ns in info.next_states):
                return False
        return True

    def complete(
        self,
        state: AssemblyState,
        now_ms: int,
        tokens: Mapping[int, TokenPayload] | None = None,
    ) -> Assembly:
        """The session's rewards and samples (call when :meth:`ready`). ``tokens``: turn ->
        :func:`token_payload`, for turns recorded with ``keep_tokens=False``. Samples are not
        z-scored here: a session is one member of its group (see the worker's group stage).

        Turns the state into a tombstone in place (``done``, turns emptied), but only once
        nothing can fail: a missing token payload raises ``KeyError`` with the state untouched,
        so the caller can retry later."""
        out = Assembly(state)
        sid = state.session_id
        outcome = state.outcome
        o_val = None if outcome is None else float(outcome.value)
        rewards: dict[int, Reward] = {}
        signal: dict[int, bool] = {}
        judged_turns: set[int] = set()
        turns = {t: v for t, v in state.turns.items() if v.interaction is not None}
        # In a group a zero score is a value to rank against the other attempts (RLAnything's
        # step-wise z-score over [1, 0, 0, -1] is [1.41, 0, 0, -1.41], not ±1 of two samples).
        grouped = state.group_id is not None or any(
            v.interaction is not None and v.interaction.group_id is not None for v in turns.values()
        )
        # The path part of turns without a real signal, carried to the next turn with one
        # (and the ids of the penalties it comes from): see the module docstring.
        carry, carried = 0.0, list[str]()
        for t in sorted(turns):
            if state.last_turn is not None and t > state.last_turn:
                continue
            info = turns[t]
            # A failed verdict is none: the turn is as unjudged as if the judge never answered.
            judged = [
                info.prm[n]
                for n in sorted(info.next_states)
                if n in info.prm and not info.prm[n].no_verdict
            ]
            pen = info.penalty
            actions = [info.action_penalties[k] for k in sorted(info.action_penalties)]
            beta, phi = (pen.beta, pen.phi) if pen else (0.0, 0.0)
            if actions:  # beta * Phi summed over the turn's penalties, as one part
                phi, beta = beta * phi + sum(a.beta * a.phi for a in actions), 1.0
            before = carried  # penalties of earlier turns this one's path part takes on
            if before:
                phi, beta = beta * phi + carry, 1.0
            path_ids = before + [x for x in (pen and pen.event_id,) if x] + [
                a.event_id for a in actions]  # fmt: skip
            if not judged and o_val is None:
                signal[t] = False  # no verdict, no outcome: nothing is known about the turn
                carry, carried = _carried(beta * phi, path_ids)
                continue
            if judged:
                judged_turns.add(t)
            votes = [v for j in judged for v in j.votes]
            # An unjudged turn of a session with an outcome takes the outcome alone (prm 0).
            o, prm, penalty, total = reward_parts(
                [j.score for j in judged], votes, o_val, beta, phi
            )
            real = has_real_signal(prm, o_val)
            shaped = real and math.isfinite(total)
            carry, carried = _carried(0.0 if shaped else penalty, path_ids)
            if not shaped:
                # Shaping modifies a real signal, never makes one (nor does an overflow).
                penalty, total = 0.0, o + prm
            parents = (
                [j.event_id for j in judged]
                + [x for x in (pen and pen.event_id, outcome and outcome.event_id) if x]
                + [a.event_id for a in actions]
                + (before if shaped else [])
            )
            rewards[t] = Reward(
                event_id=derive_event_id("reward", parents, self.reward_version),
                ts_ms=now_ms,
                producer=self.reward_producer,
                parents=parents,
                session_id=sid,
                turn=t,
                outcome=o,
                prm=prm,
                penalty=penalty,
                total=total,
                formula_version=self.reward_version,
            )
            signal[t] = real or grouped  # whatever the path part
        masked = mask_turns(signal, judged_turns)
        out.rewards = [rewards[t] for t in sorted(rewards)]
        for t in sorted(masked):
            inter = turns[t].interaction
            assert inter is not None  # turns holds only turns with an interaction
            tok = inter.tokens if inter.tokens is not None else (tokens or {}).get(t)
            if tok is None:
                raise KeyError(f"no token payload for turn {t} of session {sid}")
            reward = rewards.get(t)
            parents = [inter.event_id] + ([reward.event_id] if reward else [])
            n = len(tok.response_token_ids)
            hints = [h for _, h in sorted(turns[t].hints.values())]
            # OPD trains wherever there is a hint, whatever the score (OpenClaw-RL's OPD-only
            # samples); "masked" is left for samples neither term trains.
            no_grad = masked[t] and not hints
            total = reward.total if reward else 0.0
            bounded = outcome_bound(total, o_val)
            # The bound is kept out of the outcome+PRM part (reward - penalty) that groups rank.
            path = (reward.penalty if reward else 0.0) - (total - bounded)
            out.samples.append(
                Sample(
                    event_id=derive_event_id("sample", parents, self.sample_version, no_grad),
                    ts_ms=now_ms,
                    producer=self.sample_producer,
                    parents=parents,
                    session_id=sid,
                    turn=t,
                    policy_id=inter.policy_id,
                    prompt_token_ids=tok.prompt_token_ids,
                    response_token_ids=tok.response_token_ids,
                    loss_mask=[0 if masked[t] else 1] * n,
                    behavior_logprobs=tok.response_logprobs,
                    reward=bounded,
                    hints=hints,
                    behavior_weight_version=inter.weight_version,
                    masked=no_grad,
                    group_id=inter.group_id,
                    step_index=t,
                    opd_mask=[1 if hints else 0] * n,
                    penalty=path,
                    outcome=o_val,
                )
            )
        out.unmatched_hints = unmatched_hints(state)
        state.done = True
        state.turns = {}  # keep the tombstone small: done sessions ignore stragglers
        return out
