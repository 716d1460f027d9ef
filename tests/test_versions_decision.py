"""The canary decision and the regression watch as pure functions (pipeline/versions/
posterior.py, canary.py, watch.py, sessions.py): posteriors checked against values by hand,
a closed form and a brute-force grid; the decision rules case by case and by hypothesis."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.settings import Settings
from pipeline.versions import canary as C
from pipeline.versions import posterior, watch
from pipeline.versions.canary import decide, worse
from pipeline.versions.config import CanarySettings
from pipeline.versions.sessions import SessionBook
from pipeline.versions.table import OutcomeRate


def cfg(**kw: object) -> CanarySettings:
    return CanarySettings(**kw)  # type: ignore[arg-type]


# ---- posterior arithmetic ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a1", "b1", "a2", "b2", "m", "expected"),
    [
        # X, Y ~ U(0,1): P(X < Y - m) = area of the triangle y - x > m = (1 - m)² / 2
        (1, 1, 1, 1, 0.0, 0.5),
        (1, 1, 1, 1, 0.1, 0.405),
        # X ~ Beta(2,1) (F = x²), Y ~ U: ∫_m^1 (y - m)² dy = (1 - m)³ / 3
        (2, 1, 1, 1, 0.0, 1 / 3),
        (2, 1, 1, 1, 0.2, 0.8**3 / 3),
        # X ~ U, Y ~ Beta(2,1) (f = 2y): ∫_m^1 2y (y - m) dy = 2/3 - m + m³/3
        (1, 1, 2, 1, 0.1, 2 / 3 - 0.1 + 0.001 / 3),
        # X ~ Beta(1,2) (F = 1 - (1-x)²), Y ~ U, m = 0: ∫_0^1 1 - (1-y)² dy = 1 - 1/3
        (1, 2, 1, 1, 0.0, 2 / 3),
    ],
)
def test_probability_worse_matches_integrals_by_hand(
    a1: int, b1: int, a2: int, b2: int, m: float, expected: float
) -> None:
    assert posterior.prob_worse(a1, b1, a2, b2, m) == pytest.approx(expected, abs=1e-9)


def test_beta_cdf_matches_the_binomial_sum() -> None:
    """For integer a, b: I_x(a, b) = P(Binomial(a + b - 1, x) >= a), a finite sum."""
    for a, b, x in [(3, 5, 0.2), (3, 5, 0.7), (40, 12, 0.75), (1, 1, 0.3), (120, 80, 0.61)]:
        n = a + b - 1
        exact = sum(math.comb(n, j) * x**j * (1 - x) ** (n - j) for j in range(a, n + 1))
        assert posterior.cdf(x, a, b) == pytest.approx(exact, abs=1e-12)


def closed_form_worse(a1: int, b1: int, a2: int, b2: int) -> float:
    """P(X < Y) for X ~ Beta(a1,b1), Y ~ Beta(a2,b2), integer a2 (margin 0): the finite
    sum Σ_{i<a2} B(a1+i, b1+b2) / ((b2+i) B(1+i, b2) B(a1, b1)) (Evan Miller's formula for
    P(p_B > p_A)), an independent method."""
    lb = posterior.log_beta
    return sum(
        math.exp(lb(a1 + i, b1 + b2) - math.log(b2 + i) - lb(1 + i, b2) - lb(a1, b1))
        for i in range(a2)
    )


def grid_worse(a1: float, b1: float, a2: float, b2: float, m: float, n: int = 3000) -> float:
    """P(X < Y - m) by brute force: both densities on an n x n midpoint grid, the cells
    with x < y - m summed (cells the line crosses count half)."""
    x = (np.arange(n) + 0.5) / n

    def density(a: float, b: float) -> np.ndarray:
        d = np.exp((a - 1) * np.log(x) + (b - 1) * np.log1p(-x) - posterior.log_beta(a, b))
        return d / d.sum()

    gap = x[None, :] - m - x[:, None]  # rows x, columns y
    weight = np.where(gap > 0.5 / n, 1.0, np.where(gap > -0.5 / n, 0.5, 0.0))
    return float(density(a1, b1) @ weight @ density(a2, b2))


@pytest.mark.parametrize(
    ("a1", "b1", "a2", "b2"),
    [
        (3, 8, 5, 6),
        (20, 10, 25, 6),
        (2, 1, 40, 60),
        (101, 101, 11, 11),
        (11, 11, 101, 101),
        (1, 30, 2, 29),
    ],
)
def test_probability_worse_at_margin_zero_matches_the_closed_form(
    a1: int, b1: int, a2: int, b2: int
) -> None:
    assert posterior.prob_worse(a1, b1, a2, b2) == pytest.approx(
        closed_form_worse(a1, b1, a2, b2), abs=1e-7
    )


@pytest.mark.parametrize(
    ("a1", "b1", "a2", "b2", "m"),
    [
        (3, 8, 5, 6, 0.05),
        (20, 10, 25, 6, 0.1),
        (2, 1, 40, 60, 0.0),
        (101, 101, 11, 11, 0.02),
        (11, 11, 101, 101, 0.02),
        (15, 45, 60, 40, 0.05),
    ],
)
def test_probability_worse_with_a_margin_matches_a_brute_force_grid(
    a1: int, b1: int, a2: int, b2: int, m: float
) -> None:
    assert posterior.prob_worse(a1, b1, a2, b2, m) == pytest.approx(
        grid_worse(a1, b1, a2, b2, m), abs=1e-4
    )


def test_probability_worse_with_many_sessions_on_one_side() -> None:
    """9,500 stable sessions at 95 % against 100 canary ones at 60 %: the stable posterior
    is a spike at 0.95 and the canary's sits ~7 sds below it minus the margin."""
    p = posterior.prob_worse(61, 41, 9_501, 501, 0.05)
    assert p == pytest.approx(grid_worse(61, 41, 9_501, 501, 0.05, n=6000), abs=1e-4)
    assert p > 0.999999
    with pytest.raises(ValueError, match="margin"):
        posterior.prob_worse(1, 1, 1, 1, 1.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 60), st.integers(0, 60), st.integers(0, 60), st.integers(0, 60))
