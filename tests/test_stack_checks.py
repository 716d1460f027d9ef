"""`liverl up` checks what it can before it starts anything (issue 40 item 8): a model that
does not exist or a port that is taken is one clear line, and no broker was started (it used
to fail only after Kafka had started, and leave it running)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from click.testing import CliRunner

from pipeline import stack
from pipeline.cli import cli
from pipeline.kafka.broker import LocalBroker
from pipeline.settings import Settings


def env_for(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL_")}
    return {
        **env,
        "LIVERL_STATE_DIR": str(tmp_path / "state"),
        "LIVERL_BROKER_PORT": str(stack.free_port()),
        "LIVERL_BROKER_CONTROLLER_PORT": str(stack.free_port()),
    }


def no_broker_started(env: dict[str, str]) -> bool:
    os.environ.update(env)
    try:
        return LocalBroker(Settings()).pid() is None
    finally:
        for k in env:
            if k.startswith("LIVERL_"):
                os.environ.pop(k, None)


def test_port_problem_names_a_taken_port_and_passes_a_free_one() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        problem = stack.port_problem("127.0.0.1", port)
        assert problem is not None and problem.startswith(f"cannot listen on 127.0.0.1:{port}")
    assert stack.port_problem("127.0.0.1", stack.free_port()) is None
    assert (stack.port_problem("no-such-host.invalid", 8000) or "").startswith(
        "cannot resolve --host no-such-host.invalid"
    )


def test_up_refuses_a_taken_port_before_it_starts_kafka(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli, ["up", "--port", str(port)], env=env)
    assert result.exit_code == 1, result.output
    assert f"cannot listen on 127.0.0.1:{port}" in result.output
    assert "pass another --port" in result.output and "Traceback" not in result.output
    assert no_broker_started(env)


def test_up_refuses_an_unknown_model_before_it_starts_kafka(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    result = CliRunner().invoke(
        cli,
        ["up", "--port", str(stack.free_port()), "--model", str(tmp_path / "no-such-model")],
        env=env,
    )
    assert result.exit_code == 1, result.output
    assert "no-such-model" in result.output and "Traceback" not in result.output
    assert "Kafka" not in result.output  # nothing about the broker: it was never started
    assert no_broker_started(env)


def test_metrics_port_gives_trainer_canary_and_judges_fixed_ports() -> None:
    comps = [
        stack.Component("workers", ["workers"]),
        stack.Component("judges", ["judges", "watch"]),
        stack.Component("trainer", ["train"]),
        stack.canary_component("p"),
    ]
    assert stack.with_metrics(list(comps), None) == {}
    given = list(comps)
    assert stack.with_metrics(given, 9100) == {"judges": 9102, "trainer": 9100, "canary": 9101}
    assert [c.args for c in given] == [
        ["workers"],
        ["judges", "watch", "--metrics-port", "9102"],
        ["train", "--metrics-port", "9100"],
        ["versions", "canary", "--policy", "p", "--metrics-port", "9101"],
    ]
    # --without trainer: the others keep their ports (a scrape config stays right)
    assert stack.with_metrics([comps[3]], 9100) == {"canary": 9101}


def test_up_refuses_a_taken_metrics_port_before_it_starts_kafka(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]  # the canary decider's: --metrics-port port - 1
        result = CliRunner().invoke(
            cli,
            [
                "up",
                "--port",
                str(stack.free_port()),
                "--metrics-port",
                str(port - 1),
                "--without",
                "trainer",
            ],
            env=env,
        )
    assert result.exit_code == 1, result.output
    assert f"cannot listen on 127.0.0.1:{port}" in result.output
    assert "(canary metrics); pass another --metrics-port" in result.output
    assert no_broker_started(env)


def test_up_refuses_metrics_ports_that_take_the_gateways(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    port = stack.free_port()
    result = CliRunner().invoke(
        cli, ["up", "--port", str(port), "--metrics-port", str(port - 1)], env=env
    )
    assert result.exit_code == 1, result.output
    assert f"puts the canary's metrics on the gateway's port {port}" in result.output
    assert no_broker_started(env)
