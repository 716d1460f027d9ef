"""The live regression watch, as a pure function: once no canary runs, the serving (stable)
version's recent outcome rate against its parent's.

Each side is its last ``watch_window`` sessions with a verified outcome (``sessions.py``
says which are last), counted as ``table.outcome_rates`` counts them. The test is the
canary's (``canary.worse``): with uniform priors,

    p_drop = P(p_serving < p_parent - margin)

and the watch finds a **drop** when both sides have ``watch_min_sessions`` sessions and
``p_drop >= watch_probability``. There is no cap: the window slides for as long as the
version serves, which is why ``watch_probability`` defaults stricter (0.99) than the
canary's threshold. The runner withdraws the version, or only alerts, once per version
(``canary.watch_action``).
"""

from __future__ import annotations

from .canary import Figure, Verdict, arm_figures, worse
from .config import CanarySettings
from .table import OutcomeRate


def check(serving: OutcomeRate, parent: OutcomeRate, cfg: CanarySettings) -> Verdict:
    """``withdraw`` on a significant drop, else ``wait``, with the numbers."""
    p = worse(serving, parent, cfg.margin)
    figures: dict[str, Figure] = {
        **arm_figures("serving", serving),
        **arm_figures("parent", parent),
        "p_drop": round(p, 6),
        "margin": cfg.margin,
        "window": cfg.watch_window,
        "min_sessions": cfg.watch_min_sessions,
        "watch_probability": cfg.watch_probability,
    }
    said = (
        f"serving {serving.passed}/{serving.total}, parent {parent.passed}/{parent.total} "
        f"(last {cfg.watch_window} each), P(serving < parent - {cfg.margin:g}) = {p:.4f}"
    )
    fewest = min(serving.total, parent.total)
    if fewest < cfg.watch_min_sessions:
        return Verdict(
            "wait",
            f"{said}: {fewest} < {cfg.watch_min_sessions} sessions on a side",
            {**figures, "rule": "min_sessions"},
        )
    if p >= cfg.watch_probability:
        return Verdict(
            "withdraw",
            f"{said}: >= {cfg.watch_probability:g}",
            {**figures, "rule": "watch_probability"},
        )
    return Verdict("wait", f"{said}: < {cfg.watch_probability:g}", {**figures, "rule": "undecided"})
