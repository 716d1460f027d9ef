"""The panel judge: members' votes weighted by their measured consistency."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from pipeline.events import NextState, Producer
from pipeline.processors.judge_registry import JUDGES
from pipeline.processors.judges import RuleJudge, TurnContext, Verdict, make_judge
from pipeline.processors.panel_judge import load_consistency

P = Producer(component="test", version="1")
CTX = TurnContext("s", 0, "Explain it.", "It is like this: ...")


def reply(text: str) -> NextState:
    return NextState(
        event_id="n",
        producer=P,
        session_id="s",
        turn=0,
        kind="user_reply",
        role="user",
        content=text,
        source="pairing",
    )


def consistency_file(path: Path, rows: dict[tuple[str, str], float]) -> Path:
    path.write_bytes(
        orjson.dumps(
            {
                "judges": [
                    {"judge_id": j, "judge_version": v, "consistency": c}
                    for (j, v), c in rows.items()
                ]
            }
        )
    )
    return path


# "thanks, but answer in one sentence": the reply judge reads the directive (-1, with a hint),
# the rule judge the thanks (+1): the two members disagree, so the weights decide.
SPLIT = "Thanks, but answer in one sentence."


def test_the_more_consistent_member_decides_a_split_vote(tmp_path: Path) -> None:
    replies = make_judge("replies")
    assert asyncio.run(replies.judge(CTX, reply(SPLIT))).score == -1
    assert asyncio.run(RuleJudge().judge(CTX, reply(SPLIT))).score == 1
    trust_rules = consistency_file(
        tmp_path / "a.json", {("replies", replies.version): 0.3, ("rules", RuleJudge.version): 0.8}
    )
    panel = make_judge(
        "panel", {"judges": ["replies", "rules"], "consistency_file": str(trust_rules)}
    )
    v = asyncio.run(panel.judge(CTX, reply(SPLIT)))
    # log-odds: rules log(0.8 / 0.2) = 1.386, replies 0 (0.3 is worse than a coin)
    assert panel.weights == [0.0, pytest.approx(1.3863, abs=1e-4)]
    assert (v.score, v.votes, v.hints) == (1, [-1, 1], [])  # no hint of the loser
    trust_replies = consistency_file(
        tmp_path / "b.json", {("replies", replies.version): 0.9, ("rules", RuleJudge.version): 0.4}
    )
    panel2 = make_judge(
        "panel", {"judges": ["replies", "rules"], "consistency_file": str(trust_replies)}
    )
    v = asyncio.run(panel2.judge(CTX, reply(SPLIT)))
    assert v.score == -1 and v.hints == ["Answer in one sentence."]
    assert panel.version != panel2.version  # other weights, other verdict ids on a replay
    assert "replies (2.20) -1" in v.rationale  # log 9 = 2.1972


def test_weights_fall_back_to_fixed_weights_then_one_and_ties_are_zero(tmp_path: Path) -> None:
    stale = consistency_file(tmp_path / "c.json", {("rules", "an-old-version"): 0.99})
    panel = make_judge("panel", {"judges": ["replies", "rules"], "consistency_file": str(stale)})
    assert panel.weights == [1.0, 1.0]  # a changed judge starts again without evidence
    assert asyncio.run(panel.judge(CTX, reply(SPLIT))).score == 0  # 1.0 against 1.0
    fixed = make_judge("panel", {"judges": ["replies", "rules"], "weights": {"rules": 1.5}})
    assert asyncio.run(fixed.judge(CTX, reply(SPLIT))).score == 1
    assert fixed.inline is True


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"judges": []}, "at least 1"),
        ({"judges": ["replies", "replies"]}, "named twice"),
        ({"judges": ["panel"]}, "cannot hold a panel"),
        ({"judges": ["nope"]}, "unknown judge 'nope'"),
        ({"judges": ["rules"], "weight": {}}, "Extra inputs"),
    ],
)
def test_bad_panel_options_fail_with_the_reason(options: dict[str, object], message: str) -> None:
    with pytest.raises(Exception) as err:  # noqa: PT011 - the registry's own error type
        JUDGES.options("panel", options)
    assert message in str(err.value)


def test_a_bad_consistency_file_says_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"rows": []}')
    with pytest.raises(ValueError, match="no 'judges' list"):
        load_consistency(bad)
    bad.write_bytes(
        orjson.dumps({"judges": [{"judge_id": "x", "judge_version": "1", "consistency": 1.5}]})
    )
    with pytest.raises(ValueError, match="not in"):
        load_consistency(bad)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * ((4 << 20) + 1))
    with pytest.raises(ValueError, match="larger than"):
        load_consistency(big)


class Source:
    """Consistencies by (judge_id, version), as the topic reader answers them."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], float] = {}
        self.flagged: set[tuple[str, str]] = set()

    def consistency(self, judge_id: str, judge_version: str) -> float | None:
        return self.rows.get((judge_id, judge_version))

    def excluded(self, judge_id: str, judge_version: str) -> bool:
        return (judge_id, judge_version) in self.flagged


