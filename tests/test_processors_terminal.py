"""The terminal adapter: hand-written tool messages -> exit code and output tails."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline.events import examples
from pipeline.processors.config import DEFAULT_RULES
from pipeline.processors.pairing import Pairer
from pipeline.processors.penalties import load_rules
from pipeline.processors.terminal import (
    TerminalResult,
    combined_exit_code,
    parse_content,
    parse_tool_message,
    tail,
)


def tool(content: object) -> dict:
    return {"role": "tool", "tool_call_id": "c1", "content": content}


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            json.dumps({"exit_code": 1, "stdout": "collected 3\n", "stderr": "E assert"}),
            TerminalResult(1, "collected 3\n", "E assert"),
        ),
        ('{"exitCode": 0, "stdout": "ok"}', TerminalResult(0, "ok", "")),
        ('{"returncode": "2", "stderr": "boom"}', TerminalResult(2, "", "boom")),
        (
            '{"output": "FAILED t.py::x", "metadata": {"exit_code": 1, "duration_seconds": 0.4}}',
            TerminalResult(1, "FAILED t.py::x", ""),
        ),
        ({"exit_code": 0, "stdout": "dict content"}, TerminalResult(0, "dict content", "")),
        ("all good\n[exit 0]", TerminalResult(0, "all good", "")),
        ("Traceback\nValueError\n[exit code: 3]", TerminalResult(3, "Traceback\nValueError")),
        ("make: *** Error 2\nProcess exited with code 2", TerminalResult(2, "make: *** Error 2")),
        ("exit status 127", TerminalResult(127, "", "")),
        ([{"type": "text", "text": "done\n[exit 0]"}], TerminalResult(0, "done", "")),
    ],
)
def test_shell_results_are_read(content: object, expected: TerminalResult) -> None:
    assert parse_tool_message(tool(content)) == expected


def test_codex_text_format_keeps_the_output_without_the_code_line() -> None:
    got = parse_content("Exit code: 1\nWall time: 0.2 seconds\nOutput:\nboom")
    assert got == TerminalResult(1, "Wall time: 0.2 seconds\nOutput:\nboom", "")


@pytest.mark.parametrize(
    "content",
    [
        "ImportError: cannot import\n1 failed",  # a number, not an exit code
        "the exit code 1 means failure",  # prose mentioning an exit code
        '{"status": 1, "stdout": "x"}',  # no exit-code key
        '{"exit_code": true}',  # a bool is not a code
        '{"exit_code": 99999999999999999999}',  # beyond any real exit code
        "Exit code: 99999999999999999999",
        "{not json, and no code line",
        None,
        "",
    ],
)
def test_other_tool_output_is_not_terminal(content: object) -> None:
    assert parse_tool_message(tool(content)) is None


def test_only_tool_messages_are_read() -> None:
    assert parse_tool_message({"role": "user", "content": "[exit 1]"}) is None
    assert parse_tool_message({"role": "function", "content": "[exit 1]"}) == TerminalResult(1)


def test_tails_are_bounded_to_the_end() -> None:
    out = "x" * 5000 + "END"
    got = parse_tool_message(tool(json.dumps({"exit_code": 1, "stdout": out, "stderr": out})))
    assert got is not None
    assert len(got.stdout_tail) == 2000 and got.stdout_tail.endswith("END")
    assert got.stdout_tail.startswith("…")
    assert len(got.stderr_tail) == 2000
    assert tail("short") == "short"
    assert len(parse_content("y" * 9000 + "\n[exit 4]", limit=100).stdout_tail) == 100  # type: ignore[union-attr]


def test_last_code_wins_and_the_first_failure_names_a_turn() -> None:
    assert parse_content("[exit 1]\nretrying\n[exit 0]") == TerminalResult(0, "[exit 1]\nretrying")
    results = [TerminalResult(0), TerminalResult(2), TerminalResult(1)]
    assert combined_exit_code(results) == 2
    assert combined_exit_code([TerminalResult(0)]) == 0
    assert combined_exit_code([]) is None


def _turn(t: int, messages: list[dict]):  # type: ignore[no-untyped-def]
    base = examples.interaction(prompt_tokens=4, response_tokens=2)
    return dataclasses.replace(
        base, event_id=f"i{t}", session_id="s", turn=t, messages=messages, tool_calls=[]
    )


def test_pairing_turns_shell_results_into_a_terminal_next_state() -> None:
    sys_msg, user = {"role": "system", "content": "sys"}, {"role": "user", "content": "test it"}
    p = Pairer(load_rules(DEFAULT_RULES), "pairing-1")
    st = p.on_interaction(None, _turn(0, [sys_msg, user])).state
    msgs = [
        sys_msg,
        user,
        {"role": "assistant", "content": None},
        tool({"exit_code": 0, "stdout": "built"}),
        tool('{"exit_code": 1, "stdout": "1 failed", "stderr": "AssertionError"}'),
    ]
    (ns,) = p.on_interaction(st, _turn(1, msgs)).next_states
    assert (ns.kind, ns.exit_code, ns.role, ns.turn) == ("terminal", 1, "tool", 0)
    assert ns.detail["terminal"] == [
        {"exit_code": 0, "stdout_tail": "built", "stderr_tail": ""},
        {"exit_code": 1, "stdout_tail": "1 failed", "stderr_tail": "AssertionError"},
    ]
    assert ns.detail["messages"] == msgs[3:]


def test_pairing_keeps_plain_tool_output_and_user_replies_as_they_were() -> None:
    sys_msg, user = {"role": "system", "content": "sys"}, {"role": "user", "content": "go"}
    p = Pairer(load_rules(DEFAULT_RULES), "pairing-1")
    st = p.on_interaction(None, _turn(0, [sys_msg, user])).state
    plain = [sys_msg, user, {"role": "assistant", "content": None}, tool("1 failed")]
    (ns,) = p.on_interaction(st, _turn(1, plain)).next_states
    assert (ns.kind, ns.exit_code, "terminal" in ns.detail) == ("tool_result", None, False)
    st = p.on_interaction(None, _turn(0, [sys_msg, user])).state
    reply = [
        sys_msg,
        user,
        {"role": "assistant", "content": "x"},
        tool("[exit 1]"),
        {"role": "user", "content": "thanks"},
    ]
    (ns,) = p.on_interaction(st, _turn(1, reply)).next_states
    assert (ns.kind, ns.exit_code) == ("user_reply", None)  # the user's word is the evidence


def _shell(call_id: str, cmd: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "shell", "arguments": json.dumps({"cmd": cmd})},
    }


def _terminal_after(calls: list[tuple[str, str, int]]):  # type: ignore[no-untyped-def]
    """Turn 0 runs ``calls`` (id, command, exit code); turn 1 hands back their results: turn
    0's next state."""
    sys_msg, user = {"role": "system", "content": "sys"}, {"role": "user", "content": "fix it"}
    p = Pairer(load_rules(DEFAULT_RULES), "pairing-1")
    t0 = dataclasses.replace(
        _turn(0, [sys_msg, user]), tool_calls=[_shell(i, c) for i, c, _ in calls]
    )
    st = p.on_interaction(None, t0).state
    msgs = [
        sys_msg,
        user,
        {"role": "assistant", "content": None},
        *(
            {"role": "tool", "tool_call_id": i, "content": {"exit_code": code, "stdout": "x"}}
            for i, _, code in calls
        ),
    ]
    (ns,) = p.on_interaction(st, _turn(1, msgs)).next_states
    return ns


