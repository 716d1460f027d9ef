"""One settings object for every component: file < LIVERL_* env < options typed."""

from __future__ import annotations

import os
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


def test_invalid_section_value_names_the_field(monkeypatch: pytest.MonkeyPatch,
                                               clean_env: None) -> None:
    monkeypatch.setenv("LIVERL_TRAINER_METHOD", "sgd")
    with pytest.raises(ValueError, match="trainer.method"):
        Settings()
