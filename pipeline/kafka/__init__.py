"""Kafka plumbing: local broker, topics as code, typed producer/consumer with a DLQ.

Names are resolved lazily so that light modules (``pipeline.kafka.names``, ``connection``) can
be imported without loading the clients.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the checker sees the real types; at run time they load on first use
    from pipeline.kafka.broker import BrokerError as BrokerError
    from pipeline.kafka.broker import LocalBroker as LocalBroker
    from pipeline.kafka.consumer import Batch as Batch
    from pipeline.kafka.consumer import EventConsumer as EventConsumer
    from pipeline.kafka.consumer import Record as Record
    from pipeline.kafka.producer import DeliveryError as DeliveryError
    from pipeline.kafka.producer import EventProducer as EventProducer
    from pipeline.kafka.topics import TopicSpec as TopicSpec
    from pipeline.kafka.topics import TopicSpecError as TopicSpecError
    from pipeline.kafka.topics import load_specs as load_specs

_EXPORTS = {
    "Batch": "consumer",
    "EventConsumer": "consumer",
    "Record": "consumer",
    "BrokerError": "broker",
    "LocalBroker": "broker",
    "DeliveryError": "producer",
    "EventProducer": "producer",
    "TopicSpec": "topics",
    "TopicSpecError": "topics",
    "load_specs": "topics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline.kafka' has no attribute {name!r}")
    return getattr(import_module(f"pipeline.kafka.{module}"), name)
