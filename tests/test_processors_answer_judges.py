"""The answer-reading judges: each rule by a hand-picked answer."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.events import NextState, Producer
from pipeline.processors.answer_judges import content_words
from pipeline.processors.judges import TurnContext, make_judge

STATE = NextState(
    event_id="n",
    producer=Producer(component="t", version="1"),
    session_id="s",
    turn=0,
    kind="test_result",
    content="passed",
    source="record-outcome",
    exit_code=0,
)


def vote(judge: str, request: str, answer: str) -> tuple[int, str]:
    v = asyncio.run(make_judge(judge).judge(TurnContext("s", 0, request, answer), STATE))
    return v.score, v.rationale


def test_content_words_drop_short_and_stop_words_and_keep_order() -> None:
    assert content_words("Please explain how I should fix the flaky Login test?") == [
        "flaky",
        "login",
        "test",
    ]
    assert content_words("Why? Is it so?") == []


@pytest.mark.parametrize(
    ("answer", "score", "why"),
    [
        ("Restart the router, then renew the lease.", 1, "well-formed"),
        ("", -1, "empty"),
        ("ok", -1, "too short"),
        ("no no no no no no no no", -1, "repeated tokens"),
        ("How do I reset my router?", -1, "repeats the request"),
        ("As an AI language model, I cannot browse.", -1, "a refusal"),
    ],
)
def test_answer_judge(answer: str, score: int, why: str) -> None:
    got, rationale = vote("answer", "How do I reset my router?", answer)
    assert got == score and why in rationale


@pytest.mark.parametrize(
    ("answer", "score", "why"),
    [
        ("按住路由器的重置按钮十秒钟。", 1, "well-formed"),  # no Latin words to count: not "short"
        ("如何重置路由器？", -1, "repeats the request"),
        ("哈哈哈哈哈哈哈哈哈哈哈哈", -1, "repeated characters"),
    ],
)
def test_answer_judge_reads_a_script_without_latin_words(answer: str, score: int, why: str) -> None:
    got, rationale = vote("answer", "如何重置路由器？", answer)
    assert got == score and why in rationale


@pytest.mark.parametrize(
    ("request_", "answer", "score", "why"),
    [
        (
            "How do I reset my router?",
            "Hold the router's reset button for ten seconds.",
            1,
            "on topic (reset, router)",
        ),
        ("How do I reset my router?", "Paris is the capital of France.", -1, "mentions none of"),
        ("How do I reset my router?", "Reset router.", -1, "adds nothing"),
        ("How do I reset my router?", "router router router router", -1, "degenerate"),
        ("Why? Is it so?", "Because.", 1, "no content words"),
    ],
)
def test_on_topic_judge(request_: str, answer: str, score: int, why: str) -> None:
    got, rationale = vote("on_topic", request_, answer)
    assert got == score and why in rationale