def test_a_live_panel_follows_its_source_and_names_what_decided_each_verdict() -> None:
    from pipeline import events
    from pipeline.processors import judging

    panel = make_judge(
        "panel", {"judges": ["replies", "rules"], "live": True, "weights": {"rules": 0.6}}
    )
    replies = make_judge("replies")
    # no source yet: fixed weights, else the prior 0.5, whose log-odds is 0: rules 0.6 decides
    assert panel.weights == [0.0, 0.6]
    src = Source()
    panel.use_live(src)
    work = judging.JudgeWork(CTX, "i-1", reply(SPLIT))
    first = asyncio.run(judging.judge_one(panel, work)).prm
    assert (first.score, first.judge_version) == (1, panel.version)
    # the topic now says rules is contradicted more than replies: log-odds of 1/3 -> 0,
    # of 7/8 -> log 7 = 1.9459 -> 1.95
    src.rows = {("rules", RuleJudge.version): 1 / 3, ("replies", replies.version): 7 / 8}
    out = asyncio.run(judging.judge_one(panel, work))
    prm = out.prm
    assert prm.score == -1 and [h.hint for h in out.hints] == ["Answer in one sentence."]
    assert prm.members == [
        {"judge_id": "replies", "judge_version": replies.version, "vote": -1, "weight": 1.95},
        {"judge_id": "rules", "judge_version": RuleJudge.version, "vote": 1, "weight": 0.0},
    ]
    # the verdict's version (and so its id) names the weights it was made with
    assert prm.judge_version != first.judge_version and prm.event_id != first.event_id
    assert prm.judge_version == panel.weigh()[1]
    assert prm.event_id == events.derive_event_id("prm_score", ["i-1", "n"], prm.judge_version)
    back = events.decode(events.encode(prm))  # the schema takes the members
    assert isinstance(back, events.PrmScore) and back.members == prm.members
    # a move under the rounding step keeps the version: ids stay put between small moves
    src.rows[("rules", RuleJudge.version)] = 0.334
    assert panel.weigh()[1] == prm.judge_version


def test_a_static_panel_keeps_its_version_and_still_reports_its_members() -> None:
    panel = make_judge("panel", {"judges": ["replies", "rules"]})
    v = asyncio.run(panel.judge(CTX, reply(SPLIT)))
    assert v.version == panel.version and [m["vote"] for m in v.members] == [-1, 1]
    assert [m["weight"] for m in v.members] == [1.0, 1.0]


class Failing:
    """A member whose judgement failed (an LLM judge's timeout): a verdict with an error."""

    judge_id, version = "llm", "llm-test-1"

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        return Verdict(0, [], "", [], error="timed out after 30 s")


