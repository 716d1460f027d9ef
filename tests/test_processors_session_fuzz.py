"""Reward invariants over raw sessions driven through the real session stage (issue 38, item
3): ``bench/reward_fuzz.py`` generates chat turns, shell commands (the farming tricks among
them) with their exit codes, GUI screens, thumbs, hooks, gates and failing judges; here the
search runs with bounded examples, and each farming trick is a plain regression test whose
shaping was computed by hand from ``processors/rules/default.yaml`` (beta 0.5, phi in
[-0.8, 0.1]; repeated-failing-call: N 2, lambda 0.2, mu 0.05; no-destructive-commands: lambda
0.3, mu 0.02; tests-before-commit: lambda 0.2, mu 0.05 for each of its two progress facts;
repeated-noop-action: N 1, lambda 0.1, mu 0.02). The bench runs the search for longer
(``--budget-s``)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import bench_module

fuzz = bench_module.load("reward_fuzz")
Call, Extra, Gate, SessionSpec, TurnSpec = (
    fuzz.Call, fuzz.Extra, fuzz.Gate, fuzz.SessionSpec, fuzz.TurnSpec)  # fmt: skip


@pytest.fixture(scope="module")
def cores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return fuzz.load_cores(tmp_path_factory.mktemp("model") / "tiny")


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(fuzz.SESSIONS, st.randoms(use_true_random=False))
def test_generated_sessions_keep_the_reward_invariants(
    cores: dict[str, Any], specs: list[Any], rnd: random.Random
) -> None:
    fuzz.check(specs, cores, rnd)


# ---- the farming tricks, one by one ------------------------------------------------------------


def shaping(run: Any) -> list[float]:
    """F of each evaluation, in order (turn penalties and GUI actions' own)."""
    return [p.penalty for p in run.penalties]


def rewards(run: Any) -> dict[int, float]:
    return {r.turn: r.total for r in run.rewards}


def turns(*calls: Any, **kw: Any) -> tuple[Any, ...]:
    """One turn per call, and a last one without calls that brings the last result back (its
    own next state is the session's end: judged 0, a reward of 0)."""
    return (*(TurnSpec((c,), **kw) for c in calls), TurnSpec())


def test_echo_pytest_is_no_test_run() -> None:
    # echo pytest is read-only: it runs no requirement, so the commit after it has none:
    # F = [-0.2] (tests-before-commit violated), then 0 for the closing turn: total -0.2.
    # The line is not read-only (git commit), exit 0: the judge says +1, reward
    # 1 + 0.5 * -0.2 = 0.9.
    run = fuzz.drive_one(SessionSpec(turns(Call("echo pytest && git commit -m x", 0))))
    assert shaping(run) == pytest.approx([-0.2, 0.0])
    assert rewards(run) == pytest.approx({0: 0.9, 1: 0.0})
    # echo pytest alone, three times: read-only, F = 0 each, the judge sees no outcome: every
    # turn judged 0, reward 0, and only the last judged turn is kept, at 0.
    run = fuzz.drive_one(SessionSpec(turns(*[Call("echo pytest", 0)] * 3)))
    assert shaping(run) == [0.0] * 4
    assert rewards(run) == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}
    assert [(s.reward, s.rl_trainable()) for s in run.samples] == [
        (0.0, False), (0.0, False), (0.0, False), (0.0, True)]  # fmt: skip


def test_test_and_commit_counts_its_progress_once() -> None:
    # pytest passed (+0.05) and the commit after it verifiably succeeded (+0.05): F = 0.1 =
    # phi_max; the same line again changes no fact: F = 0. Rewards 1 + 0.5 * 0.1 = 1.05, 1.0.
    run = fuzz.drive_one(SessionSpec(turns(*[Call("pytest && git commit -m x", 0)] * 2)))
    assert shaping(run) == pytest.approx([0.1, 0.0, 0.0])
    assert rewards(run) == pytest.approx({0: 1.05, 1: 1.0, 2: 0.0})


