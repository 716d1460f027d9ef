"""How often the reward pipeline's judge agreed with the simulated users of learning runs.

A simulated user's verdict (satisfied or not) is the one verifiable outcome a learning run
has; the judge (``replies`` by default) only reads the user's reply. For every training
session of the runs in ``--runs`` (``bench/learning.py --out``) this joins the judge's
turn-0 verdicts from the archived ``prm_scores`` (``liverl up`` archives every topic) to the
user's verdict and prints, per run and pooled, agree / disagree / abstain and RLAnything's
consistency (agree + 1) / (agree + disagree + 2), the same formula ``liverl judges watch``
keeps. Prints figures; asserts nothing.

    LIVERL_STATE_DIR=.liverl/test .venv/bin/python bench/judge_agreement.py \\
        --runs .liverl/sweep/critic.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import orjson

from pipeline.lake.sql import run_query
from pipeline.processors.consistency import Tally
from pipeline.settings import Settings


def session_ids(run: dict) -> dict[str, bool]:
    """Session id -> the user was satisfied, as the demo numbers its sessions."""
    users = int(run["config"]["users"])
    return {
        f"{run['policy']}-r{k // users}-u{k % users}": bool(sat)
        for k, sat in enumerate(run["train_satisfied"])
    }


def verdicts(lake: Path, sessions: list[str]) -> dict[str, list[tuple[str, int]]]:
    """Session -> [(event_id, score)] of its turn-0 verdicts (each event once)."""
    quoted = ", ".join("'" + s.replace("'", "''") + "'" for s in sessions)
    _cols, rows = run_query(
        lake,
        "SELECT DISTINCT event_id, session_id, decode(payload) "
        f"FROM events_prm_scores WHERE turn = 0 AND session_id IN ({quoted})",
    )
    out: dict[str, list[tuple[str, int]]] = {}
    for event_id, sid, raw in rows:
        doc = orjson.loads(raw)
        if doc.get("error") is None:
            out.setdefault(sid, []).append((event_id, int(doc["score"])))
    return out


def tally(run: dict, lake: Path) -> tuple[Tally, int]:
    users = session_ids(run)
    t = Tally()
    missing = 0
    found = verdicts(lake, list(users))
    for sid, satisfied in users.items():
        if sid not in found:
            missing += 1
        for _eid, score in found.get(sid, []):
            if score == 0:
                t.abstain += 1
            elif (score > 0) == satisfied:
                t.agree += 1
            else:
                t.disagree += 1
    return t, missing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, required=True)
    ap.add_argument("--lake", type=Path, default=None, help="default: <state_dir>/lake")
    args = ap.parse_args()
    settings = Settings()
    lake = args.lake or Path(settings.trainer.under_state_dir(Path(settings.state_dir)).lake_root)
    runs = json.loads(args.runs.read_text())
    pooled = Tally()
    print(f"{'run':<44}{'agree':>7}{'disagree':>10}{'abstain':>9}{'consistency':>13}{'missing':>9}")
    for run in runs:
        t, missing = tally(run, lake)
        pooled.agree += t.agree
        pooled.disagree += t.disagree
        pooled.abstain += t.abstain
        print(
            f"{run['policy']:<44}{t.agree:>7}{t.disagree:>10}{t.abstain:>9}"
            f"{t.consistency:>13.3f}{missing:>9}"
        )
    share = "-" if pooled.agreement is None else f"{pooled.agreement:.0%}"
    print(
        f"{'all':<44}{pooled.agree:>7}{pooled.disagree:>10}{pooled.abstain:>9}"
        f"{pooled.consistency:>13.3f}   (agreement when decided {share})"
    )
    print("missing: sessions with no archived turn-0 verdict (not archived yet, or not judged)")


if __name__ == "__main__":
    main()
