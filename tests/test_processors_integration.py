"""The real Faust worker against the real broker: a scripted 5-turn session end to end.

Expected values are computed by hand from the test rule set (beta 0.5). Each turn's path
penalty is its shaping F = Phi(s') - Phi(s); a refund repays part of an earlier violation of
the same rule, and progress needs a verified (exit code 0) passing test run:
turn 0  grep, ok                  -> nothing (read-only)                        F  0
turn 1  pytest, fails             -> 1st failure, allowed                       F  0
turn 2  pytest again, fails       -> repeated (N=1) -0.2                        F -0.2
turn 3  pytest && git push --force, ok -> forbidden -0.3, pytest recovered +0.05 F -0.25
turn 4  git commit (session done) -> tests ran (no violation), none verified   F  0
Rule judge: tool results 0, "Thanks, that works" +1, session end 0. Turns 0, 1 and 4 total 0
with no outcome: no RL signal; turn 0 also has a hint, so it becomes an OPD-only sample that
trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from pipeline import events
from pipeline.events import examples
from pipeline.kafka import EventProducer, names
from pipeline.settings import Settings

pytestmark = pytest.mark.integration

OUT_TOPICS = (
    names.NEXT_STATES,
    names.PRM_SCORES,
    names.PATH_PENALTIES,
    names.REWARDS,
    names.SAMPLES,
    names.DLQ,
)
RULES = """
version: rules-test
beta: 0.5
failure_patterns: ["(?i)\\\\berror\\\\b", "(?i)failed"]
rules:
  - {id: repeated, kind: repeated_failing_call, max_repeats: 1, penalty: 0.2, compliance: 0.05}
  - id: forbidden
    kind: forbidden_pattern
    patterns: ["git\\\\s+push\\\\s+(.*\\\\s)?(--force|-f)(\\\\s|$)"]
    penalty: 0.3
    compliance: 0.02
  - id: tests-first
    kind: required_step
    trigger: "git\\\\s+commit"
    requires: "pytest"
    penalty: 0.2
    compliance: 0.05
"""


def shell(call_id: str, cmd: str) -> dict:
    args = orjson.dumps({"cmd": cmd}).decode()
    return {"id": call_id, "type": "function", "function": {"name": "shell", "arguments": args}}


def script(sid: str) -> list[events.Interaction]:
    base = examples.interaction(prompt_tokens=8, response_tokens=4)
    msgs: list[dict] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the failing import, then commit."},
    ]
    steps = [  # (tool call of the turn, what follows it)
        ("grep -rn parse_config .", [("tool", "app/cli.py:3:from app.settings import x")]),
        ("pytest -q", [("tool", "ImportError: cannot import\n1 failed")]),
        ("pytest -q", [("tool", "ImportError: cannot import\n1 failed")]),
        (
            "pytest -q && git push --force origin main",
            [("tool", "done"), ("user", "Thanks, that works")],
        ),
        ("git commit -am fix", []),
    ]
    out = []
    for t, (cmd, follow) in enumerate(steps):
        call = shell(f"c{t}", cmd)
        out.append(
            dataclasses.replace(
                base,
                event_id=f"{sid}-i{t}",
                session_id=sid,
                turn=t,
                ts_ms=1_790_000_000_000 + t,
                messages=[dict(m) for m in msgs],
                tool_calls=[call],
                response_text="",
                prompt_token_ids=[t, t + 1, t + 2],
                response_token_ids=[100 + t, 200 + t],
                response_logprobs=[-0.5, -0.25],
                session_done=t == 4,
            )
        )
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        for role, text in follow:
            extra = {"tool_call_id": f"c{t}"} if role == "tool" else {}
            msgs.append({"role": role, "content": text, **extra})
    return out


def high_watermarks(settings: Settings) -> dict[tuple[str, int], int]:
    c = Consumer(settings.kafka_client_config(**{"group.id": "hw-probe"}))
    marks = {}
    for topic in OUT_TOPICS:
        for p in c.list_topics(topic, timeout=10).topics[topic].partitions:
            marks[(topic, p)] = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
    c.close()
    return marks


def input_ends(settings: Settings) -> dict[tuple[str, int], int]:
    """End offsets of the worker's input topics."""
    c = Consumer(settings.kafka_client_config(**{"group.id": "hw-probe"}))
    marks = {}
    for topic in (names.INTERACTIONS, names.NEXT_STATES, names.HINTS):
        for p in c.list_topics(topic, timeout=10).topics[topic].partitions:
            marks[(topic, p)] = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
    c.close()
    return marks


def start_group_at(settings: Settings, group: str, offsets: dict[tuple[str, int], int]) -> None:
    """A fresh worker group reads only what the test wrote, not the broker's history: read
    first, history could decide in which order the topics' records meet (a hint read after
    its session was assembled is not in its sample)."""
    from confluent_kafka import ConsumerGroupTopicPartitions
    from confluent_kafka.admin import AdminClient

    tps = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
    admin = AdminClient(settings.kafka_client_config())
    (fut,) = admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(group, tps)]).values()
    fut.result(60)


