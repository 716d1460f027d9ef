"""Path rules as potential-based shaping: hand-computed F and Phi per turn, the farms of
issue 38 as regressions, the design rules on load, and a hypothesis search over generated
sessions for the shaping's invariants (bounded, telescoping, nothing positive without a
verified passing test run, one `a && b` call is the two calls)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.processors.config import DEFAULT_RULES
from pipeline.processors.penalties import (
    GAMMA,
    PathHistory,
    RuleConfigError,
    RuleSet,
    ToolCall,
    command_words,
    intent_of,
    load_rules,
    shell_parts,
)

BASE = {
    "version": "r-test",
    "beta": 0.5,
    "failure_patterns": ["(?i)error"],
    "rules": [
        {
            "id": "rep",
            "kind": "repeated_failing_call",
            "max_repeats": 2,
            "penalty": 0.2,
            "compliance": 0.05,
        },
        {
            "id": "bad",
            "kind": "forbidden_pattern",
            "patterns": ["rm -rf /", "git push --force( |$)"],
            "alternatives": ["git push --force-with-lease"],
            "penalty": 0.3,
            "compliance": 0.02,
        },
        {
            "id": "req",
            "kind": "required_step",
            "trigger": "git commit",
            "requires": "pytest",
            "within_turns": 2,
            "penalty": 0.2,
            "compliance": 0.05,
        },
    ],
}
# Phi's bounds for BASE: phi_min = -(0.2 + 0.3 + 0.2) = -0.7 (the default floor: minus the sum
# of the penalties), phi_max = 2 * 0.05 = 0.1 (one required step, two progress facts).


def rules(**changes) -> RuleSet:  # type: ignore[no-untyped-def]
    obj = copy.deepcopy(BASE)
    obj.update(changes)
    return RuleSet.from_dict(obj)


def call(cmd: str, result: str | None = "ok", cid: str = "c") -> ToolCall:
    return ToolCall(cid, "shell", f'{{"cmd": "{cmd}"}}', result)


def term(cmd: str, code: int | None, out: str = "", cid: str = "c") -> ToolCall:
    """A shell call whose result reports its exit code the way the terminal adapter reads it."""
    return call(cmd, out if code is None else f"{out}\nExit code: {code}", cid)


def test_default_rules_load() -> None:
    rs = load_rules(DEFAULT_RULES)
    assert rs.beta == 0.5 and rs.version == "rules-3" and GAMMA == 1.0
    # phi_min from the file; phi_max = 2 * mu of tests-before-commit; beta * 0.9 = 0.45 < 0.5
    assert (rs.phi_min, rs.phi_max) == (-0.8, 0.1)
    assert (rules().phi_min, rules().phi_max) == (-0.7, 0.1)


def test_forbidden_command_and_the_refund_of_its_alternative() -> None:
    rs, h = rules(), PathHistory()
    lease = call("git push --force-with-lease origin main")
    # The safe form alone earns nothing: a refund repays a violation, and there is none.
    assert rs.evaluate(0, [lease], PathHistory()).phi == 0.0
    r = rs.evaluate(0, [call("ls")], h)
    assert (r.phi, r.compliance_bonus, r.rule_ids, r.potential) == (0.0, 0.0, [], 0.0)
    r = rs.evaluate(1, [call("ls"), call("rm -rf / ")], h)  # D = 0.3: F = -0.3
    assert (r.phi, r.compliance_bonus, r.potential) == (-0.3, 0.0, -0.3)
    assert r.hits == [{"rule_id": "bad", "detail": "rm -rf /"}]
    r = rs.evaluate(2, [lease], h)  # repays mu of it: D = 0.3 - 0.02 = 0.28, F = +0.02
    assert (r.phi, r.compliance_bonus, r.rule_ids, r.potential) == (0.02, 0.02, ["bad"], -0.28)
    assert rs.evaluate(3, [lease], h).phi == 0.0  # refunds == violations: nothing more
    assert rs.evaluate(4, [call("git push --force origin main")], h).phi == -0.3  # D = 0.58
    assert rs.evaluate(5, [], h).phi == 0.0  # no action, no verdict: never punish inaction
    assert rs.evaluate(6, [lease, lease], h).phi == 0.02  # one refund left: D = 0.56
    assert rs.potential(h) == pytest.approx(-0.56)
    # a failed alternative repays nothing
    assert rs.evaluate(
        7, [call("rm -rf / "), term("git push --force-with-lease", 1)], h
    ).phi == pytest.approx(-0.14)  # D = 0.86, capped at 0.7: F = -0.7 - (-0.56)


def test_repeated_failures_of_one_intent_and_the_refund_of_a_recovery() -> None:
    rs, h = rules(), PathHistory()
    fail = call("make", "Error 2")
    assert rs.evaluate(0, [fail], h).phi == 0.0  # 1st failure
    assert rs.evaluate(1, [fail], h).phi == 0.0  # 2nd: N = 2 allowed
    third = rs.evaluate(2, [fail], h)  # 3rd failure of the intent `make`: -lambda
    assert third.phi == pytest.approx(-0.2)
    assert third.hits == [{"rule_id": "rep", "detail": "shell:make failed 3 times"}]
    # Another intent that succeeds is no recovery; the same intent (program and subcommand)
    # succeeding repays mu of the violation: +0.05. Each fail/recover cycle nets -0.15.
    assert rs.evaluate(3, [call("make clean")], h).phi == 0.0
    fixed = rs.evaluate(4, [call("make -j1")], h)
    assert (fixed.phi, fixed.compliance_bonus) == pytest.approx((0.05, 0.05))
    assert rs.evaluate(5, [call("make", "error")], h).phi == pytest.approx(-0.2)  # 4th
    assert rs.evaluate(6, [call("make")], h).phi == pytest.approx(0.05)  # recovered again
    assert rs.evaluate(7, [call("make")], h).phi == 0.0  # nothing left to recover
    assert rs.potential(h) == pytest.approx(-0.3)  # 2 * (0.2 - 0.05)
    # two failures in one turn count in order: the 3rd of `npm test` is in the same turn
    h2 = PathHistory()
    r = rs.evaluate(0, [call("npm test", "error")] * 3, h2)
    assert (r.phi, r.rule_ids) == (-0.2, ["rep"])


def test_a_session_of_failures_recoveries_and_unrelated_calls() -> None:
    rs, h = rules(), PathHistory()
    phis = [
        rs.evaluate(0, [call("ls"), call("cat a.py")], h).phi,  # read-only: 0
        rs.evaluate(1, [term("pytest", 1, "1 failed")], h).phi,  # 1st failure of pytest: 0
        rs.evaluate(2, [call("vim a.py")], h).phi,  # another intent: 0
        rs.evaluate(3, [term("pytest -x", 1)], h).phi,  # 2nd: 0
        rs.evaluate(4, [term("pytest -k b", 1)], h).phi,  # 3rd of the intent: -0.2
        # recovered, and passing: +0.05 refund, +0.05 progress (tests pass)
        rs.evaluate(5, [term("pytest -k b", 0), call("touch x")], h).phi,
        rs.evaluate(6, [term("git commit -am fix", 0)], h).phi,  # committed while passing
        rs.evaluate(7, [term("pytest", 1)], h).phi,  # no longer passes: -0.05; 4th: -0.2
        rs.evaluate(8, [term("git commit -m again", 0)], h).phi,  # done already: 0
    ]
    assert phis == pytest.approx([0.0, 0.0, 0.0, 0.0, -0.2, 0.1, 0.05, -0.25, 0.0])
    # telescoping: the total is Phi at the end = P - D = 0.05 - (0.4 - 0.05)
    assert sum(phis) == pytest.approx(rs.potential(h)) == pytest.approx(-0.3)
    assert h.penalised == ["shell:pytest"] and h.passing == [] and h.done == ["req"]


def test_recovery_refund_cannot_be_farmed_with_a_failing_call_then_true() -> None:
    """Audit repro: every turn holds a deliberately failing call followed by `true`."""
    rs, h = rules(failure_patterns=["(?i)error", "(?i)command not found"]), PathHistory()
    phis = [
        rs.evaluate(
            t, [call(f"nosuchcmd{t}", "sh: nosuchcmd: command not found"), call("true", "")], h
        ).phi
        for t in range(6)
    ]
    assert phis == [0.0] * 6


def test_read_only_commands_repay_nothing_and_run_nothing() -> None:
    rs, h = (
        RuleSet.from_dict(
            {
                **copy.deepcopy(BASE),
                "rules": [
                    {**BASE["rules"][0]},
                    {
                        "id": "bad",
                        "kind": "forbidden_pattern",
                        "patterns": ["git reset --hard"],
                        "alternatives": ["git\\s+stash(\\s|$)"],
                        "penalty": 0.3,
                        "compliance": 0.02,
                    },
                ],
            }
        ),
        PathHistory(),
    )
    assert rs.evaluate(0, [call("git reset --hard HEAD~1")], h).phi == pytest.approx(-0.3)
    # Audit repro: read-only `git stash list -n k` variants paid +0.02 per turn.
    assert [rs.evaluate(t, [call(f"git stash list -n {t}")], h).phi for t in range(1, 5)] == [
        0.0
    ] * 4
    assert rs.is_read_only("git stash list -n 3") and rs.is_read_only("ls -la | grep x && pwd")
    assert not rs.is_read_only("echo x > file") and not rs.is_read_only("ls && rm -rf build")
    assert rs.evaluate(5, [call("git stash")], h).phi == pytest.approx(0.02)  # the real one
    assert rs.evaluate(6, [call("git stash push -m wip")], h).phi == 0.0  # repaid already
    # a read-only call is its own intent: `cat a.txt` failing is not `cat b.txt` failing
    fails = [
        rs.evaluate(t, [call(f"cat {t}.txt", "error: no such file")], h).phi for t in range(7, 12)
    ]
    assert fails == [0.0] * 5


def test_recovery_needs_a_verified_result() -> None:
    """Audit repro: a call scored with no result (the session's last turn) is no success, nor
    is a no-outcome exit code (127: not found)."""
    rs, h = rules(), PathHistory()
    assert [
        rs.evaluate(t, [call("pytest", "Error: 2 failed")], h).phi for t in range(3)
    ] == pytest.approx([0.0, 0.0, -0.2])
    assert rs.evaluate(3, [call("rm -f build.log", None)], h).phi == 0.0
    assert rs.evaluate(4, [call("pytest", None)], h).phi == 0.0  # the same intent, unverified
    assert rs.evaluate(5, [term("pytest", 127, "pytest: not found")], h).phi == 0.0
    assert h.penalised == ["shell:pytest"]
    # text without an exit code that is no failure: a success, not a verified pass (no P)
    r = rs.evaluate(6, [call("pytest", "5 passed")], h)
    assert (r.phi, r.rule_ids) == (pytest.approx(0.05), ["rep"]) and h.passing == []


def test_intent_and_command_words() -> None:
    assert intent_of(call("pytest -x")) == intent_of(call("pytest -k case3")) == "shell:pytest"
    assert intent_of(call("python -m pytest tests")) == "shell:pytest"
    assert intent_of(call("/usr/bin/make -j2 all")) == "shell:make all"
    assert intent_of(call("CI=1 npm test")) == "shell:npm test"
    assert intent_of(call("python3 step1.py")) != intent_of(call("python step2.py"))
    assert intent_of(call("nosuchcmd")) != intent_of(call("true"))
    assert intent_of(call("cd app && pytest -q && git push")) == "shell:pytest"
    assert intent_of(call("grep -rn foo .")) == "shell:grep -rn foo ."  # read-only: itself
    other = ToolCall("c", "edit", '{"path": "a.py"}', "ok")
    assert intent_of(other) == other.key
    assert ToolCall("a", "f", '{"x": 1, "y": 2}').key == ToolCall("b", "f", '{"y": 2, "x": 1}').key
    assert command_words("CI=1 timeout -s 9 60 uv run python3.11 -m pytest -x") == ["pytest", "-x"]
    assert command_words("env X=1 nice -n 5 /usr/bin/git commit") == ["git", "commit"]


def test_shell_parts_respect_quotes_and_redirections() -> None:
    assert shell_parts('cd app && pytest -q 2>&1 | tail -5; git commit -m "a; b && c" &') == [
        ("cd app", "&&"),
        ("pytest -q 2>&1", "|"),
        ("tail -5", ";"),
        ('git commit -m "a; b && c"', "&"),
    ]
    assert shell_parts("a &&\n b || c &> log;") == [("a", "&&"), ("b", "||"), ("c &> log", "")]
    assert shell_parts("echo a\\;b |& cat") == [("echo a\\;b", "|"), ("cat", "")]


def test_what_an_exit_code_verifies_about_each_part() -> None:
    """A part passed when the line exited 0 and only `&&` follows it: a pipe, `||`, `;` or a
    background `&` after pytest hides its own code, so no progress is paid for it."""
    rs = rules()

    def passing(cmd: str, code: int | None) -> bool:
        h = PathHistory()
        rs.evaluate(0, [term(cmd, code)], h)
        return h.passing == ["req"]

    assert passing("pytest", 0) and passing("cd app && python -m pytest -q", 0)
    assert passing("make lint; pytest", 0) and passing("env CI=1 pytest", 0)
    assert not passing("pytest 2>&1 | tail -5", 0) and not passing("pytest || true", 0)
    assert not passing("pytest; true", 0) and not passing("pytest &", 0)
    assert not passing("pytest", None) and not passing("pytest", 1)
    assert not passing("echo pytest", 0) and not passing("vim test_pytest.py", 0)
    assert not passing("cat pytest.ini", 0)


def test_required_step_within_a_window() -> None:
    rs, h = rules(), PathHistory()
    assert rs.evaluate(0, [term("git commit -m x", 0)], h).phi == pytest.approx(-0.2)
    assert rs.evaluate(1, [term("pytest -q", 0)], h).phi == pytest.approx(0.05)  # passing
    done = rs.evaluate(2, [term("git commit -m y", 0)], h)  # committed while passing
    assert (done.phi, done.compliance_bonus, done.potential) == pytest.approx((0.05, 0.05, -0.1))
    assert rs.evaluate(3, [term("git commit -m y2", 0)], h).phi == 0.0  # once per session
    stale = rs.evaluate(5, [term("git commit -m z", 0)], h)  # pytest was 4 turns ago > 2
    assert stale.phi == pytest.approx(-0.2)
    fresh = PathHistory()  # both facts in one turn, the commit after the test run
    assert rs.evaluate(9, [term("pytest", 0), term("git commit", 0)], fresh).phi == pytest.approx(
        0.1
    )
    # a commit that did not verifiably succeed (no result, or exit 1) is not "done"
    h2 = PathHistory()
    rs.evaluate(0, [term("pytest", 0)], h2)
    assert rs.evaluate(1, [call("git commit -m x", None), term("git commit", 1)], h2).phi == 0.0
    assert h2.done == []


def test_history_round_trips_as_json_and_old_histories_start_at_zero() -> None:
    rs, h = rules(), PathHistory()
    for t in range(3):
        rs.evaluate(t, [call("make", "error"), term("pytest", 0), term("git commit", 0)], h)
    assert PathHistory.from_json(h.to_json()) == h
    assert h.penalised == ["shell:make"] and h.debt == {"rep": [1, 0]}
    assert rs.potential(h) == pytest.approx(0.1 - 0.2)
    # a rules-2 history (failures keyed by the exact call, commands, goals): potential 0
    old = {
        "failures": {'shell:{"cmd":"make"}': 5},
        "commands": [[0, "pytest"]],
        "failed_goals": ["shell:make"],
        "credited": ["rep 0"],
        "noops": ["click:a:", 1],
    }
    assert PathHistory.from_json(old) == PathHistory(noops=["click:a:", 1])
    assert PathHistory.from_json(None) == PathHistory() == PathHistory.from_json({})


def test_the_potential_floor_bounds_a_session_of_violations() -> None:
    """Violations cost until Phi reaches phi_min (-0.7): -0.3, -0.3, -0.1, then 0. The hits
    still say what was violated; the path part of the session stays beta * -0.7 = -0.35."""
    rs, h = rules(), PathHistory()
    rs_ = [rs.evaluate(t, [call("git push --force origin")], h) for t in range(5)]
    assert [r.phi for r in rs_] == pytest.approx([-0.3, -0.3, -0.1, 0.0, 0.0])
    assert all(r.rule_ids == ["bad"] for r in rs_) and rs_[-1].potential == -0.7
    # progress still counts at the floor (P is not capped by D)
    assert rs.evaluate(5, [term("pytest", 0)], h).phi == pytest.approx(0.05)


def test_inaction_trap_is_rejected_with_an_explanation() -> None:
    with pytest.raises(RuleConfigError, match="inaction trap") as err:
        rules(beta=1.5)  # 1.5 * (0.1 - -0.7) = 1.2 >= 0.5 * 1.0
    assert "doing nothing" in str(err.value) and "1.2" in str(err.value)
    with pytest.raises(RuleConfigError, match="inaction trap"):
        rules(beta=0.7)  # 0.7 * 0.8 = 0.56
    rules(beta=0.6)  # 0.48 < 0.5: accepted
    rules(beta=1.5, phi_min=-0.2)  # 1.5 * 0.3 = 0.45: a higher floor allows a larger beta
    with pytest.raises(RuleConfigError, match="phi_min"):
        rules(phi_min=0.0)


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (
            {"id": "x", "kind": "no_progress", "penalty": 0.1, "compliance": 0.01},
            "lack of progress",
        ),
        ({"id": "x", "kind": "forbidden_pattern", "patterns": ["a"], "penalty": 0.1}, "rule 3"),
        (
            {
                "id": "x",
                "kind": "forbidden_pattern",
                "patterns": ["a"],
                "penalty": 0.1,
                "compliance": 0.2,
            },
            "farmable",
        ),
        (
            {
                "id": "x",
                "kind": "forbidden_pattern",
                "patterns": [".*"],
                "penalty": 0.1,
                "compliance": 0.01,
            },
            "no compliant path",
        ),
        (
            {
                "id": "x",
                "kind": "required_step",
                "trigger": "a",
                "requires": "b?",
                "penalty": 0.1,
                "compliance": 0.01,
            },
            "gameable",
        ),
        (
            {
                "id": "x",
                "kind": "repeated_failing_call",
                "max_repeats": 0,
                "penalty": 0.1,
                "compliance": 0.01,
            },
            "max_repeats",
        ),
        (
            {
                "id": "x",
                "kind": "forbidden_pattern",
                "patterns": ["("],
                "penalty": 0.1,
                "compliance": 0.01,
            },
            "bad regex",
        ),
    ],
)
def test_design_rules_are_enforced(rule, message):
    with pytest.raises(RuleConfigError, match=message):
        RuleSet.from_dict({"version": "v", "beta": 0.5, "rules": [rule]})


def test_malformed_rule_set_is_a_config_error():
    with pytest.raises(RuleConfigError, match="malformed"):
        RuleSet.from_dict({"version": "v", "beta": 0.5, "rules": [{"id": "x"}]})


# ---- GUI actions: repeated no-ops (gui next states, in session order) -----------------------

NOOP_RULE = {
    "id": "noop",
    "kind": "repeated_noop_action",
    "max_repeats": 1,
    "penalty": 0.1,
    "compliance": 0.02,
}


def test_a_repeated_noop_action_is_penalised_once_per_turn_and_a_change_repays_part() -> None:
    rs = rules(rules=[*BASE["rules"], NOOP_RULE])  # type: ignore[list-item]
    h = PathHistory()
    click = "click:save:"
    steps = [  # (turn, action, no_op) -> (F, bonus, rule ids): by hand, N = 1 allowed
        ((0, click, None), (0.0, 0.0, [])),  # first screen: nothing known
        ((0, click, True), (0.0, 0.0, [])),  # 1st no-op: allowed
        ((1, click, True), (-0.1, 0.0, ["noop"])),  # 2nd in a row: -lambda
        ((1, click, True), (0.0, 0.0, [])),  # 3rd, same turn: once per turn
        ((2, click, True), (-0.1, 0.0, ["noop"])),  # 4th, next turn: again
        ((2, "type:name:bob", False), (0.02, 0.02, ["noop"])),  # changed: repays mu of one
        ((3, click, True), (0.0, 0.0, [])),  # a new run starts at 1
        ((3, click, True), (-0.1, 0.0, ["noop"])),
        ((4, "key:Enter:", False), (0.02, 0.02, ["noop"])),  # repays the 3rd violation
        ((4, "key:Tab:", False), (0.0, 0.0, [])),  # no run: nothing
        ((5, click, True), (0.0, 0.0, [])),
        ((5, click, True), (-0.1, 0.0, ["noop"])),
        ((5, click, False), (0.02, 0.02, ["noop"])),
    ]
    got = []
    for (turn, key, no_op), _ in steps:
        r = rs.evaluate_gui(turn, key, no_op, h)
        got.append((r.phi, r.compliance_bonus, r.rule_ids))
    assert got == [want for _, want in steps]
    assert rs.potential(h) == pytest.approx(-4 * 0.1 + 3 * 0.02)  # D = 0.34
    assert h.noops == []
    assert PathHistory.from_json(h.to_json()) == h


def test_noops_on_different_targets_are_no_run() -> None:
    rs = rules(rules=[NOOP_RULE])
    h = PathHistory()
    phis = [rs.evaluate_gui(0, k, True, h).phi for k in ("click:a:", "click:b:", "click:a:")]
    assert phis == [0.0, 0.0, 0.0] and h.noops == ["click:a:", 1]
    r = rs.evaluate_gui(0, "click:a:", True, h)
    assert (r.phi, r.hits) == (
        -0.1,
        [{"rule_id": "noop", "detail": "click:a: changed nothing 2 times"}],
    )


def test_tool_calls_never_fire_the_noop_rule_and_old_histories_load() -> None:
    rs = rules(rules=[NOOP_RULE])
    assert rs.evaluate(0, [call("ls", "ok"), call("ls", "ok")], PathHistory()).hits == []
    old = {"failures": {}, "commands": [], "failed_goals": [], "credited": []}
    assert PathHistory.from_json(old) == PathHistory()
    with pytest.raises(RuleConfigError, match="max_repeats"):
        rules(rules=[{**NOOP_RULE, "max_repeats": 0}])
    with pytest.raises(RuleConfigError, match="compliance"):
        rules(rules=[{**NOOP_RULE, "compliance": 0.0}])


# ---- farms (issue 38 item 2): each reproduced on 7ed65b3, none pays now ----------------------


def test_farm_gui_noop_pairs_pay_nothing() -> None:
    """Repro: 40 no-op pairs on distinct actions in one turn, each followed by an action that
    changes the screen: the penalty was paid once per turn, the bonus once per action key:
    phi -0.1 + 40 * 0.02 = +0.70. Now the run's refund is bounded by the penalties it repays:
    -0.1 + 0.02 = -0.08."""
    rs, h = rules(rules=[NOOP_RULE]), PathHistory()
    total = 0.0
    for i in range(40):
        total += rs.evaluate_gui(0, f"click:b{i}:", True, h).phi
        total += rs.evaluate_gui(0, f"click:b{i}:", True, h).phi
        total += rs.evaluate_gui(0, "click:next:", False, h).phi
    assert total == pytest.approx(-0.08)


def test_farm_echo_pytest_and_an_empty_commit_earn_nothing() -> None:
    """Repro: `echo pytest` then an empty commit earned the required-step bonus on every turn
    (any text holding "pytest" counted; the credit tag held the turn). `echo` runs no test:
    each commit is a commit without tests, -0.2, until the potential's floor (-0.7)."""
    rs, h = rules(), PathHistory()
    phis = [
        rs.evaluate(
            t, [term("echo pytest", 0, "pytest"), term("git commit --allow-empty -m x", 0)], h
        ).phi
        for t in range(6)
    ]
    assert phis == pytest.approx([-0.2, -0.2, -0.2, -0.1, 0.0, 0.0])
    assert sum(phis) == pytest.approx(-0.7)


def test_farm_a_failing_pytest_earns_no_commit_bonus() -> None:
    """Repro: a failing pytest (exit 1), then a commit: +0.05 before. Tests ran (no violation),
    but they did not pass: nothing is earned."""
    rs, h = rules(), PathHistory()
    assert rs.evaluate(0, [term("pytest -q", 1, "1 failed")], h).phi == 0.0
    assert rs.evaluate(1, [term("git commit -m x", 0)], h).phi == 0.0


def test_farm_pytest_and_commit_in_one_call_is_the_two_calls() -> None:
    """Repro: `pytest && git commit -m x` as one call was penalised -0.2 (the trigger was
    looked for in the calls before it), the same two calls apart earned +0.05. Both now earn
    the same: tests passed (+mu 0.05) and committed after a passing test (+mu 0.05)."""
    rs = rules()
    one = rs.evaluate(0, [term("pytest && git commit -m x", 0)], PathHistory()).phi
    h = PathHistory()
    two = rs.evaluate(0, [term("pytest", 0, cid="a"), term("git commit -m x", 0, cid="b")], h).phi
    apart = PathHistory()
    split = rs.evaluate(0, [term("pytest", 0)], apart).phi
    split += rs.evaluate(1, [term("git commit -m x", 0)], apart).phi
    assert one == pytest.approx(two) == pytest.approx(split) == pytest.approx(0.1)


def test_farm_a_new_goal_each_turn_earns_no_recovery() -> None:
    """Repro: `python stepN.py` fails, then succeeds, on every turn: +0.05 "recovered" per turn,
    up to the path limit. Nothing was penalised, so there is nothing to recover: 0."""
    rs, h = rules(), PathHistory()
    phis = [
        rs.evaluate(
            t,
            [term(f"python step{t}.py", 1, "NameError: x"), term(f"python step{t}.py", 0, "ok")],
            h,
        ).phi
        for t in range(10)
    ]
    assert phis == [0.0] * 10


def test_farm_repeated_failures_are_keyed_by_the_program() -> None:
    """Repro: ten failing `pytest -k caseN` calls cost nothing (the rule keyed the exact call).
    Keyed by the program now: the 3rd and later failures are penalised (N = 2), -0.2 a turn
    until the floor -0.7: [0, 0, -0.2, -0.2, -0.2, -0.1, 0, 0, 0, 0]."""
    rs, h = rules(), PathHistory()
    phis = [
        rs.evaluate(t, [term(f"pytest -k case{t}", 1, "Error: 1 failed")], h).phi for t in range(10)
    ]
    assert phis == pytest.approx([0, 0, -0.2, -0.2, -0.2, -0.1, 0, 0, 0, 0])


def test_counter_example_the_parts_of_a_line_are_shaped_in_their_order() -> None:
    """Found by the hypothesis search below (2500 examples): one line holding the safe push
    before a forced one was refunded as if the violation came first (-0.28); as two calls the
    refund finds no debt yet (-0.3). The parts are now taken in order, like calls."""
    rs = rules()
    lease, force = "git push --force-with-lease", "git push --force origin main"
    for first, second, want in ((lease, force, -0.3), (force, lease, -0.28)):
        one = rs.evaluate(0, [term(f"{first} && {second}", 0)], PathHistory()).phi
        two = rs.evaluate(0, [term(first, 0, cid="a"), term(second, 0, cid="b")], PathHistory()).phi
        assert one == pytest.approx(two) == pytest.approx(want)


# ---- the invariants, searched: generated sessions of tool calls and GUI actions -------------

# (command, runs a test program): a line that runs one and exits 0 may verify a pass; the
# second field is set by hand, independently of how the rules read command lines.
COMMANDS = [
    ("pytest", True),
    ("pytest -k case{n}", True),
    ("python -m pytest -q", True),
    ("pytest && git commit -m x", True),
    ("cd app && pytest", True),
    ("pytest 2>&1 | tail -5", True),
    ("pytest || true", True),
    ("make lint; pytest", True),
    ("echo pytest", False),
    ("cat pytest.ini", False),
    ("git commit -m x", False),
    ("git commit --allow-empty -m x", False),
    ("echo pytest && git commit -m x", False),
    ("vim test_pytest.py", False),
    ("git push --force origin main", False),
    ("git push --force-with-lease", False),
    ("git stash", False),
    ("rm -rf / ", False),
    ("python step{n}.py", False),
    ("make", False),
    ("make clean", False),
    ("true", False),
    ("ls", False),
    ("grep -rn x .", False),
    ("nosuchcmd", False),
    ("git reset --keep", False),
]
TEXTS = [None, "ok", "Error: boom", "Traceback (most recent call last)", "sh: command not found"]
CODES = [0, 1, 2, 5, 124, 126, 127]
DEFAULT = load_rules(DEFAULT_RULES)  # phi in [-0.8, 0.1]


@st.composite
def a_call(draw: st.DrawFn, verified_ok: bool = True) -> ToolCall:
    """One tool call and its result; ``verified_ok=False``: a test program never exits 0."""
    if draw(st.integers(0, 9)) == 0:  # a call that is no shell command
        return ToolCall("e", "edit", '{"path": "a.py"}', draw(st.sampled_from(TEXTS)))
    cmd, runs_tests = draw(st.sampled_from(COMMANDS))
    cmd = cmd.format(n=draw(st.integers(0, 3)))
    codes = CODES if verified_ok or not runs_tests else [c for c in CODES if c != 0]
    if draw(st.booleans()):
        return term(cmd, draw(st.sampled_from(codes)), draw(st.sampled_from(["", "5 passed"])))
    return call(cmd, draw(st.sampled_from(TEXTS)))


@st.composite
def a_session(draw: st.DrawFn, verified_ok: bool = True) -> list[tuple[int, object]]:
    """Events in session order: (turn, list of calls) or (turn, (GUI action key, no_op))."""
    events: list[tuple[int, object]] = []
    turn = 0
    for _ in range(draw(st.integers(0, 40))):
        turn += draw(st.integers(0, 3))
        if draw(st.booleans()):
            events.append((turn, draw(st.lists(a_call(verified_ok), max_size=4))))
        else:
            key = draw(st.sampled_from(["click:save:", "click:ok:", "type:name:bob"]))
            events.append((turn, (key, draw(st.sampled_from([None, True, True, False])))))
    return events


def shape(rs: RuleSet, events: list[tuple[int, object]], h: PathHistory) -> list[float]:
    """Each event's shaping F, in order."""
    out = []
    for turn, ev in events:
        if isinstance(ev, tuple):
            out.append(rs.evaluate_gui(turn, ev[0], ev[1], h).phi)
        else:
            out.append(rs.evaluate(turn, ev, h).phi)  # type: ignore[arg-type]
    return out


@settings(max_examples=150, deadline=None)
@given(a_session())
def test_a_sessions_shaping_telescopes_and_stays_within_its_bound(events) -> None:  # type: ignore[no-untyped-def]
    """Every prefix's total is Phi of its state (gamma = 1: it telescopes) and lies in
    [phi_min, phi_max] = [-0.8, 0.1], whatever the length; the history survives JSON."""
    h, total = PathHistory(), 0.0
    for f in shape(DEFAULT, events, h):
        total += f
        assert -0.8 - 1e-9 <= total <= 0.1 + 1e-9
    assert total == pytest.approx(DEFAULT.potential(h), abs=1e-9)
    assert PathHistory.from_json(h.to_json()) == h


@settings(max_examples=150, deadline=None)
@given(a_session(verified_ok=False))
def test_no_session_without_a_verified_pass_earns_a_positive_total(events) -> None:  # type: ignore[no-untyped-def]
    """No test program exits 0: refunds, alternatives, recoveries, commits, `echo pytest`,
    GUI changes, in any order and number, never bring any prefix's total above 0."""
    total = 0.0
    for f in shape(DEFAULT, events, PathHistory()):
        total += f
        assert total <= 1e-12


SINGLE = [
    "pytest",
    "pytest -k a",
    "git commit -m x",
    "make",
    "make test",
    "python step1.py",
    "git push --force-with-lease",
    "git stash",
    "git push --force origin main",
    "echo pytest",
    "ls",
    "npm test",
]


@settings(max_examples=150, deadline=None)
@given(a_session(), st.sampled_from(SINGLE), st.sampled_from(SINGLE), st.integers(0, 3))
def test_one_line_of_two_commands_is_the_two_calls(events, a, b, gap) -> None:  # type: ignore[no-untyped-def]
    """After any session, `a && b` exiting 0 shapes its turn exactly like `a` and `b` as two
    calls that each exit 0 (and leaves the same potential)."""
    h = PathHistory()
    shape(DEFAULT, events, h)
    turn = (events[-1][0] if events else 0) + gap
    one, two = PathHistory.from_json(h.to_json()), PathHistory.from_json(h.to_json())
    f_one = DEFAULT.evaluate(turn, [term(f"{a} && {b}", 0)], one).phi
    f_two = DEFAULT.evaluate(turn, [term(a, 0, cid="a"), term(b, 0, cid="b")], two).phi
    assert f_one == pytest.approx(f_two, abs=1e-12)
    assert DEFAULT.potential(one) == pytest.approx(DEFAULT.potential(two), abs=1e-12)
