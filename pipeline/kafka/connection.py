"""The Kafka layer's own settings: where the cluster is and the limits every client obeys.

The bottom of the settings layers (docs/architecture.md, Settings): these models import
nothing of liverl's components, and the producer, consumer, broker, inspection and tap take
them (a :class:`ConnectionSettings`), not the composed ``pipeline.settings.Settings``, which
sits on top and carries them as its ``[kafka]``, ``[broker]`` and ``[topics]`` sections. Like
quix-streams' ``ConnectionConfig``: a small typed value a client is built from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.contracts import contracts_dir
from pipeline.events.codec import DEFAULT_CODEC_VERSION

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SPECS_DIR = contracts_dir("topics")


class KafkaSettings(BaseModel):
    """The ``[kafka]`` section: where the cluster is. ``bootstrap`` unset means the embedded
    local broker (``[broker]``)."""

    bootstrap: str | None = Field(
        default=None,
        description="External cluster bootstrap servers; when set nothing local is started.",
    )
    client: dict[str, str] = Field(
        default_factory=dict,
        description="librdkafka settings passed through to every client (SASL/SSL etc.).",
    )
    compression: str = "lz4"
    codec_version: int = Field(
        default=DEFAULT_CODEC_VERSION,
        ge=1,
        le=2,
        description="Codec version written for interactions and samples: 2 carries token ids, "
        "log-probs and masks as base64 binary arrays, 1 as JSON lists. Readers take both "
        "(docs/architecture.md, Codec versions).",
    )
    max_event_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=64 * 1024,
        description="Largest event value accepted; larger ones are dead-lettered.",
    )
    namespace: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$",
        description="Replay namespace: every topic and group id gets the prefix replay.NAME. "
        "(pipeline/kafka/names.py: resolve); unset is the live pipeline.",
    )

    # One size policy, derived from ``max_event_bytes`` (E) so that it is stated once:
    #   event (codec, dead letters)  E                    8 MiB by default
    #   record (broker message.max.bytes, every topic's max.message.bytes, every producer's
    #           message.max.bytes / Faust producer_max_request_size)   E + 1 MiB = 9 MiB
    #   fetch (max.partition.fetch.bytes, Faust consumer_max_fetch_size) E + 2 MiB = 10 MiB
    # An event of E bytes plus its key and headers always fits a record; a record the broker
    # accepted always fits a fetch; a dead letter is truncated to E (it must be readable by
    # the same codec), so no single record can stop a producer or a consumer.
    @property
    def record_headroom_bytes(self) -> int:
        """Room above an event for its key, headers and batch framing."""
        return 1024 * 1024

    @property
    def max_record_bytes(self) -> int:
        """Broker/topic/producer limit on one record batch; strictly above the codec limit."""
        return self.max_event_bytes + self.record_headroom_bytes

    @property
    def max_fetch_bytes(self) -> int:
        """Per-partition fetch size of every consumer; strictly above the record limit."""
        return self.max_record_bytes + self.record_headroom_bytes


class ConnectionSettings(KafkaSettings):
    """What a Kafka client is built from: the ``[kafka]`` section with the bootstrap resolved
    (the local broker's when none is configured) and the topic specs that say which event
    type each topic carries. Immutable: derive another with ``model_copy``."""

    model_config = ConfigDict(frozen=True)

    bootstrap: str = Field(description="Bootstrap servers every client connects to.")
    specs_dir: Path = Field(
        default=DEFAULT_SPECS_DIR,
        description="Topic specs (topics/*.yaml): the event type a consumer expects per topic.",
    )
    replication_factor: int | None = Field(
        default=None,
        description="Replicas of every topic created here ([topics] replication_factor; "
        "unset: each spec's own).",
    )

    def client_config(self, **extra: Any) -> dict[str, Any]:
        """librdkafka config for any client: bootstrap + pass-through settings + ``extra``."""
        conf: dict[str, Any] = {"bootstrap.servers": self.bootstrap}
        conf.update(self.client)
        conf.update(extra)
        return conf


class HasConnection(Protocol):
    """Anything carrying a connection, such as the composed ``Settings``."""

    @property
    def connection(self) -> ConnectionSettings: ...


# What the Kafka layer's clients accept: their settings, or an object that carries them.
Connectable = ConnectionSettings | HasConnection


def connection_of(source: Connectable) -> ConnectionSettings:
    """The connection settings of ``source``."""
    return source if isinstance(source, ConnectionSettings) else source.connection


class BrokerSettings(BaseModel):
    """The ``[broker]`` section: the embedded Apache Kafka (KRaft) started by ``liverl broker
    up``: one node, or a local cluster of ``nodes`` combined broker+controller nodes
    (docs/architecture.md, Cluster)."""

    host: str = "127.0.0.1"
    port: int = 9092
    controller_port: int = 9093
    nodes: int = Field(
        default=1,
        ge=1,
        le=5,
        description="Nodes of the local cluster; node i listens on port + 2(i-1) and "
        "controller_port + 2(i-1) (3 nodes: 9092/9094/9096). With more than one, topics get "
        "replication min(3, nodes) and min.insync.replicas 2 once that is 3.",
    )
    kafka_version: str = "4.4.0"
    scala_version: str = "2.13"
    log4j_version: str = "2.26.1"
    slf4j_version: str = "2.0.17"
    heap_mb: int = Field(default=512, le=1024, description="JVM heap (-Xmx), at most 1 GiB.")
    start_timeout_s: float = 90.0
    stop_timeout_s: float = 30.0
    cache_dir: Path | None = Field(
        default=None,
        description="Where resolved Kafka jars live (default ~/.cache/liverl/kafka).",
    )

    @model_validator(mode="after")
    def _ports_distinct(self) -> BrokerSettings:
        ports = [p for _, port, ctl in self.node_ports() for p in (port, ctl)]
        if len(set(ports)) != len(ports) or max(ports) > 65535:
            raise ValueError(
                f"broker ports {ports} of {self.nodes} node(s) collide or exceed 65535: node i "
                "uses port + 2(i-1) and controller_port + 2(i-1); choose port and "
                "controller_port apart (e.g. 9092 and 9093)"
            )
        return self

    def node_ports(self) -> list[tuple[int, int, int]]:
        """(node id, listener port, controller port) of every node."""
        return [(i + 1, self.port + 2 * i, self.controller_port + 2 * i) for i in range(self.nodes)]

    @property
    def bootstrap(self) -> str:
        """Every node's listener, so a client starts even with one node down."""
        return ",".join(f"{self.host}:{port}" for _, port, _ in self.node_ports())

    @property
    def replication(self) -> int:
        """Replicas a topic can have here: one per node, three at most."""
        return min(3, self.nodes)


class TopicSettings(BaseModel):
    """The ``[topics]`` section: topic specs are data in ``topics/``; these knobs adapt them
    to a cluster."""

    specs_dir: Path = DEFAULT_SPECS_DIR
    replication_factor: int | None = Field(
        default=None, description="Override every spec's replication (e.g. 3 in production)."
    )
