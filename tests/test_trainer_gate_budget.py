"""The promotion gate's cumulative budget against the base model (issue 38 item 4) and its
relevance judge, without a model: every side's fresh answers and scores are fixed by hand.

Each check of the gate compares a candidate with the live version, so a chain of candidates
that each lose a little within the per-step tolerance was promoted without bound. The chain
tests below promote such candidates until their loss against the base exceeds the budget and
assert which version is the first rejected, and why."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from transformers import AutoTokenizer

from pipeline.models.tiny import ensure_tiny_model
from pipeline.sim import probe as P
from pipeline.trainer import checkpoint as ck
from pipeline.trainer import gate as G
from pipeline.trainer.config import TrainerSettings

# Four held-out requests and an answer on each one's topic (content words mentioned, and
# words of its own), and one answer on none of their topics.
ON_TOPIC = {
    "How can I drink more water during the day?": (
        "Keep a water bottle on your desk and refill it often."
    ),
    "Give me a tip for sleeping better.": (
        "Keep a fixed bedtime and a dark, cool room for sleeping."
    ),
    "What is a good way to start running?": "Start running slowly, with short easy jogs.",
    "How do I keep houseplants alive?": "Water houseplants when the soil is dry; give them light.",
}
OFF_TOPIC = "Paris is the capital of France."
PROBE_ANSWER = "It is seven, I think."  # greedy and sampled answer to every probe question


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def settings(tiny: Path, tmp_path: Path, **kw: Any) -> TrainerSettings:
    base: dict[str, Any] = dict(
        policy="p",
        model=str(tiny),
        weights_root=tmp_path / "w",
        lake_root=tmp_path / "lake",
        input_topic="in",
        device="cpu",
        gate=True,
        method="rl",
    )
    return TrainerSettings(**{**base, **kw})


def test_relevance_reads_the_on_topic_rule() -> None:
    for request, answer in ON_TOPIC.items():
        assert G.relevant(request, answer) == 1.0
        assert G.relevant(request, OFF_TOPIC) == 0.0
    assert G.relevant("", OFF_TOPIC) is None  # a probe question: no request to hold it to
    assert G.relevant("Hi!", OFF_TOPIC) is None  # no content words: nothing to check
    assert (
        G.relevant("How can I drink more water during the day?", "water water water water") == 0.0
    )  # degenerate: no substance


# ---- the budget by hand ------------------------------------------------------------------------


def test_budget_edges_by_hand(tiny: Path, tmp_path: Path) -> None:
    cfg = settings(
        tiny, tmp_path, gate_budget_probe=2, gate_budget_fluency=0.3, gate_budget_relevance=0.25
    )
    ref = G.Figures(probe=6, fluency=-1.0, relevance=0.75)
    # exactly at every budget: 6 - 4 = 2 questions, -1.0 - -1.3 = 0.30000000000000004 in
    # floats (0.3 exactly), 0.75 - 0.5 = 0.25: passes, nothing left
    reasons, fig = G.budget(G.Figures(4, -1.3, 0.5), ref, cfg)
    assert reasons == [] and fig["gate_budget_unknown"] == []
    assert (fig["gate_budget_probe_left"], fig["gate_budget_relevance_left"]) == (0, 0.0)
    assert fig["gate_budget_fluency_left"] == pytest.approx(0.0, abs=1e-9)
    assert (
        fig["gate_reference_probe"],
        fig["gate_reference_fluency"],
        fig["gate_reference_relevance"],
        fig["gate_reference"],
    ) == (6, -1.0, 0.75, "base")
    assert (fig["gate_budget_probe"], fig["gate_budget_fluency"], fig["gate_budget_relevance"]) == (
        2,
        0.3,
        0.25,
    )
    # just over each one
    reasons, fig = G.budget(G.Figures(3, -1.31, 0.49), ref, cfg)
    assert reasons == [
        "probe 3 vs reference (base) 6 questions right: lost 3, over the budget of 2 "
        "(gate_budget_probe)",
        "fluency -1.31 vs reference (base) -1 nats/token: lost 0.31, over the budget of 0.3 "
        "(gate_budget_fluency)",
        "relevance 0.49 vs reference (base) 0.75 share of held-out answers on topic: lost "
        "0.26, over the budget of 0.25 (gate_budget_relevance)",
    ]
    assert (
        fig["gate_budget_probe_left"],
        fig["gate_budget_fluency_left"],
        fig["gate_budget_relevance_left"],
    ) == (-1, -0.01, -0.01)
    # better than the base: more than the whole budget left
    reasons, fig = G.budget(G.Figures(8, -0.9, 1.0), ref, cfg)
    assert reasons == [] and (
        fig["gate_budget_probe_left"],
        fig["gate_budget_fluency_left"],
        fig["gate_budget_relevance_left"],
    ) == (4, 0.4, 0.5)


def test_the_budget_rejects_whatever_the_live_comparison_says(tiny: Path, tmp_path: Path) -> None:
    cfg = settings(tiny, tmp_path, gate_budget_fluency=0.5)
    tie = [{"prompt_id": "a", "source": "held_out", "judge": "fluency", "vote": 0}]
    # the same as live on every check, 0.6 nats/token below the base: rejected
    status, fig = G.decide(
        tie,
        (4, 4),
        (-1.6, -1.6),
        cfg,
        candidate=G.Figures(4, -1.6, 1.0),
        reference=G.Figures(4, -1.0, 1.0),
    )
    assert status == "rejected" and fig["gate_reasons"] == [
        "fluency -1.6 vs reference (base) -1 nats/token: lost 0.6, over the budget of 0.5 "
        "(gate_budget_fluency)"
    ]
    assert fig["gate_budget_fluency_left"] == pytest.approx(-0.1)
    # without a reference the verdict is the live comparison's, as before
    assert G.decide(tie, (4, 4), (-1.6, -1.6), cfg)[0] == "promoted"


@pytest.mark.parametrize("unknown", [None, float("nan"), float("inf")])
def test_an_unknown_reference_figure_is_not_checked(
    tiny: Path, tmp_path: Path, unknown: float | None
) -> None:
    cfg = settings(tiny, tmp_path)
    tie = [{"prompt_id": "a", "source": "held_out", "judge": "fluency", "vote": 0}]
    # far below any budget on every metric, but nothing known to hold it against
    status, fig = G.decide(
        tie,
        (0, 0),
        (-5.0, -5.0),
        cfg,
        candidate=G.Figures(0, -5.0, 0.0),
        reference=G.Figures(None, unknown, unknown),
    )
    assert status == "promoted" and fig["gate_reasons"] == []
    assert [u.split(":")[0] for u in fig["gate_budget_unknown"]] == [
        "probe",
        "fluency",
        "relevance",
    ]
    assert all(u.endswith("not checked") for u in fig["gate_budget_unknown"])
    for name in G.BUDGETS:
        assert fig[f"gate_reference_{name}"] is None and fig[f"gate_budget_{name}_left"] is None
    orjson.dumps(fig)  # the verdict file takes it as it is
    # one unknown metric leaves the others checked
    status, fig = G.decide(
        tie,
        (0, 0),
        (-5.0, -5.0),
        cfg,
        candidate=G.Figures(0, -5.0, 0.0),
        reference=G.Figures(None, unknown, 1.0),
    )
    assert status == "rejected" and len(fig["gate_reasons"]) == 1
    assert fig["gate_reasons"][0].startswith("relevance 0 vs reference (base) 1")


# ---- the gate without a model ------------------------------------------------------------------


class Fake:
    """Stands in for a model: ``promote`` copies the candidate's state into the live one."""

    def __init__(self, name: str) -> None:
        self.name = name

    def state_dict(self) -> dict[str, str]:
        return {"name": self.name}

    def load_state_dict(self, state: dict[str, str]) -> None:
        self.name = state["name"]


