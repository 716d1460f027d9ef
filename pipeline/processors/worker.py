"""The Faust worker process, with a stop that is bounded whatever Kafka does."""

from __future__ import annotations

import os
import threading

import faust

SHUTDOWN_S = float(os.environ.get("LIVERL_PROCESSORS_SHUTDOWN_S", "8"))


class BoundedShutdownWorker(faust.Worker):
    """aiokafka's fetcher keeps retrying a broker that went away inside Faust's shutdown
    (60-80 s were seen); after ``SHUTDOWN_S`` seconds from SIGTERM/SIGINT the process exits
    anyway. Offsets and changelogs are committed as Faust goes, so a forced exit loses
    nothing a crash would not: the next start recovers from the changelogs."""

    def _arm(self) -> None:
        timer = threading.Timer(SHUTDOWN_S, lambda: os._exit(0))
        timer.daemon = True
        timer.start()

    def _on_sigint(self) -> None:
        self._arm()
        super()._on_sigint()

    def _on_sigterm(self) -> None:
        self._arm()
        super()._on_sigterm()
