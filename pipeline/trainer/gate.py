"""Promotion gate: a candidate version is promoted by fresh rollouts and judges' votes, and only
promoted versions are served (AIDE 2's pattern: candidates rejected by vote).

Evaluation set, rebuilt from the Delta ``trajectories`` table after a restart:

- *held-out prompts*: a deterministic fraction ``gate_holdout`` of samples is never trained on
  (``sha256(event_id)``; the step masks it and its trajectory row says ``held_out``). The
  newest ``gate_eval_samples`` distinct prompts among them, with the recorded response, its
  reward and its hints;
- *the capability probe* (:mod:`pipeline.sim.probe`, ``gate_probe``): questions with checkable
  answers that nothing trains on, so a user's preference cannot silently break everyone else's
  answers.

Rollouts: the candidate (``core.model`` as published) and the live version (the newest
promoted one, else the base) answer every prompt freshly, greedy (read by ``capability``,
``hint`` and ``llm``) and sampled at ``gate_temperature`` with a fixed seed (read by
``fluency``: a greedy check alone misses sampled answers collapsing into gibberish). The live
version's answers and scores are computed once per live version.

Judges; each votes +1 (candidate better), −1 (live better) or 0 (tie, or does not apply):

- ``validity`` (every prompt): an answer that says nothing (:func:`answer_defect`: empty,
  whitespace, no letter or digit, a loop of one token or word) or whose fluency is missing,
  NaN or infinite loses its prompt, whatever the other judges say (the live version's too);

- ``capability`` (probe): one greedy answer is correct (``probe.is_correct``), the other not;
- ``fluency`` (every prompt): f = mean log-prob per token of the sampled answer under the frozen
  base; |f_c − f_l| ≤ ``gate_fluency_margin`` is a tie. It detects collapse, not style: a
  concise answer averages over its less predictable first tokens and reads lower, so the
  margin (0.5) and the tolerance (1.0 nat/token) sit between a style change (−0.5) and
  gibberish (−1.6 to −7.7 against the base);
- ``relevance`` (held-out prompts whose request, the last user message, has content words):
  one sampled answer is on the request's topic by the ``on_topic`` reader
  (:func:`pipeline.processors.answer_judges.off_topic_reasons`), the other not;
- ``hint`` (held-out prompts whose turn got a hint, the pipeline judge's correction):
  h = mean_t [log p_base(a_t | prompt + hint) − log p_base(a_t | prompt)] of the greedy
  answer: how much better the user's hint explains it than the plain prompt (OPD's teacher
  signal); ties within ``gate_tolerance``;
- ``reward`` (held-out prompts with a non-zero recorded reward r, the pipeline judge's verdict
  on the recorded response y): r · (ℓ_c(y) − ℓ_l(y)), ℓ the mean log-prob per token: toward
  what the user liked, away from what they did not; ties within ``gate_tolerance``;
- ``llm`` (where ``gate_llm_url`` is set): an OpenAI-compatible model says which greedy answer
  is better (:mod:`pipeline.trainer.gate_llm`).

Verdict: a prompt goes to the side its votes add up to (0: tied), or to the validity judge's.
The candidate is promoted iff a majority of the prompts does not prefer the live version (ties
count as no preference: a small step changes few answers, and the vetoes below guard what
matters), its probe score is at most ``gate_probe_tolerance`` questions below the live one's,
and its mean fluency at most ``gate_fluency_tolerance`` nats per token below (a fluency that
is missing or not finite fails).

Those checks compare the candidate with the live version only, so a loss within tolerance at
every step would add up without bound. The budget holds every candidate against a fixed
reference too, the base model on the same prompts (its figures computed once per prompt and
kept in ``<weights_root>/<policy>/gate_reference.json``): it is rejected when it answers more
than ``gate_budget_probe`` probe questions fewer right than the base, its mean fluency is more
than ``gate_budget_fluency`` nats per token below the base's, or its share of held-out
prompts answered on topic is more than ``gate_budget_relevance`` below the base's, whatever
its comparison with the live version says. A loss equal to its budget passes; a figure that
is missing or not finite on either side leaves that metric unchecked, said in the verdict
(``gate_budget_unknown``), which records the reference's figures (``gate_reference_*``) and
what is left of each budget (``gate_budget_*_left``, negative once overspent).

A vote cast without two comparable scores is an abstention;
with fewer than ``gate_min_decided`` of the prompts decided by some judge the verdict is no
decision (``NO_DECISION``): the version stays a candidate, never promoted. Every vote is kept
in the verdict (``votes``), and from there becomes a ``GateVote`` event and a ``gate_votes``
Delta row.

The verdict is stored in ``vN/trainer/verdict.json`` before it is appended to Delta and sent,
so a crash anywhere after that replays the same verdict rather than re-evaluating. What the
trainer does after a rejection is the loop's (``gate_on_reject``, see :mod:`loop`).
"""

from __future__ import annotations

import copy
import hashlib
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson
import pyarrow.compute as pc
from deltalake import DeltaTable

from pipeline.durable import atomic_write
from pipeline.lake.reading import dataset
from pipeline.processors.answer_judges import OnTopicJudge, off_topic_reasons
from pipeline.sim import probe as P
from pipeline.trainer import checkpoint as ck
from pipeline.trainer import rollout as R
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.prompts import ChatMarkers, last_user_ids, teacher_prompt
from pipeline.trainer.scoring import HELD_OUT

if TYPE_CHECKING:
    from pipeline.processors.consistency_file import JudgeRow


class LiveRows(Protocol):
    """Judges' consistency now (``pipeline.processors.consistency_live.LiveConsistency``)."""

    def rows(self) -> list[JudgeRow]: ...


