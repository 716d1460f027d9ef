"""The canary decision, as a pure function of two arms' session outcomes.

A canary version serves a share of the traffic beside the stable version (the fold in
``table.py`` says which is which). Each arm's sessions with a verified outcome are counted
as ``table.outcome_rates`` counts them (a session once per version, outcome > 0 passed); the
stable arm counts only its sessions since the canary became servable, so both arms see the
same period's users. With a uniform prior, an arm with ``s`` passed of ``n`` has the posterior
``Beta(1 + s, 1 + n - s)``, and the test is

    p_worse = P(p_canary < p_stable - margin)

computed by ``posterior.prob_worse`` (a one-dimensional integral of a Beta density times a
Beta CDF; see there). The decision, checked in this order:

0. given the canary's ``share`` (< 1), the canary has fewer than ``min_sessions`` sessions
   while the stable arm has ``ceil(max_sessions * (1 - share) / share)`` or more (what its
   share of the traffic would have brought the canary ``max_sessions`` by): **withdraw**,
   rule ``no_canary_traffic``: no replica serves it (a load that failed everywhere, an
   SGLang server asked for a full-weight canary), and waiting would stall every version
   queued behind it;
1. either arm has fewer than ``min_sessions`` sessions: **wait**;
2. ``p_worse >= withdraw_probability``: **withdraw**;
3. ``1 - p_worse >= rollout_probability``: **rollout** (the canary is not worse than the
   stable version by more than the margin, with that probability);
4. the canary has ``max_sessions`` sessions or more: the posterior means decide, **rollout**
   when ``mean_canary >= mean_stable - margin``, else **withdraw**;
5. else **wait**.

Both thresholds are above 0.5, so 2 and 3 never both hold. Replacing one of the canary's
passed sessions by a failed one (same counts) never moves the decision towards rollout: it
raises ``p_worse`` and lowers the canary's mean (tests/test_versions_decision.py checks it with
hypothesis).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from . import posterior
from .config import CanarySettings
from .table import OutcomeRate

Decision = Literal["rollout", "wait", "withdraw"]
Figure = int | float | str | None


@dataclass(frozen=True)
class Verdict:
    """A decision, why, and its numbers (what a decision event carries as ``figures``)."""

    kind: Decision
    reason: str
    figures: dict[str, Figure] = field(default_factory=dict)


def beta(o: OutcomeRate) -> tuple[int, int]:
    """The arm's posterior Beta(1 + passed, 1 + failed) under a uniform prior."""
    return 1 + o.passed, 1 + o.total - o.passed


def worse(candidate: OutcomeRate, reference: OutcomeRate, margin: float) -> float:
    """P(p_candidate < p_reference - margin) under both arms' posteriors."""
    return posterior.prob_worse(*beta(candidate), *beta(reference), margin)


def arm_figures(prefix: str, o: OutcomeRate) -> dict[str, Figure]:
    a, b = beta(o)
    return {
        f"{prefix}_sessions": o.total,
        f"{prefix}_passed": o.passed,
        f"{prefix}_rate": None if o.rate is None else round(o.rate, 6),
        f"{prefix}_mean": round(posterior.mean(a, b), 6),
    }


def starved_after(share: float, cfg: CanarySettings) -> int | None:
    """Stable-arm sessions after which a canary still under ``min_sessions`` gets no traffic
    (rule 0); None for a share of 1 or more, where the stable arm gets none either."""
    if not 0 < share < 1:
        return None
    return math.ceil(cfg.max_sessions * (1 - share) / share)


def decide(
    canary: OutcomeRate, stable: OutcomeRate, cfg: CanarySettings, share: float | None = None
) -> Verdict:
    """Rollout, wait or withdraw for a canary against the stable arm (rules in the module
    docstring), with every number that decided it. ``share``: the canary's share of the
    traffic (rule 0 needs it)."""
    p = worse(canary, stable, cfg.margin)
    mean_c, mean_s = posterior.mean(*beta(canary)), posterior.mean(*beta(stable))
    figures: dict[str, Figure] = {
        **arm_figures("canary", canary),
        **arm_figures("stable", stable),
        "p_worse": round(p, 6),
        "p_not_worse": round(1.0 - p, 6),
        "margin": cfg.margin,
        "min_sessions": cfg.min_sessions,
        "max_sessions": cfg.max_sessions,
        "withdraw_probability": cfg.withdraw_probability,
        "rollout_probability": cfg.rollout_probability,
    }
    said = (
        f"canary {canary.passed}/{canary.total}, stable {stable.passed}/{stable.total}, "
        f"P(canary < stable - {cfg.margin:g}) = {p:.4f}"
    )

    def verdict(kind: Decision, rule: str, why: str) -> Verdict:
        return Verdict(kind, f"{said}: {why}", {**figures, "rule": rule})

    starved = starved_after(share, cfg) if share is not None else None
    if starved is not None and canary.total < cfg.min_sessions and stable.total >= starved:
        return verdict(
            "withdraw",
            "no_canary_traffic",
            f"the stable arm had {stable.total} >= {starved} sessions while the "
            f"canary had {canary.total} < {cfg.min_sessions} at a {share:g} share: "
            "no replica serves it",
        )
    fewest = min(canary.total, stable.total)
    if fewest < cfg.min_sessions:
        return verdict("wait", "min_sessions", f"{fewest} < {cfg.min_sessions} sessions in an arm")
    if p >= cfg.withdraw_probability:
        return verdict("withdraw", "withdraw_probability", f">= {cfg.withdraw_probability:g}")
    if 1.0 - p >= cfg.rollout_probability:
        return verdict("rollout", "rollout_probability", f"1 - that >= {cfg.rollout_probability:g}")
    if canary.total >= cfg.max_sessions:
        kind: Decision = "rollout" if mean_c >= mean_s - cfg.margin else "withdraw"
        return verdict(
            kind,
            "max_sessions",
            f"{canary.total} >= {cfg.max_sessions} canary sessions; posterior "
            f"means {mean_c:.4f} vs {mean_s:.4f}",
        )
    return verdict("wait", "undecided", "neither threshold reached")
