"""Simulated users against a live loop: training sessions, held-out evaluation, freshness.

A *training session* is one user asking one question of the live policy, judging the answer
against a hidden preference (and against answering the question at all), and replying: the
reply is the next state that the judge turns into a reward and, when it carries a directive,
a hint. An *evaluation* asks held-out users held-out questions with ``X-Liverl-Train: false``
(nothing recorded, nothing trained), once on the initial policy and once on the final one.
The fixed capability probe (:mod:`pipeline.sim.probe`) runs beside them, also unrecorded:
greedy factual answers (knowledge kept) and the base model's log-prob of sampled answers
(language kept), because a preference learned by breaking everyone else's answers is no win.

Freshness is measured per training session: from the moment the user's reply was recorded
to the first answer the demo saw from the weight version whose step consumed that session
(read from the Delta ``trajectories`` table once the run is over).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.sim import (
    PREFERENCES,
    Critic,
    ProbeResult,
    Question,
    TurnResult,
    make_users,
    probe_endpoint,
    run_session,
    split,
    weight_version,
)

PROBE_MAX_TOKENS = 32  # as probe_model's default, so gateway and local figures compare


@dataclass
class DemoConfig:
    method: str = "opd"
    preference: str = "concise"
    hint_rate: float = 1.0
    users: int = 6  # concurrent users per round (one session each)
    rounds: int = 8
    eval_questions: int = 8
    max_tokens: int = 48
    temperature: float = 0.7
    seed: int = 0
    window: int = 12  # sessions in the moving satisfied share
    settle_s: float = 120.0  # wait this long at most for the last sessions to be trained
    # Users wait for the weights trained on their round before the next round, as a person
    # waits for a reply: on 2 cores serving and training share the CPU, and without the
    # pause generation starves the trainer so rounds run on ever older weights.
    pace: bool = True
    pace_s: float = 180.0  # at most this long per round
    probe: bool = True  # the capability probe before and after (fluency needs the base model)
    model: str | None = None  # the loop's model, whose base scores fluency; None: default
    # The critic (pipeline/sim/critic.py): frontier-drawn questions, adapted phrasing. Both
    # off: questions drawn uniformly, asked plainly (every figure before issue 26).
    frontier: bool = False
    adapt: bool = False
    # Share of training sessions whose user also gives thumbs up/down (POST /v1/feedback):
    # the verifiable outcomes judges' consistency is measured against. Drawn from its own
    # generator, so the questions of a seed are the same at any share.
    feedback: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.feedback <= 1.0:
            raise ValueError(f"feedback is a share of sessions in [0, 1], got {self.feedback}")


@dataclass
class Evaluation:
    version: int | None
    satisfied: float
    meets_preference: float
    quality_ok: float
    n: int
    answers: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Capability:
    """The capability probe on one served version (through the gateway, unrecorded)."""

    version: int | None
    result: ProbeResult

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, **self.result.to_dict()}


@dataclass
class Session:
    index: int
    round: int
    user_id: str
    session_id: str
    question: str
    answer: str
    satisfied: bool
    meets_preference: bool
    quality_ok: bool
    reply: str
    version: int | None
    asked_at: float
    replied_at: float
    prompt: str = ""  # what the user sent (the question, phrased by the critic when on)
    allocation: dict[str, Any] | None = None  # why the critic drew it (None: uniform, plain)
    thumbs: str | None = None  # "up" / "down": the user's feedback (DemoConfig.feedback)


@dataclass
class DemoResult:
    config: DemoConfig
    policy: str
    before: Evaluation
    after: Evaluation
    sessions: list[Session]
    first_seen: dict[int, float]  # weight version -> when the demo first got an answer from it
    freshness_s: list[float]
    wall_s: float
    probe_before: Capability | None = None  # None: not probed (DemoConfig.probe off)
    probe_after: Capability | None = None
    probe_note: str | None = None  # why fluency is missing, when it is
    gate: dict[int, str] = field(default_factory=dict)  # version -> promoted | rejected
    critic_levels: list[int] = field(default_factory=list)  # per round, when a critic planned

    def summary(self) -> dict[str, Any]:
        fresh = self.freshness_s
        satisfied = [s.satisfied for s in self.sessions]
        return {
            "policy": self.policy,
            "method": self.config.method,
            "preference": self.config.preference,
            "hint_rate": self.config.hint_rate,
            "seed": self.config.seed,
            "sessions": len(self.sessions),
            "versions_seen": sorted(self.first_seen),
            "heldout_before": _eval_dict(self.before),
            "heldout_after": _eval_dict(self.after),
            "train_satisfied_share": _share([s.satisfied for s in self.sessions]),
            "train_quality_share": _share([s.quality_ok for s in self.sessions]),
            "train_satisfied": satisfied,
            "sessions_until_met": sessions_until_met(satisfied, self.config.window),
            # OpenClaw-RL's figure; `satisfied` = meets the preference and answers the question
            "sessions_until_3_consecutive": sessions_until_consecutive(satisfied, 3),
            "probe_before": self.probe_before.to_dict() if self.probe_before else None,
            "probe_after": self.probe_after.to_dict() if self.probe_after else None,
            "probe_note": self.probe_note,
            "freshness_s": {
                "n": len(fresh),
                "p50": statistics.median(fresh) if fresh else None,
                "max": max(fresh) if fresh else None,
            },
            "gate": {
                "promoted": sum(v == "promoted" for v in self.gate.values()),
                "rejected": sum(v == "rejected" for v in self.gate.values()),
                "reject_share": (
                    sum(v == "rejected" for v in self.gate.values()) / len(self.gate)
                    if self.gate
                    else None
                ),
            },
            "critic": _critic_summary(self.sessions) if self.critic_levels else None,
            "feedback": {
                "share": self.config.feedback,
                "up": sum(s.thumbs == "up" for s in self.sessions),
                "down": sum(s.thumbs == "down" for s in self.sessions),
            },
            "wall_s": round(self.wall_s, 1),
            "config": asdict(self.config),
        }


def _critic_summary(sessions: list[Session]) -> dict[str, Any]:
    """How the critic drew the sessions: counts by level and draw, and per round."""
    drawn = [s.allocation for s in sessions if s.allocation]
    levels: dict[str, int] = {}
    draws: dict[str, int] = {}
    for a in drawn:
        levels[a["level"]] = levels.get(a["level"], 0) + 1
        draws[a["drawn"]] = draws.get(a["drawn"], 0) + 1
    rounds: dict[int, list[str]] = {}
    for s in sessions:
        if s.allocation:
            rounds.setdefault(s.round, []).append(s.allocation["level"])
    return {
        "levels": levels,
        "drawn": draws,
        "per_round": {
            r: {lv: v.count(lv) for lv in sorted(set(v))} for r, v in sorted(rounds.items())
        },
    }


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _eval_dict(e: Evaluation) -> dict[str, Any]:
    return {
        "version": e.version,
        "satisfied": e.satisfied,
        "meets_preference": e.meets_preference,
        "quality_ok": e.quality_ok,
        "n": e.n,
    }


def moving_share(flags: list[bool], window: int) -> list[float]:
    """Share of True over the last ``window`` items at each position."""
    out = []
    for i in range(len(flags)):
        part = flags[max(0, i + 1 - window) : i + 1]
        out.append(sum(part) / len(part))
    return out


def sessions_until_met(flags: list[bool], window: int, threshold: float = 0.75) -> int | None:
    """Training sessions until the moving satisfied share first reaches ``threshold`` over a
    full window (None: never). OpenClaw-RL reports the same kind of figure per method."""
    for i in range(window - 1, len(flags)):
        if sum(flags[i + 1 - window : i + 1]) / window >= threshold:
            return i + 1
    return None


def sessions_until_consecutive(flags: list[bool], k: int = 3) -> int | None:
    """Sessions up to and including the ``k``-th satisfied one in a row (1-based; None:
    never). OpenClaw-RL's learning metric: a moving share can be met by luck, ``k``
    consecutive sessions rarely are."""
    if k < 1:
        raise ValueError("k must be at least 1")
    run = 0
    for i, flag in enumerate(flags):
        run = run + 1 if flag else 0
        if run == k:
            return i + 1
    return None


Progress = Callable[[str, dict[str, Any]], None]


class DemoRunner:
    """Drives simulated users through the gateway at ``url`` serving ``policy``."""

    def __init__(
        self, url: str, policy: str, cfg: DemoConfig, *, on_progress: Progress | None = None
    ) -> None:
        from openai import OpenAI

        self.url = url
        self.policy = policy
        self.cfg = cfg
        self.client = OpenAI(base_url=url, api_key="demo", timeout=600, max_retries=0)
        self.on_progress = on_progress or (lambda _kind, _data: None)
        self.first_seen: dict[int, float] = {}
        train_q, held_q = split(seed=cfg.seed)
        self.train_questions: list[Question] = train_q
        self.heldout_questions: list[Question] = held_q[: cfg.eval_questions]
        # One repetition memory across users: the same stock answer to different users'
        # questions is caught at once (the pilot's "You are a helpful AI…" hack).
        self.users = make_users(
            cfg.users, (cfg.preference,), cfg.hint_rate, cfg.seed, shared_history=True
        )
        self.rng = random.Random(cfg.seed)
        self.feedback_rng = random.Random(f"feedback-{cfg.seed}")
        self.critic: Critic | None = None
        if cfg.frontier or cfg.adapt:
            self.critic = Critic(
                train_q, (cfg.preference,), seed=cfg.seed, frontier=cfg.frontier, adapt=cfg.adapt
            )
        self._scorer: tuple[Any, Any] | None = None  # (base model, tokenizer), loaded once
        self.probe_note: str | None = None

    def _seen(self, result: TurnResult, at: float) -> None:
        self._seen_version(result.weight_version, at)

    def _seen_version(self, v: int | None, at: float) -> None:
        if v is not None and v not in self.first_seen:
            self.first_seen[v] = at
            self.on_progress("version", {"version": v, "at": at})

    def evaluate(self, label: str) -> Evaluation:
        """Held-out users on held-out questions, nothing recorded; fresh users each time so
        the repetition check starts empty."""
        users = make_users(
            len(self.heldout_questions),
            (self.cfg.preference,),
            self.cfg.hint_rate,
            self.cfg.seed + 10_000,
            shared_history=True,
        )
        run = f"eval-{label}-{int(time.time() * 1000)}"

        def one(i: int) -> TurnResult:
            return run_session(
                self.client,
                self.policy,
                users[i],
                self.heldout_questions[i],
                session_id=f"{run}-{i}",
                max_tokens=self.cfg.max_tokens,
                temperature=0.0,
                train=False,
            )

        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(one, range(len(users))))
        for r in results:
            self._seen(r, time.monotonic())
        n = len(results)
        versions = {r.weight_version for r in results}
        ev = Evaluation(
            version=max((v for v in versions if v is not None), default=None),
            satisfied=sum(r.judgement.satisfied for r in results) / n,
            meets_preference=sum(r.judgement.meets_preference for r in results) / n,
            quality_ok=sum(r.judgement.quality.ok for r in results) / n,
            n=n,
            answers=[
                {
                    "question": r.question.text,
                    "answer": r.answer,
                    "satisfied": r.judgement.satisfied,
                    "reasons": r.judgement.quality.reasons,
                }
                for r in results
            ],
        )
        self.on_progress("eval", {"label": label, "eval": ev})
        return ev

    def scorer(self) -> tuple[Any, Any]:
        """The frozen base model and its tokenizer, loaded here once: they score the probe's
        sampled answers, so fluency compares across versions. (None, None) when they cannot
        be loaded; ``probe_note`` then says why."""
        if self._scorer is None:
            try:
                from transformers import AutoModelForCausalLM, AutoTokenizer

                from pipeline.models.store import resolve

                path = resolve(self.cfg.model)
                model = AutoModelForCausalLM.from_pretrained(path).eval()
                self._scorer = (model, AutoTokenizer.from_pretrained(path))
            except Exception as exc:  # an optional figure: report it missing, go on
                self._scorer = (None, None)
                self.probe_note = (
                    f"fluency not measured: the base model "
                    f"{self.cfg.model or 'default'} could not be loaded ({exc})"
                )
                self.on_progress("note", {"text": self.probe_note})
        return self._scorer

    def capability(self, label: str) -> Capability:
        """The fixed probe through the gateway, unrecorded: greedy answers checked, sampled
        answers (the training temperature) scored by the base model."""
        versions: list[int] = []

        def ask(question: str, temperature: float) -> str:
            reply = self.client.chat.completions.create(
                model=self.policy,
                messages=[{"role": "user", "content": question}],
                max_tokens=PROBE_MAX_TOKENS,
                temperature=temperature,
                seed=self.cfg.seed,
                extra_headers={"X-Liverl-Train": "false"},
            )
            v = weight_version(reply.system_fingerprint)
            if v is not None:
                versions.append(v)
                self._seen_version(v, time.monotonic())
            return reply.choices[0].message.content or ""

        base, tokenizer = self.scorer()
        result = probe_endpoint(
            ask, base_model=base, tokenizer=tokenizer, temperature=self.cfg.temperature
        )
        cap = Capability(max(versions, default=None), result)
        self.on_progress("capability", {"label": label, "capability": cap})
        return cap

    def train_round(self, round_no: int, start_index: int) -> list[Session]:
        """One session per user, concurrently (as real users would arrive); with a critic,
        the questions, preferences and phrasing it plans from what the policy fails at."""
        plan = self.critic.plan(len(self.users)) if self.critic else None
        if plan is None:
            questions = self.rng.sample(self.train_questions, len(self.users))
            prompts: list[str | None] = [None] * len(self.users)
        else:
            questions = [a.question for a in plan]
            prompts = [a.prompt for a in plan]
            for user, a in zip(self.users, plan, strict=True):
                user.preference = PREFERENCES[a.preference]
        run = f"{self.policy}-r{round_no}"
        rates = [self.feedback_rng.random() < self.cfg.feedback for _ in self.users]

        def one(i: int) -> Session:
            asked = time.monotonic()
            r = run_session(
                self.client,
                self.policy,
                self.users[i],
                questions[i],
                session_id=f"{run}-u{i}",
                max_tokens=self.cfg.max_tokens,
                temperature=self.cfg.temperature,
                train=True,
                prompt=prompts[i],
                thumbs=rates[i],
            )
            # The reply request answers within a token, so its end stands for when the
            # user's reply was recorded (freshness is measured from there).
            replied = time.monotonic()
            self._seen(r, replied)
            return Session(
                index=start_index + i,
                round=round_no,
                user_id=r.user_id,
                session_id=r.session_id,
                question=r.question.text,
                answer=r.answer,
                satisfied=r.judgement.satisfied,
                meets_preference=r.judgement.meets_preference,
                quality_ok=r.judgement.quality.ok,
                reply=r.reply,
                version=r.weight_version,
                asked_at=asked,
                replied_at=replied,
                prompt=r.prompt,
                allocation=plan[i].record() if plan else None,
                thumbs=r.thumbs,
            )

        with ThreadPoolExecutor(max_workers=len(self.users)) as pool:
            sessions = list(pool.map(one, range(len(self.users))))
        if plan is not None and self.critic is not None:
            for a, sess in zip(plan, sessions, strict=True):
                self.critic.observe(a, sess.satisfied)
        for s in sessions:
            self.on_progress("session", {"session": s})
        return sessions

    def probe(self) -> int | None:
        """One tiny unrecorded request: which version serves now (and note when first seen)."""
        reply = self.client.chat.completions.create(
            model=self.policy,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            extra_headers={"X-Liverl-Train": "false"},
        )
        fp = reply.system_fingerprint or ""
        version = int(fp.rsplit("v", 1)[-1]) if fp.startswith("liverl-v") else None
        self._seen_version(version, time.monotonic())
        return version

    def run(self, lake: Path) -> DemoResult:
        start = time.monotonic()
        self.probe()
        before = self.evaluate("before")
        probe_before = self.capability("before") if self.cfg.probe else None
        sessions: list[Session] = []
        for round_no in range(self.cfg.rounds):
            live = self.probe() or 0
            mine = self.train_round(round_no, len(sessions))
            sessions += mine
            if self.cfg.pace and round_no + 1 < self.cfg.rounds:
                self._wait_for_newer(live, lake, mine)
        self._settle(lake, sessions)
        after = self.evaluate("after")
        probe_after = self.capability("after") if self.cfg.probe else None
        fresh = freshness(lake, self.policy, sessions, self.first_seen)
        return DemoResult(
            self.cfg,
            self.policy,
            before,
            after,
            sessions,
            dict(self.first_seen),
            fresh,
            time.monotonic() - start,
            probe_before,
            probe_after,
            self.probe_note,
            verdicts(lake, self.policy),
            list(self.critic.levels) if self.critic else [],
        )

    def _wait_for_newer(self, live: int, lake: Path, round_sessions: list[Session]) -> None:
        """Until a version newer than ``live`` serves, or the version trained on this round
        was rejected by the promotion gate (it will never serve), bounded by ``pace_s``."""
        deadline = time.monotonic() + self.cfg.pace_s
        self.on_progress("pace", {"waiting_for": live + 1})
        wanted = {s.session_id for s in round_sessions}
        checked = 0.0
        while time.monotonic() < deadline:
            if (self.probe() or 0) > live:
                return
            if time.monotonic() - checked >= 3.0:  # the lake is slower to read than a probe
                checked = time.monotonic()
                if _round_rejected(lake, self.policy, wanted):
                    return
            time.sleep(1.0)

    def _settle(self, lake: Path, sessions: list[Session]) -> None:
        """Wait (bounded) until the last sessions were trained and their version serves."""
        wanted = {s.session_id for s in sessions}
        deadline = time.monotonic() + self.cfg.settle_s
        while time.monotonic() < deadline:
            consumed = consumed_versions(lake, self.policy)
            done = wanted & set(consumed)
            newest = max((consumed[s] for s in done), default=None)
            version = self.probe()
            self.on_progress("settle", {"trained": len(done), "of": len(wanted)})
            if (
                len(done) == len(wanted)
                and newest is not None
                and (
                    (version or 0) >= newest
                    or verdicts(lake, self.policy).get(newest) == "rejected"
                )
            ):
                return
            time.sleep(2)


def verdicts(lake: Path, policy: str) -> dict[int, str]:
    """version -> the promotion gate's verdict (``promoted`` / ``rejected``), Delta weights."""
    from deltalake import DeltaTable

    uri = str(lake / "weights")
    if not DeltaTable.is_deltatable(uri):
        return {}
    import pyarrow.compute as pc

    from pipeline.lake.reading import dataset

    flt = (pc.field("policy_id") == policy) & pc.field("status").isin(["promoted", "rejected"])
    rows = dataset(uri).to_table(columns=["version", "status"], filter=flt).to_pylist()
    return {int(r["version"]): str(r["status"]) for r in rows}


