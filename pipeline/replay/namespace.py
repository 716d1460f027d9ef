"""Namespaces: a second pipeline on the same cluster, one option away from the live one.

A namespace NAME is the live pipeline behind the prefix ``replay.NAME.``: topics (from the same
specs, so the same partition counts and therefore the same key -> partition placement),
consumer group ids and the Faust app id, all mapped in one place (``names.resolve``, applied
by ``EventProducer``, ``EventConsumer`` and the Faust app). Local state moves to
``<state_dir>/replay/NAME/`` (weights, lake, processors' tables, the replay manifest).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

from pipeline.kafka import names
from pipeline.kafka.connection import Connectable, HasConnection, KafkaSettings, connection_of
from pipeline.replay.errors import NamespaceError, NamespaceNameError


class Namespaceable(HasConnection, Protocol):
    """What :func:`enter` rebases: settings carrying ``[kafka]``, a state dir and a
    connection, such as the composed ``pipeline.settings.Settings`` (which sits above this
    module and is not imported by it)."""

    kafka: KafkaSettings
    state_dir: Path

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> Self: ...


S = TypeVar("S", bound=Namespaceable)

_NAME = re.compile(names.NAMESPACE_PATTERN)


def check_name(name: str) -> str:
    """``name`` if it can be a namespace (letters, digits, ``_``, ``-``; no dots)."""
    if not _NAME.match(name):
        raise NamespaceNameError(
            f"{name!r} is not a namespace name: 1-64 letters, digits, '_' or '-', starting with "
            "a letter or digit (no dots: replay.NAME. must split back)"
        )
    return name


def local_dir(state_dir: Path, name: str) -> Path:
    """``<state_dir>/replay/NAME`` of the live state dir (or ``state_dir`` itself, if it is
    already the namespace's)."""
    state = Path(state_dir)
    if state.parts[-2:] == ("replay", name):
        return state
    return state / "replay" / name


def enter(settings: S, name: str | None = None) -> S:
    """``settings`` for namespace ``name`` (default: ``kafka.namespace``): topics and group ids
    mapped, ``state_dir`` rebased under ``<state_dir>/replay/NAME``. Idempotent; None -> as is."""
    name = name or settings.kafka.namespace
    if not name:
        return settings
    check_name(name)
    kafka = settings.kafka.model_copy(update={"namespace": name})
    state_dir = local_dir(settings.state_dir, name)
    return settings.model_copy(update={"kafka": kafka, "state_dir": state_dir})


def specs(kafka: Connectable, name: str) -> list[Any]:
    """The topic specs of the namespace: live specs renamed, same partitions and configs,
    except ``retention.ms = -1``: replayed records keep their original timestamps, which time
    retention would expire at once for an archived day; a namespace lives until dropped."""
    from pipeline.kafka.topics import load_specs

    conn = connection_of(kafka)
    out = []
    for spec in load_specs(
        conn.specs_dir, conn.replication_factor, max_record_bytes=conn.max_record_bytes
    ):
        config = {**spec.config, "retention.ms": "-1"}
        out.append(dataclasses.replace(spec, name=names.resolve(spec.name, name), config=config))
    return out


def _admin(kafka: Connectable) -> Any:
    from confluent_kafka.admin import AdminClient

    return AdminClient(connection_of(kafka).client_config())


def existing_topics(settings: Connectable, timeout: float = 15.0) -> set[str]:
    try:
        return set(_admin(settings).list_topics(timeout=timeout).topics)
    except Exception as exc:  # noqa: BLE001 - KafkaException: say where, not a traceback
        bootstrap = connection_of(settings).bootstrap
        raise NamespaceError(f"cannot reach Kafka at {bootstrap}: {exc}") from exc


def missing_topics(settings: Connectable, name: str) -> list[str]:
    present = existing_topics(settings)
    return [s.name for s in specs(settings, name) if s.name not in present]


def require_topics(settings: Connectable, name: str | None = None) -> None:
    """Refuse to run a component in a namespace whose topics do not exist (a typo would
    otherwise start an empty pipeline that waits forever)."""
    name = name or connection_of(settings).namespace
    if not name:
        return
    missing = missing_topics(settings, name)
    if missing:
        raise NamespaceError(
            f"namespace {name!r} has no topic(s) {', '.join(missing)}; create them with "
            f"`liverl topics apply --namespace {name}` (or `liverl replay ... --into {name}`)"
        )


def ensure_topics(settings: Connectable, name: str) -> list[str]:
    """Create the namespace's missing topics (idempotent); returns the names created."""
    from pipeline.kafka import topics as t

    admin = _admin(settings)
    the_plan = t.plan(admin, specs(settings, name))
    creates = [c for c in the_plan.changes if c.action == "create"]
    if creates:
        t.apply(admin, t.Plan(creates, [], []))
        wait_ready(settings, {c.topic: c.spec.partitions for c in creates})
    return [c.topic for c in creates]


def wait_ready(settings: Connectable, topics: dict[str, int], timeout: float = 60.0) -> None:
    """Wait until every partition of new topics answers (a leader is elected): right after
    creation, offset queries fail with NOT_LEADER_FOR_PARTITION for a moment."""
    from confluent_kafka import Consumer, KafkaException

    from .replay import watermarks

    c = Consumer(connection_of(settings).client_config(**{"group.id": "liverl-namespace-probe"}))
    try:
        for topic, count in topics.items():
            for p in range(count):
                try:
                    watermarks(c, topic, p, timeout)
                except KafkaException as exc:
                    raise NamespaceError(f"{topic}[{p}] not ready: {exc}") from exc
    finally:
        c.close()


def namespace_topics(settings: Connectable, name: str) -> list[str]:
    """Every topic under the namespace's prefix: spec copies and Faust's internal ones."""
    p = names.prefix(name)
    return sorted(t for t in existing_topics(settings) if t.startswith(p))


def namespace_groups(settings: Connectable, name: str, timeout: float = 30.0) -> list[str]:
    p = names.prefix(name)
    admin = _admin(settings)  # held until the answer: a collected client answers "no groups"
    result = admin.list_consumer_groups(request_timeout=timeout).result(timeout=timeout)
    return sorted(g.group_id for g in result.valid if g.group_id.startswith(p))


def drop(
    settings: Connectable, state_dir: Path, name: str, timeout: float = 60.0
) -> tuple[list[str], list[str]]:
    """Delete the namespace's topics, consumer groups and local state dir; never anything
    outside the prefix ``replay.NAME.`` and ``<state_dir>/replay/NAME``."""
    admin = _admin(settings)
    topics = namespace_topics(settings, name)
    groups = namespace_groups(settings, name)
    if groups:
        for group, fut in admin.delete_consumer_groups(groups, request_timeout=timeout).items():
            try:
                fut.result(timeout)
            except Exception as exc:  # noqa: BLE001 - a member still running: say which
                raise NamespaceError(f"cannot delete group {group}: {exc}") from exc
    if topics:
        for topic, fut in admin.delete_topics(topics, operation_timeout=timeout).items():
            try:
                fut.result(timeout)
            except Exception as exc:  # noqa: BLE001
                if "UNKNOWN_TOPIC" not in str(exc):
                    raise NamespaceError(f"cannot delete topic {topic}: {exc}") from exc
    shutil.rmtree(local_dir(state_dir, name), ignore_errors=True)
    return topics, groups


def trainer_settings(cfg: Any, settings: Namespaceable, typed: dict[str, Any]) -> Any:
    """A namespaced trainer's settings: its input topic in the namespace, and weights and lake
    under the namespace's state dir unless given on the command line (roots from the settings
    file are the live ones: a namespaced trainer must never publish there)."""
    ns = settings.kafka.namespace
    if not ns:
        return cfg
    update: dict[str, Any] = {"input_topic": names.resolve(cfg.input_topic, ns)}
    for key, sub in (("weights_root", "weights"), ("lake_root", "lake")):
        if key not in typed:
            update[key] = Path(settings.state_dir) / sub
    return cfg.model_copy(update=update)


def enter_checked(settings: S, name: str | None) -> S:
    """:func:`enter`, then :func:`require_topics`: what a namespaced component runs at start."""
    settings = enter(settings, name)
    require_topics(settings)
    return settings
