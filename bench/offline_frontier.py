"""Offline frontier sampling against uniform on the same budget (issue 26 item 3).

``liverl train --from-delta trajectories --allocate uniform|frontier --budget N`` retrains a
new policy from N rows of the lake, drawn uniformly or by frontier sampling over tasks (a task
is a session's first prompt, a row a success when its reward is positive;
pipeline/curriculum/frontier.py). Its draws are tested; whether spending the budget on the
tasks solved near half the time teaches more than spending it uniformly was never measured.
This benchmark measures it on one history:

1. History: simulated users (the demo's, ``DemoRunner``) against a live loop (``liverl up``,
   ``running_loop``) fill the lake's ``trajectories`` table. The users' training questions are
   narrowed to ``--questions`` of the demo's training split, so each task is asked several
   times and has a success rate of its own (with the whole split nearly every task is asked
   once, every rate is the prior's 1/3 or 2/3 and frontier weights are all alike); the
   questions themselves differ in how often the small model answers them to the user's
   liking. ``--lake POLICY`` skips this and reuses that policy's rows of the lake.
2. From the base model, one offline policy per (allocation, seed): ``liverl train
   --from-delta trajectories --where "policy_id = '<history>' AND turn = 0" --allocate A
   --budget N --allocate-seed S --no-gate --method M`` (``--offline-method``, OPD by
   default; the same budget and seed for both allocations;
   turn 0 is the judged answer, turn 1 the session-closing reply whose one token has no next
   state). The gate is off so the final version is the one trained on the whole budget.
3. Each final version is served alone (``liverl serve --no-record --any-version``) and
   evaluated with ``DemoRunner.evaluate`` and ``DemoRunner.capability``: the demo's held-out
   users on held-out questions (never in the history) and the 20-question capability probe,
   against the base model's figures (the history run's evaluation before its first version).

Printed per policy: rows drawn, distinct tasks drawn, the share of drawn rows whose task's
success rate is near 1/2 (within ``--near`` of it), held-out satisfied base -> final, held-out
quality, probe base -> final and wall time. Results are appended to ``--out``. Asserts nothing.

Run it with a state dir and broker ports of its own (it starts that broker if it is down and
stops it again only if it started it):

    LIVERL_STATE_DIR=$PWD/.liverl/offline-bench LIVERL_BROKER_PORT=19092 \\
    LIVERL_BROKER_CONTROLLER_PORT=19093 .venv/bin/python bench/offline_frontier.py \\
        [--rounds 6] [--users 6] [--questions 8] [--budget-share 0.45] [--seeds 0 1] \\
        [--allocations uniform frontier] [--lake POLICY] [--out .liverl/bench-offline.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from pipeline.demo.loop import LoopConfig, running_loop
from pipeline.demo.runner import DemoConfig, DemoRunner
from pipeline.kafka.broker import LocalBroker
from pipeline.settings import Settings
from pipeline.sim import Critic, Question
from pipeline.sim.critic import EASY
from pipeline.stack import free_port


def _lake(settings: Settings) -> Path:
    state = Path(settings.state_dir)
    return Path(settings.trainer.under_state_dir(state).lake_root)


def _demo_config(args: argparse.Namespace) -> DemoConfig:
    """The demo's settings for the history and for every evaluation (same held-out users:
    the evaluation seed fixes the held-out split and the users)."""
    return DemoConfig(
        method=args.method,
        preference=args.preference,
        users=args.users,
        rounds=args.rounds,
        eval_questions=args.eval_questions,
        seed=args.eval_seed,
        pace=args.pace,
        pace_s=args.pace_s,
        settle_s=args.settle_s,
    )


def tasks(train: list[Question], args: argparse.Namespace) -> list[Question]:
    """The history's questions: ``--questions`` of the training split, asked again and again
    so each task gets a success rate of its own; the first ``--hinted`` of them with the
    preference's hint in the prompt (the critic's easy phrasing), which a small policy can
    meet, so tasks differ in difficulty. The user judges a hinted question as any other
    (its keywords, the preference); plain and hinted are different questions, so one stock
    answer to both is not taken for a repetition."""
    chosen = train[: args.questions]
    critic = Critic(chosen, (args.preference,), seed=args.eval_seed, frontier=False, adapt=False)
    return [
        Question(critic.phrase(q, args.preference, EASY), q.keywords) if i < args.hinted else q
        for i, q in enumerate(chosen)
    ]


def history(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    """Simulated users teach a live loop; their sessions land in the lake."""
    policy = f"offhist-{args.method}-{time.strftime('%H%M%S')}"
    cfg = _demo_config(args)
    extra = {"LIVERL_TRAINER_GATE": "false"}  # the history's own learning is not measured
    loop = LoopConfig(
        policy=policy,
        method=args.method,
        state_dir=Path(settings.state_dir),
        batch_samples=2 * args.users,
        extra_env=extra,
    )
    with running_loop(loop) as running:
        runner = DemoRunner(running.url, policy, cfg)
        runner.train_questions = tasks(runner.train_questions, args)
        result = runner.run(_lake(settings))
    summary = result.summary()
    print(
        f"history {policy}: {summary['sessions']} sessions over {args.questions} questions, "
        f"train satisfied {summary['train_satisfied_share']:.0%}, versions "
        f"{summary['versions_seen']}, {summary['wall_s']:.0f} s",
        flush=True,
    )
    return summary


def _rows(lake: Path, where: str) -> int:
    """Rows the offline trainer would select (before its event-id deduplication)."""
    from pipeline.trainer.offline import select

    return select(lake, "trajectories", where).rows.num_rows


def train_offline(
    policy: str, where: str, allocation: str, budget: int, seed: int, args: argparse.Namespace
) -> tuple[int | None, str]:
    """``liverl train --from-delta``; returns the final version and the trainer's output."""
    cmd = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "train",
        "--policy",
        policy,
        "--method",
        args.offline_method,
        "--from-delta",
        "trajectories",
        "--where",
        where,
        "--allocate",
        allocation,
        "--budget",
        str(budget),
        "--allocate-seed",
        str(seed),
        "--no-gate",
        "--batch-samples",
        str(args.batch_samples),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=False)
    out = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(
            f"offline training {policy} failed ({done.returncode}):\n"
            + "\n".join(out.splitlines()[-25:])
        )
    stopped = re.search(r"stopped at v(\d+)", out)
    return (int(stopped.group(1)) if stopped else None), out


