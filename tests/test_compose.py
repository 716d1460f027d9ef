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
