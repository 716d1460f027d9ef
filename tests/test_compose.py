"""docker-compose.yml is runnable as written: real commands, health-gated start order."""

from __future__ import annotations

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
    fields = {k[len(prefix):].lower(): v for k, v in env.items() if k.startswith(prefix)}
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
