"""The quality guard against reward hacking: the pilot's degenerate answers fail, good ones pass."""

from __future__ import annotations

import pytest

from pipeline.sim import QUESTIONS, Question, check_quality, mentions
from pipeline.sim.quality import (
    ECHOES_HINT,
    ECHOES_QUESTION,
    EMPTY,
    NON_LETTERS,
    OFF_TOPIC,
    REPEATED_CHARS,
    REPEATED_SENTENCE,
    REPEATED_TOKENS,
    REPEATS_EARLIER,
    TOO_SHORT,
)

SLEEP = Question("Give me a tip for sleeping better.", ("sleep", "bed", "bedtime", "night", "rest"))
TEA = Question("How do I make a cup of tea?", ("tea", "water", "boil", "kettle", "cup"))
STOCK = "You are a helpful AI, trained by Hugging Face"


def test_the_same_stock_answer_to_different_questions_fails() -> None:
    first = check_quality(SLEEP, STOCK, [])
    assert not first.ok and first.reasons == [OFF_TOPIC]
    second = check_quality(TEA, STOCK, [STOCK])
    assert not second.ok and REPEATS_EARLIER in second.reasons
    # near-identical (case, punctuation, one word changed) still counts as a repeat
    near = check_quality(TEA, "you are a helpful AI trained by Hugging Face!!", [STOCK])
    assert REPEATS_EARLIER in near.reasons
    every = [check_quality(q, STOCK, [STOCK] * i) for i, q in enumerate(QUESTIONS)]
    assert not any(result.ok for result in every)


def test_on_topic_repeat_of_another_questions_answer_fails() -> None:
    answer = "Boil water, put the tea bag in a cup and wait three minutes before bed."
    assert check_quality(TEA, answer, []).ok
    assert check_quality(SLEEP, answer, [answer]).reasons == [REPEATS_EARLIER]


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("1.1.1.1.1.1", NON_LETTERS),
        ("1.1.1.1.1.1", REPEATED_CHARS),
        ("1.1.1.1.1.1.1.1.1.1.1.1.1.1.1.1.1.1.1.1.1.1.1.1", REPEATED_CHARS),
        ("You can't. You can't. You can't.", REPEATED_SENTENCE),
        ("You can't. You can't.", REPEATED_SENTENCE),
        ("You can't. You can't. You can't.", REPEATED_TOKENS),
        ("sleep sleep sleep sleep sleep sleep", REPEATED_TOKENS),
        ("bed bed bed bed bed bed bed bed bed bed bed bed night", REPEATED_TOKENS),
        ("Sleep well at night and sleep well at night and sleep well at night", REPEATED_TOKENS),
        ("hahahahahahaha at night", REPEATED_CHARS),
        ("Sleep.", TOO_SHORT),
        ("", EMPTY),
        ("   \n ", EMPTY),
        ("!!! ??? ... --- bed", NON_LETTERS),
    ],
)
def test_degenerate_answers_fail(answer: str, reason: str) -> None:
    quality = check_quality(SLEEP, answer, [])
    assert not quality.ok
    assert reason in quality.reasons, quality.reasons
    assert quality.degenerate


@pytest.mark.parametrize(
    "answer",
    [
        "Go to bed at the same time every night.",
        "Keep your bedroom cool, dark and quiet, and avoid screens an hour before sleep.",
        "1. Set a bedtime.\n2. Avoid coffee after noon.\n3. Keep the room dark.",
        "- Go to bed early\n- Wake up at the same time",
        "try a warm bath before bed; it helps you relax and fall asleep faster.",
        "Avoid caffeine after 2 p.m., e.g. coffee or cola, and rest well at night.",
        "Sleeping 7-8 hours a night is ideal for most adults.",
    ],
)
def test_good_answers_pass(answer: str) -> None:
    quality = check_quality(SLEEP, answer, [STOCK, "Boil water and steep the tea."])
    assert quality.ok, quality.reasons
    assert quality.reasons == []


def test_echoing_the_question_fails() -> None:
    for echo in (SLEEP.text, "Give me a tip for sleeping better!", "a tip for sleeping better."):
        quality = check_quality(SLEEP, echo, [])
        assert ECHOES_QUESTION in quality.reasons, (echo, quality.reasons)
    assert check_quality(SLEEP, "A tip for sleeping better: go to bed early.", []).ok


def test_parroting_the_hint_fails() -> None:
    hint = "Use plain, simple words."
    parrot = "To wake up earlier at night, you can use plain, simple words."
    assert check_quality(SLEEP, parrot, []).ok, "without the hint nothing to compare"
    assert check_quality(SLEEP, parrot, [], hint=hint).reasons == [ECHOES_HINT]
    fine = "Use simple habits: go to bed at the same time every night."
    assert check_quality(SLEEP, fine, [], hint=hint).ok


def test_off_topic() -> None:
    assert check_quality(SLEEP, "Paris is the capital of France.", []).reasons == [OFF_TOPIC]
    assert check_quality(TEA, "Paris is the capital of France.", []).reasons == [OFF_TOPIC]


def test_mentions_matches_inflections_not_other_words() -> None:
    assert mentions("I was sleeping", ("sleep",))
    assert mentions("Two beds", ("bed",))
    assert not mentions("Catch it", ("cat",))
    assert mentions("Restful nights", ("rest",))
    assert mentions("Restless nights", ("rest",))
    assert not mentions("Go to a restaurant", ("rest",))
    assert not mentions("Embedded systems", ("bed",))
    assert mentions("Use eye contact", ("eye contact",))


def test_questions_have_keywords_that_a_stock_answer_lacks() -> None:
    texts = {q.text for q in QUESTIONS}
    assert len(QUESTIONS) >= 60 and len(texts) == len(QUESTIONS)
    for q in QUESTIONS:
        assert q.keywords and all(k == k.lower() for k in q.keywords), q
        assert not mentions(STOCK, q.keywords), q
        assert not mentions("I'm sorry, I can't answer that.", q.keywords), q