def allocation_stats(lake: Path, policy: str, near: float) -> dict[str, Any]:
    """What the allocation drew (the lake's ``allocations`` rows of ``policy``)."""
    import pyarrow.compute as pc

    from pipeline.lake.reading import dataset
    from pipeline.lake.tables import ALLOCATIONS

    table = dataset(lake / ALLOCATIONS).to_table(filter=pc.field("policy_id") == policy)
    rates = table.column("task_success_rate").to_pylist()
    near_half = sum(abs(r - 0.5) <= near for r in rates)
    return {
        "rows": table.num_rows,
        "tasks": len(pc.unique(table.column("task"))),
        "near_half_share": near_half / len(rates) if rates else None,
    }


@contextlib.contextmanager
def serving(policy: str, state_dir: Path, timeout_s: float = 600.0) -> Iterator[str]:
    """``liverl serve`` for ``policy`` alone, unrecorded, on its newest version."""
    port = free_port()
    log = state_dir / "logs" / f"bench-serve-{policy}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "serve",
        "--port",
        str(port),
        "--policy-id",
        policy,
        "--served-model-name",
        policy,
        "--no-record",
        "--any-version",
        "--replica-id",
        f"bench-{policy}",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ),
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=2).is_success:
                    break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"serve for {policy} not ready after {timeout_s:.0f} s")
        yield f"{url}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def evaluate(
    policy: str, version: int | None, args: argparse.Namespace, settings: Settings
) -> dict[str, Any]:
    """The demo's held-out users and capability probe on ``policy``'s ``version``."""
    with serving(policy, Path(settings.state_dir)) as url:
        runner = DemoRunner(url, policy, _demo_config(args))
        deadline = time.monotonic() + 120
        while (runner.probe() or 0) < (version or 0) and time.monotonic() < deadline:
            time.sleep(1.0)  # the reloader reads the weights topic from its start
        heldout = runner.evaluate("after")
        probe = runner.capability("after")
    return {
        "version": heldout.version,
        "satisfied": heldout.satisfied,
        "meets_preference": heldout.meets_preference,
        "quality_ok": heldout.quality_ok,
        "n": heldout.n,
        "probe": probe.to_dict(),
        "probe_note": runner.probe_note,
    }


def _base(
    args: argparse.Namespace, settings: Settings, hist: dict[str, Any] | None
) -> dict[str, Any]:
    """The base model's figures: the history run's first evaluation, or measured now."""
    if hist is not None:
        b = hist["heldout_before"]
        return {**b, "probe": hist["probe_before"], "probe_note": hist.get("probe_note")}
    return evaluate(f"offbase-{time.strftime('%H%M%S')}", 0, args, settings)


