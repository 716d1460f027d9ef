"""The demo's outputs: a learning-curve PNG and a JSON summary.

Drawn on an explicit Agg figure (no pyplot state), like ``liverl report``.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.demo.runner import DemoResult, moving_share


def write_outputs(result: DemoResult, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    png = out / "learning_curve.png"
    summary = out / "summary.json"
    plot(result, png)
    doc = result.summary()
    doc["sessions_detail"] = [
        {"index": s.index, "round": s.round, "user": s.user_id, "question": s.question,
         "answer": s.answer, "satisfied": s.satisfied, "meets_preference": s.meets_preference,
         "quality_ok": s.quality_ok, "reply": s.reply, "version": s.version}
        for s in result.sessions
    ]
    doc["heldout_answers"] = {"before": result.before.answers, "after": result.after.answers}
    summary.write_text(json.dumps(doc, indent=2, ensure_ascii=False))
    return png, summary


def plot(result: DemoResult, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cfg = result.config
    fig = Figure(figsize=(12.0, 6.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
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
            ax.text(s.index + 1, 1.03, f"v{s.version}", fontsize=7, ha="center",
                    color="#777777")
    end = max(x, default=1)
    # Held-out evaluations (greedy, nothing recorded) as points before and after training.
    for ev, at, label, color in ((result.before, 0, "held-out, initial", "#d62728"),
                                 (result.after, end + 1, "held-out, final", "#006d2c")):
        ax.scatter([at], [ev.satisfied], s=90, marker="D", color=color, zorder=5,
                   label=f"{label} v{ev.version}: {ev.satisfied:.0%} satisfied, "
                         f"{ev.quality_ok:.0%} answer the question (n={ev.n})")
        ax.annotate(f"v{ev.version}: {ev.satisfied:.0%}", (at, ev.satisfied),
                    textcoords="offset points", xytext=(0, 9), ha="center", fontsize=9,
                    color=color)
    fresh = result.freshness_s
    fresh_txt = (f"freshness p50 {sorted(fresh)[len(fresh) // 2]:.1f} s" if fresh
                 else "freshness: n/a")
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
