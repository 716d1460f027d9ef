"""Learning benchmark: the same simulated users teach each method their preference.

For every (method, KL coefficient, hint rate, seed) a fresh loop (``liverl up`` with its own
policy, LoRA on SmolLM2-135M-Instruct) runs the demo's sessions; printed per run: training
sessions until the moving satisfied share first reaches 50 % and 75 % over a window, the
held-out satisfied share before and after, and the held-out quality share (answers that are
on topic, not degenerate, not repeated) next to it, so a gain won by gaming the preference
shows. The paper's own metric, sessions until three consecutive sessions satisfy the user
(the preference met *and* the question answered), is printed per method as the mean over the
seeds that reached it and how many did, beside OpenClaw-RL's figures (Qwen3-4B, a simulated
user); the setups differ (model size, preference, judge), so compare orderings, not numbers.
The capability probe (20 fixed factual questions, never trained on) is printed for every
run, base vs final: greedy answers correct, and fluency (mean log-prob per token of sampled
answers under the frozen base model), because one RL step once turned sampled answers into
gibberish while greedy ones stayed right. Runs are appended to ``--out`` as they finish, so
a long sweep that is interrupted keeps what it measured. ``--frontier`` / ``--adapt`` turn on
the simulated users' critic (pipeline/sim/critic.py): runs with and without it are separate
rows of the table ("critic" column), so the effect is read on the same seeds. Prints figures;
asserts nothing.

    .venv/bin/python bench/learning.py [--methods rl opd hybrid] [--seeds 0 1 2]
        [--hint-rates 1.0 0.5] [--kl-coefs 0 0.05] [--rounds 10] [--users 6]
        [--frontier] [--adapt] [--feedback 0.3] [--label NAME] [--env LIVERL_X=V ...]
        [--out .liverl/bench-learning.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pipeline.demo.loop import LoopConfig, running_loop
from pipeline.demo.runner import (
    DemoConfig,
    DemoRunner,
    sessions_until_consecutive,
    sessions_until_met,
)
from pipeline.settings import Settings

OPENCLAW_RL = {"hybrid": 10.3, "rl": 14.1, "opd": 29.7}  # sessions, Qwen3-4B, their paper


def one(
    method: str, seed: int, hint_rate: float, kl_coef: float | None, args: argparse.Namespace
) -> dict:
    settings = Settings()
    if kl_coef is None:  # the product default
        kl_coef = settings.trainer.kl_coef
        extra: dict[str, str] = {}
    else:
        extra = {"LIVERL_TRAINER_KL_COEF": str(kl_coef)}
    state = Path(settings.state_dir)
    lake = Path(settings.trainer.under_state_dir(state).lake_root)
    policy = f"bench-{method}-kl{kl_coef:g}-s{seed}-h{hint_rate:g}-{time.strftime('%H%M%S')}"
    cfg = DemoConfig(
        method=method,
        preference=args.preference,
        hint_rate=hint_rate,
        users=args.users,
        rounds=args.rounds,
        eval_questions=args.eval_questions,
        seed=seed,
        pace_s=args.pace_s,
        settle_s=args.pace_s,
        frontier=args.frontier,
        adapt=args.adapt,
        feedback=args.feedback,
    )
    if args.gate is not None:  # None: the product default (trainer.gate)
        extra["LIVERL_TRAINER_GATE"] = "true" if args.gate else "false"
    # No canary: this measures learning, so every user meets each promoted version at once
    # (pipeline/demo/loop.py sets the same; --env LIVERL_TRAINER_CANARY_SHARE=0.1 measures
    # learning with canary rollout).
    extra["LIVERL_TRAINER_CANARY_SHARE"] = "0"
    extra.update(dict(kv.split("=", 1) for kv in args.env))
    loop = LoopConfig(
        policy=policy,
        method=method,
        state_dir=state,
        batch_samples=2 * args.users,
        lr=args.lr,
        extra_env=extra,
    )
    with running_loop(loop) as running:
        result = DemoRunner(running.url, policy, cfg).run(lake)
    summary = result.summary()
    summary["kl_coef"] = kl_coef
    summary["env"] = extra
    summary["frontier"], summary["adapt"] = args.frontier, args.adapt
    summary["label"] = args.label
    return summary


def _until(runs: list[dict], threshold: float, window: int, most: int) -> str:
    met = [sessions_until_met(r["train_satisfied"], window, threshold) for r in runs]
    reached = [m for m in met if m is not None]
    if not reached:
        return f"not within {most}"
    return f"{statistics.mean(reached):.0f} ({len(reached)}/{len(met)})"


def _consecutive(runs: list[dict], most: int, k: int = 3) -> str:
    """The paper's metric: mean sessions until ``k`` satisfied in a row, over the runs that
    got there (and how many did)."""
    met = [sessions_until_consecutive(r["train_satisfied"], k) for r in runs]
    reached = [m for m in met if m is not None]
    if not reached:
        return f"not within {most}"
    return f"{statistics.mean(reached):.1f} ({len(reached)}/{len(met)})"


def _probe(p: dict | None) -> str:
    """``17/20 -1.42``: probe answers correct (greedy) and fluency; ``-`` when not probed."""
    if not p:
        return "-"
    flu = "n/a" if p.get("fluency") is None else f"{p['fluency']:.2f}"
    return f"{p['correct']}/{p['n']} {flu}"


def _probe_mean(runs: list[dict], key: str) -> str:
    probes = [r[key] for r in runs if r.get(key)]
    if not probes:
        return "-"
    share = statistics.mean(p["correct"] / p["n"] for p in probes if p["n"])
    flus = [p["fluency"] for p in probes if p.get("fluency") is not None]
    return f"{share:.0%} {statistics.mean(flus):.2f}" if flus else f"{share:.0%} n/a"


def _variant(r: dict) -> str:
    """The critic's part in a run (off: uniform, plain; frontier, adapt or both), then the
    run's ``--label`` (e.g. the judge panel it ran with)."""
    on = [name for name in ("frontier", "adapt") if r.get(name)]
    critic = "+".join(on) or "off"
    return f"{critic} {r['label']}" if r.get("label") else critic


