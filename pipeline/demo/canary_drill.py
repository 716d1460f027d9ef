"""A canary drill on simulated users: a good version is rolled out, a harmful one withdrawn.

The drill plays the trainer's side and the users' side of a running ``liverl up`` (its
gateways and its canary decider, ``liverl versions canary``); everything between them is the
product's: gateways route each session to an arm, the workers judge the users' replies, the
decider reads the samples' outcomes and writes ``rollout`` / ``withdraw`` on the weights
topic, and the gateways follow.

- **Versions.** On the tiny model (built in code, no download) a version is fitted in
  seconds to answer the drill's questions: v1 in plain English (good), v2 from v1 in French
  (harmful: what a version trained on one French-speaking session looks like). Each is
  published by the trainer's own :class:`~pipeline.trainer.publish.Publisher` with the gate
  off (the most permissive gate: every candidate serves) and ``canary_share`` on its event.
- **Users.** Each session is a new simulated user who wants answers in English
  (``english`` in :mod:`pipeline.sim.preferences`, which also checks that the answer is on
  topic); it asks one question, judges the answer and replies (thanks or a complaint), the
  next state the workers judge. The base model's answers are noise: those users complain too.
- **Figures.** Per phase: the sessions from publication to the decision, how many of them
  the candidate answered (its exposure), the seconds, and which versions answered the
  sessions after it. ``bench/canary_live.py`` repeats the drill; the integration test
  ``tests/test_demo_canary_drill.py`` asserts on one run.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.demo.loop import LoopConfig
from pipeline.kafka.connection import Connectable
from pipeline.sim import PREFERENCES, QUESTIONS, Question, SimUser, run_session
from pipeline.trainer.config import TrainerSettings
from pipeline.versions.reading import weights_log
from pipeline.versions.table import Action

DRILL_QUESTIONS: tuple[Question, ...] = tuple(QUESTIONS[:3])
# What each version answers (greedy), by question text.
ENGLISH: dict[str, str] = {
    DRILL_QUESTIONS[0].text: "Go to bed at the same time every night.",
    DRILL_QUESTIONS[1].text: "Keep a water bottle on your desk and drink a glass with each meal.",
    DRILL_QUESTIONS[2].text: "Start with a slow run of ten minutes, three days a week.",
}
FRENCH: dict[str, str] = {
    DRILL_QUESTIONS[0].text: "Couchez-vous chaque soir à la même heure.",
    DRILL_QUESTIONS[1].text: "Gardez une bouteille d'eau sur votre bureau.",
    DRILL_QUESTIONS[2].text: "Commencez par courir dix minutes, trois fois par semaine.",
}
DECISIONS = ("rollout", "withdraw")


def fit(
    model: Any,
    tokenizer: Any,
    answers: Mapping[str, str],
    *,
    steps: int = 80,
    lr: float = 1e-2,
    seed: int = 0,
) -> float:
    """Teach ``model`` (in place) to answer each question with its answer: full-batch Adam
    on the answer tokens' cross-entropy. Returns the last loss (≈0.01 after 80 steps on the
    tiny model: greedy decoding then reproduces every answer)."""
    import torch

    torch.manual_seed(seed)
    rows = []
    for question, answer in answers.items():
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        target = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        rows.append((list(prompt) + target, [-100] * len(prompt) + target))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in rows])
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss.detach())


class DrillVersions:
    """The trainer's side: fits versions and publishes them as the trainer does. ``trainer``:
    the loop's trainer settings (its weights and lake roots); the policy, the model, full
    weights, the gate off and ``share`` are set here."""

    def __init__(
        self,
        connection: Connectable,
        trainer: TrainerSettings,
        policy: str,
        model_dir: Path,
        share: float,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from pipeline.kafka import EventProducer
        from pipeline.trainer.publish import Publisher

        self.cfg = trainer.model_copy(
            update={
                "policy": policy,
                "model": str(model_dir),
                "adapter": "full",
                "gate": False,
                "canary_share": share,
            }
        )
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.models: dict[int, Any] = {0: AutoModelForCausalLM.from_pretrained(model_dir)}
        self.producer = EventProducer(connection, client_id=f"canary-drill-{policy}")
        self.publisher = Publisher(self.cfg, self.producer)

    def publish(self, version: int, parent: int, answers: Mapping[str, str]) -> float:
        """Fit ``version`` from ``parent`` to ``answers`` and publish it; returns the wall
        clock (s) at which its servable event was sent."""
        from pipeline.trainer.core import TrainerCore

        model = copy.deepcopy(self.models[parent])
        fit(model, self.tokenizer, answers, seed=version)
        self.models[version] = model
        core = TrainerCore(self.cfg, model, self.tokenizer, step=version)
        sent = time.time()
        self.publisher.publish(
            core,
            version=version,
            parent=parent or None,
            offsets={},
            trajectories=[],
            steps=[],
            created_ms=int(sent * 1000),
        )
        return sent

    def close(self) -> None:
        self.producer.flush()


@dataclass
class Phase:
    """One candidate's canary, publication to decision, as the users met it."""

    version: int
    decision: str | None  # rollout | withdraw; None: no decision within max_sessions
    decided_by: str | None
    figures: dict[str, Any] | None  # the decision's numbers, as on its event
    seconds: float | None  # publication to the decision event
    sessions: int  # sessions started from publication until the decision
    on_candidate: int  # of them, answered by the candidate
    satisfied: dict[int, list[int]] = field(default_factory=dict)  # version -> [yes, all]
    after: Counter[int] = field(default_factory=Counter)  # versions answering afterwards
    after_replicas: Counter[str] = field(default_factory=Counter)  # gateways that answered them
    error: str | None = None  # no decision: the last failed read of the weights log, if any

    @property
    def exposure(self) -> float:
        """The share of sessions the candidate answered before its decision."""
        return self.on_candidate / self.sessions if self.sessions else 0.0


