"""An operator's ``promote`` / ``pin`` / ``unpin`` / ``rollback``, or a ``rollout`` /
``withdraw`` (an operator's or the canary decider's), as a ``weights`` event.

The event id is derived, so that a retried command is not a second action: from the
command (kind, the version asked for, who, why) and its basis, the newest operator action in
the log that is not this same command. A retry after a success finds its own event as the
newest action, skips it, gets the same basis and so the same id, which is in the log
already: nothing is sent. A retry after an ambiguous failure (a timeout whose record landed
after all) sends the same id again, and every reader counts an id once (``VersionLog.add``).
The trainer's events never change the basis, so a version published in between does not
turn a retry into a second action. An automatic decision's ``figures`` are not part of the id:
a restarted decider that recomputes them on more outcomes still finds its decision sent.
"""

from __future__ import annotations

from typing import Any

from pipeline import __version__
from pipeline.events import Producer, WeightsPublished, derive_event_id, now_ms

from .errors import VersionError
from .table import ACTION_KINDS, VersionLog

PRODUCER = Producer(component="versions", version=__version__)
ID_VERSION = "versions-1"  # bump if the id's inputs change


def _same_command(
    ev: WeightsPublished, kind: str, asked: int | None, by: str, reason: str | None
) -> bool:
    a = ev.action or {}
    return (
        a.get("kind") == kind
        and a.get("by") == by
        and a.get("reason") == reason
        and (asked is None or ev.version == asked)
    )


def action_id(
    log: VersionLog, kind: str, asked: int | None, by: str, reason: str | None
) -> tuple[str, list[str]]:
    """The command's event id and its parents (the basis, if any)."""
    basis = next(
        (
            ev
            for ev in reversed(log.events)
            if ev.action is not None and not _same_command(ev, kind, asked, by, reason)
        ),
        None,
    )
    parents = [basis.event_id] if basis is not None else []
    return derive_event_id(
        "weights_action", parents, ID_VERSION, log.policy_id, kind, asked, by, reason
    ), parents


def known(log: VersionLog, version: int) -> None:
    """Raise VersionError (exit 2) naming the published range unless ``version`` exists."""
    if version not in log.manifests:
        known = sorted(log.manifests)
        listed = f"v{known[0]}..v{known[-1]}" if known else "none yet"
        raise VersionError(
            f"policy {log.policy_id} has no version {version} (published: "
            f"{listed}; liverl versions list --policy {log.policy_id})"
        )


def target(log: VersionLog, kind: str, asked: int | None, *, require_promoted: bool) -> int:
    """The version the command acts on, after checking it can: raises VersionError with
    what to do instead."""
    if kind not in ACTION_KINDS:
        raise VersionError(f"unknown action {kind!r}")
    if kind == "unpin":
        if log.pinned is None:
            raise VersionError(f"policy {log.policy_id} is not pinned")
        return log.pinned
    if kind == "rollback":
        if log.pinned is not None:
            raise VersionError(
                f"policy {log.policy_id} is pinned at v{log.pinned}: unpin it "
                "first, or pin the version that should serve"
            )
        live = log.live(require_promoted)
        if asked is None:
            previous = log.previous(require_promoted)
            if previous is None:
                now = f"v{live}" if live is not None else "the base"
                raise VersionError(
                    f"policy {log.policy_id}: no servable version older than the live one ({now})"
                )
            return previous
        known(log, asked)
        if live is not None and asked >= live:
            raise VersionError(
                f"v{asked} is not older than the live v{live}: a rollback goes "
                "back (pin N serves any version)"
            )
        status = log.status.get(asked)
        if status == "rejected" or (require_promoted and status != "promoted"):
            raise VersionError(
                f"v{asked} is {status}: the gateways would not "
                f"serve it; promote it first (liverl versions promote {asked})"
            )
        return asked
    assert asked is not None
    known(log, asked)
    if kind == "rollout":
        if asked in log.withdrawn:
            raise VersionError(
                f"v{asked} is withdrawn: promote it (liverl versions promote "
                f"{asked}) to serve it again"
            )
        if not (log.servable(asked, require_promoted) and log.pending(asked, require_promoted)):
            canary = log.canary(require_promoted)
            now = f"the canary is v{canary[0]}" if canary is not None else "there is no canary"
            raise VersionError(f"v{asked} is not a canary ({now}): nothing to roll out")
        return asked
    if kind == "withdraw":
        if asked in log.withdrawn and all(u in log.withdrawn for u in log.manifests if u > asked):
            raise VersionError(f"v{asked} and every newer version are withdrawn already")
        return asked
    if kind == "pin" and log.status.get(asked) == "rejected":
        raise VersionError(
            f"v{asked} was rejected by the promotion gate: promote it first "
            f"(liverl versions promote {asked}) if it should serve anyway"
        )
    return asked


def action_event(
    log: VersionLog,
    kind: str,
    asked: int | None,
    *,
    by: str,
    reason: str | None,
    require_promoted: bool,
    ts_ms: int | None = None,
    figures: dict[str, Any] | None = None,
) -> WeightsPublished | None:
    """The event to send for the command, or None when the log holds it already (a retry).
    ``figures``: an automatic decision's numbers, kept on the event (not in its id).
    Raises VersionError when the command cannot apply."""
    event_id, parents = action_id(log, kind, asked, by, reason)
    if event_id in {ev.event_id for ev in log.events}:
        return None
    version = target(log, kind, asked, require_promoted=require_promoted)
    status = "promoted" if kind == "promote" else None
    return manifest_action(
        log,
        version,
        event_id=event_id,
        parents=parents,
        producer=PRODUCER,
        ts_ms=ts_ms,
        status=status,
        action={
            "kind": kind,
            "by": by,
            "reason": reason,
            **({"figures": figures} if figures is not None else {}),
        },
    )


def manifest_action(
    log: VersionLog,
    version: int,
    *,
    event_id: str,
    parents: list[str],
    producer: Producer,
    action: dict[str, Any],
    ts_ms: int | None = None,
    status: str | None = None,
) -> WeightsPublished:
    """An action on ``version`` as a ``weights`` event: the version's manifest (its first
    event) with ``action`` set, so a reader of the log alone can load what it names. Shared
    by operator commands and the canary decider. ``status``: the folded one unless given."""
    base = log.manifests[version]
    return WeightsPublished(
        event_id=event_id,
        ts_ms=now_ms() if ts_ms is None else ts_ms,
        producer=producer,
        parents=parents,
        policy_id=log.policy_id,
        version=version,
        parent=base.parent,
        uri=base.uri,
        files=[dict(f) for f in base.files],  # type: ignore[misc]
        step=base.step,
        status=status or log.status.get(version, base.status),  # type: ignore[arg-type]
        consumed_offsets=dict(base.consumed_offsets),
        action=action,
    )
