"""The trainer follows the version that serves: it folds ``liverl.weights.v1`` with the
gateways' own fold (:class:`pipeline.versions.table.VersionLog`, same ``require_promoted``),
and after an operator's ``rollback``, ``pin`` or ``promote`` makes another version serve it
trains on from that version, so the next candidate's parent is what users are answered by.

Only an operator's action moves the trainer. Without one, the trainer's own newest version
is ahead of the serving one by design (a candidate waits for its verdict, a version with too
few held-out prompts stays a candidate), and going back to the serving version there would
undo every step not yet promoted. The rule (:func:`decide`), after the newest action A:

- pinned and ``while_pinned = "pause"``: pause (no sample consumed, nothing published);
- the trainer's version V is acceptable when it is the serving version S, or when V and every
  ancestor of V between V and S was announced after A (the trainer already trained on from
  S since the action); else it switches to S. A version announced before A that merely
  descends from S (rolled back past it, or trained while a pin held) is not acceptable;
- a ``rollout`` or ``promote`` (the log moving forward, toward what the trainer holds, or
  not moving what serves) keeps V when S is V or one of its ancestors and nothing between
  them is withdrawn: the versions queued behind a canary descend from it, and going back to
  it would undo them. A ``withdraw`` is a backward action like a rollback;
- nothing servable left (every version withdrawn: the base serves): V goes back to the base
  (``switch`` to 0) unless it is the base already.

The trainer publishes its pending steps before it switches or pauses (their samples are
consumed, as after a rejection, and are never trained twice).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pipeline import events
from pipeline.kafka import names
from pipeline.kafka.connection import Connectable, connection_of
from pipeline.versions.table import Action, VersionLog

log = logging.getLogger(__name__)

DecisionKind = Literal["keep", "switch", "pause"]


@dataclass(frozen=True)
class Decision:
    """What the trainer does next: keep its weights, switch to ``version``, or pause."""

    kind: DecisionKind
    version: int | None = None  # the serving version (switch; pause: the pinned one)
    action: Action | None = None  # the operator action behind it

    def line(self, policy: str) -> str:
        """The log line that says why ("v7 serves after rollback by alice: …")."""
        a = self.action
        why = (
            ""
            if a is None
            else f" after {a.kind} by {a.by}" + (f" ({a.reason})" if a.reason else "")
        )
        if self.kind == "pause":
            return (
                f"{policy} pinned at v{self.version}{why}: training paused (samples wait "
                'for unpin; trainer.while_pinned = "pause")'
            )
        if self.version == 0:
            return f"the base model serves{why}: training goes on from the base"
        return f"v{self.version} serves{why}: training goes on from v{self.version}"


def _announced(log: VersionLog) -> dict[int, int]:
    """version -> position in the log of its first event."""
    at: dict[int, int] = {}
    for i, ev in enumerate(log.events):
        at.setdefault(ev.version, i)
    return at


def decide(
    log: VersionLog,
    current: int,
    parents: Mapping[int, int | None],
    *,
    require_promoted: bool,
    while_pinned: str,
) -> Decision:
    """What the trainer holding version ``current`` (0: the base) does, given the folded log
    and its own lineage ``parents`` (version -> parent; a version the log has not shown yet
    was published after everything folded)."""
    if not log.actions:
        return Decision("keep")
    action = log.actions[-1]
    if log.pinned is not None and while_pinned == "pause":
        return Decision("pause", log.pinned, action)
    serving = log.live(require_promoted)
    if serving is None:  # every version withdrawn: the base serves
        return Decision("keep" if current == 0 else "switch", 0, action)
    if current == serving:
        return Decision("keep", serving, action)
    if action.kind in ("rollout", "promote"):
        at: int | None = current
        seen: set[int] = set()
        while at is not None and at != serving and at not in seen and at not in log.withdrawn:
            seen.add(at)
            at = parents.get(at, log.manifests[at].parent if at in log.manifests else None)
        return Decision("keep" if at == serving else "switch", serving, action)
    announced = _announced(log)
    acted_at = next(i for i, ev in enumerate(log.events) if ev.event_id == action.event_id)
    at = current
    seen = set()
    while (
        at is not None
        and at != serving
        and at not in seen
        and announced.get(at, len(log.events)) > acted_at
    ):
        seen.add(at)  # trained since the action: walk back to what it trained on from
        at = parents.get(at, log.manifests[at].parent if at in log.manifests else None)
    if at == serving:
        return Decision("keep", serving, action)
    return Decision("switch", serving, action)


class WeightsFollower:
    """The weights topic, read from its start and then polled without waiting: a one-shot
    reader (assign, no group, no commit), so following moves nobody's offsets."""

    def __init__(
        self,
        connection: Connectable,
        policy: str,
        *,
        topic: str = names.WEIGHTS,
        catch_up_s: float = 30.0,
    ) -> None:
        from pipeline.kafka.reader import one_shot_reader

        self.log = VersionLog(policy)
        # a trainer in a replay namespace publishes to, and follows, the namespace's copy
        self.topic = names.resolve(topic, connection_of(connection).namespace)
        self._actions = 0
        no_eof: dict[str, Any] = {"enable.partition.eof": False}
        self._consumer: Any = one_shot_reader(connection, "liverl-trainer-follow-", **no_eof)
        self._catch_up(catch_up_s)

    def _catch_up(self, timeout_s: float) -> None:
        """Assign every partition from its start and read up to the high watermarks seen now:
        the first decision sees the whole log, not a prefix (a pin further on must not be
        preceded by a switch to what it overrides)."""
        from confluent_kafka import TopicPartition

        from pipeline.kafka.inspect import watermarks

        meta = self._consumer.list_topics(self.topic, timeout=timeout_s).topics.get(self.topic)
        if meta is None or meta.error is not None:
            log.warning("weights topic %s not found: the trainer follows no operator", self.topic)
            return
        ends: dict[int, int] = {}
        parts = []
        for p in sorted(meta.partitions):
            low, high = watermarks(self._consumer, TopicPartition(self.topic, p), timeout_s)
            parts.append(TopicPartition(self.topic, p, low))
            if high > low:
                ends[p] = high
        self._consumer.assign(parts)
        deadline = time.monotonic() + timeout_s
        while ends and time.monotonic() < deadline:
            for m in self._consumer.consume(num_messages=500, timeout=0.5):
                if m.error() is None:
                    self._fold(m)
                    if m.offset() + 1 >= ends.get(m.partition(), 0):
                        ends.pop(m.partition(), None)

    def _fold(self, msg: Any) -> None:
        with contextlib.suppress(events.EventValidationError):  # the gateways' to dead-letter
            ev = events.decode(msg.value(), expected_type="weights")
            if isinstance(ev, events.WeightsPublished):
                self.log.add(ev)

    def poll(self) -> bool:
        """Fold what arrived since the last call (never waits); True when it brought a new
        operator action."""
        for m in self._consumer.consume(num_messages=500, timeout=0):
            if m.error() is None:
                self._fold(m)
        fresh = len(self.log.actions) != self._actions
        self._actions = len(self.log.actions)
        return fresh

    def close(self) -> None:
        self._consumer.close()
