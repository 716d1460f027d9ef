"""Offline retraining: the trainer's input read from a Delta table instead of Kafka.

``liverl train --from-delta trajectories --where "…"`` trains a policy from history (its own
policy id, hence its own weights folder and manifests) with the same publish protocol as a
live trainer. Only the input changes: the selected rows, frozen at the table version read at
start, in a fixed order, play the role of one Kafka partition whose offset is the row index.
The manifest's ``input_topic`` names the selection (table, table version, a hash of the
filter), so a restart resumes after the last published row of the same selection and a
different selection under the same policy is refused, exactly as a different Kafka topic is.

``--allocate uniform|frontier --budget N`` trains on N of the selected rows instead of all:
drawn uniformly, or by frontier sampling over tasks (``pipeline/curriculum``; a task is the
session's first prompt, a row a success when its reward is positive). The rows drawn are
recorded in the lake's ``allocations`` table before training, one row per sample, so every
trained sample's allocation can be joined to the new policy's trajectories by ``event_id``.
The allocation is part of the selection's name: a rerun resumes it, another is refused.

Rows are deduplicated by ``event_id`` (a sample trained again after a fallback to an older
version appears under both versions; the newest row wins). Each row becomes a ``Sample`` for
the new policy whose behaviour version is the new policy's current one: the recorded
log-probs are the old serving policy's, so the PPO ratio and its clipping still correct for
the difference, while staleness (a freshness rule for live traffic) does not apply to history.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.events import Event, Producer, Sample
from pipeline.kafka import Batch, Record
from pipeline.trainer.errors import OfflineInputError

TABLES = ("trajectories",)
PREFIX = "delta:"
ORDER = "ts_ms, source_topic, source_partition, source_offset, event_id"


ALLOCATIONS = ("all", "uniform", "frontier")


@dataclass(frozen=True)
class Allocation:
    """Which of the selected rows to train on: ``all`` (in order), or ``budget`` rows drawn
    ``uniform``-ly or by ``frontier`` sampling, reproducibly from ``seed``."""

    policy: str = "all"
    budget: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in ALLOCATIONS:
            raise OfflineInputError(f"--allocate {self.policy!r}: one of {', '.join(ALLOCATIONS)}")
        if self.policy != "all" and (self.budget is None or self.budget < 1):
            raise OfflineInputError(f"--allocate {self.policy} needs --budget N (N >= 1)")

    @property
    def spec(self) -> str:
        return "" if self.policy == "all" else f"{self.policy}:{self.budget}:{self.seed}"


def _digest(where: str | None, spec: str = "") -> str:
    """Names the selection; without an allocation it is what it always was (old manifests
    resume)."""
    text = (where or "") + (f"\n{spec}" if spec else "")
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Selection:
    table: str
    table_version: int
    where: str | None
    rows: pa.Table = field(repr=False)
    allocation: Allocation = field(default_factory=Allocation)
    # One row per row of ``rows`` (same order) when an allocation chose them.
    allocated: pa.Table | None = field(default=None, repr=False)

    @property
    def input_name(self) -> str:
        """Stands for the Kafka topic in manifests: a different selection never resumes."""
        digest = _digest(self.where, self.allocation.spec)
        return f"{PREFIX}{self.table}@v{self.table_version}/{digest}"


def select(
    lake_root: Path, table: str, where: str | None, *, version: int | None = None
) -> Selection:
    """The rows to train on (at table ``version``, default newest), deduplicated by event
    id, in a fixed order."""
    import duckdb
    from deltalake import DeltaTable

    from pipeline.lake.reading import dataset

    if table not in TABLES:
        raise OfflineInputError(
            f"--from-delta {table!r}: only {', '.join(TABLES)} can be trained from"
        )
    uri = str(Path(lake_root) / table)
    if not DeltaTable.is_deltatable(uri):
        raise OfflineInputError(f"no Delta table {table!r} at {uri}")
    delta = DeltaTable(uri, version=version)
    con = duckdb.connect(":memory:")
    try:
        con.register("source", dataset(delta))
        filtered = f"SELECT * FROM source WHERE {where}" if where else "SELECT * FROM source"
        query = (
            "SELECT * EXCLUDE (_rank) FROM (SELECT *, row_number() OVER (PARTITION BY event_id "
            f"ORDER BY weight_version DESC NULLS LAST) AS _rank FROM ({filtered})) "
            f"WHERE _rank = 1 ORDER BY {ORDER}"
        )
        rows = con.sql(query).to_arrow_table()
    except duckdb.Error as exc:
        raise OfflineInputError(f"--where {where!r}: {exc}") from None
    finally:
        con.close()
    return Selection(table, delta.version(), where, rows)


def to_sample(row: dict[str, Any], policy: str, behavior_version: int) -> Sample:
    return Sample(
        event_id=row["event_id"],
        ts_ms=row["ts_ms"],
        producer=Producer(component="trainer", version="offline"),
        session_id=row["session_id"],
        turn=row["turn"],
        policy_id=policy,
        prompt_token_ids=list(row["prompt_token_ids"]),
        response_token_ids=list(row["response_token_ids"]),
        loss_mask=list(row["loss_mask"]),
        opd_mask=list(row.get("opd_mask") or []),
        behavior_logprobs=list(row["behavior_logprobs"]),
        reward=float(row["reward"]),
        hints=list(row.get("hints") or []),
        behavior_weight_version=behavior_version,
        masked=row.get("status") == "masked",
    )


@dataclass(eq=False)
class DeltaSource:
    """Stands in for the trainer's Kafka consumer: ``poll_batch`` over the selected rows."""

    selection: Selection = field(repr=False)
    policy: str
    position: int = field(default=0, init=False)
    behavior_version: int = field(default=0, init=False)  # the loop's version, before each poll

    @property
    def topic(self) -> str:
        return self.selection.input_name

    def seek(self, offset: int) -> None:
        self.position = max(0, min(offset, self.selection.rows.num_rows))

    @property
    def exhausted(self) -> bool:
        return self.position >= self.selection.rows.num_rows

    def poll_batch(self, max_records: int, timeout: float = 0.0) -> Batch:
        if self.exhausted:
            time.sleep(min(timeout, 0.05))
            return Batch()
        end = min(self.position + max_records, self.selection.rows.num_rows)
        rows = self.selection.rows.slice(self.position, end - self.position).to_pylist()
        records: list[Record[Event]] = [
            Record(
                topic=self.topic,
                partition=0,
                offset=self.position + i,
                key=row["session_id"].encode(),
                timestamp_ms=row["ts_ms"],
                event=to_sample(row, self.policy, self.behavior_version),
            )
            for i, row in enumerate(rows)
        ]
        self.position = end
        return Batch(records=records, offsets={(self.topic, 0): end})

    def close(self) -> None:
        pass


