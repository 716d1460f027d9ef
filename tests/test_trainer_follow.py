"""The trainer follows the version that serves (pipeline/trainer/follow.py): the rule over
hand-built weights logs, the same fold and actions the gateways and ``liverl versions`` use."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import events
from pipeline.trainer.follow import Decision, decide
from pipeline.versions import actions as A
from pipeline.versions.table import VersionLog

from .test_versions import POLICY, act, promoted, weights


def log_of(*evs: events.WeightsPublished) -> VersionLog:
    log = VersionLog(POLICY)
    for ev in evs:
        log.add(ev)
    return log


def chain(n: int) -> dict[int, int | None]:
    """v1 <- v2 <- ... <- vn, as the trainer's own parents map holds them."""
    return {v: (v - 1 or None) for v in range(1, n + 1)}


def test_no_action_keeps_the_trainers_own_version() -> None:
    # v1..v3 promoted, v4 a candidate: the trainer is ahead of what serves by design
    log = log_of(*promoted(1, 2, 3), weights(4))
    assert decide(log, 4, chain(4), require_promoted=True, while_pinned="pause") == Decision("keep")


def test_rollback_switches_to_the_version_rolled_back_to() -> None:
    log = log_of(*promoted(1, 2, 3, 4))
    act(log, "rollback", 2)
    d = decide(log, 4, chain(4), require_promoted=True, while_pinned="pause")
    assert (d.kind, d.version) == ("switch", 2)
    assert d.action is not None and d.action.by == "alice"
    assert d.line(POLICY) == "v2 serves after rollback by alice: training goes on from v2"


def test_a_version_trained_on_from_the_serving_one_after_the_action_is_kept() -> None:
    log = log_of(*promoted(1, 2, 3, 4))
    act(log, "rollback", 2)
    parents = {**chain(4), 5: 2}
    # v5 (parent v2) is not on the log yet: it was published after everything folded
    assert decide(log, 5, parents, require_promoted=True, while_pinned="pause").kind == "keep"
    log.add(weights(5, parent=2))  # now it is, after the rollback
    log.add(weights(6, parent=5))
    assert (
        decide(log, 6, {**parents, 6: 5}, require_promoted=True, while_pinned="pause").kind
        == "keep"
    )


def test_pending_steps_published_after_a_rollback_do_not_escape_it() -> None:
    # v5 is v4's child, published after the rollback to v2 (the trainer's pending steps):
    # it descends from v2 through withdrawn v3, v4, so the trainer still goes back to v2
    log = log_of(*promoted(1, 2, 3, 4))
    act(log, "rollback", 2)
    log.add(weights(5, parent=4))
    d = decide(log, 5, chain(5), require_promoted=True, while_pinned="pause")
    assert (d.kind, d.version) == ("switch", 2)


def test_pin_pauses_or_trains_from_the_pinned_version() -> None:
    log = log_of(*promoted(1, 2, 3))
    act(log, "pin", 1, reason="bad answers")
    paused = decide(log, 3, chain(3), require_promoted=True, while_pinned="pause")
    assert (paused.kind, paused.version) == ("pause", 1)
    assert "pinned at v1 after pin by alice (bad answers): training paused" in paused.line(POLICY)
    training = decide(log, 3, chain(3), require_promoted=True, while_pinned="train")
    assert (training.kind, training.version) == ("switch", 1)
    # the candidates trained from v1 while the pin holds do not move the trainer back
    log.add(weights(4, parent=1))
    assert (
        decide(log, 4, {**chain(3), 4: 1}, require_promoted=True, while_pinned="train").kind
        == "keep"
    )


def test_unpin_goes_to_the_newest_servable_version() -> None:
    log = log_of(*promoted(1, 2, 3))
    act(log, "pin", 1)
    log.add(weights(4, parent=1))  # trained while pinned (train mode), never promoted
    act(log, "unpin", None)
    # v3 serves again (v4 is a candidate, the gateways load promoted versions only)
    d = decide(log, 4, {**chain(3), 4: 1}, require_promoted=True, while_pinned="train")
    assert (d.kind, d.version) == ("switch", 3)
    # a paused trainer still on v3 resumes where it was
    assert decide(log, 3, chain(3), require_promoted=True, while_pinned="pause") == Decision(
        "keep", 3, log.actions[-1]
    )