def test_a_step_failing_then_passing_is_penalised_past_two_failures() -> None:
    # python step1.py fails three times: the third is past max_repeats 2, F = -0.2; then it
    # passes: the recovery repays mu, F = +0.05; total -0.15. The judge: -1, -1, -1, +1;
    # rewards -1, -1, -1 + 0.5 * -0.2 = -1.1, 1 + 0.5 * 0.05 = 1.025.
    run = fuzz.drive_one(SessionSpec(turns(*[Call("python step1.py", 1)] * 3,
                                           Call("python step1.py", 0))))  # fmt: skip
    assert shaping(run) == pytest.approx([0.0, 0.0, -0.2, 0.05, 0.0])
    assert rewards(run) == pytest.approx({0: -1.0, 1: -1.0, 2: -1.1, 3: 1.025, 4: 0.0})
    # Each stepN once failing, then passing in the same turn: each N its own intent, none
    # fails twice: F = 0 throughout (the combined exit code is the failure: -1 each).
    run = fuzz.drive_one(SessionSpec(tuple(
        TurnSpec((Call(f"python step{k}.py", 1), Call(f"python step{k}.py", 0)))
        for k in range(3)) + (TurnSpec(),)))  # fmt: skip
    assert shaping(run) == [0.0] * 4
    assert rewards(run) == pytest.approx({0: -1.0, 1: -1.0, 2: -1.0, 3: 0.0})


def test_pytest_k_case_n_failing_is_one_intent() -> None:
    # pytest -k case0..case3 all fail: one intent (pytest), failures 1, 2, 3, 4: turns 2 and
    # 3 are past max_repeats, F = -0.2 each; total -0.4. Rewards -1, -1, -1.1, -1.1.
    run = fuzz.drive_one(SessionSpec(turns(*(Call(f"pytest -k case{k}", 1) for k in range(4)))))
    assert shaping(run) == pytest.approx([0.0, 0.0, -0.2, -0.2, 0.0])
    assert rewards(run) == pytest.approx({0: -1.0, 1: -1.0, 2: -1.1, 3: -1.1, 4: 0.0})


def test_force_push_then_the_safe_form_repays_once() -> None:
    # git push --force: F = -0.3; --force-with-lease repays mu of that one violation once:
    # +0.02, then 0; total -0.28. The judge +1 each (exit 0); rewards 1 - 0.15 = 0.85,
    # 1 + 0.01 = 1.01, 1.
    run = fuzz.drive_one(
        SessionSpec(
            turns(Call("git push --force", 0), *[Call("git push --force-with-lease", 0)] * 2)
        )
    )
    assert shaping(run) == pytest.approx([-0.3, 0.02, 0.0, 0.0])
    assert rewards(run) == pytest.approx({0: 0.85, 1: 1.01, 2: 1.0, 3: 0.0})


def test_read_only_commands_earn_nothing() -> None:
    # ls, cat, git status with exit 0: read-only, F = 0, and no outcome for the judge (0): no
    # reward above 0; the session keeps its last judged turn at 0 (mask_turns), never above.
    run = fuzz.drive_one(SessionSpec(turns(*[Call("ls", 0), Call("cat README.md", 0),
                                             Call("git status", 0)])))  # fmt: skip
    assert shaping(run) == [0.0] * 4
    assert rewards(run) == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}
    assert max(s.reward for s in run.samples) == 0.0


def test_repeated_gui_no_op_is_penalised_once_and_repaid_once() -> None:
    # Five actions on turn 0: click on the home screen (the first screen: no diff), the same
    # click changing nothing (run 1 <= N 1), again (run 2: F = -0.1), again (same turn: no
    # second violation, no event), then a click that opens the settings page (repays mu:
    # +0.02). The judge: 0 for each no-op and the first screen, +1 for the settings page
    # (goal words appeared), 0 for the turn's own next state (an empty reply): prm = 1 / 6;
    # path 0.5 * 0 (the turn) + 0.5 * (-0.1 + 0.02) (its actions) = -0.04.
    same = Extra("gui", "click:settings-link:", "home")
    run = fuzz.drive_one(SessionSpec((
        TurnSpec(extras=(same, same, same, same, Extra("gui", "click:search:", "settings"))),
        TurnSpec(),
    )))  # fmt: skip
    assert shaping(run) == pytest.approx([-0.1, 0.02, 0.0, 0.0])
    assert rewards(run) == pytest.approx({0: 1 / 6 - 0.04, 1: 0.0})


def test_a_failed_gate_is_never_encouraged() -> None:
    # A passing test and commit (F = +0.1) judged +1, in a session whose gate failed: outcome
    # -1, votes [+1]: total -1 + 1 + 0.05 = 0.05, bounded to 0 (outcome_bound); a timed out
    # gate (124) is no outcome and changes nothing.
    spec = SessionSpec(
        turns(Call("pytest && git commit -m x", 0)),
        gates=(Gate("make test", 1, 0), Gate("pytest", 124, 1)),
    )
    run = fuzz.drive_one(spec)
    assert rewards(run) == pytest.approx({0: 0.05, 1: -1.0})
    assert [(s.reward, s.outcome) for s in run.samples] == [(0.0, -1.0), (-1.0, -1.0)]


