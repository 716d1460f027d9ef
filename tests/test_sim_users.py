"""Simulated users: judgements, thanks and corrections, hint rate, determinism."""

from __future__ import annotations

import pytest

from pipeline.sim import PREFERENCES, QUESTIONS, SimUser, make_users, split
from pipeline.sim.users import THANKS

SLEEP = next(q for q in QUESTIONS if "sleeping" in q.text)
TEA = next(q for q in QUESTIONS if "tea" in q.text)
GOOD_SHORT = "Go to bed at the same time every night."
GOOD_LONG = (
    "To sleep better, keep a regular schedule. Avoid screens for an hour before bed, "
    "and keep your bedroom cool and dark."
)
STOCK = "You are a helpful AI, trained by Hugging Face"


def test_judge_needs_preference_and_quality() -> None:
    user = SimUser("u", PREFERENCES["concise"])
    ok = user.judge(SLEEP, GOOD_SHORT)
    assert ok.satisfied and ok.meets_preference and ok.quality.ok
    long = user.judge(SLEEP, GOOD_LONG)
    assert not long.satisfied and not long.meets_preference and long.quality.ok
    hacked = user.judge(SLEEP, STOCK)
    assert hacked.meets_preference and not hacked.satisfied


def test_stock_answer_to_every_question_never_satisfies() -> None:
    user = SimUser("u", PREFERENCES["concise"])
    judgements = [user.judge(q, STOCK) for q in QUESTIONS[:10]]
    assert all(j.meets_preference for j in judgements)
    assert not any(j.satisfied for j in judgements)
    assert all("repeats an earlier answer" in j.quality.reasons for j in judgements[1:])


def test_parroting_the_hint_is_not_satisfying() -> None:
    user = SimUser("u", PREFERENCES["concise"])
    judged = user.judge(SLEEP, "To sleep better, answer in one short sentence.")
    assert judged.meets_preference and not judged.satisfied
    assert judged.quality.reasons == ["repeats the instruction"]
    assert user.reply(judged).startswith(("You just repeated", "Don't repeat"))


def test_same_answer_to_the_same_question_is_not_a_repeat() -> None:
    user = SimUser("u", PREFERENCES["concise"])
    assert user.judge(SLEEP, GOOD_SHORT).satisfied
    assert user.judge(SLEEP, GOOD_SHORT).satisfied, "asked again, the same good answer is fine"
    again = user.judge(TEA, GOOD_SHORT)
    assert "repeats an earlier answer" in again.quality.reasons


def test_satisfied_reply_is_thanks() -> None:
    for seed in range(30):
        user = SimUser("u", PREFERENCES["concise"], seed=seed)
        reply = user.reply(user.judge(SLEEP, GOOD_SHORT))
        assert reply in THANKS + PREFERENCES["concise"].praise
        assert not PREFERENCES["concise"].carries_hint(reply)


# an on-topic answer each preference rejects
REJECTED = {
    "concise": GOOD_LONG,
    "plain": "Utilize a consistent bedtime to optimize your sleep.",
    "numbered": GOOD_LONG,
    "lowercase": GOOD_SHORT,
    "bulleted": GOOD_LONG,
    "no_list": "1. Go to bed early.\n2. Sleep in a dark room.",
    "english": "Allez au bed chaque soir à la même heure.",
}


@pytest.mark.parametrize("name", sorted(PREFERENCES))
def test_corrections_carry_the_hint_at_rate_one_and_never_at_zero(name: str) -> None:
    pref = PREFERENCES[name]
    answers = [REJECTED[name], STOCK, "1.1.1.1.1.1", ""]
    for seed in range(40):
        always = SimUser(f"u{seed}", pref, hint_rate=1.0, seed=seed)
        never = SimUser(f"u{seed}", pref, hint_rate=0.0, seed=seed)
        for answer in answers:
            judged = always.judge(SLEEP, answer)
            assert not judged.satisfied
            with_hint = always.reply(judged)
            assert pref.carries_hint(with_hint), with_hint
            assert with_hint.count(".") + with_hint.count("?") + with_hint.count("!") >= 2
            without = never.reply(never.judge(SLEEP, answer))
            assert not pref.carries_hint(without), without


