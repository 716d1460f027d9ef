"""``liverl workers --processes N``: N worker processes on one machine, kept running.

One Faust worker is one Python process, so it uses one core however many partitions it
holds. N children with the same app id join one consumer group and Kafka spreads the
partitions over them. The supervisor here only starts, watches and stops them:

* each child runs in its own session, so a terminal's Ctrl-C reaches only the supervisor,
  which forwards SIGINT/SIGTERM to every child exactly once and waits for them (bounded:
  a child exits within ``LIVERL_PROCESSORS_SHUTDOWN_S`` of the signal, then SIGKILL);
* a child that exits while nobody asked it to is restarted after a short, growing backoff,
  so its partitions never stay unprocessed; one that keeps dying (``max_deaths`` times within
  ``window_s``) stops them all with a non-zero exit instead of crash-looping silently;
* every line a child writes reaches the supervisor's stderr prefixed with ``[worker i]``;
* children get SIGTERM from the kernel when the supervisor itself dies (Linux), so a
  killed supervisor leaves no orphan consuming partitions.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from .worker import SHUTDOWN_S

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` setting ``PR_SET_PDEATHSIG`` (Linux), resolved here in the parent: the
    forked child only calls it, importing nothing (the pump threads could hold the import
    lock at fork time)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


def child_argvs(
    options: Sequence[str],
    processes: int,
    web_port: int | None,
    *,
    prefix: Sequence[str] = (),
    python: str = sys.executable,
) -> list[list[str]]:
    """The command lines of the ``processes`` children: ``liverl [prefix] workers [options]``,
    ``options`` without ``--processes``, ``--web-port`` or ``--worker-index``; child ``i`` is
    worker ``i`` (its transactional id: a restarted child fences its killed predecessor) and
    serves its web server on ``web_port + i``, each on a free port of its own for 0
    (``None``: the server is off)."""
    base = [python, "-m", "pipeline.cli", *prefix, "workers", *options]
    return [
        [*base, "--worker-index", str(i)]
        + ([] if web_port is None else ["--web-port", str(web_port and web_port + i)])
        for i in range(processes)
    ]


@dataclass
class _Child:
    index: int
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    pump: threading.Thread | None = None
    deaths: deque[float] = field(default_factory=deque)
    restart_at: float | None = None


class GaveUp(RuntimeError):
    """A child kept dying: the supervisor stopped all of them."""


class Supervisor:
    """Runs ``argvs`` as child processes until a stop signal, restarting any that dies."""

    def __init__(
        self,
        argvs: Sequence[Sequence[str]],
        *,
        env: Mapping[str, str] | None = None,
        out: IO[bytes] | None = None,
        max_deaths: int = 5,
        window_s: float = 60.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        stop_grace_s: float = SHUTDOWN_S + 5.0,
        poll_s: float = 0.2,
    ) -> None:
        self.children = [_Child(i, list(a)) for i, a in enumerate(argvs)]
        self.env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.out = out if out is not None else sys.stderr.buffer
        self.max_deaths, self.window_s = max_deaths, window_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.stop_grace_s, self.poll_s = stop_grace_s, poll_s
        self._lock = threading.Lock()
        self._signals: list[int] = []
        self._preexec = _parent_death_signal()

    # ---- output ---------------------------------------------------------------------------

    def say(self, text: str) -> None:
        self._write(f"[workers] {text}\n".encode())

    def _write(self, data: bytes) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self.out.write(data)
            self.out.flush()

    def _pump(self, index: int, stream: IO[bytes]) -> None:
        prefix = f"[worker {index}] ".encode()
        for line in iter(stream.readline, b""):
            self._write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
        stream.close()

    # ---- children -------------------------------------------------------------------------

    def _start(self, child: _Child) -> None:
        child.restart_at = None
        try:
            child.proc = subprocess.Popen(
                child.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=self._preexec,  # noqa: PLW1509 - it only calls prctl, see above
            )
        except OSError as exc:  # not runnable: counts as a death, so it ends in GaveUp
            self.say(f"worker {child.index} could not start: {exc}")
            child.proc = None
            self._died(child, time.monotonic())
            return
        assert child.proc.stdout is not None
        child.pump = threading.Thread(
            target=self._pump, args=(child.index, child.proc.stdout), daemon=True
        )
        child.pump.start()

    def _died(self, child: _Child, now: float) -> None:
        """Note a death; schedule the restart or raise :class:`GaveUp`."""
        child.deaths.append(now)
        while child.deaths and child.deaths[0] < now - self.window_s:
            child.deaths.popleft()
        if len(child.deaths) >= self.max_deaths:
            raise GaveUp(
                f"worker {child.index} exited {len(child.deaths)} times within "
                f"{self.window_s:g} s; giving up (its last lines are above)"
            )
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (len(child.deaths) - 1))
        child.restart_at = now + delay

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop as if ``signum`` had arrived (from another thread: embedding, tests)."""
        self._signals.append(signum)

    def _forward(self, signum: int) -> None:
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signum)

    def _stop_all(self, signum: int) -> None:
        """Signal every live child and wait for all, SIGKILL past ``stop_grace_s``."""
        self._forward(signum)
        deadline = time.monotonic() + self.stop_grace_s
        forwarded = len(self._signals)
        for child in self.children:
            if child.proc is None:
                continue
            while child.proc.poll() is None and time.monotonic() < deadline:
                if len(self._signals) > forwarded:  # a second Ctrl-C: pass it on too
                    self._forward(self._signals[-1])
                    forwarded = len(self._signals)
                time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))
            if child.proc.poll() is None:
                self.say(f"worker {child.index} did not stop in {self.stop_grace_s:g} s: killed")
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                child.proc.wait()
        for child in self.children:
            if child.pump is not None:
                child.pump.join(timeout=2)

    def run(self) -> int:
        """Supervise until SIGINT/SIGTERM (then 0) or a child keeps dying (then 1). Must run
        in the main thread (it installs the signal handlers, and restores them after)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            self.say(f"starting {len(self.children)} worker processes")
            for child in self.children:
                self._start(child)
            while not self._signals:
                now = time.monotonic()
                for child in self.children:
                    if child.restart_at is not None:
                        if now >= child.restart_at:
                            self.say(f"restarting worker {child.index}")
                            self._start(child)
                        continue
                    assert child.proc is not None
                    code = child.proc.poll()
                    if code is None:
                        continue
                    child.proc = None
                    self.say(f"worker {child.index} exited unexpectedly (code {code})")
                    self._died(child, now)
                time.sleep(self.poll_s)
            self.say(f"stopping {len(self.children)} worker processes")
            self._stop_all(self._signals[0])
            return 0
        except GaveUp as exc:
            self.say(f"error: {exc}")
            self._stop_all(signal.SIGTERM)
            return 1
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
