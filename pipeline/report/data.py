"""The report's data: the three Delta tables of one policy, read and aggregated, and the
text summary.

Reads ``<lake>/trajectories``, ``<lake>/gradient_steps`` and ``<lake>/weights`` (schemas in
:mod:`pipeline.lake.tables`, docs/architecture.md#delta-tables) with ``deltalake``/pyarrow,
reading only the columns it plots (never the token id lists). Columns a table lacks are read
as nulls and the panels that need them say so, so a lake written by an older or newer trainer
still renders. Only ``trajectories`` is required; the other two tables are optional.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import ReportError
from pipeline.lake import tables as T

TRAJ_COLUMNS = ["policy_id", "reward", "status", "weight_version", "step", "ts_ms"]
STEP_COLUMNS = [
    "policy_id",
    "step",
    "weight_version",
    "published_version",
    "loss",
    "losses",
    "kl",
    "clip_fraction",
    "grad_norm",
    "samples",
    "ts_ms",
]
WEIGHT_COLUMNS = ["policy_id", "version", "step", "status", "ts_ms"]

# Statuses in the order the report stacks them (the figure colours each).
STATUS_ORDER = ["trained", "masked", "stale_dropped", "no_hint"]


# ---- reading --------------------------------------------------------------------------------


@dataclass
class LakeData:
    """The rows of one policy, already filtered by ``since_version``."""

    lake: Path
    policy: str | None
    trajectories: pa.Table
    steps: pa.Table
    weights: pa.Table
    missing: dict[str, list[str]] = field(default_factory=dict)  # table -> absent columns
    absent_tables: list[str] = field(default_factory=list)


def _empty(name: str, columns: list[str]) -> pa.Table:
    schema = T.SCHEMAS[name]
    return pa.table({c: pa.array([], type=schema.field(c).type) for c in columns})


# Before the ``losses`` map column, gradient_steps had one column per part of the built-in
# methods; a lake written then still reports its parts.
LEGACY_LOSSES = {"loss_rl": "rl", "loss_opd": "opd"}


def read_columns(
    uri: str, name: str, columns: list[str], legacy: list[str] | None = None
) -> tuple[pa.Table | None, list[str]]:
    """``columns`` of the Delta table at ``uri`` (None if there is no table there).

    Columns the table lacks come back as nulls of the declared type, and are listed.
    ``legacy`` columns (no longer in the schema) are added only where the table has them.
    """
    from deltalake import DeltaTable

    from pipeline.lake.reading import dataset

    if not DeltaTable.is_deltatable(uri):
        return None, []
    table = DeltaTable(uri)
    present = {f.name for f in table.schema().fields}
    old = [c for c in legacy or [] if c in present]
    data = dataset(table).to_table(columns=[c for c in columns if c in present] + old)
    missing = [c for c in columns if c not in present]
    schema = T.SCHEMAS[name]
    for column in missing:
        kind = schema.field(column).type
        data = data.append_column(pa.field(column, kind), pa.nulls(data.num_rows, kind))
    if old and "losses" in missing:
        missing.remove("losses")  # the legacy columns stand in for it
    return data.select(columns + old), missing


def _policies(*tables: pa.Table) -> list[str]:
    seen: set[str] = set()
    for table in tables:
        seen.update(p for p in pc.unique(table.column("policy_id")).to_pylist() if p is not None)
    return sorted(seen)


def load(
    lake: Path, policy: str | None, since_version: int | None, default_policy: str | None = None
) -> LakeData:
    """Read the three tables for one policy; raises :class:`ReportError` with a next step."""
    lake_tables = T.LakeTables(lake)
    traj, traj_missing = read_columns(lake_tables.uri(T.TRAJECTORIES), T.TRAJECTORIES, TRAJ_COLUMNS)
    if traj is None:
        raise ReportError(
            f"no trajectories yet at {lake}; run `liverl up` or `liverl train` first "
            "(or point --lake at <state_dir>/lake)"
        )
    steps, steps_missing = read_columns(
        lake_tables.uri(T.GRADIENT_STEPS), T.GRADIENT_STEPS, STEP_COLUMNS, list(LEGACY_LOSSES)
    )
    weights, weights_missing = read_columns(lake_tables.uri(T.WEIGHTS), T.WEIGHTS, WEIGHT_COLUMNS)
    absent = [n for n, t in ((T.GRADIENT_STEPS, steps), (T.WEIGHTS, weights)) if t is None]
    steps = steps if steps is not None else _empty(T.GRADIENT_STEPS, STEP_COLUMNS)
    weights = weights if weights is not None else _empty(T.WEIGHTS, WEIGHT_COLUMNS)

    policies = _policies(traj, steps, weights)
    if policy is not None and policy not in policies:
        known = ", ".join(policies) or "none"
        raise ReportError(f"no rows for policy {policy!r} at {lake} (policies present: {known})")
    if policy is None and len(policies) == 1:
        policy = policies[0]
    elif policy is None and len(policies) > 1:
        if default_policy in policies:
            policy = default_policy
        else:
            raise ReportError(
                f"several policies at {lake}: {', '.join(policies)}; choose one with --policy"
            )
    if policy is not None:
        traj = traj.filter(pc.equal(traj.column("policy_id"), policy))
        steps = steps.filter(pc.equal(steps.column("policy_id"), policy))
        weights = weights.filter(pc.equal(weights.column("policy_id"), policy))

    if since_version is not None:
        traj = traj.filter(pc.greater_equal(traj.column("weight_version"), since_version))
        # A step belongs to the version it was published with (fallback: the one it left).
        step_version = pc.coalesce(
            steps.column("published_version"), pc.add(steps.column("weight_version"), 1)
        )
        steps = steps.filter(pc.greater_equal(step_version, since_version))
        weights = weights.filter(pc.greater_equal(weights.column("version"), since_version))

    missing = {
        name: cols
        for name, cols in (
            (T.TRAJECTORIES, traj_missing),
            (T.GRADIENT_STEPS, steps_missing),
            (T.WEIGHTS, weights_missing),
        )
        if cols
    }
    return LakeData(lake, policy, traj, steps, weights, missing, absent)


# ---- aggregation ----------------------------------------------------------------------------


def _floats(column: pa.ChunkedArray | pa.Array) -> list[float]:
    """Floats with NaN for nulls (matplotlib draws gaps at NaN)."""
    return [math.nan if v is None else float(v) for v in column.to_pylist()]


@dataclass
class VersionStats:
    version: int
    samples: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    reward_n: int = 0  # trained samples with a reward
    reward_mean: float = math.nan
    reward_std: float = math.nan


@dataclass
class Summary:
    """What the text summary states (also returned to callers and tests)."""

    lake: Path
    policy: str | None
    versions: list[int]
    steps: list[int]
    samples: int
    by_status: Counter[str]
    per_version: list[VersionStats]
    verdicts: dict[int, str]
    first_ms: int | None
    last_ms: int | None
    status_known: bool = True  # False: no status column, every sample counts as trained
    out: Path | None = None
    size: tuple[int, int] | None = None

    @property
    def last_reward(self) -> VersionStats | None:
        with_reward = [v for v in self.per_version if v.reward_n]
        return with_reward[-1] if with_reward else None


def status_known(traj: pa.Table) -> bool:
    """Whether samples carry a status (an older writer may lack the column)."""
    return traj.num_rows == 0 or traj.column("status").null_count < traj.num_rows


def per_version_stats(traj: pa.Table) -> list[VersionStats]:
    """Sample counts by status and mean reward of trained samples, per weight version."""
    stats: dict[int, VersionStats] = {}
    rows = traj.filter(pc.is_valid(traj.column("weight_version")))
    status = pc.fill_null(rows.column("status"), "unknown")
    rows = rows.set_column(rows.schema.get_field_index("status"), "status", status)
    counts = rows.group_by(["weight_version", "status"]).aggregate([([], "count_all")])
    for v, s, n in zip(*(counts.column(c).to_pylist() for c in counts.column_names), strict=True):
        st = stats.setdefault(v, VersionStats(v))
        st.by_status[s] += n
        st.samples += n
    # Reward of trained samples; without a status column every sample counts as trained.
    if status_known(traj):
        trained = rows.filter(pc.equal(rows.column("status"), "trained"))
    else:
        trained = rows
    trained = trained.filter(pc.is_valid(trained.column("reward")))
    if trained.num_rows:
        agg = trained.group_by("weight_version").aggregate(
            [("reward", "mean"), ("reward", "count"), ("reward", "stddev")]
        )
        cols = [
            agg.column(c).to_pylist()
            for c in ("weight_version", "reward_mean", "reward_count", "reward_stddev")
        ]
        for v, mean, n, std in zip(*cols, strict=True):
            st = stats.setdefault(v, VersionStats(v))
            st.reward_mean, st.reward_n, st.reward_std = mean, n, std
    return [stats[v] for v in sorted(stats)]


def final_verdicts(weights: pa.Table) -> dict[int, str]:
    """Per version, the latest non-``candidate`` status (else ``candidate``)."""
    rows = weights.filter(pc.is_valid(weights.column("version")))
    order = sorted(
        zip(rows.column("ts_ms").to_pylist(), range(rows.num_rows), strict=True),
        key=lambda t: (t[0] is not None, t[0] or 0, t[1]),
    )
    versions = rows.column("version").to_pylist()
    statuses = rows.column("status").to_pylist()
    out: dict[int, str] = {}
    for _, i in order:
        status = statuses[i] or "candidate"
        if status != "candidate" or versions[i] not in out:
            out[versions[i]] = status
    return dict(sorted(out.items()))


def summarize(data: LakeData) -> Summary:
    traj, steps, weights = data.trajectories, data.steps, data.weights
    per_version = per_version_stats(traj)
    verdicts = final_verdicts(weights)
    versions = sorted({v.version for v in per_version} | set(verdicts))
    step_ids = steps.column("step") if steps.num_rows else traj.column("step")
    step_list = sorted({s for s in step_ids.to_pylist() if s is not None})
    by_status: Counter[str] = Counter()
    for v in per_version:
        by_status.update(v.by_status)
    unversioned = traj.num_rows - sum(v.samples for v in per_version)
    if unversioned:
        by_status["unpublished"] += unversioned
    stamps = [
        t
        for table in (traj, steps, weights)
        for t in table.column("ts_ms").to_pylist()
        if t is not None
    ]
    return Summary(
        lake=data.lake,
        policy=data.policy,
        versions=versions,
        steps=step_list,
        samples=traj.num_rows,
        by_status=by_status,
        per_version=per_version,
        status_known=status_known(traj),
        verdicts=verdicts,
        first_ms=min(stamps) if stamps else None,
        last_ms=max(stamps) if stamps else None,
    )


# ---- text -----------------------------------------------------------------------------------


def _utc(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _duration(ms: int) -> str:
    s = ms // 1000
    d, s = divmod(s, 86_400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h}h {m}m"
    if h:
        return f"{h}h {m}m {s}s"
    return f"{m}m {s}s" if m else f"{s}s"


def _span(values: list[int]) -> str:
    if not values:
        return "0"
    if len(values) == 1:
        return f"1 ({values[0]})"
    return f"{len(values)} ({values[0]}..{values[-1]})"


def _reward(v: VersionStats) -> str:
    return f"v{v.version} {v.reward_mean:.4f} (n={v.reward_n})"


def summary_lines(s: Summary, missing: dict[str, list[str]], absent: list[str]) -> list[str]:
    status_order = STATUS_ORDER + sorted(set(s.by_status) - set(STATUS_ORDER))
    statuses = ", ".join(f"{k} {s.by_status[k]}" for k in status_order if s.by_status[k])
    lines = [
        f"liverl report: policy {s.policy or '-'}, lake {s.lake}",
        f"versions: {_span(s.versions)}   steps: {_span(s.steps)}   "
        f"samples: {s.samples}" + (f" ({statuses})" if statuses else ""),
    ]
    which = "trained samples" if s.status_known else "all samples: no status recorded"
    last = s.last_reward
    if last is None:
        lines.append(f"reward ({which}): no trained samples with a reward yet")
    else:
        lines.append(f"last reward mean ({which}): {_reward(last)}")
        recent = [v for v in s.per_version if v.reward_n][-5:]
        lines.append("reward mean by version: " + "; ".join(_reward(v) for v in recent))
    if s.verdicts:
        counts = Counter(s.verdicts.values())
        lines.append("verdicts: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
    if s.first_ms is not None and s.last_ms is not None:
        lines.append(
            f"time span: {_utc(s.first_ms)} -> {_utc(s.last_ms)} "
            f"({_duration(s.last_ms - s.first_ms)})"
        )
    for name in absent:
        lines.append(f"note: no {name} table yet")
    for name, cols in missing.items():
        lines.append(f"note: {name} has no column(s) {', '.join(cols)} (read as empty)")
    if s.out is not None and s.size is not None:
        lines.append(f"wrote {s.out} ({s.size[0]}x{s.size[1]} px)")
    return lines


def step_parts(steps: pa.Table) -> list[dict[str, float]]:
    """Per row, loss part -> value: the ``losses`` map, else the legacy per-part columns."""
    maps = steps.column("losses").to_pylist()
    legacy = {c: steps.column(c).to_pylist() for c in LEGACY_LOSSES if c in steps.column_names}
    out = []
    for i, pairs in enumerate(maps):
        if pairs is not None:
            out.append({k: v for k, v in pairs if v is not None})
        else:
            out.append(
                {LEGACY_LOSSES[c]: vals[i] for c, vals in legacy.items() if vals[i] is not None}
            )
    return out
