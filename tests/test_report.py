"""``liverl report``: Delta tables with hand-chosen values in, a PNG and a summary out."""

from __future__ import annotations

import datetime as dt
import statistics
import struct
from pathlib import Path
from typing import Any

import click
import pyarrow as pa
import pytest
from click.testing import CliRunner, Result
from deltalake import write_deltalake

from pipeline.cli import LiverlGroup
from pipeline.lake import tables as T
from pipeline.lake.writer import Appender
from pipeline.report import PNG_SIZE, report
from pipeline.settings import Settings

BASE_MS = 1_767_225_600_000  # 2026-01-01 00:00:00Z
SEC = 1000

# (version, step, status, reward, seconds after BASE_MS)
SAMPLES: list[tuple[int, int, str, float, int]] = [
    (1, 1, "trained", 1.0, 0),
    (1, 1, "trained", -1.0, 10),
    (1, 2, "trained", 1.0, 20),
    (1, 2, "masked", 0.0, 30),
    (2, 3, "trained", 1.0, 60),
    (2, 3, "trained", 1.0, 70),
    (2, 3, "trained", 0.0, 80),
    (2, 3, "trained", -1.0, 90),
    (2, 3, "stale_dropped", 1.0, 100),
    (2, 3, "no_hint", -1.0, 110),
    (3, 4, "trained", 0.5, 200),
    (3, 4, "masked", 0.0, 210),
]
# step -> (published version, loss, loss_rl, loss_opd, kl, clip_fraction, grad_norm, seconds)
STEPS = {
    1: (1, 0.50, 0.40, 0.10, 0.010, 0.00, 1.5, 40),
    2: (1, 0.45, 0.45, None, 0.020, 0.05, 1.2, 50),
    3: (2, 0.30, 0.20, 0.10, 0.030, 0.10, 0.9, 120),
    4: (3, 0.20, 0.10, 0.10, 0.015, 0.02, 0.7, 220),
}
# (version, status, seconds): v2 promoted and v3 rejected by later rows.
WEIGHTS = [
    (1, "candidate", 55),
    (2, "candidate", 125),
    (2, "promoted", 150),
    (3, "candidate", 225),
    (3, "rejected", 330),  # the newest timestamp: the time span ends here (5m 30s)
]


def traj_row(
    version: int, step: int, status: str, reward: float, sec: int, policy: str = "p1", i: int = 0
) -> dict[str, Any]:
    ts = BASE_MS + sec * SEC
    return {
        "event_id": f"{policy}-{version}-{step}-{sec}-{i}",
        "session_id": "s1",
        "turn": i,
        "policy_id": policy,
        "prompt_token_ids": [1, 2, 3],
        "response_token_ids": [4, 5],
        "response_text": "ok",
        "loss_mask": [1, 1],
        "behavior_logprobs": [-0.5, -0.25],
        "reward": reward,
        "hints": [],
        "selected_hint": None,
        "behavior_weight_version": version - 1,
        "staleness": 0,
        "status": status,
        "step": step,
        "weight_version": version,
        "source_topic": "samples",
        "source_partition": 0,
        "source_offset": i,
        "ts_ms": ts,
        "day": dt.datetime.fromtimestamp(ts / 1000, dt.UTC).strftime("%Y-%m-%d"),
    }


def step_row(step: int, values: tuple[Any, ...], policy: str = "p1") -> dict[str, Any]:
    published, loss, rl, opd, kl, clip, grad, sec = values
    return {
        "policy_id": policy,
        "step": step,
        "weight_version": published - 1,
        "published_version": published,
        "method": "hybrid",
        "loss": loss,
        "losses": [(k, v) for k, v in (("rl", rl), ("opd", opd)) if v is not None],
        "kl": kl,
        "clip_fraction": clip,
        "grad_norm": grad,
        "samples": 3,
        "tokens": 30,
        "trained_tokens": 20,
        "dropped_stale": 0,
        "reward_mean": None,
        "consumed_offsets": "{}",
        "metrics": "{}",
        "ts_ms": BASE_MS + sec * SEC,
    }


def weights_row(version: int, status: str, sec: int, policy: str = "p1") -> dict[str, Any]:
    return {
        "policy_id": policy,
        "version": version,
        "parent": version - 1 if version > 1 else None,
        "step": version,
        "uri": f"file:///w/{policy}/v{version}/",
        "status": status,
        "files": "[]",
        "consumed_offsets": "{}",
        "input_topic": "samples",
        "method": "hybrid",
        "metrics": "{}",
        "ts_ms": BASE_MS + sec * SEC,
    }


def write(lake: Path, name: str, rows: list[dict[str, Any]], version: int = 1) -> None:
    Appender(T.LakeTables(lake).uri(name), T.PARTITION_BY[name]).append_once(
        T.to_table(name, rows), app_id="test", version=version
    )