def test_promote_of_a_rejected_version_makes_it_the_parent() -> None:
    # v3 rejected; the trainer went back to v2 and published v4 (parent v2), then the
    # operator promotes v3, the newest servable now
    log = log_of(*promoted(1, 2), weights(3), weights(3, "rejected"), weights(4, parent=2))
    act(log, "promote", 3)
    d = decide(log, 4, {**chain(3), 4: 2}, require_promoted=True, while_pinned="pause")
    assert (d.kind, d.version) == ("switch", 3)


def test_another_policys_actions_are_not_followed() -> None:
    other = VersionLog("q")
    for ev in promoted(1, 2):
        other.add(weights(ev.version, ev.status, policy="q"))
    ev = A.action_event(other, "rollback", 1, by="bob", reason=None, require_promoted=True)
    assert ev is not None
    log = log_of(*promoted(1, 2), ev)  # VersionLog drops it: another policy's
    assert decide(log, 2, chain(2), require_promoted=True, while_pinned="pause").kind == "keep"


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(2, 7),
    to=st.integers(1, 6),
    trained=st.integers(0, 4),
    mode=st.sampled_from(["pause", "train"]),
)
def test_after_a_rollback_and_the_follow_the_trainer_keeps_what_serves(
    n: int, to: int, trained: int, mode: str
) -> None:
    """Invariant: after a rollback to T, deciding and doing what the decision says, then
    publishing ``trained`` versions in a line from there, every further decision is keep,
    and the newest version's lineage reaches T through versions published after the
    action only."""
    to = min(to, n - 1)
    log = log_of(*promoted(*range(1, n + 1)))
    act(log, "rollback", to)
    parents = chain(n)
    current = n
    d = decide(log, current, parents, require_promoted=True, while_pinned=mode)
    assert (d.kind, d.version) == ("switch", to)
    current = to
    for v in range(n + 1, n + 1 + trained):
        parents[v] = current
        log.add(weights(v, parent=current))
        log.add(weights(v, "promoted"))
        current = v
        assert (
            decide(log, current, parents, require_promoted=True, while_pinned=mode).kind == "keep"
        )
    at: int | None = current
    while at is not None and at > n:
        at = parents[at]
    assert at == to


def canary(*versions: int, share: float = 0.1) -> list[events.WeightsPublished]:
    """Each version's candidate, then the gate's promotion stamped with a canary share."""
    return [
        e
        for v in versions
        for e in (weights(v), dataclasses.replace(weights(v, "promoted"), canary_share=share))
    ]


def test_a_canary_rolled_out_keeps_the_versions_queued_behind_it() -> None:
    # v1 serves everyone; v2 is the canary, v3 (its child) waits behind it; the trainer holds
    # v4 (v3's child). Rolling v2 out moves the log toward the trainer: it keeps v4.
    log = log_of(*promoted(1), *canary(2, 3), weights(4))
    assert log.canary(True) == (2, 0.1) and log.live(True) == 1
    act(log, "rollout", 2, by="canary")
    assert log.live(True) == 2
    assert decide(log, 4, chain(4), require_promoted=True, while_pinned="pause") == Decision(
        "keep", 2, log.actions[-1]
    )


def test_a_withdrawn_canary_sends_the_trainer_back_to_the_stable_version() -> None:
    log = log_of(*promoted(1), *canary(2, 3), weights(4))
    act(log, "withdraw", 2, by="canary")  # v2 and every newer version known: v3, v4
    d = decide(log, 4, chain(4), require_promoted=True, while_pinned="pause")
    assert (d.kind, d.version) == ("switch", 1)
    # trained on from v1 since, then its canary v5 rolled out: v6 (v5's child) is kept
    log.add(weights(5, parent=1))
    log.add(dataclasses.replace(weights(5, "promoted", parent=1), canary_share=0.1))
    log.add(weights(6, parent=5))
    parents = {**chain(4), 5: 1, 6: 5}
    act(log, "rollout", 5, by="canary")
    assert decide(log, 6, parents, require_promoted=True, while_pinned="pause").kind == "keep"


