"""``liverl train`` asked to stop while its broker is gone exits within its bound (issue 11),
without leaving a half-written version behind."""

from __future__ import annotations

import dataclasses
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
from click.testing import CliRunner
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from pipeline.kafka import names, topics
from pipeline.kafka.broker import LocalBroker
from pipeline.models.tiny import ensure_tiny_model
from pipeline.settings import BrokerSettings, Settings
from pipeline.stack import free_port
from pipeline.trainer import checkpoint as ck
from pipeline.trainer.commands import train

from .test_trainer_exactly_once import ROOT, make_sample, produce, wait_for

BOUND_S = 4.0  # LIVERL_TRAINER_SHUTDOWN_S for this test


def dead_letter_arrived(settings: Settings, timeout: float) -> bool:
    c = Consumer(settings.kafka_client_config(**{"group.id": "shutdown-dlq"}))
    c.assign([TopicPartition(names.DLQ, p, 0) for p in range(3)])
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if any(m.error() is None for m in c.consume(10, timeout=0.5)):
                return True
        return False
    finally:
        c.close()


@pytest.mark.integration
def test_sigterm_with_the_broker_gone_exits_within_the_bound(tmp_path: Path) -> None:
    broker = BrokerSettings(port=free_port(), controller_port=free_port())
    settings = Settings(state_dir=tmp_path / "state", broker=broker)
    settings.kafka.bootstrap = None  # this test's own broker, even under LIVERL_KAFKA_BOOTSTRAP
    local = LocalBroker(settings)
    local.up(quiet=True)
    proc: subprocess.Popen[str] | None = None
    try:
        admin = AdminClient(settings.kafka_client_config())
        wanted = (names.SAMPLES, names.DLQ, names.WEIGHTS, names.GRADIENT_STEPS)
        specs = [s for s in topics.load_specs(settings.topics.specs_dir) if s.name in wanted]
        topics.apply(admin, topics.plan(admin, specs))
        # One session, so one partition and one order: three good samples make the one batch
        # (--batch-samples 3), then one the trainer dead-letters. Seeing that letter means the
        # batch was admitted, and a batch that is admitted is trained in the same iteration.
        rng = random.Random(3)
        good = [make_sample(i, "p", rng, session_id="one") for i in range(3)]
        bad = dataclasses.replace(good[0], event_id="bad", response_token_ids=[10**9] * 4)
        produce(settings, names.SAMPLES, [*good, bad])
        weights = tmp_path / "weights"
        cmd = [
            sys.executable,
            "-m",
            "pipeline.trainer.commands",
            "--policy",
            "p",
            "--method",
            "rl",  # the old default: these samples carry rewards, not hints
            "--model",
            str(ensure_tiny_model(tmp_path / "tiny")),
            "--device",
            "cpu",
            "--weights-root",
            str(weights),
            "--lake-root",
            str(tmp_path / "lake"),
            "--batch-samples",
            "3",
            "--batch-wait",
            "0.05",
            "--lr",
            "1e-3",
            # nothing is published until the stop: the stop's publish finds Kafka gone
            "--publish-every-steps",
            "1000",
            "--publish-every-s",
            "1000",
        ]
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("LIVERL_")},
            "PYTHONUNBUFFERED": "1",
            "LIVERL_KAFKA_BOOTSTRAP": settings.bootstrap,
            "LIVERL_TRAINER_SHUTDOWN_S": str(BOUND_S),
        }
        log = tmp_path / "trainer.err"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True
            )
        lines: queue.Queue[str] = queue.Queue()
        out = proc.stdout
        assert out is not None
        threading.Thread(target=lambda: [lines.put(ln) for ln in out], daemon=True).start()
        assert wait_for(lines, "trainer ready", proc, timeout=120), log.read_text()[-3000:]
        assert dead_letter_arrived(settings, 60), log.read_text()[-3000:]

        os.kill(local.pid(), signal.SIGKILL)  # type: ignore[arg-type]
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=3 * BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"running {3 * BOUND_S:g}s after SIGTERM:\n{log.read_text()[-3000:]}")
        took = time.monotonic() - started
        print(f"exited {took:.1f}s after SIGTERM (bound {BOUND_S:g}s), code {proc.returncode}")
        errors = log.read_text()
        said = "".join(lines.get() for _ in range(lines.qsize()))
        assert "Traceback" not in errors, errors[-3000:]
        # the stop's publish waited on Kafka, and was cut short
        assert "not stopped" in errors, said + errors[-3000:]
        for v in ck.versions(weights, "p"):  # no half version: any v<N> folder is whole
            ck.verify_version(ck.version_dir(weights, "p", v))
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        local.down(quiet=True)


STUCK = """
import signal, sys, time
from pipeline.trainer.loop import install_signal_handlers

class Loop:  # a trainer whose stop never finishes
    def stop(self, *_):
        print("stopping", flush=True)

install_signal_handlers(Loop(), shutdown_s=float(sys.argv[1]))
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def stuck_trainer(bound: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK, str(bound)],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_stop_that_hangs_ends_at_the_bound_or_a_second_signal() -> None:
    proc = stuck_trainer(2.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "not stopped after 2s" in err, err
    proc = stuck_trainer(600.0)  # Ctrl-C twice: no waiting for the bound
    proc.send_signal(signal.SIGINT)
    assert proc.stdout is not None and proc.stdout.readline() == "stopping\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert "not stopped after a second signal" in err, err


def test_a_bad_shutdown_bound_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIVERL_TRAINER_SHUTDOWN_S", "soon")
    roots = ["--weights-root", str(tmp_path / "w"), "--lake-root", str(tmp_path / "l")]
    result = CliRunner().invoke(train, roots, obj={"settings": Settings()})
    assert result.exit_code == 2 and "LIVERL_TRAINER_SHUTDOWN_S" in result.output
    assert "Traceback" not in result.output
