"""Canary rollout on simulated traffic: how many users a harmful candidate reaches before it
is withdrawn, how long a good one takes to be rolled out, and how often each is decided
wrongly; and how fast the regression watch catches a version that drops after rollout.

No model and no broker: sessions arrive one at a time, each routed to the canary with
probability ``--share`` (the gateway's hash of the user or session is uniform), each with
a verified outcome drawn with its arm's success probability. They are folded into the
runner's ``SessionBook`` and judged by the runner's functions (``canary.decide``,
``watch.check``) with the ``[canary]`` settings, at each new canary session (the runner
evaluates at each poll that brings a new outcome; at these rates that is every session).
Outcomes are known at once here; live, they arrive when sessions close, which delays each
decision by that much, not by more sessions.

    .venv/bin/python bench/canary.py                 # defaults: 20 seeds per scenario
    .venv/bin/python bench/canary.py --seeds 5 --sessions-per-hour 600
    .venv/bin/python bench/canary.py --margin 0.1 --min-sessions 30

Columns: decisions (rollout / withdraw / undecided within ``--max-traffic`` sessions), canary
sessions at the decision (median, max), exposure = canary sessions / all sessions until the
decision (the share of users who met the candidate), all sessions until the decision and
that traffic's time at ``--sessions-per-hour``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from pipeline.versions import watch
from pipeline.versions.canary import decide
from pipeline.versions.config import CanarySettings
from pipeline.versions.sessions import SessionBook

STABLE, CANARY = 1, 2


@dataclass(frozen=True)
class Run:
    decision: str  # rollout | withdraw | undecided
    canary_sessions: int
    sessions: int  # all sessions, both arms, until the decision


def canary_run(
    p_stable: float, p_canary: float, cfg: CanarySettings, share: float, seed: int, max_traffic: int
) -> Run:
    """One canary from its first session to its decision (or ``max_traffic`` sessions)."""
    rng = random.Random(seed)
    book = SessionBook("bench")
    n_canary = 0
    for i in range(max_traffic):
        arm = CANARY if rng.random() < share else STABLE
        passed = rng.random() < (p_canary if arm == CANARY else p_stable)
        book.add("bench", arm, f"s{i}", 1.0 if passed else -1.0, ts_ms=i)
        if arm != CANARY:
            continue
        n_canary += 1
        # as the decider: the stable arm counts from when the canary became servable, the
        # start of this run's traffic (ts 0)
        verdict = decide(book.rate(CANARY), book.rate(STABLE, since_ms=0), cfg, share)
        if verdict.kind != "wait":
            return Run(verdict.kind, n_canary, i + 1)
    return Run("undecided", n_canary, max_traffic)


def watch_run(
    p_parent: float,
    p_before: float,
    p_after: float,
    cfg: CanarySettings,
    seed: int,
    drop_at: int,
    horizon: int,
    every: int,
) -> int | None:
    """Sessions after the drop (at session ``drop_at`` of the serving version) until the
    watch finds it; a negative number is a false alarm before the drop; None: not found
    within ``horizon`` sessions after it. The parent served ``watch_window`` sessions before."""
    rng = random.Random(seed)
    book = SessionBook("bench")
    for i in range(cfg.watch_window):
        book.add("bench", STABLE, f"p{i}", 1.0 if rng.random() < p_parent else -1.0, ts_ms=i)
    for i in range(drop_at + horizon):
        p = p_before if i < drop_at else p_after
        book.add(
            "bench", CANARY, f"s{i}", 1.0 if rng.random() < p else -1.0, ts_ms=cfg.watch_window + i
        )
        if i % every:
            continue
        v = watch.check(
            book.window(CANARY, cfg.watch_window), book.window(STABLE, cfg.watch_window), cfg
        )
        if v.kind == "withdraw":
            return i - drop_at
    return None


def _fmt_time(sessions: float, per_hour: float) -> str:
    hours = sessions / per_hour
    return f"{hours * 60:.0f} min" if hours < 2 else f"{hours:.1f} h"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--share", type=float, default=0.1, help="canary_share")
    ap.add_argument("--stable", type=float, default=0.6, help="the stable arm's success rate")
    ap.add_argument(
        "--sessions-per-hour",
        type=float,
        default=120.0,
        help="traffic with an outcome, both arms, to turn sessions into time",
    )
    ap.add_argument("--max-traffic", type=int, default=20_000)
    ap.add_argument("--min-sessions", type=int, default=None)
    ap.add_argument("--max-sessions", type=int, default=None)
    ap.add_argument("--margin", type=float, default=None)
    ap.add_argument("--withdraw-probability", type=float, default=None)
    ap.add_argument("--rollout-probability", type=float, default=None)
    ap.add_argument(
        "--watch-every",
        type=int,
        default=5,
        help="evaluate the watch every this many sessions (the canary: every one)",
    )
    args = ap.parse_args()
    overrides = {
        k: v
        for k, v in (
            ("min_sessions", args.min_sessions),
            ("max_sessions", args.max_sessions),
            ("margin", args.margin),
            ("withdraw_probability", args.withdraw_probability),
            ("rollout_probability", args.rollout_probability),
        )
        if v is not None
    }
    cfg = CanarySettings(**overrides)  # type: ignore[arg-type]
    print(
        f"settings: min_sessions {cfg.min_sessions}, max_sessions {cfg.max_sessions}, "
        f"margin {cfg.margin}, withdraw at {cfg.withdraw_probability}, rollout at "
        f"{cfg.rollout_probability}; share {args.share}; {args.seeds} seeds; time at "
        f"{args.sessions_per_hour:g} sessions/h with outcomes"
    )
    scenarios = [
        ("harmful", args.stable - 0.3),
        ("worse", args.stable - 0.15),
        ("slightly worse", args.stable - 0.05),
        ("same", args.stable),
        ("better", args.stable + 0.1),
    ]
    print(
        f"\n{'candidate':<15} {'p':>5} {'roll/withdr/undec':>18} {'canary sessions':>16} "
        f"{'exposure':>9} {'all sessions':>13} {'time':>8}"
    )
    started = time.monotonic()
    for name, p in scenarios:
        runs = [
            canary_run(args.stable, p, cfg, args.share, seed, args.max_traffic)
            for seed in range(args.seeds)
        ]
        count = {
            k: sum(r.decision == k for r in runs) for k in ("rollout", "withdraw", "undecided")
        }
        n_c = [r.canary_sessions for r in runs]
        exposure = statistics.mean(r.canary_sessions / r.sessions for r in runs)
        total = statistics.median(r.sessions for r in runs)
        print(
            f"{name:<15} {p:>5.2f} "
            f"{count['rollout']:>6}/{count['withdraw']}/{count['undecided']:<6}     "
            f"{statistics.median(n_c):>6.0f} (max {max(n_c):>3}) {exposure:>8.1%} "
            f"{total:>13.0f} {_fmt_time(total, args.sessions_per_hour):>8}"
        )
    print(
        f"\nregression watch (window {cfg.watch_window}, min {cfg.watch_min_sessions}, "
        f"P >= {cfg.watch_probability}, margin {cfg.margin}; evaluated every "
        f"{args.watch_every} sessions): the serving version matched its parent "
        f"({args.stable}) for 300 sessions, then dropped"
    )
    print(f"{'drop to':>8} {'found':>6} {'false alarm':>12} {'sessions to find (median, max)':>31}")
    for after in (args.stable - 0.3, args.stable - 0.15, args.stable):
        found = [
            watch_run(args.stable, args.stable, after, cfg, seed, 300, 600, args.watch_every)
            for seed in range(args.seeds)
        ]
        hits = [f for f in found if f is not None and f >= 0]
        false = sum(1 for f in found if f is not None and f < 0)
        spread = f"{statistics.median(hits):.0f}, {max(hits)}" if hits else "-"
        print(f"{after:>8.2f} {len(hits):>6} {false:>12} {spread:>31}")
    print(f"\n({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
