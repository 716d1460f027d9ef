"""The ``liverl workers``/``record-outcome`` commands, and the judge stage's waiting room."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner
from confluent_kafka import Consumer, TopicPartition

from pipeline import events
from pipeline.events import examples
from pipeline.kafka import names
from pipeline.processors import judging
from pipeline.processors.commands import record_outcome, workers
from pipeline.processors.outcomes import GateResult, gate_event, run_gate


def test_workers_help_names_the_knobs():
    result = CliRunner().invoke(workers, ["--help"])
    assert result.exit_code == 0
    for opt in ("--app-id", "--web-port", "--web-host", "--no-web", "--judge", "--rules"):
        assert opt in result.output


def test_workers_rejects_invalid_rules(tmp_path):
    bad = tmp_path / "rules.yaml"
    bad.write_text(
        "version: v\nbeta: 2.0\nrules:\n  - {id: x, kind: forbidden_pattern, patterns: [rm],"
        " penalty: 0.5, compliance: 0.1}\n"
    )
    result = CliRunner().invoke(workers, ["--rules", str(bad), "--no-web"])
    assert result.exit_code != 0
    assert "inaction trap" in result.output


def port_taken(port: int) -> bool:
    from pipeline.processors.config import port_problem

    return port_problem("127.0.0.1", port) is not None


def test_faust_web_server_is_off_by_default_and_bound_to_loopback(tmp_path):
    """Was: on, bound to 0.0.0.0:6066, where /router/ told anyone every changelog's partition
    assignment."""
    from pipeline.processors.app import create_app
    from pipeline.processors.config import ProcessorSettings
    from pipeline.settings import Settings

    cfg = ProcessorSettings()
    assert (cfg.web_enabled, cfg.web_host, cfg.web_port) == (False, "127.0.0.1", 0)
    assert create_app(Settings(), cfg, tmp_path).conf.web_enabled is False
    on = create_app(Settings(), ProcessorSettings(web_enabled=True), tmp_path)
    assert (on.conf.web_bind, on.conf.web_host) == ("127.0.0.1", "127.0.0.1")
    assert on.conf.web_port != 6066 and not port_taken(on.conf.web_port)  # a free one
    assert "/metrics" in on.web.views


def test_a_web_port_in_use_is_a_one_line_error_not_a_traceback(tmp_path, monkeypatch):
    """Was: ``OSError: [Errno 98] ... address already in use`` as a traceback, after the
    worker had joined its group. Now the command stops before starting, in one line."""
    import socket

    from pipeline.processors.config import free_port

    monkeypatch.setenv("LIVERL_STATE_DIR", str(tmp_path))
    port = free_port("127.0.0.1")
    while port_taken(port - 1):
        port = free_port("127.0.0.1")
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        for first, extra in (
            (port, []),
            (port, ["--processes", "2"]),
            (port - 1, ["--processes", "2"]),
        ):  # the second child's port
            result = CliRunner().invoke(workers, ["--web", "--web-port", str(first), *extra])
            assert result.exit_code == 1, result.output
            assert result.output.strip().splitlines() == [
                f"Error: web server: cannot listen on 127.0.0.1:{port} (Address already in "
                "use); pass another --web-port (0: a free one) or leave the web server off "
                "(--no-web)"
            ]


def _next_states_from_now(kafka_settings, group: str) -> Consumer:  # type: ignore[no-untyped-def]
    c = Consumer(kafka_settings.kafka_client_config(**{"group.id": group}))
    parts = c.list_topics(names.NEXT_STATES, timeout=10).topics[names.NEXT_STATES].partitions
    c.assign(
        [
            TopicPartition(
                names.NEXT_STATES,
                p,
                c.get_watermark_offsets(TopicPartition(names.NEXT_STATES, p), timeout=10)[1],
            )
            for p in parts
        ]
    )
    return c


def _one_for(c: Consumer, sid: str):  # type: ignore[no-untyped-def]
    found = None
    for _ in range(60):
        for msg in c.consume(100, timeout=0.5):
            if msg.error() is None and msg.key() == sid.encode():
                found = events.decode(msg.value(), "next_state")
        if found:
            break
    c.close()
    return found


@pytest.mark.integration
def test_record_outcome_produces_a_session_scoped_next_state(kafka_settings, unique):
    sid = f"outcome-{unique}"
    c = _next_states_from_now(kafka_settings, f"o-{unique}")
    result = CliRunner().invoke(
        record_outcome,
        ["--session", sid, "--failed", "--detail", "2 tests failed"],
        obj={"settings": kafka_settings},
    )
    assert result.exit_code == 0, result.output
    found = _one_for(c, sid)
    assert found is not None
    assert (found.kind, found.exit_code, found.score, found.content) == (
        "test_result",
        1,
        -1.0,
        "2 tests failed",
    )
    assert (found.scope, found.detail) == ("session", {"passed": False})
    assert found.event_id in result.output


def test_next_state_waits_for_its_turn_then_expires():
    ns = dataclasses.replace(examples.examples()["next_state"], event_id="n1", turn=3)
    state, todo = judging.on_next_state(None, ns, now_ms=1_000)
    assert judging.take_ready(state, todo[0]) is None  # turn 3 unknown yet
    assert judging.expired(state, 1_500, 1_000) == []
    assert judging.expired(state, 2_001, 1_000) == ["n1"]
    inter = examples.interaction(prompt_tokens=2, response_tokens=1)  # turn 3 of the session
    state = judging.on_interaction(state, inter)
    work = judging.take_ready(state, ns)
    assert work is not None and work.interaction_id == inter.event_id
    assert work.ctx.request.startswith("The CI job `unit` fails")
    assert state.pending == {}


def test_state_retention_must_outlive_live_sessions():
    from pipeline.processors.config import ProcessorSettings

    with pytest.raises(ValueError, match="retain_s"):
        ProcessorSettings(idle_timeout_s=600, grace_s=30, retain_s=600)
    assert ProcessorSettings(idle_timeout_s=600, grace_s=30, retain_s=631).retain_s == 631


# ---- record-outcome -- CMD: a quality gate run, its exit code recorded and passed through -------

PY = sys.executable


def test_a_gate_keeps_its_exit_code_and_the_ends_of_its_output():
    ok = run_gate([PY, "-c", "print('3 passed')"], 30, echo=False)
    assert (ok.exit_code, ok.stdout_tail.strip(), ok.stderr_tail, ok.timed_out) == (
        0,
        "3 passed",
        "",
        False,
    )
    code = "import sys; print('x' * 9000 + 'END'); print('E boom', file=sys.stderr); sys.exit(3)"
    bad = run_gate([PY, "-c", code], 30, tail_chars=100, echo=False)
    assert bad.exit_code == 3 and bad.stderr_tail.strip() == "E boom"
    assert len(bad.stdout_tail) == 100 and bad.stdout_tail.strip().endswith("END")


def test_a_gate_past_its_timeout_is_killed_and_fails():
    slow = run_gate(
        [PY, "-c", "import time; print('started', flush=True); time.sleep(60)"], 1.0, echo=False
    )
    assert (slow.exit_code, slow.timed_out) == (124, True)
    assert slow.stdout_tail.strip() == "started" and slow.duration_s < 30


def test_a_missing_gate_command_is_127():
    missing = run_gate(["/no/such/gate-command"], 5, echo=False)
    assert missing.exit_code == 127 and "gate-command" in missing.stderr_tail


def test_gate_event_carries_the_verdict_and_the_tails():
    gate = GateResult(2, "collected 4\n1 failed", "warning", False, 1.5)
    ev = gate_event("s", ["pytest", "-q", "tests/x y.py"], gate, turn=3)
    assert (ev.kind, ev.turn, ev.scope) == ("test_result", 3, "turn")
    assert (ev.exit_code, ev.score) == (2, -1.0)
    assert ev.content == "$ pytest -q 'tests/x y.py'\ncollected 4\n1 failed\n[stderr]\nwarning"
    assert ev.detail["command"] == "pytest -q 'tests/x y.py'" and ev.detail["passed"] is False
    assert (ev.detail["stdout_tail"], ev.detail["timed_out"]) == ("collected 4\n1 failed", False)
    passed = gate_event("s", ["true"], GateResult(0, "", "", False, 0.1))
    assert (passed.exit_code, passed.score, passed.scope) == (0, 1.0, "session")


@pytest.mark.parametrize(
    "args",
    [["--session", "s"], ["--session", "s", "--passed", "--", PY, "-c", "pass"]],
)
def test_record_outcome_needs_a_verdict_or_a_command_not_both(args):
    result = CliRunner().invoke(record_outcome, args)
    assert result.exit_code == 2 and "--passed/--failed" in result.output


@pytest.mark.integration
@pytest.mark.parametrize(
    ("code", "exit_code", "stream"),
    [
        ("print('all 5 passed')", 0, "all 5 passed"),
        ("import sys; print('AssertionError', file=sys.stderr); sys.exit(3)", 3, "AssertionError"),
    ],
)
def test_record_outcome_runs_the_gate_and_records_it(
    kafka_settings, unique, code, exit_code, stream
):
    sid = f"gate-{unique}"
    c = _next_states_from_now(kafka_settings, f"g-{unique}")
    result = CliRunner().invoke(
        record_outcome,
        ["--session", sid, "--turn", "2", "--timeout", "60", "--", PY, "-c", code],
        obj={"settings": kafka_settings},
    )
    assert result.exit_code == exit_code, result.output  # the gate's code passes through
    assert stream in result.output  # its output passed through too
    found = _one_for(c, sid)
    assert found is not None and found.event_id in result.output
    assert (found.kind, found.turn, found.scope, found.exit_code) == (
        "test_result",
        2,
        "turn",
        exit_code,
    )
    assert found.score == (1.0 if exit_code == 0 else -1.0)
    assert found.detail["passed"] is (exit_code == 0)
    tails = found.detail["stdout_tail"] + found.detail["stderr_tail"]
    assert stream in tails and stream in found.content
    assert found.detail["command"] == shlex.join([PY, "-c", code])


# ---- workers --processes N: the supervisor (trivial children, no Kafka) -----------------------


def _supervisor(argvs, **kw):  # type: ignore[no-untyped-def]
    import io

    from pipeline.processors.supervisor import Supervisor

    out = io.BytesIO()
    kw = {"backoff_s": 0.05, "poll_s": 0.05, "stop_grace_s": 10.0, **kw}
    return Supervisor(argvs, out=out, **kw), out


def test_child_command_lines_get_the_options_and_their_own_web_port():
    from pipeline.processors.supervisor import child_argvs

    web = child_argvs(["--app-id", "a"], 3, 7000, prefix=["--config", "c.toml"], python="py")
    assert web == [
        [
            "py",
            "-m",
            "pipeline.cli",
            "--config",
            "c.toml",
            "workers",
            "--app-id",
            "a",
            "--worker-index",
            str(i),
            "--web-port",
            str(7000 + i),
        ]
        for i in range(3)
    ]
    assert child_argvs(["--no-web"], 2, None, python="py") == [
        ["py", "-m", "pipeline.cli", "workers", "--no-web", "--worker-index", str(i)]
        for i in range(2)
    ]
    # port 0: every child picks a free port of its own (0 + i would hand out 1, 2, ...)
    assert child_argvs(["--web"], 2, 0, python="py") == [
        [
            "py",
            "-m",
            "pipeline.cli",
            "workers",
            "--web",
            "--worker-index",
            str(i),
            "--web-port",
            "0",
        ]
        for i in range(2)
    ]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--app-id", "a", "--no-web", "--judge", "rules", "-l", "info", "--namespace", "n"],
            [
                [
                    "--app-id",
                    "a",
                    "--no-web",
                    "--judge",
                    "rules",
                    "--namespace",
                    "n",
                    "--loglevel",
                    "info",
                    "--worker-index",
                    str(i),
                ]
                for i in range(2)
            ],
        ),
        (
            ["--web", "--web-port", "PORT", "--worker-index", "5"],  # children are numbered
            [
                ["--web", "--worker-index", "0", "--web-port", "PORT"],
                ["--web", "--worker-index", "1", "--web-port", "PORT+1"],
            ],
        ),
        (
            ["--web"],
            [["--web", "--worker-index", str(i), "--web-port", "0"] for i in range(2)],
        ),  # a free port each
        (["--web-port", "7100"], [["--worker-index", str(i)] for i in range(2)]),  # web off
        ([], [["--worker-index", str(i)] for i in range(2)]),
    ],
)
def test_workers_processes_starts_children_with_the_typed_options(
    args, expected, tmp_path, monkeypatch
):
    from pipeline.processors import supervisor
    from pipeline.processors.config import free_port

    port = free_port("127.0.0.1")
    while any(port_taken(p) for p in (port, port + 1)):
        port = free_port("127.0.0.1")
    subst = {"PORT": str(port), "PORT+1": str(port + 1)}
    args = [subst.get(a, a) for a in args]
    expected = [[subst.get(a, a) for a in argv] for argv in expected]
    monkeypatch.setenv("LIVERL_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("LIVERL_PROCESSORS_WEB_ENABLED", raising=False)
    monkeypatch.delenv("LIVERL_PROCESSORS_WEB_PORT", raising=False)
    seen: list[list[str]] = []
    monkeypatch.setattr(
        supervisor.Supervisor, "run", lambda self: seen.extend(c.argv for c in self.children) or 0
    )
    result = CliRunner().invoke(workers, [*args, "--processes", "2"])
    assert result.exit_code == 0, result.output
    assert [argv[:4] for argv in seen] == [[sys.executable, "-m", "pipeline.cli", "workers"]] * 2
    assert [argv[4:] for argv in seen] == expected  # never --processes: children are plain


def test_workers_processes_passes_the_settings_file_on(tmp_path, monkeypatch):
    from pipeline.cli import cli
    from pipeline.processors import supervisor

    config = tmp_path / "liverl.toml"
    config.write_text(f'state_dir = "{tmp_path}"\n')
    seen: list[list[str]] = []
    monkeypatch.setattr(
        supervisor.Supervisor, "run", lambda self: seen.extend(c.argv for c in self.children) or 1
    )
    result = CliRunner().invoke(
        cli, ["--config", str(config), "workers", "--processes", "2", "--no-web"]
    )
    assert result.exit_code == 1 and "kept dying" in result.output  # run()'s 1 is an error
    assert seen == [
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "--config",
            str(config),
            "workers",
            "--no-web",
            "--worker-index",
            str(i),
        ]
        for i in range(2)
    ]


def test_workers_processes_checks_the_rules_once_before_starting(tmp_path, monkeypatch):
    from pipeline.processors import supervisor

    monkeypatch.setattr(supervisor.Supervisor, "run", lambda self: pytest.fail("started"))
    monkeypatch.setenv("LIVERL_STATE_DIR", str(tmp_path))
    for rules, message in ((tmp_path / "missing.yaml", "missing.yaml"), (None, "inaction trap")):
        if rules is None:
            rules = tmp_path / "rules.yaml"
            rules.write_text(
                "version: v\nbeta: 2.0\nrules:\n  - {id: x, kind: forbidden_pattern, "
                "patterns: [rm], penalty: 0.5, compliance: 0.1}\n"
            )
        result = CliRunner().invoke(workers, ["--processes", "2", "--rules", str(rules)])
        assert result.exit_code == 1 and message in result.output, result.output


def test_supervisor_restarts_a_dying_child_and_gives_up_when_it_keeps_dying():
    dies = [PY, "-c", "import sys; print('up', flush=True); sys.exit(3)"]
    lives = [PY, "-c", "import time; print('alive', flush=True); time.sleep(60)"]
    sup, out = _supervisor([lives, dies], max_deaths=3, window_s=60)
    started = time.monotonic()
    assert sup.run() == 1
    text = out.getvalue().decode()
    assert time.monotonic() - started < 20, text
    assert text.count("[worker 1] up") == 3 and text.count("restarting worker 1") == 2, text
    assert "worker 1 exited unexpectedly (code 3)" in text
    assert "worker 1 exited 3 times within 60 s; giving up" in text
    assert text.count("[worker 0] alive") == 1  # the healthy one was never restarted, but
    assert sup.children[0].proc is not None and sup.children[0].proc.returncode == -15  # stopped


def test_supervisor_keeps_a_restarted_child_and_stops_on_request(tmp_path):
    marker = tmp_path / "crashed-once"
    code = (
        "import pathlib, sys, time\n"
        f"m = pathlib.Path({str(marker)!r})\n"
        "if not m.exists():\n    m.touch(); sys.exit(1)\n"
        "print('alive', flush=True); time.sleep(60)\n"
    )
    sup, out = _supervisor([[PY, "-c", code]], max_deaths=2)
    stopper = threading.Thread(target=_stop_when, args=(sup, out, b"[worker 0] alive"))
    stopper.start()
    assert sup.run() == 0
    stopper.join()
    text = out.getvalue().decode()
    assert "exited unexpectedly (code 1)" in text and "restarting worker 0" in text, text
    assert "giving up" not in text


def test_supervisor_kills_a_child_that_ignores_the_stop():
    deaf = [
        PY,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('deaf', flush=True); time.sleep(60)",
    ]
    sup, out = _supervisor([deaf], stop_grace_s=0.5)
    stopper = threading.Thread(target=_stop_when, args=(sup, out, b"[worker 0] deaf"))
    stopper.start()
    assert sup.run() == 0
    stopper.join()
    assert "did not stop in 0.5 s: killed" in out.getvalue().decode()
    assert sup.children[0].proc is not None and sup.children[0].proc.returncode == -9


def _stop_when(sup, out, seen: bytes, limit_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit_s
    while seen not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    sup.stop()


SUPERVISED_CHILD = """
import pathlib, signal, sys, time
def bye(signum, _frame):
    print(f"got {signum}", flush=True); sys.exit(0)
