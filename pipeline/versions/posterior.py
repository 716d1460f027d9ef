"""Beta posteriors of two success rates and the probability that one is worse than the other
by more than a margin: the arithmetic of the canary decision and the regression watch
(``canary.py``, ``watch.py``). Standard library only (scipy is not a dependency).

With a uniform prior, an arm with ``s`` passed and ``f`` failed sessions has the posterior
``Beta(1 + s, 1 + f)``. For ``X ~ Beta(a1, b1)`` (the arm under test) and ``Y ~ Beta(a2, b2)``
(the reference arm), independent::

    P(X < Y - m) = ∫_m^1 f_Y(y) · F_X(y - m) dy = ∫_0^(1-m) f_X(x) · (1 - F_Y(x + m)) dx

``F`` is the regularized incomplete beta function (a continued fraction, accurate to ~1e-12)
and the outer integral is composite Simpson over the outer density's bulk (mean ± 20 standard
deviations, cut to the domain) with 512 intervals. The outer variable is the arm with the
narrower posterior, so the density integrated is resolved however many sessions either arm
has, and the CDF under it is the smoother of the two. Error: below 1e-6 against a brute-force
grid over the tests' cases (tests/test_versions_decision.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

SIMPSON_INTERVALS = 512  # even
BULK_SD = 20.0  # the outer density's mass beyond this many sds is < 1e-9 for a, b >= 1
_CF_EPS = 1e-15
_CF_TINY = 1e-300
_CF_MAX_ITER = 10_000


def log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def pdf(x: float, a: float, b: float) -> float:
    """Beta(a, b) density at x (a, b >= 1, so it is finite on [0, 1])."""
    if x < 0.0 or x > 1.0:
        return 0.0
    if x in (0.0, 1.0):
        edge_a = a if x == 0.0 else b  # the exponent that vanishes or not at this edge
        if edge_a > 1.0:
            return 0.0
        return math.exp(-log_beta(a, b))
    return math.exp((a - 1) * math.log(x) + (b - 1) * math.log1p(-x) - log_beta(a, b))


def _continued_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz), which
    converges fast for x < (a + 1) / (a + b + 2)."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > _CF_TINY else _CF_TINY)
    h = d
    for m in range(1, _CF_MAX_ITER):
        m2 = 2 * m
        for num in (
            m * (b - m) * x / ((a + m2 - 1) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > _CF_TINY else _CF_TINY)
            c = 1.0 + num / c
            c = c if abs(c) > _CF_TINY else _CF_TINY
            h *= d * c
        if abs(d * c - 1.0) < _CF_EPS:
            return h
    raise ArithmeticError(f"incomplete beta did not converge at x={x}, a={a}, b={b}")


def cdf(x: float, a: float, b: float) -> float:
    """P(X <= x) for X ~ Beta(a, b): the regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(a * math.log(x) + b * math.log1p(-x) - log_beta(a, b))
    if x < (a + 1) / (a + b + 2):
        return front * _continued_fraction(x, a, b) / a
    return 1.0 - front * _continued_fraction(1.0 - x, b, a) / b


def mean(a: float, b: float) -> float:
    return a / (a + b)


def sd(a: float, b: float) -> float:
    n = a + b
    return math.sqrt(a * b / (n * n * (n + 1)))


def _simpson(
    f: Callable[[float], float], lo: float, hi: float, n: int = SIMPSON_INTERVALS
) -> float:
    if hi <= lo:
        return 0.0
    h = (hi - lo) / n
    total = f(lo) + f(hi)
    total += 4 * sum(f(lo + i * h) for i in range(1, n, 2))
    total += 2 * sum(f(lo + i * h) for i in range(2, n, 2))
    return float(total * h / 3)


def prob_worse(a1: float, b1: float, a2: float, b2: float, margin: float = 0.0) -> float:
    """P(X < Y - margin) for independent X ~ Beta(a1, b1), Y ~ Beta(a2, b2) (formula and
    error in the module docstring); clamped to [0, 1]."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    if sd(a1, b1) <= sd(a2, b2):  # X is the narrower: integrate over x
        centre, spread = mean(a1, b1), sd(a1, b1)
        lo, hi = max(0.0, centre - BULK_SD * spread), min(1.0 - margin, centre + BULK_SD * spread)
        p = _simpson(lambda x: pdf(x, a1, b1) * (1.0 - cdf(x + margin, a2, b2)), lo, hi)
    else:
        centre, spread = mean(a2, b2), sd(a2, b2)
        lo, hi = max(margin, centre - BULK_SD * spread), min(1.0, centre + BULK_SD * spread)
        p = _simpson(lambda y: pdf(y, a2, b2) * cdf(y - margin, a1, b1), lo, hi)
    return min(1.0, max(0.0, p))
