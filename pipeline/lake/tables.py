"""Schemas and locations of the trainer's Delta tables (docs/architecture.md#delta-tables).

Explicit Arrow schemas (not inferred) so every writer, replay and reader agrees on types;
maps and nested metrics are JSON strings because every engine (pyarrow, polars, DuckDB,
Spark) reads a string column.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import pyarrow as pa

from pipeline.events.arrays import json_default

if TYPE_CHECKING:
    from pipeline.events import GateVote

TRAJECTORIES = "trajectories"
ALLOCATIONS = "allocations"
GRADIENT_STEPS = "gradient_steps"
WEIGHTS = "weights"
GATE_VOTES = "gate_votes"

TRAJECTORIES_SCHEMA = pa.schema(
    [
        ("event_id", pa.string()),
        ("session_id", pa.string()),
        ("turn", pa.int64()),
        ("policy_id", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_token_ids", pa.list_(pa.int32())),
        ("response_text", pa.string()),
        ("loss_mask", pa.list_(pa.int8())),  # the RL term's mask
        ("opd_mask", pa.list_(pa.int8())),  # the OPD term's (loss_mask for older samples)
        ("behavior_logprobs", pa.list_(pa.float32())),
        ("reward", pa.float64()),
        ("hints", pa.list_(pa.string())),
        ("selected_hint", pa.string()),
        ("behavior_weight_version", pa.int64()),
        ("staleness", pa.int64()),
        ("status", pa.string()),  # trained | masked | stale_dropped | no_hint | held_out
        ("step", pa.int64()),  # optimizer step that consumed the sample
        ("weight_version", pa.int64()),  # version published with that step
        ("source_topic", pa.string()),
        ("source_partition", pa.int32()),
        ("source_offset", pa.int64()),
        ("ts_ms", pa.int64()),
        ("day", pa.string()),  # partition column: the sample's event day (UTC)
    ]
)

GRADIENT_STEPS_SCHEMA = pa.schema(
    [
        ("policy_id", pa.string()),
        ("step", pa.int64()),
        ("weight_version", pa.int64()),  # version the step started from
        ("published_version", pa.int64()),
        ("method", pa.string()),
        ("loss", pa.float64()),
        # loss part -> value ({"rl": …, "opd": …, "kl": …}); lakes written before this column
        # have loss_rl / loss_opd instead (liverl report reads both)
        ("losses", pa.map_(pa.string(), pa.float64())),
        ("kl", pa.float64()),
        ("clip_fraction", pa.float64()),
        ("grad_norm", pa.float64()),
        ("samples", pa.int64()),
        ("tokens", pa.int64()),
        ("trained_tokens", pa.int64()),
        ("dropped_stale", pa.int64()),
        ("reward_mean", pa.float64()),
        # |engine - trainer| log-prob over the step's samples made by the current version
        # (null when none was): numerical drift between serving and training
        ("logprob_drift_mean", pa.float64()),
        ("logprob_drift_max", pa.float64()),
        ("consumed_offsets", pa.string()),  # JSON {"partition": next_offset}
        ("metrics", pa.string()),  # JSON of every loss metric
        ("ts_ms", pa.int64()),
    ]
)

WEIGHTS_SCHEMA = pa.schema(
    [
        ("policy_id", pa.string()),
        ("version", pa.int64()),
        ("parent", pa.int64()),
        ("step", pa.int64()),
        ("uri", pa.string()),
        ("status", pa.string()),  # candidate | promoted | rejected (gate verdict: 2nd row)
        ("files", pa.string()),  # JSON [{path, sha256, bytes}]
        ("consumed_offsets", pa.string()),
        ("input_topic", pa.string()),
        ("method", pa.string()),
        ("metrics", pa.string()),
        ("ts_ms", pa.int64()),
    ]
)

# One row per gate_vote event, with both answers: the event stays small on Kafka, the lake
# keeps what each judge saw so a verdict can be audited or re-judged offline.
GATE_VOTES_SCHEMA = pa.schema(
    [
        ("policy_id", pa.string()),
        ("version", pa.int64()),  # the candidate
        ("live_version", pa.int64()),  # what it was compared with (0 = base)
        ("prompt_id", pa.string()),
        ("source", pa.string()),  # held_out | probe
        ("judge", pa.string()),
        ("vote", pa.int8()),  # +1 candidate better, -1 live better, 0 tie or abstain
        ("candidate_score", pa.float64()),
        ("live_score", pa.float64()),
        ("candidate_answer", pa.string()),
        ("live_answer", pa.string()),
        ("detail", pa.string()),  # JSON of the event's detail
        # The recorded session a held-out prompt came from (None for the probe): the answers
        # are about a user's prompt, so `liverl forget` erases them with the session.
        ("session_id", pa.string()),
        ("event_id", pa.string()),
        ("ts_ms", pa.int64()),
        ("day", pa.string()),  # partition column: the vote's event day (UTC)
    ]
)

# One row per row an offline run (train --from-delta --allocate) chose to train on, written
# before it trains: the allocation behind each sample, joinable to the new policy's
# trajectories by event_id (pipeline/trainer/offline.py).
ALLOCATIONS_SCHEMA = pa.schema(
    [
        ("input", pa.string()),  # the selection's name, as in the policy's manifests
        ("policy_id", pa.string()),  # the policy trained on it
        ("position", pa.int64()),  # offset of the row in the run's input
        ("event_id", pa.string()),
        ("session_id", pa.string()),
        ("turn", pa.int64()),
        ("task", pa.string()),  # digest of the session's first prompt
        ("allocation", pa.string()),  # uniform | frontier
        ("task_rows", pa.int64()),  # rows the task has in the selection
        ("task_success_rate", pa.float64()),  # (successes + 1) / (trials + 2)
        ("task_weight", pa.float64()),  # the task's weight (frontier), 1 (uniform)
        ("task_allocated", pa.int64()),  # rows of the task in the budget
        ("ts_ms", pa.int64()),  # when the allocation was made
    ]
)

SCHEMAS: dict[str, pa.Schema] = {
    TRAJECTORIES: TRAJECTORIES_SCHEMA,
    GRADIENT_STEPS: GRADIENT_STEPS_SCHEMA,
    WEIGHTS: WEIGHTS_SCHEMA,
    GATE_VOTES: GATE_VOTES_SCHEMA,
    ALLOCATIONS: ALLOCATIONS_SCHEMA,
}
PARTITION_BY: dict[str, list[str] | None] = {
    TRAJECTORIES: ["day"],
    GRADIENT_STEPS: None,
    WEIGHTS: None,
    GATE_VOTES: ["day"],
    ALLOCATIONS: None,
}


@dataclass(frozen=True)
class LakeTables:
    """Where the tables live: ``<root>/<name>`` (a local path or any delta-rs URI)."""

    root: Path

    def uri(self, name: str) -> str:
        return str(Path(self.root) / name)


def to_table(name: str, rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Rows (dicts) to an Arrow table with the table's declared schema."""
    schema = SCHEMAS[name]
    rows = list(rows)
    return pa.Table.from_pylist(rows, schema=schema)


def _day(ts_ms: int) -> str:
    """The UTC day of an event time, ``YYYY-MM-DD``: the ``day`` partition value."""
    return datetime.fromtimestamp(ts_ms / 1000, tz=UTC).strftime("%Y-%m-%d")


def gate_vote_row(
    event: GateVote, candidate_answer: str, live_answer: str, session_id: str | None = None
) -> dict[str, Any]:
    """A ``gate_votes`` row: the vote event plus the two answers it judged (they are kept in
    the lake, not on Kafka, where a vote stays a few hundred bytes)."""
    return {
        "policy_id": event.policy_id,
        "version": event.version,
        "live_version": event.live_version,
        "prompt_id": event.prompt_id,
        "source": event.source,
        "judge": event.judge,
        "vote": event.vote,
        "candidate_score": event.candidate_score,
        "live_score": event.live_score,
        "candidate_answer": candidate_answer,
        "live_answer": live_answer,
        "detail": orjson.dumps(event.detail, default=json_default).decode(),
        "session_id": session_id,
        "event_id": event.event_id,
        "ts_ms": event.ts_ms,
        "day": _day(event.ts_ms),
    }