def task_keys(rows: pa.Table) -> list[str]:
    """Per row, its task: a digest of the prompt of its session's earliest turn in ``rows``
    (a later turn's prompt holds the conversation so far; the question is the first)."""
    sessions = rows.column("session_id").to_pylist()
    turns = rows.column("turn").to_pylist()
    prompts = rows.column("prompt_token_ids").to_pylist()
    first: dict[str, tuple[int, str]] = {}
    for sid, turn, prompt in zip(sessions, turns, prompts, strict=True):
        if sid not in first or turn < first[sid][0]:
            digest = hashlib.sha256(array("i", prompt).tobytes()).hexdigest()[:16]
            first[sid] = (turn, digest)
    return [first[sid][1] for sid in sessions]


def allocate(
    selection: Selection, allocation: Allocation, *, policy_id: str = "", now_ms: int | None = None
) -> Selection:
    """The selection narrowed to ``allocation.budget`` rows (kept in the selection's order),
    with the allocation behind each row (:data:`pipeline.lake.tables.ALLOCATIONS_SCHEMA`)."""
    import random

    from pipeline.curriculum import frontier_weight, split_budget, success_by_task
    from pipeline.lake.tables import ALLOCATIONS_SCHEMA

    if allocation.policy == "all":
        return selection
    assert allocation.budget is not None
    rows = selection.rows
    tasks = task_keys(rows) if rows.num_rows else []
    rewards = rows.column("reward").to_pylist()
    by_task: dict[str, list[int]] = {}
    for i, task in enumerate(tasks):
        by_task.setdefault(task, []).append(i)
    success = success_by_task(
        (task, (reward or 0.0) > 0) for task, reward in zip(tasks, rewards, strict=True)
    )
    rng = random.Random(allocation.seed)
    budget = min(allocation.budget, rows.num_rows)
    if allocation.policy == "uniform":
        weights = {t: 1.0 for t in by_task}
        chosen = sorted(rng.sample(range(rows.num_rows), budget))
        counts = {t: 0 for t in by_task}
        for i in chosen:
            counts[tasks[i]] += 1
    else:
        weights = {t: frontier_weight(s.rate) for t, s in success.items()}
        counts = split_budget(weights, budget, {t: len(ix) for t, ix in by_task.items()})
        chosen = sorted(i for t in sorted(by_task) for i in rng.sample(by_task[t], counts[t]))
    narrowed = rows.take(pa.array(chosen, pa.int64()))
    at = now_ms if now_ms is not None else int(time.time() * 1000)
    record = pa.Table.from_pylist(
        [
            {
                "input": "",
                "policy_id": policy_id,
                "position": pos,
                "event_id": rows.column("event_id")[i].as_py(),
                "session_id": rows.column("session_id")[i].as_py(),
                "turn": rows.column("turn")[i].as_py(),
                "task": tasks[i],
                "allocation": allocation.policy,
                "task_rows": len(by_task[tasks[i]]),
                "task_success_rate": success[tasks[i]].rate,
                "task_weight": weights[tasks[i]],
                "task_allocated": counts[tasks[i]],
                "ts_ms": at,
            }  # fmt: skip
            for pos, i in enumerate(chosen)
        ],
        schema=ALLOCATIONS_SCHEMA,
    )
    out = Selection(selection.table, selection.table_version, selection.where, narrowed,
                    allocation)  # fmt: skip
    name = pa.array([out.input_name] * record.num_rows, pa.string())
    return Selection(out.table, out.table_version, out.where, narrowed, allocation,
                     record.set_column(0, "input", name))  # fmt: skip


