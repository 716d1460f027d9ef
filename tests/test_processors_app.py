"""The wiring of the processors app (app.py): which agents and timers exist, and what the
settings reach in Faust's producer. The agents themselves: tests/test_processors_agents.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.processors.app import create_app
from pipeline.processors.config import ProcessorSettings
from pipeline.settings import Settings


def _app(tmp_path: Path, **cfg: object):  # type: ignore[no-untyped-def]
    app = create_app(Settings(), ProcessorSettings(web_enabled=False, **cfg), tmp_path)
    app.finalize()
    return app


def test_inline_judge_wires_the_session_and_group_agents_only(tmp_path: Path) -> None:
    app = _app(tmp_path, judge="rules")
    assert sorted(a.name for a in app.liverl_agents) == ["group", "session"]
    assert sorted(app.liverl_timers) == ["expire_state", "group_sweep", "session_sweep"]
    assert {t.name for t in app.tables.values()} >= {"sessions", "tokens", "parked", "groups"}
    assert "judging" not in {t.name for t in app.tables.values()}


def test_a_judge_agent_comes_with_its_tables_and_timers(tmp_path: Path) -> None:
    app = _app(tmp_path, judge="llm", llm_base_url="http://127.0.0.1:9/v1")
    assert sorted(a.name for a in app.liverl_agents) == ["group", "judge", "session"]
    assert {"judge_grace", "expire_judge_state"} <= set(app.liverl_timers)
    assert {"judging", "judge_parked"} <= {t.name for t in app.tables.values()}


@pytest.mark.parametrize(("env", "linger_ms"), [(None, 20), ("0", 0), ("45.5", 45)])
def test_produce_linger_reaches_the_producer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: str | None, linger_ms: int
) -> None:
    if env is not None:
        monkeypatch.setenv("LIVERL_PROCESSORS_PRODUCE_LINGER_MS", env)
    app = _app(tmp_path)
    # Faust hands the producer int(producer_linger * 1000) as aiokafka's linger_ms.
    assert app.producer.linger_ms == linger_ms


def test_produce_linger_is_bounded() -> None:
    with pytest.raises(ValueError, match="produce_linger_ms"):
        ProcessorSettings(produce_linger_ms=-1)
    with pytest.raises(ValueError, match="produce_linger_ms"):
        ProcessorSettings(produce_linger_ms=5000)
