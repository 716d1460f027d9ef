"""Settings precedence: defaults < TOML file < LIVERL_* environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.settings import Settings, load_settings


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("LIVERL_"):
            monkeypatch.delenv(name)


def test_defaults_use_the_embedded_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    monkeypatch.setenv("LIVERL_CONFIG", "/nonexistent/liverl.toml")
    settings = Settings()
    assert settings.uses_local_broker
    assert settings.bootstrap == "127.0.0.1:9092"


def test_toml_then_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "liverl.toml"
    cfg.write_text(
        'state_dir = "/srv/liverl"\n[broker]\nport = 19092\nheap_mb = 768\n'
        '[kafka.client]\n"sasl.mechanism" = "SCRAM-SHA-512"\n'
    )
    _clean_env(monkeypatch)
    monkeypatch.setenv("LIVERL_BROKER_PORT", "29092")
    settings = load_settings(cfg)
    assert settings.state_dir == Path("/srv/liverl")
    assert settings.broker.port == 29092, "environment beats the file"
    assert settings.broker.heap_mb == 768
    assert settings.bootstrap == "127.0.0.1:29092"
    assert settings.kafka_client_config()["sasl.mechanism"] == "SCRAM-SHA-512"


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


def test_heap_above_one_gib_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIVERL_BROKER_HEAP_MB", "4096")
    with pytest.raises(ValueError, match="heap_mb"):
        Settings()
