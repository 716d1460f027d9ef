"""Promotion gate: held-out split, votes and verdicts by hand, the LLM judge against a fake
server, fresh rollouts, a candidate that improves the task promoted and one that breaks the
capability probe rejected (with its votes as events and Delta rows, exactly once), rollback to
the live version after a rejection, and exactly-once verdicts across a crash between candidate
and verdict (in-process, real Delta, a recording producer instead of Kafka). The real-broker
path (a rejected version never served) is tests/test_trainer_gate_broker.py."""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from deltalake import DeltaTable

from pipeline.events import Producer, Sample, WeightsPublished
from pipeline.kafka import Record, names
from pipeline.models.tiny import ensure_tiny_model
from pipeline.trainer import checkpoint as ck
from pipeline.trainer import gate as G
from pipeline.trainer import losses as L
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.core import TrainerCore
from pipeline.trainer.publish import Publisher, step_row, trajectory_rows
from pipeline.trainer.scoring import is_held_out

from .test_trainer_learning import digit_ids, prompt_ids, reward


class Crash(Exception):
    pass


class Recorder:
    """Stands in for the Kafka producer; keeps every send (a retry may send again)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    def send(self, topic: str, event: Any, key: Any = None) -> None:
        self.sent.append((topic, event))

    def flush(self) -> None:
        pass

    def weights(self, version: int) -> list[WeightsPublished]:
        return [e for t, e in self.sent if t == names.WEIGHTS and e.version == version]


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
        method="rl",  # the toy task has no hints
    )
    return TrainerSettings(**{**base, **kw})


def table(cfg: TrainerSettings, name: str) -> list[dict]:  # type: ignore[type-arg]
    return DeltaTable(str(cfg.lake_root / name)).to_pyarrow_table().to_pylist()


def publish(
    cfg: TrainerSettings,
    core: TrainerCore,
    pub: Publisher,
    version: int,
    batches: list[list[Record]],
) -> ck.Manifest:
    traj, steps = [], []
    for recs in batches:
        result = core.train_step([r.event for r in recs], version - 1)  # type: ignore[misc]
        traj += trajectory_rows(recs, result, core.tokenizer)
        steps.append(step_row(cfg, result, {0: recs[-1].offset + 1}, 1))
    return pub.publish(
        core,
        version=version,
        parent=version - 1 or None,
        offsets={0: batches[-1][-1].offset + 1},
        trajectories=traj,
        steps=steps,
        created_ms=7,
    )


def test_holdout_split_is_deterministic_and_sized() -> None:
    ids = [f"sample-{i}" for i in range(20_000)]
    held = [is_held_out(i, 0.1) for i in ids]
    assert held == [is_held_out(i, 0.1) for i in ids]
    assert 0.09 < sum(held) / len(ids) < 0.11
    assert not any(is_held_out(i, 0.0) for i in ids[:1000])


def test_held_out_samples_are_never_trained(tiny: Path, tmp_path: Path) -> None:
    cfg = settings(tiny, tmp_path, gate_holdout=0.5, lr=1e-1)
    core = TrainerCore.load(cfg)
    ids = [f"h{i}" for i in range(200) if is_held_out(f"h{i}", 0.5)][:4]
    batch = [
        Sample(
            event_id=i,
            producer=Producer(component="t", version="0"),
            session_id="x",
            turn=0,
            policy_id="p",
            prompt_token_ids=[1, 50, 2],
            response_token_ids=[70, 80],
            loss_mask=[1, 1],
            behavior_logprobs=[-5.0, -5.0],
            reward=1.0,
            behavior_weight_version=0,
        )
        for i in ids
    ]
    before = [p.detach().clone() for p in core.model.parameters()]
    result = core.train_step(batch, 0)
    assert [o.status for o in result.outcomes] == ["held_out"] * 4
    assert result.trained_tokens == 0
    assert all(a.equal(b) for a, b in zip(before, core.model.parameters(), strict=True))


def toy_batches(
    core: TrainerCore, n: int, start: int, rng: random.Random, *, invert: bool = False
) -> list[list[Record]]:
    """Recorded turns of the count-to-five task: half answer with number tokens (reward +1),
    half with other tokens (reward -1); behavior log-probs are the current policy's. With
    ``invert`` the samples the trainer learns from carry the negated reward (a broken reward
    model); held-out samples keep the true one, as recorded turns would."""
    digits = sorted(digit_ids(core.tokenizer))
    others = [i for i in range(10, core.vocab_size) if i not in set(digits)]
    prompt = prompt_ids(core.tokenizer)
    out, offset = [], start
    for _ in range(n):
        responses = [
            [rng.choice(digits if k % 2 == 0 else others) for _ in range(4)] for k in range(16)
        ]
        with torch.no_grad():
            logits = core._response_logits(core.model, [prompt] * 16, responses)
            logps = L.token_logprobs(logits, torch.tensor(responses)).tolist()
        recs = []
        for r, lp in zip(responses, logps, strict=True):
            eid = f"toy-{offset}"
            true = reward(r, set(digits))
            flip = invert and not is_held_out(eid, core.cfg.gate_holdout)
            s = Sample(
                event_id=eid,
                producer=Producer(component="t", version="0"),
                session_id=f"s{offset}",
                turn=0,
                policy_id="p",
                prompt_token_ids=prompt,
                response_token_ids=r,
                loss_mask=[1] * len(r),
                behavior_logprobs=lp,
                reward=-true if flip else true,
                behavior_weight_version=0,
            )
            recs.append(Record("in", 0, offset, None, 0, s))
            offset += 1
        out.append(recs)
    return out


def digit_probe(tmp_path: Path) -> Path:
    """A probe of the toy task: any digit in the answer is right (base: whitespace)."""
    path = tmp_path / "probe.jsonl"
    path.write_text(json.dumps({"question": "Count from one to five:", "pattern": "[0-9]"}) + "\n")
    return path


def test_votes_and_verdict_by_hand(tiny: Path, tmp_path: Path) -> None:
    cfg = settings(tiny, tmp_path, gate_probe_tolerance=1, gate_fluency_tolerance=0.3)
    assert (G.vote(1.0, 0.5, 0.1), G.vote(0.5, 1.0, 0.1), G.vote(1.0, 0.95, 0.1)) == (1, -1, 0)
    assert G.vote(None, 1.0, 0.0) == 0  # a missing score abstains
    assert (G.tally([1, 0]), G.tally([-1, -1, 1]), G.tally([0, 0]), G.tally([1, -1])) == (
        1,
        -1,
        0,
        0,
    )

    def v(pid: str, vote: int, judge: str = "fluency", source: str = "held_out") -> dict:  # type: ignore[type-arg]
        return {"prompt_id": pid, "vote": vote, "judge": judge, "source": source}

    votes = [
        v("a", 1),
        v("a", 0, "hint"),
        v("b", -1),
        v("b", -1, "reward"),
        v("b", 1, "hint"),
        v("c", 0),
        v("a", 1, "capability", "probe"),
    ]
    # a: +1, b: -1, c: 0, (probe, a): +1 -> won 2, lost 1, tied 1: promoted
    status, fig = G.decide(votes, (12, 12), (-1.0, -1.1), cfg)
    assert status == "promoted" and (fig["gate_won"], fig["gate_lost"], fig["gate_tied"]) == (
        2,
        1,
        1,
    )
    assert (fig["gate_fluency_for"], fig["gate_fluency_against"]) == (1, 1)
    assert (fig["gate_hint_for"], fig["gate_reward_against"]) == (1, 1)
    # a majority against rejects: b and d against, a for
    ok = (-1.0, -1.0)  # fluency measured on both sides, equal
    status, fig = G.decide([v("a", 1), v("b", -1), v("d", -1)], (12, 12), ok, cfg)
    assert status == "rejected" and fig["gate_reasons"] == [
        "live preferred on 2 of 3 prompts (candidate on 1)"
    ]
    # ... of all prompts: lost 2, won 0, tied 3 is no majority against (the ties are decided:
    # real ties, not abstentions)
    five = [v("a", -1), v("b", -1), v("c", 0), v("d", 0), v("e", 0)]
    assert G.decide(five, (12, 12), ok, cfg)[0] == "promoted"
    one = [v("a", 0)]  # one decided (tied) prompt: the vetoes below decide
    # capability: one question fewer is within the tolerance of 1, two are not
    assert G.decide(one, (11, 12), ok, cfg)[0] == "promoted"
    status, fig = G.decide(one, (10, 12), ok, cfg)
    assert (
        status == "rejected" and "capability probe 10 correct vs live 12" in fig["gate_reasons"][0]
    )
    # fluency: 0.3 nats per token below live is the limit
    assert G.decide(one, (12, 12), (-1.29, -1.0), cfg)[0] == "promoted"
    assert G.decide(one, (12, 12), (-1.31, -1.0), cfg)[0] == "rejected"


class FakeJudge(BaseHTTPRequestHandler):
    replies: list[str] = []
    seen: list[dict] = []  # type: ignore[type-arg]

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeJudge.seen.append(body)
        text = FakeJudge.replies.pop(0)
        out = json.dumps({"choices": [{"message": {"content": text}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


def test_llm_judge_votes_through_an_openai_compatible_server() -> None:
    from pipeline.trainer.gate_llm import LlmJudge

    server = HTTPServer(("127.0.0.1", 0), FakeJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        judge = LlmJudge(f"http://127.0.0.1:{server.server_port}/v1", "m", timeout_s=5)
        # Which side is "A" depends on the question's hash; the vote follows the candidate.
        q = "What is the capital of France?"
        flip = __import__("hashlib").sha256(q.encode()).digest()[0] & 1 == 1
        cand_letter = "B" if flip else "A"
        live_letter = "A" if flip else "B"
        FakeJudge.replies = [cand_letter, live_letter, "TIE", "no idea"]
        assert [judge.compare(q, "Paris.", "Lyon.") for _ in range(4)] == [1, -1, 0, 0]
        shown = FakeJudge.seen[0]["messages"][0]["content"]
        first = "Answer A:\nLyon." if flip else "Answer A:\nParis."
        assert first in shown and FakeJudge.seen[0]["model"] == "m"
    finally:
        server.shutdown()
    # unreachable: it abstains, never fails the gate
    assert LlmJudge("http://127.0.0.1:9/v1", "m", timeout_s=0.5).compare("q", "a", "b") == 0
    # ... an abstention, not a tie: the gate counts no decided prompt from it
    assert LlmJudge("http://127.0.0.1:9/v1", "m", timeout_s=0.5).judge("q", "a", "b") is None


def test_rollouts_are_deterministic(tiny: Path, tmp_path: Path) -> None:
    from pipeline.trainer import rollout as R

    core = TrainerCore.load(settings(tiny, tmp_path, lr=5e-2))
    for recs in toy_batches(core, 3, 0, random.Random(0)):  # move off the all-whitespace base
        core.train_step([r.event for r in recs], 0)
    prompts = [prompt_ids(core.tokenizer), [1, 50, 60, 2], [1, 70, 2]]
    kw: dict[str, Any] = dict(
        pad_id=core.pad_id,
        eos_ids=[core.tokenizer.eos_token_id],
        device=core.device,
        max_new_tokens=6,
    )
    sampled = R.generate(core.model, prompts, temperature=0.7, seed=3, **kw)
    assert sampled == R.generate(core.model, prompts, temperature=0.7, seed=3, **kw)
    assert sampled != R.generate(core.model, prompts, temperature=0.7, seed=4, **kw)
    batched = R.generate(core.model, prompts, **kw)
    alone = [R.generate(core.model, [p], **kw)[0] for p in prompts]
    assert batched == alone  # left padding does not change a greedy answer
    # mean log-prob per token of the greedy answers, checked against one plain forward pass
    got = R.mean_logprobs(core.model, prompts, batched, pad_id=core.pad_id, device=core.device)
    assert any(batched)
    for p, a, lp in zip(prompts, batched, got, strict=True):
        if not a:  # an answer that ended at once has nothing to score
            assert lp is None
            continue
        with torch.no_grad():
            logits = core.model(input_ids=torch.tensor([p + a])).logits[0].float()
        want = sum(
            torch.log_softmax(logits[len(p) - 1 + t], -1)[tok].item() for t, tok in enumerate(a)
        ) / len(a)
        assert lp == pytest.approx(want, abs=1e-4)
    assert R.mean_logprobs(core.model, [[1, 2]], [[]], pad_id=0, device=core.device) == [None]


def test_improving_candidate_promoted_probe_breaking_one_rejected(
    tiny: Path, tmp_path: Path
) -> None:
    cfg = settings(
        tiny,
        tmp_path,
        lr=2e-2,
        gate_holdout=0.3,
        gate_probe_file=digit_probe(tmp_path),
        gate_probe_tolerance=0,
    )
    core = TrainerCore.load(cfg)
    producer = Recorder()
    pub = Publisher(cfg, producer, gate=G.Gate(cfg))  # type: ignore[arg-type]
    rng = random.Random(1)

    publish(cfg, core, pub, 1, toy_batches(core, 6, 0, rng))  # learns to answer with numbers
    assert pub.last_gate_s > 0  # the evaluation's time, kept out of the publish budget
    publish(cfg, core, pub, 2, toy_batches(core, 6, 1000, rng, invert=True))  # unlearns them
    assert pub.verdicts == {1: "promoted", 2: "rejected"}

    v1, v2 = (producer.weights(v) for v in (1, 2))
    assert [e.status for e in v1] == ["candidate", "promoted"]
    assert [e.status for e in v2] == ["candidate", "rejected"]
    # the promoted verdict makes v1 servable: it alone carries the canary share (default 0.1)
    assert [e.canary_share for e in (*v1, *v2)] == [None, 0.1, None, None]
    for cand, verdict in (v1, v2):
        assert verdict.event_id != cand.event_id and verdict.parents == [cand.event_id]
        assert verdict.uri == cand.uri and verdict.files == cand.files
    good, bad = v1[1].metrics, v2[1].metrics
    assert good["gate_live_version"] == 0 and good["gate_probe_correct"] == 1
    assert good["gate_live_probe_correct"] == 0 and good["gate_capability_for"] == 1
    assert bad["gate_live_version"] == 1  # compared with the promoted v1, not the base
    assert (bad["gate_probe_correct"], bad["gate_live_probe_correct"]) == (0, 1)
    assert any("capability probe 0 correct vs live 1" in r for r in bad["gate_reasons"])

    # Every vote is an event (sent before its verdict) and a Delta row, once each.
    stored = G.read_verdict(ck.version_dir(cfg.weights_root, "p", 2))
    assert stored is not None and stored["votes"]
    sent = [e for t, e in producer.sent if t == names.GATE_VOTES and e.version == 2]
    assert len(sent) == len(stored["votes"]) == len({e.event_id for e in sent})
    assert {(e.judge, e.source, e.vote) for e in sent} >= {("capability", "probe", -1)}
    order = [e.event_id for _, e in producer.sent]
    assert max(order.index(e.event_id) for e in sent) < order.index(v2[1].event_id)
    rows = [r for r in table(cfg, "gate_votes") if r["version"] == 2]
    assert sorted(r["event_id"] for r in rows) == sorted(e.event_id for e in sent)
    probe_row = next(r for r in rows if r["judge"] == "capability")
    assert probe_row["live_version"] == 1 and probe_row["session_id"] is None
    assert any(ch.isdigit() for ch in probe_row["live_answer"])
    held = [r for r in rows if r["source"] == "held_out"]
    assert held and all(r["session_id"] for r in held)  # forget erases them with the session

    weights = sorted((r["version"], r["status"]) for r in table(cfg, "weights"))
    assert weights == [(1, "candidate"), (1, "promoted"), (2, "candidate"), (2, "rejected")]

    # A restarted trainer (fresh gate, seeded from Delta) reproduces the stored verdict and
    # writes or sends nothing twice.
    d2 = ck.version_dir(cfg.weights_root, "p", 2)
    core2 = TrainerCore.load(cfg, d2, step=core.step)
    gate2 = G.Gate(cfg)
    gate2.seed(core2, 1)
    assert gate2.baseline_version == 1
    again = Publisher(cfg, producer, gate=gate2)  # type: ignore[arg-type]
    again.complete(d2, core2)
    assert again.verdicts == {2: "rejected"}
    assert len(table(cfg, "weights")) == 4
    assert len([r for r in table(cfg, "gate_votes") if r["version"] == 2]) == len(rows)
    assert len(producer.weights(2)) == 2
    # recomputing from scratch (verdict file removed) gives the same verdict and figures
    (d2 / "trainer" / G.VERDICT_FILE).unlink()
    fresh = G.Gate(cfg)
    fresh.seed(core2, 1)
    fresh.add([r for r in table(cfg, "trajectories") if r["weight_version"] == 2])
    redo = fresh.evaluate(core2, 2)
    assert redo is not None and redo["status"] == "rejected"
    assert redo["metrics"]["gate_fluency"] == pytest.approx(bad["gate_fluency"])


def test_a_rejected_candidate_is_not_the_parent_of_the_next(tiny: Path, tmp_path: Path) -> None:
    from pipeline.settings import Settings
    from pipeline.trainer.loop import TrainerLoop

    cfg = settings(
        tiny,
        tmp_path,
        lr=2e-2,
        gate_holdout=0.3,
        gate_probe_file=digit_probe(tmp_path),
        gate_probe_tolerance=0,
    )
    core = TrainerCore.load(cfg)
    pub = Publisher(cfg, Recorder(), gate=G.Gate(cfg))  # type: ignore[arg-type]
    rng = random.Random(1)
    publish(cfg, core, pub, 1, toy_batches(core, 6, 0, rng))
    publish(cfg, core, pub, 2, toy_batches(core, 6, 1000, rng, invert=True))
    assert pub.verdicts == {1: "promoted", 2: "rejected"}
    loop = TrainerLoop(Settings(), cfg, echo=lambda _m: None)
    step = core.step
    back, version = loop._after_verdict(core, 2, pub)
    assert version == 1 and back is not core and back.step == step
    v1 = TrainerCore.load(cfg, ck.version_dir(cfg.weights_root, "p", 1), step=step)
    for a, b in zip(back.model.state_dict().values(), v1.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the live version's weights ...
    saved = back.optimizer.state_dict()["state"]
    assert saved and all(  # ... and its optimizer state, not the rejected candidate's
        torch.equal(x["exp_avg"], y["exp_avg"])
        for x, y in zip(saved.values(), v1.optimizer.state_dict()["state"].values(), strict=True)
    )
    # a promoted version, or the operator's "continue", keeps the core as it is
    assert loop._after_verdict(back, 1, pub) == (back, 1)
    keep = TrainerLoop(
        Settings(), cfg.model_copy(update={"gate_on_reject": "continue"}), echo=lambda _m: None
    )
    assert keep._after_verdict(core, 2, pub) == (core, 2)


def few(n: int, start: int) -> list[Record]:
    rng = random.Random(start)
    return [
        Record(
            "in",
            0,
            i,
            None,
            0,
            Sample(
                event_id=f"s{i}",
                producer=Producer(component="t", version="0"),
                session_id="x",
                turn=i,
                policy_id="p",
                prompt_token_ids=[1, 50, 60, 2],
                response_token_ids=[rng.randrange(10, 300) for _ in range(3)],
                loss_mask=[1, 1, 1],
                behavior_logprobs=[-5.0] * 3,
                reward=rng.choice([-1.0, 1.0]),
                behavior_weight_version=0,
                ts_ms=1_790_000_000_000,
            ),
        )
        for i in range(start, start + n)
    ]


@pytest.mark.parametrize(
    "stage",
    [
        "after_events",
        "after_verdict_file",
        "after_delta_votes",
        "after_delta_verdict",
        "after_verdict_event",
    ],
)
def test_crash_between_candidate_and_verdict(tiny: Path, tmp_path: Path, stage: str) -> None:
    cfg = settings(
        tiny,
        tmp_path,
        gate_holdout=0.5,
        gate_min_samples=1,
        lr=1e-3,
        gate_probe_file=digit_probe(tmp_path),
    )
    core = TrainerCore.load(cfg)
    producer = Recorder()
    publish(cfg, core, Publisher(cfg, producer, gate=G.Gate(cfg)), 1, [few(6, 0)])  # type: ignore[arg-type]

    def boom(s: str) -> None:
        if s == stage:
            raise Crash

    crashing = Publisher(cfg, producer, on_stage=boom, gate=G.Gate(cfg))  # type: ignore[arg-type]
    with pytest.raises(Crash):
        publish(cfg, core, crashing, 2, [few(6, 6)])

    # restart as the loop does: load the newest version, seed the gate, complete it (twice)
    for _ in range(2):
        newest = ck.latest_manifest(cfg.weights_root, "p")
        assert newest is not None and newest.version == 2
        d = ck.version_dir(cfg.weights_root, "p", 2)
        core2 = TrainerCore.load(cfg, d, step=newest.step)
        gate = G.Gate(cfg)
        gate.seed(core2, 1)
        Publisher(cfg, producer, gate=gate).complete(d, core2)  # type: ignore[arg-type]

    weights = table(cfg, "weights")
    assert sorted((r["version"], r["status"] == "candidate") for r in weights) == [
        (1, False),
        (1, True),
        (2, False),
        (2, True),
    ]
    stored = G.read_verdict(ck.version_dir(cfg.weights_root, "p", 2))
    assert stored is not None
    row = next(r for r in weights if r["version"] == 2 and r["status"] != "candidate")
    assert row["status"] == stored["status"]
    assert sorted(r["event_id"] for r in table(cfg, "trajectories")) == sorted(
        f"s{i}" for i in range(12)
    )
    # Kafka may see a retried send, but always the same event: one candidate id and one
    # verdict id for v2, with one status and one set of figures.
    sent = producer.weights(2)
    by_id = {e.event_id: e for e in sent}
    assert len(by_id) == 2
    verdicts = [e for e in sent if e.status != "candidate"]
    assert {e.status for e in verdicts} == {stored["status"]}
    assert all(e.metrics == stored["metrics"] for e in verdicts)
    # and its votes: one row each in Delta, the same ids on Kafka however often re-sent
    rows = [r for r in table(cfg, "gate_votes") if r["version"] == 2]
    assert len(rows) == len(stored["votes"]) == len({r["event_id"] for r in rows})
    votes = {e.event_id for t, e in producer.sent if t == names.GATE_VOTES and e.version == 2}
    assert votes == {r["event_id"] for r in rows}


def test_staleness_counts_the_lineage_not_rejected_versions(tiny: Path, tmp_path: Path) -> None:
    from pipeline.settings import Settings
    from pipeline.trainer.loop import TrainerLoop

    loop = TrainerLoop(Settings(), settings(tiny, tmp_path, max_staleness=2), echo=lambda _m: None)
    # v1 from the base; v2 and v3 rejected (children of v1, never served); v4 promoted on v1
    loop.parents = {1: None, 2: 1, 3: 1, 4: 1, 5: 4}
    assert loop._staleness(1, 4) == 1  # by number it would be 3, and dropped
    assert (loop._staleness(1, 5), loop._staleness(0, 4), loop._staleness(4, 4)) == (2, 2, 0)
    assert loop._staleness(7, 9) == 2  # outside the known lineage: by number
    # the step uses it: a sample 3 versions old by number but 1 by lineage trains
    core = TrainerCore.load(settings(tiny, tmp_path, max_staleness=2, gate=False))
    batch = [
        Sample(
            event_id="old",
            producer=Producer(component="t", version="0"),
            session_id="x",
            turn=0,
            policy_id="p",
            prompt_token_ids=[1, 50, 2],
            response_token_ids=[70, 80],
            loss_mask=[1, 1],
            behavior_logprobs=[-5.0] * 2,
            reward=1.0,
            behavior_weight_version=1,
        )
    ]
    by_number = core.train_step(batch, 4)
    by_lineage = core.train_step(batch, 4, [loop._staleness(1, 4)])
    assert [(o.status, o.staleness) for o in by_number.outcomes] == [("stale_dropped", 3)]
    assert [(o.status, o.staleness) for o in by_lineage.outcomes] == [("trained", 1)]


def test_the_publish_budget_leaves_the_verdict_out() -> None:
    """A 100 s publish of which 95 s evaluated the candidate, at 5 % overhead: the next
    version may follow 5 s x 0.95 / 0.05 = 95 s later, not 100 x 19 = 1,900 s."""
    from pipeline.trainer.loop import next_publish_at

    assert next_publish_at(1000.0, 100.0, 95.0, 0.05) == pytest.approx(1095.0)
    assert next_publish_at(1000.0, 100.0, 0.0, 0.05) == pytest.approx(2900.0)
    assert next_publish_at(1000.0, 10.0, 0.0, 1.0) == pytest.approx(1000.0)
    assert next_publish_at(1000.0, 10.0, 12.0, 0.5) == pytest.approx(1000.0)  # never before now


def test_judge_weights_from_a_consistency_file_decide_a_split_prompt(
    tiny: Path, tmp_path: Path
) -> None:
    assert G.tally([1, -1], [0.8, 0.3]) == 1 and G.tally([1, -1], [0.3, 0.8]) == -1
    assert G.tally([1, -1], [0.5, 0.5]) == 0
    path = tmp_path / "consistency.json"
    path.write_text(
        json.dumps(
            {
                "judges": [
                    {
                        "judge_id": "llm",
                        "judge_version": "a",
                        "agree": 1,
                        "disagree": 0,
                        "consistency": 0.9,
                    },
                    {
                        "judge_id": "llm",
                        "judge_version": "b",
                        "agree": 30,
                        "disagree": 20,
                        "consistency": 31 / 52,
                    },
                ]
            }
        )
    )
    cfg = settings(tiny, tmp_path, gate_judge_weights={"fluency": 0.5}, gate_consistency_file=path)
    # log-odds of the row with the most decided verdicts: log((31/52) / (21/52)) = 0.3895
    assert G.judge_weights(cfg) == {"fluency": 0.5, "llm": pytest.approx(0.3895, abs=1e-4)}
    # the reward judge's votes rest on the reward pipeline's judge: its row weights them
    rows = json.loads(path.read_text())["judges"]
    rows.append(
        {"judge_id": "replies", "judge_version": "r", "agree": 6, "disagree": 2, "consistency": 0.7}
    )
    withrep = tmp_path / "with-replies.json"
    withrep.write_text(json.dumps({"judges": rows}))
    got = G.judge_weights(settings(tiny, tmp_path, gate_consistency_file=withrep))
    assert got["reward"] == got["replies"] == pytest.approx(0.8473, abs=1e-4)  # log(7/3)
    off = settings(tiny, tmp_path, gate_consistency_file=withrep, gate_reward_judge=None)
    assert "reward" not in G.judge_weights(off)
    votes = [
        {"prompt_id": "a", "vote": 1, "judge": "fluency", "source": "held_out"},
        {"prompt_id": "a", "vote": -1, "judge": "llm", "source": "held_out"},
    ]
    # By consistency llm weighed 31/52 = 0.596 > 0.5 and the prompt was lost; by log-odds it
    # weighs 0.3895 < 0.5 (a judge barely better than a coin): fluency's +1 wins the prompt.
    status, fig = G.decide(votes, (12, 12), (-1.0, -1.0), cfg)
    assert (status, fig["gate_won"], fig["gate_reasons"]) == ("promoted", 1, [])
    cfg2 = settings(tiny, tmp_path, gate_judge_weights={"fluency": 0.3}, gate_consistency_file=path)
    status, fig = G.decide(votes, (12, 12), (-1.0, -1.0), cfg2)  # 0.3 - 0.3895 < 0: lost
    assert (status, fig["gate_reasons"]) == (
        "rejected",
        ["live preferred on 1 of 1 prompts (candidate on 0)"],
    )
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"judges": [{"judge_id": "llm", "judge_version": "a", "consistency": 1.5}]})
    )
    with pytest.raises(ValueError, match="consistency 1.5 of llm is not in"):
        G.Gate(settings(tiny, tmp_path, gate_consistency_file=bad))  # at start, not a verdict


def test_live_consistency_weights_the_gate_over_the_file(tiny: Path, tmp_path: Path) -> None:
    from pipeline.processors.consistency_file import JudgeRow

    class Live:
        def __init__(self, rows: list[JudgeRow]) -> None:
            self._rows = rows

        def rows(self) -> list[JudgeRow]:
            return self._rows

    path = tmp_path / "consistency.json"
    path.write_text(
        json.dumps(
            {
                "judges": [
                    {
                        "judge_id": "llm",
                        "judge_version": "a",
                        "agree": 9,
                        "disagree": 0,
                        "consistency": 0.9,
                    },
                    {
                        "judge_id": "replies",
                        "judge_version": "r",
                        "agree": 9,
                        "disagree": 0,
                        "consistency": 0.9,
                    },
                ]
            }
        )
    )
    cfg = settings(
        tiny,
        tmp_path,
        gate_consistency_file=path,
        gate_consistency_live=True,
        gate_judge_weights={"fluency": 0.5},
    )
    # the topic has since seen llm contradicted (2 agree, 6 disagree: 3/10, log-odds < 0 -> 0);
    # the version with the most decided verdicts speaks for the judge; the file's 0.9 -> log 9
    live = Live([JudgeRow("llm", "a", 0.3, 8), JudgeRow("llm", "old", 0.95, 2)])
    log9 = pytest.approx(2.1972, abs=1e-4)
    assert G.judge_weights(cfg, live) == {
        "fluency": 0.5,
        "llm": 0.0,
        "replies": log9,
        "reward": log9,
    }
    votes = [
        {"prompt_id": "a", "vote": 1, "judge": "llm", "source": "held_out"},
        {"prompt_id": "a", "vote": -1, "judge": "fluency", "source": "held_out"},
    ]
    ok = (-1.0, -1.0)  # fluency measured on both sides, equal
    assert G.decide(votes, (12, 12), ok, cfg)[0] == "promoted"  # file: 2.1972 > 0.5
    status, fig = G.decide(votes, (12, 12), ok, cfg, live)  # live: 0 < 0.5
    assert (status, fig["gate_lost"], fig["gate_judge_weights"]["llm"]) == ("rejected", 1, 0.0)
    # flagged by the watcher (its recent consistency fell): out of the gate's votes whatever
    # its cumulative 0.9, until the topic says it recovered
    flagged = Live([JudgeRow("llm", "a", 0.9, 40, excluded=True, recent=0.4)])
    assert G.judge_weights(cfg, flagged)["llm"] == 0.0
    assert G.decide(votes, (12, 12), ok, cfg, flagged)[0] == "rejected"
    back = Live([JudgeRow("llm", "a", 0.9, 60, recent=0.6)])
    assert G.judge_weights(cfg, back)["llm"] == log9
    assert G.decide(votes, (12, 12), ok, cfg, back)[0] == "promoted"


# ---- abstention cannot promote (issue 38 item 5) -----------------------------------------------
# The shape: 4 held-out prompts and 8 probe questions; the live version answers every
# prompt (fluency -1.0) and gets 1 of the 8 probe questions right. On 7ed65b3 each candidate
# below was promoted: its judges abstained (won/lost/tied 0/1/11) and the fluency veto was
# skipped on a missing or NaN mean.

LIVE_ANSWER = "Bread goes stale as its starch crystallises."


def fixed_scores(
    prompts: list[G.EvalPrompt],
    *,
    text: str,
    fluency: float | None,
    right: int,
    ids: list[int] | None = None,
) -> G.Scored:
    """The same answer (greedy and sampled) on every prompt; the first ``right`` probe
    questions answered right."""
    probe_at = [i for i, p in enumerate(prompts) if p.item is not None]
    n = len(prompts)
    return G.Scored(
        greedy=[list(ids) if ids else [] for _ in prompts],
        text=[text] * n,
        sampled_text=[text] * n,
        correct=[None if p.item is None else i in probe_at[:right] for i, p in enumerate(prompts)],
        fluency=[fluency] * n,
        hint=[None] * n,
        recorded=[None] * n,
    )


def verdict_against_weak_live(
    tiny: Path,
    tmp_path: Path,
    *,
    text: str,
    fluency: float | None,
    ids: list[int] | None = None,
    right: int = 0,
) -> dict[str, Any]:
    """Gate.evaluate on the issue's 12 prompts with both sides' answers fixed (no model)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    cfg = settings(tiny, tmp_path)  # defaults: 4 held-out prompts, 8 probe questions
    gate = G.Gate(cfg)
    gate.add(
        [
            {
                "status": "held_out",
                "prompt_token_ids": [1, 40 + k, 2],
                "reward": 0.0,
                "response_token_ids": [70, 80],
                "hints": [],
                "session_id": f"s{k}",
                "weight_version": 0,
                "step": k,
                "source_partition": 0,
                "source_offset": k,
            }
            for k in range(4)
        ]
    )
    gate.baseline = object()
    core = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(tiny), model=object())
    gate._live_scores = lambda _core, ps: fixed_scores(  # type: ignore[method-assign]
        ps, text=LIVE_ANSWER, fluency=-1.0, right=1
    )
    gate._score = lambda _core, _model, ps: fixed_scores(  # type: ignore[method-assign]
        ps, text=text, fluency=fluency, ids=ids, right=right
    )
    out = gate.evaluate(core, 1)
    assert out is not None and out["metrics"]["gate_prompts"] == 12
    return out


