"""Methods and loss parts as a registry (issue 13, item 3): a toy method from a test module
trains, lands in Delta's ``losses`` map and in ``liverl report``, with no library change."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
import torch
from click.testing import CliRunner
from deltalake import DeltaTable

from pipeline.events import Producer, Sample
from pipeline.models.tiny import ensure_tiny_model
from pipeline.settings import Settings
from pipeline.trainer import losses as L
from pipeline.trainer import methods
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.core import TrainerCore

from .conftest import create_topic
from .test_trainer_exactly_once import make_sample, produce, trainer_cmd
from .test_trainer_offline import run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def sample(i: int, reward: float, mask: list[int]) -> Sample:
    return Sample(
        event_id=f"s{i}",
        producer=Producer(component="test", version="0"),
        session_id="a",
        turn=i,
        policy_id="default",
        prompt_token_ids=[1, 20 + i, 30, 2],
        response_token_ids=[40 + i, 50, 60],
        loss_mask=mask,
        behavior_logprobs=[-5.0] * 3,
        reward=reward,
        behavior_weight_version=0,
    )


def test_unknown_method_and_plugin_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown training method 'nope'; known: hybrid, opd"):
        TrainerSettings(method="nope")
    with pytest.raises(ValueError, match="plugin 'no.such.module' cannot be imported"):
        TrainerSettings(plugins=["no.such.module"])
    with pytest.raises(ValueError, match="unknown loss part"):
        methods.register_method("broken", ["no-such-part"])
    assert "broken" not in methods.METHODS


def test_toy_method_trains_its_formula_by_hand(tiny: Path) -> None:
    cfg = TrainerSettings(
        model=str(tiny), device="cpu", lr=1e-2, method="toy", plugins=["tests.toy_method"]
    )
    core = TrainerCore.load(cfg)
    batch = [sample(0, 1.0, [1, 1, 0]), sample(1, -0.5, [1, 1, 1])]
    with torch.no_grad():
        logits = core._response_logits(
            core.model, [s.prompt_token_ids for s in batch], [s.response_token_ids for s in batch]
        )
        logp = L.token_logprobs(logits, torch.tensor([s.response_token_ids for s in batch]))
    # Σ_i r_i Σ_t m_it ℓ_it / Σ m (the normalising mask is the RL mask: 5 tokens)
    expected = -(1.0 * (logp[0, 0] + logp[0, 1]) - 0.5 * logp[1].sum()) / 5
    before = [p.detach().clone() for p in core.model.parameters()]
    result = core.train_step(batch, 0)
    assert set(result.losses) == {"toy", "total"}
    assert result.losses["toy"] == pytest.approx(float(expected), rel=1e-5)
    assert result.losses["total"] == result.losses["toy"]
    assert [o.status for o in result.outcomes] == ["trained", "trained"]
    assert any(not torch.equal(a, b) for a, b in zip(before, core.model.parameters(), strict=True))


def test_a_method_owns_its_options(tiny: Path) -> None:
    """``[trainer.method_options]`` reaches the method's parts, validated by its model."""
    with pytest.raises(ValueError, match=r"trainer.method_options.scal: Extra inputs"):
        TrainerSettings(
            model=str(tiny), method="toy", plugins=["tests.toy_method"], method_options={"scal": 2}
        )
    with pytest.raises(ValueError, match=r"training method 'opd' takes no options"):
        TrainerSettings(model=str(tiny), method_options={"scale": 2})
    batch = [sample(0, 1.0, [1, 1, 0]), sample(1, -0.5, [1, 1, 1])]
    losses = []
    for scale in (1.0, 2.5):
        torch.manual_seed(0)
        cfg = TrainerSettings(
            model=str(tiny),
            device="cpu",
            lr=1e-2,
            method="toy",
            plugins=["tests.toy_method"],
            method_options={"scale": scale},
        )
        losses.append(TrainerCore.load(cfg).train_step(batch, 0).losses["toy"])
    assert losses[1] == pytest.approx(2.5 * losses[0], rel=1e-5)


@pytest.mark.integration
def test_toy_method_lands_in_delta_and_the_report(
    kafka_settings: Settings,
    admin,
    unique: str,
    tmp_path: Path,
    tiny: Path,  # type: ignore[no-untyped-def]
) -> None:
    from pipeline.report import load, report
    from pipeline.report.png import _step_series

    topic, policy = f"test.trainer.toy.{unique}", f"toy-{unique}"
    create_topic(admin, topic, 1)
    rng = random.Random(3)
    produce(kafka_settings, topic, [make_sample(i, policy, rng) for i in range(6)])
    cmd = [
        *trainer_cmd(tiny, topic, policy, tmp_path, idle_s=1.5),
        "--method",
        "toy",
        "--plugin",
        "tests.toy_method",
    ]
    done = run(cmd, kafka_settings)
    assert done.returncode == 0, done.stderr[-3000:]

    steps = DeltaTable(str(tmp_path / "lake" / "gradient_steps")).to_pyarrow_table()
    steps = steps.filter(pc.equal(steps.column("policy_id"), policy))
    assert steps.num_rows == 2 and set(steps.column("method").to_pylist()) == {"toy"}
    for pairs, total in zip(
        steps.column("losses").to_pylist(), steps.column("loss").to_pylist(), strict=True
    ):
        assert dict(pairs) == {"toy": pytest.approx(total)}

    out = tmp_path / "report.png"
    result = CliRunner().invoke(
        report,
        ["--lake", str(tmp_path / "lake"), "--out", str(out), "--no-lag"],
        obj={"settings": kafka_settings},
    )
    assert result.exit_code == 0, result.output
    _x, series = _step_series(load(tmp_path / "lake", policy, None).steps)
    assert "part:toy" in series and len(series["part:toy"]) == 2


def test_demo_takes_any_registered_method_and_refuses_an_unknown_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``liverl demo --method`` was a fixed choice of the three built-ins: a plug-in method
    could be trained by ``liverl up`` but not demonstrated."""
    from click.testing import CliRunner

    from pipeline.cli import cli
    from pipeline.demo import loop

    started: list[str] = []

    def no_loop(cfg: loop.LoopConfig) -> Any:  # the check happens before any loop starts
        started.append(cfg.method)
        raise loop.LoopError("not started in this test")

    monkeypatch.setattr(loop, "running_loop", no_loop)
    for k in [k for k in os.environ if k.startswith("LIVERL_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("LIVERL_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("LIVERL_TRAINER_PLUGINS", '["tests.toy_method"]')
    out = CliRunner().invoke(cli, ["demo", "--quick", "--method", "nosuch"])
    assert out.exit_code == 2 and "nosuch" in out.output and "toy" in out.output, out.output
    assert started == []
    out = CliRunner().invoke(cli, ["demo", "--quick", "--method", "toy"])
    assert started == ["toy"], out.output