def answers(prompts: list[G.EvalPrompt], *, fluency: float, right: int, off_topic: int) -> G.Scored:
    """Fixed answers: the first ``right`` probe questions right, the first ``off_topic``
    held-out prompts answered off topic (the rest on topic), ``fluency`` everywhere."""
    held = [i for i, p in enumerate(prompts) if p.source == "held_out"]
    probe = [i for i, p in enumerate(prompts) if p.item is not None]
    text = [
        PROBE_ANSWER
        if p.item is not None
        else OFF_TOPIC
        if held.index(i) < off_topic
        else ON_TOPIC[p.request]
        for i, p in enumerate(prompts)
    ]
    n = len(prompts)
    return G.Scored(
        greedy=[[] for _ in prompts],
        text=text,
        sampled_text=text,
        correct=[None if p.item is None else i in probe[:right] for i, p in enumerate(prompts)],
        fluency=[fluency] * n,
        hint=[None] * n,
        recorded=[None] * n,
    )


class Harness:
    """A gate on the 4 held-out requests and the first 8 probe questions whose models are
    :class:`Fake`; ``figures[name]`` are each model's (fluency, probe right, off topic)."""

    def __init__(self, tiny: Path, tmp_path: Path, **kw: Any) -> None:
        self.cfg = settings(tiny, tmp_path, **kw)
        self.tok = AutoTokenizer.from_pretrained(tiny)
        self.figures: dict[str, tuple[float, int, int]] = {}
        self.scored: list[tuple[str, int]] = []  # (model, prompts) of every _score call
        self.gate = self.new_gate()
        self.gate.add(
            [
                {
                    "status": "held_out",
                    "prompt_token_ids": P.chat_prompt_ids(self.tok, q),
                    "reward": 0.0,
                    "response_token_ids": [70, 80],
                    "hints": [],
                    "session_id": f"s{k}",
                    "weight_version": 0,
                    "step": k,
                    "source_partition": 0,
                    "source_offset": k,
                }
                for k, q in enumerate(ON_TOPIC)
            ]
        )
        self.gate.baseline = Fake("base")

    def new_gate(self) -> G.Gate:
        gate = G.Gate(self.cfg)

        def score(
            _core: Any, model: Fake, ps: list[G.EvalPrompt], _whose: str = "candidate"
        ) -> G.Scored:
            self.scored.append((model.name, len(ps)))
            f, right, off = self.figures[model.name]
            return answers(ps, fluency=f, right=right, off_topic=off)

        gate._score = score  # type: ignore[method-assign]
        gate._base_model = lambda _core: (Fake("base"), contextlib.nullcontext())  # type: ignore[method-assign]
        return gate

    def judge(self, version: int, fluency: float, right: int, off_topic: int) -> dict[str, Any]:
        """Version ``version``'s verdict; promoted, it becomes the live version."""
        name = f"v{version}"
        self.figures[name] = (fluency, right, off_topic)
        core = SimpleNamespace(tokenizer=self.tok, model=Fake(name))
        out = self.gate.evaluate(core, version)
        assert out is not None and out["metrics"]["gate_prompts"] == 12
        if out["status"] == "promoted":
            self.gate.promote(core, version)
        return out


