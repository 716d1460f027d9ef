"""The "panel" judge: several judges vote on each next state, each weighted by how well its
verdicts have agreed with verifiable outcomes (RLAnything's reward-model consistency).

A member's weight is, first, with ``live = true``, 0 while the ``judge_consistency`` topic
says it stands flagged (``excluded``: its recent consistency fell below the watcher's
threshold; it is back once it recovers), else the log-odds of its consistency now on that topic
(``liverl judges watch`` keeps it from the members' own votes, which every panel verdict carries
in ``prm_score.members``, an excluded member's included, so it can recover); else the log-odds
of its consistency in a ``liverl judges compare NAME --format json`` file; both matched by judge
id *and* version, so a changed judge starts again without evidence; else ``weights[name]`` (a
weight, taken as it is); else the log-odds of 0.5, the consistency prior, which is 0, when live
(a live panel abstains until a member has agreed more often than not), 1.0 otherwise. The
log-odds weight is ``max(0, log(p / (1 - p)))`` (:func:`consistency.log_odds_weight`): a
coin-flip member weighs nothing, so two at 0.5 no longer outvote one at 0.9. The verdict is the
members' :func:`weighted_plurality`; the hints are those of the members that voted with it.
The panel's version names its members' versions and weights, so changing either re-derives
every verdict id (a live panel's verdict names the version it was made under:
``Verdict.version``).
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Protocol

from pipeline.events import NextState

from .consistency import log_odds_weight, weighted_plurality
from .consistency_file import read_compare_file
from .judge_registry import PanelOptions
from .judges import Judge, TurnContext, Verdict, make_judge

NO_EVIDENCE = 0.5  # a live member without a tally yet: the consistency prior


def load_consistency(path: Path) -> dict[tuple[str, str], float]:
    """(judge_id, judge_version) -> consistency from a ``judges compare --format json`` file."""
    return {(r.judge_id, r.judge_version): r.consistency for r in read_compare_file(path)}


class ConsistencySource(Protocol):
    """Where live consistencies come from (``consistency_live.LiveConsistency``)."""

    def consistency(self, judge_id: str, judge_version: str) -> float | None: ...

    def excluded(self, judge_id: str, judge_version: str) -> bool: ...


class PanelJudge:
    judge_id = "panel"

    def __init__(self, options: PanelOptions) -> None:
        self.members: list[tuple[str, Judge]] = [
            (n, make_judge(n, options.member_options.get(n))) for n in options.judges
        ]
        self.live = options.live
        self.source: ConsistencySource | None = None
        self._file = load_consistency(options.consistency_file) if options.consistency_file else {}
        self._fixed = dict(options.weights)
        self.inline = all(bool(getattr(j, "inline", True)) for _, j in self.members)
        self.weights, self.version = self.weigh()

    def use_live(self, source: ConsistencySource) -> None:
        """Weight members by ``source`` from the next verdict on (the worker attaches the
        topic reader when ``live`` is set)."""
        self.source = source
        self.weights, self.version = self.weigh()

    def weigh(self) -> tuple[list[float], str]:
        """The members' weights now and the panel version naming them. A live weight is
        rounded to 0.01, so the version (and the verdict ids derived from it) changes when a
        weight has moved by that much, not at every match."""
        weights = []
        for n, j in self.members:
            if self.source is not None and self.source.excluded(j.judge_id, j.version):
                weights.append(0.0)  # flagged: out until its recent consistency recovers
                continue
            live = self.source.consistency(j.judge_id, j.version) if self.source else None
            if live is not None:
                weights.append(round(log_odds_weight(live), 2))
                continue
            known = self._file.get((j.judge_id, j.version))
            weights.append(
                log_odds_weight(known)
                if known is not None
                else self._fixed.get(n, log_odds_weight(NO_EVIDENCE) if self.live else 1.0)
            )
        spec = ";".join(
            f"{j.version}={w:.6f}" for (_, j), w in zip(self.members, weights, strict=True)
        )
        return weights, f"panel-1/{hashlib.sha256(spec.encode()).hexdigest()[:12]}"

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        weights, version = self.weigh() if self.source is not None else (self.weights, self.version)
        verdicts = await asyncio.gather(*(j.judge(ctx, state) for _, j in self.members))
        # A failed member has no vote (None): its 0 would count against the others' verdict
        # in the plurality and in the turn's mean vote. The panel fails only if all do.
        votes = [None if v.error else v.score for v in verdicts]
        score = weighted_plurality(list(zip(votes, weights, strict=True)))
        hints: list[str] = []
        for v, vote in zip(verdicts, votes, strict=True):
            if score != 0 and vote == score:
                hints += [h for h in v.hints if h not in hints]
        why = "; ".join(
            f"{n} ({w:.2f}) " + (f"failed: {v.error}" if v.error else
                                 f"{v.score:+d}: {v.rationale}")
            for (n, _), v, w in zip(self.members, verdicts, weights, strict=True)
        )  # fmt: skip
        errors = [
            f"{n}: {v.error}" for (n, _), v in zip(self.members, verdicts, strict=True) if v.error
        ]
        members = [
            {"judge_id": j.judge_id, "judge_version": j.version, "vote": v.score, "weight": w}
            for (_, j), v, w in zip(self.members, verdicts, weights, strict=True)
            if not v.error
        ]  # a failed member's 0 is no verdict to tally
        failed = len(errors) == len(verdicts)
        return Verdict(score, votes, why[:2000], hints,
                       "; ".join(errors)[:500] if failed else None, members=members,
                       version=version)  # fmt: skip