def _round_rejected(lake: Path, policy: str, sessions: set[str]) -> bool:
    """Every session of the round was consumed, and the newest version that consumed them
    was rejected."""
    consumed = consumed_versions(lake, policy)
    if not sessions or not sessions <= set(consumed):
        return False
    return verdicts(lake, policy).get(max(consumed[s] for s in sessions)) == "rejected"


def consumed_versions(lake: Path, policy: str) -> dict[str, int]:
    """session id -> the weight version whose step consumed its turn 0 (Delta trajectories)."""
    from deltalake import DeltaTable

    uri = str(lake / "trajectories")
    if not DeltaTable.is_deltatable(uri):
        return {}
    import pyarrow.compute as pc

    from pipeline.lake.reading import dataset

    ds = dataset(uri)
    flt = (pc.field("policy_id") == policy) & (pc.field("turn") == 0)
    rows = ds.to_table(columns=["session_id", "weight_version"], filter=flt).to_pylist()
    return {r["session_id"]: r["weight_version"] for r in rows if r["weight_version"] is not None}


def freshness(
    lake: Path, policy: str, sessions: list[Session], first_seen: dict[int, float]
) -> list[float]:
    """Seconds from each user's reply to the first answer from the version trained on it."""
    consumed = consumed_versions(lake, policy)
    out = []
    for s in sessions:
        v = consumed.get(s.session_id)
        if v is not None and v in first_seen and first_seen[v] >= s.replied_at:
            out.append(first_seen[v] - s.replied_at)
    return out
