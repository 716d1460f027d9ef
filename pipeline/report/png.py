"""The report's PNG: six panels drawn with matplotlib's Agg canvas on an explicit
:class:`~matplotlib.figure.Figure` (no pyplot, no global backend state), imported lazily so
``liverl --help`` stays fast."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.report.data import (
    STATUS_ORDER,
    LakeData,
    Summary,
    VersionStats,
    _floats,
    _utc,
    step_parts,
)

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes

FIGSIZE = (16.0, 9.0)  # inches
DPI = 100  # -> 1600 x 900 px
PNG_SIZE = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))

STATUS_COLORS = dict(zip(STATUS_ORDER, ["#2ca02c", "#9a9a9a", "#ff7f0e", "#9467bd"], strict=True))
VERDICT_COLORS = {"candidate": "#9a9a9a", "promoted": "#2ca02c", "rejected": "#d62728"}
EXTRA_COLORS = ["#1f77b4", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]


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
