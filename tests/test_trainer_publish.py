"""Publish protocol units: manifest contents, atomic folders, Delta transaction skips, and
recovery after a crash at every stage (in-process, no Kafka)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from deltalake import DeltaTable
from safetensors.torch import load_file

from pipeline.events import Producer, Sample
from pipeline.kafka import Record
from pipeline.models.tiny import ensure_tiny_model
from pipeline.trainer import checkpoint as ck
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.core import TrainerCore
from pipeline.trainer.publish import Publisher, step_row, trajectory_rows

STAGES = [
    "before_rename",
    "after_folder",
    "after_delta_trajectories",
    "after_delta_gradient_steps",
    "after_delta_weights",
    "after_events",
    "after_offsets",
]


class Crash(Exception):
    pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def records(n: int, start: int = 0) -> list[Record]:
    rng = random.Random(start)
    out = []
    for i in range(start, start + n):
        s = Sample(
            event_id=f"s{i}",
            producer=Producer(component="t", version="0"),
            session_id="x",
            turn=i,
            policy_id="p",
            prompt_token_ids=[1, 50, 60, 2],
            response_token_ids=[rng.randrange(10, 300) for _ in range(3)],
            loss_mask=[1, 1, 0],
            behavior_logprobs=[-5.0, -5.0, -5.0],
            reward=1.0,
            behavior_weight_version=0,
            ts_ms=1_790_000_000_000,
        )
        out.append(Record("in", i % 2, i // 2, b"x", 0, s))
    return out


def setup(tiny: Path, tmp_path: Path) -> tuple[TrainerSettings, TrainerCore]:
    cfg = TrainerSettings(
        policy="p",
        method="rl",
        rl_baseline="none",  # the old defaults: A = r, so an all +1 batch moves
        model=str(tiny),
        weights_root=tmp_path / "w",
        lake_root=tmp_path / "lake",
        input_topic="in",
        device="cpu",
    )
    return cfg, TrainerCore.load(cfg)


def publish_one(
    cfg: TrainerSettings, core: TrainerCore, pub: Publisher, version: int, recs: list[Record]
) -> ck.Manifest:
    result = core.train_step([r.event for r in recs], version - 1)  # type: ignore[misc]
    offsets = {0: 10 * version, 1: 10 * version + 1}
    return pub.publish(
        core,
        version=version,
        parent=version - 1 or None,
        offsets=offsets,
        trajectories=trajectory_rows(recs, result, core.tokenizer),
        steps=[step_row(cfg, result, offsets, 1)],
        created_ms=123,
    )


def rows(cfg: TrainerSettings, name: str) -> list[dict]:  # type: ignore[type-arg]
    path = cfg.lake_root / name
    return DeltaTable(str(path)).to_pyarrow_table().to_pylist() if path.exists() else []


def test_manifest_lists_files_offsets_and_parent(tiny: Path, tmp_path: Path) -> None:
    cfg, core = setup(tiny, tmp_path)
    pub = Publisher(cfg)
    publish_one(cfg, core, pub, 1, records(2))
    m = publish_one(cfg, core, pub, 2, records(2, 2))
    d = ck.version_dir(cfg.weights_root, "p", 2)
    assert (m.version, m.parent, m.step, m.input_topic) == (2, 1, 2, "in")
    assert m.consumed_offsets == {"0": 20, "1": 21}
    paths = {f["path"] for f in m.files}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= paths
    assert {f["path"] for f in m.trainer_files} >= {
        "trainer/optimizer.pt",
        "trainer/trajectories.parquet",
    }
    assert ck.verify_version(d) == m
    # the servable weights are the trained ones, not the initial ones
    saved = load_file(d / "model.safetensors")
    name = next(iter(saved))
    assert not saved[name].equal(load_file(tiny / "model.safetensors")[name])
    (d / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="sha256"):
        ck.verify_version(d)


def test_versions_are_never_overwritten_and_temp_is_cleaned(tiny: Path, tmp_path: Path) -> None:
    cfg, core = setup(tiny, tmp_path)

    def boom(stage: str) -> None:
        if stage == "before_rename":
            raise Crash

    with pytest.raises(Crash):
        publish_one(cfg, core, Publisher(cfg, on_stage=boom), 1, records(1))
    assert ck.versions(cfg.weights_root, "p") == []
    assert not list((cfg.weights_root / "p").iterdir())  # no half-written folder visible
    publish_one(cfg, core, Publisher(cfg), 1, records(1))
    with pytest.raises(FileExistsError):
        publish_one(cfg, core, Publisher(cfg), 1, records(1, 1))


@pytest.mark.parametrize("stage", STAGES)
def test_crash_at_any_stage_then_recovery_writes_each_row_once(
    tiny: Path, tmp_path: Path, stage: str
) -> None:
    cfg, core = setup(tiny, tmp_path)
    publish_one(cfg, core, Publisher(cfg), 1, records(2))

    def boom(s: str) -> None:
        if s == stage:
            raise Crash

    with pytest.raises(Crash):
        publish_one(cfg, core, Publisher(cfg, on_stage=boom), 2, records(2, 2))
    # restart: clean temp folders, finish the newest version's publishing
    ck.clean_temp(cfg.weights_root, "p")
    newest = ck.latest_manifest(cfg.weights_root, "p")
    assert newest is not None
    Publisher(cfg).complete(ck.version_dir(cfg.weights_root, "p", newest.version))
    Publisher(cfg).complete(ck.version_dir(cfg.weights_root, "p", newest.version))  # twice: no-op
    expected = ["s0", "s1"] if stage == "before_rename" else ["s0", "s1", "s2", "s3"]
    assert sorted(r["event_id"] for r in rows(cfg, "trajectories")) == expected
    versions = sorted(r["version"] for r in rows(cfg, "weights"))
    assert versions == ([1] if stage == "before_rename" else [1, 2])
    assert sorted(r["step"] for r in rows(cfg, "gradient_steps")) == list(
        range(1, len(versions) + 1)
    )
    assert {r["day"] for r in rows(cfg, "trajectories")} == {"2026-09-21"}
    meta = DeltaTable(str(cfg.lake_root / "trajectories")).metadata()
    assert meta.partition_columns == ["day"]


def test_drift_and_opd_mask_columns(tiny: Path, tmp_path: Path) -> None:
    cfg, core = setup(tiny, tmp_path)
    publish_one(cfg, core, Publisher(cfg), 1, records(2))  # samples of version 0: fresh
    publish_one(cfg, core, Publisher(cfg), 2, records(2, 2))  # still version 0: stale
    steps = sorted(rows(cfg, "gradient_steps"), key=lambda r: r["step"])
    assert steps[0]["logprob_drift_max"] >= steps[0]["logprob_drift_mean"] > 0.0
    assert steps[1]["logprob_drift_mean"] is None and steps[1]["logprob_drift_max"] is None
    # samples written without opd_mask: the OPD mask recorded is their loss mask
    assert {tuple(r["opd_mask"]) for r in rows(cfg, "trajectories")} == {(1, 1, 0)}


class Sent:
    """Stands in for the Kafka producer."""

    def __init__(self) -> None:
        self.events: list = []  # type: ignore[type-arg]

    def send(self, topic: str, event: object, key: object = None) -> None:
        self.events.append(event)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(("share", "stamped"), [(0.25, 0.25), (0.0, None)])
def test_without_the_gate_the_candidate_carries_the_canary_share(
    tiny: Path, tmp_path: Path, share: float, stamped: float | None
) -> None:
    """Gate off, the candidate event makes a version servable: it carries the share
    (0: none, the version serves everyone at once)."""
    from pipeline.events import WeightsPublished

    cfg, core = setup(tiny, tmp_path)
    cfg = cfg.model_copy(update={"gate": False, "canary_share": share})
    sent = Sent()
    publish_one(cfg, core, Publisher(cfg, sent), 1, records(2))  # type: ignore[arg-type]
    weights = [e for e in sent.events if isinstance(e, WeightsPublished)]
    assert [(e.status, e.canary_share) for e in weights] == [("candidate", stamped)]