class Progress(Protocol):
    """Told how far an evaluation is: prompts answered of all it answers, and by whom
    (``live``, ``candidate`` or ``base``)."""

    def __call__(self, done: int, total: int, whose: str) -> None: ...


VERDICT_FILE = "verdict.json"
VERDICT_DONE = "verdict.done"
_COLUMNS = [
    "event_id",
    "session_id",
    "prompt_token_ids",
    "response_token_ids",
    "loss_mask",
    "reward",
    "hints",
    "weight_version",
    "step",
    "source_partition",
    "source_offset",
]
JUDGES = ("validity", "capability", "fluency", "relevance", "hint", "reward", "llm")
VALIDITY = "validity"  # an empty, degenerate or unscored answer loses its prompt, unweighted
NO_DECISION = "candidate"  # the status of a verdict with too few decided prompts: not promoted
# An answer's smallest acceptable content: one word character. The probe's right answers can be
# a single character ("4", "7", "0"), so any longer minimum would fail correct answers; an
# answer without a single letter or digit ("", "  ", "...") answers nothing.
MIN_WORD_CHARS = 1
REPEAT_MIN = 4  # units (tokens, words, characters): this many or more, all one unit, is a loop
LOOP_MIN = 8  # units: this many or more with at most a quarter of them distinct is a loop
_WORD_CHAR = re.compile(r"\w")
ANSWER_CHARS = 400  # of each answer kept in a vote (the Delta row, the event's detail)
REFERENCE_FILE = "gate_reference.json"  # the base model's figures, in the policy's folder
REFERENCE_ROWS = 512  # prompts kept in it: the evaluation set moves on, old prompts drop out
BUDGETS = ("probe", "fluency", "relevance")
# A loss equal to its budget passes: float sums (0.92 - 0.2) must not make it fail.
_BUDGET_EPS = 1e-9


def _order(row: dict[str, Any]) -> tuple[int, int, int, int]:
    return (row["weight_version"], row["step"], row["source_partition"], row["source_offset"])


def read_verdict(directory: Path) -> dict[str, Any] | None:
    path = directory / ck.TRAINER_DIR / VERDICT_FILE
    return orjson.loads(path.read_bytes()) if path.exists() else None


def write_verdict(directory: Path, verdict: dict[str, Any]) -> None:
    """Atomic and durable: a crash leaves the old verdict or the new one."""
    atomic_write(
        directory / ck.TRAINER_DIR / VERDICT_FILE,
        orjson.dumps(verdict, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2),
    )


def prompt_id(ids: Sequence[int]) -> str:
    """Stable id of a prompt: the same for every version, process and replay."""
    return hashlib.sha256(b"liverl-prompt:" + orjson.dumps(list(ids))).hexdigest()[:24]


@dataclass
class EvalPrompt:
    """One prompt of the evaluation set."""

    prompt_id: str
    source: str  # held_out | probe
    ids: list[int]
    text: str = ""
    item: P.ProbeItem | None = None
    response: list[int] = field(default_factory=list)  # the recorded answer (held-out)
    reward: float = 0.0
    hint: str | None = None
    session_id: str | None = None  # the recorded session of a held-out prompt
    request: str = ""  # a held-out prompt's last user message (the relevance judge's); probe: ""

    @property
    def key(self) -> tuple[str, str, str]:
        """What a cached live answer is valid for: the prompt, its source, and what the judges
        compare it with (the recorded response, the hint)."""
        extra = hashlib.sha256(orjson.dumps([self.response, self.reward, self.hint])).hexdigest()
        return (self.source, self.prompt_id, extra[:16])

    @property
    def seed(self) -> int:
        """The sampling seed of this prompt's sampled answer, the same in every batch."""
        return int(self.prompt_id[:8], 16)


@dataclass
class Scored:
    """One model's fresh answers to the evaluation set and what the judges read of them."""

    greedy: list[list[int]]
    text: list[str]
    sampled_text: list[str]
    correct: list[bool | None]
    fluency: list[float | None]
    hint: list[float | None]
    recorded: list[float | None]  # mean log-prob of the recorded response (reward judge)
    sampled: list[list[int]] = field(default_factory=list)  # token ids of the sampled answers

    def row(self, i: int) -> tuple[Any, ...]:
        """Prompt ``i``'s scores in field order: what the live cache keeps per prompt."""
        return (
            self.greedy[i],
            self.text[i],
            self.sampled_text[i],
            self.correct[i],
            self.fluency[i],
            self.hint[i],
            self.recorded[i],
            self.sampled[i] if i < len(self.sampled) else [],
        )


def tally(values: Sequence[int], weights: Sequence[float] | None = None) -> int:
    """A prompt's side: the sign of the (weighted) sum of its judges' votes."""
    total = sum(v * w for v, w in zip(values, weights or [1.0] * len(values), strict=True))
    return (total > 1e-12) - (total < -1e-12)


def _best(rows: Iterable[JudgeRow]) -> dict[str, float]:
    """judge_id -> the weight of its row with the most decided verdicts: 0 while the topic
    says it stands flagged, else the log-odds of its consistency (``JudgeRow.weight``)."""
    best: dict[str, tuple[int, float]] = {}
    for r in rows:
        if r.judge_id not in best or r.decided > best[r.judge_id][0]:
            best[r.judge_id] = (r.decided, r.weight)
    return {j: w for j, (_, w) in best.items()}


