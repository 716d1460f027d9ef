"""Reply judge benchmark: how the default ``replies`` judge reads replies it was not written for.

Reads ``tests/data/replies_independent.jsonl`` (227 replies written before the patterns were
read; ``tune`` is the half the patterns may be tuned on, ``report`` the half that is quoted) and
prints, per half: vote precision and recall per class, the confusion matrix (gold label x judged
vote), hint recall (a directive's first hint falls in the gold category, by the keyword rule
``HINT_CATEGORY`` in pipeline/processors/judge_eval.py) and spurious hints. Then the same
figures on the first labelled set (tests/data/replies.jsonl, dev / heldout). Asserts nothing:
the floors live in the tests.

    .venv/bin/python bench/judge.py
    .venv/bin/python bench/judge.py --rules /tmp/old-replies.yaml   # another pattern file
    .venv/bin/python bench/judge.py --misses            # list the tune half's misses
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from pipeline.processors.judge_eval import CATEGORIES, evaluate, evaluate_categories, load_rows
from pipeline.processors.judges import DEFAULT_REPLY_RULES, ReplyJudge

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def load(split: str | None = None) -> list[dict[str, Any]]:
    return load_rows(DATA / "replies.jsonl", split)


def load_independent(split: str | None = None) -> list[dict[str, Any]]:
    return load_rows(DATA / "replies_independent.jsonl", split)


VOTES = (-1, 0, 1)


def _pct(num: int, den: int) -> str:
    return f"{num / den:.2f} ({num}/{den})" if den else "n/a"


def report(name: str, res: dict[str, Any], misses: bool) -> None:
    conf = res["confusion"]
    print(
        f"\n== {name}: {res['n']} replies, gold "
        + ", ".join(f"{v:+d}: {sum(conf[v].values())}" for v in VOTES)
    )
    for v in VOTES:
        said = res["said"][v]
        right = conf[v][v]
        gold = sum(conf[v].values())
        print(f"  vote {v:+d}: precision {_pct(right, said)}, recall {_pct(right, gold)}")
    print(f"  accuracy {res['accuracy']:.2f}")
    print("  confusion (rows gold, columns judged):   -1    0   +1")
    for g in VOTES:
        print(f"    gold {g:+d}{'':27}" + "".join(f"{conf[g][p]:5d}" for p in VOTES))
    got = sum(n for n, _ in res["hint_by_category"].values())
    print(f"  hint recall {_pct(got, res['hint_n'])}; spurious hints {res['spurious_hints']}")
    print(
        "    "
        + ", ".join(
            f"{c} {n}/{d}" for c in CATEGORIES for n, d in [res["hint_by_category"][c]] if d
        )
    )
    if misses:
        for m in res["misses"]:
            print("    miss:", m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rules", default=str(DEFAULT_REPLY_RULES), help="pattern file")
    ap.add_argument("--misses", action="store_true", help="list the tune half's misses")
    ap.add_argument(
        "--misses-report", action="store_true", help="also the report half's (not to tune on)"
    )
    args = ap.parse_args()
    judge = ReplyJudge(args.rules)
    print(f"judge {judge.version} ({args.rules})")
    for split in ("tune", "report"):
        show = args.misses if split == "tune" else args.misses_report
        report(
            f"independent set, {split}", evaluate_categories(judge, load_independent(split)), show
        )
    for split in ("dev", "heldout"):
        res = evaluate(judge, load(split))
        p = res["precision"]
        print(
            f"\n== first set, {split}: {res['n']} replies; precision -1 {p[-1]:.2f}, "
            f"0 {p[0]:.2f}, +1 {p[1]:.2f}; accuracy {res['accuracy']:.2f}; hints with key "
            f"{res['hint_key']:.2f}, exact {res['hint_exact']:.2f}, spurious "
            f"{res['spurious_hints']}"
        )
        if args.misses:
            for m in res["misses"]:
                print("    miss:", m)
    rows = [r["text"] for r in load_independent()] * 20
    t0 = time.perf_counter()
    for text in rows:
        judge.read(text)
    print(f"\n{(time.perf_counter() - t0) / len(rows) * 1e3:.3f} ms per reply")


if __name__ == "__main__":
    main()
