"""Topics as code: specs load and validate; apply is idempotent, grows, refuses shrinks."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.kafka import names, topics
from pipeline.settings import Settings

from .conftest import create_topic


def _write(dir_: Path, name: str, partitions: int, retention: str = "86400000") -> None:
    (dir_ / f"{name}.yaml").write_text(
        f"# test topic\nname: {name}\npartitions: {partitions}\nreplication: 1\n"
        f"key: session_id\nvalue_schema: interaction.v1\n"
        f'config:\n  cleanup.policy: delete\n  retention.ms: "{retention}"\n'
    )


def test_repository_specs_cover_the_event_catalog() -> None:
    specs = topics.load_specs(Settings().topics.specs_dir)
    assert sorted(s.name for s in specs) == sorted(names.ALL)
    # every name constant code uses is a declared topic (ALL itself is read from topics/)
    constants = {
        v
        for k, v in vars(names).items()
        if k.isupper() and isinstance(v, str) and v.startswith("liverl.")
    }
    assert constants and constants <= set(names.ALL)
    # and every event type has its dataclass (EVENT_TYPES is found from the classes)
    from pipeline.events import EVENT_TYPES

    assert {s.value_schema.rsplit(".v", 1)[0] for s in specs} == set(EVENT_TYPES)
    session = {s.partitions for s in specs if s.key == "session_id"}
    assert len(session) == 1, "session-keyed topics must be co-partitioned"
    schemas = Path(__file__).resolve().parents[1] / "schemas"
    for spec in specs:
        assert (schemas / f"{spec.value_schema}.json").is_file(), spec.value_schema
    # The size policy is stated once (KafkaSettings); every topic gets its record limit.
    record = Settings().kafka.max_record_bytes
    assert {s.config["max.message.bytes"] for s in specs} == {str(record)}
    for path in Settings().topics.specs_dir.glob("*.yaml"):
        assert "max.message.bytes" not in path.read_text(), path


def test_mismatched_session_partitions_are_rejected(tmp_path: Path) -> None:
    _write(tmp_path, "a", 3)
    _write(tmp_path, "b", 4)
    with pytest.raises(topics.TopicSpecError, match="co-partitioning"):
        topics.load_specs(tmp_path)


def test_spec_missing_fields_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "x.yaml").write_text("name: x\n")
    with pytest.raises(topics.TopicSpecError, match="x.yaml: partitions: Field required"):
        topics.load_specs(tmp_path)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("partition: 3", "partition: Extra inputs are not permitted"),  # a typo, not a default
        ("partitions: 0", "partitions: Input should be greater than or equal to 1"),
        ("partitions: '3'", "partitions: Input should be a valid integer"),
        ("partitions: 3\nreplication: 0", "replication: Input should be greater than or equal"),
    ],
)
def test_spec_values_are_validated(tmp_path: Path, body: str, message: str) -> None:
    (tmp_path / "x.yaml").write_text(f"name: x\nkey: session_id\nvalue_schema: s.v1\n{body}\n")
    with pytest.raises(topics.TopicSpecError, match=message):
        topics.load_specs(tmp_path)


@pytest.mark.integration
def test_apply_is_idempotent_grows_and_refuses_shrink(
    kafka_settings: Settings, admin, unique: str, tmp_path: Path
) -> None:
    name = f"test.topics.{unique}"
    _write(tmp_path, name, 2)
    specs = topics.load_specs(tmp_path)

    first = topics.plan(admin, specs)
    assert [(c.action, c.topic) for c in first.changes] == [("create", name)]
    topics.apply(admin, first)
    second = topics.plan(admin, specs)
    assert second.empty and second.unchanged == [name]

    _write(tmp_path, name, 3, retention="172800000")
    grown = topics.plan(admin, topics.load_specs(tmp_path))
    assert sorted(c.action for c in grown.changes) == ["add_partitions", "alter_config"]
    topics.apply(admin, grown)
    state = topics.describe(admin, [name])[name]
    assert state.partitions == 3
    assert state.config["retention.ms"] == "172800000"
    assert topics.plan(admin, topics.load_specs(tmp_path)).empty

    _write(tmp_path, name, 1)
    shrink = topics.plan(admin, topics.load_specs(tmp_path))
    assert shrink.refusals and "cannot shrink" in shrink.refusals[0]
    with pytest.raises(topics.TopicSpecError, match="refusing"):
        topics.apply(admin, shrink)
    assert topics.describe(admin, [name])[name].partitions == 3


@pytest.mark.integration
def test_cli_apply_twice_then_list(
    kafka_settings: Settings, admin, unique: str, tmp_path: Path
) -> None:
    name = f"test.cli.{unique}"
    _write(tmp_path, name, 2)
    env = {
        "LIVERL_KAFKA_BOOTSTRAP": kafka_settings.bootstrap,
        "LIVERL_TOPICS_SPECS_DIR": str(tmp_path),
    }
    runner = CliRunner()
    first = runner.invoke(cli, ["topics", "apply"], env=env)
    assert first.exit_code == 0, first.output
    assert f"create          {name}" in first.output
    second = runner.invoke(cli, ["topics", "apply"], env=env)
    assert second.exit_code == 0, second.output
    assert "topics up to date: 1 topic(s)" in second.output
    listed = runner.invoke(cli, ["topics", "list"], env=env)
    assert listed.exit_code == 0, listed.output
    assert name in listed.output and "ok" in listed.output

    _write(tmp_path, name, 1)
    refused = runner.invoke(cli, ["topics", "apply"], env=env)
    assert refused.exit_code == 1
    assert "cannot shrink" in refused.output
    drift = runner.invoke(cli, ["topics", "list"], env=env)
    assert drift.exit_code == 2 and "differs" in drift.output


@pytest.mark.integration
def test_cli_list_marks_missing_topic(
    kafka_settings: Settings, admin, unique: str, tmp_path: Path
) -> None:
    present, missing = f"test.present.{unique}", f"test.missing.{unique}"
    create_topic(admin, present, 2)
    _write(tmp_path, present, 2)
    _write(tmp_path, missing, 2)
    env = {
        "LIVERL_KAFKA_BOOTSTRAP": kafka_settings.bootstrap,
        "LIVERL_TOPICS_SPECS_DIR": str(tmp_path),
    }
    out = CliRunner().invoke(cli, ["topics", "list"], env=env)
    assert out.exit_code == 2
    assert "missing" in out.output


def test_contracts_come_from_the_specs(tmp_path: Path) -> None:
    """Partitions and event types are stated once, in topics/; code derives them."""
    import shutil

    from pipeline.kafka.consumer import expected_types_from_specs
    from pipeline.processors.app import INPUTS, create_app
    from pipeline.processors.config import ProcessorSettings

    specs = topics.load_specs(Settings().topics.specs_dir)
    types = topics.event_types(specs)
    assert types[names.INTERACTIONS] == "interaction" and types[names.DLQ] == "dlq"
    assert topics.session_partitions(specs) == 6

    # A copy of the specs with 4 partitions per session topic: the Faust app follows it.
    for path in Settings().topics.specs_dir.glob("*.yaml"):
        text = path.read_text().replace("partitions: 6", "partitions: 4")
        (tmp_path / path.name).write_text(text)
    settings = Settings(topics={"specs_dir": tmp_path}, state_dir=tmp_path / "state")
    app = create_app(settings, ProcessorSettings(web_enabled=False), settings.state_dir)
    assert app.conf.topic_partitions == 4
    assert set(INPUTS) <= set(types)

    # A broken spec is an error, not silently disabled type checks.
    shutil.copy(tmp_path / "interactions.yaml", tmp_path / "typo.yaml")
    (tmp_path / "typo.yaml").write_text("name: x\npartition: 3\n")
    with pytest.raises(topics.TopicSpecError, match="typo.yaml"):
        expected_types_from_specs(settings)
    with pytest.raises(topics.TopicSpecError, match="typo.yaml"):
        create_app(settings, ProcessorSettings(web_enabled=False), settings.state_dir)
