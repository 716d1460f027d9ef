"""Group stage logic: hold the samples of sessions that share a ``group_id`` until the group is
complete, then z-score their rewards within (group, step index) (RLAnything,
docs/architecture.md#groups).

Sessions are assembled per session (keyed by session id); a group spans sessions on different
partitions, so the worker re-keys each grouped session's samples by group id through an internal
topic and runs this stage there. A group is complete when ``group_size`` distinct sessions are
in, or ``timeout_ms`` after its first session (then it is normalised with what it has). A session
that arrives after its group was emitted is passed on unchanged: its group cannot be reopened.

Pure state handling: the index per group is a :class:`GroupIndex` dataclass (a Faust table
value; it round-trips exactly through its JSON, `state_json.py`), updated in place and
returned by :func:`on_session`; the members' samples are stored once each, under their own key,
by the worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pipeline.events import Sample, derive_event_id

from .rewards import zscore_by_group_step


@dataclass(slots=True)
class GroupIndex:
    """A group's members so far (session ids, in arrival order). ``first_ms``: when its first
    session came (the timeout runs from there); ``done``: emitted, kept as a tombstone so late
    sessions pass through; ``touched_ms``: last write, set by the worker to expire tombstones."""

    first_ms: int
    members: list[str] = field(default_factory=list)
    done: bool = False
    touched_ms: int = 0


def on_session(index: GroupIndex | None, session_id: str, now_ms: int) -> tuple[GroupIndex, str]:
    """Add a session to its group's index (in place; ``None`` starts one at ``now_ms``). Returns
    the index and what to do with the session's samples: ``hold`` (new member), ``duplicate``
    (redelivery: drop) or ``late`` (the group was already emitted: pass the samples on
    unchanged)."""
    index = index if index is not None else GroupIndex(first_ms=now_ms)
    if session_id in index.members:
        return index, "duplicate"
    if index.done:
        return index, "late"
    index.members.append(session_id)
    return index, "hold"


def is_complete(index: GroupIndex, group_size: int, now_ms: int, timeout_ms: int) -> bool:
    """Enough members (``group_size`` > 0), or the group timed out with at least one member."""
    if index.done or not index.members:
        return False
    if group_size > 0 and len(index.members) >= group_size:
        return True
    return now_ms - index.first_ms >= timeout_ms


def normalize(
    group_id: str, members: Mapping[str, Sequence[Sample]], sample_version: str
) -> list[Sample]:
    """The group's samples (sessions in id order, turns in order), outcome+PRM z-scored within
    (group, step index) with the path part added on its bounded scale, and constant buckets
    taken out of the RL term (see :func:`zscore_by_group_step`). Ids are re-derived from the
    group's membership: the same group gives the same ids on replay, a differently composed
    one (e.g. a timeout) different ids."""
    sids = sorted(members)
    flat = [replace(s, group_id=group_id) for sid in sids for s in sorted(members[sid], key=_turn)]
    out = []
    for s in zscore_by_group_step(flat):
        extra = (s.masked, "group", group_id, sids)
        eid = derive_event_id("sample", s.parents, sample_version, *extra)
        out.append(replace(s, event_id=eid))
    return out


def _turn(s: Sample) -> int:
    return s.turn