def test_a_failed_member_has_no_vote_and_the_others_decide() -> None:
    """The failed member's 0 used to count (weight 0.9 against 0.5: the reply judge's -1 lost
    to nothing, and the turn's mean vote was pulled to 0); now only the panel fails, and only
    when every member does."""
    from pipeline import events
    from pipeline.processors import judging

    panel = make_judge(
        "panel", {"judges": ["replies", "rules"], "weights": {"replies": 0.5, "rules": 0.9}}
    )
    panel.members[1] = ("llm", Failing())
    v = asyncio.run(panel.judge(CTX, reply(SPLIT)))
    assert (v.score, v.votes, v.hints, v.error) == (-1, [-1, None], ["Answer in one sentence."],
                                                    None)  # fmt: skip
    assert "llm (0.90) failed: timed out after 30 s" in v.rationale
    assert [m["judge_id"] for m in v.members or []] == ["replies"]
    prm = asyncio.run(judging.judge_one(panel, judging.JudgeWork(CTX, "i-1", reply(SPLIT)))).prm
    back = events.decode(events.encode(prm))  # a null vote is valid on the wire
    assert isinstance(back, events.PrmScore) and back.votes == [-1, None] and back.error is None
    panel.members[0] = ("llm2", Failing())
    v = asyncio.run(panel.judge(CTX, reply(SPLIT)))
    assert (v.score, v.votes) == (0, [None, None])
    assert v.error == "llm2: timed out after 30 s; llm: timed out after 30 s"


# A long answer the user rejects: replies -1 (it reads the rejection), verbose and agreeable +1.
LONG = " ".join(["word"] * 26)
REJECT = "No, that is far too long. Answer in one short sentence."
THREE = ["replies", "verbose", "agreeable"]


def test_two_coin_flip_members_no_longer_outvote_one_at_0_9(tmp_path: Path) -> None:
    """Consistencies 0.9 (replies), 0.5, 0.5: by consistency the two carried 0.5 + 0.5 = 1.0
    against 0.9 and won; by log-odds they carry 0 + 0 against log 9 = 2.1972."""
    import pipeline.sim.flawed_judges  # noqa: F401  (registers verbose and agreeable)

    versions = {n: make_judge(n).version for n in THREE}
    path = consistency_file(
        tmp_path / "three.json",
        {
            ("replies", versions["replies"]): 0.9,
            ("verbose", versions["verbose"]): 0.5,
            ("agreeable", versions["agreeable"]): 0.5,
        },
    )
    panel = make_judge("panel", {"judges": THREE, "consistency_file": str(path)})
    assert panel.weights == [pytest.approx(2.1972, abs=1e-4), 0.0, 0.0]
    ctx = TurnContext("s", 0, "Capital of France?", LONG)
    v = asyncio.run(panel.judge(ctx, reply(REJECT)))
    assert (v.score, v.votes) == (-1, [-1, 1, 1])


def test_a_flagged_member_weighs_nothing_until_it_recovers() -> None:
    """replies at 0.9 decides the split; flagged (the topic's newest event says excluded) it
    weighs 0 and the split is a tie (rules at 0.5 weighs 0 too); recovered, it decides
    again. Its vote is still reported, so the watcher can see it recover."""
    panel = make_judge("panel", {"judges": ["replies", "rules"], "live": True})
    replies = make_judge("replies")
    src = Source()
    src.rows = {("replies", replies.version): 0.9, ("rules", RuleJudge.version): 0.5}
    panel.use_live(src)
    assert asyncio.run(panel.judge(CTX, reply(SPLIT))).score == -1
    src.flagged.add(("replies", replies.version))
    v = asyncio.run(panel.judge(CTX, reply(SPLIT)))
    assert (v.score, [m["weight"] for m in v.members or []]) == (0, [0.0, 0.0])
    assert [m["vote"] for m in v.members or []] == [-1, 1]
    src.flagged.clear()
    v = asyncio.run(panel.judge(CTX, reply(SPLIT)))
    assert (v.score, [m["weight"] for m in v.members or []]) == (-1, [2.2, 0.0])
