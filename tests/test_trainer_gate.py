"""Promotion gate: held-out split, a good candidate promoted, a regressing one rejected with
its figures, and exactly-once verdicts across a crash between candidate and verdict
(in-process, real Delta, a recording producer instead of Kafka)."""

from __future__ import annotations

import random
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
        policy="p", model=str(tiny), weights_root=tmp_path / "w", lake_root=tmp_path / "lake",
        input_topic="in", device="cpu", gate=True,
    )
    return TrainerSettings(**{**base, **kw})


def table(cfg: TrainerSettings, name: str) -> list[dict]:  # type: ignore[type-arg]
    return DeltaTable(str(cfg.lake_root / name)).to_pyarrow_table().to_pylist()


def publish(
    cfg: TrainerSettings, core: TrainerCore, pub: Publisher, version: int,
    batches: list[list[Record]],
) -> ck.Manifest:
    traj, steps = [], []
    for recs in batches:
        result = core.train_step([r.event for r in recs], version - 1)  # type: ignore[misc]
        traj += trajectory_rows(recs, result, core.tokenizer)
        steps.append(step_row(cfg, result, {0: recs[-1].offset + 1}, 1))
    return pub.publish(
        core, version=version, parent=version - 1 or None,
        offsets={0: batches[-1][-1].offset + 1}, trajectories=traj, steps=steps, created_ms=7,
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
        Sample(event_id=i, producer=Producer(component="t", version="0"), session_id="x",
               turn=0, policy_id="p", prompt_token_ids=[1, 50, 2], response_token_ids=[70, 80],
               loss_mask=[1, 1], behavior_logprobs=[-5.0, -5.0], reward=1.0,
               behavior_weight_version=0)
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
                event_id=eid, producer=Producer(component="t", version="0"),
                session_id=f"s{offset}", turn=0, policy_id="p", prompt_token_ids=prompt,
                response_token_ids=r, loss_mask=[1] * len(r), behavior_logprobs=lp,
                reward=-true if flip else true, behavior_weight_version=0,
            )
            recs.append(Record("in", 0, offset, None, 0, s))
            offset += 1
        out.append(recs)
    return out


def test_good_candidate_promoted_regressing_one_rejected(tiny: Path, tmp_path: Path) -> None:
    cfg = settings(tiny, tmp_path, lr=2e-2, gate_holdout=0.3, gate_min_samples=8)
    core = TrainerCore.load(cfg)
    producer = Recorder()
    pub = Publisher(cfg, producer, gate=G.Gate(cfg))  # type: ignore[arg-type]
    rng = random.Random(1)

    publish(cfg, core, pub, 1, toy_batches(core, 6, 0, rng))
    publish(cfg, core, pub, 2, toy_batches(core, 6, 1000, rng, invert=True))
    assert pub.verdicts == {1: "promoted", 2: "rejected"}

    v1, v2 = (producer.weights(v) for v in (1, 2))
    assert [e.status for e in v1] == ["candidate", "promoted"]
    assert [e.status for e in v2] == ["candidate", "rejected"]
    for cand, verdict in (v1, v2):
        assert verdict.event_id != cand.event_id and verdict.parents == [cand.event_id]
        assert verdict.uri == cand.uri and verdict.files == cand.files
    good, bad = v1[1].metrics, v2[1].metrics
    assert good["gate_live_version"] == 0 and good["gate_delta"] > 0
    assert bad["gate_live_version"] == 1  # compared with the promoted v1, not the base
    assert bad["gate_delta"] < -cfg.gate_tolerance
    assert bad["gate_samples"] >= 8 and bad["gate_tokens"] > 0

    rows = sorted((r["version"], r["status"]) for r in table(cfg, "weights"))
    assert rows == [(1, "candidate"), (1, "promoted"), (2, "candidate"), (2, "rejected")]
    held = [r for r in table(cfg, "trajectories") if r["status"] == "held_out"]
    assert len(held) == bad["gate_samples"] and len(held) >= 8

    # A restarted trainer (fresh gate, seeded from Delta) reproduces the stored verdict and
    # writes or sends nothing twice.
    d2 = ck.version_dir(cfg.weights_root, "p", 2)
    core2 = TrainerCore.load(cfg, d2, step=core.step)
    gate2 = G.Gate(cfg)
    gate2.seed(core2, 1)
    assert gate2.baseline_version == 1 and len(gate2.rows) == len(held) - sum(
        r["weight_version"] == 2 for r in held
    )
    again = Publisher(cfg, producer, gate=gate2)  # type: ignore[arg-type]
    again.complete(d2, core2)
    assert again.verdicts == {2: "rejected"}
    assert len(table(cfg, "weights")) == 4
    assert len(producer.weights(2)) == 2
    # recomputing from scratch (verdict file removed) gives the same figures
    (d2 / "trainer" / G.VERDICT_FILE).unlink()
    fresh = G.Gate(cfg)
    fresh.seed(core2, 1)
    fresh.add([r for r in held if r["weight_version"] == 2])
    assert fresh.evaluate(core2, 2)["metrics"]["gate_delta"] == pytest.approx(bad["gate_delta"])


def few(n: int, start: int) -> list[Record]:
    rng = random.Random(start)
    return [
        Record("in", 0, i, None, 0, Sample(
            event_id=f"s{i}", producer=Producer(component="t", version="0"), session_id="x",
            turn=i, policy_id="p", prompt_token_ids=[1, 50, 60, 2],
            response_token_ids=[rng.randrange(10, 300) for _ in range(3)], loss_mask=[1, 1, 1],
            behavior_logprobs=[-5.0] * 3, reward=rng.choice([-1.0, 1.0]),
            behavior_weight_version=0, ts_ms=1_790_000_000_000,
        ))
        for i in range(start, start + n)
    ]


@pytest.mark.parametrize(
    "stage", ["after_events", "after_verdict_file", "after_delta_verdict", "after_verdict_event"]
)
def test_crash_between_candidate_and_verdict(tiny: Path, tmp_path: Path, stage: str) -> None:
    cfg = settings(tiny, tmp_path, gate_holdout=0.5, gate_min_samples=1, lr=1e-3)
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
        (1, False), (1, True), (2, False), (2, True)
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