def _pct(values: list[float]) -> str:
    mean = statistics.mean(values)
    spread = f" ({min(values):.0%}-{max(values):.0%})" if len(values) > 1 else ""
    return f"{mean:.0%}{spread}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["rl", "opd", "hybrid"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--hint-rates", nargs="+", type=float, default=[1.0])
    ap.add_argument(
        "--kl-coefs",
        nargs="+",
        type=float,
        default=[None],
        help="KL-to-reference coefficients to try (trainer --kl-coef; default: "
        "the trainer's default)",
    )
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--window", type=int, default=12)
    ap.add_argument("--eval-questions", type=int, default=8)
    ap.add_argument("--preference", default="concise")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument(
        "--pace-s",
        type=float,
        default=600.0,
        help="the most a round waits for the version trained on it (the demo's "
        "180 s; longer keeps a run's figures the same when the CPU is shared)",
    )
    ap.add_argument(
        "--gate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the trainer's promotion gate on/off (default: the product default)",
    )
    ap.add_argument(
        "--frontier",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="questions drawn by frontier sampling (pipeline/sim/critic.py)",
    )
    ap.add_argument(
        "--adapt",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the critic adapts the users' phrasing to the policy's success",
    )
    ap.add_argument(
        "--feedback",
        type=float,
        default=0.0,
        help="share of training sessions whose user gives thumbs up/down",
    )
    ap.add_argument(
        "--label",
        default="",
        help="a name for these runs, shown beside the critic (e.g. 'panel weighted')",
    )
    ap.add_argument(
        "--env",
        nargs="*",
        default=[],
        metavar="LIVERL_TRAINER_X=V",
        help="extra settings for the loop (e.g. LIVERL_TRAINER_PPO_EPOCHS=1)",
    )
    ap.add_argument("--out", type=Path, default=Path(".liverl/bench-learning.json"))
    ap.add_argument(
        "--table-only",
        action="store_true",
        help="print the table from the runs already in --out; run nothing",
    )
    args = ap.parse_args()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = json.loads(args.out.read_text()) if args.out.exists() else []
    if not args.table_only:
        for hint_rate in args.hint_rates:
            for kl_coef in args.kl_coefs:
                for method in args.methods:
                    for seed in args.seeds:
                        s = one(method, seed, hint_rate, kl_coef, args)
                        runs.append(s)
                        args.out.write_text(json.dumps(runs, indent=2))
                        b, a = s["heldout_before"], s["heldout_after"]
                        print(
                            f"{method:<7} kl {s['kl_coef']:g} seed {seed} hint {hint_rate:g}: "
                            f"held-out satisfied {b['satisfied']:.0%} -> "
                            f"{a['satisfied']:.0%}, quality {b['quality_ok']:.0%} -> "
                            f"{a['quality_ok']:.0%}, train satisfied "
                            f"{s['train_satisfied_share']:.0%}, {s['sessions']} sessions, "
                            f"freshness p50 {s['freshness_s']['p50']}, {s['wall_s']:.0f} s",
                            flush=True,
                        )
                        k3 = s["sessions_until_3_consecutive"]
                        print(
                            f"        3 satisfied in a row: "
                            f"{'never' if k3 is None else f'after {k3} sessions'}; "
                            f"probe (correct, fluency) "
                            f"{_probe(s['probe_before'])} -> {_probe(s['probe_after'])}"
                            + (f" ({s['probe_note']})" if s.get("probe_note") else ""),
                            flush=True,
                        )

    print(
        f"\nSmolLM2-135M-Instruct + LoRA, {args.users} users per round, preference "
        f"'{args.preference}', moving share over {args.window} sessions"
    )
    print(
        f"{'method':<8}{'critic / label':>26}{'kl':>5}{'hint':>6}{'runs':>6}{'until 50 %':>14}"
        f"{'until 75 %':>14}{'held-out v0':>15}{'held-out final':>18}{'quality final':>18}"
        f"{'3 in a row':>14}{'OpenClaw-RL':>13}{'probe v0':>14}{'probe final':>14}"
        f"{'wall s':>8}"
    )

    def key(r: dict) -> tuple:
        return (r.get("kl_coef", 0.0), r["hint_rate"], r["method"], _variant(r))

    keys = sorted(
        {key(r) for r in runs},
        key=lambda k: (
            k[1] != 1.0,
            k[0],
            ["hybrid", "rl", "opd"].index(k[2]) if k[2] in ("hybrid", "rl", "opd") else 9,
            k[3],
        ),
    )
    for kl_coef, hint_rate, method, variant in keys:
        mine = [
            r
            for r in runs
            if key(r) == (kl_coef, hint_rate, method, variant) and "train_satisfied" in r
        ]
        if not mine:
            continue
        most = max(len(r["train_satisfied"]) for r in mine)
        print(
            f"{method:<8}{variant:>26}{kl_coef:>5g}{hint_rate:>6g}{len(mine):>6}"
            f"{_until(mine, 0.5, args.window, most):>14}"
            f"{_until(mine, 0.75, args.window, most):>14}"
            f"{_pct([r['heldout_before']['satisfied'] for r in mine]):>15}"
            f"{_pct([r['heldout_after']['satisfied'] for r in mine]):>18}"
            f"{_pct([r['heldout_after']['quality_ok'] for r in mine]):>18}"
            f"{_consecutive(mine, most):>14}"
            f"{OPENCLAW_RL.get(method, float('nan')):>13}"
            f"{_probe_mean(mine, 'probe_before'):>14}{_probe_mean(mine, 'probe_after'):>14}"
            f"{statistics.mean(r['wall_s'] for r in mine):>8.0f}"
        )
    print(
        "3 in a row: sessions until three consecutive satisfied ones, mean over the seeds "
        "that got there (reached/runs); OpenClaw-RL reports the same count. probe: share "
        "of 20 fixed questions right (greedy) and fluency (base log-prob/token of sampled "
        "answers; nearer 0 is more fluent)"
    )
    print(
        f"\n{'capability probe per run':<44}{'v0 correct':>12}{'fluency':>9}"
        f"{'final correct':>15}{'fluency':>9}"
    )
    for r in runs:
        b, a = r.get("probe_before"), r.get("probe_after")
        if not b or not a:
            continue
        name = (
            f"{r['method']} kl {r.get('kl_coef', 0.0):g} hint {r['hint_rate']:g} seed {r['seed']}"
        )

        def flu(p: dict) -> str:
            return "n/a" if p.get("fluency") is None else f"{p['fluency']:.2f}"

        print(
            f"{name:<44}{b['correct']:>9}/{b['n']:<2}{flu(b):>9}"
            f"{a['correct']:>12}/{a['n']:<2}{flu(a):>9}"
        )
    print(f"runs in {args.out}")


if __name__ == "__main__":
    main()