def test_empty_answers_lose_every_prompt(tiny: Path, tmp_path: Path) -> None:
    out = verdict_against_weak_live(tiny, tmp_path, text="", fluency=None)  # None: nothing scored
    m = out["metrics"]
    assert out["status"] == "rejected"
    assert (m["gate_won"], m["gate_lost"], m["gate_tied"]) == (0, 12, 0)
    assert m["gate_validity_against"] == 12
    assert any("fluency not measured" in r for r in m["gate_reasons"])
    why = {v["detail"]["candidate"] for v in out["votes"] if v["judge"] == "validity"}
    assert why == {"sampled answer: empty"}


def test_whitespace_answers_lose_every_prompt(tiny: Path, tmp_path: Path) -> None:
    # Whitespace is easy to predict: its fluency reads better than the live answers' (-0.8
    # against -1.0, a tie within the 0.5 margin on 7ed65b3).
    out = verdict_against_weak_live(tiny, tmp_path, text=" \n\t ", fluency=-0.8)
    m = out["metrics"]
    assert out["status"] == "rejected" and (m["gate_won"], m["gate_lost"]) == (0, 12)
    assert {v["detail"]["candidate"] for v in out["votes"] if v["judge"] == "validity"} == {
        "sampled answer: whitespace"
    }


def test_nan_fluency_is_a_failed_check(tiny: Path, tmp_path: Path) -> None:
    # The same answers as the live version (one probe question right), but fluency NaN.
    out = verdict_against_weak_live(tiny, tmp_path, text=LIVE_ANSWER, fluency=float("nan"), right=1)
    m = out["metrics"]
    assert out["status"] == "rejected" and m["gate_lost"] == 12
    assert any("fluency not measured: candidate nan" in r for r in m["gate_reasons"])
    assert all(v["candidate_score"] is None for v in out["votes"] if v["judge"] == "fluency")