def test_hint_rate_is_respected_on_average() -> None:
    pref = PREFERENCES["concise"]
    carried = 0
    for seed in range(400):
        user = SimUser("u", pref, hint_rate=0.5, seed=seed)
        carried += pref.carries_hint(user.reply(user.judge(SLEEP, GOOD_LONG)))
    assert 150 < carried < 250


def test_corrections_are_varied_and_name_the_problem() -> None:
    pref = PREFERENCES["concise"]
    user = SimUser("u", pref, seed=1)
    replies = {user.reply(user.judge(SLEEP, GOOD_LONG)) for _ in range(60)}
    assert len(replies) >= 10
    assert any(r.startswith(pref.complaint) for r in replies)
    off = SimUser("v", pref).reply(SimUser("v", pref).judge(SLEEP, "Paris is in France."))
    assert not off.startswith(tuple([pref.complaint, *pref.complaints])), off


def test_deterministic_given_seed_and_user_id() -> None:
    def replies(user_id: str, seed: int) -> list[str]:
        user = SimUser(user_id, PREFERENCES["plain"], hint_rate=0.5, seed=seed)
        out = []
        for q in split(seed=3)[0][:20]:
            out.append(user.reply(user.judge(q, "Utilize comprehensive methodologies here.")))
            out.append(user.reply(user.judge(q, q.keywords[0] + " is simple and good for you.")))
        return out

    assert replies("a", 0) == replies("a", 0)
    assert replies("a", 0) != replies("b", 0)
    assert replies("a", 0) != replies("a", 1)


def test_make_users() -> None:
    users = make_users(5, ("concise", "numbered"), hint_rate=0.3, seed=7)
    assert [u.user_id for u in users] == [f"user-{i}" for i in range(5)]
    assert [u.preference.name for u in users] == ["concise", "numbered"] * 2 + ["concise"]
    assert all(u.hint_rate == 0.3 and u.seed == 7 for u in users)
    assert [u.preference.name for u in make_users(2)] == ["concise", "concise"]
    with pytest.raises(KeyError):
        make_users(1, ("shouty",))
    with pytest.raises(ValueError):
        SimUser("u", PREFERENCES["concise"], hint_rate=1.5)


def test_shared_history_catches_one_answer_across_users() -> None:
    alone = make_users(3)
    reasons = [u.judge(q, STOCK).quality.reasons for u, q in zip(alone, QUESTIONS, strict=False)]
    assert reasons == [["off topic"]] * 3
    together = make_users(3, shared_history=True)
    answer = "Drink water, sleep well, boil the kettle, go to bed early at night."
    judged = [u.judge(q, answer) for u, q in zip(together, (SLEEP, SLEEP, TEA), strict=True)]
    assert judged[0].quality.ok
    assert judged[1].quality.ok, "the same question again is not a repeat"
    assert "repeats an earlier answer" in judged[2].quality.reasons


def test_split_is_disjoint_stable_and_seeded() -> None:
    train, held = split()
    assert len(train) + len(held) == len(QUESTIONS)
    assert len(held) == round(0.25 * len(QUESTIONS))
    assert not {q.text for q in train} & {q.text for q in held}
    assert split() == (train, held)
    assert split(seed=1) != (train, held)
    assert split(heldout=0.5)[1] != held and len(split(heldout=0.5)[1]) == len(QUESTIONS) // 2
    assert split(heldout=0.0)[1] == [] and split(heldout=1.0)[0] == []
    # the held-out questions of seed 0 are pinned: changing them changes every reported figure
    assert [q.text for q in held][:3] == PINNED_HELD_OUT


PINNED_HELD_OUT = [
    "How can I drink more water during the day?",
    "How do I keep a houseplant alive?",
    "How can I wake up earlier?",
]