def test_a_read_only_command_is_no_outcome() -> None:
    """Issue 38: `ls` (or `git status`, `cat`, `echo`...) exiting 0 verified the turn: judges
    +1 on 7ed65b3. It changes nothing, so its exit code says nothing about the task."""
    from pipeline.processors.consistency import outcome_vote
    from pipeline.processors.judges import RuleJudge

    ns = _terminal_after([("c1", "ls -la", 0), ("c2", "git status && cat README.md", 0)])
    assert (ns.kind, ns.exit_code) == ("terminal", None)
    assert [(e["command"], e.get("no_outcome")) for e in ns.detail["terminal"]] == [
        ("ls -la", True),
        ("git status && cat README.md", True),
    ]
    assert RuleJudge().verdict(ns).score == 0 and outcome_vote(ns) is None
    # beside a command that does something, that one decides; a grep finding nothing (1) is
    # not a failure either
    ns = _terminal_after([("c1", "grep -rn TODO .", 1), ("c2", "pytest -q", 0)])
    assert (ns.exit_code, RuleJudge().verdict(ns).score) == (0, 1)
    ns = _terminal_after([("c1", "ls", 0), ("c2", "pytest -q", 1)])
    assert (ns.exit_code, RuleJudge().verdict(ns).score) == (1, -1)
    # a read-only-looking line that writes a file is not read-only
    assert _terminal_after([("c1", "echo x > out.txt", 0)]).exit_code == 0


def test_timeouts_and_missing_commands_are_no_outcome() -> None:
    """Issue 38: exit 124 (timed out), 126 (not executable), 127 (not found) are no outcome,
    not the agent's failure: on 7ed65b3 they were the turn's failing code."""
    assert combined_exit_code([TerminalResult(127), TerminalResult(0)]) == 0
    assert combined_exit_code([TerminalResult(124), TerminalResult(126)]) is None
    ns = _terminal_after([("c1", "pytest -q", 124)])
    assert (ns.kind, ns.exit_code, ns.detail["terminal"][0]["no_outcome"]) == (
        "terminal",
        None,
        True,
    )
