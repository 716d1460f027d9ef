"""Frontier sampling (ScaleCUA): spend a sample budget on the tasks the policy solves about
half the time, where a gradient step has the most to learn, instead of uniformly.

A task's success rate is estimated with a uniform prior, ``p = (s + 1) / (n + 2)``, so a
task seen once is not taken for solved or hopeless. Its weight is

    w(p) = floor + (1 - floor) * 4 p (1 - p)

1 at p = 1/2, ``floor`` at p = 0 or 1: the variance of a Bernoulli outcome, which is what an
advantage-weighted update feeds on (an always-failed or always-solved task gives a batch-mean
baseline a zero advantage). ``floor`` keeps every task in play, so a task that left the
frontier is seen again and its estimate can move. The budget is split by weight with the
largest-remainder rule, capped by what each task has (no row is drawn twice: the trainer
trains an event id once), the excess going to the tasks still below their share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

FLOOR = 0.05


@dataclass
class TaskSuccess:
    """Successes and trials of one task."""

    successes: int = 0
    trials: int = 0

    def add(self, success: bool) -> None:
        self.trials += 1
        self.successes += int(success)

    @property
    def rate(self) -> float:
        """The posterior mean under a uniform prior: 1/2 for a task never tried."""
        return (self.successes + 1) / (self.trials + 2)


def success_by_task(outcomes: Iterable[tuple[str, bool]]) -> dict[str, TaskSuccess]:
    out: dict[str, TaskSuccess] = {}
    for task, success in outcomes:
        out.setdefault(task, TaskSuccess()).add(success)
    return out


def frontier_weight(rate: float, floor: float = FLOOR) -> float:
    """``floor + (1 - floor) * 4 p (1 - p)``."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"a success rate is in [0, 1], not {rate}")
    return floor + (1.0 - floor) * 4.0 * rate * (1.0 - rate)


def split_budget(
    weights: Mapping[str, float], budget: int, caps: Mapping[str, int] | None = None
) -> dict[str, int]:
    """``budget`` split in proportion to ``weights`` (largest remainder, ties by task name),
    no task above its cap; what a capped task cannot take goes to the others by weight."""
    if budget < 0:
        raise ValueError("budget must be >= 0")
    caps = dict(caps) if caps is not None else {t: budget for t in weights}
    out = {t: 0 for t in weights}
    left = min(budget, sum(caps.get(t, 0) for t in weights))
    open_ = [t for t in sorted(weights) if caps.get(t, 0) > 0 and weights[t] > 0]
    while left > 0 and open_:
        total = sum(weights[t] for t in open_)
        quotas = {t: left * weights[t] / total for t in open_}
        whole = {t: min(int(quotas[t]), caps[t] - out[t]) for t in open_}
        given = sum(whole.values())
        if given < left:  # the remainders, largest first, one each
            order = sorted(open_, key=lambda t: (-(quotas[t] - int(quotas[t])), t))
            for t in order:
                if given == left:
                    break
                if whole[t] < caps[t] - out[t]:
                    whole[t] += 1
                    given += 1
        for t in open_:
            out[t] += whole[t]
        left -= given
        open_ = [t for t in open_ if out[t] < caps[t]]
        if given == 0:
            break
    return out


def frontier_allocation(
    success: Mapping[str, TaskSuccess],
    budget: int,
    available: Mapping[str, int] | None = None,
    floor: float = FLOOR,
) -> dict[str, int]:
    """Samples per task for a ``budget``: by :func:`frontier_weight` of each task's rate,
    capped by ``available`` (rows the task has)."""
    weights = {t: frontier_weight(s.rate, floor) for t, s in success.items()}
    return split_budget(weights, budget, available)
