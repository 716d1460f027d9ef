"""docker-compose.yml is runnable as written: real commands, health-gated start order."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml

from pipeline.cli import cli

COMPOSE = yaml.safe_load((Path(__file__).resolve().parents[1] / "docker-compose.yml").read_text())


def test_services_depend_on_existing_services_with_conditions() -> None:
    services = COMPOSE["services"]
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert cond["condition"] in {"service_healthy", "service_completed_successfully"}
    assert "healthcheck" in services["kafka"]
    assert services["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["sglang"]["profiles"] == ["gpu"]


def test_liverl_services_run_real_cli_commands() -> None:
    for name, svc in COMPOSE["services"].items():
        if svc.get("image") != "liverl:latest":
            continue
        command = svc["command"]
        assert command[0] in cli.commands, f"service {name} runs unknown `liverl {command[0]}`"
        sub = cli.commands[command[0]]
        if command[0] == "topics":
            assert command[1] in sub.commands  # type: ignore[attr-defined]
        else:
            flags = {opt for p in sub.params for opt in getattr(p, "opts", [])}
            given = {arg for arg in command[1:] if arg.startswith("--")}
            assert given <= flags, f"{name}: unknown flags {given - flags}"


def test_gpu_profile_routes_a_gateway_to_sglang_with_original_logprobs() -> None:
    from pipeline.serving.settings import ServeSettings

    services = COMPOSE["services"]
    assert services["sglang"]["environment"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    gpu = [
        name
        for name, svc in services.items()
        if svc.get("profiles") == ["gpu"] and svc.get("command", [None])[0] == "serve"
    ]
    assert gpu == ["gateway-sglang"]
    svc = services["gateway-sglang"]
    env = svc["environment"]
    prefix = "LIVERL_SERVE_"
    fields = {k[len(prefix) :].lower(): v for k, v in env.items() if k.startswith(prefix)}
    assert set(fields) <= set(ServeSettings.model_fields) | {"api_keys"}
    assert fields["backend"] == "sglang"
    assert fields["sglang_url"] == "http://sglang:30000"
    assert svc["depends_on"]["sglang"]["condition"] == "service_healthy"


def test_named_volumes_are_declared_and_the_model_is_pulled_once() -> None:
    declared = set(COMPOSE["volumes"])
    for name, svc in COMPOSE["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/", "$")):
                assert source in declared, f"{name} mounts undeclared volume {source}"
    services = COMPOSE["services"]
    assert services["model"]["command"] == ["models", "pull"]
    for name in ("gateway", "trainer", "gateway-sglang", "sglang"):
        condition = services[name]["depends_on"]["model"]["condition"]
        assert condition == "service_completed_successfully", name
    assert "--enable-lora" in services["sglang"]["command"]


def _interpolation_default(value: str) -> str:
    """``${VAR:-default}`` -> ``default`` (what Compose uses when VAR is unset)."""
    assert value.startswith("${") and ":-" in value and value.endswith("}"), value
    return value[2:-1].split(":-", 1)[1]


def test_cluster_profile_is_the_three_node_layout_of_the_local_cluster(tmp_path: Path) -> None:
    """kafka-1..3 under `--profile cluster`: one cluster id, one 3-voter quorum, each node its
    own id, advertised name and volume, and the same replication settings as
    `liverl broker up --nodes 3` writes (so both layouts behave alike)."""
    from pipeline.kafka.broker import LocalBroker
    from pipeline.settings import BrokerSettings, Settings

    services = COMPOSE["services"]
    cluster = sorted(n for n, s in services.items() if s.get("profiles") == ["cluster"])
    assert cluster == ["kafka-1", "kafka-2", "kafka-3"]
    envs = {n: services[n]["environment"] for n in cluster}
    voters = "1@kafka-1:9093,2@kafka-2:9093,3@kafka-3:9093"
    (cluster_id,) = {e["CLUSTER_ID"] for e in envs.values()}  # one cluster id
    assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16, "a Kafka Uuid: 16 bytes"
    volumes = set()
    for i, name in enumerate(cluster, start=1):
        svc, env = services[name], envs[name]
        assert svc["image"] == services["kafka"]["image"] and svc["hostname"] == name
        assert env["KAFKA_NODE_ID"] == i
        assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
        assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == voters
        assert env["KAFKA_ADVERTISED_LISTENERS"] == f"PLAINTEXT://{name}:9092"
        assert "healthcheck" in svc
        (volume,) = svc["volumes"]
        source, target = volume.split(":")
        assert target == env["KAFKA_LOG_DIRS"] == "/var/lib/kafka/data"
        volumes.add(source)
    assert len(volumes) == 3, "each node its own data volume"
    assert services["kafka"]["environment"]["KAFKA_LOG_DIRS"] == "/var/lib/kafka/data"
    # the broker settings liverl writes for its own layouts, key by key
    for nodes, env in ((3, envs["kafka-2"]), (1, services["kafka"]["environment"])):
        local = LocalBroker(Settings(state_dir=tmp_path, broker=BrokerSettings(nodes=nodes)))
        props = local.node_config(local.nodes[0])
        for key in (
            "offsets.topic.replication.factor",
            "transaction.state.log.replication.factor",
            "transaction.state.log.min.isr",
            "share.coordinator.state.topic.replication.factor",
            "share.coordinator.state.topic.min.isr",
            "default.replication.factor",
            "min.insync.replicas",
            "broker.heartbeat.interval.ms",
            "broker.session.timeout.ms",
            "auto.create.topics.enable",
            "message.max.bytes",
            "group.initial.rebalance.delay.ms",
        ):
            if key in props:
                assert str(env["KAFKA_" + key.upper().replace(".", "_")]) == props[key], key


def test_cluster_profile_wires_topics_and_the_pipeline_to_every_node() -> None:
    services = COMPOSE["services"]
    cluster_bootstrap = COMPOSE["x-cluster-bootstrap"]
    advertised = [
        services[n]["environment"]["KAFKA_ADVERTISED_LISTENERS"].split("//")[1]
        for n in ("kafka-1", "kafka-2", "kafka-3")
    ]
    assert cluster_bootstrap.split(",") == advertised
    topics = services["topics"]
    for node in ("kafka-1", "kafka-2", "kafka-3"):
        dep = topics["depends_on"][node]
        assert dep == {"condition": "service_healthy", "required": False}, node
    for name, svc in services.items():
        env = svc.get("environment") or {}
        if svc.get("image") != "liverl:latest" or "LIVERL_KAFKA_BOOTSTRAP" not in env:
            continue
        # unset: the single broker, exactly as before; replication 1 = every spec's own
        assert env["LIVERL_KAFKA_BOOTSTRAP"] == "${LIVERL_COMPOSE_KAFKA:-kafka:9092}", name
        assert _interpolation_default(env["LIVERL_KAFKA_BOOTSTRAP"]) == "kafka:9092"
        assert _interpolation_default(env["LIVERL_TOPICS_REPLICATION_FACTOR"]) == "1", name
    assert {"gateway", "workers", "trainer", "topics"} <= {
        n
        for n, s in services.items()
        if "LIVERL_COMPOSE_KAFKA" in str((s.get("environment") or {}).get("LIVERL_KAFKA_BOOTSTRAP"))
    }
