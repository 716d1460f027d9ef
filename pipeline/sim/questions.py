"""Everyday questions a small instruct model can answer, each with hand-written topic keywords.

An answer is on topic when it mentions at least one keyword (see :func:`mentions`): the
keywords are the question's subject and its everyday synonyms, never generic words ("you",
"help", "ai") that an off-topic stock answer would contain.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

_WORD = re.compile(r"[a-z0-9]+")
SUFFIX = 4  # a keyword of 4+ letters also matches a word it starts, with up to 4 letters more
SHORT_SUFFIXES = ("", "s", "es")  # a keyword of 3 letters or fewer: only these endings


@dataclass(frozen=True)
class Question:
    text: str
    keywords: tuple[str, ...]  # lowercase topic words; any one present in the answer = on topic


def _q(text: str, keywords: str) -> Question:
    return Question(text, tuple(keywords.split()))


def mentions(answer: str, keywords: Sequence[str]) -> bool:
    """Whether ``answer`` contains a keyword as a word or, for keywords of 4+ letters, as the
    start of a word at most 4 letters longer (``sleep`` matches "sleeping", ``rest`` matches
    "restless" but not "restaurant"); a short keyword matches only itself and its plural
    (``cat`` matches "cats", not "catch")."""
    found = _WORD.findall(answer.lower())
    for keyword in keywords:
        kw = keyword.lower()
        if " " in kw:
            if kw in " ".join(found):
                return True
            continue
        if len(kw) <= 3:
            if any(kw + end in found for end in SHORT_SUFFIXES):
                return True
            continue
        for word in found:
            if word.startswith(kw) and len(word) - len(kw) <= SUFFIX:
                return True
    return False


QUESTIONS: list[Question] = [
    _q("Give me a tip for sleeping better.", "sleep bed bedroom bedtime night rest nap tired"),
    _q("How can I drink more water during the day?", "water drink bottle hydrate glass thirst"),
    _q("What is a good way to start running?", "run jog pace walk mile shoes legs"),
    _q("How do I make a cup of tea?", "tea water boil kettle cup steep leaves bag"),
    _q("How do I boil an egg?", "egg boil water minutes pot shell"),
    _q("What is photosynthesis?", "photosynthesis plant light sun energy leaves sugar oxygen"),
    _q("How can I save money on groceries?", "grocer money save food shop list store budget price"),
    _q("Give me a tip for studying for an exam.", "study exam test learn notes review"),
    _q("How do I keep a houseplant alive?", "plant water light soil pot leaves sun"),
    _q("What is a good way to relax after work?", "relax rest calm walk breath music bath stress"),
    _q("How do I clean a kitchen sink?", "sink clean wash soap water scrub vinegar"),
    _q("How can I wake up earlier?", "wake early morning alarm sleep bed"),
    _q("What is the water cycle?", "water evaporat rain cloud cycle condens vapor"),
    _q("How do I make a simple salad?", "salad lettuce vegetable tomato dressing greens cucumber"),
    _q("Give me a tip for remembering names.", "name remember repeat memory person"),
    _q("How can I stay focused while working?", "focus work distraction break task concentrat"),
    _q("What is a healthy breakfast?", "breakfast oat egg fruit yogurt toast cereal protein"),
    _q("How do I write a thank-you note?", "thank note card letter grateful write"),
    _q("How can I be more organized at home?", "organiz home clutter tidy box shelf clean"),
    _q("What is gravity?", "gravity force mass pull earth fall weight"),
    _q("How do I fold a shirt neatly?", "shirt fold sleeve collar"),
    _q("Give me a tip for a job interview.", "interview job employer question prepare company"),
    _q("How can I reduce stress?", "stress relax calm breath exercise rest anxiety"),
    _q("How do I make pancakes?", "pancake flour egg milk batter pan"),
    _q("What is a rainbow?", "rainbow light rain color colour sun water"),
    _q("How can I improve my handwriting?", "handwrit write letter pen pencil practice"),
    _q("How do I start a vegetable garden?", "garden vegetable soil plant seed water sun"),
    _q("What is a good way to learn new words?", "word vocabulary read learn dictionary"),
    _q("How can I stop procrastinating?", "procrastinat task start timer work goal"),
    _q("How do I cook rice?", "rice water boil cook pot cup simmer"),
    _q("Give me a tip for saving energy at home.", "energy light power electric heat bill"),
    _q("What is a volcano?", "volcano lava magma erupt mountain"),
    _q("How do I tie a tie?", "tie knot neck collar loop"),
    _q("How can I make new friends?", "friend people social club meet talk"),
    _q("What should I pack for a beach day?", "beach sunscreen towel water swim hat sun"),
    _q("How do I remove a coffee stain?", "stain coffee water wash soap vinegar blot"),
    _q("Give me a tip for eating more vegetables.", "vegetable veggie salad carrot broccoli meal"),
    _q("What is the moon?", "moon earth orbit satellite sky"),
    _q("How can I keep my phone battery lasting longer?", "battery phone charge screen app power"),
    _q("How do I make a good first impression?", "impression smile eye contact greet confident"),
    _q("What is recycling?", "recycl waste plastic paper glass reuse trash"),
    _q("How do I clean my glasses?", "glass lens clean cloth wipe"),
    _q("Give me a tip for keeping a budget.", "budget money spend track save income expense"),
    _q("How can I get better at cooking?", "cook recipe kitchen food practice meal"),
    _q("What is exercise good for?", "exercise health heart body muscle fit energy"),
    _q("How do I write a good email?", "email subject message write clear"),
    _q("How can I stay warm in winter?", "warm winter layer coat heat cold blanket"),
    _q("What is a cloud made of?", "cloud water droplet vapor ice"),
    _q("How do I take care of a cat?", "cat pet food water litter vet"),
    _q("How do I take care of a dog?", "dog pet walk food water vet"),
    _q("Give me a tip for public speaking.", "speak speech audience practice talk present"),
    _q("How can I keep my room tidy?", "room tidy clean clutter bed floor"),
    _q("What is the sun?", "sun star light heat energy"),
    _q("How do I make a sandwich?", "sandwich bread filling cheese ham butter"),
    _q("How can I drink less coffee?", "coffee caffeine cup tea decaf"),
    _q("Give me a tip for a long car trip.", "car trip drive road break snack"),
    _q("What is a healthy snack?", "snack fruit nut yogurt apple vegetable"),
    _q("How do I wash my hands properly?", "hand wash soap water scrub seconds"),
    _q("How can I read more books?", "book read page library"),
    _q("What is the internet?", "internet network computer web online"),
    _q("How do I brush my teeth well?", "teeth tooth brush floss gum"),
    _q("Give me a tip for staying cool in summer.", "cool summer heat water shade fan"),
    _q("How can I be kinder to people?", "kind people listen smile compliment others"),
    _q("What is a good way to learn to swim?", "swim pool water lesson float"),
    _q("How do I make my bed?", "bed sheet pillow blanket"),
    _q("How can I sit with better posture?", "posture sit back chair shoulder spine straight"),
    _q("What is a healthy lunch?", "lunch salad sandwich vegetable protein meal"),
    _q("How do I plan a birthday party?", "party birthday guest cake invite"),
    _q("How do I iron a shirt?", "iron shirt heat fabric collar sleeve steam"),
    _q("What is a good way to stretch in the morning?", "stretch muscle arm leg back morning"),
    _q("How can I keep fruit fresh longer?", "fruit fresh fridge store ripe cool"),
    _q("What is a thunderstorm?", "thunder storm lightning rain cloud"),
    _q("How do I change a light bulb?", "bulb light lamp socket switch"),
    _q("Give me a tip for learning to cook eggs.", "egg pan cook butter heat scrambl fry boil"),
    _q("How can I spend less time on my phone?", "phone screen app time notification"),
    _q("What is a good gift for a friend?", "gift friend present book card"),
    _q("How do I keep my shoes clean?", "shoe clean wash brush dirt"),
    _q("What is a healthy dinner?", "dinner vegetable protein meal rice fish chicken salad"),
    _q("How can I be on time more often?", "time early late alarm clock schedule plan"),
    _q("How do I wash a car?", "car wash soap water sponge rinse"),
]


def split(seed: int = 0, heldout: float = 0.25) -> tuple[list[Question], list[Question]]:
    """Deterministic (train, held-out) split of :data:`QUESTIONS`; both keep the list order."""
    if not 0.0 <= heldout <= 1.0:
        raise ValueError("heldout must be in [0, 1]")
    order = list(range(len(QUESTIONS)))
    random.Random(seed).shuffle(order)
    cut = round(len(QUESTIONS) * heldout)
    held = set(order[:cut])
    train = [q for i, q in enumerate(QUESTIONS) if i not in held]
    return train, [q for i, q in enumerate(QUESTIONS) if i in held]