def test_the_two_directions_add_up_to_one_at_margin_zero(
    s1: int, f1: int, s2: int, f2: int
) -> None:
    """P(X < Y) + P(Y < X) = 1 (ties have probability 0)."""
    total = posterior.prob_worse(1 + s1, 1 + f1, 1 + s2, 1 + f2) + posterior.prob_worse(
        1 + s2, 1 + f2, 1 + s1, 1 + f1
    )
    assert total == pytest.approx(1.0, abs=1e-6)


# ---- the canary decision ----------------------------------------------------------------------


def rate(passed: int, total: int) -> OutcomeRate:
    return OutcomeRate(passed, total)


def test_below_min_sessions_the_decision_waits_with_the_priors_figures() -> None:
    """No session yet: both posteriors are U(0,1), so p_worse = (1 - 0.1)² / 2 = 0.405."""
    v = decide(rate(0, 0), rate(0, 0), cfg(margin=0.1))
    assert (v.kind, v.figures["rule"], v.figures["p_worse"]) == ("wait", "min_sessions", 0.405)
    v = decide(rate(0, 19), rate(100, 100), cfg(min_sessions=20))  # hopeless, but 19 < 20
    assert v.kind == "wait" and "19 < 20 sessions" in v.reason


def test_a_clearly_worse_canary_is_withdrawn_and_a_good_one_rolled_out() -> None:
    bad = decide(rate(5, 40), rate(80, 100), cfg())
    assert (bad.kind, bad.figures["rule"]) == ("withdraw", "withdraw_probability")
    assert bad.figures["p_worse"] > 0.9999  # means 6/42 = 0.14 vs 81/102 = 0.79
    assert (
        bad.figures["canary_sessions"],
        bad.figures["canary_passed"],
        bad.figures["stable_sessions"],
        bad.figures["stable_passed"],
    ) == (40, 5, 100, 80)
    assert bad.figures["canary_rate"] == 0.125 and bad.figures["stable_mean"] == round(81 / 102, 6)
    good = decide(rate(38, 40), rate(50, 100), cfg())
    assert (good.kind, good.figures["rule"]) == ("rollout", "rollout_probability")
    assert good.figures["p_not_worse"] > 0.9999