class DecisionWatch:
    """Follows the weights log in a thread: the first rollout/withdraw of each version."""

    def __init__(self, connection: Connectable, policy: str, every_s: float = 1.0) -> None:
        self.connection, self.policy, self.every_s = connection, policy, every_s
        self.found: dict[int, Action] = {}  # version -> its first rollout or withdraw
        self.counts: Counter[tuple[str, int]] = Counter()  # (kind, version) -> events
        self.error: str | None = None  # the last read's failure (None after a good read)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drill-decisions", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:  # a failed read is retried at the next tick, and kept for the report
                self.refresh()
                self.error = None
            except Exception as exc:  # noqa: BLE001
                self.error = f"{type(exc).__name__}: {exc}"

    def refresh(self) -> None:
        log = weights_log(self.connection, self.policy, timeout_s=10)
        counts = Counter((a.kind, a.version) for a in log.actions)
        for action in log.actions:
            if action.kind in DECISIONS:
                self.found.setdefault(action.version, action)
        self.counts = counts

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class DrillUsers:
    """The users' side: one new English-speaking user per session, at ``rate`` sessions/s."""

    def __init__(self, url: str, policy: str, *, rate: float = 4.0, seed: int = 0) -> None:
        from openai import DefaultHttpxClient, OpenAI

        # A new connection per request (Connection: close): gateway replicas share one port
        # (SO_REUSEPORT) and the kernel picks one per connection, so a kept-alive connection
        # would pin every session to one replica and leave the other untested.
        http = DefaultHttpxClient(event_hooks={"response": [self._seen]})
        self.client = OpenAI(
            base_url=url,
            api_key="drill",
            max_retries=0,
            timeout=60,
            http_client=http,
            default_headers={"Connection": "close"},
        )
        self.policy, self.rate, self.seed = policy, rate, seed
        self.count = 0
        self.last_replicas: set[str] = set()  # the replicas that answered the last session

    def _seen(self, response: Any) -> None:
        replica = response.headers.get("x-liverl-replica")
        if replica:
            self.last_replicas.add(replica)

    def session(self) -> tuple[float, int | None, bool]:
        """(start wall time, the version that answered, whether the user was satisfied)."""
        i = self.count
        self.count += 1
        user = SimUser(
            f"{self.policy}-user-{self.seed}-{i}",
            PREFERENCES["english"],
            hint_rate=0.0,
            seed=self.seed,
        )
        started = time.time()
        self.last_replicas = set()
        turn = run_session(
            self.client,
            self.policy,
            user,
            DRILL_QUESTIONS[i % len(DRILL_QUESTIONS)],
            session_id=f"{self.policy}-s{self.seed}-{i}",
            max_tokens=48,
            temperature=0.0,
        )
        return started, turn.weight_version, turn.judgement.satisfied

    def paced(self) -> Iterator[tuple[float, int | None, bool]]:
        """Sessions one after another, no faster than ``rate`` per second."""
        while True:
            t0 = time.monotonic()
            yield self.session()
            time.sleep(max(0.0, 1.0 / self.rate - (time.monotonic() - t0)))


