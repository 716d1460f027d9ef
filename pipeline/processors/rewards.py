"""Rewards and training samples, assembled per session once it closes.

Why per session: "each session keeps at least one sample" and the step-wise outcome reward
(RLAnything: r_step = outcome + mean(judge votes)) both need the whole session. A slow judge
therefore delays a session's samples, never a user's answer.

Per turn: O = session outcome (0 when none), prm = mean of the turn's judge scores, or with an
outcome the mean of all valid votes; penalty = beta * Phi; total = O + prm + penalty. The RL mask
(``loss_mask``) and the OPD mask (``opd_mask``) are separate: a turn with no next state, or a
total of exactly 0 without a session outcome, has no RL signal (RL-masked, except that the
session's last turn is kept when every turn would be); a total of 0 *with* an outcome is a real
value and stays (it matters once the group is z-scored). A turn with an accepted hint trains OPD
whatever its score (OpenClaw-RL's OPD-only samples); ``masked`` means neither term trains.

Groups (RLAnything): sessions whose interactions carry a ``group_id`` are attempts at the same
task; their samples' rewards are z-scored within (group, step index) by :func:`zscore_by_group_step`
once the group is complete (the worker's group stage, keyed by group id, does the waiting).
The path part is kept out of that z-score and added back on its own bounded scale (RLVP: it must
stay a small share of the outcome, never flip it).

Token payloads (prompt/response ids, log-probs) are the bulk of a session; the worker keeps them
out of the per-session state (``on_interaction(..., keep_tokens=False)``) and hands them to
:meth:`Assembler.complete` from a table written once per turn.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.events import (
    Hint,
    Interaction,
    NextState,
    PathPenalty,
    PrmScore,
    Producer,
    Reward,
    Sample,
    derive_event_id,
)

SessionState = dict[str, Any]
OUTCOME_KINDS = ("test_result", "feedback")


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


def token_payload(inter: Interaction) -> dict[str, Any]:
    """What a sample needs of an interaction's tokens (stored once per turn by the worker)."""
    return {
        "prompt_token_ids": inter.prompt_token_ids,
        "response_token_ids": inter.response_token_ids,
        "response_logprobs": inter.response_logprobs,
    }


def outcome_value(ns: NextState) -> float:
    """Explicit score, else pass/fail from the exit code, else 0."""
    if ns.score is not None:
        return float(ns.score)
    if ns.exit_code is not None:
        return 1.0 if ns.exit_code == 0 else -1.0
    return 0.0


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