# Base: fluency -1.0, 6 of 8 probe questions right, every held-out answer on topic. Each
# candidate loses a little against the one before (within the per-step tolerance, and a tie
# or one lost prompt of 12 in the votes); the budget allows two such steps.
CHAINS = {
    # metric: (settings, the chain's (fluency, probe right, off topic) per version)
    "fluency": (
        {"gate_fluency_tolerance": 0.3, "gate_budget_fluency": 0.5},
        [(-1.25, 6, 0), (-1.5, 6, 0), (-1.75, 6, 0)],
    ),
    "probe": (
        {"gate_probe_tolerance": 1, "gate_budget_probe": 2},
        [(-1.0, 5, 0), (-1.0, 4, 0), (-1.0, 3, 0)],
    ),
    "relevance": ({"gate_budget_relevance": 0.5}, [(-1.0, 6, 1), (-1.0, 6, 2), (-1.0, 6, 3)]),
}
BASE = (-1.0, 6, 0)


@pytest.mark.parametrize("metric", list(CHAINS))
def test_a_chain_of_small_losses_stops_when_the_budget_is_spent(
    tiny: Path, tmp_path: Path, metric: str
) -> None:
    kw, chain = CHAINS[metric]
    h = Harness(tiny, tmp_path, **kw)
    h.figures["base"] = BASE
    verdicts = [h.judge(v, *figs) for v, figs in enumerate(chain, start=1)]
    assert [v["status"] for v in verdicts] == ["promoted", "promoted", "rejected"]
    # v1 and v2 spend half the budget each (v2 exactly all of it, which passes) ...
    left = [v["metrics"][f"gate_budget_{metric}_left"] for v in verdicts]
    budget = verdicts[0]["metrics"][f"gate_budget_{metric}"]
    assert left == [budget / 2, 0, -budget / 2]
    assert verdicts[1]["metrics"]["gate_reasons"] == []
    # ... and v3, within tolerance against the live v2, is rejected by the budget alone
    m = verdicts[2]["metrics"]
    assert m["gate_live_version"] == 2 and h.gate.baseline_version == 2
    want = {
        "fluency": "fluency -1.75 vs reference (base) -1 nats/token: lost 0.75, over the budget "
        "of 0.5 (gate_budget_fluency)",
        "probe": "probe 3 vs reference (base) 6 questions right: lost 3, over the budget of 2 "
        "(gate_budget_probe)",
        "relevance": "relevance 0.25 vs reference (base) 1 share of held-out answers on topic: "
        "lost 0.75, over the budget of 0.5 (gate_budget_relevance)",
    }
    assert m["gate_reasons"] == [want[metric]]
    assert m["gate_lost"] <= 1  # one prompt of 12 against it at most: no majority
    assert (
        m["gate_reference_probe"],
        m["gate_reference_fluency"],
        m["gate_reference_relevance"],
    ) == (6, -1.0, 1.0)
    # The base was scored once, as the first live version; later versions read the reference
    # from the cache and the live answers from the promoted candidate's.
    assert h.scored == [("base", 12), ("v1", 12), ("v2", 12), ("v3", 12)]
    # A next candidate that recovers to v2's level is promoted again: the budget is held
    # against the base, not spent for good.
    assert h.judge(4, *chain[1])["status"] == "promoted"