def full_lake(lake: Path) -> Path:
    write(lake, T.TRAJECTORIES, [traj_row(*s, i=i) for i, s in enumerate(SAMPLES)])
    write(lake, T.GRADIENT_STEPS, [step_row(k, v) for k, v in STEPS.items()])
    write(lake, T.WEIGHTS, [weights_row(*w) for w in WEIGHTS])
    return lake


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND", "PNG is truncated"
    return struct.unpack(">II", data[16:24])


def run(*args: str, obj: dict[str, Any] | None = None) -> Any:
    return CliRunner().invoke(report, list(args), obj=obj, catch_exceptions=False)


def mean_reward(version: int) -> float:
    return statistics.mean(r for v, _, s, r, _ in SAMPLES if v == version and s == "trained")


def test_png_and_summary_state_the_hand_values(tmp_path: Path) -> None:
    lake = full_lake(tmp_path / "lake")
    out = tmp_path / "out" / "report.png"
    result = run("--lake", str(lake), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert png_size(out) == PNG_SIZE == (1600, 900)
    text = result.output
    assert mean_reward(1) == pytest.approx(1 / 3)
    assert mean_reward(2) == 0.25
    assert "policy p1" in text
    assert "versions: 3 (1..3)" in text
    assert "steps: 4 (1..4)" in text
    assert "samples: 12 (trained 8, masked 2, stale_dropped 1, no_hint 1)" in text
    assert f"last reward mean (trained samples): v3 {mean_reward(3):.4f} (n=1)" in text
    assert f"v1 {mean_reward(1):.4f} (n=3); v2 {mean_reward(2):.4f} (n=4)" in text
    assert "v2 0.2500 (n=4)" in text
    assert "verdicts: candidate 1, promoted 1, rejected 1" in text
    assert "time span: 2026-01-01 00:00:00Z -> 2026-01-01 00:05:30Z (5m 30s)" in text
    assert f"wrote {out} (1600x900 px)" in text


def test_since_version_keeps_later_versions_and_their_steps(tmp_path: Path) -> None:
    lake = full_lake(tmp_path / "lake")
    out = tmp_path / "since.png"
    result = run("--lake", str(lake), "--out", str(out), "--since-version", "2")
    assert result.exit_code == 0, result.output
    assert png_size(out) == PNG_SIZE
    assert "versions: 2 (2..3)" in result.output
    assert "steps: 2 (3..4)" in result.output
    assert "samples: 8 (trained 5, masked 1, stale_dropped 1, no_hint 1)" in result.output
    assert "v1 " not in result.output


def test_since_version_past_the_end_renders_empty_panels(tmp_path: Path) -> None:
    lake = full_lake(tmp_path / "lake")
    out = tmp_path / "late.png"
    result = run("--lake", str(lake), "--out", str(out), "--since-version", "99")
    assert result.exit_code == 0, result.output
    assert png_size(out) == PNG_SIZE
    assert "samples: 0" in result.output
    assert "no trained samples with a reward yet" in result.output


def via_liverl(*args: str) -> Result:
    """``report`` in a group as ``liverl`` has it: its errors become one line there."""
    group = LiverlGroup()
    group.add_command(report)
    return CliRunner().invoke(group, ["report", *args])


def test_lake_without_tables_is_a_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "r.png"
    result = via_liverl("--lake", str(tmp_path / "nothing"), "--out", str(out))
    assert result.exit_code == 1
    assert f"no trajectories yet at {tmp_path / 'nothing'}" in result.output
    assert "run `liverl up` or `liverl train` first" in result.output
    assert not out.exists()


def test_empty_tables_render(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    for name in (T.TRAJECTORIES, T.GRADIENT_STEPS, T.WEIGHTS):
        write_deltalake(T.LakeTables(lake).uri(name), T.to_table(name, []))
    out = tmp_path / "empty.png"
    result = run("--lake", str(lake), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert png_size(out) == PNG_SIZE
    assert "versions: 0   steps: 0   samples: 0" in result.output


def test_single_point_series_and_missing_optional_tables(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    write(lake, T.TRAJECTORIES, [traj_row(1, 1, "trained", 0.75, 5)])
    out = tmp_path / "one.png"
    result = run("--lake", str(lake), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "last reward mean (trained samples): v1 0.7500 (n=1)" in result.output
    assert "note: no gradient_steps table yet" in result.output
    assert "steps: 1 (1)" in result.output  # from the trajectories' consuming step
    write(lake, T.GRADIENT_STEPS, [step_row(1, STEPS[1])])
    write(lake, T.WEIGHTS, [weights_row(1, "promoted", 60)])
    result = run("--lake", str(lake), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert png_size(out) == PNG_SIZE
    assert "verdicts: promoted 1" in result.output
    assert "time span: 2026-01-01 00:00:05Z -> 2026-01-01 00:01:00Z (55s)" in result.output


def test_missing_columns_are_tolerated(tmp_path: Path) -> None:
    """An older (or newer) writer: no status/reward in trajectories, no KL or clip in steps."""
    lake = tmp_path / "lake"
    rows = [traj_row(*s, i=i) for i, s in enumerate(SAMPLES)]
    traj = T.to_table(T.TRAJECTORIES, rows).drop_columns(["status"])
    write_deltalake(T.LakeTables(lake).uri(T.TRAJECTORIES), traj, partition_by=["day"])
    steps = T.to_table(T.GRADIENT_STEPS, [step_row(k, v) for k, v in STEPS.items()])
    steps = steps.drop_columns(["kl", "clip_fraction", "losses", "published_version"])
    steps = steps.append_column(pa.field("new_metric", pa.float64()), pa.nulls(4, pa.float64()))
    write_deltalake(T.LakeTables(lake).uri(T.GRADIENT_STEPS), steps)
    out = tmp_path / "old.png"
    result = run("--lake", str(lake), "--out", str(out), "--since-version", "2")
    assert result.exit_code == 0, result.output
    assert png_size(out) == PNG_SIZE
    # Without a status column every sample counts: v2 = mean of all six rewards.
    all_v2 = statistics.mean(r for v, _, _, r, _ in SAMPLES if v == 2)
    assert f"v2 {all_v2:.4f} (n=6)" in result.output
    assert "last reward mean (all samples: no status recorded): v3" in result.output
    assert "note: trajectories has no column(s) status" in result.output
    assert "note: gradient_steps has no column(s) published_version, losses, kl" in result.output
    assert "steps: 2 (3..4)" in result.output  # published_version fell back to weight_version+1


def test_policy_choice(tmp_path: Path) -> None:
    lake = full_lake(tmp_path / "lake")
    write(lake, T.TRAJECTORIES, [traj_row(1, 1, "trained", -0.5, 400, policy="p2")], version=2)
    out = tmp_path / "p.png"
    result = via_liverl("--lake", str(lake), "--out", str(out))
    assert result.exit_code == 1
    assert "several policies" in result.output and "p1, p2" in result.output
    result = run("--lake", str(lake), "--out", str(out), "--policy", "p2")
    assert result.exit_code == 0, result.output
    assert "last reward mean (trained samples): v1 -0.5000 (n=1)" in result.output
    assert "samples: 1 (trained 1)" in result.output
    result = via_liverl("--lake", str(lake), "--out", str(out), "--policy", "x")
    assert result.exit_code == 1
    assert "no rows for policy 'x'" in result.output


def test_default_lake_follows_the_state_dir_when_wired_into_a_group(tmp_path: Path) -> None:
    full_lake(tmp_path / "state" / "lake")

    @click.group()
    def cli() -> None:
        pass

    cli.add_command(report)
    out = tmp_path / "g.png"
    settings = Settings(state_dir=tmp_path / "state")
    result = CliRunner().invoke(
        cli, ["report", "--out", str(out)], obj={"settings": settings}, catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert f"lake {tmp_path / 'state' / 'lake'}" in result.output
    assert png_size(out) == PNG_SIZE


def test_loss_parts_come_from_the_map_or_the_legacy_columns(tmp_path: Path) -> None:
    """A lake written before the ``losses`` map kept one column per built-in part."""
    from pipeline.report.data import read_columns, step_parts

    steps = T.to_table(T.GRADIENT_STEPS, [step_row(k, v) for k, v in STEPS.items()])
    legacy = (
        steps.drop_columns(["losses"])
        .append_column("loss_rl", pa.array([0.40, 0.45, 0.20, 0.10]))
        .append_column("loss_opd", pa.array([0.10, None, 0.10, 0.10], pa.float64()))
    )
    uri = str(tmp_path / "old" / "gradient_steps")
    write_deltalake(uri, legacy)
    legacy_cols = ["loss_rl", "loss_opd"]
    table, missing = read_columns(uri, T.GRADIENT_STEPS, ["step", "losses"], legacy_cols)
    assert table is not None and missing == []
    assert step_parts(table) == [
        {"rl": 0.40, "opd": 0.10},
        {"rl": 0.45},
        {"rl": 0.20, "opd": 0.10},
        {"rl": 0.10, "opd": 0.10},
    ]
    uri = str(tmp_path / "new" / "gradient_steps")
    write_deltalake(uri, steps)
    table, _ = read_columns(uri, T.GRADIENT_STEPS, ["step", "losses"], legacy_cols)
    assert table is not None
    assert step_parts(table) == step_parts(
        legacy.append_column("losses", pa.nulls(4, T.GRADIENT_STEPS_SCHEMA.field("losses").type))
    )
