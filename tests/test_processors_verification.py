"""What an outcome says (processors/verification.py): no-outcome exit codes, read-only
commands, and all-must-pass across a session's checks."""

from __future__ import annotations

from pipeline.processors import verification as V
from pipeline.processors.outcomes import GateResult, gate_event, outcome_event
from pipeline.processors.rewards import Assembler, Outcome

from .test_processors_rewards import feed


def test_exit_votes_and_read_only_commands() -> None:
    assert [V.exit_vote(c) for c in (0, 1, 2, 124, 126, 127, 137)] == [
        1,
        -1,
        -1,
        None,
        None,
        None,
        -1,
    ]  # 137 (SIGKILL, e.g. OOM) is the command's failure
    for cmd in ("ls", "cat a | grep b", "git status", "git diff --stat", "pwd; echo hi"):
        assert V.is_read_only(cmd) and V.exit_vote(0, cmd) is None and V.exit_vote(1, cmd) is None
    for cmd in ("pytest -q", "echo x > f", "git commit -m x", "ls && make", "rm -rf build"):
        assert not V.is_read_only(cmd)
    assert V.exit_vote(0, "pytest -q") == 1
    assert [V.combine_signs(s) for s in ([1, 1], [1, -1], [1, None], [None, -1], [])] == [
        1,
        -1,
        None,
        -1,
        None,
    ]


def test_all_must_pass_over_the_latest_result_of_each_check() -> None:
    """pytest fails (t=1), lint passes (t=2): failed, where the last recorded outcome read +1.
    pytest passes after a fix (t=3): its later result replaces its failure, all pass."""

    def recorded(cmd: str, passed: bool, ts: int) -> tuple[str, Outcome]:
        ev = gate_event("s", cmd.split(), GateResult(0 if passed else 1, "", "", False, 0.1))
        ev.ts_ms = ts
        value = V.outcome_value(ev)
        assert value is not None
        return V.outcome_key(ev), Outcome(ev.event_id, ts, value)

    checks: dict[str, Outcome] = {}
    for key, entry in (recorded("pytest -q", False, 1), recorded("ruff check .", True, 2)):
        V.keep_latest(checks, key, entry)
    combined = V.all_must_pass(checks.values())
    assert combined is not None and combined.value == -1.0 and combined.ts_ms == 1
    V.keep_latest(checks, *recorded("pytest -q", True, 3))
    combined = V.all_must_pass(checks.values())
    assert combined is not None and (combined.value, len(checks)) == (1.0, 2)
    # a person's verdict is a check of its own, replaced by the same source's later one
    said = outcome_event("s", False, source="ci", ts_ms=4)
    assert V.outcome_key(said) == "said:ci" and V.outcome_value(said) == -1.0
    # no outcome is not recorded at all
    lost = gate_event("s", ["pytest"], GateResult(127, "", "", False, 0.0))
    assert V.outcome_value(lost) is None


def test_a_failing_gate_then_a_passing_one_fails_the_session() -> None:
    """Issue 38, as recorded by two `liverl record-outcome -- CMD` calls: the later passing
    lint set the session's outcome to +1 on 7ed65b3."""
    asm = Assembler()
    state = feed(asm, [(1, [1], 0.0)])
    for ts, (cmd, code) in enumerate([("pytest -q", 1), ("ruff check .", 0)], start=1):
        ev = gate_event("s", cmd.split(), GateResult(code, "", "", False, 0.1))
        ev.ts_ms = ts
        state = asm.on_next_state(state, ev, ts)
    (reward,) = asm.complete(state, 10).rewards
    assert reward.outcome == -1.0


def test_a_gate_that_was_not_found_is_no_session_outcome() -> None:
    asm = Assembler()
    state = feed(asm, [(1, [1], 0.0)])
    ev = gate_event("s", ["pytest"], GateResult(127, "", "", False, 0.0))
    state = asm.on_next_state(state, ev, 1)
    (reward,) = asm.complete(state, 10).rewards
    assert (state.outcome, reward.outcome) == (None, 0.0)


def test_a_session_combines_at_most_a_bounded_number_of_checks() -> None:
    """A client names its check (the source of a posted outcome): a session keeps the results
    of at most MAX_OUTCOME_CHECKS distinct checks, so posting many sources cannot grow its
    state; a check it already holds is still updated."""
    from pipeline.processors.rewards import MAX_OUTCOME_CHECKS

    asm = Assembler()
    state = feed(asm, [(1, [1], 0.0)])
    for ts in range(1, MAX_OUTCOME_CHECKS + 6):
        ev = gate_event("s", ["check", str(ts)], GateResult(0, "", "", False, 0.1))
        ev.ts_ms = ts
        state = asm.on_next_state(state, ev, ts)
    assert len(state.outcomes) == MAX_OUTCOME_CHECKS
    ev = gate_event("s", ["check", "1"], GateResult(1, "", "", False, 0.1))
    ev.ts_ms = 100
    state = asm.on_next_state(state, ev, 100)
    (reward,) = asm.complete(state, 200).rewards
    assert reward.outcome == -1.0  # the held check's later failure fails the session
