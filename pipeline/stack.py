"""Run liverl's components as child processes on one machine (``liverl up``).

Each component is the same ``liverl`` command a user (or docker compose) would run, so the
embedded default and production share entry points. Ctrl-C or SIGTERM stops them in
reverse order: SIGTERM, a grace period, then SIGKILL. Children run in their own sessions (a
terminal's Ctrl-C reaches only ``up``, which stops them in order) and get SIGTERM from the
kernel if ``up`` itself dies without stopping them (SIGKILL, OOM): no orphaned trainer keeps
a model in memory.

A component that exits on its own is started again (:class:`RestartPolicy`, as Compose's
``restart: unless-stopped`` would): a watcher or the trainer dying on a transient error must
not take the gateway, and every user's requests, down with it. Two exits still stop
everything: one right after ``up`` started it (a configuration error, reported at once, not
retried), and one restart too many within a window (a crash loop).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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


def canary_component(policy: str) -> Component:
    """``liverl versions canary``: rolls out or withdraws canary versions by their live
    outcomes and watches the serving version for a drop (settings: ``[canary]``). It keeps
    no state: a restart folds the weights and samples topics again and sends no decision
    twice."""
    return Component("canary", ["versions", "canary", "--policy", policy])


# ``up --metrics-port P``: who serves Prometheus metrics on which port above P. A fixed layout
# (not the next free port), so a scrape config stays right across restarts and --without.
METRICS_LAYOUT = {"trainer": 0, "canary": 1, "judges": 2}


def with_metrics(components: list[Component], base: int | None) -> dict[str, int]:
    """Give each component of :data:`METRICS_LAYOUT` in ``components`` its ``--metrics-port``
    (in place); returns name -> port ({} when ``base`` is None)."""
    if base is None:
        return {}
    ports: dict[str, int] = {}
    for i, c in enumerate(components):
        if c.name in METRICS_LAYOUT:
            ports[c.name] = base + METRICS_LAYOUT[c.name]
            components[i] = Component(c.name, [*c.args, "--metrics-port", str(ports[c.name])])
    return ports


def gateway_components(
    count: int, host: str, port: int, policy: str, model_args: list[str]
) -> list[Component]:
    """``liverl serve`` once, or ``count`` replicas sharing ``host:port`` (SO_REUSEPORT: the
    kernel spreads connections over them). Each replica has its own id, hence its own spool
    dir and Kafka client id; none needs sticky sessions (see ``pipeline/serving/sessions.py``)."""
    args = [
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--policy-id",
        policy,
        "--served-model-name",
        policy,
        *model_args,
    ]
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
    started_at: float = field(default_factory=time.monotonic)
    restarts: list[float] = field(default_factory=list)  # when it was started again
    restart_at: float | None = None  # exited: when it will be started again


@dataclass(frozen=True)
class RestartPolicy:
    """What :func:`supervise` does when a component exits on its own. It is started again
    after ``backoff_s`` (doubling with each restart in the window, at most ``max_backoff_s``)
    unless it exited within ``startup_s`` of its first start (a configuration error: a retry
    would fail the same way) or it was started again ``max_restarts`` times within
    ``window_s`` already (a crash loop): then supervise returns it and everything stops."""

    startup_s: float = 15.0
    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0

    def delay(self, item: Running, now: float) -> float | None:
        """Seconds until ``item`` (just exited) starts again; None: stop everything."""
        if not item.restarts and now - item.started_at < self.startup_s:
            return None
        recent = [t for t in item.restarts if now - t < self.window_s]
        if len(recent) >= self.max_restarts:
            return None
        return min(self.max_backoff_s, self.backoff_s * 2 ** len(recent))


def _die_with_parent() -> None:
    """Linux ``PR_SET_PDEATHSIG``: SIGTERM this child when its parent exits."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def command(comp: Component) -> list[str]:
    """The component's command line: the ``liverl`` command of its ``args``."""
    return [sys.executable, "-m", "pipeline.cli", *comp.args]


def _spawn(comp: Component, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:  # appended: a restarted component's log goes on
        return subprocess.Popen(
            command(comp),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            env=os.environ.copy(),
        )


def start(state_dir: Path, components: list[Component]) -> list[Running]:
    logs = Path(state_dir).resolve() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    running: list[Running] = []
    for comp in components:
        log = logs / f"{comp.name}.log"
        running.append(Running(comp, _spawn(comp, log), log))
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


# Called when a component exited on its own and will start again after ``delay`` seconds.
OnRestart = Callable[[Running, float], None]


def supervise(
    running: list[Running],
    poll_s: float = 0.5,
    policy: RestartPolicy | None = None,
    on_restart: OnRestart | None = None,
) -> Running | None:
    """Block until Ctrl-C/SIGTERM (returns None) or a component exits in a way ``policy``
    does not restart (returns it); any other exit is reported to ``on_restart`` and the
    component starts again after its delay, in the same log."""
    policy = policy or RestartPolicy()
    stopping = False

    def _stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    # SIGINT explicitly too: a shell that starts us in the background ignores it by default.
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stopping:
            now = time.monotonic()
            for item in running:
                if item.restart_at is not None:
                    if now >= item.restart_at:
                        item.restart_at = None
                        item.restarts.append(now)
                        item.proc = _spawn(item.component, item.log)
                    continue
                if item.proc.poll() is None:
                    continue
                delay = policy.delay(item, now)
                if delay is None:
                    return item
                with contextlib.suppress(ProcessLookupError):  # what it left running
                    os.killpg(item.proc.pid, signal.SIGTERM)
                item.restart_at = now + delay
                if on_restart is not None:
                    on_restart(item, delay)
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


def port_problem(host: str, port: int) -> str | None:
    """Why the gateway could not listen on ``host:port`` (None: it can), asked by binding it
    once before anything starts."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve --host {host}: {exc.strerror or exc}"
    family, _type, _proto, _name, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is
        try:  # no obstacle, a listener is
            sock.bind(addr)
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a local component started next (the
    demo's gateway and processors web server, tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