class Collector:
    """Reads the output topics from given offsets, keeping this session's events."""

    def __init__(self, settings: Settings, sid: str, start: dict[tuple[str, int], int]) -> None:
        self.sid = sid.encode()
        self.c = Consumer(settings.kafka_client_config(**{"group.id": f"collect-{sid}"}))
        self.c.assign([TopicPartition(t, p, o) for (t, p), o in start.items()])
        self.by_topic: dict[str, list[events.Event]] = defaultdict(list)

    def poll_until(self, done, proc, limit_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + limit_s
        while not done(self.by_topic) and time.monotonic() < deadline and proc.poll() is None:
            for msg in self.c.consume(500, timeout=0.5):
                if msg.error() is None and msg.key() == self.sid:
                    self.by_topic[msg.topic()].append(events.decode(msg.value()))

    def close(self) -> None:
        self.c.close()


def start_worker(
    app_id: str, sid: str, rules: Path, tmp: Path, *args: str, **processor_env: str
) -> subprocess.Popen:
    """A worker subprocess; ``args`` are more ``liverl workers`` options, ``processor_env``
    sets more ``LIVERL_PROCESSORS_*`` variables. Restarts of the same app id append to one
    log."""
    env = dict(os.environ)
    env.update(
        LIVERL_PROCESSORS_SESSION_PREFIX=sid,
        LIVERL_PROCESSORS_RULES_PATH=str(rules),
        LIVERL_PROCESSORS_GRACE_S="3",
        LIVERL_PROCESSORS_SWEEP_INTERVAL_S="1",
        LIVERL_STATE_DIR=str(tmp),
    )
    env.update({f"LIVERL_PROCESSORS_{k.upper()}": v for k, v in processor_env.items()})
    code = "from pipeline.processors.commands import workers; workers()"
    return subprocess.Popen(
        [sys.executable, "-c", code, "--app-id", app_id, "--no-web", "-l", "warn", *args],
        env=env,
        stdout=open(tmp / f"{app_id}.log", "ab"),
        stderr=subprocess.STDOUT,
    )


def drop_internal_topics(settings: Settings, app_id: str) -> None:
    """Faust creates changelog and assignor topics per app id: remove this test's."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka_client_config())
    mine = [t for t in admin.list_topics(timeout=10).topics if t.startswith(f"{app_id}-")]
    if mine:
        for fut in admin.delete_topics(mine, operation_timeout=30).values():
            fut.result()


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def complete(by_topic) -> bool:  # type: ignore[no-untyped-def]
    pairing = [e for e in by_topic[names.NEXT_STATES] if e.source == "pairing"]
    return (
        len({e.event_id for e in pairing}) >= 5
        and len({e.event_id for e in by_topic[names.SAMPLES]}) >= 5
        and len({e.event_id for e in by_topic[names.DLQ]}) >= 2
    )


def test_session_end_to_end_and_replay_is_deterministic(kafka_settings, unique, tmp_path):
    sid = f"itest-{unique}"
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    start = high_watermarks(kafka_settings)
    inputs = input_ends(kafka_settings)
    producer = EventProducer(kafka_settings, client_id="itest", partitioner="murmur2_random")
    turns = script(sid)
    # An outside hint counts only if it is read before its session is assembled; the worker
    # reads the hints and interactions topics interleaved, in no set order, and with the
    # inline judge assembles as soon as the last turn is judged: hint_wait_s holds it open.
    hint = events.Hint(
        event_id=f"{sid}-hint0",
        producer=events.Producer(component="itest", version="1"),
        parents=[turns[0].event_id],
        session_id=sid,
        turn=0,
        hint="Search with grep -rn before editing any import.",
        judge_id="itest",
        rank=0,
    )
    producer.send(names.HINTS, hint)
    producer.flush()
    side = dataclasses.replace(turns[1], event_id=f"{sid}-side", turn_type="side", turn=2)
    for inter in turns[:2] + [side] + turns[2:]:
        producer.send(names.INTERACTIONS, inter)
    producer.send_raw(names.INTERACTIONS, b'{"type": "interaction", "turn": ', key=sid)
    stray = dataclasses.replace(
        examples.examples()["next_state"],
        event_id=f"{sid}-stray",
        session_id=sid,
        turn=9,
        source="feedback-endpoint",
    )
    producer.send(names.NEXT_STATES, stray)
    producer.flush()

    runs = []
    for run in range(2):
        # Each run reads only what it wrote itself: from the end of what was there before it.
        col = Collector(kafka_settings, sid, start if run == 0 else high_watermarks(kafka_settings))
        start_group_at(kafka_settings, f"itest-{unique}-{run}", inputs)
        proc = start_worker(f"itest-{unique}-{run}", sid, rules, tmp_path, hint_wait_s="2")
        try:
            col.poll_until(complete, proc)
        finally:
            stop(proc)
            col.close()
            drop_internal_topics(kafka_settings, f"itest-{unique}-{run}")
        counts = {t: len(v) for t, v in col.by_topic.items()}
        log = (tmp_path / f"itest-{unique}-{run}.log").read_text()[-3000:]
        assert complete(col.by_topic), f"run {run}: {counts}\n{log}"
        runs.append(col.by_topic)

    first = runs[0]
    ns = sorted(
        (
            e
            for e in {e.event_id: e for e in first[names.NEXT_STATES]}.values()
            if e.source == "pairing"
        ),
        key=lambda e: e.turn,
    )
    ids = [i.event_id for i in turns]
    assert [(e.turn, e.kind, e.role, e.content) for e in ns] == [
        (0, "tool_result", "tool", "app/cli.py:3:from app.settings import x"),
        (1, "tool_result", "tool", "ImportError: cannot import\n1 failed"),
        (2, "tool_result", "tool", "ImportError: cannot import\n1 failed"),
        (3, "user_reply", "user", "done\nThanks, that works"),
        (4, "session_end", None, ""),
    ]
    assert [e.event_id for e in ns[:4]] == [
        events.derive_event_id("next_state", [ids[t], ids[t + 1]], "pairing-1", ns[t].kind)
        for t in range(4)
    ]
    assert ns[4].event_id == events.derive_event_id(
        "next_state", [ids[4]], "pairing-1", "session_end"
    )

    prm = {e.turn: e for e in first[names.PRM_SCORES]}
    assert {t: (p.score, p.votes) for t, p in prm.items()} == {
        0: (0, [0]),
        1: (0, [0]),
        2: (0, [0]),
        3: (1, [1]),
        4: (0, [0]),
    }
    assert prm[3].parents == [ids[3], ns[3].event_id]

    pen = {e.turn: e for e in first[names.PATH_PENALTIES]}
    # F = Phi(s') - Phi(s) (rules: phi_min -0.7): turn 2 pytest's 2nd failure (N = 1): -0.2;
    # turn 3 a force push -0.3 and pytest, penalised, succeeding: a refund of mu, +0.05; turn
    # 4 commits after test runs that never reported a verified pass: no violation, no progress
    expect_phi = {0: 0.0, 1: 0.0, 2: -0.2, 3: -0.25, 4: 0.0}
    assert {t: p.penalty for t, p in pen.items()} == pytest.approx(expect_phi)
    # compliance_bonus is what progress and paid-back debt raised, net within the turn: turn
    # 3's refund (+0.05) sits beside a bigger violation (-0.3), so the debt rose and it is 0
    assert {t: p.compliance_bonus for t, p in pen.items()} == pytest.approx(
        {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}
    )
    assert pen[2].rule_ids == ["repeated"]
    assert pen[3].rule_ids == ["forbidden", "repeated"]
    assert pen[4].rule_ids == []

    rewards = {e.turn: e for e in first[names.REWARDS]}
    # turn 2: judge 0 and no outcome, so its shaping alone is no signal (issue 38): total 0;
    # its path part goes to the next judged turn (the failures its output reported without an
    # exit code are not hidden that way): turn 3 is 1 + 0.5 * (-0.2 - 0.25) = 0.775
    expect_total = {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.775, 4: 0.0}
    assert {t: r.total for t, r in rewards.items()} == pytest.approx(expect_total)
    assert {t: r.prm for t, r in rewards.items()} == {0: 0, 1: 0, 2: 0, 3: 1, 4: 0}
    assert all(r.outcome == 0 for r in rewards.values())

    samples = {e.turn: e for e in first[names.SAMPLES]}
    assert sorted(samples) == [0, 1, 2, 3, 4]  # the side turn never becomes a sample
    masks = {  # (loss_mask, opd_mask, masked): turn 0 is OPD-only, turns 1, 2, 4 carry nothing
        0: ([0, 0], [1, 1], False),
        1: ([0, 0], [0, 0], True),
        2: ([0, 0], [0, 0], True),
        3: ([1, 1], [0, 0], False),
        4: ([0, 0], [0, 0], True),
    }
    for t, s in samples.items():
        assert (s.prompt_token_ids, s.response_token_ids) == ([t, t + 1, t + 2], [100 + t, 200 + t])
        assert (s.loss_mask, s.opd_mask, s.masked) == masks[t], t
        assert s.behavior_logprobs == [-0.5, -0.25]
        assert s.behavior_weight_version == 12 and s.step_index == t
        assert s.reward == pytest.approx(expect_total[t])
        assert s.parents == [ids[t], rewards[t].event_id]
    assert samples[0].hints == [hint.hint] and samples[0].penalty == 0.0
    assert samples[3].penalty == pytest.approx(-0.225)  # beta * F, kept for group z-scoring

    # The hinted zero-score turn trains through its hint (OPD), and only that way.
    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.trainer.config import TrainerSettings
    from pipeline.trainer.core import TrainerCore

    tiny = ensure_tiny_model(tmp_path / "tiny")
    opd_only = dataclasses.replace(samples[0], behavior_weight_version=0)
    for method, status in (("opd", "trained"), ("hybrid", "trained"), ("rl", "masked")):
        # gate off: no sample is held out for it (a tenth, by hash of the random event id)
        cfg = TrainerSettings(
            model=str(tiny), method=method, device="cpu", old_logprobs="trainer", gate=False
        )
        result = TrainerCore.load(cfg).train_step([opd_only], current_version=0)
        assert result.outcomes[0].status == status, method
        assert result.trained_tokens == (2 if method != "rl" else 0), method
        if method != "rl":
            assert result.losses["opd"] != 0.0 and result.grad_norm, method

    dlq = {e.event_id: e for e in first[names.DLQ]}.values()
    errors = sorted(d.error for d in dlq)
    assert any("malformed JSON" in e for e in errors), errors
    assert any("unknown turn 9" in e for e in errors), errors

    # Replay under a new consumer group: the very same event ids, nothing new.
    def derived(by_topic, topic):  # type: ignore[no-untyped-def]
        return {e.event_id for e in by_topic[topic] if getattr(e, "source", "pairing") == "pairing"}

    for topic in OUT_TOPICS:
        assert derived(runs[1], topic) == derived(first, topic), topic


def group_session(sid: str, group: str, reply: str) -> list[events.Interaction]:
    """Two turns without tool calls: the user's reply to turn 0, then done."""
    base = examples.interaction(prompt_tokens=8, response_tokens=4)
    first = [{"role": "user", "content": "Fix the failing import."}]
    second = first + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": reply}]
    return [
        dataclasses.replace(
            base,
            event_id=f"{sid}-i{t}",
            session_id=sid,
            turn=t,
            messages=msgs,
            tool_calls=[],
            response_text="Done.",
            prompt_token_ids=[t],
            response_token_ids=[100 + t],
            response_logprobs=[-0.5],
            session_done=t == 1,
            group_id=group,
        )
        for t, msgs in enumerate([first, second])
    ]


def test_group_of_two_sessions_is_zscored_within_group_and_step(
    kafka_settings, unique, tmp_path, monkeypatch
):
    """Sessions a and b attempt the same task (group g, size 2). Rule judge: a's turn 0 is
    thanked (+1), b's corrected (-1); the turn-1 session ends carry no signal (masked). Same
    tool calls (none), so the same beta*Phi on both: step 0 has mean beta*Phi, std 1, and the
    samples' rewards become +1 and -1; masked turn-1 samples are left at their raw reward."""
    prefix = f"gtest-{unique}"
    sa, sb, group = f"{prefix}-a", f"{prefix}-b", f"{prefix}-g"
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    start = high_watermarks(kafka_settings)
    producer = EventProducer(kafka_settings, client_id="itest", partitioner="murmur2_random")
    for inter in group_session(sa, group, "Thanks, that works") + group_session(
        sb, group, "That doesn't work, it still fails"
    ):
        producer.send(names.INTERACTIONS, inter)
    producer.flush()
    c = Consumer(kafka_settings.kafka_client_config(**{"group.id": f"collect-{prefix}"}))
    c.assign([TopicPartition(t, p, o) for (t, p), o in start.items()])
    got: dict[str, dict[str, events.Event]] = defaultdict(dict)
    app_id = f"gtest-{unique}"
    monkeypatch.setenv("LIVERL_PROCESSORS_GROUP_SIZE", "2")
    proc = start_worker(app_id, prefix, rules, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while len(got[names.SAMPLES]) < 4 and time.monotonic() < deadline and proc.poll() is None:
            for msg in c.consume(500, timeout=0.5):
                if msg.error() is None and msg.key() in (sa.encode(), sb.encode()):
                    ev = events.decode(msg.value())
                    got[msg.topic()][ev.event_id] = ev
    finally:
        stop(proc)
        c.close()
        drop_internal_topics(kafka_settings, app_id)
    log = (tmp_path / f"{app_id}.log").read_text()[-3000:]
    assert len(got[names.SAMPLES]) == 4, log
    rewards = {(r.session_id, r.turn): r.total for r in got[names.REWARDS].values()}  # type: ignore[attr-defined]
    assert rewards[(sa, 0)] - rewards[(sb, 0)] == pytest.approx(2.0)  # +1 vs -1, same Phi
    samples = {(s.session_id, s.turn): s for s in got[names.SAMPLES].values()}  # type: ignore[attr-defined]
    assert {k: s.group_id for k, s in samples.items()} == dict.fromkeys(samples, group)
    assert samples[(sa, 0)].reward == pytest.approx(1.0, abs=1e-5)
    assert samples[(sb, 0)].reward == pytest.approx(-1.0, abs=1e-5)
    for sid in (sa, sb):
        s1 = samples[(sid, 1)]
        assert s1.masked and s1.reward == pytest.approx(rewards[(sid, 1)])


def group_members(settings: Settings, group: str) -> dict[str, set[int]]:
    """Member id -> the ``interactions`` partitions it holds, in consumer group ``group``."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka_client_config())
    desc = admin.describe_consumer_groups([group])[group].result(timeout=10)
    return {
        m.member_id: {
            tp.partition for tp in m.assignment.topic_partitions if tp.topic == names.INTERACTIONS
        }
        for m in desc.members
    }


def test_two_worker_processes_share_the_partitions_of_one_group(
    kafka_settings: Settings, unique: str, tmp_path: Path
) -> None:
    """``liverl workers --processes 2``: both children join the one consumer group (the app
    id) and each holds some of the partitions; then sessions on every partition (two each,
    chosen by the murmur2 hash of their ids) get their samples."""
    from aiokafka.partitioner import murmur2

    prefix = f"ptest-{unique}"
    app_id = prefix
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    parts = len({p for (t, p) in high_watermarks(kafka_settings) if t == names.SAMPLES})
    sids: dict[int, list[str]] = defaultdict(list)
    k = 0
    while any(len(sids[p]) < 2 for p in range(parts)):
        sid = f"{prefix}-{k}"
        k += 1
        p = (murmur2(sid.encode()) & 0x7FFFFFFF) % parts
        if len(sids[p]) < 2:
            sids[p].append(sid)
    wanted = {sid for group in sids.values() for sid in group}
    start = high_watermarks(kafka_settings)
    c = Consumer(kafka_settings.kafka_client_config(**{"group.id": f"collect-{prefix}"}))
    c.assign([TopicPartition(t, p, o) for (t, p), o in start.items() if t == names.SAMPLES])
    samples: dict[str, set[int]] = defaultdict(set)
    members: dict[str, set[int]] = {}
    proc = start_worker(app_id, prefix, rules, tmp_path, "--processes", "2")
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(Exception):  # the group may not exist yet
                members = group_members(kafka_settings, app_id)
            if len(members) == 2 and all(members.values()):
                break
            time.sleep(1)
        split = dict(members)
        assert len(split) == 2 and all(split.values()), (
            f"group {app_id}: members and their partitions {split}, wanted 2 each holding some "
            f"(worker exit {proc.poll()})\n{(tmp_path / f'{app_id}.log').read_text()[-3000:]}"
        )
        producer = EventProducer(kafka_settings, client_id="itest", partitioner="murmur2_random")
        for sid in sorted(wanted):
            for inter in group_session(sid, "", "Thanks, that works"):
                producer.send(names.INTERACTIONS, dataclasses.replace(inter, group_id=None))
        producer.flush()
        deadline = time.monotonic() + 120
        while (
            sum(map(len, samples.values())) < 2 * len(wanted)
            and time.monotonic() < deadline
            and proc.poll() is None
        ):
            for msg in c.consume(500, timeout=0.5):
                key = (msg.key() or b"").decode()
                if msg.error() is None and key in wanted:
                    samples[key].add(events.decode(msg.value()).turn)  # type: ignore[attr-defined]
    finally:
        stop(proc)
        c.close()
        drop_internal_topics(kafka_settings, app_id)
    log = (tmp_path / f"{app_id}.log").read_text()
    assert set().union(*split.values()) == set(range(parts)), split
    missing = sorted(sid for sid in wanted if samples[sid] != {0, 1})
    assert not missing, f"no samples for {missing} (worker exit {proc.returncode})\n{log[-3000:]}"
    assert "starting 2 worker processes" in log and "exited unexpectedly" not in log, log[-3000:]


def outside_hint(sid: str, turn: int, text: str, parent: str) -> events.Hint:
    return events.Hint(
        event_id=f"{sid}-hint-{turn}",
        producer=events.Producer(component="itest", version="1"),
        parents=[parent],
        session_id=sid,
        turn=turn,
        hint=text,
        judge_id="itest",
        rank=0,
    )


def test_hints_after_close_wait_for_hint_wait_s_then_are_dead_lettered(
    kafka_settings, unique, tmp_path
):
    """A closed session waits ``hint_wait_s`` for outside hints; one that comes after its
    samples left is dead-lettered with the reason, never dropped in silence."""
    sid = f"ihint-{unique}"
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    col = Collector(kafka_settings, sid, high_watermarks(kafka_settings))
    app_id = f"ihint-{unique}"
    start_group_at(kafka_settings, app_id, input_ends(kafka_settings))
    proc = start_worker(app_id, sid, rules, tmp_path, hint_wait_s="5")
    producer = EventProducer(kafka_settings, client_id="itest", partitioner="murmur2_random")
    turns = script(sid)
    try:
        for inter in turns:
            producer.send(names.INTERACTIONS, inter)
        producer.flush()

        def closed(by_topic) -> bool:  # type: ignore[no-untyped-def]
            ends = by_topic[names.NEXT_STATES]
            return any(getattr(e, "kind", None) == "session_end" for e in ends)

        col.poll_until(closed, proc)
        assert closed(col.by_topic), (tmp_path / f"{app_id}.log").read_text()[-3000:]
        assert not col.by_topic[names.SAMPLES]  # closed, and waiting for hints
        early = outside_hint(
            sid, 1, "Read the failing test before running it again.", turns[1].event_id
        )
        producer.send(names.HINTS, early)
        producer.flush()
        col.poll_until(lambda b: len(b[names.SAMPLES]) >= 5, proc)
        samples = {e.turn: e for e in col.by_topic[names.SAMPLES]}
        assert sorted(samples) == [0, 1, 2, 3, 4], (tmp_path / f"{app_id}.log").read_text()[-3000:]
        assert early.hint in samples[1].hints

        late = outside_hint(sid, 2, "Too late for this session.", turns[2].event_id)
        producer.send(names.HINTS, late)
        producer.flush()

        def late_letter(by_topic) -> list[events.DeadLetter]:  # type: ignore[no-untyped-def]
            return [d for d in by_topic[names.DLQ] if "after the session was assembled" in d.error]

        col.poll_until(lambda b: bool(late_letter(b)), proc, limit_s=60)
        letters = late_letter(col.by_topic)
        # Only the late outside hint: the judge's own hints, read back after the session was
        # assembled, are not letters.
        assert len({d.event_id for d in letters}) == 1, letters
        assert events.decode(letters[0].original()) == late
        assert {e.event_id for e in col.by_topic[names.SAMPLES]} == {
            s.event_id for s in samples.values()
        }
    finally:
        stop(proc)
        col.close()
        drop_internal_topics(kafka_settings, app_id)


def test_changelogs_are_compacted_within_bounded_time(
    kafka_settings: Settings, admin: Any, unique: str, tmp_path: Path
) -> None:
    """A restarted worker reads its changelogs back: they must not keep every stale value
    for the 7 days of Kafka's default segments. New changelogs get the bounds, and so do
    changelogs created before them (an upgraded deployment)."""
    from confluent_kafka.admin import ConfigResource, NewTopic

    from pipeline.processors.app import create_app
    from pipeline.processors.internal_topics import CHANGELOG_COMPACTION, ensure_internal_topics

    app_id = f"compact-{unique}"
    settings = kafka_settings.model_copy(update={
        "state_dir": tmp_path,
        "processors": kafka_settings.processors.model_copy(
            update={"app_id": app_id, "web_enabled": False}),
    })  # fmt: skip
    older = f"{app_id}-tokens-changelog"  # as an earlier release created it: no bounds
    created = admin.create_topics([NewTopic(older, 6, 1, config={"cleanup.policy": "compact"})])
    created[older].result(30)
    app = create_app(settings, settings.processors, settings.state_dir)
    ensure_internal_topics(app, settings)
    names_ = [f"{app_id}-{t}-changelog" for t in ("sessions", "tokens", "parked")]
    configs = admin.describe_configs([ConfigResource("topic", n) for n in names_])
    for res, fut in configs.items():
        got = {k: v.value for k, v in fut.result(30).items()}
        assert {k: got[k] for k in CHANGELOG_COMPACTION} == CHANGELOG_COMPACTION, res.name
        assert got["cleanup.policy"] == "compact", res.name
    assert int(CHANGELOG_COMPACTION["max.compaction.lag.ms"]) <= 3_600_000


def feedback(sid: str, key_id: str, thumbs: str, ts_ms: int, text: str = "",
             score: float | None = None) -> events.NextState:  # fmt: skip
    """A ``POST /v1/feedback`` on turn 0, as the gateway records it."""
    from pipeline.serving.feedback import FeedbackRequest, feedback_event

    req = FeedbackRequest(session_id=sid, turn=0, thumbs=thumbs, score=score,  # type: ignore[arg-type]
                          text=text or None)  # fmt: skip
    return dataclasses.replace(feedback_event(req, 0, key_id), ts_ms=ts_ms)


def chat_session(sid: str, reply: str, t0: int) -> list[events.Interaction]:
    """Turn 0, then the user's ``reply`` in turn 1, which ends the session (no tool calls)."""
    base = examples.interaction(prompt_tokens=8, response_tokens=4)
    first = [{"role": "user", "content": "Explain Kafka partitions."}]
    second = [*first, {"role": "assistant", "content": "They split a topic."},
              {"role": "user", "content": reply}]  # fmt: skip
    return [
        dataclasses.replace(
            base,
            event_id=f"{sid}-i{t}",
            session_id=sid,
            turn=t,
            ts_ms=t0 + t,
            messages=msgs,
            tool_calls=[],
            response_text="They split a topic.",
            prompt_token_ids=[t],
            response_token_ids=[100 + t],
            response_logprobs=[-0.5],
            session_done=t == 1,
        )  # fmt: skip
        for t, msgs in enumerate([first, second])
    ]


def original_id(letter: events.DeadLetter) -> str:
    """The id of the next state a letter is about: the record itself, or (a vote replaced
    after it had counted) the letter's description of it."""
    raw = letter.original()
    try:
        return events.decode(raw).event_id
    except Exception:  # noqa: BLE001 - not an event: the description
        return str(orjson.loads(raw)["event_id"])


def test_feedback_counts_once_per_caller_and_every_vote_left_out_is_dead_lettered(
    kafka_settings, unique, tmp_path
):
    """The issue's repro: one turn, 1,000 feedbacks of one caller (thumbs up, down every 10th,
    2 KB of text each), then a closing turn. Was: 1,001 verdicts for turn 0 (mean 0.80) while
    the reward counted only the votes read before the closing turn (0.80 x ~400/1,000 read),
    with no dead letter: the rest came after the session was assembled and were dropped.

    Now a caller's latest vote per turn counts, and with processors.feedback_voters_per_turn
    = 2 so do the votes of the first two callers. Caller k: 1,000 votes, the last (999) up;
    caller a: score 0.5 (its sign, +1); caller b: over the cap; the reply "Next question."
    is 0 to the rules judge. Turn 0: prm = (0 + 1 + 1) / 3 = 2/3, no penalty (no tool
    calls). Every other vote is a dead letter: 999 superseded, b over the cap, and c, sent
    after the samples, too late."""
    sid = f"ifb-{unique}"
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    col = Collector(kafka_settings, sid, high_watermarks(kafka_settings))
    app_id = f"ifb-{unique}"
    start_group_at(kafka_settings, app_id, input_ends(kafka_settings))
    proc = start_worker(app_id, sid, rules, tmp_path, "--judge", "rules", hint_wait_s="5",
                        feedback_voters_per_turn="2")  # fmt: skip
    producer = EventProducer(kafka_settings, client_id="itest", partitioner="murmur2_random")
    t0 = events.now_ms()
    turns = chat_session(sid, "Next question.", t0)
    text = ("The answer was fine, I suppose. " * 64)[:2048]
    votes = [feedback(sid, "k", "down" if i % 10 == 0 else "up", t0 + 10 + i, text)
             for i in range(1000)]  # fmt: skip
    a = feedback(sid, "a", "up", t0 + 600, score=0.5)
    b = feedback(sid, "b", "down", t0 + 601)
    superseded = {v.event_id for v in votes[:-1]}

    def letters(by) -> dict[str, events.DeadLetter]:  # type: ignore[no-untyped-def]
        return {original_id(d): d for d in by[names.DLQ]}

    try:
        producer.send(names.INTERACTIONS, turns[0])
        for ev in [*votes[:500], a, b, *votes[500:]]:
            producer.send(names.NEXT_STATES, ev)
        producer.flush()
        # The closing turn travels on another topic: sent before the worker has read every
        # vote, it would close the session first and the votes still unread would be (rightly)
        # dead-lettered as late rather than as superseded. Wait for the worker to reach vote 999.
        col.poll_until(lambda by: superseded <= letters(by).keys(), proc, limit_s=180)
        producer.send(names.INTERACTIONS, turns[1])
        producer.flush()
        col.poll_until(lambda by: len(by[names.SAMPLES]) >= 2, proc, limit_s=180)
        log = (tmp_path / f"{app_id}.log").read_text()[-3000:]
        assert len(col.by_topic[names.SAMPLES]) >= 2, log
        late = feedback(sid, "c", "down", events.now_ms())
        producer.send(names.NEXT_STATES, late)
        producer.flush()

        col.poll_until(lambda by: late.event_id in letters(by), proc, limit_s=60)
        col.poll_until(lambda by: False, proc, limit_s=2)  # anything still on its way
    finally:
        stop(proc)
        col.close()
        drop_internal_topics(kafka_settings, app_id)
    by = col.by_topic
    rewards = {r.turn: r for r in by[names.REWARDS]}
    assert rewards[0].prm == pytest.approx(2 / 3) and rewards[0].total == pytest.approx(2 / 3)
    assert rewards[1].prm == 0.0
    samples = {s.turn: s for s in by[names.SAMPLES]}
    assert samples[0].reward == pytest.approx(2 / 3)

    got = letters(by)
    assert all(d.source_topic == names.NEXT_STATES for d in got.values())
    assert {i for i, d in got.items() if "superseded by a later vote" in d.error} == superseded
    assert {i for i, d in got.items() if "feedback_voters_per_turn" in d.error} == {b.event_id}
    assert {i for i, d in got.items() if "after the session was assembled" in d.error} == {
        late.event_id
    }
    assert set(got) == superseded | {b.event_id, late.event_id}
    # The late vote was the record consumed: its letter names that record on the topic.
    letter = got[late.event_id]
    reader = Consumer(kafka_settings.kafka_client_config(**{"group.id": f"late-{unique}"}))
    try:
        at = TopicPartition(names.NEXT_STATES, letter.source_partition, letter.source_offset)
        reader.assign([at])
        (record,) = reader.consume(1, timeout=10)
    finally:
        reader.close()
    assert record.value() == letter.original() and events.decode(record.value()) == late
    # What counts is in the reward's parents; each of the 1,003 feedbacks either counts or
    # is a letter.
    verdicts = {p.parents[-1]: p for p in by[names.PRM_SCORES]}
    counted = {ns_id for ns_id, v in verdicts.items() if v.event_id in rewards[0].parents}
    sent = {v.event_id for v in [*votes, a, b, late]}
    assert counted & sent == {votes[-1].event_id, a.event_id}
    assert (counted & sent) | set(got) == sent
    # Votes that never count are not judged: no verdict for b's or c's.
    assert b.event_id not in verdicts and late.event_id not in verdicts


@pytest.mark.integration
def test_exactly_once_holds_one_record_per_input_through_repeated_sigkills(
    kafka_settings: Settings, unique: str, tmp_path: Path
) -> None:
    """``--exactly-once`` under load: two worker processes of one group (worker indexes 0 and
    1) while 12 five-turn sessions arrive; three times a worker is SIGKILLed while it
    produces and restarted with its index (fencing what its predecessor left open; the
    survivor's rebalances hand partitions over). A plain read_committed consumer then finds,
    counted from the raw records and not deduplicated, each event id once on every derived
    topic and exactly one reward and one sample per interaction."""
    import threading

    prefix = app_id = f"eosk-{unique}"
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    start = high_watermarks(kafka_settings)
    start_group_at(kafka_settings, app_id, input_ends(kafka_settings))
    sessions = {f"{prefix}-{k}": script(f"{prefix}-{k}") for k in range(12)}
    inputs = {(i.session_id, i.turn) for turns in sessions.values() for i in turns}
    got: dict[str, list[events.Event]] = defaultdict(list)
    c = Consumer(kafka_settings.kafka_client_config(**{"group.id": f"collect-{prefix}"}))
    c.assign([TopicPartition(t, p, o) for (t, p), o in start.items()])
    opts = ("--exactly-once", "--worker-index")
    env = dict(session_timeout_s="6")  # a killed member leaves the group within seconds

    def worker(index: int) -> subprocess.Popen:
        return start_worker(app_id, prefix, rules, tmp_path, *opts, str(index), **env)

    def poll(until, limit_s: float) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + limit_s
        while not until() and time.monotonic() < deadline:
            for msg in c.consume(500, timeout=0.3):
                if msg.error() is None and (msg.key() or b"").startswith(prefix.encode()):
                    got[msg.topic()].append(events.decode(msg.value()))

    def sampled() -> int:
        return len({(e.session_id, e.turn) for e in got[names.SAMPLES]})  # type: ignore[attr-defined]

    def send_all() -> None:  # one turn of every session, then the next turn, 2.5 s apart
        producer = EventProducer(kafka_settings, client_id="itest", partitioner="murmur2_random")
        for t in range(5):
            for turns in sessions.values():
                producer.send(names.INTERACTIONS, turns[t])
            producer.flush()
            time.sleep(2.5)

    procs = [worker(0), worker(1)]
    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    kills = 0
    try:
        for victim in (0, 1, 0):  # each kill while outputs are being written
            before = len(got[names.NEXT_STATES]) + len(got[names.SAMPLES])
            poll(lambda b=before: len(got[names.NEXT_STATES]) + len(got[names.SAMPLES]) > b, 60)
            procs[victim].kill()  # SIGKILL: its open transaction is left behind
            procs[victim].wait(10)
            kills += 1
            procs[victim] = worker(victim)
        sender.join(60)
        poll(lambda: sampled() >= len(inputs), 180)
        poll(lambda: False, 4)  # a duplicate, if any, would be committed by now
        alive = [p.poll() is None for p in procs]
    finally:
        for proc in procs:
            stop(proc)
        c.close()
        drop_internal_topics(kafka_settings, app_id)
    log = (tmp_path / f"{app_id}.log").read_text()[-3000:]
    assert kills == 3 and all(alive), log
    missing = inputs - {(e.session_id, e.turn) for e in got[names.SAMPLES]}  # type: ignore[attr-defined]
    assert not missing, (sorted(missing), log)
    for topic, evs in got.items():
        ids = [e.event_id for e in evs]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        assert twice == [], f"{topic}: {twice} more than once\n{log}"
    for topic in (names.REWARDS, names.SAMPLES):  # one per interaction, by key and turn
        per_turn = [(e.session_id, e.turn) for e in got[topic]]  # type: ignore[attr-defined]
        assert len(per_turn) == len(inputs) and set(per_turn) == inputs, topic
    assert got[names.PRM_SCORES] and got[names.PATH_PENALTIES], log
