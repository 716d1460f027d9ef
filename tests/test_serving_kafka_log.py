"""Issue 37, item 2: while the broker is down the gateway's log took 1,367 librdkafka
"Connection refused" lines in 70 s (each client logs every reconnect attempt; the weights
reloader's consumer about 20 a second, printed raw on stderr). The gateway's clients now log
through :class:`FoldedLog`: a line the first time, then at most one line per ``every_s`` for
its repeats, with their count."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import pytest

from pipeline.serving import kafka_log
from pipeline.serving.build import build_app
from pipeline.serving.kafka_log import FoldedLog
from pipeline.serving.settings import ServeSettings
from pipeline.serving.threaded import running
from pipeline.settings import Settings
from pipeline.stack import free_port

REFUSED = (
    "Connect to ipv4#127.0.0.1:{port} failed: Connection refused (after {ms}ms in state CONNECT)"
)


def test_repeats_are_folded_into_one_line_per_period(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    folded = FoldedLog(logging.getLogger("test.folded"), every_s=30, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.folded"):
        n = 100
        for i in range(n):  # 10 s of reconnects, ports and timings varying
            now[0] = i * 0.1
            folded.log(logging.ERROR, "%s [%s] %s", "FAIL", f"producer-{i % 3}",
                       REFUSED.format(port=40000 + i, ms=i % 2))  # fmt: skip
        folded.log(logging.WARNING, "%s [%s] %s", "ERROR", "producer-1", "1/1 brokers are down")
        now[0] = 31.0
        folded.log(logging.ERROR, "%s [%s] %s", "FAIL", "producer-1",
                   REFUSED.format(port=41000, ms=0))  # fmt: skip
        now[0] = 32.0
        folded.log(logging.ERROR, "%s [%s] %s", "FAIL", "producer-1",
                   REFUSED.format(port=41001, ms=0))  # fmt: skip
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (logging.ERROR, "FAIL [producer-0] " + REFUSED.format(port=40000, ms=0)),
        (logging.WARNING, "ERROR [producer-1] 1/1 brokers are down"),  # another kind: at once
        (
            logging.ERROR,
            "FAIL [producer-1] "
            + REFUSED.format(port=41000, ms=0)
            + f" [repeated {n - 1} more time(s) since last logged]",
        ),
    ]


def test_kinds_are_bounded() -> None:
    folded = FoldedLog(logging.getLogger("test.folded.bound"), max_kinds=4)
    for i in range(50):
        folded.log(logging.ERROR, "%s", f"line kind {'x' * i}")
    assert len(folded._next) == 4


def test_a_gateway_with_the_broker_down_logs_few_reconnect_lines(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every Kafka client of the gateway (the recorder's producer, the weights reloader's
    consumer and its dead-letter producer) points at a closed port for 6 s with a turn to
    record: the first "Connection refused" line of each client is logged, the repeats are
    folded (the old gateway logged ~20 lines a second, most of them raw on stderr)."""
    monkeypatch.setattr(kafka_log.GATEWAY_KAFKA_LOG, "_next", {})  # as in a fresh process
    settings = Settings()
    settings.kafka.bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    cfg = ServeSettings(model_path="tiny", spool_dir=tmp_path / "spool", reload=True,
                        turn_recovery_s=0, delivery_timeout_s=2.0)  # fmt: skip
    app = build_app(cfg, settings)
    with caplog.at_level(logging.INFO), running(app) as url:
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "liverl-tiny-v1", "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert answer.status_code == 200  # Kafka down never fails a request
        assert answer.headers["x-liverl-recorded"]  # spooled: recorded later
        time.sleep(6)
    refused = [r.getMessage() for r in caplog.records if "Connection refused" in r.getMessage()]
    raw = [line for line in capfd.readouterr().err.splitlines() if "Connection refused" in line]
    assert not raw, f"librdkafka lines printed raw on stderr: {raw[:3]}"
    assert 1 <= len(refused) <= 4, refused  # one per client, none repeated within 30 s