def judge_weights(cfg: TrainerSettings, live: LiveRows | None = None) -> dict[str, float]:
    """Each gate judge's weight: ``gate_judge_weights``, then the weight of the judge of the
    same id in ``gate_consistency_file``, then its weight now on the consistency topic
    (``live``, with ``gate_consistency_live``); of several versions of a judge, the row with
    the most decided verdicts. A row's weight is ``max(0, log(p / (1 - p)))`` of its
    consistency p, and 0 while the topic says the judge stands flagged: a coin-flip or
    flagged judge carries no weight (``processors/consistency.py``). The ``reward`` judge
    takes the row of ``gate_reward_judge``, the judge behind the rewards."""
    weights = dict(cfg.gate_judge_weights)
    sources = []
    if cfg.gate_consistency_file is not None:
        from pipeline.processors.consistency_file import read_compare_file

        sources.append(_best(read_compare_file(Path(cfg.gate_consistency_file))))
    if live is not None:
        sources.append(_best(live.rows()))
    for best in sources:
        weights.update(best)
        if cfg.gate_reward_judge in best:  # the recorded rewards are that judge's verdicts
            weights["reward"] = best[cfg.gate_reward_judge]
    return weights


def finite(x: float | None) -> bool:
    """A score that can be compared: present and neither NaN nor infinite."""
    return x is not None and math.isfinite(x)


def vote(candidate: float | None, live: float | None, margin: float) -> int:
    """+1 / −1 when one score beats the other by more than ``margin``; 0 otherwise or when a
    score is missing, NaN or infinite (the judge abstains: see :func:`judged`)."""
    if not finite(candidate) or not finite(live):
        return 0
    assert candidate is not None and live is not None
    if candidate > live + margin:
        return 1
    if candidate < live - margin:
        return -1
    return 0


def judged(candidate: float | None, live: float | None) -> bool:
    """Whether a score judge compared two scores (a tie within the margin included), rather
    than abstained on a missing or non-finite one."""
    return finite(candidate) and finite(live)


def _repeats(units: Sequence[Any]) -> bool:
    """One unit (token, word, character) said ``REPEAT_MIN`` or more times, and nothing else."""
    return len(units) >= REPEAT_MIN and len(set(units)) == 1


def _loops(words: Sequence[str]) -> bool:
    """``LOOP_MIN`` or more words of which at most a quarter are distinct ("a b a b a b a b").
    Words only: a long number is a few distinct digit tokens and still an answer."""
    return len(words) >= LOOP_MIN and 4 * len(set(words)) <= len(words)


def answer_defect(text: str, ids: Sequence[int] | None = None) -> str | None:
    """Why an answer answers nothing (None: it is an answer): ``empty``, ``whitespace``,
    ``no words`` (fewer than ``MIN_WORD_CHARS`` letters or digits: "...", "?!"), or
    ``degenerate`` (one token, word or character repeated, or a loop of a few words).
    Model-independent: read from the decoded text, and from the token ids where given."""
    if not text:
        return "empty"
    if not text.strip():
        return "whitespace"
    if len(_WORD_CHAR.findall(text)) < MIN_WORD_CHARS:
        return "no words"
    words = text.split()
    chars = [c for c in text if not c.isspace()]
    if (
        _repeats(list(ids or ()))
        or _repeats(words)
        or _loops(words)
        or (len(words) == 1 and _repeats(chars))
    ):
        return "degenerate"
    return None


def fluency_defect(value: float | None) -> str | None:
    """Why a fluency score is not one (None: it is): missing, NaN or infinite."""
    if value is None:
        return "no fluency"
    if math.isnan(value):
        return "fluency NaN"
    if math.isinf(value):
        return "fluency infinite"
    return None


def relevant(request: str, answer: str) -> float | None:
    """1.0 when ``answer`` is on ``request``'s topic (the ``on_topic`` reader's rule), 0.0
    when it is not, None when there is nothing to check (no request, or no content words)."""
    if not request:
        return None
    reasons = off_topic_reasons(request, answer)
    return None if reasons is None else float(not reasons)


@dataclass(frozen=True)
class Figures:
    """One model's figures on a verdict's prompts, what the budget holds against the
    reference: probe questions answered right (None: no probe), mean fluency, and the share
    of held-out prompts whose sampled answer is on topic (None: none to judge)."""

    probe: int | None
    fluency: float | None
    relevance: float | None


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _say(x: float | None) -> str:
    """A figure in a reason: 4 significant digits, or what it is when it is not one."""
    return str(x) if x is None or not math.isfinite(x) else _fmt(x)


def budget(
    candidate: Figures, reference: Figures, cfg: TrainerSettings
) -> tuple[list[str], dict[str, Any]]:
    """(reasons, figures): the candidate's loss against the fixed reference per metric, each
    within its ``gate_budget_*`` or a reason to reject. The live comparison alone lets a
    small loss pass at every step and add up; this one is cumulative. A figure that is
    missing or not finite on either side is unknown: no check on that metric, said in
    ``gate_budget_unknown`` (a candidate's unmeasured fluency fails in :func:`decide`)."""
    limits: dict[str, float] = {
        "probe": cfg.gate_budget_probe,
        "fluency": cfg.gate_budget_fluency,
        "relevance": cfg.gate_budget_relevance,
    }
    units = {
        "probe": "questions right",
        "fluency": "nats/token",
        "relevance": "share of held-out answers on topic",
    }
    reasons: list[str] = []
    unknown: list[str] = []
    out: dict[str, Any] = {"gate_reference": "base"}
    for name in BUDGETS:
        ref, cand, limit = getattr(reference, name), getattr(candidate, name), limits[name]
        out[f"gate_reference_{name}"] = ref if finite(ref) else None
        out[f"gate_budget_{name}"] = limit
        if not finite(ref) or not finite(cand):
            out[f"gate_budget_{name}_left"] = None
            unknown.append(f"{name}: reference {_say(ref)}, candidate {_say(cand)}: not checked")
            continue
        loss = ref - cand
        left = limit - loss
        out[f"gate_budget_{name}_left"] = round(left, 6)
        if left < -_BUDGET_EPS:
            reasons.append(
                f"{name} {_fmt(cand)} vs reference (base) {_fmt(ref)} {units[name]}: "
                f"lost {_fmt(loss)}, over the budget of {_fmt(limit)} "
                f"(gate_budget_{name})"
            )
    out["gate_budget_unknown"] = unknown
    return reasons, out


