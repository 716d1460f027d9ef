"""The demo's outputs: a learning-curve PNG and a JSON summary.

Drawn on an explicit Agg figure (no pyplot state), like ``liverl report``. When the capability
probe ran, a side panel shows it before and after: the curve alone cannot show a preference
learned by breaking the answers other users get.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.demo.runner import Capability, DemoResult, moving_share


def write_outputs(result: DemoResult, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    png = out / "learning_curve.png"
    summary = out / "summary.json"
    plot(result, png)
    doc = result.summary()
    doc["sessions_detail"] = [
        {
            "index": s.index,
            "round": s.round,
            "user": s.user_id,
            "question": s.question,
            "answer": s.answer,
            "satisfied": s.satisfied,
            "meets_preference": s.meets_preference,
            "quality_ok": s.quality_ok,
            "reply": s.reply,
            "version": s.version,
            "session_id": s.session_id,
            "prompt": s.prompt,
            "allocation": s.allocation,
        }
        for s in result.sessions
    ]
    doc["heldout_answers"] = {"before": result.before.answers, "after": result.after.answers}
    doc["probe_answers"] = {
        label: {"greedy": cap.result.answers, "sampled": cap.result.samples}
        for label, cap in (("before", result.probe_before), ("after", result.probe_after))
        if cap is not None
    }
    summary.write_text(json.dumps(doc, indent=2, ensure_ascii=False))
    return png, summary


def plot(result: DemoResult, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cfg = result.config
    before, after = result.probe_before, result.probe_after
    probed = before is not None and after is not None
    fig = Figure(figsize=(15.0 if probed else 12.0, 6.5), dpi=100)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1, 2 if probed else 1, width_ratios=[4, 1] if probed else [1])
    ax = fig.add_subplot(grid[0, 0])
    if before is not None and after is not None:
        _plot_probe(fig.add_subplot(grid[0, 1]), before, after, result.probe_note)
    sessions = result.sessions
    x = [s.index + 1 for s in sessions]
    sat = moving_share([s.satisfied for s in sessions], cfg.window)
    pref = moving_share([s.meets_preference for s in sessions], cfg.window)
    qual = moving_share([s.quality_ok for s in sessions], cfg.window)
    ax.plot(x, sat, color="#2ca02c", lw=2.5, label=f"satisfied (moving, {cfg.window} sessions)")
    ax.plot(x, pref, color="#1f77b4", lw=1.2, ls="--", label="meets the preference")
    ax.plot(x, qual, color="#9467bd", lw=1.2, ls=":", label="answers the question (quality)")
    # When each weight version first served a training session.
    shown: set[int] = set()
    for s in sessions:
        if s.version is not None and s.version > 0 and s.version not in shown:
            shown.add(s.version)
            ax.axvline(s.index + 1, color="#bbbbbb", lw=0.8, zorder=0)
            ax.text(s.index + 1, 1.03, f"v{s.version}", fontsize=7, ha="center", color="#777777")
    end = max(x, default=1)
    # Held-out evaluations (greedy, nothing recorded) as points before and after training.
    for ev, at, label, color in (
        (result.before, 0, "held-out, initial", "#d62728"),
        (result.after, end + 1, "held-out, final", "#006d2c"),
    ):
        ax.scatter(
            [at],
            [ev.satisfied],
            s=90,
            marker="D",
            color=color,
            zorder=5,
            label=f"{label} v{ev.version}: {ev.satisfied:.0%} satisfied, "
            f"{ev.quality_ok:.0%} answer the question (n={ev.n})",
        )
        ax.annotate(
            f"v{ev.version}: {ev.satisfied:.0%}",
            (at, ev.satisfied),
            textcoords="offset points",
            xytext=(0, 9),
            ha="center",
            fontsize=9,
            color=color,
        )
    fresh = result.freshness_s
    fresh_txt = (
        f"freshness p50 {sorted(fresh)[len(fresh) // 2]:.1f} s" if fresh else "freshness: n/a"
    )
    ax.set_title(
        f"liverl demo — {result.policy}: method {cfg.method}, preference '{cfg.preference}', "
        f"hint rate {cfg.hint_rate:g}, {len(sessions)} sessions, {fresh_txt}",
        fontsize=10,
    )
    ax.set_xlabel("training session")
    ax.set_ylabel("share")
    ax.set_ylim(-0.02, 1.08)
    ax.set_xlim(-1, end + 2)
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path)


def _plot_probe(ax: Any, before: Capability, after: Capability, note: str | None) -> None:
    """Greedy correct share as bars, fluency written on them, initial vs final version."""
    for i, (label, cap, color) in enumerate(
        (("initial", before, "#d62728"), ("final", after, "#006d2c"))
    ):
        r = cap.result
        share = r.correct / r.n if r.n else 0.0
        ax.bar(i, share, color=color, alpha=0.75, width=0.6)
        flu = f"{r.fluency:.2f}" if r.fluency is not None else "n/a"
        ax.text(
            i,
            share + 0.02,
            f"{r.correct}/{r.n}\nfluency {flu}",
            ha="center",
            va="bottom",
            fontsize=9,
            color=color,
        )
        ax.text(
            i, 0.02, f"{label}\nv{cap.version}", ha="center", va="bottom", fontsize=8, color="white"
        )
    ax.set_xticks([])
    ax.set_xlim(-0.6, 1.6)
    ax.set_ylim(0, 1.25)
    ax.set_ylabel("probe answers correct (greedy)")
    ax.set_title(
        f"capability probe, {after.result.n} fixed questions\nfluency: base "
        "log-prob/token\nof sampled answers",
        fontsize=9,
    )
    ax.grid(alpha=0.3, axis="y")
    if note:
        ax.text(
            0.5,
            -0.04,
            "fluency n/a: base model not loaded",
            transform=ax.transAxes,
            ha="center",
            va="top",
            fontsize=7,
            color="#777777",
        )
