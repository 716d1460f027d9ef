"""The flawed judges: their votes by hand, and their place in a panel beside a sound judge."""

from __future__ import annotations

import asyncio

import pytest

import pipeline.sim.flawed_judges  # noqa: F401  (registers verbose and agreeable)
from pipeline.events import NextState, Producer
from pipeline.processors.judges import TurnContext, make_judge

SHORT = "Paris."
LONG = " ".join(["word"] * 26)


def _state(text: str) -> NextState:
    return NextState(
        event_id="e",
        session_id="s",
        turn=0,
        ts_ms=0,
        parents=[],
        kind="user_reply",
        role="user",
        content=text,
        source="pairing",
        producer=Producer(component="test", version="0"),
    )


def _judge(name: str, answer: str, reply: str, **options: object) -> tuple[int, list]:
    judge = make_judge(name, options)
    v = asyncio.run(judge.judge(TurnContext("s", 0, "Capital of France?", answer), _state(reply)))
    return v.score, v.votes


def test_verbose_votes_on_length_alone() -> None:
    assert _judge("verbose", LONG, "Too long, one sentence please.") == (1, [1])
    assert _judge("verbose", SHORT, "Thanks, perfect!") == (-1, [-1])
    assert _judge("verbose", " ".join(["w"] * 25), "ok") == (-1, [-1])  # concise ends at 25
    assert _judge("verbose", SHORT, "ok", min_words=1) == (1, [1])
    assert make_judge("verbose", {"min_words": 3}).version == "verbose-1/3"
    with pytest.raises(ValueError, match="min_words"):
        make_judge("verbose", {"min_words": 0})


def test_agreeable_approves_of_everything() -> None:
    assert _judge("agreeable", LONG, "That is wrong and far too long.") == (1, [1])
    assert _judge("agreeable", SHORT, "Thanks!") == (1, [1])


def test_an_equal_panel_follows_the_flawed_pair_and_a_weighted_one_the_sound_judge() -> None:
    # A long answer the user rejects: replies -1, verbose +1, agreeable +1.
    members = ["replies", "verbose", "agreeable"]
    reply = "No, that is far too long. Answer in one short sentence."
    assert _judge("replies", LONG, reply)[0] == -1
    assert _judge("panel", LONG, reply, judges=members) == (1, [-1, 1, 1])
    # Consistencies 0.95 / 0.2 / 0.4: 0.95 against 0.6, the sound judge decides.
    weights = {"replies": 0.95, "verbose": 0.2, "agreeable": 0.4}
    assert _judge("panel", LONG, reply, judges=members, weights=weights) == (-1, [-1, 1, 1])