def record_allocation(lake_root: Path, selection: Selection) -> int:
    """Append the selection's allocation to the lake's ``allocations`` table, once per input
    (a resumed run finds its rows there). Returns the rows written."""
    from deltalake import DeltaTable, write_deltalake

    from pipeline.lake.tables import ALLOCATIONS

    if selection.allocated is None or not selection.allocated.num_rows:
        return 0
    uri = str(Path(lake_root) / ALLOCATIONS)
    if DeltaTable.is_deltatable(uri):
        import pyarrow.compute as pc

        have = DeltaTable(uri).to_pyarrow_table(columns=["input"])
        if pc.any(pc.equal(have.column("input"), selection.input_name)).as_py():
            return 0
    write_deltalake(uri, selection.allocated, mode="append")
    return selection.allocated.num_rows


def allocation_summary(selection: Selection, top: int = 10) -> list[str]:
    """Lines for people: per task (most allocated first) its rows, success rate, weight and
    share of the budget."""
    if selection.allocated is None:
        return []
    seen: dict[str, tuple[int, float, float, int]] = {}
    for row in selection.allocated.to_pylist():
        seen[row["task"]] = (row["task_rows"], row["task_success_rate"], row["task_weight"],
                             row["task_allocated"])  # fmt: skip
    budget = selection.allocated.num_rows
    lines = [f"allocation {selection.allocation.policy}: {budget} row(s) over {len(seen)} "
             "task(s) drawn; task, rows, success, weight, allocated"]  # fmt: skip
    ranked = sorted(seen.items(), key=lambda kv: (-kv[1][3], kv[0]))
    for task, (n, rate, weight, got) in ranked[:top]:
        lines.append(f"  {task}  {n:>5}  {rate:>6.0%}  {weight:>6.3f}  {got:>5} "
                     f"({got / budget:.0%})")  # fmt: skip
    if len(ranked) > top:
        lines.append(f"  … {len(ranked) - top} more task(s)")
    return lines


def pinned_version(
    manifest_input: str | None, table: str, where: str | None, spec: str = ""
) -> int | None:
    """The table version a resumed run must read: the one its newest manifest consumed.

    None when nothing was published yet or the manifest is another input (the caller's
    resume check then refuses it with a clear message).
    """
    if not manifest_input or not manifest_input.startswith(f"{PREFIX}{table}@v"):
        return None
    head, _, digest = manifest_input[len(PREFIX) :].partition("/")
    if digest != _digest(where, spec):
        return None
    return int(head.rsplit("@v", 1)[1])
