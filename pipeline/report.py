"""``liverl report``: one PNG and a short text summary of training, read from the Delta lake.

Reads ``<lake>/trajectories``, ``<lake>/gradient_steps`` and ``<lake>/weights`` (schemas in
:mod:`pipeline.lake.tables`, docs/architecture.md#delta-tables) with ``deltalake``/pyarrow,
reading only the columns it plots (never the token id lists). Columns a table lacks are read
as nulls and the panels that need them say so, so a lake written by an older or newer trainer
still renders. Only ``trajectories`` is required; the other two tables are optional.

Drawn with matplotlib's Agg canvas on an explicit :class:`~matplotlib.figure.Figure`
(no pyplot, no global backend state), imported lazily so ``liverl --help`` stays fast.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import ReportError
from pipeline.lake import tables as T

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes

FIGSIZE = (16.0, 9.0)  # inches
DPI = 100  # -> 1600 x 900 px
PNG_SIZE = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))

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

STATUS_COLORS = {
    "trained": "#2ca02c",
    "masked": "#9a9a9a",
    "stale_dropped": "#ff7f0e",
    "no_hint": "#9467bd",
}
STATUS_ORDER = list(STATUS_COLORS)
VERDICT_COLORS = {"candidate": "#9a9a9a", "promoted": "#2ca02c", "rejected": "#d62728"}
EXTRA_COLORS = ["#1f77b4", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]


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


# ---- figure ---------------------------------------------------------------------------------


def _no_data(ax: Axes, message: str = "no data yet") -> None:
    ax.text(
        0.5,
        0.5,
        message,
        ha="center",
        va="center",
        transform=ax.transAxes,
        color="#777777",
        fontsize=11,
    )
    ax.set_xticks([])
    ax.set_yticks([])


def _integer_x(ax: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def step_parts(steps: pa.Table) -> list[dict[str, float]]:
    """Per row, loss part -> value: the ``losses`` map, else the legacy per-part columns."""
    maps = steps.column("losses").to_pylist()
    legacy = {c: steps.column(c).to_pylist() for c in LEGACY_LOSSES if c in steps.column_names}
    out = []
    for i, pairs in enumerate(maps):
        if pairs is not None:
            out.append({k: v for k, v in pairs if v is not None})
        else:
            out.append({LEGACY_LOSSES[c]: vals[i] for c, vals in legacy.items()
                        if vals[i] is not None})
    return out


def _step_series(steps: pa.Table) -> tuple[list[float], dict[str, list[float]]]:
    """x = step; series: total loss, ``part:<name>`` per loss part, kl, clip, grad norm."""
    rows = steps.filter(pc.is_valid(steps.column("step"))).sort_by("step")
    x = _floats(rows.column("step"))
    series = {c: _floats(rows.column(c)) for c in ("loss", "kl", "clip_fraction", "grad_norm")}
    parts = step_parts(rows)
    for name in sorted({k for p in parts for k in p}):
        series[f"part:{name}"] = [p.get(name, math.nan) for p in parts]
    return x, series


def _has(values: list[float]) -> bool:
    return any(not math.isnan(v) for v in values)


def _marker(n: int, shape: str = "o") -> dict[str, Any]:
    """Markers while points are few enough to see (a single point needs one to show)."""
    return {"marker": shape, "markersize": 3} if n <= 150 else {}


def _panel_reward(ax: Axes, per_version: list[VersionStats], known: bool = True) -> None:
    which = "trained samples" if known else "all samples (no status recorded)"
    ax.set_title(f"Mean reward of {which} per version")
    rows = [v for v in per_version if v.reward_n]
    if not rows:
        _no_data(ax, "no trained samples with a reward yet")
        return
    x = [v.version for v in rows]
    mean = [v.reward_mean for v in rows]
    # Standard error of the mean: the band narrows as a version gets more samples.
    sem = [
        0.0
        if v.reward_std is None or math.isnan(v.reward_std)
        else v.reward_std / math.sqrt(v.reward_n)
        for v in rows
    ]
    counts = ax.twinx()
    n = [v.reward_n for v in rows]
    counts.bar(x, n, width=0.6, color="#1f77b4", alpha=0.18)
    counts.set_ylim(0, max(n) * 2.5)  # bars keep to the lower part, under the curve
    counts.set_ylabel("trained samples per version (bars)", color="#1f77b4")
    counts.tick_params(axis="y", colors="#1f77b4")
    ax.set_zorder(counts.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.fill_between(
        x,
        [m - e for m, e in zip(mean, sem, strict=True)],
        [m + e for m, e in zip(mean, sem, strict=True)],
        color="#d62728",
        alpha=0.15,
        linewidth=0,
    )
    ax.plot(x, mean, color="#d62728", **(_marker(len(x)) | {"markersize": 5}))
    ax.axhline(0.0, color="#444444", linewidth=0.6, alpha=0.5)
    ax.set_xlabel("weight version")
    ax.set_ylabel("mean reward (band: ±1 std. error)", color="#d62728")
    ax.tick_params(axis="y", colors="#d62728")
    if len(x) == 1:
        ax.set_xlim(x[0] - 1, x[0] + 1)
    _integer_x(ax)


def _panel_losses(ax: Axes, x: list[float], series: dict[str, list[float]]) -> None:
    ax.set_title("Loss by part per step")
    known = {"rl": "RL (binary)", "opd": "OPD", "kl": "KL to reference (unweighted)"}
    labels = {"loss": "total"} | {
        key: known.get(key[5:], key[5:]) for key in series if key.startswith("part:")
    }
    drawn = False
    for col, label in labels.items():
        if x and _has(series[col]):
            ax.plot(x, series[col], linewidth=1.2, label=label, **_marker(len(x)))
            drawn = True
    if not drawn:
        _no_data(ax, "no loss recorded" if x else "no gradient steps yet")
        return
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    _integer_x(ax)
    ax.legend(loc="best", fontsize=8, framealpha=0.8)


def _panel_kl_clip(ax: Axes, x: list[float], series: dict[str, list[float]]) -> None:
    has_kl, has_clip = bool(x) and _has(series["kl"]), bool(x) and _has(series["clip_fraction"])
    ax.set_title(
        "KL (left axis) and clip fraction (right axis) per step"
        if has_kl and has_clip
        else "KL per step"
        if has_kl
        else "Clip fraction per step"
    )
    if not (has_kl or has_clip):
        ax.set_title("KL and clip fraction per step")
        _no_data(ax, "no KL or clip fraction recorded" if x else "no gradient steps yet")
        return
    if has_kl:
        ax.plot(x, series["kl"], color="#9467bd", **_marker(len(x)))
        ax.set_ylabel("KL (policy vs behavior)", color="#9467bd")
        ax.tick_params(axis="y", colors="#9467bd")
    else:
        ax.set_yticks([])
    if has_clip:
        clip = ax.twinx()
        clip.plot(x, series["clip_fraction"], color="#8c564b", **_marker(len(x), "s"))
        clip.set_ylabel("clip fraction", color="#8c564b")
        clip.tick_params(axis="y", colors="#8c564b")
        top = max(v for v in series["clip_fraction"] if not math.isnan(v))
        clip.set_ylim(0, max(top * 1.15, 0.05))
        clip.yaxis.set_major_formatter(lambda v, _pos: f"{v:.0%}")
    ax.set_xlabel("optimizer step")
    _integer_x(ax)


def _panel_grad(ax: Axes, x: list[float], series: dict[str, list[float]]) -> None:
    ax.set_title("Gradient norm per step (before clipping)")
    if not (x and _has(series["grad_norm"])):
        _no_data(ax, "no grad norm recorded" if x else "no gradient steps yet")
        return
    ax.plot(x, series["grad_norm"], color="#17becf", **_marker(len(x)))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("grad norm")
    ax.set_ylim(bottom=0)
    _integer_x(ax)


def _panel_status(ax: Axes, per_version: list[VersionStats]) -> None:
    ax.set_title("Share of samples by status per version")
    rows = [v for v in per_version if v.samples]
    if not rows:
        _no_data(ax, "no published samples yet")
        return
    statuses = STATUS_ORDER + sorted({s for v in rows for s in v.by_status} - set(STATUS_ORDER))
    statuses = [s for s in statuses if any(v.by_status[s] for v in rows)]
    x = [v.version for v in rows]
    bottom = [0.0] * len(rows)
    extra = iter(EXTRA_COLORS * 4)
    for status in statuses:
        share = [v.by_status[status] / v.samples for v in rows]
        color = STATUS_COLORS.get(status) or next(extra)
        ax.bar(x, share, bottom=bottom, width=0.8, color=color, label=status)
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(lambda v, _pos: f"{v:.0%}")
    ax.set_xlabel("weight version")
    ax.set_ylabel("share of samples")
    if len(rows) <= 12:
        ax.set_xticks(x, [f"{v.version}\nn={v.samples}" for v in rows], fontsize=8)
    else:
        _integer_x(ax)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)


def _panel_verdicts(ax: Axes, weights: pa.Table, verdicts: dict[int, str]) -> None:
    judged = any(s != "candidate" for s in verdicts.values())
    ax.set_title(
        "Weight versions and promotion verdicts"
        if judged
        else "Weight versions published (no verdicts yet)"
    )
    rows = weights.filter(pc.is_valid(weights.column("version")))
    first: dict[int, int] = {}
    for v, t in zip(
        rows.column("version").to_pylist(), rows.column("ts_ms").to_pylist(), strict=True
    ):
        if t is not None and (v not in first or t < first[v]):
            first[v] = t
    if not verdicts or not first:
        _no_data(ax, "no weight versions yet" if not verdicts else "no publish times recorded")
        return
    t0 = min(first.values())
    extra = iter(EXTRA_COLORS * 4)
    colors: dict[str, str] = {}
    for status in sorted(set(verdicts.values()), key=lambda s: (s not in VERDICT_COLORS, s)):
        colors[status] = VERDICT_COLORS.get(status) or next(extra)
        vs = [v for v, s in verdicts.items() if s == status and v in first]
        ax.scatter(
            [(first[v] - t0) / 60_000 for v in vs],
            vs,
            s=36,
            color=colors[status],
            label=f"{status} ({len(vs)})",
            zorder=3,
            edgecolors="white",
            linewidths=0.5,
        )
    ordered = sorted(first)
    ax.plot(
        [(first[v] - t0) / 60_000 for v in ordered], ordered, color="#cccccc", linewidth=1, zorder=2
    )
    ax.set_xlabel(f"minutes since first publish ({_utc(t0)})")
    ax.set_ylabel("weight version")
    from matplotlib.ticker import MaxNLocator

    locator = ax.yaxis.get_major_locator()  # the default AutoLocator, a MaxNLocator
    assert isinstance(locator, MaxNLocator)
    locator.set_params(integer=True)
    if len(ordered) == 1:
        ax.set_xlim(-1, 1)
    ax.legend(loc="lower right", fontsize=8, framealpha=0.8)


def render(data: LakeData, summary: Summary, out: Path) -> tuple[int, int]:
    """Draw the 2x3 grid into ``out`` (PNG); returns its pixel size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    x, series = _step_series(data.steps)
    _panel_reward(axes[0, 0], summary.per_version, summary.status_known)
    _panel_losses(axes[0, 1], x, series)
    _panel_kl_clip(axes[0, 2], x, series)
    _panel_status(axes[1, 0], summary.per_version)
    _panel_grad(axes[1, 1], x, series)
    _panel_verdicts(axes[1, 2], data.weights, summary.verdicts)
    for ax in axes.flat:
        ax.grid(True, alpha=0.25)
    lake = str(data.lake)
    if len(lake) > 70:
        lake = "..." + lake[-67:]
    fig.suptitle(
        f"liverl training report  |  policy {summary.policy or '-'}  |  "
        f"{_plural(len(summary.versions), 'version')}, {_plural(len(summary.steps), 'step')}, "
        f"{_plural(summary.samples, 'sample')}  |  {lake}",
        fontsize=13,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=DPI)
    width, height = fig.canvas.get_width_height()
    return width, height


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def build_report(
    lake: Path,
    out: Path,
    *,
    policy: str | None = None,
    since_version: int | None = None,
    default_policy: str | None = None,
) -> tuple[Summary, list[str]]:
    """Read the lake, write the PNG, return the summary and its text lines."""
    data = load(lake, policy, since_version, default_policy)
    summary = summarize(data)
    summary.size = render(data, summary, out)
    summary.out = out
    return summary, summary_lines(summary, data.missing, data.absent_tables)