def test_missing_fluency_is_a_failed_check(tiny: Path, tmp_path: Path) -> None:
    out = verdict_against_weak_live(tiny, tmp_path, text=LIVE_ANSWER, fluency=None, right=1)
    m = out["metrics"]
    assert out["status"] == "rejected" and m["gate_lost"] == 12
    assert any("fluency not measured: candidate None" in r for r in m["gate_reasons"])
    assert {v["detail"]["candidate"] for v in out["votes"] if v["judge"] == "validity"} == {
        "no fluency"
    }


def test_degenerate_answers_lose_every_prompt(tiny: Path, tmp_path: Path) -> None:
    # One word looped: highly predictable, so its fluency beats the live version's by more
    # than the margin (-0.3 vs -1.0: a fluency vote *for* it on 7ed65b3).
    out = verdict_against_weak_live(tiny, tmp_path, text="the " * 12, fluency=-0.3, ids=[5] * 16)
    m = out["metrics"]
    assert out["status"] == "rejected" and (m["gate_won"], m["gate_lost"]) == (0, 12)
    assert {v["detail"]["candidate"] for v in out["votes"] if v["judge"] == "validity"} == {
        "sampled answer: degenerate"
    }


def test_answer_defects_by_hand() -> None:
    d = G.answer_defect
    assert (d(""), d("  \n"), d("?!..."), d("the the the the")) == (
        "empty",
        "whitespace",
        "no words",
        "degenerate",
    )
    assert d("ok", [7, 7, 7, 7]) == "degenerate"  # one token repeated 4 times
    assert d("aaaaaa") == "degenerate" and d("a b a b a b a b") == "degenerate"  # 2 of 8 words
    # answers, however short: the probe accepts "4"; a long number is still one
    assert [d(t) for t in ("4", "Paris", "1000000000", "the the the", "a b c a b c a b")] == [
        None
    ] * 5
    assert d("1000000000", [16, 15, 15, 15, 15, 15, 15, 15, 15, 15]) is None
    assert (
        G.fluency_defect(None),
        G.fluency_defect(float("nan")),
        G.fluency_defect(float("-inf")),
        G.fluency_defect(-1.2),
    ) == ("no fluency", "fluency NaN", "fluency infinite", None)


