"""The Faust worker process, with a stop that is bounded whatever Kafka does."""

from __future__ import annotations

import logging
import os
import threading

import faust

SHUTDOWN_S = float(os.environ.get("LIVERL_PROCESSORS_SHUTDOWN_S", "8"))
log = logging.getLogger(__name__)


def log_thread_exception(args: threading.ExceptHookArgs) -> None:
    """A thread's uncaught exception as one log record with its whole traceback. The worker
    redirects stderr to a logger one ``write()`` at a time (mode's FileLogProxy), and Python's
    own hook writes a traceback token by token: a fetcher thread cancelled at shutdown came
    out as ~100 WARNING lines of ``^`` and fragments (issue 25)."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    value = args.exc_value  # carries its own __traceback__
    log.warning(
        "exception in thread %s: %s",
        name,
        args.exc_type.__name__,
        exc_info=value if value is not None else False,
    )


class BoundedShutdownWorker(faust.Worker):
    """aiokafka's fetcher keeps retrying a broker that went away inside Faust's shutdown
    (60-80 s were seen); after ``SHUTDOWN_S`` seconds from SIGTERM/SIGINT the process exits
    anyway. Offsets and changelogs are committed as Faust goes, so a forced exit loses
    nothing a crash would not: the next start recovers from the changelogs."""

    def _arm(self) -> None:
        timer = threading.Timer(SHUTDOWN_S, lambda: os._exit(0))
        timer.daemon = True
        timer.start()

    def on_setup_root_logger(self, logger: logging.Logger, level: int) -> None:
        super().on_setup_root_logger(logger, level)
        threading.excepthook = log_thread_exception  # stderr is about to become a logger

    def _on_sigint(self) -> None:
        self._arm()
        super()._on_sigint()

    def _on_sigterm(self) -> None:
        self._arm()
        super()._on_sigterm()