def _table(runs: list[dict[str, Any]]) -> None:
    print(
        f"\n{'allocation':<11}{'seed':>5}{'rows':>6}{'of':>5}{'tasks':>7}{'near 1/2':>10}"
        f"{'held-out base -> final':>24}{'quality':>9}{'probe base -> final':>21}"
        f"{'version':>9}{'train s':>9}{'eval s':>8}"
    )
    for r in runs:
        a, b, f = r["drawn"], r["base"], r["final"]
        near = "-" if a["near_half_share"] is None else f"{a['near_half_share']:.0%}"
        print(
            f"{r['allocation']:<11}{r['seed']:>5}{a['rows']:>6}{r['selected_rows']:>5}"
            f"{a['tasks']:>7}{near:>10}"
            f"{b['satisfied']:>13.0%} -> {f['satisfied']:<6.0%}{f['quality_ok']:>9.0%}"
            f"{b['probe']['correct']:>11}/{b['probe']['n']} -> "
            f"{f['probe']['correct']}/{f['probe']['n']:<3}"
            f"{'v' + str(f['version']):>7}{r['train_s']:>9.0f}{r['eval_s']:>8.0f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="opd", help="the history's live loop")
    ap.add_argument(
        "--offline-method",
        default="opd",
        help="offline retraining (hybrid adds the reward's advantage, which "
        "frontier sampling's weights are about, to the hints)",
    )
    ap.add_argument("--preference", default="concise")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument(
        "--questions",
        type=int,
        default=8,
        help="training questions the history's users ask (repeats make rates)",
    )
    ap.add_argument(
        "--hinted",
        type=int,
        default=4,
        help="of those, asked with the preference's hint (easier tasks)",
    )
    ap.add_argument(
        "--pace",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="history: users wait for each round's version (the demo's pacing)",
    )
    ap.add_argument("--pace-s", type=float, default=180.0)
    ap.add_argument("--settle-s", type=float, default=300.0)
    ap.add_argument("--eval-questions", type=int, default=8)
    ap.add_argument(
        "--eval-seed",
        type=int,
        default=0,
        help="the demo seed of the history and of every evaluation",
    )
    ap.add_argument(
        "--lake",
        default=None,
        metavar="POLICY",
        help="reuse this policy's rows of the lake instead of making a history",
    )
    ap.add_argument(
        "--budget-share", type=float, default=0.45, help="budget as a share of the selected rows"
    )
    ap.add_argument("--budget", type=int, default=None, help="budget in rows (overrides share)")
    ap.add_argument(
        "--batch-samples",
        type=int,
        default=6,
        help="offline batch (a demo round's sessions make one live step)",
    )
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--allocations", nargs="+", default=["uniform", "frontier"])
    ap.add_argument(
        "--near",
        type=float,
        default=0.15,
        help="a task's success rate within this of 1/2 counts as near it",
    )
    ap.add_argument("--out", type=Path, default=Path(".liverl/bench-offline-frontier.json"))
    args = ap.parse_args()

    settings = Settings()
    print(f"state dir {settings.state_dir}, broker {settings.bootstrap}", flush=True)
    broker = LocalBroker(settings)
    started_broker = broker.pid() is None
    broker.up(quiet=True)
    lake = _lake(settings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    saved: list[dict[str, Any]] = json.loads(args.out.read_text()) if args.out.exists() else []
    try:
        hist = None if args.lake else history(args, settings)
        source = args.lake or hist["policy"]  # type: ignore[index]
        where = f"policy_id = '{source}' AND turn = 0"
        selected = _rows(lake, where)
        budget = args.budget or max(1, round(selected * args.budget_share))
        print(f"offline: {selected} rows where {where}; budget {budget}", flush=True)
        base = _base(args, settings, hist)
        runs: list[dict[str, Any]] = []
        stamp = time.strftime("%H%M%S")
        for seed in args.seeds:
            for allocation in args.allocations:
                policy = f"off-{allocation}-s{seed}-{stamp}"
                t0 = time.monotonic()
                version, out = train_offline(policy, where, allocation, budget, seed, args)
                train_s = time.monotonic() - t0
                print(
                    "\n".join(
                        line
                        for line in out.splitlines()
                        if line.startswith(("allocation", "  ", "offline", "stopped"))
                    ),
                    flush=True,
                )
                drawn = allocation_stats(lake, policy, args.near)
                t1 = time.monotonic()
                final = evaluate(policy, version, args, settings)
                run = {
                    "allocation": allocation,
                    "seed": seed,
                    "policy": policy,
                    "history": source,
                    "where": where,
                    "selected_rows": selected,
                    "budget": budget,
                    "method": args.offline_method,
                    "drawn": drawn,
                    "base": base,
                    "final": final,
                    "train_s": round(train_s, 1),
                    "eval_s": round(time.monotonic() - t1, 1),
                    "history_summary": {
                        k: hist[k]
                        for k in (
                            "policy",
                            "sessions",
                            "train_satisfied_share",
                            "versions_seen",
                            "wall_s",
                        )
                    }
                    if hist
                    else None,
                    "config": {
                        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    },
                }
                runs.append(run)
                saved.append(run)
                args.out.write_text(json.dumps(saved, indent=2))
                _table([run])
        print(
            f"\nSmolLM2-135M-Instruct + LoRA, offline method {args.offline_method}, history "
            f"{source}, "
            f"budget {budget} of {selected} rows; near 1/2: task success rate within "
            f"{args.near:g} of 1/2; held-out n={args.eval_questions}, probe of 20"
        )
        _table(runs)
        print(f"runs in {args.out}")
    finally:
        if started_broker:
            broker.down(quiet=True)


if __name__ == "__main__":
    main()
