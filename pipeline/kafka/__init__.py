"""Kafka plumbing: local broker, topics as code, typed producer/consumer with a DLQ."""

from pipeline.kafka.broker import BrokerError, LocalBroker
from pipeline.kafka.consumer import Batch, EventConsumer, Record
from pipeline.kafka.producer import DeliveryError, EventProducer
from pipeline.kafka.topics import TopicSpec, TopicSpecError, load_specs

__all__ = [
    "Batch",
    "BrokerError",
    "DeliveryError",
    "EventConsumer",
    "EventProducer",
    "LocalBroker",
    "Record",
    "TopicSpec",
    "TopicSpecError",
    "load_specs",
]
