"""The "panel" judge: several judges vote on each next state, each weighted by how well its
verdicts have agreed with verifiable outcomes (RLAnything's reward-model consistency).

A member's weight is its consistency from a ``liverl judges compare NAME --format json``
file, matched by judge id *and* version (a changed judge starts again at no evidence, 0.5),
else ``weights[name]``, else 1.0. The verdict is the members' :func:`weighted_plurality`;
the hints are those of the members that voted with it. The panel's version names its
members' versions and weights, so changing either re-derives every verdict id on a replay.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from pipeline.events import NextState

from .consistency import weighted_plurality
from .consistency_file import read_compare_file
from .judge_registry import PanelOptions
from .judges import Judge, TurnContext, Verdict, make_judge


def load_consistency(path: Path) -> dict[tuple[str, str], float]:
    """(judge_id, judge_version) -> consistency from a ``judges compare --format json`` file."""
    return {(r.judge_id, r.judge_version): r.consistency for r in read_compare_file(path)}


class PanelJudge:
    judge_id = "panel"

    def __init__(self, options: PanelOptions) -> None:
        self.members: list[tuple[str, Judge]] = [
            (n, make_judge(n, options.member_options.get(n))) for n in options.judges
        ]
        known = load_consistency(options.consistency_file) if options.consistency_file else {}
        self.weights = [
            known.get((j.judge_id, j.version), options.weights.get(n, 1.0))
            for n, j in self.members
        ]
        self.inline = all(bool(getattr(j, "inline", True)) for _, j in self.members)
        spec = ";".join(f"{j.version}={w:.6f}" for (_, j), w in zip(self.members, self.weights,
                                                                   strict=True))
        self.version = f"panel-1/{hashlib.sha256(spec.encode()).hexdigest()[:12]}"

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        verdicts = await asyncio.gather(*(j.judge(ctx, state) for _, j in self.members))
        score = weighted_plurality([(v.score, w) for v, w in zip(verdicts, self.weights,
                                                                  strict=True)])
        hints: list[str] = []
        for v in verdicts:
            if score != 0 and v.score == score:
                hints += [h for h in v.hints if h not in hints]
        why = "; ".join(f"{n} ({w:.2f}) {v.score:+d}: {v.rationale}" for (n, _), v, w
                        in zip(self.members, verdicts, self.weights, strict=True))
        errors = [f"{n}: {v.error}" for (n, _), v in zip(self.members, verdicts, strict=True)
                  if v.error]
        return Verdict(score, [v.score for v in verdicts], why[:2000], hints,
                       "; ".join(errors)[:500] or None)