def mask_turns(has_signal: dict[int, bool]) -> dict[int, bool]:
    """turn -> masked. Turns without signal are masked; if all are, the last one is kept."""
    masked = {t: not ok for t, ok in has_signal.items()}
    if masked and all(masked.values()):
        masked[max(masked)] = False
    return masked


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
    population std, then add the path part by :func:`path_adjusted`.

    Only RL-trainable samples take part (RL-masked ones carry no signal and would drag the mean
    to 0). Samples without a group and buckets of one are returned unchanged (a single sample
    has no spread). A constant bucket (no spread in outcome+PRM) is dropped from training the RL
    term instead of being kept at advantage 0: its members get a zero ``loss_mask`` (and are
    ``masked`` unless their OPD mask still trains), so they neither dilute the token count of
    the informative samples nor let a path-part difference alone become a ±1 advantage."""
    groups: dict[tuple[str, int | None], list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        if s.group_id is not None and s.rl_trainable():
            groups[(s.group_id, s.step_index)].append(i)
    out = list(samples)
    for idx in groups.values():
        if len(idx) < 2:
            continue
        base = [samples[i].reward - samples[i].penalty for i in idx]
        mean = sum(base) / len(base)
        std = math.sqrt(sum((r - mean) ** 2 for r in base) / len(base))
        if std <= 1e-9 * max(1.0, abs(mean)):
            for i in idx:
                s = samples[i]
                opd = list(s.opd_token_mask()) if s.hints else [0] * len(s.loss_mask)
                out[i] = replace(
                    s, loss_mask=[0] * len(s.loss_mask), opd_mask=opd, masked=not any(opd)
                )
            continue
        for i, b in zip(idx, base, strict=True):
            z = (b - mean) / (std + eps)
            adv = path_adjusted(z, samples[i].penalty, path_share, path_scale)
            out[i] = replace(samples[i], reward=adv, penalty=adv - z)
    return out


@dataclass
class Assembly:
    state: SessionState
    rewards: list[Reward] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)


@dataclass(eq=False)
class Assembler:
    """Collects a session's turn events (JSON-able state) and emits rewards and samples."""

    reward_version: str = "reward-1"
    sample_version: str = "samples-1"
    grace_ms: int = 30_000
    outcome_wait_ms: int = 0
    reward_producer: Producer = field(init=False)
    sample_producer: Producer = field(init=False)

    def __post_init__(self) -> None:
        self.reward_producer = Producer(component="rewards", version=self.reward_version)
        self.sample_producer = Producer(component="samples", version=self.sample_version)

    # ---- inputs (each returns the new state; idempotent on redelivery) -----------------------

    @staticmethod
    def _turn(state: SessionState, session_id: str, turn: int) -> dict[str, Any]:
        state.setdefault("session_id", session_id)
        turns = state.setdefault("turns", {})
        return turns.setdefault(
            str(turn), {"next_states": {}, "prm": {}, "penalty": None, "hints": {}}
        )

    def on_interaction(
        self, state: SessionState | None, inter: Interaction, keep_tokens: bool = True
    ) -> SessionState:
        """Record a main-line turn; with ``keep_tokens=False`` its token payload is left out of
        the state (the caller stores :func:`token_payload` and passes it to :meth:`complete`)."""
        state = dict(state or {})
        if inter.turn_type == "side" or state.get("done"):
            return state
        turn = self._turn(state, inter.session_id, inter.turn)
        kept = turn.get("interaction")
        if not inter.train:
            if kept is None:  # opted out (aborted): never a sample, but accounted for
                turn["skip"] = True
            return state
        if kept is not None and (kept.get("ts_ms", 0), kept["event_id"]) > (
            inter.ts_ms, inter.event_id
        ):
            return state  # a number used twice (a retry on another replica): the later turn
        turn.pop("skip", None)
        turn["interaction"] = {
            "event_id": inter.event_id,
            "policy_id": inter.policy_id,
            "weight_version": inter.weight_version,
            "group_id": group_of(inter),
            "ts_ms": inter.ts_ms,
            **(token_payload(inter) if keep_tokens else {}),
        }
        if turn["interaction"]["group_id"] is not None:
            state["group_id"] = turn["interaction"]["group_id"]
        return state

    def on_next_state(self, state: SessionState | None, ns: NextState, now_ms: int) -> SessionState:
        state = dict(state or {})
        state.setdefault("session_id", ns.session_id)
        if is_session_outcome(ns):
            prev = state.get("outcome")
            if prev is None or (ns.ts_ms, ns.event_id) > (prev["ts_ms"], prev["event_id"]):
                state["outcome"] = {
                    "event_id": ns.event_id,
                    "ts_ms": ns.ts_ms,
                    "value": outcome_value(ns),
                }
            return state
        if state.get("done"):
            return state
        self._turn(state, ns.session_id, ns.turn)["next_states"][ns.event_id] = ns.kind
        if ns.kind == "session_end" and state.get("closed_at_ms") is None:
            state["closed_at_ms"] = now_ms
            state["last_turn"] = ns.turn
        return state

    def on_prm(self, state: SessionState | None, prm: PrmScore) -> SessionState:
        state = dict(state or {})
        if state.get("done"):
            return state
        # parents are [interaction id, next state id]: key the verdict by its next state.
        self._turn(state, prm.session_id, prm.turn)["prm"][prm.parents[-1]] = {
            "event_id": prm.event_id,
            "score": prm.score,
            "votes": prm.votes,
        }
        return state

    def on_penalty(self, state: SessionState | None, pen: PathPenalty) -> SessionState:
        state = dict(state or {})
        self._turn(state, pen.session_id, pen.turn)["penalty"] = {
            "event_id": pen.event_id,
            "phi": pen.penalty,
            "beta": pen.beta,
        }
        return state

    def on_hint(self, state: SessionState | None, hint: Hint) -> SessionState:
        state = dict(state or {})
        self._turn(state, hint.session_id, hint.turn)["hints"][hint.event_id] = [
            hint.rank,
            hint.hint,
        ]
        return state

    # ---- completion --------------------------------------------------------------------------

    def ready(self, state: SessionState, now_ms: int) -> bool:
        """Closed, every turn judged and penalised (or the grace period is over), and the
        outcome is in (or no outcome is awaited / the wait is over)."""
        closed = state.get("closed_at_ms")
        if state.get("done") or closed is None:
            return False
        if (
            self.outcome_wait_ms
            and "outcome" not in state
            and now_ms - closed < self.outcome_wait_ms
        ):
            return False
        if now_ms - closed >= self.grace_ms:
            return True
        # Topics are read interleaved, so a replay may deliver a turn's verdicts before its
        # interaction: every main-line turn up to the last must be complete. Turn numbers are
        # conversation positions, so some may never exist (a turn that opted out of training,
        # assistant messages in the first prompt); a trainable one cannot be missing
        # altogether: pairing wrote its next state before the session_end, on this partition.
        turns = state.get("turns", {})
        for t in range(state["last_turn"] + 1):
            info = turns.get(str(t))
            if info is None:
                continue
            if info.get("skip"):
                continue
            if "interaction" not in info or info["penalty"] is None or not info["next_states"]:
                return False
            if any(ns not in info["prm"] for ns in info["next_states"]):
                return False
        return True

    def complete(
        self,
        state: SessionState,
        now_ms: int,
        tokens: Mapping[int, dict[str, Any]] | None = None,
    ) -> Assembly:
        """The session's rewards and samples (call when :meth:`ready`). ``tokens``: turn ->
        :func:`token_payload`, for turns recorded with ``keep_tokens=False``. Samples are not
        z-scored here: a session is one member of its group (see the worker's group stage)."""
        state = dict(state)
        out = Assembly(state)
        sid = state["session_id"]
        outcome = state.get("outcome")
        o_val = None if outcome is None else float(outcome["value"])
        rewards: dict[int, Reward] = {}
        signal: dict[int, bool] = {}
        turns = {int(k): v for k, v in state.get("turns", {}).items() if "interaction" in v}
        for t in sorted(turns):
            if t > state.get("last_turn", t):
                continue
            info = turns[t]
            judged = [info["prm"][n] for n in sorted(info["next_states"]) if n in info["prm"]]
            if not judged:
                signal[t] = False
                continue
            pen = info["penalty"] or {"event_id": None, "phi": 0.0, "beta": 0.0}
            votes = [v for j in judged for v in j["votes"]]
            o, prm, penalty, total = reward_parts(
                [j["score"] for j in judged], votes, o_val, pen["beta"], pen["phi"]
            )
            parents = [j["event_id"] for j in judged] + [
                x for x in (pen["event_id"], outcome and outcome["event_id"]) if x
            ]
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
            signal[t] = total != 0 or o_val is not None
        masked = mask_turns(signal)
        out.rewards = [rewards[t] for t in sorted(rewards)]
        for t in sorted(masked):
            inter = turns[t]["interaction"]
            tok = inter if "response_token_ids" in inter else (tokens or {}).get(t)
            if tok is None:
                raise KeyError(f"no token payload for turn {t} of session {sid}")
            reward = rewards.get(t)
            parents = [inter["event_id"]] + ([reward.event_id] if reward else [])
            n = len(tok["response_token_ids"])
            hints = [h for _, h in sorted(turns[t]["hints"].values())]
            # OPD trains wherever there is a hint, whatever the score (OpenClaw-RL's OPD-only
            # samples); "masked" is left for samples neither term trains.
            no_grad = masked[t] and not hints
            out.samples.append(
                Sample(
                    event_id=derive_event_id("sample", parents, self.sample_version, no_grad),
                    ts_ms=now_ms,
                    producer=self.sample_producer,
                    parents=parents,
                    session_id=sid,
                    turn=t,
                    policy_id=inter["policy_id"],
                    prompt_token_ids=tok["prompt_token_ids"],
                    response_token_ids=tok["response_token_ids"],
                    loss_mask=[0 if masked[t] else 1] * n,
                    behavior_logprobs=tok["response_logprobs"],
                    reward=reward.total if reward else 0.0,
                    hints=hints,
                    behavior_weight_version=inter["weight_version"],
                    masked=no_grad,
                    group_id=inter["group_id"],
                    step_index=t,
                    opd_mask=[1 if hints else 0] * n,
                    penalty=reward.penalty if reward else 0.0,
                )
            )
        state["done"] = True
        state["turns"] = {}  # keep the tombstone small: done sessions ignore stragglers
        return out
