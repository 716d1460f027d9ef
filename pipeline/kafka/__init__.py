"""Kafka plumbing: local broker, topics as code, typed producer/consumer with a DLQ.

Names are resolved lazily so that light modules (``pipeline.kafka.names``, ``connection``) can
be imported without loading the clients.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

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
