"""Exactly-once training under SIGKILL, and bad input to the DLQ (real broker, real Delta).

A fixed stream of samples goes to a unique topic with the samples topic's partition count;
the trainer runs as a subprocess and is killed at random moments, then restarted. At the
end every sample is in ``trajectories`` exactly once, with the step that consumed it, and
versions and steps are contiguous.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from deltalake import DeltaTable

from pipeline import events
from pipeline.events import Producer, Sample
from pipeline.kafka import EventProducer, names
from pipeline.models.tiny import ensure_tiny_model
from pipeline.settings import Settings
from pipeline.trainer import checkpoint as ck

from .conftest import create_topic

pytestmark = pytest.mark.integration

PARTITIONS = 6  # topics/samples.yaml
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def make_sample(i: int, policy: str, rng: random.Random, **overrides: object) -> Sample:
    response = [rng.randrange(10, 400) for _ in range(4)]
    fields: dict[str, object] = {
        "event_id": f"sample-{i:04d}",
        "producer": Producer(component="test", version="0"),
        "session_id": f"sess-{i % 17}",
        "turn": i,
        "policy_id": policy,
        "prompt_token_ids": [1, *[rng.randrange(10, 400) for _ in range(6)], 2],
        "response_token_ids": response,
        "loss_mask": [1] * len(response),
        "behavior_logprobs": [-6.0] * len(response),
        "reward": rng.choice([-1.0, 1.0]),
        "hints": [],
        "behavior_weight_version": 0,
    }
    fields.update(overrides)
    return Sample(**fields)  # type: ignore[arg-type]


def produce(settings: Settings, topic: str, samples: list[Sample]) -> None:
    producer = EventProducer(settings, client_id="test-samples")
    for s in samples:
        producer.send(topic, s)
    producer.flush()


def trainer_cmd(tiny: Path, topic: str, policy: str, root: Path, idle_s: float) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pipeline.trainer.commands",
        "--policy",
        policy,
        # Binary RL (the old default): these samples carry rewards, not hints
        "--method",
        "rl",
        "--model",
        str(tiny),
        "--topic",
        topic,
        "--weights-root",
        str(root / "weights"),
        "--lake-root",
        str(root / "lake"),
        "--batch-samples",
        "3",
        "--batch-wait",
        "0.05",
        "--publish-every-steps",
        "1",
        "--publish-max-overhead",
        "1",
        "--lr",
        "1e-3",
        "--device",
        "cpu",
        "--exit-when-idle",
        str(idle_s),
        # Exactly-once of the steps and versions themselves; the gate's verdicts and votes
        # across crashes are tests/test_trainer_gate.py's (it would slow each version here).
        "--no-gate",
    ]


def start(cmd: list[str], settings: Settings, log: Path) -> tuple[subprocess.Popen, queue.Queue]:  # type: ignore[type-arg]
    env = dict(os.environ, PYTHONUNBUFFERED="1", LIVERL_KAFKA_BOOTSTRAP=settings.bootstrap)
    with open(log, "ab") as err:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True
        )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def wait_for(lines: queue.Queue, text: str, proc: subprocess.Popen, timeout: float) -> bool:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if text in lines.get(timeout=0.2):
                return True
        except queue.Empty:
            if proc.poll() is not None:
                return False
    return False


def read_table(root: Path, name: str) -> list[dict]:  # type: ignore[type-arg]
    return DeltaTable(str(root / "lake" / name)).to_pyarrow_table().to_pylist()


def end_offsets(settings: Settings, topic: str) -> dict[int, int]:
    c = Consumer(settings.kafka_client_config(**{"group.id": "wm"}))
    try:
        return {
            p: c.get_watermark_offsets(TopicPartition(topic, p), 10)[1] for p in range(PARTITIONS)
        }
    finally:
        c.close()


def test_sigkill_at_random_points_trains_each_sample_once(
    kafka_settings: Settings, admin, unique: str, tiny: Path, tmp_path: Path
) -> None:
    topic, policy = f"test.trainer.{unique}", f"p-{unique}"
    create_topic(admin, topic, PARTITIONS)
    rng = random.Random(7)
    samples = [make_sample(i, policy, rng) for i in range(90)]
    produce(kafka_settings, topic, samples)
    cmd = trainer_cmd(tiny, topic, policy, tmp_path, idle_s=2.0)
    log = tmp_path / "trainer.log"

    kills, attempts, progress = 0, 0, []
    while kills < 10 and attempts < 25:
        attempts += 1
        proc, lines = start(cmd, kafka_settings, log)
        if not wait_for(lines, "trainer ready", proc, timeout=90):
            proc.kill()
            proc.wait()
            pytest.fail(f"trainer did not start:\n{log.read_text()[-3000:]}")
        # Kill after a random number of versions (0-2) plus a little, so kills land before
        # the first step, mid-step and inside the publish protocol, whatever the speed.
        for _ in range(rng.randint(0, 2)):
            if not wait_for(lines, "published v", proc, timeout=60):
                break
        time.sleep(rng.uniform(0.0, 0.15))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        progress.append(len(ck.versions(tmp_path / "weights", policy)))
    assert kills >= 10
    # The kills landed at different points of the stream, not all before the first step.
    assert len(set(progress)) >= 3, progress

    proc, lines = start(cmd, kafka_settings, log)
    assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]

    rows = read_table(tmp_path, "trajectories")
    ids = [r["event_id"] for r in rows]
    assert sorted(ids) == sorted(s.event_id for s in samples)  # each exactly once
    steps = read_table(tmp_path, "gradient_steps")
    step_version = {r["step"]: r["published_version"] for r in steps}
    assert sorted(step_version) == list(range(1, len(steps) + 1))  # unique, contiguous
    for r in rows:
        assert step_version[r["step"]] == r["weight_version"]
    per_step = {s: sum(r["step"] == s for r in rows) for s in step_version}
    assert all(1 <= n <= 3 for n in per_step.values())
    weights = sorted(r["version"] for r in read_table(tmp_path, "weights"))
    assert weights == list(range(1, len(weights) + 1))
    assert ck.versions(tmp_path / "weights", policy) == weights
    newest = ck.latest_manifest(tmp_path / "weights", policy)
    assert newest is not None and newest.offsets() == end_offsets(kafka_settings, topic)
    ck.verify_version(ck.version_dir(tmp_path / "weights", policy, newest.version))


def _dlq_for(settings: Settings, topic: str, expected: int) -> list[events.DeadLetter]:
    c = Consumer(settings.kafka_client_config(**{"group.id": f"dlq-{topic}"}))
    md = c.list_topics(names.DLQ, timeout=10)
    c.assign([TopicPartition(names.DLQ, p, 0) for p in md.topics[names.DLQ].partitions])
    found: list[events.DeadLetter] = []
    deadline = time.monotonic() + 30
    while len(found) < expected and time.monotonic() < deadline:
        for msg in c.consume(500, timeout=1.0):
            if msg.error() is None:
                letter = events.decode(msg.value(), expected_type="dlq")
                if letter.source_topic == topic:  # type: ignore[attr-defined]
                    found.append(letter)  # type: ignore[arg-type]
    c.close()
    return found


def test_bad_samples_go_to_dlq_and_training_goes_on(
    kafka_settings: Settings, admin, unique: str, tiny: Path, tmp_path: Path
) -> None:
    topic, policy = f"test.trainer.bad.{unique}", f"p-{unique}"
    create_topic(admin, topic, 1)
    rng = random.Random(3)
    good = [make_sample(i, policy, rng) for i in range(5)]
    too_big = make_sample(100, policy, rng, response_token_ids=[5, 6, 99_999, 7])
    mismatch = make_sample(101, policy, rng, loss_mask=[1, 1])
    # Codec v1: a v2 reader already rejects tied lengths at decode; v1 leaves it to the trainer.
    v1 = kafka_settings.model_copy(deep=True)
    v1.kafka.codec_version = 1
    produce(v1, topic, [good[0], too_big, good[1], mismatch, *good[2:]])
    log = tmp_path / "trainer.log"
    proc, _ = start(trainer_cmd(tiny, topic, policy, tmp_path, idle_s=1.5), kafka_settings, log)
    assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]

    rows = read_table(tmp_path, "trajectories")
    assert sorted(r["event_id"] for r in rows) == sorted(s.event_id for s in good)
    letters = {
        dl.original_b64 and events.decode(dl.original()).event_id: dl
        for dl in _dlq_for(kafka_settings, topic, 2)
    }
    assert set(letters) == {too_big.event_id, mismatch.event_id}
    assert "exceeds the vocabulary" in letters[too_big.event_id].error
    assert "lengths disagree" in letters[mismatch.event_id].error
    newest = ck.latest_manifest(tmp_path / "weights", policy)
    assert newest is not None and newest.offsets() == {0: 7}