def test_too_few_decided_prompts_is_no_decision(tiny: Path, tmp_path: Path) -> None:
    cfg = settings(tiny, tmp_path)  # gate_min_decided 0.5
    # 12 prompts: the capability judge decides one (lost); on the other 11 every judge
    # abstained (an LLM judge that could not be reached, scores that could not be compared).
    votes = [{"prompt_id": "q0", "source": "probe", "judge": "capability", "vote": -1}]
    votes += [
        {"prompt_id": f"h{k}", "source": "held_out", "judge": j, "vote": 0, "abstained": True}
        for k in range(11)
        for j in ("fluency", "llm")
    ]
    status, fig = G.decide(votes, (0, 1), (-1.0, -1.0), cfg)
    assert status == "candidate"  # G.NO_DECISION: never promoted
    assert (fig["gate_decided"], fig["gate_min_decided"]) == (1, 6)  # ceil(0.5 * 12) = 6
    assert "1 of 12 prompts decided" in fig["gate_no_decision"]
    # six decided prompts (ties within the margin are decisions) are enough ...
    ties = [
        {**v, "abstained": False} for v in votes if v["prompt_id"] in {"h0", "h1", "h2", "h3", "h4"}
    ]
    assert G.decide(votes + ties, (0, 1), (-1.0, -1.0), cfg)[0] == "promoted"
    # ... and no votes at all are never a decision, whatever the setting
    none = settings(tiny, tmp_path, gate_min_decided=0.0)
    assert G.decide([], (0, 0), (-1.0, -1.0), none)[0] == "candidate"