def decide(
    votes: Sequence[dict[str, Any]],
    probe_correct: tuple[int, int],
    fluency: tuple[float | None, float | None],
    cfg: TrainerSettings,
    live: LiveRows | None = None,
    *,
    candidate: Figures | None = None,
    reference: Figures | None = None,
) -> tuple[str, dict[str, Any]]:
    """(status, figures) from the votes, the capability checks against the live version and,
    given the ``candidate``'s and the ``reference``'s figures, the budget against the
    reference (see the module docstring): ``rejected`` on any reason, else ``NO_DECISION``
    when fewer than ``gate_min_decided`` of the prompts were decided, else ``promoted``."""
    weights = judge_weights(cfg, live)
    by_prompt: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for v in votes:
        by_prompt.setdefault((v["source"], v["prompt_id"]), []).append(v)
    sides, decided = [], 0
    for vs in by_prompt.values():
        # The validity judge settles its prompt whatever the others say: an answer that
        # answers nothing loses, however the weighted judges split or abstain.
        forced = [int(v["vote"]) for v in vs if v["judge"] == VALIDITY and int(v["vote"])]
        rest = [v for v in vs if v["judge"] != VALIDITY]
        if forced:
            sides.append(min(forced))
        else:
            sides.append(
                tally([int(v["vote"]) for v in rest], [weights.get(v["judge"], 1.0) for v in rest])
            )
        decided += bool(forced) or any(not v.get("abstained", False) for v in rest)
    won, lost = sides.count(1), sides.count(-1)
    reasons = []
    if lost > len(sides) / 2:
        reasons.append(f"live preferred on {lost} of {len(sides)} prompts (candidate on {won})")
    cand_ok, live_ok = probe_correct
    if cand_ok < live_ok - cfg.gate_probe_tolerance:
        reasons.append(
            f"capability probe {cand_ok} correct vs live {live_ok} "
            f"(tolerance {cfg.gate_probe_tolerance})"
        )
    f_c, f_l = fluency
    if not finite(f_c) or not finite(f_l):
        # A fluency that cannot be measured fails the check: skipping it let a candidate that
        # answers nothing (fluency None) or scores NaN through.
        reasons.append(
            f"fluency not measured: candidate {f_c}, live {f_l} nats/token (a failed check)"
        )
    elif f_c is not None and f_l is not None and f_c < f_l - cfg.gate_fluency_tolerance:
        reasons.append(
            f"fluency {f_c:.3f} vs live {f_l:.3f} nats/token "
            f"(tolerance {cfg.gate_fluency_tolerance})"
        )
    spent: dict[str, Any] = {}
    if candidate is not None and reference is not None:
        over, spent = budget(candidate, reference, cfg)
        reasons += over
    need = max(1, math.ceil(cfg.gate_min_decided * len(by_prompt)))
    figures: dict[str, Any] = {
        "gate_prompts": len(by_prompt),
        "gate_won": won,
        "gate_lost": lost,
        "gate_tied": len(sides) - won - lost,
        "gate_decided": decided,
        "gate_min_decided": need,
        "gate_reasons": reasons,
        **spent,
    }
    if weights:
        figures["gate_judge_weights"] = weights
    for judge in JUDGES:
        mine = [int(v["vote"]) for v in votes if v["judge"] == judge]
        if mine:
            figures[f"gate_{judge}_for"] = mine.count(1)
            figures[f"gate_{judge}_against"] = mine.count(-1)
    if reasons:
        return "rejected", figures
    if decided < need:
        # Judges that abstain are no evidence either way: the candidate is neither promoted
        # nor rejected, and stays a candidate (never served).
        figures["gate_no_decision"] = (
            f"{decided} of {len(by_prompt)} prompts decided, fewer than {need} (gate_min_decided)"
        )
        return NO_DECISION, figures
    return "promoted", figures


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def figures_of(
    prompts: Sequence[EvalPrompt],
    correct: Sequence[bool | None],
    fluency: Sequence[float | None],
    on_topic: Sequence[float | None],
) -> Figures:
    """A model's :class:`Figures` from its per-prompt scores on ``prompts``."""
    probe = [bool(c) for p, c in zip(prompts, correct, strict=True) if p.item is not None]
    judged = [t for t in on_topic if t is not None]
    return Figures(
        probe=sum(probe) if probe else None,
        fluency=_mean(fluency),
        relevance=sum(judged) / len(judged) if judged else None,
    )


def scored_figures(prompts: Sequence[EvalPrompt], s: Scored) -> Figures:
    """:func:`figures_of` for fresh answers: relevance read from the sampled answers."""
    texts = [s.sampled_text[i] if i < len(s.sampled_text) else "" for i in range(len(prompts))]
    return figures_of(
        prompts,
        s.correct,
        s.fluency,
        [relevant(p.request, t) for p, t in zip(prompts, texts, strict=True)],
    )


def _reference_key(p: EvalPrompt) -> str:
    """What a cached reference row is valid for: the prompt and, for a probe question, what
    counts as its right answer."""
    item = "" if p.item is None else hashlib.sha256(repr(p.item).encode()).hexdigest()[:12]
    return f"{p.source}:{p.prompt_id}:{item}"


def _request(core: Any, ids: Sequence[int]) -> str:
    """A held-out prompt's request: its last user message (the whole prompt without a ChatML
    user turn), as the ``on_topic`` reader reads a turn's request."""
    markers = getattr(core, "markers", None) or ChatMarkers.from_tokenizer(core.tokenizer)
    user = last_user_ids(ids, markers)
    text = core.tokenizer.decode(list(ids) if user is None else user, skip_special_tokens=True)
    return str(text).strip()


