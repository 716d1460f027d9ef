"""SIGKILL of the worker loses no verdict (real broker, real worker subprocesses).

Reproduced failure: ``record-outcome --turn 0`` read before its interaction waited in process
memory only (its offset already committed); a SIGKILL then lost it: no prm_score, no dead
letter. Parked next states now live in a changelogged table, and timers wait for table
recovery (a sweep during recovery once killed the worker with ``KeyError('no token payload')``).

At-least-once: a restart may judge a turn again. That is tolerable only because verdict ids
are deterministic (derived from the interaction and next-state ids and the judge version):
every consumer downstream (the assembler, the lake, the trainer) must deduplicate by event id,
and this test asserts exactly one verdict per turn *after* deduplication, not before.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import time
from collections import defaultdict
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from pipeline import events
from pipeline.kafka import EventProducer, names
from pipeline.processors.commands import outcome_event
from pipeline.settings import Settings
from tests.support import examples

from .test_processors_integration import (
    RULES,
    drop_internal_topics,
    high_watermarks,
    start_worker,
    stop,
)

pytestmark = pytest.mark.integration

def changelog_size(settings: Settings, app_id: str, table: str) -> int:
    """Records ever written to a table's changelog (0 before it exists)."""
    topic = f"{app_id}-{table}-changelog"
    c = Consumer(settings.kafka_client_config(**{"group.id": "rst-wm"}))
    try:
        meta = c.list_topics(topic, timeout=10).topics.get(topic)
        if meta is None or meta.error is not None:
            return 0
        return sum(
            c.get_watermark_offsets(TopicPartition(topic, p), 10)[1] for p in meta.partitions
        )
    finally:
        c.close()


def test_sigkill_at_random_points_with_parked_next_states_loses_no_verdict(
    kafka_settings: Settings, unique: str, tmp_path: Path
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prefix, app_id = f"rst-{unique}", f"rst-{unique}"
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    start = high_watermarks(kafka_settings)
    producer = EventProducer(kafka_settings, client_id="rst")
    env = {"grace_s": "900", "session_timeout_s": "6"}
    base = examples.interaction(prompt_tokens=4, response_tokens=2)
    expected: dict[str, list[str]] = {}  # session -> prm_score parents
    parked_at_kill = 0
    # Kill points: some rounds wait until the outcome is provably parked (read, committed,
    # in the changelog) and kill soon after, so every run covers that case however slowly the
    # worker starts on a loaded machine; the others kill at a random moment, some with the
    # interaction sent before the kill.
    modes = ["parked"] * 4 + ["random"] * 3 + ["early"] * 3
    rng.shuffle(modes)
    proc = start_worker(app_id, prefix, rules, tmp_path, **env)
    try:
        for i, mode in enumerate(modes):
            sid = f"{prefix}-{i}"
            outcome = outcome_event(sid, True, turn=0)  # liverl record-outcome --turn 0 --passed
            inter = dataclasses.replace(base, event_id=f"{sid}-i0", session_id=sid, turn=0)
            expected[sid] = [inter.event_id, outcome.event_id]
            before = changelog_size(kafka_settings, app_id, "judging")
            producer.send(names.NEXT_STATES, outcome)
            producer.flush()
            early = mode == "early"
            if early:
                time.sleep(rng.uniform(0.0, 2.0))
                producer.send(names.INTERACTIONS, inter)
                producer.flush()
            if mode == "parked":
                parked_by = time.monotonic() + 120
                while changelog_size(kafka_settings, app_id, "judging") <= before:
                    assert proc.poll() is None, f"seed {seed}: worker exited before parking"
                    assert time.monotonic() < parked_by, f"seed {seed}: outcome never parked"
                    time.sleep(0.2)
                time.sleep(rng.uniform(0.0, 1.0))
            else:
                time.sleep(rng.uniform(0.5, 10.0))
            if not early and changelog_size(kafka_settings, app_id, "judging") > before:
                parked_at_kill += 1  # the outcome was read (and committed) and now waits
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc = start_worker(app_id, prefix, rules, tmp_path, **env)
            if not early:
                time.sleep(rng.uniform(0.0, 3.0))
                producer.send(names.INTERACTIONS, inter)
                producer.flush()

        c = Consumer(kafka_settings.kafka_client_config(**{"group.id": f"rst-{unique}"}))
        c.assign([TopicPartition(t, p, o) for (t, p), o in start.items()])
        verdicts: list[events.PrmScore] = []
        dead: list[events.DeadLetter] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            for msg in c.consume(500, timeout=0.5):
                if msg.error() is not None or not (msg.key() or b"").startswith(prefix.encode()):
                    continue
                ev = events.decode(msg.value())
                if isinstance(ev, events.PrmScore):
                    verdicts.append(ev)
                elif isinstance(ev, events.DeadLetter):
                    dead.append(ev)
            if {v.session_id for v in verdicts} >= set(expected):
                break
        c.close()
        alive = proc.poll() is None
    finally:
        stop(proc)
        drop_internal_topics(kafka_settings, app_id)
    log = (tmp_path / f"{app_id}.log").read_text()[-4000:]
    assert alive, f"seed {seed}: worker exited\n{log}"
    assert parked_at_kill >= 4, f"seed {seed}: only {parked_at_kill} kills with a parked outcome"
    assert not dead, [d.error for d in dead]

    # Deduplicate by id, as every downstream consumer must: then exactly one verdict per turn.
    by_id = {v.event_id: v for v in verdicts}
    per_turn: dict[tuple[str, int], set[str]] = defaultdict(set)
    for v in by_id.values():
        per_turn[(v.session_id, v.turn)].add(v.event_id)
    missing = sorted(set(expected) - {s for s, _ in per_turn})
    assert not missing, f"seed {seed}: verdicts lost for {missing}\n{log}"
    assert {k: len(ids) for k, ids in per_turn.items()} == {(s, 0): 1 for s in expected}
    for v in by_id.values():
        assert v.parents == expected[v.session_id]
    # Duplicates (same id) are allowed, never a second id for the same turn.
    assert len(verdicts) >= len(by_id)