def test_the_issue_chain_with_the_default_budgets(tiny: Path, tmp_path: Path) -> None:
    """The issue's drift at the default settings: each step 0.25 nats/token less fluent (a
    tie within the 0.5 margin, within the 1.0 tolerance) and one more answer off topic (one
    prompt of 12 lost). The relevance budget (0.25: one answer) stops v2, the fluency budget
    (0.4) would have stopped v2 as well."""
    h = Harness(tiny, tmp_path)
    h.figures["base"] = BASE
    first = h.judge(1, -1.25, 6, 1)
    second = h.judge(2, -1.5, 6, 2)
    assert (first["status"], second["status"]) == ("promoted", "rejected")
    assert second["metrics"]["gate_reasons"] == [
        "fluency -1.5 vs reference (base) -1 nats/token: lost 0.5, over the budget of 0.4 "
        "(gate_budget_fluency)",
        "relevance 0.5 vs reference (base) 1 share of held-out answers on topic: lost 0.5, "
        "over the budget of 0.25 (gate_budget_relevance)",
    ]
    # the relevance judge voted against v2 on the one prompt v1 answered on topic and v2 not
    rel = [v for v in second["votes"] if v["judge"] == "relevance"]
    assert len(rel) == 4 and sorted(v["vote"] for v in rel) == [-1, 0, 0, 0]
    assert (second["metrics"]["gate_relevance"], second["metrics"]["gate_live_relevance"]) == (
        0.5,
        0.75,
    )
    assert (
        second["metrics"]["gate_relevance_for"],
        second["metrics"]["gate_relevance_against"],
    ) == (0, 1)


def test_relevance_votes_per_held_out_prompt(tiny: Path, tmp_path: Path) -> None:
    h = Harness(tiny, tmp_path)
    prompts = h.gate.prompts(SimpleNamespace(tokenizer=h.tok))
    held = [p for p in prompts if p.source == "held_out"]
    assert sorted(p.request for p in held) == sorted(ON_TOPIC)  # the last user message
    cand = answers(prompts, fluency=-1.0, right=0, off_topic=1)  # held[0] off topic
    live = answers(prompts, fluency=-1.0, right=0, off_topic=0)
    live.sampled_text[prompts.index(held[3])] = OFF_TOPIC  # live off topic on held[3]
    votes = [v for v in h.gate.votes(prompts, cand, live) if v["judge"] == "relevance"]
    by = {v["prompt_id"]: (v["vote"], v["candidate_score"], v["live_score"]) for v in votes}
    assert [by[p.prompt_id] for p in held] == [
        (-1, 0.0, 1.0),
        (0, 1.0, 1.0),
        (0, 1.0, 1.0),
        (1, 1.0, 0.0),
    ]
    assert not any(v["abstained"] for v in votes)  # ties are decisions
    assert all(v["source"] == "held_out" for v in votes)  # the probe has no request to read


