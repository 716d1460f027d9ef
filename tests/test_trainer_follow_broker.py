"""The trainer follows the operator on the real broker (pipeline/trainer/follow.py): after
``liverl versions rollback`` the next version it publishes has the rolled-back-to version as
its parent; ``pin`` pauses it (samples sent meanwhile wait), ``unpin`` resumes it, and every
sample is trained exactly once (one ``trajectories`` row per sample id)."""

from __future__ import annotations

import queue
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from deltalake import DeltaTable

from pipeline import events
from pipeline.kafka import names
from pipeline.kafka.reader import read_to_end
from pipeline.models.tiny import ensure_tiny_model
from pipeline.settings import Settings
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.loop import TrainerLoop
from pipeline.versions import reading
from pipeline.versions.commands import versions
from pipeline.versions.rule import require_promoted

from .conftest import create_topic
from .test_trainer_exactly_once import make_sample, produce

pytestmark = pytest.mark.integration


def wait_line(lines: queue.Queue[str], text: str, timeout: float = 120.0) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if text in line:
            return line
    return None


def act(settings: Settings, *args: str) -> None:
    out = CliRunner().invoke(versions, [*args, "--by", "tester"], obj={"settings": settings})
    assert out.exit_code == 0, out.output


def trainer_statuses(settings: Settings, policy: str) -> list[events.TrainerStatus]:
    got: list[events.TrainerStatus] = []

    def handle(msg: Any) -> None:
        ev = events.decode(msg.value(), expected_type="trainer_status")
        if isinstance(ev, events.TrainerStatus) and ev.policy_id == policy:
            got.append(ev)

    read_to_end(settings, [names.TRAINER_STATUS], handle, group_prefix="test-follow-")
    return got


def test_rollback_pin_unpin_on_a_live_trainer(
    kafka_settings: Settings, admin: Any, unique: str, tmp_path: Path
) -> None:
    policy = f"follow-{unique}"
    topic = f"test.follow.samples.{unique}"
    create_topic(admin, topic, 2)
    # the gate off: every candidate serves (the gateways' rule with trainer.gate = false)
    settings = kafka_settings.model_copy(
        update={"trainer": kafka_settings.trainer.model_copy(update={"gate": False})}
    )
    assert require_promoted(settings) is False
    cfg = TrainerSettings(
        policy=policy,
        model=str(ensure_tiny_model(tmp_path / "tiny")),
        method="rl",
        input_topic=topic,
        weights_root=tmp_path / "weights",
        lake_root=tmp_path / "lake",
        device="cpu",
        gate=False,
        batch_max_samples=3,
        batch_max_wait_s=0.05,
        publish_every_steps=1,
        publish_max_overhead=1.0,
        lr=1e-3,
        max_staleness=1000,
        progress_every_s=0.5,
        canary_share=0.0,  # every version serves everyone once servable: following is tested
    )
    lines: queue.Queue[str] = queue.Queue()
    loop = TrainerLoop(settings, cfg, echo=lines.put, require_promoted=False)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    rng = random.Random(7)
    samples = [make_sample(i, policy, rng) for i in range(18)]
    try:
        assert wait_line(lines, "trainer ready")
        produce(settings, topic, samples[:9])
        deadline = time.monotonic() + 120
        while loop.stats.samples < 9 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert loop.stats.samples == 9
        while loop.stats.published < 3 and time.monotonic() < deadline:
            time.sleep(0.1)  # 9 samples in batches of at most 3: 3 versions or more
        before = reading.weights_log(settings, policy)
        newest = max(before.manifests)
        assert newest >= 3 and loop.stats.published == newest

        act(settings, "rollback", "--to", "1", "--policy", policy, "--reason", "regressed")
        said = wait_line(lines, "serves after rollback")
        assert said == ("v1 serves after rollback by tester (regressed): training goes on from v1")
        produce(settings, topic, samples[9:12])
        while loop.stats.samples < 12 and time.monotonic() < deadline + 60:
            time.sleep(0.1)
        assert wait_line(lines, f"published v{newest + 1}")
        log = reading.weights_log(settings, policy)
        assert log.manifests[newest + 1].parent == 1  # trained on from what serves
        assert log.live(False) == max(log.manifests)  # and it serves: published after

        act(settings, "pin", str(newest + 1), "--policy", policy)
        assert wait_line(lines, "training paused")
        published = loop.stats.published
        produce(settings, topic, samples[12:18])
        time.sleep(3.0)  # room for a trainer that did not pause to train them
        assert loop.stats.samples == 12 and loop.stats.published == published
        paused = [s for s in trainer_statuses(settings, policy) if s.state == "paused"]
        assert paused and paused[-1].pinned_version == newest + 1

        act(settings, "unpin", "--policy", policy)
        assert wait_line(lines, "training resumes")
        while loop.stats.samples < 18 and time.monotonic() < deadline + 180:
            time.sleep(0.1)
        assert loop.stats.samples == 18
    finally:
        loop.stop()
        thread.join(timeout=60)
    assert not thread.is_alive()
    rows = (
        DeltaTable(str(tmp_path / "lake" / "trajectories"))
        .to_pyarrow_table(columns=["event_id", "weight_version"])
        .to_pylist()
    )
    ids = sorted(r["event_id"] for r in rows)
    assert ids == sorted(s.event_id for s in samples)  # every sample once, none twice
    log = reading.weights_log(settings, policy)
    pin = next(i for i, ev in enumerate(log.events) if (ev.action or {}).get("kind") == "pin")
    unpin = next(i for i, ev in enumerate(log.events) if (ev.action or {}).get("kind") == "unpin")
    assert all(ev.action is not None for ev in log.events[pin : unpin + 1])  # nothing published
    statuses = trainer_statuses(settings, policy)
    assert statuses[-1].state == "stopped" and statuses[-1].samples == 18
