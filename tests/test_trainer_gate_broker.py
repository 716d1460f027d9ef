"""The promotion gate on the real broker: the trainer (a subprocess, gate on by default) learns a
task and its candidate is promoted and served; a candidate trained to break the capability probe
is rejected and never reaches the gateway's backend, and every vote is on its topic exactly once,
read committed by a plain consumer."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from pipeline import events
from pipeline.kafka import EventProducer, names
from pipeline.models.tiny import ensure_tiny_model
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.reloader import Reloader
from pipeline.settings import Settings
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.core import TrainerCore

from .conftest import create_topic
from .test_serving_hf import FakeRecorder
from .test_trainer_gate import digit_probe, toy_batches

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def read_all(settings: Settings, topic: str, policy: str) -> list[events.Event]:
    """Every event of ``policy`` on ``topic``, read committed from the beginning."""
    c = Consumer(
        settings.kafka_client_config(
            **{
                "group.id": f"gate-read-{time.time_ns()}",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
            }
        )
    )
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), 10)[1] for p in parts}
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out: list[events.Event] = []
        pos = dict.fromkeys(parts, 0)
        deadline = time.monotonic() + 30
        while any(pos[p] < ends[p] for p in parts) and time.monotonic() < deadline:
            for msg in c.consume(500, timeout=0.5):
                if msg.error() is not None:
                    continue
                pos[msg.partition()] = msg.offset() + 1
                if msg.key() == policy.encode():
                    out.append(events.decode(msg.value()))
        return out
    finally:
        c.close()


def test_rejected_candidate_is_never_served(
    kafka_settings: Settings,
    admin,
    tiny: Path,
    tmp_path: Path,
    unique: str,  # type: ignore[no-untyped-def]
) -> None:
    policy, topic = f"gate-{unique}", f"test.samples.gate.{unique}"
    create_topic(admin, topic)
    probe = digit_probe(tmp_path)
    cfg = TrainerSettings(model=str(tiny), device="cpu", gate_holdout=0.3, lr=2e-2, method="rl")
    core = TrainerCore.load(cfg)
    rng = random.Random(1)
    good = [r.event for b in toy_batches(core, 6, 0, rng) for r in b]
    bad = [r.event for b in toy_batches(core, 6, 1000, rng, invert=True) for r in b]
    producer = EventProducer(kafka_settings, client_id="test-gate")

    def send(samples: list[events.Event]) -> None:
        for s in samples:
            producer.send(topic, dataclasses.replace(s, policy_id=policy))
        producer.flush()

    # The gateway side: a backend following the weights topic with the serving default
    # (promoted versions only, because the trainer's gate is on by default).
    backend = HFBackend(tiny, policy_id=policy, workers=1)
    assert Settings().trainer.gate and Settings().serve.require_promoted is None
    rec = FakeRecorder()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    reloader = Reloader(
        kafka_settings,
        backend,
        loop,
        replica_id=f"r-{unique}",
        require_promoted=kafka_settings.trainer.gate,
        emit=rec.record,
    )
    reloader.start()
    cmd = [
        sys.executable,
        "-m",
        "pipeline.trainer.commands",
        "--policy",
        policy,
        "--model",
        str(tiny),
        "--topic",
        topic,
        "--weights-root",
        str(tmp_path / "weights"),
        "--lake-root",
        str(tmp_path / "lake"),
        "--batch-samples",
        "16",
        "--batch-wait",
        "0.05",
        "--publish-every-steps",
        "6",
        "--publish-max-overhead",
        "1",
        "--lr",
        "2e-2",
        "--device",
        "cpu",
        "--method",
        "rl",
        "--gate-holdout",
        "0.3",
        "--gate-probe-file",
        str(probe),
        "--gate-probe-tolerance",
        "0",
        "--exit-when-idle",
        "25",
    ]
    log = (tmp_path / "trainer.log").open("wb")  # noqa: SIM115 - the child writes it throughout
    try:
        send(good)
        # no canary: a promoted version serves everyone at once, which is what this checks
        env = {**os.environ, "LIVERL_TRAINER_CANARY_SHARE": "0"}
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 240
        while backend.version < 1 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert backend.version == 1, (tmp_path / "trainer.log").read_text()[-3000:]
        send(bad)
        assert proc.wait(timeout=300) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        time.sleep(3)  # the reloader has seen every verdict
    finally:
        reloader.close()
        loop.call_soon_threadsafe(loop.stop)
        log.close()

    weights = [
        e
        for e in read_all(kafka_settings, names.WEIGHTS, policy)
        if isinstance(e, events.WeightsPublished)
    ]
    status = {(e.version, e.status) for e in weights}
    assert (1, "promoted") in status and (2, "rejected") in status, status
    assert backend.version == 1  # v2 was rejected: never loaded
    loaded = [e.version for _, e in rec.events if isinstance(e, events.ServingStatus) and e.ok]
    assert 2 not in loaded and loaded == [1]
    text = (tmp_path / "trainer.log").read_text()
    assert "v2 rejected: training goes on from live v1" in text
    votes = [
        e
        for e in read_all(kafka_settings, names.GATE_VOTES, policy)
        if isinstance(e, events.GateVote)
    ]
    v2 = [e for e in votes if e.version == 2]
    assert v2 and len(v2) == len({e.event_id for e in v2})  # once each, by id
    assert any(e.judge == "capability" and e.vote == -1 for e in v2)
