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


def test_the_kafka_layer_does_not_load_the_composed_settings() -> None:
    """Settings sit on top: the Kafka layer and each component's section import without it."""
    import subprocess
    import sys

    modules = [
        "pipeline.kafka.connection",
        "pipeline.kafka.producer",
        "pipeline.kafka.consumer",
        "pipeline.kafka.broker",
        "pipeline.kafka.topics",
        "pipeline.kafka.inspect",
        "pipeline.kafka.tap",
        "pipeline.processors.config",
        "pipeline.serving.settings",
        "pipeline.trainer.config",
        "pipeline.versions.config",
    ]
    code = (
        f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        "print('pipeline.settings' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_connection_resolves_the_bootstrap_and_carries_the_kafka_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.kafka import producer as producer_mod
    from pipeline.kafka.connection import ConnectionSettings
    from pipeline.kafka.producer import EventProducer

    _clean_env(monkeypatch)
    monkeypatch.setenv("LIVERL_CONFIG", "/nonexistent/liverl.toml")
    monkeypatch.setenv("LIVERL_BROKER_NODES", "3")
    monkeypatch.setenv("LIVERL_KAFKA_MAX_EVENT_BYTES", str(2**20))
    monkeypatch.setenv("LIVERL_TOPICS_SPECS_DIR", str(tmp_path))
    local = Settings().connection
    assert local.bootstrap == "127.0.0.1:9092,127.0.0.1:9094,127.0.0.1:9096"
    assert (local.max_record_bytes, local.max_fetch_bytes) == (2 * 2**20, 3 * 2**20)
    assert local.specs_dir == tmp_path

    monkeypatch.setenv("LIVERL_KAFKA_BOOTSTRAP", "kafka-1:9092")
    monkeypatch.setenv("LIVERL_KAFKA_CLIENT", '{"security.protocol": "SASL_SSL"}')
    settings = Settings()
    conn = settings.connection
    assert conn.bootstrap == "kafka-1:9092"
    assert (
        conn.client_config(**{"group.id": "g"})
        == settings.kafka_client_config(**{"group.id": "g"})
        == {"bootstrap.servers": "kafka-1:9092", "security.protocol": "SASL_SSL", "group.id": "g"}
    )

    confs: list[dict] = []
    monkeypatch.setattr(producer_mod, "Producer", lambda conf: confs.append(conf))
    EventProducer(settings, client_id="a")
    EventProducer(
        ConnectionSettings(
            bootstrap="kafka-1:9092",
            client={"security.protocol": "SASL_SSL"},
            max_event_bytes=2**20,
        ),
        client_id="a",
    )
    for conf in confs:
        conf.pop("error_cb")
    assert confs[0] == confs[1]
    assert confs[0]["message.max.bytes"] == 2 * 2**20


def test_the_forget_section_is_read_from_the_file_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``[forget]`` sat outside Settings: a table in liverl.toml was silently ignored."""
    for k in [k for k in os.environ if k.startswith("LIVERL_")]:
        monkeypatch.delenv(k)
    toml = tmp_path / "liverl.toml"
    toml.write_text("[forget]\nvacuum_retention_hours = 6\n")
    assert load_settings(toml).forget.vacuum_retention_hours == 6
    monkeypatch.setenv("LIVERL_FORGET_VACUUM_RETENTION_HOURS", "0")
    assert load_settings(toml).forget.vacuum_retention_hours == 0  # the environment wins
    assert Settings().forget.vacuum_retention_hours == 0
    monkeypatch.delenv("LIVERL_FORGET_VACUUM_RETENTION_HOURS")
    assert Settings().forget.vacuum_retention_hours == 24


def test_unknown_keys_in_the_file_are_refused_with_the_key_and_its_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typo in liverl.toml used to be dropped silently (every section ignored extra keys)."""
    from click.testing import CliRunner

    from pipeline.cli import cli

    _clean_env(monkeypatch)
    toml = tmp_path / "liverl.toml"
    toml.write_text(
        'statedir = "/srv"\n[trainer]\nlr = 1e-4\ngate_budget_fluencyy = 0.5\n'
        "[broker]\nport = 19092\n[bogus]\nx = 1\n"
    )
    with pytest.raises(ValueError) as err:
        load_settings(toml)
    said = str(err.value)
    assert said.startswith(
        f"{toml}: unknown key 'statedir' in the top level; did you mean 'state_dir'?"
    )
    assert (
        "unknown key 'gate_budget_fluencyy' in [trainer]; did you mean 'gate_budget_fluency'?"
    ) in said
    assert "unknown key 'bogus' in the top level" in said and "lr" not in said.split(";")[0]
    assert "\n" not in said
    out = CliRunner().invoke(cli, ["--config", str(toml), "status"])
    assert out.exit_code == 1 and "unknown key 'statedir'" in out.output
    assert "Traceback" not in out.output

    # What every section takes still loads: nested sections, dict fields with any key, and
    # LIVERL_* variables that are no setting (only the file is checked).
    toml.write_text(
        'state_dir = "/srv"\n[trainer]\nlr = 1e-4\n[trainer.gate_judge_weights]\n'
        'anything = 2.0\n[kafka.client]\n"sasl.mechanism" = "PLAIN"\n'
        "[canary]\nmin_sessions = 5\n"
    )
    monkeypatch.setenv("LIVERL_TRAINER_CRASH_AT", "after_events")
    settings = load_settings(toml)
    assert settings.trainer.lr == 1e-4 and settings.canary.min_sessions == 5
    assert settings.trainer.gate_judge_weights == {"anything": 2.0}
