"""Run liverl's components as child processes on one machine (``liverl up``).

Each component is the same ``liverl`` command a user (or docker compose) would run, so the
embedded default and production share entry points. Ctrl-C or SIGTERM stops them in
reverse order: SIGTERM, a grace period, then SIGKILL. Children run in their own sessions (a
terminal's Ctrl-C reaches only ``up``, which stops them in order) and get SIGTERM from the
kernel if ``up`` itself dies without stopping them (SIGKILL, OOM): no orphaned trainer keeps
a model in memory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Component:
    name: str
    args: list[str]


def archive_component() -> Component:
    """``liverl archive --follow``: every topic into ``<state_dir>/lake/events/``. On SIGTERM
    it commits what it has read and exits; whatever the other components send while they
    stop is copied on the next start (progress lives in the Delta tables)."""
    return Component("archive", ["archive", "--follow"])


def gateway_components(
    count: int, host: str, port: int, policy: str, model_args: list[str]
) -> list[Component]:
    """``liverl serve`` once, or ``count`` replicas sharing ``host:port`` (SO_REUSEPORT: the
    kernel spreads connections over them). Each replica has its own id, hence its own spool
    dir and Kafka client id; none needs sticky sessions (see ``pipeline/serving/sessions.py``)."""
    args = ["serve", "--host", host, "--port", str(port), "--policy-id", policy,
            "--served-model-name", policy, *model_args]
    if count == 1:
        return [Component("gateway", args)]
    return [
        Component(f"gateway-{i}", [*args, "--replica-id", f"gateway-{i}", "--reuse-port"])
        for i in range(count)
    ]


@dataclass
class Running:
    component: Component
    proc: subprocess.Popen[bytes]
    log: Path


def _die_with_parent() -> None:
    """Linux ``PR_SET_PDEATHSIG``: SIGTERM this child when its parent exits."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def start(state_dir: Path, components: list[Component]) -> list[Running]:
    logs = Path(state_dir).resolve() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    running: list[Running] = []
    for comp in components:
        log = logs / f"{comp.name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", *comp.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                env=os.environ.copy(),
            )
        running.append(Running(comp, proc, log))
    return running


def stop(running: list[Running], grace_s: float = 20.0) -> None:
    for item in reversed(running):
        if item.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(item.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for item in reversed(running):
        remaining = max(0.1, deadline - time.monotonic())
        try:
            item.proc.wait(remaining)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(item.proc.pid, signal.SIGKILL)
            item.proc.wait()


def supervise(running: list[Running], poll_s: float = 0.5) -> Running | None:
    """Block until Ctrl-C/SIGTERM (returns None) or a component dies (returns it)."""
    stopping = False

    def _stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    # SIGINT explicitly too: a shell that starts us in the background ignores it by default.
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stopping:
            for item in running:
                if item.proc.poll() is not None:
                    return item
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return None


def tail(path: Path, lines: int = 20) -> str:
    if not path.exists():
        return "(no output)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a local component started next (the
    demo's gateway and processors web server, tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
