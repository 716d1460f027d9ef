"""The versions read model and the live-version rule (pipeline/versions), over hand-built
events: what ``liverl versions`` shows and what every gateway replica loads."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest

from pipeline import events
from pipeline.versions import actions as A
from pipeline.versions.errors import VersionError
from pipeline.versions.table import (
    OutcomeRate,
    VersionLog,
    fold,
    lineage,
    outcome_rates,
    rows,
    served,
    wilson,
)

if TYPE_CHECKING:
    from pipeline.serving.backends.base import Backend

POLICY = "p"
TRAINER = events.Producer(component="trainer", version="test")


def weights(
    version: int,
    status: str = "candidate",
    *,
    parent: int | None = None,
    step: int | None = None,
    metrics: dict | None = None,
    policy: str = POLICY,
    ts: int | None = None,
) -> events.WeightsPublished:
    kind = "weights" if status == "candidate" else "weights_verdict"
    return events.WeightsPublished(
        event_id=events.derive_event_id(kind, [], "t", policy, version),
        ts_ms=1_000 * version if ts is None else ts,
        producer=TRAINER,
        policy_id=policy,
        version=version,
        parent=(version - 1 or None) if parent is None else parent,
        uri=f"file:///w/{policy}/v{version}/",
        files=[
            {"path": "adapter.safetensors", "sha256": "a" * 64, "bytes": 100 * version},
            {"path": "config.json", "sha256": "b" * 64, "bytes": 10},
        ],
        step=10 * version if step is None else step,
        status=status,  # type: ignore[arg-type]
        consumed_offsets={"0": version},
        metrics=metrics or {},
    )


def promoted(*versions: int) -> list[events.WeightsPublished]:
    """Each version's candidate, then the gate's promotion."""
    return [e for v in versions for e in (weights(v), weights(v, "promoted"))]


def act(
    log: VersionLog,
    kind: str,
    asked: int | None,
    by: str = "alice",
    reason: str | None = None,
    require_promoted: bool = True,
) -> events.WeightsPublished:
    ev = A.action_event(
        log, kind, asked, by=by, reason=reason, require_promoted=require_promoted, ts_ms=99_000
    )
    assert ev is not None
    log.add(ev)
    return ev


# ---- Wilson interval ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("passed", "total", "lo", "hi"),
    [
        # by hand: z = 1.96, z² = 3.8415; 0/10: hi = (z²/n) / (1 + z²/n) = 0.38415 / 1.38415
        (0, 10, 0.0, 0.277533),
        # 5/10: centre 0.5, half = 1.96·√(0.025 + 0.0096)/1.38415 = 0.263408
        (5, 10, 0.236592, 0.763408),
        (10, 10, 0.722467, 1.0),
        # 1/1: centre (1 + 1.92)/4.84 = 0.60331, half = 1.96·√(0.96037)/4.84 = 0.39686 (lo .20645)
        (1, 1, 0.206549, 1.0),
    ],
)
def test_wilson_matches_hand_computed_values(passed: int, total: int, lo: float, hi: float) -> None:
    got = wilson(passed, total)
    assert got is not None
    assert got[0] == pytest.approx(lo, abs=2e-5) and got[1] == pytest.approx(hi, abs=2e-5)


def test_wilson_of_nothing_is_unknown() -> None:
    assert wilson(0, 0) is None
    assert OutcomeRate(0, 0).rate is None and OutcomeRate(0, 0).interval is None


# ---- the live version -----------------------------------------------------------------------


def test_newest_promoted_serves_and_rejected_never_does() -> None:
    log = fold(POLICY, [*promoted(1, 2), weights(3), weights(3, "rejected"), weights(4)])
    assert log.live(require_promoted=True) == 2
    assert log.live(require_promoted=False) == 4, "a candidate serves without the gate"
    assert log.preference(False) == [4, 2, 1], "rejected v3 is never a fallback"
    assert log.preference(True, failed={2}) == [1]


def test_pin_holds_until_unpin_and_never_falls_back() -> None:
    log = fold(POLICY, promoted(1, 2, 3))
    act(log, "pin", 2, reason="v3 regressed")
    for ev in promoted(4, 5):
        log.add(ev)
    assert log.live(True) == 2, "newer promotions do not move a pin"
    assert log.preference(True, failed={2}) == [], "a pinned version that fails is not replaced"
    act(log, "unpin", None)
    assert log.pinned is None and log.live(True) == 5


def test_rollback_withdraws_newer_versions_until_a_later_one() -> None:
    log = fold(POLICY, [*promoted(1, 2, 3), weights(4)])
    ev = act(log, "rollback", None, reason="bad answers")
    assert ev.version == 2 and ev.action == {
        "kind": "rollback",
        "by": "alice",
        "reason": "bad answers",
    }
    assert log.live(True) == 2 and log.withdrawn == {3, 4}
    log.add(weights(4, "promoted"))
    assert log.live(True) == 2, "a verdict on a withdrawn version does not bring it back"
    log.add(weights(5, parent=2))
    log.add(weights(5, "promoted", parent=2))
    assert log.live(True) == 5, "a version published after the rollback serves"
    act(log, "rollback", 1, reason="further")
    assert log.live(True) == 1 and 5 in log.withdrawn
    act(log, "promote", 3)
    assert log.live(True) == 3 and log.status[3] == "promoted", "promote restores a version"


def test_promote_overrides_the_gate() -> None:
    log = fold(POLICY, [*promoted(1), weights(2), weights(2, "rejected")])
    act(log, "promote", 2, reason="the gate's probe is flaky")
    assert log.status[2] == "promoted" and log.live(True) == 2
    log.add(weights(2, "rejected"))  # a re-sent verdict (recovery) repeats the id: ignored
    assert log.status[2] == "promoted"


def test_other_policies_and_repeated_ids_are_ignored() -> None:
    log = fold(POLICY, [*promoted(1), weights(7, "promoted", policy="other"), *promoted(1)])
    assert sorted(log.manifests) == [1] and len(log.events) == 2


# ---- actions: exactly once, clear refusals --------------------------------------------------


def test_a_retried_command_is_not_a_second_action() -> None:
    log = fold(POLICY, promoted(1, 2, 3))
    first = act(log, "pin", 2, reason="why")
    log.add(weights(4))  # the trainer publishes in between: not the basis
    assert A.action_event(log, "pin", 2, by="alice", reason="why", require_promoted=True) is None
    again = A.action_event(
        fold(POLICY, [*promoted(1, 2, 3)]),
        "pin",
        2,
        by="alice",
        reason="why",
        require_promoted=True,
    )
    assert again is not None and again.event_id == first.event_id, "deterministic id"
    act(log, "unpin", None)
    second = act(log, "pin", 2, reason="why")
    assert second.event_id != first.event_id, "pin, unpin, pin again is a new action"
    assert second.parents != first.parents


def test_a_retry_after_an_ambiguous_failure_resends_the_same_id() -> None:
    log = fold(POLICY, promoted(1, 2))
    ev = A.action_event(log, "rollback", None, by="bob", reason=None, require_promoted=True)
    assert ev is not None  # never reached the log (timeout), retried, and both land:
    log.add(ev)
    log.add(ev)
    assert [a.kind for a in log.actions] == ["rollback"]


def test_the_action_event_is_valid_on_the_wire() -> None:
    log = fold(POLICY, promoted(1, 2))
    ev = act(log, "pin", 1, reason=None)
    back = events.decode(events.encode(ev), expected_type="weights")
    assert back == ev and back.files == log.manifests[1].files and back.step == 10


@pytest.mark.parametrize(
    ("history", "kind", "asked", "message"),
    [
        (promoted(1, 2), "pin", 9, "has no version 9"),
        ([], "promote", 1, "none yet"),
        (promoted(1, 2), "unpin", None, "is not pinned"),
        ([*promoted(1), weights(2), weights(2, "rejected")], "pin", 2, "rejected"),
        (promoted(1), "rollback", None, "no servable version older"),
        (promoted(1, 2), "rollback", 2, "not older than the live v2"),
        ([*promoted(1), weights(2), *promoted(3)], "rollback", 2, "is candidate"),
    ],
)
def test_refusals_say_what_to_do(history: list, kind: str, asked: int | None, message: str) -> None:
    log = fold(POLICY, history)
    with pytest.raises(VersionError, match=message) as info:
        A.action_event(log, kind, asked, by="a", reason=None, require_promoted=True)
    assert info.value.exit_code == 2


def test_rollback_while_pinned_is_refused() -> None:
    log = fold(POLICY, promoted(1, 2, 3))
    act(log, "pin", 3)
    with pytest.raises(VersionError, match="pinned at v3"):
        A.action_event(log, "rollback", 1, by="a", reason=None, require_promoted=True)


# ---- the table ------------------------------------------------------------------------------


def status(replica: str, version: int, ts: int, ok: bool = True) -> events.ServingStatus:
    return events.ServingStatus(
        event_id=f"s-{replica}-{version}-{ts}",
        ts_ms=ts,
        producer=TRAINER,
        replica_id=replica,
        policy_id=POLICY,
        version=version,
        reload_ms=1.0,
        ok=ok,
    )


def test_served_since_and_until_from_reload_reports() -> None:
    got = served(
        POLICY,
        [
            status("r0", 1, 100),
            status("r1", 1, 110),
            status("r0", 2, 200),
            status("r1", 2, 205),
            status("r1", 3, 300, ok=False),  # a failed reload changes nothing
        ],
    )
    assert got[1].since_ms == 100 and got[1].until_ms == 200 and got[1].replicas == ()
    assert got[2].since_ms == 200 and got[2].until_ms is None
    assert got[2].replicas == ("r0", "r1") and 3 not in got


def test_outcome_rate_counts_a_session_once_per_version() -> None:
    got = outcome_rates(
        POLICY,
        [
            (POLICY, 1, "s1", 1.0),
            (POLICY, 1, "s1", 1.0),  # two turns of one session
            (POLICY, 1, "s2", -1.0),
            (POLICY, 1, "s3", None),  # s3 has no outcome
            (POLICY, 2, "s4", 0.0),
            (POLICY, 2, "s5", math.nan),
            ("other", 2, "s6", 1.0),
        ],
    )
    assert got[1] == OutcomeRate(1, 2) and got[2] == OutcomeRate(0, 1)


def test_rows_carry_the_manifest_verdict_serving_and_outcomes() -> None:
    gate = {
        "gate_won": 5,
        "gate_lost": 1,
        "gate_tied": 2,
        "gate_probe_correct": 7,
        "gate_probe_n": 8,
        "gate_fluency": 0.9,
        "gate_live_fluency": 0.85,
        "gate_reasons": ["x"],
    }
    log = fold(
        POLICY,
        [
            weights(1, metrics={"samples": 12, "reward_mean": 0.1, "method": "opd"}),
            weights(1, "promoted", metrics=gate),
            weights(2, metrics={"samples": 3}),
            weights(2, "rejected"),
        ],
    )
    act(log, "pin", 1, by="ops", reason="freeze")
    table = rows(
        log,
        served(POLICY, [status("r0", 1, 1_500)]),
        {1: OutcomeRate(5, 10)},
        require_promoted=True,
    )
    one, two = table
    assert (one["version"], one["parent"], one["step"], one["steps"]) == (1, None, 10, 10)
    assert (one["samples"], one["method"], one["status"]) == (12, "opd", "promoted")
    assert one["gate"]["gate_won"] == 5 and "gate_reasons" not in one["gate"]
    assert one["served_since_ms"] == 1_500 and one["replicas"] == ["r0"]
    assert one["outcomes"]["rate"] == 0.5 and one["outcomes"]["ci95"][0] == pytest.approx(
        0.236592, abs=2e-5
    )
    assert one["size_bytes"] == 110 and one["live"] and one["pinned"]
    assert (two["steps"], two["status"], two["outcomes"], two["live"]) == (
        10,
        "rejected",
        None,
        False,
    )
    assert lineage(log, 2) == [2, 1]
    assert [(a.kind, a.by, a.reason) for a in log.actions] == [("pin", "ops", "freeze")]


# ---- the gateway's reloader follows the actions ---------------------------------------------


class FakeBackend:
    """Records the versions it was told to load; a version whose folder lacks its files fails
    in the reloader's check, before the backend sees it."""

    def __init__(self) -> None:
        self.policy_id = POLICY
        self.loaded: list[int] = []

    @property
    def version(self) -> int:
        return self.loaded[-1] if self.loaded else 0

    async def reload(self, path: Path, version: int) -> None:
        self.loaded.append(version)


