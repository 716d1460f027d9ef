"""One settings object for every component: file < LIVERL_* env < options typed."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pipeline.options import merged
from pipeline.settings import Settings, load_settings


@click.command()
@click.option("--method", type=click.Choice(["rl", "opd", "hybrid"]), default="rl")
@click.option("--lr", type=float, default=1e-5)
@click.pass_context
def probe(ctx: click.Context, **options: object) -> None:
    cfg = merged(ctx.obj.trainer, ctx, options)
    click.echo(f"{cfg.method} {cfg.lr} {cfg.batch_max_samples}")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("LIVERL_"):
            monkeypatch.delenv(name)


def test_sections_read_file_then_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    cfg = tmp_path / "liverl.toml"
    cfg.write_text(
        '[trainer]\nmethod = "opd"\nbatch_max_samples = 4\n'
        '[serve]\nport = 8100\n[processors]\njudge = "llm"\n'
    )
    monkeypatch.setenv("LIVERL_SERVE_PORT", "8200")
    settings = load_settings(cfg)
    assert settings.trainer.method == "opd"
    assert settings.trainer.batch_max_samples == 4
    assert settings.serve.port == 8200, "environment beats the file"
    assert settings.processors.judge == "llm"


def test_only_typed_options_override_settings(tmp_path: Path, clean_env: None) -> None:
    cfg = tmp_path / "liverl.toml"
    cfg.write_text('[trainer]\nmethod = "hybrid"\nlr = 0.001\nbatch_max_samples = 4\n')
    settings = load_settings(cfg)
    runner = CliRunner()
    untouched = runner.invoke(probe, [], obj=settings)
    assert untouched.output.split() == ["hybrid", "0.001", "4"], untouched.output
    typed = runner.invoke(probe, ["--method", "rl"], obj=settings)
    assert typed.output.split() == ["rl", "0.001", "4"], typed.output


def test_invalid_section_value_names_the_field(
    monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    monkeypatch.setenv("LIVERL_TRAINER_METHOD", "sgd")
    with pytest.raises(ValueError, match="trainer.method"):
        Settings()


# ---- one way from an option to a setting ---------------------------------------------------


class _Stop(Exception):
    """Raised by the stand-ins below once a command has built its section."""


def test_field_option_takes_default_and_choices_from_the_field() -> None:
    from pipeline.options import field_option
    from pipeline.trainer.config import TrainerSettings

    @click.command()
    @field_option(TrainerSettings, "batch_max_samples", "--batch-samples")
    @field_option(TrainerSettings, "staleness", "--staleness")
    def cmd(batch_max_samples: int, staleness: str) -> None:
        click.echo(f"{batch_max_samples} {staleness}")

    runner = CliRunner()
    assert runner.invoke(cmd, []).output.split() == ["16", "drop"]
    assert "[default: 16]" in runner.invoke(cmd, ["--help"]).output
    bad = runner.invoke(cmd, ["--staleness", "keep"])
    assert bad.exit_code == 2 and "'drop', 'tis'" in bad.output, bad.output


def _settings_from(tmp_path: Path, text: str) -> Settings:
    cfg = tmp_path / "liverl.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\n' + text)
    return load_settings(cfg)


def test_serve_maps_options_like_every_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    from pipeline.serving import build
    from pipeline.serving.commands import serve
    from pipeline.serving.settings import ServeSettings

    built: list[ServeSettings] = []

    def fake_build_app(cfg: ServeSettings, settings: Settings) -> None:
        built.append(cfg)
        raise _Stop

    monkeypatch.setattr(build, "build_app", fake_build_app)
    settings = _settings_from(tmp_path, "[serve]\nport = 8100\nworkers = 2\nreplica_id = 'g7'\n")
    runner = CliRunner()
    result = runner.invoke(
        serve, ["--rate-limit", "30", "--no-record", "--workers", "3"], obj={"settings": settings}
    )
    assert isinstance(result.exception, _Stop), result.output
    cfg = built[-1]
    assert cfg.port == 8100, "the file's port, not the option's default"
    assert (cfg.workers, cfg.rate_limit_per_min, cfg.record, cfg.reload) == (3, 30.0, False, True)
    assert cfg.spool_dir == tmp_path / "state" / "spool" / "g7"

    result = runner.invoke(serve, ["--no-reload", "--replica-id", "g9"], obj={"settings": settings})
    assert isinstance(result.exception, _Stop), result.output
    cfg = built[-1]
    assert (cfg.port, cfg.workers, cfg.record, cfg.reload) == (8100, 2, True, False)
    assert cfg.spool_dir == tmp_path / "state" / "spool" / "g9"


def test_workers_map_options_like_every_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    from pipeline.processors import app as processors_app
    from pipeline.processors.commands import workers
    from pipeline.processors.config import ProcessorSettings

    built: list[ProcessorSettings] = []

    def fake_create_app(settings: Settings, cfg: ProcessorSettings, state_dir: Path) -> None:
        built.append(cfg)
        raise RuntimeError("stop")

    monkeypatch.setattr(processors_app, "create_app", fake_create_app)
    settings = _settings_from(tmp_path, "[processors]\njudge = 'rules'\nweb_port = 7000\n")
    runner = CliRunner()
    result = runner.invoke(workers, ["--no-web", "--app-id", "rw"], obj={"settings": settings})
    assert result.exit_code == 1 and "stop" in result.output, result.output
    cfg = built[-1]
    assert (cfg.app_id, cfg.web_enabled, cfg.judge, cfg.web_port) == ("rw", False, "rules", 7000)

    result = runner.invoke(
        workers, ["--judge", "replies", "--web", "--web-port", "0"], obj={"settings": settings}
    )
    cfg = built[-1]
    assert (cfg.app_id, cfg.web_enabled, cfg.judge) == ("liverl-rewards", True, "replies")
    assert cfg.web_port not in (0, 7000)  # 0: the free port picked before the app is built


def test_train_maps_options_like_every_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    from pipeline.trainer import loop
    from pipeline.trainer.commands import train
    from pipeline.trainer.config import TrainerSettings

    built: list[TrainerSettings] = []

    class FakeLoop:
        def __init__(self, settings: Settings, cfg: TrainerSettings, **_: object) -> None:
            built.append(cfg)
            raise _Stop

    monkeypatch.setattr(loop, "TrainerLoop", FakeLoop)
    settings = _settings_from(
        tmp_path, "[trainer]\nbatch_max_samples = 4\nstaleness = 'tis'\nkl_coef = 0.1\n"
    )
    result = CliRunner().invoke(
        train, ["--batch-wait", "0.5", "--no-gate", "--lr", "0.003"], obj={"settings": settings}
    )
    assert isinstance(result.exception, _Stop), result.output
    cfg = built[-1]
    assert (cfg.batch_max_samples, cfg.staleness, cfg.kl_coef) == (4, "tis", 0.1)
    assert (cfg.batch_max_wait_s, cfg.gate, cfg.lr) == (0.5, False, 0.003)
    assert cfg.weights_root == tmp_path / "state" / "weights"


@pytest.fixture
def up_children(
    monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> Callable[..., dict[str, list[str]]]:
    """``liverl up`` with these settings and options, stopped before it starts anything:
    the command line of each component, by command name."""
    from pipeline import cli, stack

    started: list[list[str]] = []

    def fake_start(settings: Settings, components: list[stack.Component]) -> None:
        started.extend(c.args for c in components)
        raise _Stop

    monkeypatch.setattr(stack, "start", fake_start)
    monkeypatch.setattr(cli, "_pull_model", lambda model: None)
    monkeypatch.setattr(cli, "topics_apply", lambda **_: None)

    def children(settings: Settings, *args: str) -> dict[str, list[str]]:
        started.clear()
        result = CliRunner().invoke(cli.up, list(args), obj={"settings": settings})
        assert isinstance(result.exception, _Stop), result.output
        return {a[0]: a for a in started}

    return children


def test_up_passes_the_file_settings_to_its_children(
    tmp_path: Path, up_children: Callable[..., dict[str, list[str]]]
) -> None:
    """`liverl up` used to pass its option defaults (--method rl, --port 8000) to the trainer
    and the gateway, overriding a `[trainer] method` in the file."""
    settings = _settings_from(
        tmp_path,
        "[kafka]\nbootstrap = 'k:9092'\n[trainer]\nmethod = 'opd'\npolicy = 'p1'\n"
        "[serve]\nport = 8123\n",
    )

    def children(*args: str) -> dict[str, list[str]]:
        return up_children(settings, "--without", "archive", "--without", "workers", *args)

    got = children()
    assert got["train"][got["train"].index("--method") + 1] == "opd"
    assert got["train"][got["train"].index("--policy") + 1] == "p1"
    assert got["serve"][got["serve"].index("--port") + 1] == "8123"
    got = children("--method", "hybrid", "--port", "8124")
    assert got["train"][got["train"].index("--method") + 1] == "hybrid"
    assert got["serve"][got["serve"].index("--port") + 1] == "8124"


def test_up_runs_the_reward_workers_as_asked(
    tmp_path: Path, up_children: Callable[..., dict[str, list[str]]]
) -> None:
    """`liverl up --worker-processes N` starts `liverl workers --processes N`; one by default."""
    from pipeline import cli

    settings = _settings_from(tmp_path, "[kafka]\nbootstrap = 'k:9092'\n")
    assert up_children(settings, "--without", "archive")["workers"] == ["workers"]
    # the judges' consistency watcher runs beside them (a live panel and the gate read it)
    assert up_children(settings)["judges"] == ["judges", "watch"]
    assert "judges" not in up_children(settings, "--without", "judges")
    got = up_children(settings, "--without", "archive", "--worker-processes", "3")
    assert got["workers"] == ["workers", "--processes", "3"]
    result = CliRunner().invoke(cli.up, ["--worker-processes", "0"], obj={"settings": settings})
    assert result.exit_code == 2 and "--worker-processes" in result.output
