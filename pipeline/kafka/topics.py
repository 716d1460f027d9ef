"""Topics as code: specs in ``topics/*.yaml``, planned and applied idempotently.

``plan`` compares specs with the broker and lists changes; ``apply`` executes a plan.
A plan that would need a shrink (fewer partitions) or a replication change is refused
as a whole before anything is touched, so a bad spec never half-applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
)
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from pipeline.kafka.errors import TopicSpecError

SESSION_KEY = "session_id"


class SpecFile(BaseModel):
    """One ``topics/*.yaml`` file as written; unknown fields are refused (a typo such as
    ``partition:`` must not silently fall back to a default)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    partitions: StrictInt = Field(ge=1)
    replication: StrictInt = Field(default=1, ge=1)
    key: str
    value_schema: str
    config: dict[str, str | int] = Field(default_factory=dict)


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication: int
    key: str
    value_schema: str
    config: dict[str, str] = field(default_factory=dict)
    description: str = ""
    source: Path | None = None


@dataclass
class TopicState:
    """What the broker has for one topic."""

    partitions: int
    replication: int
    config: dict[str, str]


@dataclass
class Change:
    topic: str
    action: str  # create | add_partitions | alter_config
    detail: str
    spec: TopicSpec
    configs: dict[str, str] = field(default_factory=dict)


@dataclass
class Plan:
    changes: list[Change]
    refusals: list[str]
    unchanged: list[str]
    states: dict[str, TopicState] = field(default_factory=dict)  # the broker, as compared

    def differences(self, topic: str) -> list[str]:
        """What differs for ``topic``: its changes' and refusals' details (empty: in line)."""
        out = [
            c.detail if c.action != "create" else "missing"
            for c in self.changes
            if c.topic == topic
        ]
        out += [r.split(": ", 1)[1] for r in self.refusals if r.startswith(topic + ": ")]
        return out

    @property
    def empty(self) -> bool:
        return not self.changes and not self.refusals


MAX_MESSAGE_BYTES = "max.message.bytes"
MIN_INSYNC_REPLICAS = "min.insync.replicas"


def min_insync_replicas(replication: int) -> int:
    """In-sync replicas an acks=all write needs: 2 of 3 (or more), so one broker may be down
    and an acknowledged record is still on two; below 3 replicas, 1 (any more would make a
    single broker's loss stop every write)."""
    return 2 if replication >= 3 else 1


def default_max_record_bytes() -> int:
    """The record limit of the default size policy; callers holding settings pass theirs
    (``connection.max_record_bytes``)."""
    from pipeline.kafka.connection import KafkaSettings

    return KafkaSettings().max_record_bytes


def load_specs(
    specs_dir: Path,
    replication_override: int | None = None,
    max_record_bytes: int | None = None,
) -> list[TopicSpec]:
    """Read every ``*.yaml`` spec; session-keyed topics must share a partition count.

    Every topic gets ``max.message.bytes`` from the size policy (``KafkaSettings
    .max_record_bytes``, the default policy's unless given), so no spec restates the number;
    a spec may raise it but not lower it (events the codec accepts would be refused).
    A topic with 3 or more replicas (a spec's or ``replication_override``, e.g. a local
    cluster's) gets ``min.insync.replicas`` 2 unless its spec states one.
    """
    record_bytes = max_record_bytes or default_max_record_bytes()
    files = sorted(Path(specs_dir).glob("*.yaml"))
    if not files:
        raise TopicSpecError(f"no topic specs (*.yaml) in {specs_dir}")
    specs: list[TopicSpec] = []
    for path in files:
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise TopicSpecError(f"{path}: not valid YAML: {exc}") from exc
        try:
            file = SpecFile.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'spec'}: {e['msg']}" for e in exc.errors()
            )
            raise TopicSpecError(f"{path}: {problems}") from None
        partitions = file.partitions
        replication = replication_override or file.replication
        config = {str(k): str(v) for k, v in file.config.items()}
        if replication >= 3:
            config.setdefault(MIN_INSYNC_REPLICAS, str(min_insync_replicas(replication)))
        stated = config.setdefault(MAX_MESSAGE_BYTES, str(record_bytes))
        if not stated.isdigit() or int(stated) < record_bytes:
            raise TopicSpecError(
                f"{path}: {MAX_MESSAGE_BYTES} {stated!r} is below the size policy's record "
                f"limit {record_bytes} (kafka.max_event_bytes + headroom); drop it from the spec"
            )
        specs.append(
            TopicSpec(
                name=file.name,
                partitions=partitions,
                replication=int(replication),
                key=file.key,
                value_schema=file.value_schema,
                config=config,
                description=_leading_comment(path),
                source=path,
            )
        )
    names = [s.name for s in specs]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise TopicSpecError(f"topic(s) specified twice: {', '.join(sorted(dupes))}")
    session_counts = {s.partitions for s in specs if s.key == SESSION_KEY}
    if len(session_counts) > 1:
        detail = ", ".join(f"{s.name}={s.partitions}" for s in specs if s.key == SESSION_KEY)
        raise TopicSpecError(
            "topics keyed by session_id must have the same partition count so joins need no "
            f"repartition (co-partitioning); got {detail}"
        )
    return specs


def describe(admin: AdminClient, names: list[str], timeout: float = 10.0) -> dict[str, TopicState]:
    """Partitions, replication and non-default configs of the named topics that exist."""
    md = admin.list_topics(timeout=timeout)
    present = [n for n in names if n in md.topics and md.topics[n].error is None]
    states: dict[str, TopicState] = {}
    if not present:
        return states
    resources = [ConfigResource(ConfigResource.Type.TOPIC, n) for n in present]
    futures = admin.describe_configs(resources, request_timeout=timeout)
    for resource, fut in futures.items():
        entries = fut.result(timeout=timeout)
        topic = md.topics[resource.name]
        first = next(iter(topic.partitions.values()), None)
        states[resource.name] = TopicState(
            partitions=len(topic.partitions),
            replication=len(first.replicas) if first is not None else 0,
            config={k: str(e.value) for k, e in entries.items()},
        )
    return states


def plan(admin: AdminClient, specs: list[TopicSpec], timeout: float = 10.0) -> Plan:
    states = describe(admin, [s.name for s in specs], timeout)
    changes: list[Change] = []
    refusals: list[str] = []
    unchanged: list[str] = []
    for spec in specs:
        state = states.get(spec.name)
        if state is None:
            changes.append(
                Change(
                    spec.name,
                    "create",
                    f"{spec.partitions} partitions, replication {spec.replication}",
                    spec,
                )
            )
            continue
        touched = False
        if spec.partitions < state.partitions:
            refusals.append(
                f"{spec.name}: spec has {spec.partitions} partitions but the broker has "
                f"{state.partitions}; Kafka cannot shrink a topic (it would re-key every "
                "session). Raise the spec back, or create a new topic version and migrate."
            )
        elif spec.partitions > state.partitions:
            changes.append(
                Change(
                    spec.name,
                    "add_partitions",
                    f"partitions {state.partitions} -> {spec.partitions}",
                    spec,
                )
            )
            touched = True
        if spec.replication != state.replication:
            refusals.append(
                f"{spec.name}: spec asks replication {spec.replication}, broker has "
                f"{state.replication}; change it with kafka-reassign-partitions, not liverl."
            )
        drift = {k: v for k, v in spec.config.items() if state.config.get(k) != v}
        if drift:
            detail = ", ".join(f"{k} {state.config.get(k)!r} -> {v!r}" for k, v in drift.items())
            changes.append(Change(spec.name, "alter_config", detail, spec, configs=drift))
            touched = True
        if not touched and not any(r.startswith(spec.name + ":") for r in refusals):
            unchanged.append(spec.name)
    return Plan(changes, refusals, unchanged, states)


def apply(admin: AdminClient, the_plan: Plan, timeout: float = 30.0) -> None:
    """Execute a plan; refuses (changing nothing) if the plan holds any refusal."""
    if the_plan.refusals:
        raise TopicSpecError("refusing to apply:\n  " + "\n  ".join(the_plan.refusals))
    creates = [
        NewTopic(c.topic, c.spec.partitions, c.spec.replication, config=dict(c.spec.config))
        for c in the_plan.changes
        if c.action == "create"
    ]
    grows = [
        NewPartitions(c.topic, c.spec.partitions)
        for c in the_plan.changes
        if c.action == "add_partitions"
    ]
    alters = [
        ConfigResource(
            ConfigResource.Type.TOPIC,
            c.topic,
            incremental_configs=[
                ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
                for k, v in c.configs.items()
            ],
        )
        for c in the_plan.changes
        if c.action == "alter_config"
    ]
    futures: dict[Any, Any] = {}
    if creates:
        futures.update(admin.create_topics(creates, request_timeout=timeout))
    if grows:
        futures.update(admin.create_partitions(grows, request_timeout=timeout))
    if alters:
        futures.update(admin.incremental_alter_configs(alters, request_timeout=timeout))
    errors = []
    for what, fut in futures.items():
        try:
            fut.result(timeout=timeout)
        except KafkaException as exc:
            errors.append(f"{getattr(what, 'name', what)}: {exc.args[0]}")
    if errors:
        raise TopicSpecError("broker rejected changes:\n  " + "\n  ".join(errors))


def _leading_comment(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").rstrip())
    return " ".join(lines)


def event_types(specs: list[TopicSpec]) -> dict[str, str]:
    """topic -> the event type it carries (``value_schema`` ``interaction.v1`` ->
    ``interaction``): the one place consumers learn what to expect on a topic."""
    return {s.name: s.value_schema.rsplit(".v", 1)[0] for s in specs}


def session_partitions(specs: list[TopicSpec]) -> int:
    """The partition count shared by the session-keyed topics (``load_specs`` checks that
    they agree): what the processors' tables and internal topics must use to stay
    co-partitioned with them."""
    counts = {s.partitions for s in specs if s.key == SESSION_KEY}
    if len(counts) != 1:
        raise TopicSpecError(
            f"expected one partition count for topics keyed by {SESSION_KEY}, "
            f"found {sorted(counts) or 'none'}"
        )
    return counts.pop()
