"""The group agent: z-scores samples within (group, step index) across sessions.

A session with a ``group_id`` is sent by the session agent to the internal topic
``<app id>-groups``, keyed by group (a group spans partitions of the session topics, hence the
repartition). The samples are held (``group_members``) until the group has ``group_size``
sessions or ``group_timeout_s`` passed, then normalised (`grouping.py`) and published. The
group tables are placed by the current event's partition, so the timer does not write them:
it sends a ``sweep`` message through the group topic and the agent does the writing.
"""

from __future__ import annotations

import logging

import faust
import orjson
from faust.types import TopicT

from pipeline import events
from pipeline.kafka import names

from . import grouping, runtime
from .grouping import GroupIndex
from .records import GROUP_MEMBERS, GROUPS, held_samples, member_key, sample_of
from .runtime import Runtime
from .state_json import StateJson, StateUnreadable

log = logging.getLogger(__name__)

_INDEX: StateJson[GroupIndex] = StateJson(GroupIndex)


class GroupAgent:
    """The agent body and its timer over two tables (see the module docstring)."""

    def __init__(self, rt: Runtime, topic: TopicT) -> None:
        self.rt, self.topic = rt, topic
        # Written only in the agent's stream, on the partition of the group id.
        self.groups = rt.table(GROUPS, use_partitioner=False)  # group id -> GroupIndex
        self.members = rt.table(GROUP_MEMBERS, use_partitioner=False)  # group\0session
        self.timeout_ms = int(rt.cfg.group_timeout_s * 1000)
        self.retain_ms = int(rt.cfg.retain_s * 1000)

    async def read(self, gid: bytes) -> GroupIndex | None:
        """The group's index; one that cannot be read back is dead-lettered and dropped."""
        return await self.rt.read_state(self.groups, gid, _INDEX.load, "group index")

    def save(self, gid: bytes, index: GroupIndex) -> None:
        index.touched_ms = runtime.now_ms()
        self.groups[gid] = _INDEX.dump(index)

    async def flush(self, gid: bytes, index: GroupIndex) -> None:
        members: dict[str, list[events.Sample]] = {}
        for sid in index.members:
            key = member_key(gid, sid)
            raw = self.members.get(key)
            if raw is None:
                continue
            try:
                members[sid] = held_samples(raw)
            except events.EventValidationError as exc:
                why = f"held samples of group member unreadable: {exc}"
                await self.rt.dead_letter_state(GROUP_MEMBERS, key, raw, why)
        for s in grouping.normalize(gid.decode(), members, self.rt.cfg.sample_version):
            await self.rt.send(names.SAMPLES, s)
        for sid in index.members:
            self.members.pop(member_key(gid, sid), None)
        index.done = True

    async def process(self, stream: faust.StreamT) -> None:
        cfg = self.rt.cfg
        async for ev in self.rt.units(stream):
            gid, now = ev.message.key or b"", runtime.now_ms()
            try:
                body = orjson.loads(ev.message.value)
            except orjson.JSONDecodeError:
                continue  # only this app writes the topic: nothing else to do with it
            index = await self.read(gid)
            if body.get("kind") == "session":
                index, action = grouping.on_session(index, body["session_id"], now)
                if action == "late":
                    log.warning("session %s arrived after group %r was emitted: not normalised",
                                body["session_id"], gid)  # fmt: skip
                    try:
                        late = [sample_of(d) for d in body["samples"]]
                    except events.EventValidationError as exc:
                        why = f"late group member unreadable: {exc}"
                        await self.rt.dead_letter(ev.message, why)
                        late = []
                    for sample in late:
                        await self.rt.send(names.SAMPLES, sample)
                elif action == "hold":
                    self.members[member_key(gid, body["session_id"])] = orjson.dumps(
                        body["samples"]
                    )
            elif index is None:
                continue
            elif index.done and now - (index.touched_ms or now) >= self.retain_ms:
                del self.groups[gid]  # sweep of an old tombstone
                continue
            if grouping.is_complete(index, cfg.group_size, now, self.timeout_ms):
                await self.flush(gid, index)
            self.save(gid, index)

    async def group_sweep(self) -> None:
        """Ask the agent to look at groups past their timeout (or long done)."""
        now = runtime.now_ms()
        for gid, raw in list(self.groups.items()):
            try:
                index = _INDEX.load(raw)
            except StateUnreadable:
                continue  # the agent dead-letters it when the group is next seen
            due = (not index.done and now - index.first_ms >= self.timeout_ms) or (
                index.done and now - (index.touched_ms or now) >= self.retain_ms
            )
            if due:
                await self.rt.produce(self.topic.get_topic_name(), gid, b'{"kind":"sweep"}')
