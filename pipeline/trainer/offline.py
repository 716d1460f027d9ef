"""Offline retraining: the trainer's input read from a Delta table instead of Kafka.

``liverl train --from-delta trajectories --where "…"`` trains a policy from history (its own
policy id, hence its own weights folder and manifests) with the same publish protocol as a
live trainer. Only the input changes: the selected rows, frozen at the table version read at
start, in a fixed order, play the role of one Kafka partition whose offset is the row index.
The manifest's ``input_topic`` names the selection (table, table version, a hash of the
filter), so a restart resumes after the last published row of the same selection and a
different selection under the same policy is refused, exactly as a different Kafka topic is.

Rows are deduplicated by ``event_id`` (a sample trained again after a fallback to an older
version appears under both versions; the newest row wins). Each row becomes a ``Sample`` for
the new policy whose behaviour version is the new policy's current one: the recorded
log-probs are the old serving policy's, so the PPO ratio and its clipping still correct for
the difference, while staleness (a freshness rule for live traffic) does not apply to history.
"""

from __future__ import annotations

import hashlib
import time
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


@dataclass(frozen=True)
class Selection:
    table: str
    table_version: int
    where: str | None
    rows: pa.Table = field(repr=False)

    @property
    def input_name(self) -> str:
        """Stands for the Kafka topic in manifests: a different selection never resumes."""
        digest = hashlib.sha256((self.where or "").encode()).hexdigest()[:12]
        return f"{PREFIX}{self.table}@v{self.table_version}/{digest}"


def select(lake_root: Path, table: str, where: str | None, *,
           version: int | None = None) -> Selection:
    """The rows to train on (at table ``version``, default newest), deduplicated by event
    id, in a fixed order."""
    import duckdb
    from deltalake import DeltaTable

    from pipeline.lake.reading import dataset

    if table not in TABLES:
        raise OfflineInputError(f"--from-delta {table!r}: only {', '.join(TABLES)} can be "
                                "trained from")
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
            Record(topic=self.topic, partition=0, offset=self.position + i,
                   key=row["session_id"].encode(), timestamp_ms=row["ts_ms"],
                   event=to_sample(row, self.policy, self.behavior_version))
            for i, row in enumerate(rows)
        ]
        self.position = end
        return Batch(records=records, offsets={(self.topic, 0): end})

    def close(self) -> None:
        pass


def pinned_version(manifest_input: str | None, table: str, where: str | None) -> int | None:
    """The table version a resumed run must read: the one its newest manifest consumed.

    None when nothing was published yet or the manifest is another input (the caller's
    resume check then refuses it with a clear message).
    """
    if not manifest_input or not manifest_input.startswith(f"{PREFIX}{table}@v"):
        return None
    head, _, digest = manifest_input[len(PREFIX):].partition("/")
    if digest != hashlib.sha256((where or "").encode()).hexdigest()[:12]:
        return None
    return int(head.rsplit("@v", 1)[1])