# ---- what the search found ----------------------------------------------------------------------


def test_failures_hidden_from_the_judge_are_charged_to_the_next_judged_turn() -> None:
    # Found by the search (the "bound" invariant): pytest fails with output that reports no
    # exit code, so the judge scores those turns 0 (no signal) and their shaping was dropped,
    # while the recoveries after them, judged +1, were paid.
    #   turn:      0    1    2     3 (exit 0)        4     5 (exit 0)  6
    #   F:         0    0   -0.2  +0.1 (refund, pass) -0.2  +0.05       0    Phi_T = -0.25
    # Dropped, the rewards carried 0.5 * (0.1 + 0.05) = +0.075 of path part: above beta *
    # phi_max = 0.05, and positive for a session whose Phi is -0.25. Carried to the next
    # judged turn: turn 3 takes 0.5 * (-0.2 + 0.1) = -0.05, turn 5 0.5 * (-0.2 + 0.05) =
    # -0.075; the session's path parts sum to 0.5 * -0.25 = beta * Phi_T.
    tb = TurnSpec((Call("pytest", None, "Traceback (most recent call last):\n  ImportError"),))
    ok = TurnSpec((Call("pytest", 0),))
    run = fuzz.drive_one(SessionSpec((tb, tb, tb, ok, tb, ok, TurnSpec())))
    assert shaping(run) == pytest.approx([0.0, 0.0, -0.2, 0.1, -0.2, 0.05, 0.0])
    assert rewards(run) == pytest.approx({0: 0.0, 1: 0.0, 2: 0.0, 3: 0.95, 4: 0.0, 5: 0.925,
                                          6: 0.0})  # fmt: skip
    assert sum(r.penalty for r in run.rewards) == pytest.approx(0.5 * -0.25)
    # the reward names the penalties it took on (turn 2's, turn 4's) among its parents
    pen = {p.turn: p.event_id for p in run.penalties}
    by_turn = {r.turn: r for r in run.rewards}
    assert pen[2] in by_turn[3].parents and pen[4] in by_turn[5].parents
    assert pen[2] not in by_turn[5].parents
    # turns without a signal still carry no path part and train nothing
    assert all(s.penalty == 0.0 and not s.rl_trainable() for s in run.samples if s.turn != 3
               and s.turn != 5)  # fmt: skip


def test_the_search_s_minimal_hidden_failures_session() -> None:
    # The search's own minimised counter-example (seed 11, against main before the fix):
    #   turn 0 pytest && git commit -m x, exit 0: passing + done, F = +0.1, judged +1
    #   turns 1-3 pytest failing without an exit code (judged 0): failures 1, 2, 3: F = 0, 0,
    #     -0.2 (the progress facts stay: no exit code verifies a failed run)
    #   turn 4 pytest, exit 0: the penalised intent recovers, F = +0.05, judged +1
    #   turn 5 closes: F = 0.                                      Phi_T = -0.05
    # Dropped, turn 3's -0.2 left the rewards 0.5 * (0.1 + 0.05) = +0.075 of path part
    # (above 0.5 * 0.1); carried, turn 4 is 1 + 0.5 * (-0.2 + 0.05) = 0.925 and the path parts
    # sum to 0.05 - 0.075 = -0.025 = 0.5 * Phi_T.
    tb = TurnSpec((Call("pytest", None, "Traceback (most recent call last):\n  AssertionError"),))
    run = fuzz.drive_one(SessionSpec((
        TurnSpec((Call("pytest && git commit -m x", 0),), user="fix the failing test"),
        tb, tb, tb, TurnSpec((Call("pytest", 0),)), TurnSpec())))  # fmt: skip
    assert shaping(run) == pytest.approx([0.1, 0.0, 0.0, -0.2, 0.05, 0.0])
    assert rewards(run) == pytest.approx({0: 1.05, 1: 0.0, 2: 0.0, 3: 0.0, 4: 0.925, 5: 0.0})
    assert sum(r.penalty for r in run.rewards) == pytest.approx(0.5 * -0.05)


