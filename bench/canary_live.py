"""Canary rollout on simulated users: exposure of a harmful version, time to roll out a good one.

Each repeat starts ``liverl up`` (tiny model, two gateway replicas, the canary decider; no
trainer: the drill publishes the versions, gate off) under a new policy and runs the canary
drill of ``pipeline/demo/canary_drill.py``: v1 answers in English (its users are satisfied,
the base model's are not) and must be rolled out; v2 answers in French and must be
withdrawn. Printed per repeat and as medians: sessions from publication to the decision,
the candidate's share of them (exposure), its canary sessions with an outcome when the
decider decided, and seconds; the users arrive at ``--rate`` sessions per second, one after
another, so seconds scale with 1 / rate while sessions do not. Prints figures; asserts
nothing.

    .venv/bin/python bench/canary_live.py [--repeats 5] [--share 0.1] [--rate 4]
        [--min-sessions 20] [--out bench/results/canary-live.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from pipeline.demo.canary_drill import Phase, loop_config, run_drill
from pipeline.demo.loop import running_loop
from pipeline.settings import Settings
from pipeline.stack import free_port


def row(p: Phase) -> dict:
    figures = p.figures or {}
    return {
        "decision": p.decision,
        "sessions": p.sessions,
        "on_candidate": p.on_candidate,
        "exposure": round(p.exposure, 4),
        "seconds": p.seconds,
        "canary_sessions": figures.get("canary_sessions"),
        "stable_sessions": figures.get("stable_sessions"),
        "p_worse": figures.get("p_worse"),
        "satisfied": {str(k): v for k, v in p.satisfied.items()},
        "after": {str(k): v for k, v in p.after.items()},
        "after_replicas": dict(p.after_replicas),
        "error": p.error,
    }


def one(i: int, args: argparse.Namespace, state: Path) -> dict:
    policy = f"drill-{time.strftime('%H%M%S')}-{i}"
    cfg = loop_config(policy, state, gateways=args.gateways)
    t0 = time.monotonic()
    with running_loop(cfg) as loop:
        settings = Settings()
        trainer = settings.trainer.under_state_dir(Path(settings.state_dir))
        result = run_drill(
            settings,
            trainer,
            loop.url,
            policy,
            share=args.share,
            rate=args.rate,
            seed=i,
            max_sessions=args.max_sessions,
        )
    return {
        "repeat": i,
        "policy": policy,
        "share": args.share,
        "rate": args.rate,
        "min_sessions": args.min_sessions,
        "good": row(result.good),
        "harmful": row(result.harmful),
        "actions": {f"{k}:v{v}": n for (k, v), n in result.actions.items()},
        "wall_s": round(time.monotonic() - t0, 1),
    }


def median(runs: list[dict], phase: str, key: str) -> float | None:
    """Over the runs whose ``phase`` reached a decision (an undecided one has no exposure)."""
    values = [
        r[phase][key]
        for r in runs
        if r[phase]["decision"] is not None and r[phase][key] is not None
    ]
    return statistics.median(values) if values else None


def table(runs: list[dict]) -> str:
    lines = [
        "| repeat | good: decision, sessions (on v1), s | harmful: decision, "
        "sessions (on v2), exposure, s |",
        "|---|---|---|",
    ]
    for r in runs:
        g, h = r["good"], r["harmful"]
        lines.append(
            f"| {r['repeat']} | {g['decision']}, {g['sessions']} ({g['on_candidate']}),"
            f" {g['seconds'] and round(g['seconds'])} | {h['decision']}, "
            f"{h['sessions']} ({h['on_candidate']}), {h['exposure']:.1%}, "
            f"{h['seconds'] and round(h['seconds'])} |"
        )
    rolled = sum(r["good"]["decision"] == "rollout" for r in runs)
    withdrawn = sum(r["harmful"]["decision"] == "withdraw" for r in runs)

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines.append(
        f"\ngood rolled out {rolled}/{len(runs)}, median "
        f"{fmt(median(runs, 'good', 'seconds'), '.0f')} s, "
        f"{fmt(median(runs, 'good', 'sessions'), '.0f')} sessions; harmful withdrawn "
        f"{withdrawn}/{len(runs)}, median exposure "
        f"{fmt(median(runs, 'harmful', 'exposure'), '.1%')}, "
        f"{fmt(median(runs, 'harmful', 'on_candidate'), '.0f')} sessions on it, "
        f"{fmt(median(runs, 'harmful', 'seconds'), '.0f')} s"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--share", type=float, default=0.1, help="canary share (the default's)")
    ap.add_argument("--rate", type=float, default=4.0, help="sessions per second")
    ap.add_argument(
        "--min-sessions", type=int, default=20, help="[canary] min_sessions (the default's)"
    )
    ap.add_argument(
        "--max-sessions",
        type=int,
        default=1500,
        help="the most sessions a phase sends before giving up on a decision",
    )
    ap.add_argument("--gateways", type=int, default=2)
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(".liverl/bench-canary-live.json"),
        help="runs are appended here; use one file per configuration",
    )
    ap.add_argument(
        "--table-only",
        action="store_true",
        help="print the table from the runs already in --out; run nothing",
    )
    args = ap.parse_args()
    runs: list[dict] = json.loads(args.out.read_text()) if args.out.exists() else []
    if not args.table_only:
        state = Path(os.environ.get("LIVERL_STATE_DIR", ".liverl/bench-canary-live")).resolve()
        os.environ.update(
            {
                "LIVERL_STATE_DIR": str(state),
                "LIVERL_TRAINER_GATE": "false",
                "LIVERL_CANARY_MIN_SESSIONS": str(args.min_sessions),
            }
        )
        for key in (
            "LIVERL_PROCESSORS_WEB_PORT",
            "LIVERL_BROKER_PORT",
            "LIVERL_BROKER_CONTROLLER_PORT",
        ):  # beside a test or bench broker
            os.environ.setdefault(key, str(free_port()))
        for _ in range(args.repeats):
            run = one(len(runs), args, state)
            runs.append(run)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(runs, indent=1))
            print(json.dumps(run), flush=True)
    print(table(runs))


if __name__ == "__main__":
    main()
