"""Frontier sampling for ``liverl replay``: which sessions to replay for offline retraining.

A replay copies whole sessions, so the unit drawn is a session: one row per session of the
lake's ``trajectories`` (optionally filtered by ``--where``), its task the digest of its
earliest turn's prompt and its success whether its rewards average above 0. The draw is
:func:`pipeline.trainer.offline.allocate`'s, so a replay and ``train --from-delta`` allocate
alike, and it is recorded the same way in the ``allocations`` table (``policy_id``
``replay:<namespace>``, ``event_id`` the session's earliest sample).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from pipeline.trainer import offline


def session_rows(selection: offline.Selection) -> pa.Table:
    """One row per session: its earliest turn's row, ``reward`` the mean over its rows."""
    rows = selection.rows
    sessions = rows.column("session_id").to_pylist()
    turns = rows.column("turn").to_pylist()
    rewards = rows.column("reward").to_pylist()
    first: dict[str, int] = {}
    total: dict[str, list[float]] = {}
    for i, (sid, turn) in enumerate(zip(sessions, turns, strict=True)):
        if sid not in first or turn < turns[first[sid]]:
            first[sid] = i
        total.setdefault(sid, []).append(float(rewards[i] or 0.0))
    order = sorted(first.values())
    picked = rows.take(pa.array(order, pa.int64()))
    means = [sum(total[s]) / len(total[s]) for s in picked.column("session_id").to_pylist()]
    return picked.set_column(picked.schema.get_field_index("reward"), "reward",
                             pa.array(means, pa.float64()))  # fmt: skip


def allocate_sessions(
    lake_root: Path, where: str | None, allocation: offline.Allocation, namespace: str
) -> tuple[list[str], offline.Selection]:
    """The sessions drawn (sorted) and the selection that records why."""
    selection = offline.select(lake_root, "trajectories", where)
    per_session = offline.Selection(selection.table, selection.table_version, selection.where,
                                    session_rows(selection))  # fmt: skip
    chosen = offline.allocate(per_session, allocation, policy_id=f"replay:{namespace}")
    return sorted(chosen.rows.column("session_id").to_pylist()), chosen
