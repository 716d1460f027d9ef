"""The loop the demo talks to: ``liverl up`` as a child process, tuned for a short session.

The demo runs the very stack a user runs (``liverl up``: broker, topics, Faust workers,
trainer, gateway) with its own policy id, so its LoRA versions start from the base model
and never touch another policy's weights. The trainer's cadence is set for a live demo
(small batches, a version after every step) through ``LIVERL_TRAINER_*`` variables, which
``up`` hands to its children unchanged.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pipeline.demo.errors import LoopError
from pipeline.stack import free_port


@dataclass
class LoopConfig:
    policy: str
    state_dir: Path  # the loop's state dir (its broker, logs, weights and lake)
    method: str = "opd"
    model: str | None = None  # None: the default store model
    port: int | None = None  # None: a free port
    batch_samples: int = 6
    batch_wait_s: float = 4.0
    lr: float | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 600.0
    without: tuple[str, ...] = ()  # components left out (``up --without``)
    gateways: int = 1  # gateway replicas on one port (``up --gateways``)
    extra_args: tuple[str, ...] = ()  # more ``liverl up`` options (e.g. --metrics-port)


@dataclass
class Loop:
    url: str  # gateway base URL, .../v1
    policy: str
    logs: Path
    proc: subprocess.Popen[bytes] | None


def _env(cfg: LoopConfig, state_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "LIVERL_STATE_DIR": str(state_dir),
            "LIVERL_TRAINER_BATCH_MAX_SAMPLES": str(cfg.batch_samples),
            "LIVERL_TRAINER_BATCH_MAX_WAIT_S": str(cfg.batch_wait_s),
            # One step per round: the users wait for it (--pace), so no early partial batches.
            "LIVERL_TRAINER_BATCH_IDLE_S": "0",
            "LIVERL_TRAINER_PUBLISH_MAX_OVERHEAD": "1.0",  # a version after every step
            # The demo (and bench/learning.py, which runs this loop) measures learning, not
            # rollout: every user must meet each promoted version at once, not 10 % of them
            # while a canary waits for outcomes (cfg.extra_env may still set a share).
            "LIVERL_TRAINER_CANARY_SHARE": "0",
        }
    )
    if cfg.lr is not None:
        env["LIVERL_TRAINER_LR"] = str(cfg.lr)
    env.update(cfg.extra_env)
    return env


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_ready(
    url: str,
    proc: subprocess.Popen[bytes],
    trainer_log: Path | None,
    offset: int,
    policy: str,
    timeout_s: float,
    up_log: Path,
) -> None:
    """Gateway answers /healthz and (unless ``trainer_log`` is None: no trainer) the trainer
    printed ``trainer ready`` for our policy."""
    deadline = time.monotonic() + timeout_s
    healthy = False
    trained = trainer_log is None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LoopError(f"`liverl up` exited with {proc.returncode}:\n{_tail(up_log)}")
        if not healthy:
            with contextlib.suppress(httpx.HTTPError):
                healthy = httpx.get(url.removesuffix("/v1") + "/healthz", timeout=2).is_success
        if not trained and trainer_log is not None and trainer_log.exists():
            with open(trainer_log, "rb") as fh:
                fh.seek(offset)
                trained = f"trainer ready: policy {policy}".encode() in fh.read()
        if healthy and trained:
            return
        time.sleep(0.5)
    raise LoopError(f"the loop was not ready after {timeout_s:.0f} s:\n{_tail(up_log)}")


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def running_loop(cfg: LoopConfig) -> Iterator[Loop]:
    """Start ``liverl up`` for ``cfg.policy``, wait until it serves and trains, stop it after."""
    state_dir = Path(cfg.state_dir).resolve()
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    trainer_log = logs / "trainer.log"
    offset = trainer_log.stat().st_size if trainer_log.exists() else 0
    port = cfg.port or free_port()
    args = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "up",
        "--port",
        str(port),
        "--policy",
        cfg.policy,
        "--method",
        cfg.method,
    ]
    if cfg.model:
        args += ["--model", cfg.model]
    for name in cfg.without:
        args += ["--without", name]
    if cfg.gateways != 1:
        args += ["--gateways", str(cfg.gateways)]
    args += cfg.extra_args
    up_log = logs / f"demo-up-{cfg.policy}.log"
    with open(up_log, "wb") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_env(cfg, state_dir),
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/v1"
    # `up` runs in its own session, so a SIGTERM to this process would leave it serving, and
    # later stopping the broker under the next run: turn SIGTERM into an exit that cleans up.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        _wait_ready(
            url,
            proc,
            None if "trainer" in cfg.without else trainer_log,
            offset,
            cfg.policy,
            cfg.start_timeout_s,
            up_log,
        )
        yield Loop(url=url, policy=cfg.policy, logs=logs, proc=proc)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # `up` stops its children in order
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
