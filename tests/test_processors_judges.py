"""Vote parsing, plurality, hint filtering and the rule verifier."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pipeline import events
from pipeline.events import examples
from pipeline.processors.judges import (
    JUDGES,
    ReplyJudge,
    RuleJudge,
    make_judge,
    parse_vote,
    plurality,
    select_hints,
)


@pytest.mark.parametrize(
    ("votes", "expected"),
    [
        ([1, 1, -1], 1),
        ([-1, -1, 1], -1),
        ([1, -1, 0], 0),  # three-way tie
        ([1, -1, None], 0),  # tie among valid votes
        ([None, None, None], 0),  # no valid vote
        ([1, None, None], 1),
        ([0, 0, 1], 0),
        ([1, 1, -1, -1, 0], 0),
    ],
)
def test_plurality(votes, expected):
    assert plurality(votes) == expected


@pytest.mark.parametrize(
    ("text", "vote"),
    [
        ("good answer \\boxed{1}", 1),
        ("\\boxed{-1}", -1),
        ("\\boxed{ 0 }", 0),
        ("first \\boxed{1} then revised \\boxed{-1}", -1),
        ("\\boxed{2}", None),
        ("boxed 1", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_vote(text, vote):
    assert parse_vote(text) == vote


def test_hints_longer_than_ten_deduplicated_shortest_first_at_most_three():
    texts = [
        "[HINT_START]Run the full test suite first.[HINT_END] \\boxed{1}",
        "[HINT_START]too short[HINT_END]",  # 9 chars: dropped
        "[HINT_START]0123456789[HINT_END]",  # exactly 10: dropped
        "[HINT_START]01234567890[HINT_END]",  # 11: kept
        "[HINT_START]  Run the full   test suite first. [HINT_END]",  # duplicate after trim
        "[HINT_START]Update every importer found by grep.[HINT_END]",
        "[HINT_START]Check tests/ for other importers too, not only app/.[HINT_END]",
        None,
        "no markers here",
    ]
    assert select_hints(texts) == [
        "01234567890",
        "Run the full test suite first.",
        "Update every importer found by grep.",
    ]


def ns(**kw):  # type: ignore[no-untyped-def]
    return dataclasses.replace(examples.examples()["next_state"], **kw)


@pytest.mark.parametrize(
    ("kw", "score"),
    [
        ({"exit_code": 0, "kind": "terminal"}, 1),
        ({"exit_code": 2, "kind": "test_result"}, -1),
        ({"score": 0.5, "kind": "feedback"}, 1),
        ({"score": -3.0, "exit_code": 0}, -1),  # explicit score wins over exit code
        ({"content": "Thanks, but the tests still fail"}, -1),  # correction beats thanks
        ({"content": "Perfect, thank you!"}, 1),
        ({"content": "What about the docs?"}, 0),
        ({"content": "error: thanks", "kind": "tool_result"}, 0),  # tool output is not a reply
        ({"content": "", "kind": "session_end"}, 0),
    ],
)
def test_rule_judge(kw, score):
    v = asyncio.run(RuleJudge().judge(None, ns(**kw)))  # type: ignore[arg-type]
    assert (v.score, v.votes) == (score, [score])


@pytest.mark.parametrize(
    ("kw", "score"),
    [
        ({"exit_code": 0, "kind": "terminal"}, 1),
        ({"exit_code": 2, "kind": "test_result"}, -1),
        ({"score": 0.5, "kind": "feedback"}, 1),
        ({"score": -3.0, "exit_code": 0}, -1),
        ({"content": "Thanks, but the tests still fail"}, -1),
        ({"content": "Perfect, thank you!"}, 1),
        ({"content": "What about the docs?"}, 0),
        ({"content": "error: thanks", "kind": "tool_result"}, 0),
        ({"content": "", "kind": "session_end"}, 0),
        # Where the phrase lists saw nothing (the replies):
        ({"content": "Great, short and sweet."}, 1),
        ({"content": "Way too much text for me; just one brief sentence, please."}, -1),
    ],
)
def test_reply_judge_keeps_the_rule_judges_verdicts(kw, score):
    """The default judge gives the rule judge's verdicts on its cases, and votes where the
    phrase lists voted 0."""
    v = asyncio.run(ReplyJudge().judge(None, ns(**kw)))  # type: ignore[arg-type]
    assert (v.score, v.votes) == (score, [score])


def test_registry_lists_the_default_and_the_alternatives():
    assert {"replies", "rules", "llm"} <= set(JUDGES.names())


def test_phrase_lists_are_configurable():
    judge = RuleJudge(corrections=["nope"], thanks=["danke"])
    assert judge.verdict(ns(content="Danke!")).score == 1
    assert judge.verdict(ns(content="nope")).score == -1
    assert judge.verdict(ns(content="thanks")).score == 0


def test_unknown_judge_name_is_rejected():
    with pytest.raises(ValueError, match="unknown judge 'nope'"):
        make_judge("nope")


def test_a_crashing_plugin_judge_gives_a_neutral_score_with_the_error():
    from pipeline.processors.judges import TurnContext
    from pipeline.processors.judging import JudgeWork, judge_one

    class Boom:
        judge_id, version = "boom", "b-1"

        async def judge(self, ctx, state):  # type: ignore[no-untyped-def]
            raise RuntimeError("model down")

    state = ns()
    work = JudgeWork(TurnContext("s", 3, "q", "a"), "i3", state)
    out = asyncio.run(judge_one(Boom(), work))  # type: ignore[arg-type]
    assert (out.prm.score, out.prm.votes, out.hints) == (0, [], [])
    assert out.prm.error == "judge raised RuntimeError: model down"
    assert out.prm.parents == ["i3", state.event_id]
    events.encode(out.prm, validate=True)  # schema-valid


@pytest.mark.parametrize(
    ("score", "votes", "bad"),
    [(2, [2], "2"), (1, [1, 5], "5"), (True, [], "True"), (1.0, [], "1.0")],
)
def test_a_plugin_judge_outside_the_vote_range_gives_a_neutral_score_with_the_error(
    score, votes, bad
):
    from pipeline.processors.judges import TurnContext, Verdict
    from pipeline.processors.judging import JudgeWork, judge_one

    class Wild:
        judge_id, version = "wild", "w-1"

        async def judge(self, ctx, state):  # type: ignore[no-untyped-def]
            return Verdict(score, votes, "sure", ["a hint"])

    work = JudgeWork(TurnContext("s", 3, "q", "a"), "i3", ns())
    out = asyncio.run(judge_one(Wild(), work))  # type: ignore[arg-type]
    assert (out.prm.score, out.prm.votes, out.hints) == (0, [], [])
    assert out.prm.error == f"judge returned {bad}, not a vote (-1, 0, 1)"
    events.encode(out.prm, validate=True)  # schema-valid, where a score of 2 was not