# ---- progress and following the serving version (issue 39) ---------------------------------


def test_generate_tells_each_answer_end_once(tiny: Path, tmp_path: Path) -> None:
    from pipeline.trainer import rollout as R

    core = TrainerCore.load(settings(tiny, tmp_path))
    prompts = [prompt_ids(core.tokenizer), [1, 50, 60, 2], [1, 70, 2], [1, 80, 2], [1, 90, 2]]
    told: list[int] = []
    kw: dict[str, Any] = dict(
        pad_id=core.pad_id,
        eos_ids=[core.tokenizer.eos_token_id],
        device=core.device,
        max_new_tokens=5,
    )
    # batches of 2: three chunks; every prompt's end is told once, in chunk order
    got = R.generate(core.model, prompts, batch=2, on_finished=told.extend, **kw)
    assert sorted(told) == [0, 1, 2, 3, 4] and told[:2] in ([0, 1], [1, 0])
    assert got == R.generate(core.model, prompts, batch=2, **kw)  # the hook changes nothing


def test_evaluation_progress_counts_every_prompt_it_answers(tiny: Path, tmp_path: Path) -> None:
    cfg = settings(
        tiny,
        tmp_path,
        lr=2e-2,
        gate_holdout=0.3,
        gate_probe_file=digit_probe(tmp_path),
        gate_probe_tolerance=0,
    )
    core = TrainerCore.load(cfg)
    calls: list[tuple[int, int, str]] = []
    gate = G.Gate(cfg, on_progress=lambda d, t, w: calls.append((d, t, w)))
    pub = Publisher(cfg, Recorder(), gate=gate)  # type: ignore[arg-type]
    publish(cfg, core, pub, 1, toy_batches(core, 6, 0, random.Random(1)))
    assert pub.verdicts == {1: "promoted"}
    n = len(gate._last[1]) if gate._last is not None else 0
    # v1 against the base: the base's n answers (live, computed here) then the candidate's n;
    # the base is the reference too, nothing more to answer
    assert n > 0 and calls == [(i, 2 * n, "live") for i in range(1, n + 1)] + [
        (i, 2 * n, "candidate") for i in range(n + 1, 2 * n + 1)
    ]


