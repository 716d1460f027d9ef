"""``liverl replay --allocate``: sessions drawn by frontier sampling over the lake's
trajectories, replayed whole, recorded in the allocations table."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from deltalake import DeltaTable, write_deltalake

from pipeline.kafka import names
from pipeline.lake.tables import to_table
from pipeline.replay.allocation import session_rows
from pipeline.trainer import offline
from tests.test_replay import cli_env, drop, invoke, produce_source, read_topic, source_topic

__all__ = ["source_topic"]  # the fixture, used by name

PROMPTS = {"solved": [1, 11, 12, 2], "half": [1, 21, 22, 2], "failed": [1, 31, 32, 2]}
REWARDS = {"solved": [1.0] * 4, "half": [1.0, -1.0, 1.0, -1.0], "failed": [-1.0] * 4}


def trajectories(lake: Path, prefix: str) -> list[str]:
    """Three tasks of four two-turn sessions; a session's reward is its turns' mean (turn 1
    rewards 0, so the sign is turn 0's)."""
    rows, sessions = [], []
    for name, prompt in PROMPTS.items():
        for j in range(4):
            sid = f"{prefix}-{name}-{j}"
            sessions.append(sid)
            for turn in (0, 1):
                rows.append({"event_id": f"{sid}-t{turn}", "session_id": sid, "turn": turn,
                             "policy_id": "p", "prompt_token_ids": prompt + [turn] * turn,
                             "reward": REWARDS[name][j] if turn == 0 else 0.0,
                             "ts_ms": 1000 * j + turn})  # fmt: skip
    write_deltalake(str(lake / "trajectories"), to_table("trajectories", rows))
    return sessions


def test_one_row_per_session_its_earliest_turn_and_mean_reward(tmp_path: Path) -> None:
    trajectories(tmp_path, "u")
    rows = session_rows(offline.select(tmp_path, "trajectories", None)).to_pylist()
    assert len(rows) == 12 and {r["turn"] for r in rows} == {0}
    half = {r["session_id"]: r["reward"] for r in rows if "-half-" in r["session_id"]}
    assert half == {"u-half-0": 0.5, "u-half-1": -0.5, "u-half-2": 0.5, "u-half-3": -0.5}


@pytest.mark.integration
def test_replay_draws_sessions_near_the_frontier_and_records_the_draw(
    kafka_settings,
    source_topic,
    unique,
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """Budget 6 of 12 sessions: 3 of the half-solved task and 2 + 1 of the others (the same
    arithmetic as train --from-delta's, tests/test_trainer_offline.py); only those sessions'
    records reach the namespace; a rerun keeps the draw and replays nothing."""
    topic, specs = source_topic
    env = cli_env(tmp_path, specs)
    lake = tmp_path / "lake"
    sessions = trajectories(lake, f"ra{unique}")
    produce_source(kafka_settings, topic, sessions, 48, int(time.time() * 1000) - 60_000)
    ns = f"ra{unique}"
    args = ["replay", "--topics", topic, "--into", ns, "--allocate", "frontier", "--budget", "6",
            "--lake-root", str(lake), "--where", "policy_id = 'p'"]  # fmt: skip
    try:
        res = invoke(args, env)
        assert res.exit_code == 0, res.output
        assert "allocation frontier: 6 row(s) over 3 task(s)" in res.output
        copied = read_topic(kafka_settings, names.resolve(topic, ns))
        keys = {m.key().decode() for msgs in copied.values() for m in msgs}
        per = {n: sum(1 for k in keys if f"-{n}-" in k) for n in PROMPTS}
        assert len(keys) == 6 and per["half"] == 3
        assert sorted([per["solved"], per["failed"]]) == [1, 2]
        # every record of a drawn session came along (4 each: 48 over 12 sessions)
        assert sum(len(msgs) for msgs in copied.values()) == 6 * 4
        table = DeltaTable(str(lake / "allocations")).to_pyarrow_table().to_pylist()
        assert {r["session_id"] for r in table} == keys
        assert {r["policy_id"] for r in table} == {f"replay:{ns}"}
        again = invoke(args, env)
        assert again.exit_code == 0 and "nothing to replay" in again.output, again.output
        assert DeltaTable(str(lake / "allocations")).to_pyarrow_table().num_rows == 6
        both = invoke([*args[:-2], "--sessions", sessions[0]], env)
        assert both.exit_code == 2 and "not both" in both.output
    finally:
        drop(env, ns)