# ---- command --------------------------------------------------------------------------------


def _default_lake(ctx: click.Context) -> tuple[Path, str | None]:
    """``[trainer] lake_root`` if set, else ``<state_dir>/lake`` (like ``liverl train``)."""
    from pipeline.settings import Settings

    obj: dict[str, Any] = ctx.find_root().obj or {}
    settings: Settings = obj.get("settings") or Settings()
    cfg = settings.trainer.under_state_dir(settings.state_dir)
    return Path(cfg.lake_root), cfg.policy


@click.command("report")
@click.option(
    "--lake",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Lake folder holding the Delta tables (default: <state_dir>/lake).",
)
@click.option(
    "--policy",
    default=None,
    help="Policy to report (default: the only one in the lake, else [trainer] policy).",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("report.png"),
    show_default=True,
    help="PNG file to write.",
)
@click.option(
    "--html",
    "html_out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="HTML page to write (default: the PNG's path with .html); see --no-html.",
)
@click.option("--no-html", is_flag=True, help="Write only the PNG.")
@click.option(
    "--lag/--no-lag",
    default=True,
    show_default=True,
    help="Ask the broker for consumer lag for the HTML page (3 s timeout).",
)
@click.option(
    "--since-version",
    type=click.IntRange(min=0),
    default=None,
    help="Only weight versions >= N (and the steps that published them).",
)
@click.pass_context
def report(
    ctx: click.Context,
    lake: Path | None,
    policy: str | None,
    out: Path,
    html_out: Path | None,
    no_html: bool,
    lag: bool,
    since_version: int | None,
) -> None:
    """Plot training from the Delta lake into one PNG and an HTML page; print a summary.

    PNG panels: mean reward of trained samples per weight version (with counts), losses by
    part, KL and clip fraction, and grad norm per optimizer step, share of samples by
    status per version, and weight versions with their promotion verdicts.

    The HTML page (self-contained, the PNG inline) adds reward over time by method and by
    judge, each weight version with when it was published and first served, trained
    samples per minute, and consumer lag per group. Judges and serving times come from the
    archive (`liverl archive`); without it the page says what is missing.
    """
    from pipeline.report_html import build_page, lag_reader, render_html

    default_lake, default_policy = _default_lake(ctx)
    lake = lake if lake is not None else default_lake
    summary, lines = build_report(
        lake,
        out,
        policy=policy,
        since_version=since_version,
        default_policy=default_policy,
    )
    for line in lines:
        click.echo(line)
    if no_html:
        return
    settings = (ctx.find_root().obj or {}).get("settings")
    if lag and settings is None:
        from pipeline.settings import Settings

        settings = Settings()
    page = build_page(lake, summary.policy, lag=lag_reader(settings) if lag else None)
    target = render_html(page, html_out or out.with_suffix(".html"), png=out)
    click.echo(f"html: {target}")


if __name__ == "__main__":  # pragma: no cover
    report()