@dataclass(eq=False)
class Gate:
    """Held-out rows, the live (baseline) model, its cached answers, and the evaluation."""

    cfg: TrainerSettings
    rows: deque[dict[str, Any]] = field(init=False, repr=False)
    baseline: Any | None = field(default=None, init=False, repr=False)
    baseline_version: int = field(default=0, init=False)
    seeded_upto: int | None = field(default=None, init=False)
    _live: dict[tuple[int, tuple[str, str, str]], tuple[Any, ...]] = field(
        default_factory=dict, init=False, repr=False
    )
    _base: Any | None = field(default=None, init=False, repr=False)
    llm: Any | None = field(default=None, init=False, repr=False)  # gate_llm.LlmJudge
    _last: tuple[int, list[EvalPrompt], Scored] | None = field(default=None, init=False, repr=False)
    # The base model's per-prompt figures (REFERENCE_FILE), read on first use.
    _reference: dict[str, dict[str, Any]] | None = field(default=None, init=False, repr=False)

    probe_items: tuple[P.ProbeItem, ...] = field(default=(), init=False, repr=False)
    # The consistency topic read live (gate_consistency_live; the trainer starts the reader).
    consistency: LiveRows | None = field(default=None, repr=False)
    # Told (prompts answered, prompts to answer, whose answers) as each prompt's fresh
    # answers end: the trainer's progress line and status (pipeline/trainer/progress.py).
    on_progress: Progress | None = field(default=None, repr=False)
    skipped: str | None = field(default=None, init=False)  # why the last evaluation was None
    _answered: int = field(default=0, init=False, repr=False)
    _to_answer: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.probe_items = (
            P.load_probe(self.cfg.gate_probe_file) if self.cfg.gate_probe_file else P.PROBE
        )
        judge_weights(self.cfg)  # a bad consistency file fails at start, not at a verdict
        # Every held-out turn is kept (a prompt is judged freshly, whatever its reward); the
        # newest distinct prompts are the evaluation set.
        self.rows = deque(maxlen=max(4 * self.cfg.gate_eval_samples, 64))
        if self.cfg.gate_llm_url:
            from pipeline.trainer.gate_llm import LlmJudge

            self.llm = LlmJudge(
                self.cfg.gate_llm_url,
                self.cfg.gate_llm_model,
                timeout_s=self.cfg.gate_llm_timeout_s,
            )

    # ---- state -------------------------------------------------------------------------

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        """Held-out rows, in the canonical order."""
        picked = [r for r in rows if r["status"] == HELD_OUT]
        self.rows.extend(sorted(picked, key=_order))

    def seed(self, core: Any, upto: int) -> None:
        """After a restart: held-out rows of versions <= ``upto`` from Delta, and the live model
        (newest promoted version <= ``upto``, else the base model)."""
        self.rows.clear()
        uri = str(Path(self.cfg.lake_root) / "trajectories")
        if DeltaTable.is_deltatable(uri):
            ds = dataset(uri)
            flt = (
                (pc.field("policy_id") == self.cfg.policy)
                & (pc.field("status") == HELD_OUT)
                & (pc.field("weight_version") <= upto)
            )
            found = ds.to_table(columns=[*_COLUMNS, "status"], filter=flt).to_pylist()
            self.add(found)
        self.baseline, self.baseline_version = None, 0
        for v in reversed(ck.versions(self.cfg.weights_root, self.cfg.policy)):
            d = ck.version_dir(self.cfg.weights_root, self.cfg.policy, v)
            verdict = read_verdict(d) if v <= upto else None
            if verdict is not None and verdict["status"] == "promoted":
                self.baseline = self._load(core, d)
                self.baseline_version = v
                break
        if self.baseline is None:
            self.baseline = self._load(core, None)
        self.seeded_upto = upto

    def live_dir(self) -> Path | None:
        """The live version's folder (None: the base model)."""
        if self.baseline_version == 0:
            return None
        return ck.version_dir(self.cfg.weights_root, self.cfg.policy, self.baseline_version)

    def _load(self, core: Any, directory: Path | None) -> Any:
        return core.load_snapshot(directory)

    def follow(self, core: Any, version: int) -> None:
        """``version`` (0: the base) serves now by an operator's action: it becomes the live
        baseline whatever the verdicts said (the trainer trains on from it)."""
        directory = (
            None
            if version == 0
            else ck.version_dir(self.cfg.weights_root, self.cfg.policy, version)
        )
        self.baseline = self._load(core, directory)
        self.baseline_version = version
        self._live.clear()

    def promote(self, core: Any, version: int) -> None:
        """The candidate (``core.model`` as published) becomes the live version."""
        if self.baseline is not None and type(self.baseline) is type(core.model):
            self.baseline.load_state_dict(core.model.state_dict())
        else:
            self.baseline = copy.deepcopy(core.model).eval().requires_grad_(False)
        self.baseline_version = version
        self._live.clear()
        # The candidate's fresh answers are the new live version's: never computed twice.
        if self._last is not None and self._last[0] == version:
            _, prompts, scored = self._last
            for i, p in enumerate(prompts):
                self._live[(version, p.key)] = scored.row(i)

    # ---- the evaluation set ------------------------------------------------------------

    def prompts(self, core: Any) -> list[EvalPrompt]:
        """The newest distinct held-out prompts (newest first), then the probe."""
        out: list[EvalPrompt] = []
        seen: set[str] = set()
        for row in reversed(self.rows):
            if len(out) >= self.cfg.gate_eval_samples:
                break
            ids = [int(i) for i in row["prompt_token_ids"]]
            pid = prompt_id(ids)
            if pid in seen:
                continue
            seen.add(pid)
            hints = list(row.get("hints") or [])
            out.append(
                EvalPrompt(
                    prompt_id=pid,
                    source="held_out",
                    ids=ids,
                    text=core.tokenizer.decode(ids, skip_special_tokens=True)[-300:],
                    response=[int(i) for i in row["response_token_ids"]],
                    reward=float(row["reward"] or 0.0),
                    hint=hints[0] if hints else None,
                    session_id=row.get("session_id"),
                    request=_request(core, ids),
                )
            )
        if self.cfg.gate_probe:
            count = self.cfg.gate_probe_questions or len(self.probe_items)
            for item in self.probe_items[:count]:
                ids = P.chat_prompt_ids(core.tokenizer, item.question)
                out.append(
                    EvalPrompt(
                        prompt_id=prompt_id(ids),
                        source="probe",
                        ids=ids,
                        text=item.question,
                        item=item,
                    )
                )
        return out

    # ---- rollouts and scores -----------------------------------------------------------

    def _base_model(self, core: Any) -> tuple[Any, Any]:
        """The frozen base for scoring, and the context to use it in (LoRA: adapters off)."""
        import contextlib

        if core.lora:
            return core.model, core.model.disable_adapter()
        if core.reference is not None:
            return core.reference, contextlib.nullcontext()
        if self._base is None:
            self._base = core.load_snapshot(None)
        return self._base, contextlib.nullcontext()

    def _answering(self, wants: Sequence[int], n: int, whose: str) -> Callable[[list[int]], None]:
        """The hook :func:`R.generate` calls as answers end: a prompt is answered once its
        greedy (where wanted) and sampled answers both ended."""
        rows_left = [1] * n
        for i in wants:
            rows_left[i] += 1

        def ended(rows: list[int]) -> None:
            for r in rows:
                i = wants[r] if r < len(wants) else r - len(wants)
                rows_left[i] -= 1
                if rows_left[i] == 0:
                    self._answered += 1
                    if self.on_progress is not None:
                        self.on_progress(
                            self._answered, max(self._to_answer, self._answered), whose
                        )

        return ended

    def _score(
        self, core: Any, model: Any, prompts: Sequence[EvalPrompt], whose: str = "candidate"
    ) -> Scored:
        cfg = self.cfg
        ids = [p.ids for p in prompts]
        kw: dict[str, Any] = {"pad_id": core.pad_id, "device": core.device}
        eos = _eos_ids(core.tokenizer, model)
        n = len(ids)
        # Greedy answers only where a judge reads them (the probe, hinted prompts, the LLM);
        # sampled answers everywhere (fluency). One pass for both.
        wants = [
            i for i, p in enumerate(prompts) if p.item is not None or p.hint or self.llm is not None
        ]
        both = R.generate(
            model,
            [*[ids[i] for i in wants], *ids],
            eos_ids=eos,
            seeds=[0] * len(wants) + [cfg.seed * 7919 + p.seed for p in prompts],
            max_new_tokens=cfg.gate_max_new_tokens,
            temperature=[0.0] * len(wants) + [cfg.gate_temperature] * n,
            on_finished=self._answering(wants, n, whose),
            **kw,
        )
        greedy: list[list[int]] = [[] for _ in prompts]
        for i, answer in zip(wants, both[: len(wants)], strict=True):
            greedy[i] = answer
        sampled = both[len(wants) :]
        recorded_at = [i for i, p in enumerate(prompts) if p.response and p.reward != 0.0]
        recorded: list[float | None] = [None] * len(prompts)
        if recorded_at:
            got = R.mean_logprobs(
                model,
                [ids[i] for i in recorded_at],
                [prompts[i].response for i in recorded_at],
                **kw,
            )
            for i, v in zip(recorded_at, got, strict=True):
                recorded[i] = v
        base, ctx = self._base_model(core)
        hinted_at = [i for i, p in enumerate(prompts) if p.hint and greedy[i]]
        hint: list[float | None] = [None] * len(prompts)
        with ctx:
            fluency = R.mean_logprobs(base, ids, sampled, **kw)
            if hinted_at:
                teach = [
                    teacher_prompt(ids[i], prompts[i].hint or "", core.tokenizer, core.markers)
                    for i in hinted_at
                ]
                answers = [greedy[i] for i in hinted_at]
                with_hint = R.mean_logprobs(base, teach, answers, **kw)
                plain = R.mean_logprobs(base, [ids[i] for i in hinted_at], answers, **kw)
                for i, a, b in zip(hinted_at, with_hint, plain, strict=True):
                    hint[i] = None if a is None or b is None else a - b
        text = [core.tokenizer.decode(g, skip_special_tokens=True) for g in greedy]
        return Scored(
            greedy=greedy,
            text=text,
            sampled_text=[core.tokenizer.decode(s, skip_special_tokens=True) for s in sampled],
            correct=[
                None if p.item is None else P.is_correct(p.item, t)
                for p, t in zip(prompts, text, strict=True)
            ],
            fluency=fluency,
            hint=hint,
            recorded=recorded,
            sampled=[list(a) for a in sampled],
        )

    def _live_scores(self, core: Any, prompts: Sequence[EvalPrompt]) -> Scored:
        """The live version's scores, computed once per (live version, prompt)."""
        missing = [p for p in prompts if (self.baseline_version, p.key) not in self._live]
        if missing:
            got = self._score(core, self.baseline, missing, "live")
            for i, p in enumerate(missing):
                self._live[(self.baseline_version, p.key)] = got.row(i)
        rows = [self._live[(self.baseline_version, p.key)] for p in prompts]
        cols: list[list[Any]] = (
            [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in range(8)]
        )
        return Scored(*cols)

    # ---- the fixed reference: the base model -------------------------------------------

    def reference_path(self) -> Path:
        return ck.policy_dir(self.cfg.weights_root, self.cfg.policy) / REFERENCE_FILE

    def reference_base(self) -> dict[str, Any]:
        """What the cached reference is valid for: the base model and every setting its fresh
        answers and their reading depend on (another one discards the cache)."""
        cfg = self.cfg
        return {
            "model": str(cfg.model),
            "seed": cfg.seed,
            "temperature": cfg.gate_temperature,
            "max_new_tokens": cfg.gate_max_new_tokens,
            "on_topic": OnTopicJudge.version,
        }

    def _reference_rows(self) -> dict[str, dict[str, Any]]:
        if self._reference is None:
            self._reference = {}
            path = self.reference_path()
            try:
                stored = orjson.loads(path.read_bytes()) if path.exists() else {}
            except (OSError, orjson.JSONDecodeError):
                stored = {}  # a damaged cache is recomputed, never a failed verdict
            if isinstance(stored, dict) and stored.get("base") == self.reference_base():
                self._reference = dict(stored.get("rows") or {})
        return self._reference

    def _save_reference(self, keep: set[str]) -> None:
        rows = self._reference_rows()
        over = len(rows) - REFERENCE_ROWS
        for key in [k for k in rows if k not in keep][: max(over, 0)]:
            del rows[key]  # the oldest prompts first: the evaluation set has moved on
        path = self.reference_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(
            path,
            orjson.dumps({"base": self.reference_base(), "rows": rows}, option=orjson.OPT_INDENT_2),
        )

    def reference(self, core: Any, prompts: Sequence[EvalPrompt], live: Scored) -> Figures:
        """The base model's figures on ``prompts``, the fixed reference of the budget: each
        prompt's are computed once (while the base is live, its answers are the live ones)
        and kept in ``REFERENCE_FILE``, so later versions and a restarted trainer reuse them."""
        rows = self._reference_rows()
        keys = [_reference_key(p) for p in prompts]
        missing = [i for i, k in enumerate(keys) if k not in rows]
        if missing:
            if self.baseline_version == 0:
                got, at = live, missing
            else:
                model, ctx = self._base_model(core)
                with ctx:
                    got = self._score(core, model, [prompts[i] for i in missing], "base")
                at = list(range(len(missing)))
            for i, j in zip(missing, at, strict=True):
                p = prompts[i]
                text = got.sampled_text[j] if j < len(got.sampled_text) else ""
                rows[keys[i]] = {
                    "correct": None if p.item is None else bool(got.correct[j]),
                    "fluency": got.fluency[j] if finite(got.fluency[j]) else None,
                    "on_topic": relevant(p.request, text),
                }
            self._save_reference(set(keys))
        got_rows = [rows[k] for k in keys]
        return figures_of(
            prompts,
            [r.get("correct") for r in got_rows],
            [r.get("fluency") for r in got_rows],
            [r.get("on_topic") for r in got_rows],
        )

    # ---- evaluation --------------------------------------------------------------------

    def votes(
        self, prompts: Sequence[EvalPrompt], cand: Scored, live: Scored
    ) -> list[dict[str, Any]]:
        """Every judge's vote on every prompt it applies to; ``abstained`` marks a vote cast
        without two comparable scores (it decides nothing)."""
        cfg = self.cfg
        out: list[dict[str, Any]] = []

        def add(
            i: int,
            judge: str,
            v: int,
            c: float | None,
            li: float | None,
            abstained: bool = False,
            **detail: Any,
        ) -> None:
            p = prompts[i]
            out.append(
                {
                    "prompt_id": p.prompt_id,
                    "source": p.source,
                    "judge": judge,
                    "vote": v,
                    "candidate_score": c if finite(c) else None,
                    "live_score": li if finite(li) else None,
                    "candidate_answer": cand.text[i][:ANSWER_CHARS],
                    "live_answer": live.text[i][:ANSWER_CHARS],
                    "session_id": p.session_id,
                    "abstained": abstained,
                    **({"detail": detail} if detail else {}),
                }
            )

        for i, p in enumerate(prompts):
            wants_greedy = p.item is not None or bool(p.hint) or self.llm is not None
            mine = self.defect(cand, i, wants_greedy, scored=True)
            theirs = self.defect(live, i, wants_greedy, scored=False)
            if mine or theirs:
                # An answer that says nothing loses its prompt (the live version's too: the
                # candidate answered where it did not), whatever the other judges say below.
                add(i, VALIDITY, -1 if mine else 1, None, None, candidate=mine, live=theirs)
            if p.item is not None:
                c, li = float(bool(cand.correct[i])), float(bool(live.correct[i]))
                add(i, "capability", int(c - li), c, li)
            add(
                i,
                "fluency",
                vote(cand.fluency[i], live.fluency[i], cfg.gate_fluency_margin),
                cand.fluency[i],
                live.fluency[i],
                abstained=not judged(cand.fluency[i], live.fluency[i]),
            )
            # Relevance (held-out prompts with content words): the sampled answer on the
            # request's topic or not, by the on_topic reader.
            mine_on = relevant(
                p.request, cand.sampled_text[i] if i < len(cand.sampled_text) else ""
            )
            theirs_on = relevant(
                p.request, live.sampled_text[i] if i < len(live.sampled_text) else ""
            )
            if mine_on is not None or theirs_on is not None:
                add(
                    i,
                    "relevance",
                    vote(mine_on, theirs_on, 0.0),
                    mine_on,
                    theirs_on,
                    abstained=not judged(mine_on, theirs_on),
                )
            if p.hint:
                add(
                    i,
                    "hint",
                    vote(cand.hint[i], live.hint[i], cfg.gate_tolerance),
                    cand.hint[i],
                    live.hint[i],
                    abstained=not judged(cand.hint[i], live.hint[i]),
                )
            if cand.recorded[i] is not None and live.recorded[i] is not None:
                c = p.reward * float(cand.recorded[i] or 0.0)
                li = p.reward * float(live.recorded[i] or 0.0)
                add(
                    i, "reward", vote(c, li, cfg.gate_tolerance), c, li, abstained=not judged(c, li)
                )
            if self.llm is not None:
                said = self.llm.judge(p.text, cand.text[i], live.text[i])
                add(i, "llm", said or 0, None, None, abstained=said is None)
        return out

    @staticmethod
    def defect(s: Scored, i: int, wants_greedy: bool, *, scored: bool) -> str | None:
        """Why prompt ``i``'s answers in ``s`` answer nothing: the sampled answer (every
        prompt has one), the greedy one where a judge reads it, and with ``scored`` its
        fluency (missing, NaN or infinite: an answer the judges cannot score)."""

        def at(xs: Sequence[Any], default: Any) -> Any:
            return xs[i] if i < len(xs) else default

        sampled = answer_defect(at(s.sampled_text, ""), at(s.sampled, None) or None)
        if sampled:
            return f"sampled answer: {sampled}"
        if wants_greedy:
            greedy = answer_defect(at(s.text, ""), at(s.greedy, None) or None)
            if greedy:
                return f"greedy answer: {greedy}"
        if scored:
            bad = fluency_defect(at(s.fluency, None))
            if bad:
                return bad
        return None

    def to_answer(self, prompts: Sequence[EvalPrompt]) -> int:
        """Prompts an evaluation of ``prompts`` answers freshly: the live version's not
        cached yet, every one by the candidate, and the base's not in the reference yet
        (while the base is live its answers are the live ones)."""
        live = sum((self.baseline_version, p.key) not in self._live for p in prompts)
        base = 0
        if self.baseline_version != 0:
            rows = self._reference_rows()
            base = sum(_reference_key(p) not in rows for p in prompts)
        return live + len(prompts) + base

    def evaluate(self, core: Any, version: int) -> dict[str, Any] | None:
        """Verdict for ``core.model`` as version ``version`` (None: too few held-out prompts
        and no probe to judge on)."""
        started = time.perf_counter()
        prompts = self.prompts(core)
        held = sum(p.source == "held_out" for p in prompts)
        self.skipped = None
        if held < self.cfg.gate_min_samples or not prompts:
            self.skipped = (
                f"{held} held-out prompt(s), fewer than gate_min_samples "
                f"({self.cfg.gate_min_samples}): stays a candidate"
            )
            return None
        assert self.baseline is not None
        self._answered, self._to_answer = 0, self.to_answer(prompts)
        live = self._live_scores(core, prompts)
        cand = self._score(core, core.model, prompts)
        self._last = (version, prompts, cand)
        votes = self.votes(prompts, cand, live)
        probe_at = [i for i, p in enumerate(prompts) if p.item is not None]
        probe = (
            sum(bool(cand.correct[i]) for i in probe_at),
            sum(bool(live.correct[i]) for i in probe_at),
        )
        fluency = (_mean(cand.fluency), _mean(live.fluency))
        reference = self.reference(core, prompts, live)
        mine, theirs = scored_figures(prompts, cand), scored_figures(prompts, live)
        status, figures = decide(
            votes, probe, fluency, self.cfg, self.consistency, candidate=mine, reference=reference
        )
        return {
            "status": status,
            "votes": votes,
            "metrics": {
                **figures,
                "gate_live_version": self.baseline_version,
                "gate_held_out_prompts": held,
                "gate_probe_n": len(probe_at),
                "gate_probe_correct": probe[0],
                "gate_live_probe_correct": probe[1],
                "gate_fluency": fluency[0],
                "gate_live_fluency": fluency[1],
                "gate_relevance": mine.relevance,
                "gate_live_relevance": theirs.relevance,
                "gate_tolerance": self.cfg.gate_tolerance,
                "gate_eval_s": round(time.perf_counter() - started, 3),
                "gate_metric": "fresh rollouts, judges' votes per prompt",
            },
        }


