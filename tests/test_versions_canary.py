"""The canary in the versions fold (issue 39 item 2): which version is stable, which is the
canary and for what share of users, over hand-built logs; ``arm_fraction``; the rollout and
withdraw actions; and the invariants by hypothesis."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import events
from pipeline.versions import actions as A
from pipeline.versions.errors import VersionError
from pipeline.versions.table import VersionLog, arm_fraction, fold, rows, served

from .test_versions import POLICY, act, status, weights


def with_share(ev: events.WeightsPublished, share: float | None) -> events.WeightsPublished:
    ev.canary_share = share
    return ev


def promoted_canary(
    v: int, share: float = 0.1, *, parent: int | None = None
) -> list[events.WeightsPublished]:
    """v's candidate, then the gate's promotion stamped with a canary share (the trainer's
    servable event when the gate is on)."""
    return [weights(v, parent=parent), with_share(weights(v, "promoted", parent=parent), share)]


def promoted(*versions: int) -> list[events.WeightsPublished]:
    return [e for v in versions for e in (weights(v), weights(v, "promoted"))]


# ---- arm_fraction and routing ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "fraction"),
    [
        # sha256("alice") = 2bd806c97f0e00af 1a1f...; 0x2bd806c97f0e00af = 3159282601090220207,
        # / 2**64 (18446744073709551616) = 0.171265053...
        ("alice", 3159282601090220207 / 2**64),
        # sha256("bob") = 81b637d8fcd2c6da 6359...; 0x81b637d8fcd2c6da = 9346719481748178650,
        # / 2**64 = 0.506686678...
        ("bob", 9346719481748178650 / 2**64),
    ],
)
def test_arm_fraction_is_the_first_8_bytes_of_sha256_over_2_to_the_64(
    key: str, fraction: float
) -> None:
    assert arm_fraction(key) == fraction
    assert arm_fraction(key) == pytest.approx({"alice": 0.171265, "bob": 0.506687}[key], abs=1e-6)


def test_alice_is_in_a_20_percent_canary_and_bob_is_not() -> None:
    assert arm_fraction("alice") < 0.2 <= arm_fraction("bob")
    assert arm_fraction("alice") >= 0.1, "but not in a 10 % one: 0.171 >= 0.1"


def test_routing_shares_over_a_fixed_key_set() -> None:
    keys = [f"session-{i}" for i in range(10_000)]
    fractions = [arm_fraction(k) for k in keys]
    for share in (0.05, 0.1, 0.5):
        n = sum(f < share for f in fractions)
        # binomial(10000, share): sd = sqrt(10000 * share * (1 - share)) <= 50; 4 sd
        assert abs(n - 10_000 * share) <= 4 * (10_000 * share * (1 - share)) ** 0.5, (share, n)
    at_10 = {k for k, f in zip(keys, fractions, strict=True) if f < 0.1}
    at_20 = {k for k, f in zip(keys, fractions, strict=True) if f < 0.2}
    assert at_10 < at_20, "a larger share only adds users: nobody changes arm back and forth"
    assert all(0.0 <= f < 1.0 for f in fractions)


# ---- the fold by hand -----------------------------------------------------------------------


def test_a_promoted_version_with_a_share_is_the_canary_until_rolled_out() -> None:
    log = fold(POLICY, [*promoted(1), *promoted_canary(2)])
    assert log.live(True) == 1 and log.canary(True) == (2, 0.1)
    assert log.preference(True) == [1], "the stable arm never falls back to a canary"
    act(log, "rollout", 2, by="canary", reason="won")
    assert log.live(True) == 2 and log.canary(True) is None
    assert log.preference(True) == [2, 1]


def test_the_first_canary_sits_beside_the_base_model() -> None:
    log = fold(POLICY, promoted_canary(1, 0.25))
    assert log.live(True) is None and log.canary(True) == (1, 0.25)


def test_later_versions_wait_their_turn_and_withdrawing_the_canary_withdraws_them() -> None:
    log = fold(POLICY, [*promoted(1), *promoted_canary(2), *promoted_canary(3, 0.2)])
    assert log.live(True) == 1 and log.canary(True) == (2, 0.1), "FIFO: the oldest first"
    act(log, "rollout", 2, by="canary")
    assert log.live(True) == 2 and log.canary(True) == (3, 0.2), "then the next one"
    log2 = fold(POLICY, [*promoted(1), *promoted_canary(2), *promoted_canary(3, 0.2)])
    act(log2, "withdraw", 2, by="canary", reason="lost")
    assert log2.withdrawn == {2, 3} and log2.live(True) == 1 and log2.canary(True) is None


def test_a_withdrawn_canary_never_serves_again_until_promoted() -> None:
    log = fold(POLICY, [*promoted(1), *promoted_canary(2)])
    act(log, "withdraw", 2, by="canary")
    log.add(weights(2, "promoted"))  # a re-sent verdict (another id) changes nothing
    assert log.live(True) == 1 and log.canary(True) is None
    log.add(weights(3, parent=1))
    log.add(with_share(weights(3, "promoted", parent=1), 0.1))
    assert log.canary(True) == (3, 0.1), "a version published after the withdraw: canary"
    with pytest.raises(VersionError, match="withdrawn"):
        A.action_event(log, "rollout", 2, by="a", reason=None, require_promoted=True)
    act(log, "promote", 2, reason="false alarm")
    assert log.live(True) == 2 and log.canary(True) == (3, 0.1), "promote: stable, no canary"


def test_a_late_rollout_does_not_bring_back_a_withdrawn_version() -> None:
    """The watch withdrew v2 just before the decider's rollout landed: the log's order rules."""
    log = fold(POLICY, [*promoted(1), *promoted_canary(2)])
    act(log, "withdraw", 2, by="watch")
    log.add(
        A.action_event(
            fold(POLICY, [*promoted(1), *promoted_canary(2)]),
            "rollout",
            2,
            by="canary",
            reason=None,
            require_promoted=True,
            ts_ms=1,
        )
    )  # type: ignore[arg-type]
    assert log.live(True) == 1 and log.canary(True) is None and 2 in log.withdrawn


def test_withdraw_of_the_stable_version_goes_back_to_the_one_below_or_the_base() -> None:
    log = fold(POLICY, [*promoted_canary(1)])
    act(log, "rollout", 1, by="canary")
    assert log.live(True) == 1
    act(log, "withdraw", 1, by="watch", reason="regressed")
    assert log.live(True) is None and log.canary(True) is None, "the base model serves"


def test_a_pin_serves_alone_and_the_canary_comes_back_after_unpin() -> None:
    log = fold(POLICY, [*promoted(1, 2), *promoted_canary(3)])
    act(log, "pin", 1)
    assert log.live(True) == 1 and log.canary(True) is None
    act(log, "unpin", None)
    assert log.live(True) == 2 and log.canary(True) == (3, 0.1)
    act(log, "pin", 3, reason="serve the canary to everyone for a while")
    assert log.live(True) == 3 and log.canary(True) is None


def test_an_operator_promote_or_a_rollback_to_it_ends_the_canary() -> None:
    log = fold(POLICY, [*promoted(1), *promoted_canary(2)])
    act(log, "promote", 2, reason="looks fine")
    assert log.live(True) == 2 and log.canary(True) is None
    log = fold(POLICY, [*promoted(1), *promoted_canary(2), *promoted_canary(3)])
    act(log, "promote", 3, reason="skip the queue")
    assert log.live(True) == 3 and log.canary(True) is None, "v2 is older than stable now"
    act(log, "rollback", 2)
    assert log.withdrawn == {3} and log.live(True) == 2 and log.canary(True) is None


def test_the_servable_event_decides_with_and_without_the_gate() -> None:
    """Gate off: the trainer stamps its candidate; gate on: its promoted verdict. A gateway
    reads the share of the event that makes a version servable under its own rule."""
    gate_off = fold(POLICY, [weights(1), with_share(weights(2), 0.3)])
    assert gate_off.live(False) == 1 and gate_off.canary(False) == (2, 0.3)
    assert gate_off.live(True) is None and gate_off.canary(True) is None
    gate_on = fold(POLICY, [*promoted(1), *promoted_canary(2, 0.3)])
    assert gate_on.live(False) == 2 and gate_on.canary(False) is None, (
        "candidates serve at once when only the verdict carries the share"
    )
    assert gate_on.canary(True) == (2, 0.3)


def test_a_zero_or_absent_share_rolls_out_at_once() -> None:
    for share in (None, 0.0):
        log = fold(POLICY, [*promoted(1), *promoted_canary(2, share)])  # type: ignore[arg-type]
        assert log.live(True) == 2 and log.canary(True) is None


def test_old_logs_without_canary_share_fold_as_before() -> None:
    """The log of tests/test_versions.py's rollback test, decoded from JSON without the
    field (as an old log holds it): the same answers at every step."""
    history = [*promoted(1, 2, 3), weights(4)]
    for ev in history:
        doc = events.to_dict(ev)
        doc.pop("canary_share")
        assert events.decode(orjson.dumps(doc), expected_type="weights").canary_share is None
    log = fold(POLICY, history)
    assert log.live(True) == 3 and log.canary(True) is None
    act(log, "rollback", None)
    assert log.live(True) == 2 and log.withdrawn == {3, 4} and log.canary(True) is None


# ---- actions ---------------------------------------------------------------------------------


def test_rollout_names_a_canary_and_withdraw_a_live_version() -> None:
    log = fold(POLICY, [*promoted(1), *promoted_canary(2)])
    with pytest.raises(VersionError, match=r"v1 is not a canary \(the canary is v2\)") as info:
        A.action_event(log, "rollout", 1, by="a", reason=None, require_promoted=True)
    assert info.value.exit_code == 2
    act(log, "withdraw", 2)
    with pytest.raises(VersionError, match="withdrawn already"):
        A.action_event(log, "withdraw", 2, by="b", reason=None, require_promoted=True)
    with pytest.raises(VersionError, match="there is no canary"):
        A.action_event(log, "rollout", 1, by="a", reason=None, require_promoted=True)


def test_figures_ride_on_the_event_and_a_restarted_decider_sends_nothing_twice() -> None:
    history = [*promoted(1), *promoted_canary(2)]
    log = fold(POLICY, history)
    figures = {"sessions_canary": 40, "successes_canary": 31, "p_better": 0.97}
    ev = A.action_event(
        log,
        "rollout",
        2,
        by="canary",
        reason="canary won",
        require_promoted=True,
        ts_ms=5,
        figures=figures,
    )
    assert ev is not None and ev.action == {
        "kind": "rollout",
        "by": "canary",
        "reason": "canary won",
        "figures": figures,
    }
    back = events.decode(events.encode(ev), expected_type="weights")
    assert back == ev
    log.add(ev)
    assert log.actions[-1].figures == figures
    # restarted: more outcomes, other figures, the same decision: found in the log
    assert (
        A.action_event(
            log,
            "rollout",
            2,
            by="canary",
            reason="canary won",
            require_promoted=True,
            figures={"p_better": 0.99},
        )
        is None
    )


@pytest.mark.parametrize(
    "patch",
    [
        {"canary_share": 1.5},
        {"canary_share": -0.1},
        {"canary_share": "10%"},
        {"action": {"kind": "rollout", "by": "c", "figures": [1, 2]}},
        {"action": {"kind": "retire", "by": "c"}},
    ],
)
def test_the_schema_refuses_a_malformed_share_or_decision(patch: dict[str, Any]) -> None:
    doc = {**events.to_dict(weights(1)), **patch}
    with pytest.raises(events.EventValidationError):
        events.decode(orjson.dumps(doc), expected_type="weights")


# ---- list and show --------------------------------------------------------------------------


def test_rows_and_served_mark_the_canary_and_each_arm() -> None:
    log = fold(POLICY, [*promoted(1), *promoted_canary(2), *promoted_canary(3, 0.2)])

    def arm(replica: str, version: int, ts: int, which: str) -> events.ServingStatus:
        s = status(replica, version, ts)
        s.arm = which  # type: ignore[assignment]
        return s

    reports = [
        arm("r0", 1, 100, "stable"),
        arm("r0", 2, 110, "canary"),
        arm("r1", 1, 105, "stable"),
        arm("r1", 2, 120, "canary"),
    ]
    got = served(POLICY, reports)
    assert got[1].replicas == ("r0", "r1") and got[1].canary_on == ()
    assert got[2].replicas == ("r0", "r1") and got[2].canary_on == ("r0", "r1")
    assert got[2].until_ms is None
    # r0 drops its canary (reports the stable version on that arm) at 300, r1 at 310
    got = served(POLICY, [*reports, arm("r0", 1, 300, "canary"), arm("r1", 1, 310, "canary")])
    assert got[2].until_ms == 300 and got[2].replicas == () and got[1].canary_on == ()
    table = {r["version"]: r for r in rows(log, served(POLICY, reports), require_promoted=True)}
    assert table[1]["live"] and table[1]["canary"] is None
    assert table[2]["canary"] == 0.1 and table[2]["pending"]
    assert table[2]["canary_replicas"] == ["r0", "r1"]
    assert table[3]["canary"] is None and table[3]["pending"], "waiting its turn"


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> tuple[VersionLog, list[events.WeightsPublished]]:
    from pipeline.versions import commands, reading

    log = fold(POLICY, [*promoted(1), *promoted_canary(2)])
    sent: list[events.WeightsPublished] = []

    def produce(_settings: object, ev: events.WeightsPublished) -> None:
        sent.append(ev)
        log.add(ev)

    monkeypatch.setattr(reading, "weights_log", lambda _s, policy, *_t: log)
    monkeypatch.setattr(reading, "serving_statuses", lambda _s, *_t: [])
    monkeypatch.setattr(reading, "sample_outcomes", lambda _s, policy, *_t: [])
    monkeypatch.setattr(commands, "_produce", produce)
    return log, sent


def run_cli(*args: str) -> Any:
    from click.testing import CliRunner

    from pipeline.cli import cli as root

    return CliRunner().invoke(root, ["versions", *args, "--policy", POLICY])


def test_list_and_show_mark_the_canary_and_rollout_withdraw_are_commands(cli: Any) -> None:
    log, sent = cli
    out = run_cli("list")
    assert out.exit_code == 0, out.output
    assert "canary v2 at 10%" in out.output and "canary 10%" in out.output
    doc = json.loads(run_cli("list", "--format", "json").output)
    assert [(r["version"], r["live"], r["canary"]) for r in doc] == [
        (1, True, None),
        (2, False, 0.1),
    ]
    bad = run_cli("rollout", "1")
    assert bad.exit_code == 2 and "not a canary" in bad.output and "Traceback" not in bad.output
    out = run_cli("rollout", "2", "--by", "ops", "--reason", "looks good")
    assert out.exit_code == 0 and "v2 should serve now" in out.output, out.output
    out = run_cli("withdraw", "2", "--by", "ops", "--reason", "complaints")
    assert out.exit_code == 0 and "v1 should serve now" in out.output, out.output
    assert [e.action["kind"] for e in sent if e.action] == ["rollout", "withdraw"]
    shown = run_cli("show", "2")
    assert "rollout" in shown.output and "withdraw" in shown.output and "complaints" in shown.output
    assert log.withdrawn == {2}


# ---- invariants by hypothesis ---------------------------------------------------------------

Op = tuple[Any, ...]
OPS = st.one_of(
    st.tuples(
        st.just("publish"),
        st.sampled_from([None, 0.0, 0.1, 0.5]),
        st.sampled_from(["promoted", "rejected", "none"]),
    ),
    st.tuples(
        st.just("act"),
        st.sampled_from(["promote", "pin", "unpin", "rollback", "rollout", "withdraw"]),
        st.integers(min_value=0, max_value=8),
    ),
)


class Step:
    """One op's effect: the action it sent (kind, version) if any, the versions known
    then, the stable version and the canary after it."""

    def __init__(
        self,
        sent: tuple[str, int] | None,
        known: set[int],
        stable: int | None,
        canary: tuple[int, float] | None,
        pinned: int | None = None,
    ) -> None:
        self.sent, self.known, self.stable, self.canary = sent, known, stable, canary
        self.pinned = pinned  # the pin in force after it


def replay(ops: list[Op], *, shares: bool) -> tuple[VersionLog, list[Step]]:
    """Apply ``ops`` (shares stripped unless ``shares``); refused actions send nothing."""
    log = VersionLog(POLICY)
    steps = []
    version = 0
    for op in ops:
        sent = None
        if op[0] == "publish":
            version += 1
            log.add(weights(version))
            if op[2] != "none":
                share = op[1] if shares and op[2] == "promoted" else None
                log.add(with_share(weights(version, op[2]), share))
        else:
            asked = None if op[1] in ("unpin", "rollback") and op[2] == 0 else op[2]
            try:
                ev = A.action_event(
                    log, op[1], asked, by="h", reason=str(len(steps)), require_promoted=True
                )
            except VersionError:
                ev = None
            if ev is not None:
                log.add(ev)
                sent = (op[1], ev.version)
        steps.append(Step(sent, set(log.manifests), log.live(True), log.canary(True), log.pinned))
    return log, steps


def old_rule(log: VersionLog) -> int | None:
    """The rule before canaries, written again: the pin, else the newest version that is
    promoted and not withdrawn."""
    if log.pinned is not None:
        return log.pinned if log.pinned in log.manifests else None
    ok = [v for v in log.manifests if log.status.get(v) == "promoted" and v not in log.withdrawn]
    return max(ok) if ok else None


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=14))
def test_without_shares_the_fold_is_the_old_rule(ops: list[Op]) -> None:
    log, steps = replay(ops, shares=False)
    assert all(s.canary is None for s in steps)
    assert log.live(True) == old_rule(log)


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=14))
def test_the_canary_is_newer_than_stable_and_a_withdrawn_one_stays_out(ops: list[Op]) -> None:
    log, steps = replay(ops, shares=True)
    out: set[int] = set()  # withdrawn by a withdraw, not named by promote/rollback/pin since
    for s in steps:
        if s.sent is not None and s.sent[0] in ("promote", "rollback", "pin"):
            out.discard(s.sent[1])
        if s.sent is not None and s.sent[0] == "withdraw":  # N and every newer one known
            out |= {u for u in s.known if u >= s.sent[1]}
        if s.canary is not None:
            version, share = s.canary
            assert 0 < share <= 1
            assert s.stable is None or version > s.stable, (s.stable, s.canary)
            assert version not in out and log.status.get(version) == "promoted"
        # a withdrawn version serves only as the pin in force at that step (a pin never
        # falls back): checked against that step's pin, not the log's final one
        assert s.stable is None or s.stable not in out or s.pinned == s.stable