def test_the_reference_is_cached_in_the_policy_folder(tiny: Path, tmp_path: Path) -> None:
    h = Harness(tiny, tmp_path)
    h.figures["base"] = BASE
    assert h.judge(1, -1.1, 6, 0)["status"] == "promoted"
    path = ck.policy_dir(h.cfg.weights_root, "p") / G.REFERENCE_FILE
    stored = orjson.loads(path.read_bytes())
    assert stored["base"] == h.gate.reference_base() and len(stored["rows"]) == 12
    # A restarted trainer (v1 live) reads it: the base is not scored again ...
    gate = h.new_gate()
    gate.baseline, gate.baseline_version = Fake("v1"), 1
    gate.rows = h.gate.rows
    h.gate, h.scored = gate, []
    h.figures["v1"] = (-1.1, 6, 0)
    out = h.judge(2, -1.2, 6, 0)
    assert out["status"] == "promoted" and out["metrics"]["gate_reference_fluency"] == -1.0
    assert h.scored == [("v1", 12), ("v2", 12)]
    # ... only a prompt it has not seen (the newest held-out request replaces the oldest)
    h.gate.add(
        [
            {
                "status": "held_out",
                "reward": 0.0,
                "response_token_ids": [70, 80],
                "prompt_token_ids": P.chat_prompt_ids(h.tok, "Which bread keeps fresh longest?"),
                "hints": [],
                "session_id": "s9",
                "weight_version": 2,
                "step": 9,
                "source_partition": 0,
                "source_offset": 9,
            }
        ]
    )
    ON_TOPIC["Which bread keeps fresh longest?"] = "Sourdough bread keeps fresh for days."
    try:
        h.scored = []
        assert h.judge(3, -1.2, 6, 0)["status"] == "promoted"
    finally:
        del ON_TOPIC["Which bread keeps fresh longest?"]
    assert h.scored == [("v2", 1), ("v3", 12), ("base", 1)]
    assert len(orjson.loads(path.read_bytes())["rows"]) == 13
    # another base setting (the sampling temperature) or a damaged file: computed again
    assert G.Gate(h.cfg)._reference_rows() != {}
    assert G.Gate(h.cfg.model_copy(update={"gate_temperature": 0.9}))._reference_rows() == {}
    path.write_bytes(b"{not json")
    assert G.Gate(h.cfg)._reference_rows() == {}


def test_unknown_reference_fluency_in_the_cache_is_said_in_the_verdict(
    tiny: Path, tmp_path: Path
) -> None:
    """A base whose fluency could not be measured (a reference row without one): the fluency
    budget is not checked, the verdict says so, and the other budgets still are."""
    h = Harness(tiny, tmp_path)
    h.figures["base"] = BASE
    assert h.judge(1, -1.0, 6, 0)["status"] == "promoted"
    rows = h.gate._reference_rows()
    for row in rows.values():
        row["fluency"] = None
    h.gate._save_reference(set(rows))
    # 0.45 nats/token below the base: over the default budget of 0.4, were the base's known
    # (a tie within the 0.5 margin against the live v1, within the tolerance of 1.0)
    out = h.judge(2, -1.45, 6, 0)
    m = out["metrics"]
    assert out["status"] == "promoted" and m["gate_reasons"] == []
    assert m["gate_reference_fluency"] is None and m["gate_budget_fluency_left"] is None
    assert m["gate_budget_unknown"] == ["fluency: reference None, candidate -1.45: not checked"]
    assert (m["gate_budget_probe_left"], m["gate_budget_relevance_left"]) == (1, 0.25)
    (tmp_path / "v2" / ck.TRAINER_DIR).mkdir(parents=True)
    G.write_verdict(tmp_path / "v2", out)
    assert G.read_verdict(tmp_path / "v2") == orjson.loads(orjson.dumps(out))