signal.signal(signal.SIGTERM, bye)
pathlib.Path(sys.argv[1]).touch()
time.sleep(60)
"""


def test_supervisor_forwards_sigterm_to_every_child(tmp_path):
    import os
    import signal

    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    argvs = [[PY, "-c", SUPERVISED_CHILD, str(r)] for r in ready]
    code = (
        "import sys; from pipeline.processors.supervisor import Supervisor; "
        f"sys.exit(Supervisor({argvs!r}, poll_s=0.05).run())"
    )
    sup = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not all(r.exists() for r in ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(r.exists() for r in ready), "children did not start within 30 s"
        os.kill(sup.pid, signal.SIGTERM)
        output, _ = sup.communicate(timeout=30)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    text = output.decode()
    assert sup.returncode == 0, text
    assert f"[worker 0] got {int(signal.SIGTERM)}" in text, text
    assert f"[worker 1] got {int(signal.SIGTERM)}" in text, text
    assert "restarting" not in text and "stopping 2 worker processes" in text


@pytest.mark.integration
def test_namespace_workers_run_beside_live_ones(kafka_settings, unique, tmp_path):
    """The README's re-judge flow beside a live loop: live workers (here with their web server
    on, a free loopback port) and ``liverl workers --namespace NS --judge rules`` at the same
    time. Was: the second died binding Faust's 0.0.0.0:6066 (a traceback), so the namespace got
    no rewards. Now both groups process their own session, and the live one's /metrics
    answers on 127.0.0.1."""
    import os
    import re
    import signal

    import httpx

    from pipeline.cli import cli
    from pipeline.kafka import EventProducer
    from tests.test_processors_integration import group_session, input_ends, start_group_at
    from tests.test_replay import drop, drop_worker_state, rewards_of

    prefix, ns = f"nsw{unique}", f"nsw{unique}"
    app_id = f"nsw-{unique}"
    live_sid, ns_sid = f"{prefix}-live", f"{prefix}-ns"
    env = {**os.environ, "LIVERL_STATE_DIR": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1",
           "LIVERL_PROCESSORS_SESSION_PREFIX": prefix, "LIVERL_PROCESSORS_GRACE_S": "2",
           "LIVERL_PROCESSORS_SWEEP_INTERVAL_S": "1"}  # fmt: skip
    for var in ("LIVERL_PROCESSORS_WEB_ENABLED", "LIVERL_PROCESSORS_WEB_PORT"):
        env.pop(var, None)
    res = CliRunner().invoke(cli, ["topics", "apply", "--namespace", ns], env=env)
    assert res.exit_code == 0, res.output
    procs: dict[str, subprocess.Popen] = {}  # type: ignore[type-arg]
    logs = {side: tmp_path / f"{side}.log" for side in ("live", "ns")}
    try:
        start_group_at(kafka_settings, app_id, input_ends(kafka_settings))
        producer = EventProducer(kafka_settings, client_id="nsw-test")
        for sid, topic in ((live_sid, names.INTERACTIONS),
                           (ns_sid, names.resolve(names.INTERACTIONS, ns))):  # fmt: skip
            for inter in group_session(sid, "", "Thanks, that works"):
                producer.send(topic, dataclasses.replace(inter, group_id=None))
        producer.flush()
        commands = {
            "live": ["workers", "--app-id", app_id, "--web", "-l", "info"],
            "ns": ["workers", "--namespace", ns, "--app-id", app_id, "--judge", "rules"],
        }
        for side, args in commands.items():
            with open(logs[side], "ab") as log:
                procs[side] = subprocess.Popen(
                    [sys.executable, "-m", "pipeline.cli", *args],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        topics = {"live": names.REWARDS, "ns": names.resolve(names.REWARDS, ns)}
        sids = {"live": live_sid, "ns": ns_sid}
        got: dict[str, dict] = {"live": {}, "ns": {}}  # type: ignore[type-arg]
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and any(len(g) < 2 for g in got.values()):
            assert all(p.poll() is None for p in procs.values()), {
                side: logs[side].read_text()[-3000:] for side in procs
            }
            for side in got:
                got[side] = rewards_of(kafka_settings, topics[side], {sids[side].encode()})
            time.sleep(1.0)
        text = {side: logs[side].read_text() for side in logs}
        assert {side: sorted(t for _, t in g) for side, g in got.items()} == {
            "live": [0, 1],
            "ns": [0, 1],
        }, text
        assert all(p.poll() is None for p in procs.values()), text
        # "Thanks, that works" is +1 to either judge (turn 0); the session end is 0 (turn 1)
        for side, sid in sids.items():
            assert (got[side][(sid, 0)].prm, got[side][(sid, 1)].prm) == (1.0, 0.0), side
        found = re.search(r"web server \(/metrics\) on http://127\.0\.0\.1:(\d+)", text["live"])
        assert found, text["live"][-3000:]
        assert "web server" not in text["ns"] and "Traceback" not in text["ns"] + text["live"]
        body = httpx.get(f"http://127.0.0.1:{found[1]}/metrics", timeout=10).text
        assert "liverl_workers_dead_lettered_total" in body, body
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        drop_worker_state(kafka_settings, app_id)
        drop(env, ns)