def run_phase(
    users: DrillUsers,
    watch: DecisionWatch,
    version: int,
    published_s: float,
    *,
    max_sessions: int = 600,
    after: int = 12,
    settle_s: float = 2.0,
) -> Phase:
    """Send sessions until ``version``'s decision is on the log (or ``max_sessions``), then
    ``after`` more once the gateways had ``settle_s`` to follow it."""
    started: list[tuple[float, int | None, bool]] = []
    for record in users.paced():
        started.append(record)
        if version in watch.found or len(started) >= max_sessions:
            break
    deadline = time.monotonic() + 30  # the last sessions' outcomes may still be on the way
    while (
        version not in watch.found and time.monotonic() < deadline and len(started) >= max_sessions
    ):
        time.sleep(0.5)
    action = watch.found.get(version)
    cut = action.ts_ms / 1000 if action is not None else float("inf")
    before = [r for r in started if r[0] < cut]
    satisfied: dict[int, list[int]] = {}
    for _, v, ok in before:
        pair = satisfied.setdefault(v if v is not None else -1, [0, 0])
        pair[0] += ok
        pair[1] += 1
    phase = Phase(
        version=version,
        decision=action.kind if action is not None else None,
        decided_by=action.by if action is not None else None,
        figures=action.figures if action is not None else None,
        seconds=(cut - published_s) if action is not None else None,
        sessions=len(before),
        on_candidate=sum(v == version for _, v, _ in before),
        satisfied=satisfied,
    )
    if action is None:
        phase.error = watch.error
    else:
        time.sleep(settle_s)
        for _ in range(after):
            _, v, _ = users.session()
            phase.after[v if v is not None else -1] += 1
            phase.after_replicas.update(users.last_replicas)
    return phase


@dataclass
class DrillResult:
    good: Phase  # v1, English, against the base model
    harmful: Phase  # v2, French, against v1
    actions: Counter[tuple[str, int]]  # (kind, version) -> events on the weights topic


def loop_config(
    policy: str,
    state_dir: Path,
    *,
    gateways: int = 2,
    extra_args: tuple[str, ...] = (),
    start_timeout_s: float = 600.0,
) -> LoopConfig:
    """The ``liverl up`` the drill runs against: the tiny model, ``gateways`` replicas, the
    workers and the canary decider; no trainer (the drill publishes), judges or archive."""
    # The drill publishes with the gate off: the gateways must serve candidates too.
    return LoopConfig(
        extra_env={"LIVERL_TRAINER_GATE": "false"},
        policy=policy,
        state_dir=state_dir,
        model="tiny",
        without=("trainer", "judges", "archive"),
        gateways=gateways,
        extra_args=extra_args,
        start_timeout_s=start_timeout_s,
    )


def run_drill(
    connection: Connectable,
    trainer: TrainerSettings,
    url: str,
    policy: str,
    model_dir: Path | None = None,
    *,
    share: float,
    rate: float = 4.0,
    seed: int = 0,
    max_sessions: int = 600,
) -> DrillResult:
    """Both phases against the loop serving ``policy`` at ``url`` (its OpenAI base URL);
    ``trainer``: the loop's trainer settings, resolved under its state dir; ``model_dir``:
    the loop's model (default: the tiny model, as :func:`loop_config` starts it)."""
    if model_dir is None:
        from pipeline.models.tiny import ensure_tiny_model

        model_dir = ensure_tiny_model()
    versions = DrillVersions(connection, trainer, policy, model_dir, share)
    users = DrillUsers(url, policy, rate=rate, seed=seed)
    watch = DecisionWatch(connection, policy)
    try:
        good = run_phase(
            users, watch, 1, versions.publish(1, 0, ENGLISH), max_sessions=max_sessions
        )
        harmful = run_phase(
            users, watch, 2, versions.publish(2, 1, FRENCH), max_sessions=max_sessions
        )
        watch.refresh()
        return DrillResult(good, harmful, watch.counts)
    finally:
        watch.close()
        versions.close()