def on_disk(root: Path, ev: events.WeightsPublished) -> events.WeightsPublished:
    """The event pointing at a real folder holding its files."""
    folder = root / f"v{ev.version}"
    folder.mkdir(exist_ok=True)
    files = []
    for i in range(2):
        data = f"v{ev.version} file {i}".encode()
        (folder / f"f{i}").write_bytes(data)
        files.append(
            {"path": f"f{i}", "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        )
    ev.uri, ev.files = folder.as_uri() + "/", files  # type: ignore[assignment]
    return ev


@pytest.fixture
def running_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_the_reloader_follows_pin_unpin_rollback_and_reports_each_load(
    tmp_path: Path, running_loop: asyncio.AbstractEventLoop
) -> None:
    from pipeline.serving.reloader import Reloader
    from pipeline.settings import Settings

    backend = FakeBackend()
    statuses: list[events.ServingStatus] = []
    r = Reloader(
        Settings(),
        cast("Backend", backend),
        running_loop,
        replica_id="r0",
        require_promoted=True,
        emit=lambda _topic, ev: statuses.append(ev),
    )
    for ev in promoted(1, 2, 3):
        r.log.add(on_disk(tmp_path, ev))
    assert r.load_newest() == 3
    act(r.log, "pin", 2, reason="v3 regressed")
    r.log.add(on_disk(tmp_path, weights(4)))
    r.log.add(on_disk(tmp_path, weights(4, "promoted")))
    assert r.load_newest() == 2 and r.load_newest() is None, "pinned: v4 is not loaded"
    act(r.log, "unpin", None)
    assert r.load_newest() == 4
    act(r.log, "rollback", 2)
    assert r.load_newest() == 2
    assert backend.loaded == [3, 2, 4, 2]
    assert [s.version for s in statuses] == [3, 2, 4, 2] and all(s.ok for s in statuses)
    assert statuses[1].event_id != statuses[3].event_id, "served again: a new report"
    assert statuses[3].parents[-1] == r.log.last_action_id


def test_a_pinned_version_that_fails_is_not_replaced(
    tmp_path: Path, running_loop: asyncio.AbstractEventLoop
) -> None:
    from pipeline.serving.reloader import Reloader
    from pipeline.settings import Settings

    backend = FakeBackend()
    r = Reloader(Settings(), cast("Backend", backend), running_loop, replica_id="r0")
    for v in (1, 2, 3):
        r.log.add(on_disk(tmp_path, weights(v)))
    assert r.load_newest() == 3
    act(r.log, "pin", 1, require_promoted=False)
    (tmp_path / "v1" / "f0").write_bytes(b"corrupt")
    assert r.load_newest() is None and backend.version == 3 and 1 in r.failed
    act(r.log, "unpin", None, require_promoted=False)
    assert r.load_newest() is None and backend.version == 3, "unpinned: v3 serves already"


def test_the_gateway_counts_each_operator_action_it_folds_once(
    tmp_path: Path, running_loop: asyncio.AbstractEventLoop
) -> None:
    from prometheus_client import generate_latest

    from pipeline.kafka import Record
    from pipeline.serving.metrics import Metrics
    from pipeline.serving.reloader import Reloader
    from pipeline.settings import Settings

    metrics = Metrics()
    backend = FakeBackend()
    r = Reloader(
        Settings(),
        cast("Backend", backend),
        running_loop,
        replica_id="r0",
        on_action=lambda kind: metrics.actions.labels(kind).inc(),
    )
    log = VersionLog(POLICY)
    evs = [on_disk(tmp_path, ev) for ev in promoted(1, 2, 3)]
    for ev in evs:
        log.add(ev)
    evs += [
        act(log, "rollback", 1),
        act(log, "pin", 2),
        act(log, "unpin", None),
        act(log, "pin", 3),
    ]

    class Batch:
        def __init__(self, records: list[Record[events.Event]]) -> None:
            self.records = records

    class Consumer:  # two polls, the second a redelivery of the first (counted once)
        def poll_batch(self, **_kw: object) -> Batch:
            return Batch([Record(POLICY, 0, i, None, 0, ev) for i, ev in enumerate(evs)])

    r._step(cast("Any", Consumer()))
    r._step(cast("Any", Consumer()))
    text = generate_latest(metrics.registry).decode()
    # 1 rollback, 2 pins, 1 unpin; the trainer's 6 events are not actions
    assert 'liverl_gateway_operator_actions_total{kind="rollback"} 1.0' in text
    assert 'liverl_gateway_operator_actions_total{kind="pin"} 2.0' in text
    assert 'liverl_gateway_operator_actions_total{kind="unpin"} 1.0' in text
    assert backend.version == 3  # pinned at v3


# ---- the commands ---------------------------------------------------------------------------


@pytest.fixture
def cli_log(monkeypatch: pytest.MonkeyPatch) -> tuple[VersionLog, list[events.WeightsPublished]]:
    """``liverl versions`` over a hand-built log: reads return it, sends land in it."""
    from pipeline.versions import commands, reading

    gate = {
        "gate_won": 4,
        "gate_lost": 1,
        "gate_tied": 0,
        "gate_probe_correct": 6,
        "gate_probe_n": 8,
        "gate_live_probe_correct": 5,
        "gate_fluency": 0.91,
        "gate_live_fluency": 0.9,
    }
    log = fold(
        POLICY,
        [
            weights(1, metrics={"samples": 4, "method": "opd"}),
            weights(1, "promoted", metrics=gate),
            *promoted(2),
        ],
    )
    sent: list[events.WeightsPublished] = []

    def produce(_settings: object, ev: events.WeightsPublished) -> None:
        sent.append(ev)
        log.add(ev)

    # the readers' last argument (a timeout) is optional
    monkeypatch.setattr(reading, "weights_log", lambda _s, policy, *_t: log)
    monkeypatch.setattr(
        reading,
        "serving_statuses",
        lambda _s, *_t: [status("r0", 1, 1_000), status("r0", 2, 2_000)],
    )
    monkeypatch.setattr(
        reading,
        "sample_outcomes",
        lambda _s, policy, *_t: [(POLICY, 1, "s1", 1.0), (POLICY, 1, "s2", -1.0)],
    )
    monkeypatch.setattr(commands, "_produce", produce)
    return log, sent


def run_cli(*args: str) -> Any:
    from click.testing import CliRunner

    from pipeline.cli import cli

    return CliRunner().invoke(cli, ["versions", *args, "--policy", POLICY])


def test_list_prints_every_version_as_a_table_and_as_json(cli_log: Any) -> None:
    out = run_cli("list")
    assert out.exit_code == 0, out.output
    assert "promoted 4-1-0" in out.output and "6/8 (live 5)" in out.output
    assert "1/2 50% [9%, 91%]" in out.output and "unknown" in out.output  # v2: no outcome
    doc = json.loads(run_cli("list", "--format", "json").output)
    assert [r["version"] for r in doc] == [1, 2] and doc[1]["live"]
    assert doc[0]["served_until_ms"] == 2_000 and doc[0]["outcomes"]["total"] == 2


def test_show_gives_lineage_and_unknown_sessions_without_the_folder(cli_log: Any) -> None:
    out = run_cli("show", "2")
    assert out.exit_code == 0, out.output
    assert "v2 (2 samples" not in out.output and "v2 (? samples, 10 steps) <- v1" in out.output
    assert "sessions    unknown" in out.output
    doc = json.loads(run_cli("show", "1", "--format", "json").output)
    assert doc["lineage"] == [{"version": 1, "samples": 4, "steps": 10, "step": 10}]
    assert doc["method"] == "opd"


def test_unknown_version_exits_2_with_a_message(cli_log: Any) -> None:
    for args in (("show", "9"), ("pin", "9")):
        out = run_cli(*args)
        assert out.exit_code == 2 and "has no version 9" in out.output
        assert "Traceback" not in out.output
    assert run_cli("unpin").exit_code == 2, "not pinned"


def test_actions_are_sent_once_with_who_and_why(cli_log: Any) -> None:
    log, sent = cli_log
    out = run_cli("pin", "1", "--by", "ops", "--reason", "hold")
    assert out.exit_code == 0 and "v1 should serve now" in out.output, out.output
    again = run_cli("pin", "1", "--by", "ops", "--reason", "hold")
    assert again.exit_code == 0 and "already in the log" in again.output
    assert len(sent) == 1 and sent[0].action == {"kind": "pin", "by": "ops", "reason": "hold"}
    assert run_cli("rollback").exit_code == 2, "refused while pinned"
    assert run_cli("unpin", "--by", "ops").exit_code == 0
    out = run_cli("rollback", "--reason", "bad")
    assert out.exit_code == 0 and "v1 should serve now" in out.output, out.output
    assert [e.action["kind"] for e in sent if e.action] == ["pin", "unpin", "rollback"]
    assert sent[1].action is not None and sent[1].action["by"] == "ops"
    assert log.withdrawn == {2}


@pytest.mark.parametrize(
    "action",
    [
        {"kind": "delete", "by": "a"},  # not an action
        {"kind": "pin"},  # who is required
        {"kind": "pin", "by": ""},
        {"kind": "pin", "by": "a", "when": 1},  # no other fields
    ],
)
def test_the_schema_refuses_a_malformed_action(action: dict[str, Any]) -> None:
    import orjson

    doc = events.to_dict(weights(1))
    doc["action"] = action
    with pytest.raises(events.EventValidationError):
        events.decode(orjson.dumps(doc), expected_type="weights")
