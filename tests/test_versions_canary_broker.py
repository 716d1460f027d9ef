"""The canary runner on the real broker: a canary whose users' outcomes are bad is withdrawn,
the next one, whose outcomes are good, is rolled out, each as one event on the weights topic,
and a restarted runner sends nothing again. Events as the canary interface of issue 39 has
them (``canary_share`` on the servable event), in a replay namespace of their own."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from pipeline import events
from pipeline.kafka import EventProducer, names
from pipeline.settings import Settings
from pipeline.versions.config import CanarySettings
from pipeline.versions.decider import arms
from pipeline.versions.runner import CanaryRunner
from pipeline.versions.table import VersionLog
from tests.test_replay import cli_env, drop, invoke, read_topic

from .test_versions_decider import POLICY, sample, servable

CFG = CanarySettings(min_sessions=10, max_sessions=100)


def weights_log(settings: Settings, topic: str) -> VersionLog:
    log = VersionLog(POLICY)
    for msgs in read_topic(settings, topic).values():
        for m in msgs:
            log.add(events.decode(m.value(), expected_type="weights"))  # type: ignore[arg-type]
    return log


def wait_for(runner: CanaryRunner, thread: threading.Thread, n: int) -> None:
    deadline = time.monotonic() + 90
    while len(runner.sent) < n:
        assert thread.is_alive() and time.monotonic() < deadline, runner.sent
        time.sleep(0.1)


@pytest.mark.integration
def test_a_bad_canary_is_withdrawn_a_good_one_rolled_out_and_a_restart_decides_nothing(
    kafka_settings: Settings, unique: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ns = f"cn{unique}"
    env = {
        **os.environ,
        **cli_env(tmp_path),
        "LIVERL_KAFKA_BOOTSTRAP": kafka_settings.bootstrap,
        "LIVERL_CANARY_MIN_SESSIONS": "10",
        "LIVERL_CANARY_MAX_SESSIONS": "100",
    }
    request.addfinalizer(lambda: drop(env, ns))
    assert invoke(["topics", "apply", "--namespace", ns], env).exit_code == 0
    w, s = names.resolve(names.WEIGHTS, ns), names.resolve(names.SAMPLES, ns)
    producer = EventProducer(kafka_settings, client_id=f"canary-test-{unique}")

    def send(topic: str, *evs: events.Event) -> None:
        for ev in evs:
            key = ev.policy_id if topic == w else ev.session_id  # type: ignore[attr-defined]
            producer.send(topic, ev, key=key)
        producer.flush()

    # v1 serves everyone; v2 enters as a 10 % canary and fails all of its 12 users while v1
    # passes 18 of 20 in the same period
    send(w, *servable(1, None), *servable(2, 0.1))
    send(
        s,
        *[sample(1, f"a{i}", 1.0 if i < 18 else -1.0, 20_000 + i) for i in range(20)],
        *[sample(2, f"b{i}", -1.0, 20_000 + i) for i in range(12)],
    )
    runner = CanaryRunner(
        kafka_settings, CFG, policy_id=POLICY, require_promoted=True, namespace=ns
    )
    stop = threading.Event()
    thread = threading.Thread(target=runner.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(runner, thread, 1)
        # while it follows: v3, trained on from v1 after the withdrawal (a version whose
        # parent is withdrawn would be withdrawn too), becomes the canary and its 12 users all
        # pass, against v1's 7 of 14 since v3 became servable
        send(w, *servable(3, 0.2, parent=1, ts=30_000))
        send(
            s,
            *[sample(3, f"c{i}", 1.0, 40_000 + i) for i in range(12)],
            *[sample(1, f"d{i}", 1.0 if i % 2 else -1.0, 40_000 + i) for i in range(14)],
        )
        wait_for(runner, thread, 2)
    finally:
        stop.set()
        thread.join(30)
    withdrawn, rolled_out = runner.sent
    log = weights_log(kafka_settings, w)
    decisions = [e for e in log.events if e.action is not None]
    assert [
        (e.action["kind"], e.action["by"], e.version)
        for e in decisions  # type: ignore[index]
    ] == [("withdraw", "canary", 2), ("rollout", "canary", 3)]
    assert [e.event_id for e in decisions] == [withdrawn.event_id, rolled_out.event_id]
    f = decisions[0].action["figures"]  # type: ignore[index]
    assert (f["canary_sessions"], f["canary_passed"], f["stable_sessions"], f["stable_passed"]) == (
        12,
        0,
        20,
        18,
    )
    f = decisions[1].action["figures"]  # type: ignore[index]
    assert (f["canary_version"], f["stable_version"], f["canary_share"]) == (3, 1, 0.2)
    assert (f["canary_sessions"], f["stable_sessions"], f["stable_passed"]) == (12, 14, 7)
    assert arms(log, True) == (3, None) and 2 in log.withdrawn

    # a restart folds both topics again: nothing left to decide, nothing sent
    res = invoke(["versions", "canary", "--namespace", ns, "--policy", POLICY, "--once"], env)
    assert res.exit_code == 0 and f"{POLICY}: 0 decision(s) sent" in res.output, res.output
    again = weights_log(kafka_settings, w)
    assert len([e for e in again.events if e.action is not None]) == 2
