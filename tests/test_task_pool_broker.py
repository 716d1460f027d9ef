"""The task pool on the real broker: sessions with a passing gate enter the pool only after a
majority of three judges, a session with one vote of three is published rejected, a session
without a verified outcome gives no task; a rerun publishes nothing; list, export and replay
read the pool; forget removes a session's task."""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest

from pipeline import events
from pipeline.kafka import EventProducer, names
from pipeline.processors.outcomes import GateResult, gate_event, outcome_event
from pipeline.processors.task_pool import TaskPool, build_judges, read_tasks
from pipeline.settings import Settings
from tests.test_replay import cli_env, drop, invoke, read_topic
from tests.test_task_pool import PLUGINS, WORDS, posted, turn


def tombstones(settings: Settings, keys: list[str]) -> None:
    """Remove this test's tasks from the live (compacted) pool again."""
    from confluent_kafka import Producer

    p = Producer(settings.kafka_client_config())
    for k in keys:
        p.produce(names.TASKS, key=k.encode(), value=None)
    p.flush(30)


@pytest.mark.integration
def test_a_verified_session_enters_the_pool_only_after_a_majority_of_judges(
    kafka_settings: Settings, unique: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    p = f"tp{unique}-"
    ns = f"tp{unique}"
    env = {
        **os.environ,
        **cli_env(tmp_path),
        "LIVERL_KAFKA_BOOTSTRAP": kafka_settings.bootstrap,
        "LIVERL_PROCESSORS_PLUGINS": json.dumps(PLUGINS),
        "LIVERL_TASKS_JUDGES": json.dumps(sorted(WORDS)),
        "LIVERL_TASKS_JUDGE_OPTIONS": json.dumps(WORDS),
    }
    producer = EventProducer(kafka_settings, client_id="task-pool-test")
    gate = GateResult(0, "3 passed", "", False, 0.4)

    def send(*evs: events.Event) -> None:
        for ev in evs:
            producer.send(
                names.INTERACTIONS if isinstance(ev, events.Interaction) else names.NEXT_STATES, ev
            )
        producer.flush()

    # a: fixed + tests (2 of 3) -> accepted; b: only "refactor" (1 of 3) -> rejected;
    # c: a failed gate -> no task; e: a command a client posted to the gateway, accepted 2 of 3
    marker = tmp_path / "posted-command-ran"
    posted_command = shlex.join([sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    send(turn(p + "e", 0, "Fixed the tests."), posted(p + "e", posted_command))
    send(
        turn(p + "a", 0, "Looking at the import."),
        turn(p + "a", 1, "Fixed the import; the tests pass."),
        gate_event(p + "a", ["pytest", "-q"], gate),
    )
    send(turn(p + "b", 0, "I refactored the module."), outcome_event(p + "b", True))
    send(turn(p + "c", 0, "Fixed it, tests pass."), outcome_event(p + "c", False))
    seen: list[events.VerifiedTask] = []
    judges = build_judges(sorted(WORDS), WORDS, PLUGINS)
    pool = TaskPool(kafka_settings, judges, session_prefix=p, on_task=seen.append)
    request.addfinalizer(lambda: tombstones(kafka_settings, [t.task_id for t in seen]))
    stop = threading.Event()
    thread = threading.Thread(target=pool.run, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 90
        while len(seen) < 3:
            assert time.monotonic() < deadline and thread.is_alive(), seen
            time.sleep(0.2)
        # while it follows: d's outcome arrives before its turn
        send(
            outcome_event(p + "d", True, kind="feedback"),
            turn(p + "d", 0, "Fixed: the tests pass now."),
        )
        while len(seen) < 4:
            assert time.monotonic() < deadline and thread.is_alive(), seen
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join(30)
    by_session = {t.provenance["session_id"]: t for t in seen}
    assert sorted(by_session) == [p + "a", p + "b", p + "d", p + "e"]  # c: no verified outcome
    a, b, d, e = (by_session[p + s] for s in "abde")
    assert [v["vote"] for v in a.votes] == [1, 1, -1] and a.status == "accepted"
    assert [v["vote"] for v in b.votes] == [-1, -1, 1] and b.status == "rejected"
    assert d.status == "accepted" and d.checker["kind"] == "feedback"
    assert a.checker["command"] == "pytest -q" and a.prompt == "Fix the import error."
    assert a.checker["kind"] == "command" and a.checker["producer"] == "record-outcome"
    assert e.status == "accepted" and (e.checker["kind"], e.checker["command"]) == (
        "reported",
        None,
    )
    assert e.checker["producer"] == "gateway"
    assert [i["turn"] for i in a.provenance["interactions"]] == [0, 1]
    assert all(
        i["topic"] == names.INTERACTIONS and i["offset"] >= 0 for i in a.provenance["interactions"]
    )
    assert a.provenance["outcome_at"]["topic"] == names.NEXT_STATES
    # the pool on the broker: each task once; a rerun from history publishes nothing
    ours = {
        i: t
        for i, t in read_tasks(kafka_settings).items()
        if t.provenance["session_id"].startswith(p)
    }
    assert ours == {t.task_id: t for t in seen}
    res = invoke(["tasks", "watch", "--once", "--session-prefix", p], env)
    assert res.exit_code == 0 and "published 0 task(s)" in res.output, res.output
    # people's commands
    res = invoke(["tasks", "list", "--status", "accepted", "--format", "json"], env)
    listed = {r["task_id"] for r in orjson.loads(res.output)}
    assert res.exit_code == 0 and {a.task_id, d.task_id} <= listed and b.task_id not in listed
    out = tmp_path / "pool.jsonl"
    res = invoke(["tasks", "export", "-o", str(out)], env)
    exported = {r["task_id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    assert res.exit_code == 0 and {a.task_id, d.task_id} <= set(exported)
    assert b.task_id not in exported and exported[a.task_id]["checker"]["command"] == "pytest -q"
    res = invoke(["tasks", "show", a.task_id[:12]], env)
    assert res.exit_code == 0 and orjson.loads(res.output)["votes"] == a.votes
    # the posted command never runs, whatever the operator allows
    res = invoke(
        ["tasks", "check", e.task_id],
        {**env, "LIVERL_TASKS_ALLOWED_COMMANDS": json.dumps([sys.executable, posted_command])},
    )
    assert res.exit_code == 2 and "reported by a client" in res.output, res.output
    assert not marker.exists()
    # the accepted tasks' sessions into a namespace, for its workers and trainer
    request.addfinalizer(lambda: drop(env, ns))
    res = invoke(["tasks", "replay", "--into", ns, "--session-prefix", p], env)
    assert res.exit_code == 0, res.output
    replayed = [
        events.decode(m.value())
        for topic in (names.INTERACTIONS, names.NEXT_STATES)
        for msgs in read_topic(kafka_settings, names.resolve(topic, ns)).values()
        for m in msgs
    ]
    # (live workers on this broker may have derived next states of these sessions: they are
    # the sessions' records too, and replayed with them)
    got = {
        (e.session_id, e.type)
        for e in replayed  # type: ignore[attr-defined]
        if getattr(e, "session_id", "").startswith(p)
    }
    assert got == {(p + s, t) for s in "ade" for t in ("interaction", "next_state")}
    ids = {ev.event_id for ev in replayed}
    assert {
        *(i["event_id"] for t in (a, d, e) for i in t.provenance["interactions"]),
        *(t.provenance["outcome_id"] for t in (a, d, e)),
    } <= ids
    # a later failed outcome withdraws a's task; the watcher says so, and counts it
    send(outcome_event(p + "a", False))
    res = invoke(["tasks", "watch", "--once", "--session-prefix", p], env)
    assert res.exit_code == 0 and f"{a.task_id} withdrawn" in res.output, res.output
    assert (
        "1 accepted" not in res.output and "1 revised by later outcomes (1 withdrawn)" in res.output
    ), res.output
    # forgetting a session removes its task from the pool (a tombstone on the compacted topic)
    res = invoke(["forget", "--session", p + "a"], env)
    assert res.exit_code == 0 and f"{names.TASKS}: " in res.output, res.output
    left = read_tasks(kafka_settings)
    assert a.task_id not in left and d.task_id in left


@pytest.mark.integration
def test_the_accepted_pool_trains_offline_through_a_replay_namespace(
    kafka_settings: Settings, unique: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """liverl tasks replay puts only the accepted tasks' sessions into a namespace; its
    workers turn them into samples and its trainer trains a version from them (the usual
    exactly-once path of replay namespaces)."""
    import dataclasses

    from tests.test_replay import drop_worker_state, start, stop, wait_rewards

    p, ns, app_id, policy = f"to{unique}-", f"to{unique}", f"to-{unique}", f"top-{unique}"
    env = {
        **os.environ,
        **cli_env(tmp_path),
        "LIVERL_KAFKA_BOOTSTRAP": kafka_settings.bootstrap,
        "PYTHONUNBUFFERED": "1",
        "LIVERL_PROCESSORS_SESSION_PREFIX": p,
        "LIVERL_PROCESSORS_GRACE_S": "2",
        "LIVERL_PROCESSORS_SWEEP_INTERVAL_S": "1",
    }
    producer = EventProducer(kafka_settings, client_id="task-offline-test")

    def session(sid: str, answer: str) -> None:
        for t in range(2):
            inter = dataclasses.replace(
                turn(sid, t, answer if t == 1 else "Looking."),
                policy_id=policy,
                prompt_token_ids=[t + 1, t + 2],
                response_token_ids=[10 + t, 20 + t],
                response_logprobs=[-0.5, -0.25],
                session_done=t == 1,
            )
            producer.send(names.INTERACTIONS, inter)
        producer.send(names.NEXT_STATES, outcome_event(sid, True))
        producer.flush()

    session(p + "yes", "Fixed the import; the tests pass.")  # 2 of 3: accepted
    session(p + "no", "I refactored the module.")  # 1 of 3: rejected
    seen: list[events.VerifiedTask] = []
    pool = TaskPool(
        kafka_settings,
        build_judges(sorted(WORDS), WORDS, PLUGINS),
        session_prefix=p,
        on_task=seen.append,
    )
    request.addfinalizer(lambda: tombstones(kafka_settings, [t.task_id for t in seen]))
    pool.run(once=True)
    assert sorted((t.provenance["session_id"], t.status) for t in seen) == [
        (p + "no", "rejected"),
        (p + "yes", "accepted"),
    ]
    request.addfinalizer(lambda: drop_worker_state(kafka_settings, app_id))
    request.addfinalizer(lambda: drop(env, ns))
    res = invoke(["tasks", "replay", "--into", ns, "--session-prefix", p], env)
    assert res.exit_code == 0 and "replaying 1 session(s)" in res.output, res.output
    replayed = {
        m.key()
        for ms in read_topic(kafka_settings, names.resolve(names.INTERACTIONS, ns)).values()
        for m in ms
    }
    assert replayed == {(p + "yes").encode()}
    log = tmp_path / "workers.log"
    proc = start(["workers", "--namespace", ns, "--app-id", app_id, "--no-web"], env, log)
    keys = {(p + "yes").encode(), (p + "no").encode()}
    try:
        rewards = wait_rewards(kafka_settings, names.resolve(names.REWARDS, ns), keys, 2, proc, log)
        samples = names.resolve(names.SAMPLES, ns)
        deadline = time.monotonic() + 60
        while (
            len(
                got := [
                    m
                    for ms in read_topic(kafka_settings, samples).values()
                    for m in ms
                    if m.key() in keys
                ]
            )
            < 2
        ):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        stop(proc)
    assert {k for k, _ in rewards} == {p + "yes"}  # the rejected session never trains
    assert {m.key() for m in got} == {(p + "yes").encode()}
    train_log = tmp_path / "train.log"
    trainer = start(
        [
            "train",
            "--namespace",
            ns,
            "--policy",
            policy,
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--batch-samples",
            "2",
            "--batch-wait",
            "0.05",
            "--publish-max-overhead",
            "1",
            "--exit-when-idle",
            "2",
        ],
        env,
        train_log,
    )
    try:
        assert trainer.wait(300) == 0, train_log.read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    manifest = tmp_path / "state" / "replay" / ns / "weights" / policy / "v1" / "manifest.json"
    assert manifest.is_file(), train_log.read_text()[-3000:]
    assert orjson.loads(manifest.read_bytes())["input_topic"] == samples