def test_at_the_cap_the_posterior_means_decide() -> None:
    c = cfg(min_sessions=20, max_sessions=40, margin=0.05)
    # means 21/42 = 0.500 vs 22/42 = 0.524: 0.500 >= 0.524 - 0.05 -> rollout
    tie = decide(rate(20, 40), rate(21, 40), c)
    assert (tie.kind, tie.figures["rule"]) == ("rollout", "max_sessions")
    # means 17/42 = 0.405 vs 23/42 = 0.548: 0.405 < 0.498 -> withdraw; p_worse only ~0.8
    low = decide(rate(16, 40), rate(22, 40), c)
    assert (low.kind, low.figures["rule"]) == ("withdraw", "max_sessions")
    assert 0.5 < float(low.figures["p_worse"]) < 0.95  # type: ignore[arg-type]
    # one session short of the cap: the same counts wait
    assert decide(rate(16, 39), rate(22, 40), c).kind == "wait"


ORDER = {"withdraw": 0, "wait": 1, "rollout": 2}
rules = st.builds(
    CanarySettings,
    min_sessions=st.integers(1, 30),
    max_sessions=st.integers(30, 200),
    margin=st.sampled_from([0.0, 0.02, 0.05, 0.1]),
    withdraw_probability=st.sampled_from([0.8, 0.9, 0.95, 0.99]),
    rollout_probability=st.sampled_from([0.8, 0.9, 0.95, 0.99]),
)


@settings(max_examples=120, deadline=None)
@given(rules, st.integers(1, 200), st.data())
def test_one_more_failed_canary_session_never_makes_rollout_more_likely(
    c: CanarySettings, total: int, data: st.DataObject
) -> None:
    """The same counts with one passed session turned failed: the decision never moves
    towards rollout (withdraw < wait < rollout)."""
    passed = data.draw(st.integers(1, total))
    n_s = data.draw(st.integers(0, 300))
    stable = rate(data.draw(st.integers(0, n_s)), n_s)
    better, worse_one = (
        decide(rate(passed, total), stable, c),
        decide(rate(passed - 1, total), stable, c),
    )
    assert ORDER[worse_one.kind] <= ORDER[better.kind], (better.reason, worse_one.reason)


@settings(max_examples=120, deadline=None)
@given(rules, st.integers(0, 250), st.data())
def test_symmetric_arms_never_withdraw_and_wait_below_min_sessions(
    c: CanarySettings, total: int, data: st.DataObject
) -> None:
    arm = rate(data.draw(st.integers(0, total)), total)
    v = decide(arm, arm, c)
    assert v.kind != "withdraw", v.reason  # p_worse <= 0.5 < threshold; equal means at the cap
    if total < c.min_sessions:
        assert v.kind == "wait" and v.figures["rule"] == "min_sessions"


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 80), st.integers(0, 80), st.integers(0, 80), st.integers(0, 80))
def test_a_wider_margin_never_makes_the_canary_more_likely_worse(
    s1: int, f1: int, s2: int, f2: int
) -> None:
    ps = [worse(rate(s1, s1 + f1), rate(s2, s2 + f2), m) for m in (0.0, 0.05, 0.2)]
    assert ps[0] + 1e-9 >= ps[1] and ps[1] + 1e-9 >= ps[2]


# ---- the regression watch ---------------------------------------------------------------------


def test_the_watch_finds_a_drop_only_with_enough_sessions_and_probability() -> None:
    c = cfg(watch_min_sessions=30, watch_probability=0.99, margin=0.05)
    drop = watch.check(rate(10, 50), rate(40, 50), c)  # 20 % against 80 %
    assert (drop.kind, drop.figures["rule"]) == ("withdraw", "watch_probability")
    assert drop.figures["p_drop"] > 0.9999 and drop.figures["serving_sessions"] == 50
    few = watch.check(rate(0, 29), rate(40, 50), c)
    assert (few.kind, few.figures["rule"]) == ("wait", "min_sessions")
    # 70 % against 80 % over 50 each: a drop, but not a certain one (~0.7)
    unsure = watch.check(rate(35, 50), rate(40, 50), c)
    assert unsure.kind == "wait" and 0.5 < float(unsure.figures["p_drop"]) < 0.99  # type: ignore[arg-type]


# ---- the session book -------------------------------------------------------------------------


