"""Recording survives a Kafka outage: every interaction arrives exactly once, in order."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient

from pipeline import events
from pipeline.kafka import names, topics
from pipeline.kafka.broker import LocalBroker
from pipeline.serving.build import build_app
from pipeline.serving.settings import ServeSettings
from pipeline.serving.testing import free_port, running
from pipeline.settings import BrokerSettings, Settings

MODEL = "liverl-tiny-v1"


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def _wait(cond, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.integration
def test_outage_spools_and_drains_exactly_once(tmp_path: Path) -> None:
    broker_cfg = BrokerSettings(port=free_port(), controller_port=free_port())
    settings = Settings(state_dir=tmp_path / "state", broker=broker_cfg)
    local = LocalBroker(settings)
    try:
        local.up(quiet=True)
        admin = AdminClient(settings.kafka_client_config())
        specs = [
            s
            for s in topics.load_specs(settings.topics.specs_dir)
            if s.name in (names.INTERACTIONS, names.WEIGHTS, names.SERVING_STATUS)
        ]
        topics.apply(admin, topics.plan(admin, specs))
        cfg = ServeSettings(
            model_path="tiny", spool_dir=tmp_path / "spool", delivery_timeout_s=2.0, reload=False
        )
        sent: list[str] = []
        app = build_app(cfg, settings)
        with running(app) as url, httpx.Client(timeout=60) as c:

            def ask(i: int) -> None:
                body = {
                    "model": MODEL,
                    "max_tokens": 3,
                    "messages": [{"role": "user", "content": f"question {i}"}],
                }
                resp = c.post(
                    f"{url}/v1/chat/completions",
                    json=body,
                    headers={"X-Session-Id": f"sess-{i % 3}"},
                )
                assert resp.status_code == 200, resp.text
                sent.append(f"sess-{i % 3}/{resp.headers['x-liverl-turn']}")

            for i in range(6):
                ask(i)
            assert _wait(lambda: _metric(url, "liverl_gateway_record_backlog") == 0, 30)
            local.down(quiet=True)
            for i in range(6, 18):
                ask(i)  # all answered while Kafka is down
            assert _metric(url, "liverl_gateway_record_backlog") > 0
            assert _metric(url, "liverl_gateway_spool_bytes") > 0
            time.sleep(3)  # past the delivery timeout: the failed batch is retried later
            assert _metric(url, "liverl_gateway_record_backlog") > 0
            local.up(quiet=True)
            assert _wait(lambda: _metric(url, "liverl_gateway_record_backlog") == 0, 90)
        assert app.state.recorder.redelivered > 0, "the outage outlasted a delivery timeout"

        consumer = Consumer(
            settings.kafka_client_config(**{"group.id": "verify", "auto.offset.reset": "earliest"})
        )
        consumer.subscribe([names.INTERACTIONS])
        got: list[events.Interaction] = []
        deadline = time.monotonic() + 60
        while len(got) < len(sent) + 5 and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                if len(got) >= len(sent):
                    break
                continue
            if msg.error() is None:
                ev = events.decode(msg.value(), expected_type="interaction")
                assert isinstance(ev, events.Interaction)
                got.append(ev)
        consumer.close()
        found = [f"{e.session_id}/{e.turn}" for e in got]
        assert sorted(found) == sorted(sent), "every interaction exactly once"
        assert len({e.event_id for e in got}) == len(got)
        for s in ("sess-0", "sess-1", "sess-2"):
            turns = [e.turn for e in got if e.session_id == s]
            assert turns == sorted(turns), "order kept within a session"
    finally:
        local.down(quiet=True)