def test_a_rollout_of_a_version_off_the_trainers_lineage_switches_to_it() -> None:
    # an operator rolls out v2 while the trainer holds v3 trained from v1 (v2 not its ancestor)
    log = log_of(*promoted(1), *canary(2), weights(3, parent=1))
    act(log, "rollout", 2)
    d = decide(log, 3, {1: None, 2: 1, 3: 1}, require_promoted=True, while_pinned="pause")
    assert (d.kind, d.version) == ("switch", 2)


def test_steps_published_after_a_withdraw_are_withdrawn_with_their_lineage() -> None:
    # stable v4, canary v5, trainer on v6 (v5's child): withdraw 5 drops v5 and v6; the
    # trainer then publishes its pending steps as v7 (parent v6) before it reads the action
    log = log_of(*promoted(1, 2, 3, 4), *canary(5, 6))
    act(log, "withdraw", 5, by="canary")
    log.add(weights(7, parent=6))
    log.add(dataclasses.replace(weights(7, "promoted", parent=6), canary_share=0.1))
    assert 7 in log.withdrawn and log.canary(True) is None and log.live(True) == 4
    # the same after a rollback: v5 (parent v4, withdrawn by rollback to 2) never serves
    log = log_of(*promoted(1, 2, 3, 4))
    act(log, "rollback", 2)
    log.add(weights(5, parent=4))
    log.add(weights(5, "promoted", parent=4))
    assert log.live(True) == 2 and 5 in log.withdrawn
    act(log, "promote", 5)  # an operator may still bring it back
    assert log.live(True) == 5


def test_when_every_version_is_withdrawn_the_trainer_goes_back_to_the_base() -> None:
    log = log_of(*canary(1), weights(2))  # v1 the first canary, the base stable
    act(log, "withdraw", 1, by="canary")
    d = decide(log, 2, chain(2), require_promoted=True, while_pinned="pause")
    assert (d.kind, d.version) == ("switch", 0)
    assert d.line(POLICY) == (
        "the base model serves after withdraw by canary: training goes on from the base"
    )
    assert decide(log, 0, chain(2), require_promoted=True, while_pinned="pause").kind == "keep"


def test_an_old_rollback_does_not_pull_a_restarted_trainer_back_past_what_serves() -> None:
    # rollback to v2 long ago; v5 (parent v2) .. v8 published and promoted since, v8 serves;
    # the trainer holds v9 (v8's child, a candidate): it keeps v9
    log = log_of(*promoted(1, 2, 3, 4))
    act(log, "rollback", 2)
    for v, parent in ((5, 2), (6, 5), (7, 6), (8, 7)):
        log.add(weights(v, parent=parent))
        log.add(weights(v, "promoted", parent=parent))
    log.add(weights(9, parent=8))
    assert log.live(True) == 8
    parents = {**chain(4), 5: 2, 6: 5, 7: 6, 8: 7, 9: 8}
    assert decide(log, 9, parents, require_promoted=True, while_pinned="pause").kind == "keep"


def test_promote_keeps_a_trainer_whose_lineage_holds_what_serves() -> None:
    # A: promote the canary v5 (like a rollout): the trainer on v7 (v7 <- v6 <- v5) keeps it
    log = log_of(*promoted(1, 2, 3, 4), *canary(5, 6), weights(7))
    act(log, "promote", 5)
    assert log.live(True) == 5
    assert decide(log, 7, chain(7), require_promoted=True, while_pinned="pause").kind == "keep"
    # B: promote an old rejected version: v3 still serves, the trainer on v4 (v3's child)
    log = log_of(*promoted(1), weights(2), weights(2, "rejected"), *promoted(3), weights(4))
    act(log, "promote", 2)
    assert log.live(True) == 3
    assert decide(log, 4, chain(4), require_promoted=True, while_pinned="pause").kind == "keep"