def test_in_a_group_a_judged_zero_ranks_above_a_failed_attempt() -> None:
    # Found by the search against a too strict check ("a session without signal never gets a
    # reward > 0"): in a group, a judged 0 is a value. Step 0: b = [0 (s0, judged 0), -1
    # (s1, failed gate; its turn judged 0: prm 0)], mean -0.5, std 0.5: z = +-0.5 / (0.5 +
    # 1e-6) = +-0.999998000004; no path part on either. Without any rule: the same.
    spec0 = SessionSpec((TurnSpec(user="fix the failing test"),), group="g")
    spec1 = SessionSpec(
        (TurnSpec(user="fix the failing test"),), gates=(Gate("pytest", 1, 0),), group="g"
    )
    for rules in (fuzz.DEFAULT, fuzz.NO_RULES):
        runs = [fuzz.drive_one(spec0, rules, "s0"), fuzz.drive_one(spec1, rules, "s1")]
        got = {s.session_id: s.reward for s in fuzz.assemble(runs, [spec0, spec1])}
        assert got == pytest.approx({"s0": 0.5 / (0.5 + 1e-6), "s1": -0.5 / (0.5 + 1e-6)})


def test_shaping_that_cancels_a_real_signal_does_not_move_the_kept_turn() -> None:
    # The search's counter-example after the carry fix (seed 11, 5,289 examples):
    #   turn 0 no calls; its next state an empty reply: judged 0
    #   turn 1 git push --force, exit 0, the judge raises: no verdict; F = -0.3, carried:
    #     0.5 * -0.3 = -0.15
    #   turn 2 the same click four times on the same screen: the first screen, then no-ops;
    #     the second no-op in a row is a violation, F = -0.1 (beta 0.5: -0.05); each judged
    #     0; then the user thanks (+1): prm = 1 / 5 = 0.2, path -0.15 - 0.05 = -0.2, total 0
    #   turn 3 the session's end: judged 0
    # Masked by its total of 0, turn 2 left every turn without signal and mask_turns kept the
    # last judged one, turn 3, trained at 0 because of shaping alone. By its prm (0.2) turn 2
    # keeps its signal, as without any rule, and turn 3 stays masked.
    same = Extra("gui", "click:settings-link:", "home")
    spec = SessionSpec((
        TurnSpec(user="fix the failing test"),
        TurnSpec((Call("git push --force", 0),), judge="raise"),
        TurnSpec(extras=(same,) * 4),
        TurnSpec(user="thanks, that works"),
    ))  # fmt: skip
    run = fuzz.drive_one(spec)
    assert shaping(run) == pytest.approx([0.0, -0.3, -0.1, 0.0, 0.0])
    assert rewards(run) == pytest.approx({0: 0.0, 2: 0.0, 3: 0.0})
    assert {r.turn: r.prm for r in run.rewards} == pytest.approx({0: 0.0, 2: 0.2, 3: 0.0})
    plain = fuzz.drive_one(spec, fuzz.NO_RULES)
    assert rewards(plain) == pytest.approx({0: 0.0, 2: 0.2, 3: 0.0})
    for r in (run, plain):
        assert [s.turn for s in r.samples if s.rl_trainable()] == [2]


COUNTER_EXAMPLES = {
    # a force push in the other attempt of the group: its reward - penalty is 0 to ~1e-17,
    # which moved s0's z-score by as much (the check compares to float precision)
    "float_precision_in_a_group": [
        SessionSpec((TurnSpec(user="fix the failing test"), TurnSpec()), group="g"),
        SessionSpec((TurnSpec(user="fix the failing test"),
                     TurnSpec((Call("git push --force", 0),))),
                    gates=(Gate("pytest", 1, 0),), group="g"),
    ],
    "shaping_cancels_a_signal": [SessionSpec((
        TurnSpec(user="fix the failing test"),
        TurnSpec((Call("git push --force", 0),), judge="raise"),
        TurnSpec(extras=(Extra("gui", "click:settings-link:", "home"),) * 4),
        TurnSpec(user="thanks, that works")))],
    "hidden_failures": [SessionSpec((
        TurnSpec((Call("pytest", None, "Traceback (most recent call last):\n  x"),)),
        *[TurnSpec((Call("pytest", None, "Traceback (most recent call last):\n  x"),))] * 2,
        TurnSpec((Call("pytest", 0),)),
        TurnSpec((Call("pytest", None, "Traceback (most recent call last):\n  x"),)),
        TurnSpec((Call("pytest", 0),)), TurnSpec()))],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(COUNTER_EXAMPLES))
def test_the_search_s_counter_examples_keep_the_invariants(
    cores: dict[str, Any], name: str
) -> None:
    fuzz.check(COUNTER_EXAMPLES[name], cores, random.Random(0))