def test_the_book_counts_a_session_once_with_its_last_outcome_and_first_time() -> None:
    book = SessionBook("p")
    assert book.add("p", 2, "s1", 1.0, ts_ms=100)
    assert book.add("p", 2, "s1", -1.0, ts_ms=300)  # a later test run restates it
    assert not book.add("p", 2, "s1", -1.0, ts_ms=400)  # nothing new
    assert not book.add("q", 2, "s9", 1.0, ts_ms=100)  # another policy's
    assert not book.add("p", 2, "s8", None, ts_ms=100)
    assert not book.add("p", 2, "s7", float("nan"), ts_ms=100)
    book.add("p", 2, "s2", 0.5, ts_ms=200)
    book.add("p", 2, "s3", 1.0, ts_ms=250)
    book.add("p", 1, "s4", 1.0, ts_ms=50)
    assert book.rate(2) == OutcomeRate(2, 3)  # s1 failed (last outcome), s2 and s3 passed
    assert book.rate(2, since_ms=150) == OutcomeRate(2, 2)  # s1 began at 100
    assert book.window(2, 2) == OutcomeRate(2, 2)  # the newest two: s3 (250), s2 (200)
    assert book.window(2, 1) == OutcomeRate(1, 1)
    assert book.by_version[2]["s1"][0] == 100 and 5 not in book.by_version  # when s1 began
    assert book.rate(5) == OutcomeRate(0, 0) and book.count() == 4


# ---- settings ---------------------------------------------------------------------------------


def test_canary_settings_come_from_the_environment_and_are_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LIVERL_CANARY_MARGIN", "0.1")
    monkeypatch.setenv("LIVERL_CANARY_WATCH_ACTION", "alert")
    s = Settings()
    assert (s.canary.margin, s.canary.watch_action, s.canary.min_sessions) == (0.1, "alert", 20)
    with pytest.raises(ValueError, match="max_sessions"):
        cfg(min_sessions=50, max_sessions=10)
    with pytest.raises(ValueError):
        cfg(withdraw_probability=0.4)  # at or below 0.5 both thresholds could hold
    assert all(f.description for f in CanarySettings.model_fields.values())


def test_the_benchmark_withdraws_a_harmful_candidate_and_rolls_out_a_better_one() -> None:
    """bench/canary.py's runs, short: the decision each scenario should reach, and at least
    min_sessions canary sessions before it."""
    from .bench_module import load

    bench = load("canary")
    c = cfg()
    bad = bench.canary_run(0.6, 0.1, c, 0.1, seed=0, max_traffic=5_000)
    assert bad.decision == "withdraw" and c.min_sessions <= bad.canary_sessions < bad.sessions
    good = bench.canary_run(0.3, 0.9, c, 0.1, seed=0, max_traffic=5_000)
    assert good.decision == "rollout" and good.canary_sessions >= c.min_sessions
    found = bench.watch_run(0.6, 0.6, 0.1, c, seed=0, drop_at=200, horizon=300, every=5)
    assert found is not None and 0 <= found <= c.watch_window


def test_a_canary_no_replica_serves_is_withdrawn_once_the_stable_arm_shows_it() -> None:
    """Rule 0: a canary whose share of the traffic would have brought it max_sessions by now
    but has fewer than min_sessions is served by no replica; waiting would stall every version
    queued behind it. min 20, max 100, share 0.1: ceil(100 * 0.9 / 0.1) = 900 stable sessions."""
    cfg = CanarySettings(min_sessions=20, max_sessions=100)
    assert C.starved_after(0.1, cfg) == 900 and C.starved_after(0.25, cfg) == 300
    assert C.starved_after(1.0, cfg) is None  # the stable arm gets no traffic either
    none, stable = OutcomeRate(0, 0), OutcomeRate(540, 900)
    v = C.decide(none, stable, cfg, share=0.1)
    assert (v.kind, v.figures["rule"]) == ("withdraw", "no_canary_traffic")
    assert C.decide(none, OutcomeRate(539, 899), cfg, share=0.1).kind == "wait"
    assert C.decide(none, stable, cfg).kind == "wait"  # no share given: the old rules
    assert (
        C.decide(OutcomeRate(12, 20), stable, cfg, share=0.1).figures["rule"] != "no_canary_traffic"
    )  # 20 canary sessions: it is served, the usual rules decide
