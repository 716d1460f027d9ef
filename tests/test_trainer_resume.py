"""Resume with a corrupt newest version (issue 11, item 6; real broker, real trainer process).

Before, the trainer resumed from the newest manifest without checking its files and built on
weights nobody could verify. Now it verifies, falls back to the newest version that verifies
(saying so), trains the inputs after it again and numbers new versions after the newest folder.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pipeline.models.tiny import ensure_tiny_model
from pipeline.settings import Settings
from pipeline.trainer import checkpoint as ck

from .conftest import create_topic
from .test_trainer_exactly_once import make_sample, produce, start, trainer_cmd

pytestmark = pytest.mark.integration


def run_to_idle(cmd: list[str], settings: Settings, log: Path) -> str:
    proc, lines = start(cmd, settings, log)
    assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]
    out = []
    while not lines.empty():
        out.append(lines.get())
    return "".join(out)


def corrupt(directory: Path) -> None:
    path = (
        directory
        / ck.read_manifest(
            directory.parent.parent, directory.parent.name, int(directory.name[1:])
        ).files[0]["path"]
    )
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 8] = b"\x7f" * 8
    path.write_bytes(bytes(raw))


def test_corrupt_newest_version_resumes_from_newest_valid(
    kafka_settings: Settings,
    admin,
    unique: str,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    topic, policy = f"test.trainer.resume.{unique}", f"p-{unique}"
    create_topic(admin, topic, 1)
    rng = random.Random(11)
    samples = [make_sample(i, policy, rng) for i in range(9)]
    produce(kafka_settings, topic, samples)
    tiny = ensure_tiny_model(tmp_path / "model" / "tiny")
    cmd = trainer_cmd(tiny, topic, policy, tmp_path, idle_s=1.5)
    weights = tmp_path / "weights"

    run_to_idle(cmd, kafka_settings, tmp_path / "t1.log")
    assert ck.versions(weights, policy) == [1, 2, 3]
    v2 = ck.read_manifest(weights, policy, 2)
    corrupt(ck.version_dir(weights, policy, 3))
    with pytest.raises(ValueError):
        ck.verify_version(ck.version_dir(weights, policy, 3))  # what was never checked

    more = [make_sample(i, policy, rng) for i in range(9, 12)]
    produce(kafka_settings, topic, more)
    out = run_to_idle(cmd, kafka_settings, tmp_path / "t2.log")
    assert "v3 does not verify" in out and "resumed from v2" in out, out

    newest = ck.latest_manifest(weights, policy)
    assert newest is not None and newest.version > 3, "versions are never overwritten"
    first_new = ck.read_manifest(weights, policy, 4)
    assert first_new.parent == 2 and first_new.step > v2.step
    assert newest.offsets() == {0: 12}, "the inputs after v2 were trained again, then the rest"
    ck.verify_version(ck.version_dir(weights, policy, newest.version))
    assert ck.newest_valid(weights, policy).version == newest.version  # type: ignore[union-attr]


def test_steps_that_train_nothing_do_not_make_versions(
    kafka_settings: Settings,
    admin,
    unique: str,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """Masked samples are consumed and recorded, but an identical version is published only
    when the trainer stops (to keep their bookkeeping), not once per step."""
    topic, policy = f"test.trainer.noop.{unique}", f"p-{unique}"
    create_topic(admin, topic, 1)
    rng = random.Random(5)
    masked = [make_sample(i, policy, rng, masked=True, loss_mask=[0, 0, 0, 0]) for i in range(6)]
    produce(kafka_settings, topic, masked)
    tiny = ensure_tiny_model(tmp_path / "model" / "tiny")
    cmd = trainer_cmd(tiny, topic, policy, tmp_path, idle_s=1.5)
    out = run_to_idle(cmd, kafka_settings, tmp_path / "t1.log")
    weights = tmp_path / "weights"
    assert ck.versions(weights, policy) == [1], out  # two no-op steps, one closing version
    assert ck.read_manifest(weights, policy, 1).offsets() == {0: 6}

    produce(kafka_settings, topic, [make_sample(i, policy, rng) for i in range(6, 12)])
    run_to_idle(cmd, kafka_settings, tmp_path / "t2.log")
    assert ck.versions(weights, policy) == [1, 2, 3]  # trained steps: a version each


def test_a_sample_sent_twice_is_trained_once_across_restarts(
    kafka_settings: Settings,
    admin,
    unique: str,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """Processors run at-least-once (``--at-least-once``, or a reader of uncommitted records)
    can re-send a session's samples with the same ids; the trainer trains each id once, also
    after its own restart."""
    from deltalake import DeltaTable

    topic, policy = f"test.trainer.dedup.{unique}", f"p-{unique}"
    create_topic(admin, topic, 1)
    rng = random.Random(7)
    first = [make_sample(i, policy, rng) for i in range(6)]
    produce(kafka_settings, topic, [*first, first[1], first[4]])
    tiny = ensure_tiny_model(tmp_path / "model" / "tiny")
    cmd = trainer_cmd(tiny, topic, policy, tmp_path, idle_s=1.5)
    out = run_to_idle(cmd, kafka_settings, tmp_path / "t1.log")
    assert "2 duplicates skipped" in out, out
    produce(kafka_settings, topic, [first[0], make_sample(6, policy, rng), first[5]])
    out = run_to_idle(cmd, kafka_settings, tmp_path / "t2.log")
    assert "2 duplicates skipped" in out, out
    rows = DeltaTable(str(tmp_path / "lake" / "trajectories")).to_pyarrow_table().to_pylist()
    ids = sorted(r["event_id"] for r in rows)
    assert ids == sorted(f"sample-{i:04d}" for i in range(7))
