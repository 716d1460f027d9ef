"""The simulated users' critic: levels moved by recent success within bounds, questions drawn
toward the frontier, and (real gateway, real broker) the users' mix changing on the wire."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from pipeline.sim import PREFERENCES, QUESTIONS, Critic, CriticBounds
from pipeline.sim.critic import EASY, HARD, PLAIN

HINT = PREFERENCES["concise"].hint


def feed(critic: Critic, n: int, satisfied: bool) -> None:
    for a in critic.plan(n):
        critic.observe(a, satisfied)


def test_failing_makes_it_easier_within_the_easy_bound():
    critic = Critic(QUESTIONS[:10], seed=1)
    first = critic.plan(6)
    assert critic.level == PLAIN and all(a.prompt == a.question.text for a in first)
    for a in first:
        critic.observe(a, False)  # 0 of 6 < 0.5 - 0.15
    plan = critic.plan(6)
    assert critic.level == EASY
    easy = [a for a in plan if a.level == EASY]
    assert len(easy) == 3  # max_easy 0.5 of 6: the bound, not every user
    assert all(a.prompt == f"{a.question.text} {HINT}" for a in easy)
    assert all(a.prompt == a.question.text for a in plan if a.level == PLAIN)
    for a in plan:
        critic.observe(a, False)
    critic.plan(6)
    assert critic.level == EASY  # the floor: no level below easy


def test_succeeding_makes_it_harder_and_the_band_holds_it():
    critic = Critic(QUESTIONS[:10], seed=2, bounds=CriticBounds(window=6, max_hard=1 / 3))
    feed(critic, 6, True)  # 6/6 > 0.65
    plan = critic.plan(6)
    assert critic.level == HARD and sum(a.level == HARD for a in plan) == 2  # 1/3 of 6
    assert all(a.question.text in a.prompt and a.prompt != a.question.text
               for a in plan if a.level == HARD)  # fmt: skip
    for i, a in enumerate(plan):
        critic.observe(a, i % 2 == 0)  # 3 of the last 6 = 0.5: inside the band
    critic.plan(6)
    assert critic.level == HARD and critic.levels == [PLAIN, HARD, HARD]


def test_without_adapt_the_level_never_moves():
    critic = Critic(QUESTIONS[:10], seed=3, adapt=False)
    feed(critic, 6, False)
    assert all(a.level == PLAIN for a in critic.plan(6)) and critic.level == PLAIN


def test_frontier_draws_favour_half_solved_questions_and_keep_an_explore_share():
    """Questions 0-4 always solved, 5-9 half the time (8 sessions each): weights 0.05 + 0.95 *
    4p(1-p) with p = 9/10 -> 0.392 and p = 1/2 -> 1. Over 200 rounds of 4 (3 frontier draws,
    1 explore), the half-solved get most frontier draws; every explore draw is uniform."""
    qs = QUESTIONS[:10]
    critic = Critic(qs, seed=4, adapt=False)
    probe = critic.plan(1)[0]
    for i, q in enumerate(qs):
        for k in range(8):
            critic.observe(type(probe)(q, "concise", PLAIN, q.text, "frontier", 0.5, 1.0),
                           i < 5 or k % 2 == 0)  # fmt: skip
    draws: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for _ in range(200):
        for a in critic.plan(4):
            kinds[a.drawn] += 1
            if a.drawn == "frontier":
                draws["half" if qs.index(a.question) >= 5 else "solved"] += 1
    assert kinds == {"frontier": 600, "explore": 200}  # round(4 * 0.25) = 1 per round
    assert draws["half"] > 1.8 * draws["solved"]  # 1 : 0.392 before drawing without repeats
    solved = next(a for a in critic.plan(4) if qs.index(a.question) < 5)
    assert solved.question_rate == pytest.approx(0.9)


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="max_easy"):
        CriticBounds(max_easy=1.5)
    with pytest.raises(ValueError, match="unknown preferences"):
        Critic(QUESTIONS[:3], preferences=("nosuch",))


@pytest.mark.integration
def test_the_critic_changes_what_the_users_send_through_the_gateway(
    kafka_settings,
    unique: str,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """A real gateway (the tiny model, which never satisfies anyone) recording to the real
    broker: round 0 asks plainly; after it fails every session the critic moves to easy and
    half of round 1's users ask with the hint. Read back from the interactions topic, the
    prompts the broker holds are exactly what the critic planned."""
    from pipeline import events
    from pipeline.demo.runner import DemoConfig, DemoRunner
    from pipeline.kafka import names
    from pipeline.serving.threaded import running
    from tests.test_processors_integration import input_ends
    from tests.test_serving_feedback import gateway_app

    from_now = {p: o for (t, p), o in input_ends(kafka_settings).items() if t == names.INTERACTIONS}
    app = gateway_app(tmp_path, kafka_settings)
    cfg = DemoConfig(users=4, max_tokens=4, frontier=True, adapt=True, seed=5)
    with running(app) as url:
        runner = DemoRunner(f"{url}/v1", "liverl-tiny-v1", cfg)
        runner.policy = "liverl-tiny-v1"
        rounds = [runner.train_round(r, 4 * r) for r in range(2)]
        deadline = time.monotonic() + 30
        while app.state.recorder.backlog and time.monotonic() < deadline:
            time.sleep(0.1)
    sent = [s for r in rounds for s in r]
    assert not any(s.satisfied for s in sent)
    assert [s.allocation["level"] for s in rounds[0]] == ["plain"] * 4  # type: ignore[index]
    levels = Counter(s.allocation["level"] for s in rounds[1])  # type: ignore[index]
    assert levels == {"easy": 2, "plain": 2}
    assert runner.critic is not None and runner.critic.levels == [PLAIN, EASY]
    on_wire: dict[str, str] = {}
    c = Consumer(kafka_settings.kafka_client_config(**{"group.id": f"critic-{unique}"}))
    c.assign([TopicPartition(names.INTERACTIONS, p, o) for p, o in from_now.items()])
    deadline = time.monotonic() + 60
    wanted = {s.session_id for s in sent}
    while not wanted <= on_wire.keys() and time.monotonic() < deadline:
        for msg in c.consume(200, timeout=0.5):
            key = (msg.key() or b"").decode()
            if msg.error() is None and key in wanted:
                turn = events.decode(msg.value(), "interaction")
                if turn.turn == 0:
                    on_wire[key] = turn.messages[0]["content"]
    c.close()
    assert wanted <= on_wire.keys()
    for s in sent:
        assert on_wire[s.session_id] == s.prompt
        assert (HINT in s.prompt) is (s.allocation["level"] == "easy")  # type: ignore[index]
