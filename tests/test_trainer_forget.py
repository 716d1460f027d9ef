"""The trainer's part of forget (trainer/forget.py) over version folders written as the
publisher writes them (checkpoint.write_version + publish.write_folder_rows): survey finds
the folders holding a session's trajectory rows, erase removes exactly those rows and the
folder stays a valid version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from pipeline.lake import tables as T
from pipeline.trainer import checkpoint as ck
from pipeline.trainer import forget as trainer_forget
from pipeline.trainer.publish import STEPS_FILE, TRAJ_FILE, write_folder_rows

from .test_report import traj_row


def _traj(session: str, i: int) -> dict[str, Any]:
    row = traj_row(1, 1, "trained", 0.5, 10 + i, i=i)
    row.update(event_id=f"{session}-{i}", session_id=session, response_text=f"of {session}")
    return row


def _version(root: Path, policy: str, version: int, sessions: list[str]) -> Path:
    step = {
        "policy_id": policy,
        "step": version,
        "weight_version": version,
        "loss": 0.5,
        "samples": 2,
        "tokens": 4,
        "ts_ms": 1,
    }

    def files(tmp: Path) -> None:
        (tmp / "adapter.bin").write_bytes(b"weights")
        rows = [_traj(s, i) for s in sessions for i in range(2)]
        write_folder_rows(
            tmp / ck.TRAINER_DIR,
            T.to_table(T.TRAJECTORIES, rows),
            T.to_table(T.GRADIENT_STEPS, [step]),
        )

    manifest = ck.Manifest(
        policy_id=policy,
        version=version,
        parent=None,
        step=version,
        created_ms=0,
        input_topic="in",
        consumed_offsets={},
        files=[],
    )
    return ck.write_version(root, manifest, files)


def test_survey_finds_and_erase_removes_only_the_sessions_rows(tmp_path: Path) -> None:
    main, replay = tmp_path / "weights", tmp_path / "replay" / "r1" / "weights"
    v1 = _version(main, "p1", 1, ["a", "b"])
    v2 = _version(main, "p1", 2, ["b"])
    v3 = _version(replay, "p2", 1, ["a", "c"])
    steps = (v1 / ck.TRAINER_DIR / STEPS_FILE).read_bytes()

    hits = trainer_forget.survey([main, replay, tmp_path / "absent"], ["a"])
    assert [(h.folder, h.rows) for h in hits] == [(v1, 2), (v3, 2)]
    assert [(h.folder, h.rows) for h in trainer_forget.survey([main], ["b"])] == [(v1, 2), (v2, 2)]

    assert [trainer_forget.erase(h, ["a"]) for h in hits] == [2, 2]
    assert trainer_forget.survey([main, replay], ["a"]) == []
    for folder, left in [(v1, ["b", "b"]), (v2, ["b", "b"]), (v3, ["c", "c"])]:
        rows = pq.read_table(folder / ck.TRAINER_DIR / TRAJ_FILE)
        assert rows.column("session_id").to_pylist() == left
        assert ck.verify_version(folder).version in (1, 2)  # the manifest follows the file
    assert pq.read_table(v1 / ck.TRAINER_DIR / TRAJ_FILE).schema == T.TRAJECTORIES_SCHEMA
    assert (v1 / ck.TRAINER_DIR / STEPS_FILE).read_bytes() == steps  # no session column
