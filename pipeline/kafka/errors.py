"""Errors of the Kafka layer: the local broker, topic specs, delivery and taps."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import LiverlError


@dataclass(frozen=True)
class DeliveryFailure:
    """One record the cluster did not acknowledge."""

    topic: str
    key: bytes | None
    error: str


class BrokerError(LiverlError, RuntimeError):
    """Something stops the local broker; the message names the remedy."""


class TopicSpecError(LiverlError, ValueError):
    """A spec file is invalid or cannot be applied as written."""


class DeliveryError(LiverlError, RuntimeError):
    """One or more records were not acknowledged by the cluster."""

    def __init__(self, failures: list[DeliveryFailure]) -> None:
        self.failures = failures
        shown = "; ".join(f"{f.topic}: {f.error}" for f in failures[:5])
        more = f" (+{len(failures) - 5} more)" if len(failures) > 5 else ""
        super().__init__(f"{len(failures)} record(s) not delivered: {shown}{more}")


class TopicNameError(LiverlError, ValueError):
    """A topic named on the command line that is not one (unknown, empty): exit status 2."""

    exit_code = 2


class TapError(LiverlError):
    """A tap cannot read what was asked (unknown topic, bad --since)."""

    exit_code = 2


class TopicMissing(TapError):
    """The broker has no such topic."""


class ReadError(LiverlError):
    """A one-shot read of a topic could not reach its end (a stalled partition, a fetch
    error): what was read is partial and must not pass for the whole topic."""
