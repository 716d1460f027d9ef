"""Learning benchmark: the same simulated users teach each method their preference.

For every (method, seed, hint rate) a fresh loop (``liverl up`` with its own policy, LoRA on
SmolLM2-135M-Instruct) runs the demo's sessions; printed per run: training sessions until
the moving satisfied share first reaches 75 % over a window, the held-out satisfied share
before and after, and the held-out quality share (answers that are on topic, not degenerate,
not repeated) next to it, so a gain won by gaming the preference shows. OpenClaw-RL's own
figures (Qwen3-4B, a simulated user, sessions until the preference is met) are printed
beside ours; the setups differ (model size, preference, judge), so compare orderings, not
numbers. Prints figures; asserts nothing.

    .venv/bin/python bench/learning.py [--methods rl opd hybrid] [--seeds 0 1]
        [--hint-rates 1.0 0.5] [--rounds 8] [--users 6] [--out .liverl/bench-learning.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pipeline.demo.loop import LoopConfig, running_loop
from pipeline.demo.runner import DemoConfig, DemoRunner
from pipeline.settings import Settings

OPENCLAW_RL = {"hybrid": 10.3, "rl": 14.1, "opd": 29.7}  # sessions, Qwen3-4B, their paper


def one(method: str, seed: int, hint_rate: float, args: argparse.Namespace) -> dict:
    settings = Settings()
    state = Path(settings.state_dir)
    lake = Path(settings.trainer.under_state_dir(state).lake_root)
    policy = f"bench-{method}-s{seed}-h{hint_rate:g}-{time.strftime('%H%M%S')}"
    cfg = DemoConfig(method=method, preference=args.preference, hint_rate=hint_rate,
                     users=args.users, rounds=args.rounds, eval_questions=args.eval_questions,
                     seed=seed)
    loop = LoopConfig(policy=policy, method=method, state_dir=state,
                      batch_samples=2 * args.users, lr=args.lr)
    with running_loop(loop) as running:
        result = DemoRunner(running.url, policy, cfg).run(lake)
    return result.summary()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["rl", "opd", "hybrid"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--hint-rates", nargs="+", type=float, default=[1.0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--eval-questions", type=int, default=8)
    ap.add_argument("--preference", default="concise")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--out", type=Path, default=Path(".liverl/bench-learning.json"))
    args = ap.parse_args()

    runs = []
    for hint_rate in args.hint_rates:
        for method in args.methods:
            for seed in args.seeds:
                s = one(method, seed, hint_rate, args)
                runs.append(s)
                b, a = s["heldout_before"], s["heldout_after"]
                print(f"{method:<7} seed {seed} hint {hint_rate:g}: sessions until met "
                      f"{s['sessions_until_met']}, held-out satisfied {b['satisfied']:.0%} -> "
                      f"{a['satisfied']:.0%}, quality {b['quality_ok']:.0%} -> "
                      f"{a['quality_ok']:.0%}, {s['sessions']} sessions, "
                      f"freshness p50 {s['freshness_s']['p50']}, {s['wall_s']:.0f} s",
                      flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(runs, indent=2))

    print(f"\nSmolLM2-135M-Instruct + LoRA on {args.users} users x {args.rounds} rounds, "
          f"preference '{args.preference}', seeds {args.seeds}")
    print(f"{'method':<8}{'hint':>6}{'sessions until met':>20}{'held-out after':>16}"
          f"{'quality after':>15}{'OpenClaw-RL (sessions)':>24}")
    for hint_rate in args.hint_rates:
        for method in args.methods:
            mine = [r for r in runs if r["method"] == method and r["hint_rate"] == hint_rate]
            met = [r["sessions_until_met"] for r in mine]
            reached = [m for m in met if m is not None]
            until = (f"{statistics.mean(reached):.1f} ({len(reached)}/{len(met)} runs)"
                     if reached else f"not within {args.users * args.rounds}")
            after = statistics.mean(r["heldout_after"]["satisfied"] for r in mine)
            quality = statistics.mean(r["heldout_after"]["quality_ok"] for r in mine)
            print(f"{method:<8}{hint_rate:>6g}{until:>20}{after:>16.0%}{quality:>15.0%}"
                  f"{OPENCLAW_RL.get(method, float('nan')):>24}")
    print(f"runs written to {args.out}")


if __name__ == "__main__":
    main()
