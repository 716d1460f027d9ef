"""Reads what ``liverl versions`` folds: the weights log, the replicas' reload reports, the
samples' outcomes and a version folder's trajectories. One-shot reads (assign, no group, no
commit), so looking at versions moves nobody's offsets."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import orjson

from pipeline import events
from pipeline.kafka import names
from pipeline.kafka.connection import Connectable
from pipeline.kafka.reader import read_to_end

from .table import VersionLog, outcome_rates, rows, served

# pipeline/trainer/publish.py writes it (TRAJ_FILE under checkpoint.TRAINER_DIR); named here
# so that reading a version does not import the trainer (and torch).
TRAJECTORIES = Path("trainer") / "trajectories.parquet"


TIMEOUT_S = 30.0  # a partition that yields nothing this long fails the read (ReadError)


def _decoded(
    topic: str, expected: str, connection: Connectable, timeout_s: float = TIMEOUT_S
) -> list[Any]:
    out: list[Any] = []

    def handle(msg: Any) -> None:
        # a record that does not decode is the consumers' to dead-letter; a view skips it
        with contextlib.suppress(events.EventValidationError):
            out.append(events.decode(msg.value(), expected_type=expected))

    read_to_end(
        connection, [topic], handle, group_prefix="liverl-versions-", idle_timeout_s=timeout_s
    )
    return out


def weights_log(
    connection: Connectable, policy_id: str, timeout_s: float = TIMEOUT_S
) -> VersionLog:
    log = VersionLog(policy_id)
    for ev in _decoded(names.WEIGHTS, "weights", connection, timeout_s):
        log.add(ev)
    return log


def version_rows(
    connection: Connectable,
    policy_id: str,
    *,
    require_promoted: bool,
    outcomes: bool = True,
    timeout_s: float = TIMEOUT_S,
) -> tuple[VersionLog, list[dict[str, Any]]]:
    """The folded log and one row per version (``table.rows``): serving times from the
    replicas' reports and, with ``outcomes``, each version's live outcome rate from the
    samples. What ``liverl versions list`` and ``liverl report`` both show."""
    log = weights_log(connection, policy_id, timeout_s)
    if not log.manifests:  # nothing to rate: the samples topic, the largest, is not read
        return log, []
    serving = served(policy_id, serving_statuses(connection, timeout_s))
    rates = (
        outcome_rates(policy_id, sample_outcomes(connection, policy_id, timeout_s))
        if outcomes
        else {}
    )
    return log, rows(log, serving, rates, require_promoted=require_promoted)


def weights_logs(connection: Connectable) -> dict[str, VersionLog]:
    """Every policy's weights log, folded (``liverl status``)."""
    logs: dict[str, VersionLog] = {}
    for ev in _decoded(names.WEIGHTS, "weights", connection):
        logs.setdefault(ev.policy_id, VersionLog(ev.policy_id)).add(ev)
    return logs


def trainer_statuses(connection: Connectable) -> list[events.TrainerStatus]:
    """The trainers' status events in log order (compacted: about one per policy)."""
    return _decoded(names.TRAINER_STATUS, "trainer_status", connection)


def serving_statuses(
    connection: Connectable, timeout_s: float = TIMEOUT_S
) -> list[events.ServingStatus]:
    return _decoded(names.SERVING_STATUS, "serving_status", connection, timeout_s)


def sample_outcome(
    raw: bytes | None, policy_id: str
) -> tuple[int, str, float | None, int, float | None, int] | None:
    """``(behavior_weight_version, session_id, outcome, ts_ms, judged, turn)`` of one sample
    record of the policy, None for anything else. ``judged`` is the turn's judged score,
    reward minus the path part (``penalty``), when the reward is not a group-normalised
    advantage (None then): the live signal of a session without a verified outcome, such as
    the user's reply.
    Only those fields are read (no validation, no token arrays decoded): the samples topic is
    by far the largest, and a view or the canary decider must not cost what training does."""
    try:
        doc = orjson.loads(raw or b"")
        if doc.get("type") != "sample" or doc.get("policy_id") != policy_id:
            return None
        outcome = doc.get("outcome")
        reward, penalty = doc.get("reward"), doc.get("penalty") or 0.0
        judged = (
            float(reward) - float(penalty)
            if isinstance(reward, int | float)
            and isinstance(penalty, int | float)
            and not doc.get("normalized")
            else None
        )
        return (
            int(doc["behavior_weight_version"]),
            str(doc["session_id"]),
            float(outcome) if isinstance(outcome, int | float) else None,
            int(doc.get("ts_ms") or 0),
            judged,
            int(doc.get("turn") or 0),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None


def sample_outcomes(
    connection: Connectable, policy_id: str, timeout_s: float = TIMEOUT_S
) -> list[tuple[str, int, str, float | None]]:
    """``(policy_id, behavior_weight_version, session_id, outcome)`` of every sample of the
    policy (:func:`sample_outcome` reads each)."""
    out: list[tuple[str, int, str, float | None]] = []

    def handle(msg: Any) -> None:
        got = sample_outcome(msg.value(), policy_id)
        if got is not None:
            out.append((policy_id, *got[:3]))

    read_to_end(
        connection,
        [names.SAMPLES],
        handle,
        group_prefix="liverl-versions-",
        idle_timeout_s=timeout_s,
    )
    return out


def trained_sessions(folder: Path) -> dict[str, int] | None:
    """session id -> turns the version trained on (rows with status ``trained``), from the
    version folder's own trajectories; None when the folder is not readable here."""
    path = folder / TRAJECTORIES
    if not path.is_file():
        return None
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["session_id", "status"])
    out: dict[str, int] = {}
    for sid, status in zip(
        table.column("session_id").to_pylist(), table.column("status").to_pylist(), strict=True
    ):
        if status == "trained":
            out[sid] = out.get(sid, 0) + 1
    return out