def test_following_the_serving_version_loads_its_weights_and_optimizer(
    tiny: Path, tmp_path: Path
) -> None:
    from pipeline.settings import Settings
    from pipeline.trainer.follow import Decision
    from pipeline.trainer.loop import TrainerLoop
    from pipeline.versions.table import Action

    cfg = settings(
        tiny,
        tmp_path,
        lr=2e-2,
        gate_holdout=0.3,
        gate_probe_file=digit_probe(tmp_path),
        gate_probe_tolerance=0,
    )
    core = TrainerCore.load(cfg)
    gate = G.Gate(cfg)
    pub = Publisher(cfg, Recorder(), gate=gate)  # type: ignore[arg-type]
    rng = random.Random(1)
    publish(cfg, core, pub, 1, toy_batches(core, 6, 0, rng))
    publish(cfg, core, pub, 2, toy_batches(core, 2, 1000, rng))
    lines: list[str] = []
    loop = TrainerLoop(Settings(), cfg, echo=lines.append)
    step = core.step
    rollback = Decision("switch", 1, Action("rollback", 1, "alice", "v2 talks French", 5, "e1"))
    back, version = loop._follow(rollback, core, 2, pub)
    assert version == 1 and back is not core and back.step == step  # step numbers go on
    v1 = TrainerCore.load(cfg, ck.version_dir(cfg.weights_root, "p", 1), step=step)
    for a, b in zip(back.model.state_dict().values(), v1.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    saved = back.optimizer.state_dict()["state"]
    assert saved and all(
        torch.equal(x["exp_avg"], y["exp_avg"])
        for x, y in zip(saved.values(), v1.optimizer.state_dict()["state"].values(), strict=True)
    )
    assert gate.baseline_version == 1 and gate.live_dir() == ck.version_dir(
        cfg.weights_root, "p", 1
    )
    assert lines[-1] == (
        "v1 serves after rollback by alice (v2 talks French): training goes on from v1"
    )
    assert (loop.progress.version, loop.progress.detail) == (1, lines[-1])
    # pinned with while_pinned = "pause": the weights stay, the loop pauses; then resumes
    pin = Decision("pause", 1, Action("pin", 1, "bob", None, 6, "e2"))
    assert loop._follow(pin, back, 1, pub) == (back, 1) and loop.paused
    assert loop.progress.state == "paused" and loop.progress.pinned == 1
    unpin = Decision("keep", 1, Action("unpin", 1, "bob", None, 7, "e3"))
    assert loop._follow(unpin, back, 1, pub) == (back, 1) and not loop.paused
    assert lines[-1] == "p unpinned: v1 serves; training resumes"
    # a version whose folder is not here is not followed
    gone = Decision("switch", 9, Action("promote", 9, "bob", None, 8, "e4"))
    assert loop._follow(gone, back, 1, pub) == (back, 1)
    assert lines[-1].startswith("v9 serves but its folder")
