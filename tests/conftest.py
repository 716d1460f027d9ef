"""Shared fixtures: one real Kafka broker per test session.

With ``LIVERL_KAFKA_BOOTSTRAP`` set, tests use that cluster. Otherwise the embedded broker
of the default settings is started (or reused when ``.ci/run`` or a developer already runs
it) and stopped at the end only if this session started it.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator

import pytest

from pipeline.settings import Settings


@pytest.fixture(autouse=True)
def _signal_handling_restored() -> Iterator[None]:
    """A command run in-process (click's CliRunner) may install process-wide signal handling:
    `liverl train` sets a wakeup fd whose watchdog ends the process with status 0 some
    seconds after a SIGTERM. Left installed, a later test's SIGTERM ended a whole run that
    way, a failed test included, and the run passed. Restored after every test."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    signal.set_wakeup_fd(-1)
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)


@pytest.fixture(scope="session")
def kafka_settings() -> Iterator[Settings]:
    from confluent_kafka.admin import AdminClient

    from pipeline.kafka import topics
    from pipeline.kafka.broker import LocalBroker

    settings = Settings()
    started = False
    if settings.uses_local_broker:
        local = LocalBroker(settings)
        started = local.pid() is None
        local.up(quiet=True)
    admin = AdminClient(settings.kafka_client_config())
    specs = topics.load_specs(settings.topics.specs_dir, settings.topics.replication_factor)
    the_plan = topics.plan(admin, specs)
    if the_plan.changes:
        topics.apply(admin, the_plan)
    yield settings
    if started:
        LocalBroker(settings).down(quiet=True)


@pytest.fixture
def admin(kafka_settings: Settings):  # type: ignore[no-untyped-def]
    from confluent_kafka.admin import AdminClient

    return AdminClient(kafka_settings.kafka_client_config())


@pytest.fixture
def unique() -> str:
    """A short unique suffix for topic and group names, so tests never collide."""
    return uuid.uuid4().hex[:10]


def create_topic(admin, name: str, partitions: int = 1) -> None:  # type: ignore[no-untyped-def]
    from confluent_kafka.admin import NewTopic

    for fut in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        fut.result(timeout=30)
