"""Offline retraining from the lake (issue 12, item 3): real broker, real trainer processes.

A live trainer first trains a policy from Kafka, which fills ``trajectories``; then
``liverl train --from-delta trajectories --where …`` trains a second policy from those rows.
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pyarrow.compute as pc
import pytest
from click.testing import CliRunner
from deltalake import DeltaTable

from pipeline.models.tiny import ensure_tiny_model
from pipeline.settings import Settings
from pipeline.trainer import checkpoint as ck
from pipeline.trainer import offline
from pipeline.trainer.commands import train

from .conftest import create_topic
from .test_trainer_exactly_once import ROOT, make_sample, produce, trainer_cmd

pytestmark = pytest.mark.integration


def offline_cmd(tiny: Path, policy: str, root: Path, where: str) -> list[str]:
    cmd = trainer_cmd(tiny, "unused", policy, root, idle_s=1.0)
    i = cmd.index("--topic")
    return [*cmd[:i], *cmd[i + 2 :], "--from-delta", "trajectories", "--where", where]


def run(cmd: list[str], settings: Settings, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(
            os.environ, PYTHONUNBUFFERED="1", LIVERL_KAFKA_BOOTSTRAP=settings.bootstrap, **env
        ),
    )


def rows_of(lake: Path, policy: str) -> list[str]:
    table = DeltaTable(str(lake / "trajectories")).to_pyarrow_table(
        columns=["policy_id", "event_id"]
    )
    return table.filter(pc.equal(table.column("policy_id"), policy)).column("event_id").to_pylist()


def live_history(
    settings: Settings,
    admin,
    tmp_path: Path,
    topic: str,  # type: ignore[no-untyped-def]
    live: str,
    *,
    seed: int,
) -> Path:
    """12 samples trained live by policy ``live`` into the lake; returns the tiny model."""
    create_topic(admin, topic, 1)
    rng = random.Random(seed)
    produce(settings, topic, [make_sample(i, live, rng) for i in range(12)])
    tiny = ensure_tiny_model(tmp_path / "model" / "tiny")
    first = run(trainer_cmd(tiny, topic, live, tmp_path, idle_s=1.5), settings)
    assert first.returncode == 0, first.stderr[-3000:]
    return tiny


def test_offline_retrain_trains_each_selected_row_once_across_a_crash(
    kafka_settings: Settings,
    admin,
    unique: str,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    topic, live, again = f"test.trainer.offline.{unique}", f"live-{unique}", f"off-{unique}"
    tiny = live_history(kafka_settings, admin, tmp_path, topic, live, seed=5)
    lake, weights = tmp_path / "lake", tmp_path / "weights"
    assert len(rows_of(lake, live)) == 12

    # Select 8 of the 12 rows: the filter is what decides, and the count must match.
    where = f"policy_id = '{live}' AND (turn % 2 = 0 OR turn IN (1, 3))"
    expected = offline.select(lake, "trajectories", where)
    assert expected.rows.num_rows == 8  # turns 0, 2, 4, 6, 8, 10 and 1, 3
    cmd = offline_cmd(tiny, again, tmp_path, where)

    crashed = run(cmd, kafka_settings, LIVERL_TRAINER_CRASH_AT="after_delta_trajectories")
    assert crashed.returncode == 137, crashed.stderr[-3000:]
    done = run(cmd, kafka_settings)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from v1" in done.stdout and "every selected row consumed" in done.stdout

    trained = rows_of(lake, again)
    assert sorted(trained) == sorted(expected.rows.column("event_id").to_pylist())
    assert len(trained) == len(set(trained)) == 8, "each selected row exactly once"
    newest = ck.latest_manifest(weights, again)
    assert newest is not None and newest.input_topic == expected.input_name
    assert newest.offsets() == {0: 8}
    assert len(rows_of(lake, live)) == 12, "the source policy is untouched"

    # The lake grew (the offline policy's own rows), yet a rerun reads the pinned version.
    rerun = run(cmd, kafka_settings)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "done: 0 steps, 0 samples, 0 versions" in rerun.stdout
    assert ck.latest_manifest(weights, again).version == newest.version  # type: ignore[union-attr]

    # Another filter under the same policy is another input: refused, nothing trained.
    other = run(offline_cmd(tiny, again, tmp_path, f"policy_id = '{live}'"), kafka_settings)
    assert other.returncode != 0 and "not" in other.stderr + other.stdout
    assert len(rows_of(lake, again)) == 8


def test_offline_rows_are_never_dropped_as_stale(
    kafka_settings: Settings,
    admin,
    unique: str,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """One poll reads four batches (3 samples each here) stamped with the poll's version; a
    version is published after every step, so the fourth batch trains three versions later.
    History is off-policy, not stale: all 12 rows are trained, none ``stale_dropped``."""
    topic, live, again = f"test.trainer.nostale.{unique}", f"live-{unique}", f"ns-{unique}"
    tiny = live_history(kafka_settings, admin, tmp_path, topic, live, seed=11)
    done = run(offline_cmd(tiny, again, tmp_path, f"policy_id = '{live}'"), kafka_settings)
    assert done.returncode == 0, done.stderr[-3000:]
    table = DeltaTable(str(tmp_path / "lake" / "trajectories")).to_pyarrow_table(
        columns=["policy_id", "status"]
    )
    mine = table.filter(pc.equal(table.column("policy_id"), again)).column("status")
    assert mine.to_pylist() == ["trained"] * 12, done.stdout


def test_duplicate_event_ids_train_once_newest_row_wins(tmp_path: Path) -> None:
    from tests.test_report import traj_row, write

    lake = tmp_path / "lake"
    rows = [
        traj_row(1, 1, "trained", 1.0, 0, i=0),
        traj_row(2, 2, "trained", -1.0, 5, i=0),
        traj_row(1, 1, "trained", 0.5, 10, i=1),
    ]
    rows[1]["event_id"] = rows[0]["event_id"]  # trained again after a fallback
    write(lake, "trajectories", rows)
    sel = offline.select(lake, "trajectories", None)
    assert sel.rows.num_rows == 2
    by_id = dict(
        zip(
            sel.rows.column("event_id").to_pylist(),
            sel.rows.column("reward").to_pylist(),
            strict=True,
        )
    )
    assert by_id[rows[0]["event_id"]] == -1.0  # the v2 row
    source = offline.DeltaSource(sel, "new")
    source.behavior_version = 4
    batch = source.poll_batch(10)
    assert [r.offset for r in batch.records] == [0, 1] and source.exhausted
    assert all(r.event.policy_id == "new" for r in batch.records)  # type: ignore[attr-defined]
    assert all(r.event.behavior_weight_version == 4 for r in batch.records)  # type: ignore[attr-defined]
    assert offline.pinned_version(sel.input_name, "trajectories", None) == sel.table_version
    assert offline.pinned_version(sel.input_name, "trajectories", "turn = 1") is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--where", "turn = 1"], "give --from-delta too"),
        (["--from-delta", "trajectories", "--where", "no_such_column = 1"], "no_such_column"),
        (["--from-delta", "trajectories"], "no Delta table"),
    ],
)
def test_bad_offline_arguments_are_usage_errors(
    tmp_path: Path, args: list[str], message: str, kafka_settings: Settings
) -> None:
    if "no Delta table" not in message:
        from tests.test_report import traj_row, write

        write(tmp_path / "lake", "trajectories", [traj_row(1, 1, "trained", 1.0, 0)])
    result = CliRunner().invoke(
        train,
        [
            "--model",
            "tiny",
            "--policy",
            "p",
            "--lake-root",
            str(tmp_path / "lake"),
            "--weights-root",
            str(tmp_path / "w"),
            *args,
        ],
        obj={"settings": kafka_settings},
    )
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "w" / "p").exists() or not any((tmp_path / "w" / "p").iterdir())


def test_frontier_allocation_spends_the_budget_near_half_success_and_records_each_row(
    kafka_settings: Settings,
    admin,
    unique: str,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """Three tasks of 4 sessions each (one prompt per task): always solved, solved half the
    time, never solved. Rates (s + 1) / (n + 2): 5/6, 1/2, 1/6; weights 0.05 + 0.95 * 4p(1-p):
    0.5778, 1, 0.5778. A budget of 6: quotas 1.61, 2.78, 1.61 -> 1, 2, 1 and the remainders
    to the half task (0.78) and to one of the tied others: 3 rows of the frontier task, 2 and
    1 of the others. Each drawn row is recorded (allocations) and trained once."""
    topic, live, again = f"test.trainer.alloc.{unique}", f"live-{unique}", f"fr-{unique}"
    create_topic(admin, topic, 1)
    rng = random.Random(7)
    prompts = {"solved": [1, 11, 12, 2], "half": [1, 21, 22, 2], "failed": [1, 31, 32, 2]}
    rewards = {"solved": [1.0] * 4, "half": [1.0, -1.0, 1.0, -1.0], "failed": [-1.0] * 4}
    samples = [
        make_sample(10 * k + j, live, rng, session_id=f"{name}-{j}", turn=0,
                    prompt_token_ids=prompts[name], reward=rewards[name][j])
        for k, name in enumerate(prompts) for j in range(4)
    ]  # fmt: skip
    produce(kafka_settings, topic, samples)
    tiny = ensure_tiny_model(tmp_path / "model" / "tiny")
    first = run(trainer_cmd(tiny, topic, live, tmp_path, idle_s=1.5), kafka_settings)
    assert first.returncode == 0, first.stderr[-3000:]
    lake, weights = tmp_path / "lake", tmp_path / "weights"
    where = f"policy_id = '{live}'"
    cmd = [*offline_cmd(tiny, again, tmp_path, where), "--allocate", "frontier", "--budget", "6"]
    done = run(cmd, kafka_settings)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "allocation frontier: 6 row(s) over 3 task(s)" in done.stdout, done.stdout

    table = DeltaTable(str(lake / "allocations")).to_pyarrow_table().to_pylist()
    assert len(table) == 6 and {r["allocation"] for r in table} == {"frontier"}
    by_session = {r["session_id"]: r for r in table}
    per_task = {name: sum(1 for s in by_session if s.startswith(name)) for name in prompts}
    assert per_task["half"] == 3 and sorted([per_task["solved"], per_task["failed"]]) == [1, 2]
    half = next(r for r in table if r["session_id"].startswith("half"))
    assert (half["task_rows"], half["task_allocated"]) == (4, 3)
    assert half["task_success_rate"] == pytest.approx(0.5) and half["task_weight"] == 1.0
    solved = next(r for r in table if r["session_id"].startswith("solved"))
    assert solved["task_success_rate"] == pytest.approx(5 / 6)
    assert solved["task_weight"] == pytest.approx(0.05 + 0.95 * 4 * 5 / 6 / 6)
    newest = ck.latest_manifest(weights, again)
    assert newest is not None and {r["input"] for r in table} == {newest.input_topic}
    assert sorted(rows_of(lake, again)) == sorted(r["event_id"] for r in table)

    rerun = run(cmd, kafka_settings)  # resumes the same allocation: nothing new
    assert rerun.returncode == 0 and "done: 0 steps" in rerun.stdout, rerun.stderr[-3000:]
    assert DeltaTable(str(lake / "allocations")).to_pyarrow_table().num_rows == 6


def test_offline_run_pauses_while_its_policy_is_pinned_and_finishes_after_unpin(
    kafka_settings: Settings,
    admin,
    unique: str,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """An offline policy's versions serve like any other's, so its trainer follows the
    operator too (issue 39 item 1): pinned, the run consumes no row and publishes nothing."""
    import time

    from pipeline.versions.commands import versions

    from .test_trainer_exactly_once import start, wait_for

    topic, live, again = f"test.trainer.offpin.{unique}", f"live-{unique}", f"op-{unique}"
    tiny = live_history(kafka_settings, admin, tmp_path, topic, live, seed=13)
    cmd = offline_cmd(tiny, again, tmp_path, f"policy_id = '{live}'")
    crashed = run(cmd, kafka_settings, LIVERL_TRAINER_CRASH_AT="after_events")
    assert crashed.returncode == 137, crashed.stderr[-3000:]  # v1 published, then killed
    obj = {"settings": kafka_settings}
    pin = CliRunner().invoke(versions, ["pin", "1", "--policy", again], obj=obj)
    assert pin.exit_code == 0, pin.output

    proc, lines = start(cmd, kafka_settings, tmp_path / "offline.log")
    try:
        assert wait_for(lines, "training paused", proc, 120), (
            tmp_path / "offline.log"
        ).read_text()[-3000:]
        time.sleep(3.0)  # room for a run that did not pause to train on
        assert proc.poll() is None, "a paused run is not idle: it waits"
        assert ck.latest_manifest(tmp_path / "weights", again).version == 1  # type: ignore[union-attr]
        assert len(rows_of(tmp_path / "lake", again)) == 3  # v1's one batch, no more

        unpin = CliRunner().invoke(versions, ["unpin", "--policy", again], obj=obj)
        assert unpin.exit_code == 0, unpin.output
        assert wait_for(lines, "training resumes", proc, 60)
        assert proc.wait(timeout=180) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    trained = rows_of(tmp_path / "lake", again)
    assert sorted(trained) == sorted(set(rows_of(tmp_path / "lake", live)))  # each row once
