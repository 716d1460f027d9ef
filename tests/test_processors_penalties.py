"""Path-penalty rules: evaluation by hand-computed Phi, and the four design rules on load."""

from __future__ import annotations

import copy

import pytest

from pipeline.processors.config import DEFAULT_RULES
from pipeline.processors.penalties import (
    PathHistory,
    RuleConfigError,
    RuleSet,
    ToolCall,
    load_rules,
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


def rules(**changes) -> RuleSet:  # type: ignore[no-untyped-def]
    obj = copy.deepcopy(BASE)
    obj.update(changes)
    return RuleSet.from_dict(obj)


def call(cmd: str, result: str | None = "ok", cid: str = "c") -> ToolCall:
    return ToolCall(cid, "shell", f'{{"cmd": "{cmd}"}}', result)


def test_default_rules_load():
    rs = load_rules(DEFAULT_RULES)
    assert rs.beta == 0.5 and rs.version == "rules-2"


def test_forbidden_command_and_its_compliance_bonus():
    rs, h = rules(), PathHistory()
    r = rs.evaluate(0, [call("ls")], h)  # not forbidden, but not an alternative either
    assert (r.phi, r.compliance_bonus, r.rule_ids) == (0.0, 0.0, [])
    r = rs.evaluate(1, [call("ls"), call("rm -rf / ")], h)
    assert (r.phi, r.compliance_bonus) == (-0.3, 0.0)
    assert r.hits == [{"rule_id": "bad", "detail": "rm -rf / "}]
    lease = call("git push --force-with-lease origin main")
    r = rs.evaluate(2, [lease], h)  # the compliant alternative to --force: +mu
    assert (r.phi, r.compliance_bonus, r.rule_ids) == (0.02, 0.02, ["bad"])
    assert rs.evaluate(3, [lease], h).phi == 0.0  # the same call again: credited once
    assert rs.evaluate(4, [call("git push --force origin main")], h).phi == -0.3
    assert rs.evaluate(5, [], h).phi == 0.0  # no action, no verdict: never punish inaction


def test_identical_failing_calls_beyond_n():
    rs, h = rules(), PathHistory()
    fail = call("make", "Error 2")
    assert rs.evaluate(0, [fail], h).phi == 0.0  # 1st failure
    assert rs.evaluate(1, [fail], h).phi == 0.0  # 2nd: N = 2 allowed
    third = rs.evaluate(2, [fail], h)  # 3rd identical failing call: -lambda
    assert third.phi == pytest.approx(-0.2)
    assert third.hits[0] == {"rule_id": "rep", "detail": 'shell:{"cmd":"make"} failed 3 times'}
    # A different goal that succeeds after the failure is no recovery; a retry of the same
    # goal (same program and first argument) that succeeds is: +0.05, once per goal.
    assert rs.evaluate(3, [call("make clean")], h).phi == 0.0
    fixed = rs.evaluate(4, [call("make -j1")], h)
    assert fixed.phi == pytest.approx(0.05) and fixed.compliance_bonus == pytest.approx(0.05)
    assert rs.evaluate(5, [call("make", "error")], h).phi == pytest.approx(-0.2)  # 4th identical
    assert rs.evaluate(6, [call("make")], h).phi == 0.0  # that goal was already paid
    assert ToolCall("a", "f", '{"x": 1, "y": 2}').key == ToolCall("b", "f", '{"y": 2, "x": 1}').key


def test_bonuses_on_a_session_with_a_failure_a_recovery_and_unrelated_calls():
    rs, h = rules(), PathHistory()
    phis = [
        rs.evaluate(0, [call("ls"), call("cat a.py")], h).phi,  # unrelated: 0
        rs.evaluate(1, [call("pytest", "Error: 1 failed")], h).phi,  # a failure: 0 (1st)
        rs.evaluate(2, [call("vim a.py")], h).phi,  # another goal: 0
        rs.evaluate(3, [call("pytest -x")], h).phi,  # the same goal, now ok: +0.05
        rs.evaluate(4, [call("ls")], h).phi,  # unrelated, after the recovery: 0
        # failure and recovery within one turn: +0.05; the unrelated call after it: nothing
        rs.evaluate(5, [call("make", "error"), call("make -j1"), call("touch x")], h).phi,
        rs.evaluate(6, [call("make -j1", "error"), call("make -j1", "error")], h).phi,  # 0
        rs.evaluate(7, [call("make -j2")], h).phi,  # make was recovered once already: 0
    ]
    assert phis == pytest.approx([0.0, 0.0, 0.0, 0.05, 0.0, 0.05, 0.0, 0.0])
    assert h.failed_goals == []


def test_recovery_bonus_cannot_be_farmed_with_a_failing_call_then_true():
    """Audit repro: every turn holds a deliberately failing call followed by `true`; before,
    each turn earned +0.05 (the first failure of each new call is never penalised)."""
    rs, h = rules(failure_patterns=["(?i)error", "(?i)command not found"]), PathHistory()
    phis = [
        rs.evaluate(t, [call(f"nosuchcmd{t}", "sh: nosuchcmd: command not found"),
                        call("true", "")], h).phi
        for t in range(6)
    ]
    assert phis == [0.0] * 6


def test_no_bonus_for_read_only_commands():
    rs, h = RuleSet.from_dict({**copy.deepcopy(BASE), "rules": [
        {**BASE["rules"][0]},
        {"id": "bad", "kind": "forbidden_pattern", "patterns": ["git reset --hard"],
         "alternatives": ["git\\s+stash(\\s|$)"], "penalty": 0.3, "compliance": 0.02},
    ]}), PathHistory()
    # Audit repro: read-only `git stash list -n k` variants paid +0.02 per turn.
    assert [rs.evaluate(t, [call(f"git stash list -n {t}")], h).phi for t in range(4)] == [0.0] * 4
    assert rs.is_read_only("git stash list -n 3") and rs.is_read_only("ls -la | grep x && pwd")
    assert not rs.is_read_only("echo x > file") and not rs.is_read_only("ls && rm -rf build")
    # the real alternative pays once, and its variants do not pay again
    assert rs.evaluate(5, [call("git stash")], h).phi == pytest.approx(0.02)
    assert rs.evaluate(6, [call("git stash push -m wip")], h).phi == 0.0
    # a read-only goal that fails and then succeeds is no recovery either
    assert rs.evaluate(7, [call("cat a.txt", "error: no such file")], h).phi == 0.0
    assert rs.evaluate(8, [call("cat a.txt", "hello")], h).phi == 0.0


def test_recovery_needs_a_verified_result():
    """Audit repro: failing pytest on turn 0, then `rm -f build.log` on the closing turn, which
    is scored with no result: +0.05 "recovered". No result is not a success."""
    rs, h = rules(), PathHistory()
    assert rs.evaluate(0, [call("pytest", "Error: 2 failed")], h).phi == 0.0
    assert rs.evaluate(1, [call("rm -f build.log", None)], h).phi == 0.0
    assert rs.evaluate(2, [call("pytest", None)], h).phi == 0.0  # the same goal, unverified
    assert h.failed_goals == ["shell:pytest"]
    assert rs.evaluate(3, [call("pytest", "5 passed")], h).phi == pytest.approx(0.05)


def test_goal_of_a_call():
    from pipeline.processors.penalties import goal_of

    assert goal_of(call("pytest -x")) == goal_of(call("pytest")) == "shell:pytest"
    assert goal_of(call("/usr/bin/make -j2 all")) == "shell:make all"
    assert goal_of(call("CI=1 npm test")) == "shell:npm test"
    assert goal_of(call("nosuchcmd")) != goal_of(call("true"))
    assert goal_of(call("cd app && pytest -q && git push")) == "shell:pytest"
    other = ToolCall("c", "edit", '{"path": "a.py"}', "ok")
    assert goal_of(other) == other.key


def test_required_step_within_a_window():
    rs, h = rules(), PathHistory()
    skipped = rs.evaluate(0, [call("git commit -m x")], h)
    assert skipped.phi == pytest.approx(-0.2)
    rs.evaluate(1, [call("pytest -q")], h)
    done = rs.evaluate(2, [call("git commit -m y")], h)
    assert done.phi == pytest.approx(0.05)
    again = rs.evaluate(3, [call("git commit -m y2")], h)  # the same test run: no 2nd bonus
    assert again.phi == 0.0
    stale = rs.evaluate(5, [call("git commit -m z")], h)  # pytest was 4 turns ago > 2
    assert stale.phi == pytest.approx(-0.2)
    same_turn = rs.evaluate(9, [call("pytest"), call("git commit")], PathHistory())
    assert same_turn.phi == pytest.approx(0.05)


def test_history_round_trips_as_json():
    rs, h = rules(), PathHistory()
    rs.evaluate(0, [call("make", "error")], h)
    assert PathHistory.from_json(h.to_json()) == h
    assert h.failed_goals == ["shell:make"]
    # state written before the recovery/credit fields existed
    assert PathHistory.from_json({"failures": {}, "commands": []}) == PathHistory()


def test_inaction_trap_is_rejected_with_an_explanation():
    with pytest.raises(RuleConfigError, match="inaction trap") as err:
        rules(beta=1.5)  # 1.5 * (0.2 + 0.3 + 0.2) = 1.05 >= 0.5 * 1.0
    assert "doing nothing" in str(err.value)
    assert "1.05" in str(err.value)
    rules(beta=0.7)  # 0.49 < 0.5: accepted


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

NOOP_RULE = {"id": "noop", "kind": "repeated_noop_action", "max_repeats": 1, "penalty": 0.1,
             "compliance": 0.02}


def test_a_repeated_noop_action_is_penalised_once_per_turn_and_recovery_pays_once() -> None:
    rs = rules(rules=[*BASE["rules"], NOOP_RULE])  # type: ignore[list-item]
    h = PathHistory()
    click = "click:save:"
    steps = [  # (turn, action, no_op) -> (phi, bonus, rule ids): by hand, N = 1 allowed
        ((0, click, None), (0.0, 0.0, [])),  # first screen: nothing known
        ((0, click, True), (0.0, 0.0, [])),  # 1st no-op: allowed
        ((1, click, True), (-0.1, 0.0, ["noop"])),  # 2nd in a row: -lambda
        ((1, click, True), (0.0, 0.0, [])),  # 3rd, same turn: once per turn
        ((2, click, True), (-0.1, 0.0, ["noop"])),  # 4th, next turn: again
        ((2, "type:name:bob", False), (0.02, 0.02, ["noop"])),  # the screen changed: +mu
        ((3, click, True), (0.0, 0.0, [])),  # a new run starts at 1
        ((3, click, True), (-0.1, 0.0, ["noop"])),
        ((4, "key:Enter:", False), (0.0, 0.0, [])),  # recovery from click:save: paid already
    ]
    got = []
    for (turn, key, no_op), _ in steps:
        r = rs.evaluate_gui(turn, key, no_op, h)
        got.append((r.phi, r.compliance_bonus, r.rule_ids))
    assert got == [want for _, want in steps]
    assert h.noops == []
    assert PathHistory.from_json(h.to_json()) == h


def test_noops_on_different_targets_are_no_run() -> None:
    rs = rules(rules=[NOOP_RULE])
    h = PathHistory()
    phis = [rs.evaluate_gui(0, k, True, h).phi for k in ("click:a:", "click:b:", "click:a:")]
    assert phis == [0.0, 0.0, 0.0] and h.noops == ["click:a:", 1]
    r = rs.evaluate_gui(0, "click:a:", True, h)
    assert (r.phi, r.hits) == (-0.1, [{"rule_id": "noop",
                                       "detail": "click:a: changed nothing 2 times"}])


def test_tool_calls_never_fire_the_noop_rule_and_old_histories_load() -> None:
    rs = rules(rules=[NOOP_RULE])
    assert rs.evaluate(0, [call("ls", "ok"), call("ls", "ok")], PathHistory()).hits == []
    old = {"failures": {}, "commands": [], "failed_goals": [], "credited": []}
    assert PathHistory.from_json(old).noops == []
    with pytest.raises(RuleConfigError, match="max_repeats"):
        rules(rules=[{**NOOP_RULE, "max_repeats": 0}])
    with pytest.raises(RuleConfigError, match="compliance"):
        rules(rules=[{**NOOP_RULE, "compliance": 0.0}])
