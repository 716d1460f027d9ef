"""Simulated users' preferences: each `met` on hand-written answers; hints carry key phrases."""

from __future__ import annotations

import pytest

from pipeline.sim import PREFERENCES, Preference

LONG = (
    "To sleep better, keep a regular schedule. Avoid screens for an hour before bed, "
    "and keep your bedroom cool and dark."
)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("Go to bed at the same time every night.", True),
        ("Boil it for about 8.5 minutes, then cool it in cold water!", True),
        ("Keep a bottle of water on your desk", True),
        (LONG, False),
        ("Drink water. Eat fruit.", False),
        ("1. Boil water\n2. Add the egg", False),
        (" ".join(["word"] * 26) + ".", False),
        (" ".join(["word"] * 25) + ".", True),
        ("", False),
        ("...", False),
    ],
)
def test_concise(answer: str, expected: bool) -> None:
    assert PREFERENCES["concise"].met(answer) is expected


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("Go to bed at the same time every night and keep the room dark.", True),
        ("Drink a glass of water with every meal.", True),
        ("Utilize a consistent schedule to optimize your rest.", False),
        ("Furthermore, keep the room cool.", False),
        ("Improve circadian alignment.", False),
        # more than 10 % long words (11+ letters)
        (
            "Comfortable temperatures, consistently maintained, significantly "
            "improve restfulness overall tonight.",
            False,
        ),
        # one long word among ten or more is fine
        ("Keep your bedroom comfortable, quiet and dark so you can sleep well.", True),
        ("", False),
    ],
)
def test_plain(answer: str, expected: bool) -> None:
    assert PREFERENCES["plain"].met(answer) is expected


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("1. Boil water.\n2. Add the egg.\n3. Wait 8 minutes.", True),
        ("Here is how:\n\n1. Fill a pot.\n2. Boil.", True),
        ("  1. Fill a pot.\n  2. Boil.", True),
        ("**1.** no", False),
        ("1. Only one step.", False),
        ("2. Boil.\n3. Eat.", False),  # does not start at 1
        ("1. Boil water. 2. Add the egg.", False),  # one line
        ("- Boil water\n- Add the egg", False),
        ("1.1.1.1.1.1", False),
        (LONG, False),
    ],
)
def test_numbered(answer: str, expected: bool) -> None:
    assert PREFERENCES["numbered"].met(answer) is expected


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("go to bed at the same time every night.", True),
        ("drink water, 2 litres a day!", True),
        ("Go to bed early.", False),
        ("go to bed at 10 PM.", False),
        ("123 456", False),
        ("", False),
    ],
)
def test_lowercase(answer: str, expected: bool) -> None:
    assert PREFERENCES["lowercase"].met(answer) is expected


def test_bulleted_and_no_list() -> None:
    bullets, numbered = "- Boil water\n- Add the egg", "1. Boil\n2. Eat"
    assert PREFERENCES["bulleted"].met(bullets)
    assert PREFERENCES["bulleted"].met("* one\n* two\n")
    assert not PREFERENCES["bulleted"].met("- only one")
    assert PREFERENCES["no_list"].met(LONG)
    assert not PREFERENCES["no_list"].met(bullets)
    assert not PREFERENCES["no_list"].met(numbered)


def test_required_preferences_and_hints() -> None:
    assert {"concise", "plain", "numbered", "lowercase"} <= set(PREFERENCES)
    for name, pref in PREFERENCES.items():
        assert pref.name == name
        assert pref.key_phrase.lower() in pref.hint.lower()
        assert pref.carries_hint(pref.hint)
        for complaint in (pref.complaint, *pref.complaints):
            assert not pref.carries_hint(complaint), (name, complaint)
        assert pref.hint[0].isupper() and pref.hint.endswith(".")


def test_key_phrase_must_be_in_hint() -> None:
    with pytest.raises(ValueError):
        Preference("x", hint="Be brief.", complaint="Long.", key_phrase="numbered")
    assert Preference("x", hint="Be brief.", complaint="Long.").key_phrase == "be brief"


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("Go to bed at the same time every night.", True),
        ("I had a café before bed.", True),  # one French marker: an English answer
        ("Couchez-vous chaque soir à la même heure.", False),  # accents and function words
        ("Gardez une bouteille d'eau sur votre bureau.", False),  # une, sur, votre
        ("Commencez par courir dix minutes, trois fois par semaine.", False),  # dix, trois…
        ("Pour the tea, then sit with your son.", True),  # English homographs of French words
        ("Pour a ton of water, est. two liters, pas de deux.", True),
        ("I had a café au lait.", False),  # café and au: two markers
        ("", False),
        ("123 456", False),  # no word
    ],
)
def test_english(answer: str, expected: bool) -> None:
    assert PREFERENCES["english"].met(answer) is expected
