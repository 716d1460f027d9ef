"""Each judge's consistency with the outcomes of recorded learning runs, as one compare file.

The product's own path (``liverl judges compare --help``), once per judge: replay the runs'
sessions (interactions and next states, the users' thumbs among them) into a namespace of its
own, run the reward workers there with that judge until its verdicts stop coming, and read
``liverl judges compare NAME --format json``. The rows of every judge go into one file, which
a panel judge reads (``judge_options.consistency_file``) to weigh its members:

    LIVERL_STATE_DIR=.liverl/bench .venv/bin/python bench/consistency_calibrate.py \\
        --runs .liverl/sweep/panel.json --label "panel equal" \\
        --judges replies verbose agreeable --plugin pipeline.sim.flawed_judges \\
        --out .liverl/sweep/consistency.json

Prints each judge's agreement; asserts nothing. Needs the broker the runs used
(``liverl broker up`` with the same state dir).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LIVERL = str(Path(sys.executable).with_name("liverl"))


def sessions_of(run: dict) -> list[str]:
    """The run's training sessions, as the demo names them."""
    users = int(run["config"]["users"])
    return [
        f"{run['policy']}-r{k // users}-u{k % users}" for k in range(len(run["train_satisfied"]))
    ]


def compare(namespace: str, env: dict[str, str]) -> dict:
    out = subprocess.run(
        [LIVERL, "judges", "compare", namespace, "--format", "json"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)


def judge_namespace(
    judge: str, sessions: list[str], args: argparse.Namespace, env: dict[str, str]
) -> list[dict]:
    """Replay, judge and compare in namespace ``cal-<judge>-<time>``; the judge's rows."""
    ns = f"cal-{judge}-{time.strftime('%H%M%S')}"
    subprocess.run(
        [LIVERL, "replay", "--sessions", ",".join(sessions), "--into", ns],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    log = (args.out.parent / f"{ns}-workers.log").open("w")
    cmd = [LIVERL, "workers", "--namespace", ns, "--judge", judge]
    for p in args.plugin:
        cmd += ["--plugin", p]
    workers = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        seen, still_since = -1, time.monotonic()
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline:
            time.sleep(args.poll_s)
            try:
                doc = compare(ns, env)
            except subprocess.CalledProcessError:  # no verdicts topic yet
                continue
            if doc["verdicts"] != seen:
                seen, still_since = doc["verdicts"], time.monotonic()
            elif seen > 0 and time.monotonic() - still_since >= args.settle_s:
                break
        else:
            raise SystemExit(
                f"{judge}: verdicts still coming after {args.timeout_s} s (workers log {log.name})"
            )
    finally:
        os.killpg(workers.pid, signal.SIGTERM)
        workers.wait(timeout=60)
    rows = [r for r in doc["judges"] if r["judge_id"] != "panel"]
    print(
        f"{judge:<10} namespace {ns}: {doc['verdicts']} verdicts, {doc['outcomes']} outcomes",
        flush=True,
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, required=True, help="bench/learning.py --out")
    ap.add_argument("--label", default=None, help="only the runs with this --label")
    ap.add_argument("--judges", nargs="+", required=True)
    ap.add_argument("--plugin", nargs="*", default=[], help="modules that register judges")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--poll-s", type=float, default=5.0)
    ap.add_argument(
        "--settle-s",
        type=float,
        default=20.0,
        help="verdicts unchanged this long: the judge is done",
    )
    ap.add_argument("--timeout-s", type=float, default=900.0)
    args = ap.parse_args()

    runs = [
        r
        for r in json.loads(args.runs.read_text())
        if args.label is None or r.get("label") == args.label
    ]
    if not runs:
        raise SystemExit(f"no runs labelled {args.label!r} in {args.runs}")
    sessions = [s for r in runs for s in sessions_of(r)]
    env = dict(os.environ)
    if args.plugin:
        env["LIVERL_PROCESSORS_PLUGINS"] = json.dumps(args.plugin)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = [row for judge in args.judges for row in judge_namespace(judge, sessions, args, env)]
    args.out.write_text(
        json.dumps(
            {"namespace": "calibration", "judges": rows, "runs": [r["policy"] for r in runs]},
            indent=2,
        )
    )
    print(
        f"\n{'judge':<12}{'version':<16}{'agree':>7}{'disagree':>10}{'abstain':>9}"
        f"{'consistency':>13}"
    )
    for r in rows:
        print(
            f"{r['judge_id']:<12}{r['judge_version']:<16}{r['agree']:>7}{r['disagree']:>10}"
            f"{r['abstain']:>9}{r['consistency']:>13.3f}"
        )
    print(f"{len(sessions)} sessions of {len(runs)} runs; written to {args.out}")


if __name__ == "__main__":
    main()