def verdict_line(version: int, verdict: dict[str, Any]) -> str:
    """A verdict for the log: its status, votes, probe and fluency against the live version,
    the time it took, and the reasons of a rejection or of no decision."""
    m = verdict.get("metrics", {})

    def num(key: str) -> str:
        x = m.get(key)
        return f"{x:.2f}" if isinstance(x, int | float) and math.isfinite(x) else "?"

    line = (
        f"gate v{version}: {verdict['status']} against live v{m.get('gate_live_version', 0)}"
        f" ({m.get('gate_won', 0)} won, {m.get('gate_lost', 0)} lost, "
        f"{m.get('gate_tied', 0)} tied of {m.get('gate_prompts', 0)} prompts; probe "
        f"{m.get('gate_probe_correct', '?')}/{m.get('gate_probe_n', '?')} vs "
        f"{m.get('gate_live_probe_correct', '?')}; fluency {num('gate_fluency')} vs "
        f"{num('gate_live_fluency')}) in {num('gate_eval_s')} s"
    )
    reasons = list(m.get("gate_reasons") or [])
    if m.get("gate_no_decision"):
        reasons.append(str(m["gate_no_decision"]))
    return line + (": " + "; ".join(reasons) if reasons else "")


def _eos_ids(tokenizer: Any, model: Any) -> list[int]:
    """Token ids that end an answer: the tokenizer's EOS, the chat template's end of turn, and
    the model's generation config's."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    end = tokenizer.get_vocab().get("<|im_end|>")
    if end is not None:
        ids.add(int(end))
    gen = getattr(model, "generation_config", None)
    cfg_eos = getattr(gen, "eos_token_id", None)
    if isinstance(cfg_eos, int):
        ids.add(cfg_eos)
    elif isinstance(cfg_eos, list):
        ids.update(int(e) for e in cfg_eos)
    return sorted(ids)
