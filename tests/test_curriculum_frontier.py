"""Frontier sampling's arithmetic, by hand."""

from __future__ import annotations

import pytest

from pipeline.curriculum import (
    TaskSuccess,
    frontier_allocation,
    frontier_weight,
    split_budget,
    success_by_task,
)


def test_rate_has_a_uniform_prior():
    assert TaskSuccess().rate == 0.5  # never tried: on the frontier
    assert TaskSuccess(3, 3).rate == pytest.approx(4 / 5)
    s = success_by_task([("a", True), ("a", False), ("b", False)])
    assert (s["a"].successes, s["a"].trials, s["b"].rate) == (1, 2, pytest.approx(1 / 3))


def test_weight_peaks_at_half_and_keeps_a_floor():
    assert frontier_weight(0.5) == 1.0
    assert frontier_weight(0.0) == frontier_weight(1.0) == pytest.approx(0.05)
    assert frontier_weight(0.25) == pytest.approx(0.05 + 0.95 * 0.75)  # 4 * 0.25 * 0.75
    assert frontier_weight(0.2, floor=0.0) == pytest.approx(0.64)
    with pytest.raises(ValueError):
        frontier_weight(1.5)


def test_split_budget_by_largest_remainder_ties_by_name():
    # quotas 2.5, 2.5, 5: whole 2, 2, 5; the one left to the first of the tied remainders
    assert split_budget({"a": 1, "b": 1, "c": 2}, 10) == {"a": 3, "b": 2, "c": 5}
    assert split_budget({"a": 1, "b": 3}, 0) == {"a": 0, "b": 0}


def test_a_capped_task_gives_its_share_to_the_others_by_weight():
    # a can take 1: the other 9 go to b and c as 1 : 2
    assert split_budget({"a": 1, "b": 1, "c": 2}, 10, {"a": 1, "b": 10, "c": 10}) == {
        "a": 1, "b": 3, "c": 6,
    }  # fmt: skip
    # more budget than rows: every row once
    assert split_budget({"a": 1, "b": 1}, 10, {"a": 2, "b": 3}) == {"a": 2, "b": 3}


def test_frontier_allocation_favours_the_half_solved_task():
    success = {"solved": TaskSuccess(9, 9), "half": TaskSuccess(5, 10), "new": TaskSuccess()}
    # rates 10/11, 1/2, 1/2; weights 0.05 + 0.95 * 4 * 10/11 * 1/11 = 0.3640, 1, 1;
    # quotas 12 * w / 2.3640: 5.08, 5.08, 1.85 -> 5, 5, 1 and the one left to the 0.85
    got = frontier_allocation(success, 12)
    assert got == {"half": 5, "new": 5, "solved": 2}
